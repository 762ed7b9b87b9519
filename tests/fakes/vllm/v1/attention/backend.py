"""vllm.v1.attention.backend: the abstract backend, its enums and the per-step metadata."""

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from tests.fakes import check_overrides


class AttentionType:
    DECODER = "decoder"
    ENCODER = "encoder"


class AttentionCGSupport(enum.Enum):
    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class MultipleOf:
    def __init__(self, base: int):
        self.base = base


class AttentionBackend:
    accept_output_buffer: bool = False

    @staticmethod
    def get_name() -> str:
        raise NotImplementedError

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        raise NotImplementedError

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [MultipleOf(1)]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_overrides(cls, AttentionBackend, ("get_name", "get_impl_cls", "get_builder_cls",
                                                "get_kv_cache_shape", "get_supported_kernel_block_sizes",
                                                "supports_compute_capability"))


@dataclass
class CommonAttentionMetadata:
    """One step's batch as the model runner hands it to every builder."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    # (batch_size,) the lengths on the host: exact but for async speculative decoding's rows
    seq_lens_cpu_upper_bound: torch.Tensor | None = None


M = TypeVar("M")


class AttentionMetadataBuilder(Generic[M]):
    pass


class MLAAttentionImpl(Generic[M]):
    pass


class AttentionLayer:
    """What an impl reads of its layer: the KV scales (`_k_scale`, `_q_scale`)."""

    def __init__(self, k_scale: torch.Tensor | None = None):
        one = torch.ones((1,), dtype=torch.float32)
        self._k_scale = one if k_scale is None else k_scale
        self._q_scale = one
