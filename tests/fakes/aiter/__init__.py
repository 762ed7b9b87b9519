"""A CPU fake of AITER v0.1.11 (package amd-aiter) for mla-tune's tests.

Install it with tests/fakes/vendor_fakes.py (in-process, or PYTHONPATH for a worker). It
imitates one release, v0.1.11 (the one current during the amd-mixed-mla contest): the same
signatures, dtype pairs, shapes, int32 indices, scale shapes and metadata buffer sizes,
and it raises where the real one would raise or silently misbehave.
"""

from aiter import _state, dtypes  # noqa: F401
from aiter._version import __version__  # noqa: F401
from aiter.mla import mla_decode_fwd  # noqa: F401
from aiter.ops.attention import get_mla_metadata_info_v1, get_mla_metadata_v1  # noqa: F401
from aiter.ops.quant import dynamic_per_tensor_quant, static_per_tensor_quant  # noqa: F401

# mla_tune.backends.aiter_mla treats a module carrying this as runnable on the CPU.
MLA_TUNE_CPU_FAKE = True
