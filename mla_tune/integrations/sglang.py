"""An SGLang MLA AttentionBackend that runs decode through mla-tune's DecodePlans.

Register it before the server starts and select it as the decode backend (prefill stays
another backend's):

    from mla_tune.integrations import sglang as mla_tune_sglang
    mla_tune_sglang.register()            # register_attention_backend("mla_tune")
    # python -m sglang.launch_server ... --decode-attention-backend mla_tune \\
    #     --prefill-attention-backend flashinfer

Written against SGLang 0.5.23's AttentionBackend (python/sglang/srt/layers/attention/
base_attn_backend.py with the out_graph / in_graph metadata contract, read from the stored
sgl-project/sglang source, with its flashmla_backend.py; attention_registry.py at
43681aaa). The hooks:

- `init_forward_metadata(forward_batch)`: an eager step. The block table is written on
  the device from `req_to_token` (the request-to-token map SGLang keeps: page 1 is its
  own slots, a larger page size takes every page_size-th slot // page_size), then the
  eager plan takes the step with the lengths on the host (`seq_lens_cpu`, which SGLang
  publishes for backends with `needs_cpu_seq_lens`, the default).
- `init_cuda_graph_state(max_bs, max_num_tokens)`: the graph plan for up to max_bs
  sequences and its fixed buffers (block table, lengths, qo_indptr).
- `init_forward_metadata_out_graph(forward_batch, in_capture=False)`: before a capture
  and before each replay, outside the graph: the same table written into the fixed
  buffers, and the graph plan updated (its pick depends on the batch bucket only).
- `init_forward_metadata_in_graph(forward_batch)`: nothing (out_graph did the step's work).
- `get_cuda_graph_seq_len_fill_value()`: 1 (a padded row's one token, in the page its
  request-to-token row names).
- `forward_decode(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs)`: once per
  layer: store the new tokens' latent KV (`set_kv_buffer`), run the step's plan on
  `get_key_buffer(layer.layer_id)` at `layer.scaling` (fixed per model: the plans' spec),
  return (tokens, heads * 512). An fp8 cache is read at scale 1, whatever `layer.k_scale`
  says: SGLang's `MLATokenToKVPool.set_kv_buffer` and `set_mla_kv_buffer` cast the latent
  to fp8 without a scale (they take none), and its FlashMLA backend passes `descale_k` 1
  (flashmla_backend.py, mem_cache/memory_pool.py in the stored sgl-project/sglang source).

`forward_extend` is refused: mla-tune serves decode only. The table is
`plans.serving_table()` ($MLA_TUNE_SERVING_TABLE, else this GPU's). Tested against a fake of
the base class (tests/fakes/sglang), not a real SGLang.
"""

from __future__ import annotations

import math

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from mla_tune.core import QK_DIM, V_DIM, CallSpec
from mla_tune.integrations.indices import req_to_block_table
from mla_tune.integrations.plans import EnginePlans, gpu_name, serving_table

NAME = "mla_tune"
FILL_VALUE = 1


def _attn_tp_size() -> int:
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # older layouts
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        return get_attention_tp_size()
    return get_parallel().attn_tp_size


def create_mla_tune_backend(runner):
    """The factory SGLang's registry calls with the model runner."""
    if not getattr(runner, "use_mla_backend", True):
        raise ValueError("the mla_tune attention backend serves MLA models (DeepSeek-V2/V3/R1) only")
    return MlaTuneAttnBackend(runner)


