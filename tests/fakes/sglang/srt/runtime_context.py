"""sglang.srt.runtime_context: the process's parallel layout (attention TP size)."""

from dataclasses import dataclass


@dataclass
class Parallel:
    attn_tp_size: int = 1
    attn_dcp_size: int = 1


_PARALLEL = Parallel()


def get_parallel() -> Parallel:
    return _PARALLEL
