"""A CPU fake of sgl-flash-mla 1.0.0 (module flash_mla) for mla-tune's tests.

Dense decoding only, as the legacy kernels run it (use_legacy=True): the 1.0.0 signatures of
flash_mla_with_kvcache / get_mla_decoding_metadata / get_mla_metadata, their checks (64-token
pages, int32 tables, same q/KV dtype, fp8 descales, a schedule made for the same kind of
call and the same lengths), any s_q and h_q with the kernels' causal mask, and an answer
computed on the CPU with mla_tune.serving.inputs' fp32 reference.
"""

from flash_mla.flash_mla_interface import (  # noqa: F401
    calls,
    flash_mla_with_kvcache,
    get_mla_decoding_metadata,
    get_mla_metadata,
)

__version__ = "1.0.0"
# mla_tune.backends.flash_mla treats a module carrying this as runnable on the CPU.
MLA_TUNE_CPU_FAKE = True


def has_legacy() -> bool:
    return True
