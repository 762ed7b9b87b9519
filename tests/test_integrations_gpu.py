"""The engine loops of tests/test_integrations_engines.py on CUDA: layers captured once, replayed
for 3 growing steps (metadata hooks outside the graph), each against the fp32 reference."""

import pytest
import torch

from mla_tune.core import CORE_DEEPSEEK_V3_SCALE as SCALE
from mla_tune.core import QK_DIM, V_DIM
from tests import engine_helpers
from tests.engine_helpers import HEADS, Cache, close_to_reference, vllm_layers
from tests.fakes import engine_fakes

pytestmark = pytest.mark.gpu


def _capture(run):
    """`run` once eagerly (compiles, allocates), then captured; the graph."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


@pytest.mark.parametrize("page,fp8", [(1, False), (1, True), (64, True)])
def test_sglang_backend_replays_a_captured_decode_step_with_new_lengths(monkeypatch, page, fp8):
    engine_fakes.install(monkeypatch, "sglang")
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from mla_tune.integrations import sglang as backend

    monkeypatch.setenv("MLA_TUNE_SERVING_TABLE", "none")
    dev = torch.device("cuda")
    lens = [5, 300, 1000, 64]
    cache = Cache(lens, page, 120, fp8=fp8, seed=3, device=dev, unit_scales=True)
    attn = backend.create_mla_tune_backend(engine_helpers.sglang_runner(cache, max_reqs=8, context=1200))
    rows, bs = [0, 1, 2, 3], 4
    attn.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
    k_scale = torch.tensor([0.37], device=dev) if fp8 else None  # not the pool's
    layers = engine_helpers.sglang_layers(SCALE, k_scale)
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

    attn.init_forward_metadata_out_graph(batch, in_capture=True)
    graph = _capture(layers_run)
    gen = torch.Generator(device=dev).manual_seed(4)
    for step in range(3):
        for b in rows:
            cache.grow(b, 1 + 37 * step)  # the sequences grow between replays
        now = [cache.lens[b] for b in rows]
        seq_lens.copy_(torch.tensor(now))
        loc.copy_(torch.tensor([cache.slot(b, cache.lens[b] - 1) for b in rows]))
        batch.seq_lens_cpu = torch.tensor(now)
        for q, latent in zip(qs, latents, strict=True):
            q.copy_(torch.randn(q.shape, generator=gen, device=dev))
            latent.copy_(torch.randn(latent.shape, generator=gen, device=dev))
        attn.init_forward_metadata_out_graph(batch)
        graph.replay()
        torch.cuda.synchronize()
        for layer, q, out in zip(layers, qs, outs, strict=True):
            ref, _ = cache.reference(layer.layer_id, q.view(-1, HEADS, QK_DIM), rows, SCALE)
            close_to_reference(out.view(-1, HEADS, V_DIM), ref, f"step {step} layer {layer.layer_id}")


@pytest.mark.parametrize("cache_dtype", ["fp8", "auto"])
def test_vllm_backend_replays_captured_layers_after_each_build(monkeypatch, cache_dtype):
    engine_fakes.install(monkeypatch, "vllm")
    from vllm.v1.attention.backend import CommonAttentionMetadata

    monkeypatch.setenv("MLA_TUNE_SERVING_TABLE", "none")
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

    graph = _capture(layers_run)
    gen = torch.Generator(device=dev).manual_seed(6)
    for step in range(3):
        for b in rows:
            cache.grow(b, 1 + 50 * step)
        seq_lens.copy_(torch.tensor([cache.lens[b] for b in rows]))
        slots.copy_(torch.tensor([cache.slot(b, cache.lens[b] - 1) for b in rows]))
        for q, latent in zip(qs, latents, strict=True):
            q.copy_(torch.randn(q.shape, generator=gen, device=dev))
            latent.copy_(torch.randn(latent.shape, generator=gen, device=dev))
        builder.build(0, common)  # the step's metadata, outside the graph
        graph.replay()
        torch.cuda.synchronize()
        for i, (q, out) in enumerate(zip(qs, outs, strict=True)):
            ref, _ = cache.reference(i, q, rows, SCALE)
            close_to_reference(out, ref, f"vLLM {cache_dtype} step {step} layer {i}")
