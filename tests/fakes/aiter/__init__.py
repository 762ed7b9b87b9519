"""A CPU fake of AITER (package amd-aiter) for mla-tune's tests.

Install it with tests/fakes/vendor_fakes.py (in-process, or PYTHONPATH for a worker). It
imitates one build, chosen by MLA_TUNE_FAKE_AITER_VERSION: 0.1.11 (the default, tagged during
the amd-mixed-mla contest), f3be04a12 or 0.1.20.post1 (_state.py says what each has). Same signatures, dtype pairs (fp8 per arch), shapes, int32
indices, dense buffers, scale shapes, split caps and metadata buffer sizes as that build; it
raises where the real one would raise or silently misbehave, and, stricter than AITER, it
refuses any argument past the first few tensors passed by position (_checks.keywords_past).
Its fp32 numerics are no evidence of AITER's accuracy.
"""

import aiter.ops.triton.gluon  # noqa: E402  (the package; its mla_gluon exists from 0.1.18)
from aiter import _state, dtypes  # noqa: F401
from aiter._version import __version__  # noqa: F401
from aiter.mla import mla_decode_fwd  # noqa: F401
from aiter.ops.attention import (  # noqa: F401
    get_mla_metadata_info_v1,
    get_mla_metadata_v1,
    mla_decode_stage1_asm_fwd,
    mla_reduce_v1,
)
from aiter.ops.quant import dynamic_per_tensor_quant, static_per_tensor_quant  # noqa: F401

if _state.new_api:  # what 0.1.20.post1 adds (the real package re-exports aiter.ops.attention)
    import aiter.ops.triton.gluon.mla_gluon  # noqa: F401
    from aiter.ops.attention import get_mla_decode_fwd_max_splits, mla_decode_fwd_opus_stage1  # noqa: F401

# mla_tune.backends.aiter_mla treats a module carrying this as runnable on the CPU.
MLA_TUNE_CPU_FAKE = True
