"""A vLLM MLA attention backend that runs decode through mla-tune's DecodePlans.

Register it before the engine starts, then select the CUSTOM backend:

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CUSTOM, "mla_tune.integrations.vllm.MlaTuneMLABackend")
    # vllm serve deepseek-ai/DeepSeek-V3 ... --attention-backend CUSTOM

(`register()` here does the first line.) Written against vLLM 0.33.0's v1 MLA API, whose
common classes live in `vllm.model_executor.layers.attention.mla_attention` (read from
vllm-project/vllm: mla_attention.py at 0014ca6b, whose MLAAttention calls the impl's
`forward_mqa` (at 90b0a26e the hook was `_forward_decode`); v1/attention/backends/registry.py
at 0033bf03, v1/attention/backends/mla/flashmla.py at 01b1d340; `seq_lens_cpu_upper_bound`
from v1/attention/backend.py at 0014ca6b, read with getattr since older releases lack it).
The trio, as vLLM's FlashMLA backend is built:

- `MlaTuneMLABackend` (MLACommonBackend): names the builder and impl; bf16 or fp8 caches
  of (num_blocks, block_size, 576), the fp8 one stored as uint8 bytes with a per-layer
  `_k_scale`, which vLLM views as fp8 before `forward_mqa`.
- `MlaTuneMLAMetadataBuilder` (MLACommonMetadataBuilder): owns the EnginePlans (a graph
  plan for up to the largest CUDA-graph capture size when full graphs are on, an eager plan
  for up to max_num_seqs), made from the model's facts: heads per GPU, block size, cache
  dtype, the layers' softmax scale (their impls' `scale`, DeepSeek-V3's mscale**2/sqrt(192)),
  the LSE when decode context parallelism needs it (then the heads of the whole DCP group:
  vLLM gathers q's heads across it before `forward_mqa`), the speculative q_len. Its
  `_build_decode` (once per step, before the layers or their graph replay) updates the
  plan of the step's mode (a step of decodes only whose batch size vLLM captures: the graph
  plan; a step with prefills runs its attention outside any full graph) with vLLM's device
  block table, lengths and query_start_loc, and the q lengths from the host copy.
- `MlaTuneMLAImpl` (MLACommonImpl): prefill stays vLLM's; `forward_mqa` (once per layer)
  runs the step's plan on the cache and returns (out, lse or None). The LSE is natural-log
  (`lse_base_on_e`), (tokens, heads) float32.

vLLM hands `_build_decode` the lengths on the device, so the spec has no host lengths
(FlashInfer picks, which plan on the host, are not eligible). The builder's `build` keeps
the step's `CommonAttentionMetadata.seq_lens_cpu_upper_bound` (vLLM's host copy of the
lengths) for `_build_decode`: an eager step's lookup then estimates at its own lengths, or
with speculative decoding (the copy is then an upper bound by at most a row's draft tokens)
at their mean. With decode context parallelism (the layers see each rank's share) or where
vLLM gives no host copy, the eager pick is the batch bucket's graph pick, and without a
family the default variant. The table is `plans.serving_table()` ($MLA_TUNE_SERVING_TABLE, else
this GPU's).
Tested against a fake of these base classes (tests/fakes/vllm), not a real vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.utils import get_per_layer_parameters

from mla_tune.backends import capabilities, serving_backends
from mla_tune.core import CallSpec
from mla_tune.integrations.plans import EnginePlans, gpu_name, serving_table

CLASS_PATH = "mla_tune.integrations.vllm.MlaTuneMLABackend"


def register() -> None:
    """register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)


class MlaTuneMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "fp8", "fp8_e4m3"]

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [64, 16, 32, 128]  # 64: the committed serving table's; others run the untuned default

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_builder_cls() -> type[MlaTuneMLAMetadataBuilder]:
        return MlaTuneMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[MlaTuneMLAImpl]:
        return MlaTuneMLAImpl

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability.major >= 8  # the own Triton kernels; the table names the GPU


@dataclass
class MlaTuneDecodeMetadata(MLACommonDecodeMetadata):
    plans: EnginePlans | None = None


@dataclass
class MlaTuneMetadata(MLACommonMetadata[MlaTuneDecodeMetadata]):
    pass


def _kv_format(cache_dtype: str) -> str:
    if cache_dtype in ("auto", "bfloat16"):
        return "bf16"
    if cache_dtype in ("fp8", "fp8_e4m3"):
        # vLLM keeps an fp8 cache as uint8 bytes and views it as fp8 (current_platform's
        # fp8_dtype()) before forward_mqa: the plans take the fp8 dtype (cache_dtype "")
        return "fp8"
    raise ValueError(f"mla-tune serves bf16 and fp8 (e4m3) MLA caches, not kv_cache_dtype={cache_dtype!r}; "
                     "use --kv-cache-dtype auto or fp8")


