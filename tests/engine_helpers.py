"""The paged latent cache and the vLLM layers and SGLang model runner over it that the engine
loops share: tests/test_integrations_engines.py on the CPU, tests/test_integrations_gpu.py on CUDA."""

from types import SimpleNamespace

import torch

from mla_tune import problem
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE as SCALE
from mla_tune.core import QK_DIM, V_DIM
from mla_tune.serving import inputs as serving

HEADS, LAYERS = 16, 2
CPU = torch.device("cpu")


class Cache:
    """A paged latent cache per layer that sequences grow into, every unheld slot NaN."""

    def __init__(self, lens, page, steps, seed, fp8=False, as_bytes=False, device="cpu",
                 unit_scales=False):
        """unit_scales: an fp8 cache written without a scale (SGLang's MLA pool), else each
        layer's latent divided by its own k_scale (vLLM's)."""
        gen = torch.Generator().manual_seed(seed)
        self.page, self.fp8, self.as_bytes, self.device = page, fp8, as_bytes, torch.device(device)
        pages = [-(-(n + steps) // page) for n in lens]
        self.num_pages = sum(pages) + 2
        order = torch.randperm(self.num_pages, generator=gen)
        self.table = torch.zeros((len(lens), max(pages) + 1), dtype=torch.int32)
        for b, held in enumerate(order[: sum(pages)].split(pages)):  # the next pages of a shuffle
            self.table[b, : len(held)] = held
        self.lens = list(lens)
        self.scales = [torch.tensor([1.0 if unit_scales else 0.02 + 0.01 * layer], dtype=torch.float32, device=device)
                       for layer in range(LAYERS)]
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        self.kv = [torch.full((self.num_pages * page, QK_DIM), float("nan"), device=device).to(dtype)
                   for _ in range(LAYERS)]
        for layer in range(LAYERS):  # the tokens already cached
            for b, n in enumerate(lens):
                self.write(layer, b, range(n), torch.randn((n, QK_DIM), generator=gen))

    def grow(self, b, by, gen=None):
        """Sequence b grows by `by` tokens, all but the last (the engine writes it) filled here."""
        for layer in range(LAYERS):
            self.write(layer, b, range(self.lens[b], self.lens[b] + by - 1),
                       torch.randn((by - 1, QK_DIM), generator=gen))
        self.lens[b] += by

    def slot(self, b, pos):
        return int(self.table[b, pos // self.page]) * self.page + pos % self.page

    def write(self, layer, b, positions, latent):
        if not len(positions):
            return
        slots = torch.tensor([self.slot(b, p) for p in positions], dtype=torch.int64, device=self.device)
        latent = latent.to(self.device)
        value = latent.float() / self.scales[layer] if self.fp8 else latent
        self.kv[layer][slots] = value.to(self.kv[layer].dtype)

    def engine_view(self, layer):
        kv = self.kv[layer].view(self.num_pages, self.page, QK_DIM)
        return kv.view(torch.uint8) if self.as_bytes and self.fp8 else kv

    def reference(self, layer, q, rows, sm_scale):
        lens = torch.tensor([self.lens[b] for b in rows], dtype=torch.int32, device=self.device)
        qo = torch.arange(len(rows) + 1, dtype=torch.int32, device=self.device)
        return serving.reference(q, qo, self.kv[layer].view(self.num_pages, self.page, QK_DIM),
                                 self.scales[layer] if self.fp8 else None,
                                 block_table=self.table[rows].to(self.device),
                                 seq_lens=lens, sm_scale=sm_scale, return_lse=True)


def close_to_reference(out, ref, what):
    """`out` holds no NaN and passes strict against `ref`."""
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    result = problem.check(out, ref, problem.RULES["strict"])
    assert result.passed, f"{what}: {result}"


def vllm_layers(cache, cache_dtype, page, dcp, max_seqs, device=CPU, speculative=0):
    """vLLM's config (graphs at batch 1, 2, 4), the metadata builder, per layer impl and layer."""
    from vllm import config as vc
    from vllm.v1.attention.backend import AttentionLayer, AttentionType

    from mla_tune.integrations import vllm as backend

    config = vc.VllmConfig(model_config=vc.ModelConfig(num_attention_heads=HEADS),
                           cache_config=vc.CacheConfig(cache_dtype=cache_dtype, block_size=page),
                           parallel_config=vc.ParallelConfig(decode_context_parallel_size=dcp),
                           scheduler_config=vc.SchedulerConfig(max_num_seqs=max_seqs),
                           compilation_config=vc.CompilationConfig(cudagraph_mode=vc.CUDAGraphMode(True),
                                                                   cudagraph_capture_sizes=[1, 2, 4]),
                           speculative_config=vc.SpeculativeConfig(num_speculative_tokens=speculative)
                           if speculative else None)
    impls, layers, names = [], [], [f"layers.{i}.attn" for i in range(LAYERS)]
    for layer, name in enumerate(names):
        impl = backend.MlaTuneMLAImpl(num_heads=HEADS, head_size=QK_DIM, scale=SCALE, num_kv_heads=1,
                                      alibi_slopes=None, sliding_window=None, kv_cache_dtype=cache_dtype,
                                      logits_soft_cap=None, attn_type=AttentionType.DECODER,
                                      kv_sharing_target_layer_name=None, kv_lora_rank=V_DIM,
                                      qk_rope_head_dim=QK_DIM - V_DIM)
        if dcp > 1:
            impl.dcp_world_size = dcp  # decode context parallelism: the LSE is asked for
        impls.append(impl)
        layers.append(AttentionLayer(k_scale=cache.scales[layer]))
        config.compilation_config.static_forward_context[name] = SimpleNamespace(impl=impl)
    builder = backend.MlaTuneMLAMetadataBuilder(SimpleNamespace(block_size=page), names, config, device)
    return builder, impls, layers


class Pool:
    """SGLang's MLA token pool over Cache's storage: get_key_buffer and set_kv_buffer, which
    casts the latent to the cache's dtype with no scale (MLATokenToKVPool takes none)."""

    def __init__(self, cache):
        assert not cache.fp8 or all(float(s) == 1.0 for s in cache.scales), "SGLang's fp8 pool has no scale"
        self.cache = cache

    def get_key_buffer(self, layer_id):
        return self.cache.kv[layer_id].view(-1, 1, QK_DIM)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        kv = self.cache.kv[layer.layer_id]
        kv.view(-1, QK_DIM)[loc.long()] = cache_k.view(-1, QK_DIM).to(kv.dtype)


def sglang_layers(scaling, k_scale=None):
    """SGLang's attention layers as the backend reads them, one per layer of the cache."""
    return [SimpleNamespace(layer_id=i, tp_q_head_num=HEADS, head_dim=QK_DIM, v_head_dim=V_DIM,
                            scaling=scaling, k_scale=k_scale) for i in range(LAYERS)]


def sglang_runner(cache, max_reqs, context):
    """SGLang's model runner over `cache`: its config, req_to_token rows and Pool."""
    req_to_token = torch.zeros((max_reqs, context), dtype=torch.int32, device=cache.device)
    for b in range(len(cache.lens)):
        held = min(context, cache.table.shape[1] * cache.page)  # the rest of the row stays 0
        req_to_token[b, :held] = torch.tensor([cache.slot(b, p) for p in range(held)], dtype=torch.int32)
    return SimpleNamespace(
        model_config=SimpleNamespace(num_attention_heads=HEADS, scaling=SCALE), device=str(cache.device),
        page_size=cache.page, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token, size=max_reqs),
        token_to_kv_pool=Pool(cache), kv_cache_dtype=torch.float8_e4m3fn if cache.fp8 else torch.bfloat16,
        use_mla_backend=True)
