"""The serving runners' step API and the replayed Triton launches (mla_tune/kernels/launch.py):
a step's layers answer as the plain runner and the reference (own backends interpreted, the
vendors through their CPU fakes); the replay's guard and substitution on fake objects. GPU:
replays bit-identical to the JIT launch, a misaligned q falling back (DecodePlan.run's host time:
scripts/bench_serving_host.py).
"""

import inspect
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

from mla_tune.backends import flash_mla as flash_mla_backend
from mla_tune.core import CallSpec, tensor_sig
from mla_tune.kernels import launch
from mla_tune.kernels.flash_decode import FlashDecodeServingWorkspace, flash_decode_serving
from mla_tune.kernels.launch import LaunchReplay, RecordedLaunch
from mla_tune.kernels.serving_runner import OwnServingRunner
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import Decoder, runner_step
from mla_tune.serving.decode_plan import DecodePlan
from tests.helpers import GPU_LENS, assert_close, vendor_fakes

SPEC = CallSpec("bf16", page_size=16, heads=16, max_q_len=2, mixed_q_len=True)
LENS = [1, 17, 40]


def _layers(spec: CallSpec, kv_lens, q_lens, n: int, device="cpu"):
    """n layers of one step: the step's tensors from the first, a q and a KV cache per layer
    (same shapes, new values)."""
    first = serving.make_input(q_lens, kv_lens, spec.heads, spec.page_size, spec.kv_format, seed=3, device=device)
    gen = torch.Generator(device=device).manual_seed(4)
    more = [tuple(torch.randn(t.shape, generator=gen, device=device).to(t.dtype) for t in (first.q, first.kv))
            for _ in range(n - 1)]
    return first, [(first.q, first.kv), *more]


def _ref(first, q, kv, q_format="bf16"):
    return serving.reference(q, first.qo_indptr, kv, first.kv_scale, **first.layout, q_format=q_format)


# --------------------------------------------------------------------- a step's layers, CPU
# (backend, kv format, host lengths): FlashMLA steps with the host q_lens and without
STEP_CASES = [("triton", "bf16", False), ("triton_fused", "bf16", False), ("flashinfer", "bf16", True),
              ("flashinfer", "fp8", True)]
STEP_CASES += [("flashmla", kv, host) for kv in ("bf16", "fp8") for host in (True, False)]


@pytest.mark.parametrize("backend,kv_format,host_lengths", STEP_CASES)
def test_a_steps_layers_through_the_plan_answer_as_the_plain_runner_and_the_reference(
        monkeypatch, backend, kv_format, host_lengths):
    """The own runners interpreted; the vendors' fakes, which make their per-step work once for
    the step: FlashInfer plans (then runs once per layer), FlashMLA schedules."""
    fm = vendor_fakes.install(monkeypatch, "flashinfer", "flash_mla")["flash_mla"]
    import flashinfer.mla as fi

    if backend == "flashmla":  # one q_len a step, 64-token pages
        spec = CallSpec(kv_format, page_size=64, heads=16, max_q_len=2)
        q_lens, kv_lens = [2, 2, 2], [2, 70, 130]
    else:
        spec = replace(SPEC, kv_format=kv_format, host_lengths=host_lengths)
        q_lens, kv_lens = [1, 2, 2], LENS
    plan = DecodePlan(spec, max_batch=4, backend=backend, device="cpu")
    first, layers = _layers(spec, kv_lens, q_lens, 2)
    host = {"q_lens_host": q_lens} if host_lengths else {}
    if spec.host_lengths:
        host["kv_lens_host"] = kv_lens

    def made():  # FlashInfer's plans and runs, FlashMLA's schedules
        return [fi.calls["plan"], fi.calls["run"], fm.calls["get_mla_decoding_metadata"]]

    before = made()
    plan.update(first.qo_indptr, **first.layout, **host)
    outs = [plan.run(q, kv, first.kv_scale).clone() for q, kv in layers]
    step = [now - n for now, n in zip(made(), before, strict=True)]
    assert step == {"flashinfer": [1, 2, 0], "flashmla": [0, 0, 1]}.get(backend, [0, 0, 0])
    if backend in ("triton", "triton_fused"):
        assert plan._layer.fast is None  # the interpreter: every layer took the runner
    runner = plan._default.runner
    q_format = kv_format if backend == "flashmla" else "bf16"
    for i, ((q, kv), out) in enumerate(zip(layers, outs, strict=True)):
        plain = runner(q, first.qo_indptr, kv, first.kv_scale, **first.layout, **host)
        assert torch.equal(out, plain), f"{backend} layer {i}: the step differs from the plain runner"
        assert_close(out, _ref(first, q, kv, q_format), what=f"{backend} layer {i}")


