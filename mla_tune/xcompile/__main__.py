"""`python -m mla_tune.xcompile`: the compile check's JSON, for `mla-tune compile --triton`."""

import sys

from mla_tune.xcompile.check import main

sys.exit(main())
