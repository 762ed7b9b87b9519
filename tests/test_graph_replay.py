"""A CUDA graph of the serving call (every graph-safe backend's Decoder, a DecodePlan's step),
captured once at the maxima and replayed with other lengths, q_lens and block tables, each
output poisoned with NaN and compared with the fp32 reference of the new call."""

import pytest
import torch

from mla_tune import gpu
from mla_tune.backends import get_backend
from mla_tune.core import CallSpec, Variant
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import PREFERENCE, Decoder
from mla_tune.serving.decode_plan import DecodePlan
from tests.helpers import GPU_LENS, assert_close, cell_spec, max_error, refill, serving_expected

HEADS = 128
# One call captured at these lengths (each kv_len >= its q_len), then replayed with the
# others: ragged, with 1-, 2- and 3000-token sequences moved between batch slots.
GRAPH_Q_LENS = [2, 2, 2, 2, 2, 1]
GRAPH_KV_LENS = [3000, 700, 65, 2, 17, 64]
GRAPH_REPLAYS = ((42, [5, 3000, 1, 64, 65, 2]), (43, [700, 17, 2, 1, 64, 3000]))


def refill_for_replays(static: serving.ServingInput, max_q_len: int, heads: int, kv_format: str, device):
    """For each of GRAPH_REPLAYS: (seed, the new input), its tensors copied into `static`'s
    buffers (`refill`) for the caller to replay and compare with the new call's reference."""
    for seed, kv_lens in GRAPH_REPLAYS:
        q_lens = [min(n, max_q_len) for n in kv_lens]
        q_lens[-1] = 1  # the total stays within the captured q
        new = serving.make_input(q_lens, kv_lens, heads, static.page_size, kv_format, seed=seed, device=device)
        refill(static, new, f"replay seed {seed}")
        yield seed, new


# The own kernels' settings of the kernel-level graph tests: 16 splits of 128 tokens, split-K
# with q quantized to fp8 in the graph (its amax pass included), fused with bf16 q.
SETTINGS = {"triton": dict(q="fp8_dynamic", max_splits=16, tokens_per_split=128, block_n=64, block_h=16,
                           num_warps=4, num_stages=2, dot_dtype="bf16"),
            "triton_fused": dict(q="bf16", qk_dot="bf16", pv_dot="bf16", max_splits=16, tokens_per_split=128,
                                 block_n=64, block_h=8, num_warps=4, num_stages=2)}

# (backend, layout, kv, setting): None is the backend's default serving variant.
CALL_CASES = [
    ("triton", 0, "fp8", "kernel"), ("triton", 64, "fp8", None),
    ("triton_fused", 0, "fp8", "kernel"), ("triton_fused", 64, "fp8", None),
    ("flashmla", 64, "bf16", None), ("flashmla", 64, "fp8", None),
    ("flashinfer", 0, "fp8", None), ("flashinfer", 64, "fp8", None),
    ("gluon_fused", 0, "fp8", None), ("gluon_fused", 64, "fp8", None), ("gluon_fused", 64, "bf16", None),
]


def _graph_backends() -> list[str]:
    """The serving backends that declare themselves graph-safe and run on an H200."""
    tags = gpu.fake_platform("H200").tags
    return [name for name in PREFERENCE
            if (caps := get_backend(name).CAPABILITIES).serving and caps.graph_safe and caps.runs_on(tags)]


# Any other: its default variant on paged 64 (or contiguous).
CALL_CASES += [(name, 64 if 64 in get_backend(name).CAPABILITIES.page_sizes else 0, "fp8", None)
               for name in _graph_backends() if name not in {c[0] for c in CALL_CASES}]


def _ids(case) -> str:
    name, layout, kv, setting = case
    return f"{name}-{'contiguous' if layout == 0 else f'page{layout}'}-{kv}-{setting or 'default'}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", CALL_CASES, ids=_ids)