def test_the_interpreter_takes_the_jit_path_and_records_nothing():
    assert "TRITON_INTERPRET" in (launch.replay_unsupported() or "")
    first = _layers(SPEC, LENS, [1, 2, 2], 1)[0]
    record = []
    out = torch.empty((first.q.shape[0], 16, 512), dtype=torch.bfloat16)
    flash_decode_serving(first.q, first.qo_indptr, first.kv, None, out, **first.layout, max_q_len=2,
                         max_splits=4, tokens_per_split=16, block_n=16, block_h=8, num_warps=4, num_stages=1,
                         dot_dtype="fp16", workspace=FlashDecodeServingWorkspace.allocate(8, 16, 4, "cpu", max_q_len=2),
                         record=record)
    assert record == [None, None]  # stage 1 and stage 2, neither replayable here


# --------------------------------------------------------------------- the guard, on fakes
class _FakeTensor:
    """What tensor_sig and LaunchReplay.build read of a tensor."""

    def __init__(self, ptr=4096, dtype=torch.bfloat16, shape=(4, 16, 576), stride=(9216, 576, 1), device=0):
        self.ptr, self.dtype, self.shape, self._stride, self.device = ptr, dtype, torch.Size(shape), stride, device

    def stride(self):
        return self._stride

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return self.device

    def untyped_storage(self):
        return self  # its own storage, starting at ptr

    def __repr__(self):
        return f"T({self.ptr})"


class _FakeCompiled:
    function, packed_metadata = "FUNCTION", "PACKED"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


def _replay(values, tensors, grid=(2, 3)):
    compiled = _FakeCompiled()
    rec = RecordedLaunch(compiled, (*grid, 1, 1)[:3], list(values), lambda device: 77, 0)
    return LaunchReplay.build([rec], tensors), compiled


def test_the_guard_rejects_a_changed_dtype_alignment_shape_stride_or_device_or_a_launch_hook():
    """It compares each tensor's tensor_sig: what the compile specialized on."""
    t = torch.zeros(64, dtype=torch.bfloat16)
    assert tensor_sig(t) == (torch.bfloat16, torch.Size([64]), (1,), True, -1)
    assert tensor_sig(t[1:9])[3] is False  # 2 bytes in: not 16-byte aligned
    assert tensor_sig(None) is None
    q, kv, scale = _FakeTensor(4096), _FakeTensor(8192, torch.float8_e4m3fn, (10, 16, 576)), _FakeTensor(64, torch.float32, (1,), (1,))
    replay, _ = _replay([q, 5, kv, scale], (q, kv, scale))
    kv2 = _FakeTensor(1 << 21, torch.float8_e4m3fn, (10, 16, 576))
    assert replay.matches((_FakeTensor(1 << 20), kv2, _FakeTensor(128, torch.float32, (1,), (1,))))
    for bad_q in (_FakeTensor(4096, dtype=torch.float16),  # dtype
                  _FakeTensor(4096 + 8),  # data_ptr no longer 16-byte aligned
                  _FakeTensor(4096, shape=(5, 16, 576)),  # shape: total_q, the grid
                  _FakeTensor(4096, stride=(9216, 1, 16)),  # strides
                  _FakeTensor(4096, device=1)):  # device
        assert not replay.matches((bad_q, kv2, scale)), bad_q.__dict__
    assert not replay.matches((q, kv2, None))  # a scale where the recording had none, and back
    assert not replay.matches((q, _FakeTensor(1 << 21, torch.bfloat16, (10, 16, 576)), scale))

    def hook(_metadata):
        return None

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not replay.matches((q, kv, scale))
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert replay.matches((q, kv, scale))


def test_a_replay_substitutes_by_identity_launches_as_the_jit_does_and_refuses_views_and_unrecordables():
    q, kv, ws = _FakeTensor(4096), _FakeTensor(1 << 16), _FakeTensor(1 << 24)
    replay, compiled = _replay([q, kv, ws, 7, q, "CONST"], (q, kv, None))
    q2, kv2 = _FakeTensor(1 << 26), _FakeTensor(1 << 27)
    assert replay.try_launch((q2, kv2, None))
    # tensors reach the launcher as their addresses (Triton's C launchers take ints)
    assert compiled.calls == [(2, 3, 1, 77, "FUNCTION", "PACKED", None, None, None,
                               1 << 26, 1 << 27, 1 << 24, 7, 1 << 26, "CONST")]
    assert not replay.try_launch((_FakeTensor(4096 + 4), kv2, None)) and len(compiled.calls) == 1
    view = _FakeTensor(4096)  # another object over q's storage: it would not follow the layer
    assert _replay([q, view], (q,))[0] is None
    assert _replay([_FakeTensor(99)], (q,))[0] is None  # q reaches no launch
    assert LaunchReplay.build([None], (q,)) is None
    assert LaunchReplay.build([], (q,)) is None