def register() -> None:
    """register_attention_backend(NAME)(create_mla_tune_backend)."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(NAME)(create_mla_tune_backend)


class MlaTuneAttnBackend(AttentionBackend):
    """See the module. table: a serving table (a path, a GPU name or a ServingTable); None
    takes `plans.serving_table()`."""

    needs_cpu_seq_lens = True  # the plans take the lengths on the host

    def __init__(self, model_runner, *, table=None, backend: str | None = None):
        super().__init__()
        config = model_runner.model_config
        self.device = torch.device(model_runner.device)
        self.heads = config.num_attention_heads // _attn_tp_size()
        self.scaling = float(config.scaling)
        self.page_size = int(model_runner.page_size)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        fp8 = model_runner.kv_cache_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        if not fp8 and model_runner.kv_cache_dtype != torch.bfloat16:
            raise ValueError(f"mla-tune serves bf16 and fp8 (e4m3) MLA caches, not {model_runner.kv_cache_dtype}")
        # SGLang publishes the lengths on the host (seq_lens_cpu: needs_cpu_seq_lens), so picks
        # that plan on the host (FlashInfer's) are eligible: out_graph runs outside the graph
        self.spec = CallSpec("fp8" if fp8 else "bf16", page_size=self.page_size, heads=self.heads,
                             host_lengths=True, sm_scale=self.scaling)
        max_bs = int(model_runner.req_to_token_pool.size)
        width = -(-self.req_to_token.shape[1] // self.page_size)
        table = serving_table(gpu_name(self.device)) if table is None else table
        self.plans = EnginePlans(self.spec, max_bs, table=table, backend=backend, device=self.device)
        self._eager = self._buffers(max_bs, width)
        self._graph = None
        self._one = torch.ones((1,), dtype=torch.float32, device=self.device)
        self.forward_metadata = None

    def _buffers(self, batch: int, width: int) -> dict:
        dev = self.device
        return {"block_table": torch.zeros((batch, width), dtype=torch.int32, device=dev),
                "seq_lens": torch.zeros((batch,), dtype=torch.int32, device=dev),
                "qo_indptr": torch.arange(batch + 1, dtype=torch.int32, device=dev)}

    def _step(self, buffers: dict, forward_batch, graph: bool) -> None:
        bs = forward_batch.batch_size
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"mla-tune serves decode steps only, not {forward_batch.forward_mode}; "
                                      "use it as --decode-attention-backend")
        req_to_block_table(self.req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
                           self.page_size, buffers["block_table"], buffers["seq_lens"])
        lens_cpu = forward_batch.seq_lens_cpu
        if lens_cpu is None:
            raise ValueError("SGLang passed no seq_lens_cpu; the mla_tune backend needs the lengths on the "
                             "host (it keeps needs_cpu_seq_lens = True)")
        self.plans.update(graph, buffers["qo_indptr"][: bs + 1], block_table=buffers["block_table"][:bs],
                          seq_lens=buffers["seq_lens"][:bs], q_lens_host=[1] * bs,
                          kv_lens_host=lens_cpu[:bs].tolist())
        self.forward_metadata = buffers

    # ------------------------------------------------------------------ the engine's hooks
    def init_forward_metadata(self, forward_batch):
        self._step(self._eager, forward_batch, graph=False)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.plans.make_graph_plan(max_bs)
        self._graph = self._buffers(max_bs, self._eager["block_table"].shape[1])

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if self._graph is None:
            raise ValueError("init_forward_metadata_out_graph before init_cuda_graph_state")
        self._step(self._graph, forward_batch, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Nothing: out_graph wrote the step's table into the graph's fixed buffers."""

    def get_cuda_graph_seq_len_fill_value(self):
        return FILL_VALUE

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if k is not None and save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        # the model config's scaling (1 / sqrt(192) x mscale^2) and the layers' (192 ** -0.5 x
        # mscale^2) may differ in the last bit (sglang configs/model_config.py, models/deepseek_v2.py)
        if layer.scaling != self.scaling and not math.isclose(layer.scaling, self.scaling, rel_tol=1e-6):
            raise ValueError(f"layer {layer.layer_id} scales scores by {layer.scaling}, but the plans were made "
                             f"for the model's {self.scaling}")
        cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, self.page_size, QK_DIM)
        # an fp8 cache holds the latent cast as is: SGLang's MLA pool takes no scale on write
        # (set_kv_buffer, set_mla_kv_buffer), so layer.k_scale is not this cache's scale
        kv_scale = self._one if self.spec.kv_format == "fp8" else None
        out = self.plans.run(q.view(-1, layer.tp_q_head_num, QK_DIM), cache, kv_scale)
        return out.view(-1, layer.tp_q_head_num * V_DIM)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise NotImplementedError("mla-tune serves decode only; pair it with a prefill backend "
                                  "(--decode-attention-backend mla_tune --prefill-attention-backend ...)")
