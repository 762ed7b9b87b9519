# The AITER release this fake imitates (setuptools_scm writes aiter/_version.py in real builds).
__version__ = "0.1.11"
