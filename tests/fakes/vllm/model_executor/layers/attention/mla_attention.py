"""vllm.model_executor.layers.attention.mla_attention: the MLA common backend, metadata,
builder and impl that a vLLM MLA backend subclasses (0.33.0's names and signatures).

The fake's builder serves decode-only steps (what a decode backend's hooks see). Its
impl's `forward_decode_step` stands in for MLACommonImpl.forward on such a step (vllm-project/vllm
mla_attention.py at 0014ca6b): it writes the new tokens' latent KV into the cache as
concat_and_cache_mla, calls `forward_mqa` as MLAAttention does, checks what comes back and
returns the latent out of this rank's heads (the LSE merge and the up-projection are vLLM's)."""

import enum
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, MLAAttentionImpl

from tests.fakes import check_overrides


class QueryLenSupport(enum.Enum):
    SINGLE_ONLY = "single_only"
    UNIFORM = "uniform"
    VARLEN = "varlen"


class MLACommonBackend(AttentionBackend):
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        return "TRITON_MLA"

    @staticmethod
    def get_builder_cls():
        return MLACommonMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]

    @classmethod
    def is_mla(cls) -> bool:
        return True


@dataclass
class MLACommonDecodeMetadata:
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    dcp_tot_seq_lens: torch.Tensor | None


D = TypeVar("D", bound=MLACommonDecodeMetadata)


@dataclass
class MLACommonMetadata(Generic[D]):
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode: D | None = None
    prefill: object | None = None


M = TypeVar("M", bound=MLACommonMetadata)


class MLACommonMetadataBuilder(AttentionMetadataBuilder[M]):
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.SINGLE_ONLY
    reorder_batch_threshold: int = 1

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_overrides(cls, MLACommonMetadataBuilder, ("__init__", "_build_decode", "build",
                                                        "build_for_cudagraph_capture"), init=_builder_init)

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device,
                 metadata_cls=None, supports_dcp_with_varlen: bool = False):
        self.metadata_cls = metadata_cls if metadata_cls is not None else MLACommonMetadata
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.compilation_config = vllm_config.compilation_config
        self.device = device
        self.dcp_world_size = vllm_config.parallel_config.decode_context_parallel_size
        spec = vllm_config.speculative_config
        if spec is not None and spec.num_speculative_tokens and self.query_len_support != QueryLenSupport.SINGLE_ONLY:
            self.reorder_batch_threshold = 1 + spec.num_speculative_tokens

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                      max_seq_len: int, query_start_loc_cpu: torch.Tensor,
                      query_start_loc_device: torch.Tensor, num_decode_tokens: int,
                      dcp_tot_seq_lens_device: torch.Tensor | None) -> MLACommonDecodeMetadata:
        return MLACommonDecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                       dcp_tot_seq_lens=dcp_tot_seq_lens_device)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        assert common_attn_metadata.max_query_len <= self.reorder_batch_threshold  # decode only
        return self.build(0, common_attn_metadata)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        """The step's metadata as vLLM's build makes it: the decodes (query_len <=
        reorder_batch_threshold, at the batch's front) through `_build_decode`; a stand-in for
        the prefills after them (vLLM's prefill path is not faked)."""
        m = common_attn_metadata
        lens = (m.query_start_loc_cpu[1:] - m.query_start_loc_cpu[:-1]).tolist()
        n = next((i for i, q in enumerate(lens) if q > self.reorder_batch_threshold), len(lens))
        if any(q <= self.reorder_batch_threshold for q in lens[n:]):
            raise AssertionError("the batch's decodes are not all at its front (vLLM reorders them there)")
        # a request of query length 0 is a full CUDA graph's padding, counted as a decode
        # (vllm/v1/attention/backends/utils.py, split_decodes_and_prefills)
        if self.query_len_support != QueryLenSupport.VARLEN and len({q for q in lens[:n] if q}) > 1:
            raise AssertionError("a builder without VARLEN support got decodes of different query lengths")
        tokens = int(m.query_start_loc_cpu[n])
        decode = self._build_decode(
            block_table_tensor=m.block_table_tensor[:n], seq_lens_device=m.seq_lens[:n],
            max_seq_len=m.max_seq_len, query_start_loc_cpu=m.query_start_loc_cpu[: n + 1],
            query_start_loc_device=m.query_start_loc[: n + 1], num_decode_tokens=tokens,
            dcp_tot_seq_lens_device=None) if n else None
        return self.metadata_cls(num_reqs=m.num_reqs, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len,
                                 num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc,
                                 slot_mapping=m.slot_mapping, num_decodes=n, num_decode_tokens=tokens,
                                 num_prefills=m.num_reqs - n, decode=decode,
                                 prefill=object() if n < m.num_reqs else None)