# --------------------------------------------------------------------- a step's recording, on fakes
class _FakeReplay:
    def __init__(self, tensors):
        self.sigs = tuple(map(tensor_sig, tensors))
        self.calls = 0

    def try_launch(self, tensors):
        if tuple(map(tensor_sig, tensors)) != self.sigs:
            return False
        self.calls += 1
        return True


def test_a_step_records_at_its_first_layer_replays_the_rest_and_keeps_it_for_the_same_tensors():
    launches = []

    def decode(q, qo_indptr, kv, kv_scale, out, *, record, **_):
        launches.append(q)
        if record is not None:
            record.append("launch")

    replays = []

    def replay_from(record, tensors):
        assert record == ["launch"]
        replays.append(_FakeReplay(tensors))
        return replays[-1]

    spec = CallSpec("bf16", page_size=16, heads=16, max_q_len=1)
    workspace_type = SimpleNamespace(allocate=lambda *args, **kwargs: SimpleNamespace())
    runner = OwnServingRunner("fake", spec, "cpu", decode, workspace_type, 4, {}, replay_from)
    qo, table, lens = torch.arange(3, dtype=torch.int32), torch.zeros((2, 4), dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    kv = torch.zeros((4, 16, 576), dtype=torch.bfloat16)
    qs = [torch.randn((2, 16, 576)).to(torch.bfloat16) for _ in range(3)]
    layer = runner.step(qo, block_table=table, seq_lens=lens)
    for q in qs:
        layer(q, kv)
    assert len(launches) == 1 and len(replays) == 1 and replays[0].calls == 2
    # the next step, made of the same tensor objects: replays from its first layer
    layer = runner.step(qo, block_table=table, seq_lens=lens)
    layer(qs[0], kv)
    assert len(launches) == 1 and replays[0].calls == 3
    # a q the recording does not fit (here: misaligned) takes the runner and records again
    odd = torch.empty(2 * 16 * 576 + 1, dtype=torch.bfloat16)[1:].view(2, 16, 576)
    layer(odd, kv)
    assert len(launches) == 2 and len(replays) == 2
    # a step over another block table object records anew
    layer = runner.step(qo, block_table=table.clone(), seq_lens=lens)
    layer(qs[0], kv)
    assert len(launches) == 3


def test_a_runner_without_a_step_gets_a_plain_per_layer_call():
    calls = []

    def runner(q, qo_indptr, kv, kv_scale, **layout):
        calls.append((q, qo_indptr, kv, kv_scale, layout))
        return q

    layer = runner_step(runner, "QO", block_table="BT", seq_lens="SL")
    assert layer("Q", "KV") == "Q"
    assert calls == [("Q", "QO", "KV", None, dict(kv_indptr=None, block_table="BT", seq_lens="SL",
                                                 q_lens_host=None, kv_lens_host=None))]


# --------------------------------------------------------------------- a graph step, CPU fakes
def test_a_graph_steps_vendor_work_lands_where_the_captured_layers_read_it(monkeypatch):
    """The engine's graph protocol (docs/serving.md): update on the host before each replay
    of a graph that holds the layers. FlashInfer must plan at update (a replay cannot run
    host code); FlashMLA's update enqueues nothing: its schedule is launched by the first
    layer, into fixed buffers, and again by the first layer captured, so the graph holds it."""
    fm = vendor_fakes.install(monkeypatch, "flash_mla", "flashinfer")["flash_mla"]
    import flashinfer.mla as fi
    spec = CallSpec("bf16", page_size=64, heads=16, max_q_len=1, graph=True, host_lengths=True)
    lens = [70, 129, 64]
    first, layers = _layers(spec, lens, [1, 1, 1], 2)
    host = {"q_lens_host": [1, 1, 1], "kv_lens_host": lens}
    fi_plan = DecodePlan(spec, max_batch=4, backend="flashinfer", device="cpu")
    plans = fi.calls["plan"]
    fi_plan.update(first.qo_indptr, **first.layout, **{**host, "kv_lens_host": [n - 1 for n in lens]})
    fi_plan.update(first.qo_indptr, **first.layout, **host)
    assert fi.calls["plan"] == plans + 2  # each update planned, before any layer ran
    fm_plan = DecodePlan(spec, max_batch=4, backend="flashmla", device="cpu")
    capturing = [False]
    monkeypatch.setattr(flash_mla_backend, "_capturing", lambda: capturing[0])
    made, where = fm.calls["get_mla_decoding_metadata"], set()
    first.seq_lens.sub_(1)  # a step at lens - 1, then the sequences grow to lens
    for grow, expected in ((0, 1), (1, 2)):  # step 1: an eager pass, then a captured one
        first.seq_lens.add_(grow)
        fm_plan.update(first.qo_indptr, **first.layout, **{**host, "kv_lens_host": [n - 1 + grow for n in lens]})
        assert fm.calls["get_mla_decoding_metadata"] == made, "a graph step's update launched a schedule"
        for captured in (False, True)[:grow + 1]:
            capturing[0] = captured
            for q, kv in layers:
                assert_close(fm_plan.run(q, kv, first.kv_scale), _ref(first, q, kv), what=f"flashmla step {grow}")
            where.add(tuple(t.data_ptr() for t in fm_plan._layer.sched))
        made += expected
        assert fm.calls["get_mla_decoding_metadata"] == made  # once per pass: first layer, first captured layer
    assert len(where) == 1, "FlashMLA's schedule moved between steps: a graph would read stale memory"


# --------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("backend,kv_format,q_mode", [
    ("triton", "bf16", None), ("triton", "fp8", None), ("triton", "fp8", "fp8_dynamic"),
    ("triton_fused", "bf16", None), ("triton_fused", "fp8", None)])
