"""The vLLM and SGLang backends against fakes of vLLM 0.33.0 and SGLang 0.5.23 that enforce
the real hooks: engine loops (2 layers, 3 steps, graph and eager plans) at DeepSeek-V3's scale
(and SGLang's at V2-Lite's, whose model config and layers compute it one bit apart). GPU: the
loops' layers captured once, replayed for 3 growing steps (metadata hooks outside the graph),
each against the fp32 reference."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from mla_tune import problem
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE as SCALE
from mla_tune.core import QK_DIM, SM_SCALE, V_DIM
from mla_tune.serving import inputs as serving
from tests.fakes import engine_fakes

# ------------------------------------------------------------------ the engines' cache and layers
HEADS, LAYERS = 16, 2
CPU = torch.device("cpu")


class Cache:
    """A paged latent cache per layer that sequences grow into, every unheld slot NaN."""

    def __init__(self, lens, page, steps, seed, fp8=False, as_bytes=False, device="cpu", unit_scales=False):
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

    def reference(self, layer, q, rows, sm_scale, q_len=1):
        lens = torch.tensor([self.lens[b] for b in rows], dtype=torch.int32, device=self.device)
        qo = torch.arange(len(rows) + 1, dtype=torch.int32, device=self.device) * q_len
        return serving.reference(q, qo, self.kv[layer].view(self.num_pages, self.page, QK_DIM),
                                 self.scales[layer] if self.fp8 else None, block_table=self.table[rows].to(self.device),
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
        impl = backend.MlaTuneMLAImpl(num_heads=HEADS, head_size=QK_DIM, scale=SCALE, num_kv_heads=1, alibi_slopes=None,
                                      sliding_window=None, kv_cache_dtype=cache_dtype, logits_soft_cap=None,
                                      attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                                      kv_lora_rank=V_DIM, qk_rope_head_dim=QK_DIM - V_DIM)
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


@pytest.fixture(autouse=True)
def _no_table(monkeypatch):
    monkeypatch.setenv("MLA_TUNE_SERVING_TABLE", "none")  # the default variant, no table lookups


def _ignored_scale_would_fail(out, cache, layer, q, rows):
    at_leaderboard = cache.reference(layer, q, rows, SM_SCALE)[0]
    assert not problem.check(out, at_leaderboard, problem.RULES["strict"]).passed


# ---------------------------------------------------------------------------------- vLLM
def test_vllm_backend_registers_and_refuses_more_speculative_tokens_than_its_kernels_take(monkeypatch):
    """It registers as CUSTOM; the fake, which enforces vLLM 0.33.0's hooks, refuses a wrong one."""
    engine_fakes.install(monkeypatch, "vllm")
    from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_tune.integrations import vllm as backend

    backend.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is backend.MlaTuneMLABackend
    assert backend.MlaTuneMLABackend.get_builder_cls() is backend.MlaTuneMLAMetadataBuilder
    assert backend.MlaTuneMLABackend.get_impl_cls() is backend.MlaTuneMLAImpl
    with pytest.raises(TypeError, match=r"forward_mqa takes .*'kv_cache'"):
        class Wrong(MLACommonImpl):  # noqa: F841
            def forward_mqa(self, q, kv_cache, attn_metadata, layer):
                pass
    cache = Cache([5, 30], 16, 3, seed=2)
    vllm_layers(cache, "auto", 16, dcp=1, max_seqs=4, speculative=3)  # q_len 4
    with pytest.raises(ValueError, match=r"up to 5 tokens per sequence .* take up to 4: use "
                                         r"num_speculative_tokens 3 or fewer"):
        vllm_layers(cache, "auto", 16, dcp=1, max_seqs=4, speculative=4)