def test_a_captured_serving_call_replays_new_lengths_and_block_tables(case):
    name, layout, kv, setting = case
    backend = get_backend(name)
    assert (reason := backend.unavailable_reason()) is None, reason
    max_q = 2 if backend.CAPABILITIES.mixed_q_len else 1
    spec = cell_spec(name, layout, HEADS, max_q, kv, graph=True)  # the ragged q_len and host lengths it takes
    variant = Variant.make(name, kv=kv, **SETTINGS[name]) if setting else None
    decoder = Decoder(spec, backend=name, variant=variant, device="cuda")
    q_lens = GRAPH_Q_LENS if max_q > 1 else [1] * len(GRAPH_KV_LENS)
    static = serving.make_input(q_lens, GRAPH_KV_LENS, HEADS, layout, kv, seed=41, device="cuda")
    lengths = {"q_lens_host": q_lens, "kv_lens_host": GRAPH_KV_LENS} if spec.host_lengths else {}
    held = {}

    def call():
        held["out"] = decoder(static.q, static.qo_indptr, static.kv, static.kv_scale, **static.layout, **lengths)

    graph = serving.capture_without_sync(call)
    out = held["out"]
    for seed, new in refill_for_replays(static, max_q, HEADS, kv, "cuda"):
        if name == "flashinfer":  # its plan runs on the host: before each replay, outside the graph
            decoder.runner.plan(static.q, static.qo_indptr, static.kv, static.kv_scale, **static.layout,
                                q_lens_host=new.q_lens, kv_lens_host=new.kv_lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        rows = new.q.shape[0]
        ref = serving_expected(decoder.variant, new.q, new.qo_indptr, new.kv, new.kv_scale, **new.layout)
        assert_close(out[:rows], ref, max_error(decoder.variant, "cuda"), f"{_ids(case)} replay seed {seed}")
        if name == "triton_fused":  # the reduction's counters are back at zero for the next replay
            assert int(decoder.runner.workspace.count.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("update_in_graph", [True, False], ids=["update-captured", "update-before-replay"])
@pytest.mark.parametrize("backend", ["triton", "triton_fused", "flashmla"])
def test_a_decode_step_through_a_plan_captured_once_replays_growing_lengths(backend, update_in_graph):
    """An engine's step captured once, replayed as sequences grow: the update captured with
    the three layers, or (the engines' protocol) made on the host before each replay of a
    graph of the layers."""
    spec = CallSpec("fp8", page_size=64, heads=HEADS, max_q_len=1, graph=True)
    plan = DecodePlan(spec, max_batch=8, backend=backend, device="cuda")
    batch = len(GPU_LENS)
    static = serving.make_input([1] * batch, [n + 8 for n in GPU_LENS], HEADS, 64, "fp8", seed=10, device="cuda")
    layers = [torch.randn_like(static.q) for _ in range(3)]
    outs = [torch.empty((batch, HEADS, 512), dtype=torch.bfloat16, device="cuda") for _ in layers]

    def update():
        plan.update(static.qo_indptr, block_table=static.block_table, seq_lens=static.seq_lens)

    def step():
        if update_in_graph:
            update()
        for q, out in zip(layers, outs, strict=True):
            out.copy_(plan.run(q, static.kv, static.kv_scale))

    if not update_in_graph:
        update()
    graph = serving.capture_without_sync(step)
    variant = plan.pick(batch)
    assert variant.backend == backend
    for grow in (0, 4, 8):
        static.seq_lens.copy_(torch.tensor([n + grow for n in GPU_LENS], dtype=torch.int32, device="cuda"))
        for out in outs:
            out.fill_(float("nan"))
        if not update_in_graph:
            update()
        graph.replay()
        torch.cuda.synchronize()
        for i, (q, out) in enumerate(zip(layers, outs, strict=True)):
            ref = serving_expected(variant, q, static.qo_indptr, static.kv, static.kv_scale, **static.layout)
            assert_close(out, ref, max_error(variant, "cuda"), f"{backend} +{grow} layer {i}")


def test_every_backend_that_serves_a_graph_on_the_h200_has_a_replay_case():
    assert {"triton", "triton_fused", "flashmla", "flashinfer", "gluon_fused"} <= set(_graph_backends())
    assert {c[0] for c in CALL_CASES} == set(_graph_backends())


@pytest.mark.parametrize("layout", [0, 64])
def test_refilling_the_captured_buffers_reproduces_each_replay_input(layout):
    """After each refill (refill_for_replays) the captured buffers are exactly the new call."""
    static = serving.make_input(GRAPH_Q_LENS, GRAPH_KV_LENS, 16, layout, "fp8", seed=41, device="cpu")
    seen = []
    for seed, new in refill_for_replays(static, 2, 16, "fp8", "cpu"):
        rows = new.q.shape[0]
        refilled = serving.reference(static.q, static.qo_indptr, static.kv, static.kv_scale,
                                     **static.layout, q_format="fp8")[:rows]
        assert torch.equal(refilled, new.reference("fp8")), f"replay seed {seed}"
        seen.append(seed)
    assert seen == [seed for seed, _ in GRAPH_REPLAYS]
