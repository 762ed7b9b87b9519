"""sglang.srt.model_executor.forward_batch_info: the step's batch, as a backend reads it."""

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    IDLE = 4

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor  # (bs,) int64
    seq_lens: torch.Tensor  # (bs,) int64 on the device, the new token included
    out_cache_loc: torch.Tensor  # (tokens,) the new tokens' slots
    seq_lens_sum: int
    seq_lens_cpu: torch.Tensor | None = None