def test_replayed_launches_are_bit_identical_to_the_jit_launch_across_layers(backend, kv_format, q_mode):
    spec = CallSpec(kv_format, page_size=64, heads=128, max_q_len=1)
    decoder = Decoder(spec, backend=backend, device="cuda")
    if q_mode is not None:
        decoder = Decoder(spec, variant=decoder.variant.with_params(q=q_mode), device="cuda")
    runner = decoder.runner
    first, layers = _layers(spec, GPU_LENS, [1] * 8, 3, device="cuda")
    step = runner.step(first.qo_indptr, **first.layout)
    outs = [step(q, kv, first.kv_scale).clone() for q, kv in layers]
    assert step.fast is not None, "the first layer was not recorded"
    for i, ((q, kv), out) in enumerate(zip(layers, outs, strict=True)):
        plain = runner(q, first.qo_indptr, kv, first.kv_scale, **first.layout)
        assert torch.equal(out, plain), f"layer {i}: the replay differs from the JIT launch"
    q_format = "fp8" if str(decoder.variant.get("q")).startswith("fp8") else "bf16"
    assert_close(outs[2], _ref(first, *layers[2], q_format), what="layer 2")
    # a misaligned q (a view 2 bytes into a buffer) does not fit the recording: JIT path
    q = layers[1][0]
    odd = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    odd.copy_(q)
    recorded = step.fast[0]
    assert not recorded.matches((odd, layers[1][1], first.kv_scale))
    out = step(odd, layers[1][1], first.kv_scale).clone()
    assert step.fast[0] is not recorded, "the misaligned q did not take the JIT path"
    assert torch.equal(out, runner(odd, first.qo_indptr, layers[1][1], first.kv_scale, **first.layout))
    assert_close(out, _ref(first, odd, layers[1][1], q_format), what="misaligned q")
    # and an aligned layer after it is right again (recorded anew)
    assert torch.equal(step(*layers[2], first.kv_scale), outs[2])


def _bind_me(A, b, C: triton.language.constexpr, D: triton.language.constexpr = 3):
    pass


def test_a_record_holds_every_parameter_in_signature_order_with_defaults(monkeypatch):
    """What JITFunction.run's binder passes to the launcher: constexprs and defaults
    included, compile options (num_warps) left out; and this Triton's JITFunction.run still
    binds and launches as launch.py replays it (3.6 / 3.9)."""
    source = "".join(inspect.getsource(JITFunction.run).split())
    assert launch._ln_JIT_BIND in source and launch._ln_JIT_LAUNCH in source, triton.__version__

    monkeypatch.setattr(launch, "replay_unsupported", lambda: None)
    driver = SimpleNamespace(active=SimpleNamespace(get_current_stream=lambda device: 5, get_current_device=lambda: 0))
    monkeypatch.setattr(triton.runtime, "driver", driver)
    a, compiled = torch.zeros(4), _FakeCompiled()
    rec = launch._ln_record(JITFunction(_bind_me), (2, 3), compiled, (a, 5), {"C": 7, "num_warps": 4})
    assert rec.values == [a, 5, 7, 3] and rec.grid == (2, 3, 1) and rec.device == 0
    assert launch._ln_record(JITFunction(_bind_me), lambda meta: (1,), compiled, (a, 5), {"C": 7}) is None
