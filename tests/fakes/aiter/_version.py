# The AITER build this fake imitates (setuptools_scm writes aiter/_version.py in real
# builds): 0.1.11 unless MLA_TUNE_FAKE_AITER_VERSION picks another (see _state.py).
# "f3be04a12" names the contest runner's build by its commit: setuptools_scm's version
# for it (git describe: v0.1.10.post3-78-gf3be04a12a, inferred, not read off the runner).
import os

_ALIASES = {"f3be04a12": "0.1.10.post4.dev78+gf3be04a12a"}
__version__ = os.environ.get("MLA_TUNE_FAKE_AITER_VERSION") or "0.1.11"
__version__ = _ALIASES.get(__version__, __version__)