class MlaTuneMLAMetadataBuilder(MLACommonMetadataBuilder[MlaTuneMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    reorder_batch_threshold: int = 1  # raised by vLLM to 1 + speculative tokens

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, MlaTuneMetadata)
        scales = {p.sm_scale for p in get_per_layer_parameters(vllm_config, layer_names, MlaTuneMLAImpl).values()}
        if len(scales) != 1:
            raise ValueError(f"mla-tune's plans take one softmax scale, but the layers {layer_names[:3]}... "
                             f"have {sorted(scales)}")
        kv_format = _kv_format(vllm_config.cache_config.cache_dtype)
        max_q_len = int(self.reorder_batch_threshold)
        longest = max(capabilities(name).max_q_len for name in serving_backends())
        if max_q_len > longest:
            raise ValueError(f"decode steps of up to {max_q_len} tokens per sequence (1 + the speculative "
                             f"tokens), but mla-tune's serving kernels take up to {longest}: use "
                             f"num_speculative_tokens {longest - 1} or fewer")
        # with decode context parallelism vLLM gathers q's heads across the DCP group before
        # forward_mqa (each rank attends all of them over its share of the cache)
        heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config) * self.dcp_world_size
        spec = CallSpec(kv_format, page_size=kv_cache_spec.block_size, heads=heads, max_q_len=max_q_len,
                        sm_scale=scales.pop(), return_lse=self.dcp_world_size > 1)
        compilation = vllm_config.compilation_config
        full_graphs = compilation.cudagraph_mode.has_full_cudagraphs()
        sizes = sorted(compilation.cudagraph_capture_sizes or []) if full_graphs else []
        # a captured step holds capture-size tokens: batch = tokens / q_len
        self.graph_batches = frozenset(s // max_q_len for s in sizes if s % max_q_len == 0)
        self.plans = EnginePlans(spec, vllm_config.scheduler_config.max_num_seqs,
                                 max(self.graph_batches, default=0),
                                 table=serving_table(gpu_name(device)), device=device)
        # vLLM's host copy of the lengths is the sequences' own only without decode context
        # parallelism (the layers then see each rank's share), and exact only without
        # speculative decoding (then an upper bound by at most the draft tokens of a row)
        self._own_lengths, self._exact_lengths = self.dcp_world_size == 1, max_q_len == 1
        self._kv_lens_host, self._decodes_only = None, True

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        m = common_attn_metadata
        # read by _build_decode, which vLLM calls from here: the host lengths, and whether the
        # step holds decodes only (a step with prefills is never in a full CUDA graph: this
        # builder supports graphs of uniform batches only, UNIFORM_BATCH)
        self._kv_lens_host = getattr(m, "seq_lens_cpu_upper_bound", None) if self._own_lengths else None
        self._decodes_only = m.max_query_len <= self.reorder_batch_threshold
        try:
            return super().build(common_prefix_len, m, fast_build)
        finally:
            self._kv_lens_host, self._decodes_only = None, True

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                      max_seq_len: int, query_start_loc_cpu: torch.Tensor,
                      query_start_loc_device: torch.Tensor, num_decode_tokens: int,
                      dcp_tot_seq_lens_device: torch.Tensor | None) -> MlaTuneDecodeMetadata:
        batch = query_start_loc_cpu.shape[0] - 1
        q_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).tolist()  # a host tensor
        graph, lens = self._decodes_only and batch in self.graph_batches, self._kv_lens_host
        # an eager step's lengths on the host (the decodes come first): its lookup estimates
        # for them where they are exact, else for their mean; a graph step's pick does not
        # depend on them
        kv_lens = mean = None
        if lens is not None and not graph and lens.shape[0] >= batch:
            if self._exact_lengths:
                kv_lens = lens[:batch].tolist()
            else:
                mean = float(lens[:batch].sum()) / batch
        self.plans.update(graph, query_start_loc_device, block_table=block_table_tensor,
                          seq_lens=seq_lens_device, q_lens_host=q_lens, kv_lens_host=kv_lens, mean_kv_len=mean)
        return MlaTuneDecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                     dcp_tot_seq_lens=dcp_tot_seq_lens_device, plans=self.plans)


class MlaTuneMLAImpl(MLACommonImpl[MlaTuneMetadata]):
    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True  # natural log, as FlashMLA's

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                         **mla_args)
        if any([alibi_slopes, sliding_window, logits_soft_cap]):
            raise NotImplementedError("mla-tune's MLA backend has no alibi_slopes, sliding_window or "
                                      "logits_soft_cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("mla-tune's MLA backend serves decoder self-attention only")
        self._fp8 = _kv_format(kv_cache_dtype) == "fp8"
        # q arrives in bf16: vLLM quantizes decode q to fp8 before forward_mqa when an impl
        # with an fp8 cache says it takes it; the plans quantize q themselves if their variant does
        self.supports_quant_query_input = False

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MlaTuneMetadata,
                    layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        decode = attn_metadata.decode
        if decode is None or decode.plans is None:
            raise ValueError("forward_mqa without the step's decode metadata from MlaTuneMLAMetadataBuilder")
        if type(q) is tuple:
            q = torch.cat(q, dim=-1)
        plans = decode.plans
        result = plans.run(q, kv_c_and_k_pe_cache, layer._k_scale if self._fp8 else None)
        if plans.spec.return_lse:
            return result
        return result, None
