"""A CPU fake of flashinfer-python 0.6.18.post1's MLA wrapper, for mla-tune's tests.

Only `flashinfer.mla.BatchMLAPagedAttentionWrapper` exists: same constructor, `plan` and
`run` signatures as 0.6.18.post1 (flashinfer/mla/_core.py), the checks they make, what plan()
keeps (host indptrs, kv_indices by reference), and an answer computed on the CPU with
mla_tune.serving.inputs' fp32 reference.
"""

from flashinfer import mla  # noqa: F401

__version__ = "0.6.18.post1"
# mla_tune.backends.flashinfer_mla treats a module carrying this as runnable on the CPU.
MLA_TUNE_CPU_FAKE = True