def _builder_init(self, kv_cache_spec, layer_names, vllm_config, device):
    """What a backend's builder __init__ takes: vLLM constructs it with these four."""


class MLACommonImpl(MLAAttentionImpl[M]):
    can_return_lse_for_decode: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_overrides(cls, MLACommonImpl, ("__init__", "forward_mqa"), init=_impl_init)

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes, sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                 kv_sharing_target_layer_name, q_lora_rank=None, kv_lora_rank: int = 512,
                 qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64, qk_head_dim: int = 192,
                 v_head_dim: int = 128, kv_b_proj=None, indexer=None, q_pad_num_heads=None):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim = kv_cache_dtype, kv_lora_rank, qk_rope_head_dim
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.dcp_world_size = 1  # vLLM reads it from the DCP group; a test may set it
        self.supports_quant_query_input = True  # fp8 caches get fp8 q unless the impl says no

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata, layer):
        raise NotImplementedError

    def forward_decode_step(self, layer, q: torch.Tensor, k_c_normed: torch.Tensor, k_pe: torch.Tensor,
                            kv_cache: torch.Tensor, attn_metadata):
        """A decode step's attention for one layer, as MLACommonImpl.forward runs it (see the module)."""
        latent = torch.cat([k_c_normed, k_pe], dim=-1)  # (tokens, 576)
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        slots = attn_metadata.slot_mapping.long()
        if self.kv_cache_dtype.startswith("fp8"):
            assert kv_cache.dtype == torch.uint8, "vLLM keeps an fp8 MLA cache as uint8"
            flat[slots] = (latent.float() / layer._k_scale.float()).to(torch.float8_e4m3fn).view(torch.uint8)
            kv_cache = kv_cache.view(torch.float8_e4m3fn)  # MLAAttention's view before forward_mqa
        else:
            flat[slots] = latent.to(kv_cache.dtype)
        if self.supports_quant_query_input and self.kv_cache_dtype.startswith("fp8"):
            mqa_q = (q.float() / layer._q_scale.float()).to(torch.float8_e4m3fn)  # MLAAttention's q quant
        else:
            mqa_q = (q[..., : self.kv_lora_rank], q[..., self.kv_lora_rank:])
        dcp = self.dcp_world_size
        if dcp > 1:  # q's heads gathered across the DCP group (here every rank's q is this one's)
            mqa_q = torch.cat([torch.cat(mqa_q, dim=-1) if type(mqa_q) is tuple else mqa_q] * dcp, dim=1)
        result = self.forward_mqa(mqa_q, kv_cache, attn_metadata, layer)
        assert isinstance(result, tuple) and len(result) == 2, "forward_mqa returns (out, lse | None)"
        out, lse = result
        tokens = attn_metadata.num_decode_tokens
        assert tuple(out.shape) == (tokens, self.num_heads * dcp, self.kv_lora_rank), tuple(out.shape)
        if dcp > 1 and self.can_return_lse_for_decode:
            assert lse is not None and tuple(lse.shape) == (tokens, self.num_heads * dcp) and lse.dtype == torch.float32
        if dcp > 1:  # the LSE merge over the group's shares, then this rank's heads (one share here)
            out, lse = out[:, : self.num_heads], lse[:, : self.num_heads]
        return out, lse


def _impl_init(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
               kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name):
    """What an MLA impl's __init__ takes before **mla_args (vLLM passes them by keyword)."""
