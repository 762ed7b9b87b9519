# The AITER release this fake imitates (setuptools_scm writes aiter/_version.py in real
# builds): 0.1.11 unless MLA_TUNE_FAKE_AITER_VERSION picks 0.1.20.post1 (see _state.py).
import os

__version__ = os.environ.get("MLA_TUNE_FAKE_AITER_VERSION") or "0.1.11"