def _common(qsl, lens, table, slots, tokens=None, max_seq_len=None):
    """vLLM's CommonAttentionMetadata of a step: query_start_loc qsl, seq_lens (and their host
    copy) lens; tokens and max_seq_len default to qsl's last and lens' largest."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=lens.clone(), num_reqs=len(lens),
        num_actual_tokens=int(qsl[-1]) if tokens is None else tokens, max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(lens.max()) if max_seq_len is None else max_seq_len, block_table_tensor=table.clone(),
        slot_mapping=slots, seq_lens_cpu_upper_bound=lens)


@pytest.mark.parametrize(("dcp", "speculative", "cache_dtype", "takes"),
                         [(2, 0, "fp8", None), (1, 0, "auto", "lengths"), (1, 1, "auto", "mean")])
def test_vllm_decode_loop_at_deepseek_v3_scale_gives_eager_steps_vllms_host_lengths(
        monkeypatch, dcp, speculative, cache_dtype, takes):
    """An fp8 cache kept as uint8 bytes, as vLLM keeps it; decode context parallelism asks for
    the LSE. vLLM's host copy of the lengths (seq_lens_cpu_upper_bound) reaches an eager step's
    plan, whose lookup estimates at them; with speculative decoding (an upper bound then)
    their mean; with decode context parallelism (each rank's share differs) nothing. A graph
    step takes none."""
    engine_fakes.install(monkeypatch, "vllm")
    fp8 = cache_dtype == "fp8"
    cache = Cache([5, 30, 47, 70], 16, 3, fp8=fp8, seed=1, as_bytes=fp8)
    builder, impls, layers = vllm_layers(cache, cache_dtype, 16, dcp=dcp, max_seqs=4, speculative=speculative)
    spec = builder.plans.spec
    assert spec.sm_scale == SCALE and spec.return_lse == (dcp > 1) and builder.plans.graph is not None
    assert spec.cache_dtype == ""  # vLLM views its uint8 bytes as fp8 before forward_mqa
    assert spec.heads == dcp * HEADS  # q's heads gathered over the DCP group
    calls = []
    update = builder.plans.update
    monkeypatch.setattr(builder.plans, "update", lambda graph, qo, **kw: calls.append(
        (graph, kw["kv_lens_host"], kw["mean_kv_len"], kw["seq_lens"].tolist())) or update(graph, qo, **kw))
    for step, rows in enumerate(([0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3])):  # 4: captured unless q_len 2
        gen = torch.Generator().manual_seed(10 + step)
        for b in rows:
            cache.lens[b] += 1  # this step's new token, written by the layer below
        qsl = torch.arange(len(rows) + 1, dtype=torch.int32)
        slots = torch.tensor([cache.slot(b, cache.lens[b] - 1) for b in rows], dtype=torch.int64)
        lens = torch.tensor([cache.lens[b] for b in rows], dtype=torch.int32)
        metadata = builder.build(0, _common(qsl, lens, cache.table[rows], slots))
        for layer, (impl, layer_obj) in enumerate(zip(impls, layers, strict=True)):
            q = torch.randn((len(rows), HEADS, QK_DIM), generator=gen).to(torch.bfloat16)
            latent = torch.randn((len(rows), QK_DIM), generator=gen)
            out, lse = impl.forward_decode_step(layer_obj, q, latent[:, :V_DIM], latent[:, V_DIM:],
                                                cache.engine_view(layer), metadata)
            ref, ref_lse = cache.reference(layer, q, rows, SCALE)
            close_to_reference(out, ref, f"vLLM layer {layer}")
            if spec.return_lse:  # decode context parallelism asks for it
                torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=0)
            else:
                assert lse is None
            _ignored_scale_would_fail(out, cache, layer, q, rows)
        graph = len(rows) == 4 and not speculative
        assert metadata.decode.plans.active is (builder.plans.graph if graph else builder.plans.eager)
    assert [graph for graph, *_ in calls] == [not speculative, False, not speculative]
    for graph, kv_lens, mean, lens in calls:
        assert kv_lens == (lens if takes == "lengths" and not graph else None)
        assert mean == (sum(lens) / len(lens) if takes == "mean" and not graph else None)


@pytest.mark.parametrize("speculative", [0, 1])
def test_vllm_a_graph_step_padded_with_empty_requests_answers_its_real_rows(monkeypatch, speculative):
    """A full CUDA graph's step as vLLM pads it: requests of query length 0 and sequence
    length 0 up to the captured batch (query_start_loc repeats the real token count), q
    padded to the captured tokens. The graph plan takes it; the real rows match the
    reference, the padding stays finite."""
    engine_fakes.install(monkeypatch, "vllm")
    q_len, real, padded = 1 + speculative, 3, 4
    cache = Cache([5, 30, 47], 16, 3, seed=3)
    builder, impls, layers = vllm_layers(cache, "auto", 16, dcp=1, max_seqs=8, speculative=speculative)
    builder.graph_batches = frozenset({padded})  # a capture of `padded` requests at this q_len
    builder.plans.make_graph_plan(padded)
    qsl = torch.tensor([q_len * min(i, real) for i in range(padded + 1)], dtype=torch.int32)
    lens = torch.tensor(cache.lens + [0], dtype=torch.int32)
    table = torch.cat([cache.table[:real], torch.zeros((1, cache.table.shape[1]), dtype=torch.int32)])
    metadata = builder.build(0, _common(qsl, lens, table, torch.full((padded * q_len,), -1, dtype=torch.int64),
                                        tokens=padded * q_len))
    assert builder.plans.active is builder.plans.graph
    q = torch.randn((padded * q_len, HEADS, QK_DIM), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, _ = impls[0].forward_mqa((q[..., :V_DIM], q[..., V_DIM:]), cache.engine_view(0), metadata, layers[0])
    ref, _ = cache.reference(0, q[: real * q_len], list(range(real)), SCALE, q_len)
    close_to_reference(out[: real * q_len], ref, f"vLLM padded graph step, q_len {q_len}")
    assert torch.isfinite(out[real * q_len:].float()).all()


def test_vllm_a_step_with_prefills_runs_its_decodes_on_the_eager_plan(monkeypatch):
    """A mixed step (chunked prefill) runs its attention outside any full CUDA graph, so its
    decodes take the eager plan and its lengths-aware pick even where their count is a
    capture size; a step of decodes only of that size takes the graph plan."""
    engine_fakes.install(monkeypatch, "vllm")
    cache = Cache([5, 30, 47, 70, 90], 16, 3, seed=4)
    builder, _impls, _layers = vllm_layers(cache, "auto", 16, dcp=1, max_seqs=8)
    lens = torch.tensor(cache.lens, dtype=torch.int32)
    for q_lens, graph in (([1, 1, 1, 1, 3], False), ([1, 1, 1, 1], True)):  # 4 decodes: a capture size
        n = len(q_lens)
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        slots = torch.zeros(int(qsl[-1]), dtype=torch.int64)
        metadata = builder.build(0, _common(qsl, lens[:n], cache.table[:n], slots, max_seq_len=int(lens.max())))
        assert metadata.num_decodes == 4 and metadata.num_prefills == n - 4
        assert metadata.decode.plans.active is (builder.plans.graph if graph else builder.plans.eager)


# -------------------------------------------------------------------------------- SGLang
def test_sglang_backend_registers_and_the_fake_refuses_the_removed_hooks(monkeypatch):
    engine_fakes.install(monkeypatch, "sglang")
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from mla_tune.integrations import sglang as backend

    backend.register()
    assert attention_registry.ATTENTION_BACKENDS["mla_tune"] is backend.create_mla_tune_backend
    with pytest.raises(TypeError, match="removed from the 0.5.23 base class"):
        class Old(AttentionBackend):  # noqa: F841
            def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens):
                pass
    with pytest.raises(TypeError, match=r"init_forward_metadata_out_graph takes"):
        class Wrong(AttentionBackend):  # noqa: F841
            def init_forward_metadata_out_graph(self, batch):
                pass


# DeepSeek-V2-Lite's yarn (factor 40, mscale_all_dim 0.707): SGLang's model config computes its
# scaling as 1 / sqrt(192) x m^2, its layers as 192 ** -0.5 x m^2, which differ in the last bit
_M = 0.1 * 0.707 * math.log(40) + 1.0
V2_LITE = (1 / math.sqrt(192) * _M * _M, 192 ** -0.5 * _M * _M)


@pytest.mark.parametrize(("config_scale", "layer_scale", "fp8"), [(SCALE, SCALE, False), (*V2_LITE, False),
                                                                 (SCALE, SCALE, True)], ids=["v3", "v2_lite", "v3_fp8"])
def test_sglang_page_one_decode_loop_at_the_models_scale_with_graph_hooks(monkeypatch, config_scale, layer_scale, fp8):
    """An fp8 cache is read at scale 1 whatever the layer's k_scale (0.37 here): the pool wrote
    it unscaled."""
    engine_fakes.install(monkeypatch, "sglang")
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from mla_tune.integrations import sglang as backend

    assert V2_LITE[0] != V2_LITE[1]
    cache = Cache([5, 30, 47], 1, 3, fp8=fp8, seed=2, as_bytes=False, unit_scales=True)  # page 1: token slots
    runner = sglang_runner(cache, max_reqs=4, context=64)
    runner.model_config.scaling = config_scale
    attn = backend.create_mla_tune_backend(runner)
    assert attn.plans.spec.sm_scale == config_scale and attn.plans.spec.page_size == 1
    attn.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    layers = sglang_layers(layer_scale, torch.tensor([0.37]) if fp8 else None)
    gen = torch.Generator().manual_seed(7)
    for step, rows in enumerate(([0, 1, 2], [0, 2], [1, 2])):  # 3 sequences eager; 2: the graph path
        for b in rows:
            cache.lens[b] += 1
        lens = torch.tensor([cache.lens[b] for b in rows])
        batch = ForwardBatch(ForwardMode.DECODE, len(rows), torch.tensor(rows), lens,
                             torch.tensor([cache.slot(b, cache.lens[b] - 1) for b in rows]),
                             int(lens.sum()), seq_lens_cpu=lens.clone())
        graph = len(rows) <= 2
        if graph:  # the graph runner: out_graph (capture or replay), then the captured forward
            attn.init_forward_metadata_out_graph(batch, in_capture=step == 1)
            attn.init_forward_metadata_in_graph(batch)
        else:
            attn.init_forward_metadata(batch)
        assert attn.plans.active is (attn.plans.graph if graph else attn.plans.eager)
        for layer in layers:
            q = torch.randn((len(rows), HEADS * QK_DIM), generator=gen).to(torch.bfloat16)
            latent = torch.randn((len(rows), 1, QK_DIM), generator=gen).to(torch.bfloat16)
            out = attn.forward(q, latent, latent[..., :V_DIM], layer, batch)
            assert out.shape == (len(rows), HEADS * V_DIM)
            q3 = q.view(-1, HEADS, QK_DIM)
            ref, _ = cache.reference(layer.layer_id, q3, rows, layer_scale)
            close_to_reference(out.view(-1, HEADS, V_DIM), ref, f"SGLang step {step} layer {layer.layer_id}")
            _ignored_scale_would_fail(out.view(-1, HEADS, V_DIM), cache, layer.layer_id, q3, rows)
    layers[0].scaling = layer_scale * 1.01  # a layer at another scale than the plans'
    with pytest.raises(ValueError, match="layer 0 scales scores by"):
        attn.forward(q, latent, latent[..., :V_DIM], layers[0], batch)


# ------------------------------------------------------------------------- CUDA graphs
def _replay_growing(cache, layers_run, qs, latents, outs, refill, seed, grow, what):
    """`layers_run` run once eagerly (compiles, allocates), captured, then replayed for 3 steps
    as every sequence grows by 1 + grow x step tokens: each layer's q and latent refilled,
    `refill(lens, new_token_slots)` (the engine's metadata, outside the graph) before each
    replay, every layer's output against the reference."""
    dev, rows = qs[0].device, list(range(len(cache.lens)))
    layers_run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers_run()
    gen = torch.Generator(device=dev).manual_seed(seed)
    for step in range(3):
        for b in rows:
            cache.grow(b, 1 + grow * step)
        for q, latent in zip(qs, latents, strict=True):
            q.copy_(torch.randn(q.shape, generator=gen, device=dev))
            latent.copy_(torch.randn(latent.shape, generator=gen, device=dev))
        refill(list(cache.lens), [cache.slot(b, cache.lens[b] - 1) for b in rows])
        graph.replay()
        torch.cuda.synchronize()
        for i, (q, out) in enumerate(zip(qs, outs, strict=True)):
            ref, _ = cache.reference(i, q.view(-1, HEADS, QK_DIM), rows, SCALE)
            close_to_reference(out.view(-1, HEADS, V_DIM), ref, f"{what} step {step} layer {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("page,fp8", [(1, False), (1, True), (64, True)])
def test_sglang_backend_replays_a_captured_decode_step_with_new_lengths(monkeypatch, page, fp8):
    engine_fakes.install(monkeypatch, "sglang")
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from mla_tune.integrations import sglang as backend

    dev = torch.device("cuda")
    lens = [5, 300, 1000, 64]
    cache = Cache(lens, page, 120, fp8=fp8, seed=3, device=dev, unit_scales=True)
    attn = backend.create_mla_tune_backend(sglang_runner(cache, max_reqs=8, context=1200))
    rows, bs = [0, 1, 2, 3], 4
    attn.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    k_scale = torch.tensor([0.37], device=dev) if fp8 else None  # not the pool's
    layers = sglang_layers(SCALE, k_scale)
    # the graph's static inputs, refilled before each replay (as SGLang's graph runner does)
    seq_lens = torch.tensor(lens, device=dev)
    loc = torch.zeros(bs, dtype=torch.int64, device=dev)
    qs = [torch.zeros((bs, HEADS * QK_DIM), dtype=torch.bfloat16, device=dev) for _ in layers]
    latents = [torch.zeros((bs, 1, QK_DIM), dtype=torch.bfloat16, device=dev) for _ in layers]
    outs = [torch.zeros((bs, HEADS * V_DIM), dtype=torch.bfloat16, device=dev) for _ in layers]
    batch = ForwardBatch(ForwardMode.DECODE, bs, torch.tensor(rows, device=dev), seq_lens, loc, 0,
                         seq_lens_cpu=torch.tensor(lens))

    def layers_run():
        for layer, q, latent, out in zip(layers, qs, latents, outs, strict=True):
            out.copy_(attn.forward(q, latent, latent[..., :V_DIM], layer, batch))

    def refill(now, slots):
        seq_lens.copy_(torch.tensor(now))
        loc.copy_(torch.tensor(slots))
        batch.seq_lens_cpu = torch.tensor(now)
        attn.init_forward_metadata_out_graph(batch)

    attn.init_forward_metadata_out_graph(batch, in_capture=True)
    _replay_growing(cache, layers_run, qs, latents, outs, refill, 4, 37, f"SGLang page {page}")


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8", "auto"])
def test_vllm_backend_replays_captured_layers_after_each_build(monkeypatch, cache_dtype):
    engine_fakes.install(monkeypatch, "vllm")
    from vllm.v1.attention.backend import CommonAttentionMetadata

    dev, page, bs = torch.device("cuda"), 64, 4
    fp8 = cache_dtype == "fp8"
    cache = Cache([5, 300, 1000, 64], page, 200, fp8=fp8, seed=5, as_bytes=True, device=dev)
    builder, impls, layer_objs = vllm_layers(cache, cache_dtype, page, dcp=1, max_seqs=8, device=dev)
    rows = [0, 1, 2, 3]
    qsl = torch.arange(bs + 1, dtype=torch.int32)
    seq_lens = torch.tensor(cache.lens, dtype=torch.int32, device=dev)
    slots = torch.zeros(bs, dtype=torch.int64, device=dev)
    table = cache.table[rows].to(dev)
    common = CommonAttentionMetadata(query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq_lens,
                                     num_reqs=bs, num_actual_tokens=bs, max_query_len=1, max_seq_len=2000,
                                     block_table_tensor=table, slot_mapping=slots)
    qs = [torch.zeros((bs, HEADS, QK_DIM), dtype=torch.bfloat16, device=dev) for _ in impls]
    latents = [torch.zeros((bs, QK_DIM), device=dev) for _ in impls]
    outs = [torch.zeros((bs, HEADS, V_DIM), dtype=torch.bfloat16, device=dev) for _ in impls]
    metadata = builder.build(0, common)
    assert metadata.decode.plans.active is builder.plans.graph

    def layers_run():
        for i, impl in enumerate(impls):
            out, _ = impl.forward_decode_step(layer_objs[i], qs[i], latents[i][:, :V_DIM], latents[i][:, V_DIM:],
                                              cache.engine_view(i), metadata)
            outs[i].copy_(out)

    def refill(now, new_slots):
        seq_lens.copy_(torch.tensor(now))
        slots.copy_(torch.tensor(new_slots))
        builder.build(0, common)

    _replay_growing(cache, layers_run, qs, latents, outs, refill, 6, 50, f"vLLM {cache_dtype}")
