"""FlashMLA, FlashInfer and AITER's serving call against the fp32 reference through tests/fakes:
declared cells run, the rest are refused. A padded slot of length 0, for every backend (the own
kernels' too); on the H200 (`-m gpu`) the vendors' on the GPU."""

import contextlib
import sys

import pytest
import torch

from mla_tune import gpu
from mla_tune.backends import aiter_mla, flash_mla, flashinfer_mla, get_backend
from mla_tune.core import CallSpec, Variant
from mla_tune.serving import inputs as serving
from tests.helpers import (
    assert_close,
    call_with_host_lengths,
    cell_id,
    cell_spec,
    declared_cells,
    max_error,
    serving_expected,
    serving_input,
    vendor_fakes,
)

BACKENDS = {"flashmla": flash_mla, "flashinfer": flashinfer_mla, "aiter": aiter_mla}
PACKAGES = {"flashmla": "flash_mla", "flashinfer": "flashinfer", "aiter": "aiter"}
KV_LENS = [3000, 1, 17, 63, 64, 65]
H200 = gpu.fake_platform("H200")

SERVED = [c for name in BACKENDS for c in declared_cells(name)]
# FlashMLA's fp8 cells at 128 heads and q_len 2 or 4 are left out on the CPU (their q quantizer
# takes ~100 s under the interpreter); their wiring is checked by the neighbouring cells.
CPU_SERVED = [c for c in SERVED if not (c[0] == "flashmla" and c[2] == 128 and c[3] > 1 and c[4] == "fp8")]
REFUSED = [c for name in BACKENDS for c in declared_cells(name, served=False)]


def _install(monkeypatch, name: str, **settings):
    return vendor_fakes.install(monkeypatch, PACKAGES[name], **settings)[PACKAGES[name]]


def _expected(variant: Variant, inp: serving.ServingInput) -> torch.Tensor:
    """The reference on q as the variant's q mode sees it. AITER's dynamic scale stays fp32
    (FlashMLA's rounds to bf16): a static scale of this call's amax is the same."""
    if variant.backend == "aiter" and variant.get("q") == "fp8_dynamic":
        return inp.reference("fp8_static", float(inp.q.abs().amax()))
    return serving_expected(variant, inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, max_error: float, what: str) -> None:
    """The call's rows of a runner's output buffer (it may hold more) against ref."""
    assert_close(out[:ref.shape[0]], ref, max_error, what)


def _runner(name, *cell, platform=H200, device="cpu", **extra):
    """The cell's spec, its default serving variant and that variant's runner."""
    spec = cell_spec(name, *cell, **extra)
    variant = get_backend(name).default_serving_variant(spec, platform)
    return spec, variant, get_backend(name).build_serving(variant, spec, device)


def _any_runner(monkeypatch, device, name, *cell, **extra):
    """_runner's three, then where it runs: a vendor through its fake on a fake H200 (on the
    CPU), an own kernel as the tests' device runs it (extra: the spec's, graph=True say)."""
    if name in PACKAGES:
        _install(monkeypatch, name)
        return (*_runner(name, *cell, **extra), "cpu")
    return (*_runner(name, *cell, platform=gpu.detect(), device=device, **extra), device)


@contextlib.contextmanager
def _host_reads_refused():
    """Reading a tensor's values on the host raises when mla-tune's code (not a fake, nor the
    references the fakes answer with) does it."""
    with pytest.MonkeyPatch.context() as patched:
        for method in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "__iter__"):
            original = getattr(torch.Tensor, method)

            def guarded(self, *args, _original=original, _method=method, **kwargs):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                references = ("mla_tune.serving.inputs", "mla_tune.problem")
                assert not caller.startswith("mla_tune.") or caller in references, f"{caller} called Tensor.{_method}"
                return _original(self, *args, **kwargs)

            patched.setattr(torch.Tensor, method, guarded)
        yield


def _run_case(name, layout, heads, q_len, kv, platform, seed=17):
    """The cell's default serving variant, called twice (the first answer poisoned with NaN),
    its runner reading no tensor on the host."""
    spec, variant, runner = _runner(name, layout, heads, q_len, kv, platform=platform)
    inp = serving_input(spec, KV_LENS, seed, "cpu")
    with _host_reads_refused():
        call_with_host_lengths(runner, inp).fill_(float("nan"))
        out = call_with_host_lengths(runner, inp)
    _assert_close(out, _expected(variant, inp), max_error(variant, "cpu"), cell_id((name, layout, heads, q_len, kv)))


# ------------------------------------------------------------------ what is declared
def test_each_backend_declares_the_layouts_its_library_reads():
    """The facts read from the libraries' sources (see each module's docstring)."""
    fm, fi, ai = flash_mla.CAPABILITIES, flashinfer_mla.CAPABILITIES, aiter_mla.CAPABILITIES
    assert (fm.contiguous, fm.page_sizes, fm.mixed_q_len, fm.graph_safe, fm.host_lengths) == (
        False, (64,), False, True, False)
    assert (fi.contiguous, fi.mixed_q_len, fi.host_lengths) == (True, True, True)
    assert {1, 16, 64} <= set(fi.page_sizes)
    assert (ai.contiguous, ai.page_sizes, ai.heads, ai.mixed_q_len) == (True, (1,), (16, 128), False)
    assert fi.runs_on(H200.tags) and fm.runs_on(H200.tags) and not ai.runs_on(H200.tags)
    assert ai.runs_on(gpu.fake_platform("MI355X").tags)
    for caps in (fm, fi, ai):
        assert caps.serving and caps.max_q_len >= 4 and set(caps.kv_formats) >= {"bf16", "fp8"}


@pytest.mark.parametrize("case", REFUSED, ids=cell_id)
def test_build_serving_refuses_what_the_capabilities_refuse(case, monkeypatch):
    name, *cell = case
    _install(monkeypatch, name)
    backend, spec = BACKENDS[name], cell_spec(name, *cell)
    served = cell_spec(name, 64 if name == "flashmla" else 0, 16, 1, cell[3])
    variant = backend.default_serving_variant(served, H200)
    with pytest.raises(ValueError, match=f"{name} cannot serve"):
        backend.build_serving(variant, spec, "cpu")
    with pytest.raises(ValueError, match=f"{name} cannot serve"):
        backend.default_serving_variant(spec, H200)


# ------------------------------------------------------------ the call, on the CPU
@pytest.mark.parametrize("case", SERVED, ids=cell_id)
def test_declared_cells_default_variants_validate_and_match_the_reference_through_the_fakes(case, monkeypatch):
    """And a variant for the other KV format is refused, naming the fix."""
    name, *cell = case
    _install(monkeypatch, name)
    backend = BACKENDS[name]
    variant = backend.default_serving_variant(cell_spec(name, *cell), H200)
    backend.validate(variant)
    assert variant.backend == backend.NAME and variant.get("kv") == cell[3]  # it reads the call's KV
    if cell[3] == "fp8":
        bf16_variant = backend.default_serving_variant(cell_spec(name, *cell[:3], "bf16"), H200)
        with pytest.raises(ValueError, match="make the variant with kv=fp8"):
            backend.build_serving(bf16_variant, cell_spec(name, *cell), "cpu")
    if case in CPU_SERVED:  # the cells run here (see CPU_SERVED)
        _run_case(name, *cell, platform=H200 if name != "aiter" else gpu.fake_platform("MI355X"))


def test_the_newer_aiter_fake_serves_too(monkeypatch):
    monkeypatch.setenv("MLA_TUNE_FAKE_AITER_VERSION", "0.1.20.post1")
    _install(monkeypatch, "aiter")
    for cell in ((0, 128, 2, "fp8"), (1, 16, 4, "bf16")):
        _run_case("aiter", *cell, platform=gpu.fake_platform("MI355X"))


def test_flash_mla_answers_a_static_q_scale_and_counts_saturation(monkeypatch):
    _install(monkeypatch, "flashmla")
    spec = cell_spec("flashmla", 64, 32, 2, "fp8")
    inp = serving_input(spec, KV_LENS, 5, "cpu")
    variant = Variant.make("flashmla", kv="fp8", q="fp8_static", q_amax=0.8 * float(inp.q.abs().amax()))
    runner = flash_mla.build_serving(variant, spec, "cpu")
    _assert_close(call_with_host_lengths(runner, inp), _expected(variant, inp), 1e-2, "fp8_static")
    assert int(runner.q_saturation) > 0


@pytest.mark.parametrize("name", ["flashmla", "aiter"])
def test_one_q_len_per_call_backends_refuse_a_ragged_one(name, monkeypatch):
    _install(monkeypatch, name)
    layout = 64 if name == "flashmla" else 0
    _, _, runner = _runner(name, layout, 16, 2, "bf16")
    inp = serving.make_input([2, 1, 2], [40, 70, 9], 16, layout, "bf16", seed=3)  # 5 rows, 3 sequences
    with pytest.raises(ValueError, match="same q_len"):
        call_with_host_lengths(runner, inp)


@pytest.mark.parametrize("layout", [0, 16])
def test_flashinfer_replans_only_when_the_lengths_or_the_page_array_change(layout, monkeypatch):
    """Also: a call without host lengths, or with too few, is refused."""
    calls = _install(monkeypatch, "flashinfer").mla.calls
    spec, _, runner = _runner("flashinfer", layout, 16, 2, "fp8")
    inp = serving_input(spec, [40, 5, 70], 3, "cpu")
    with pytest.raises(ValueError, match="pass q_lens_host and kv_lens_host"):
        runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    with pytest.raises(ValueError, match="one entry per sequence"):
        runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout,
               q_lens_host=inp.q_lens[:2], kv_lens_host=inp.kv_lens)
    assert calls["plan"] == calls["run"] == 0
    for _ in range(3):
        call_with_host_lengths(runner, inp)
    assert (calls["plan"], calls["run"]) == (1, 3)
    longer = serving_input(spec, [41, 6, 71], 3, "cpu")
    _assert_close(call_with_host_lengths(runner, longer), longer.reference(), 1e-2, "new lengths")
    assert calls["plan"] == 2
    if layout:  # another block table (a new tensor) is another page array
        inp2 = serving_input(spec, [41, 6, 71], 4, "cpu")
        _assert_close(call_with_host_lengths(runner, inp2), inp2.reference(), 1e-2, "new table")
        assert calls["plan"] == 3
    runner.plan(longer.q, longer.qo_indptr, longer.kv, longer.kv_scale, **longer.layout,
                q_lens_host=longer.q_lens, kv_lens_host=longer.kv_lens)
    assert calls["run"] == 3 + 1 + bool(layout)  # plan() alone runs nothing


def test_flashinfer_plans_uniform_steps_from_index_arrays_made_once_and_keeps_a_graphs_grid(monkeypatch):
    """A uniform q_len's qo_indptr and a block table's row starts are host tensors made once
    per (step, batch) and passed again unchanged; a ragged step's are its running sums. A graph
    runner refuses a replan that changes its launch grid (32 heads: q_len 1 packs 32 rows per
    request, 1-CTA clusters; q_len 4 packs 128, 2)."""
    fi = _install(monkeypatch, "flashinfer")
    seen = []
    plan = fi.mla.BatchMLAPagedAttentionWrapper.plan

    def recording(self, qo_indptr, kv_indptr, *args, **kw):
        seen.append((qo_indptr, kv_indptr))
        return plan(self, qo_indptr, kv_indptr, *args, **kw)
    monkeypatch.setattr(fi.mla.BatchMLAPagedAttentionWrapper, "plan", recording)
    spec = CallSpec("bf16", page_size=16, heads=16, max_q_len=2, host_lengths=True)  # one q_len a step
    runner = flashinfer_mla.build_serving(flashinfer_mla.default_serving_variant(spec, H200), spec, "cpu")
    for seed, lens in ((1, [40, 5, 70]), (2, [41, 6, 71])):
        inp = serving.make_input([2, 2, 2], lens, 16, 16, "bf16", seed=seed)
        _assert_close(call_with_host_lengths(runner, inp), inp.reference(), 1e-2, f"lengths {lens}")
    (qo1, kv1), (qo2, kv2) = seen
    width = inp.layout["block_table"].shape[1]
    assert qo1 is qo2 and qo1.tolist() == [0, 2, 4, 6]
    assert kv1 is kv2 and kv1.tolist() == [0, width, 2 * width, 3 * width]
    _, _, mixed = _runner("flashinfer", 16, 16, 2, "bf16")  # ragged q_len
    ragged = serving.make_input([2, 1, 2], [40, 5, 70], 16, 16, "bf16", seed=3)
    _assert_close(call_with_host_lengths(mixed, ragged), ragged.reference(), 1e-2, "ragged q_lens")
    assert seen[-1][0].tolist() == [0, 2, 3, 5]
    _, _, runner = _runner("flashinfer", 0, 32, 4, "bf16", graph=True)
    short = serving.make_input([1, 1], [40, 9], 32, 0, "bf16", seed=1)
    long = serving.make_input([4, 4], [40, 9], 32, 0, "bf16", seed=1)
    call_with_host_lengths(runner, short)
    with pytest.raises(ValueError, match="launch grid"):
        call_with_host_lengths(runner, long)
    _, _, eager = _runner("flashinfer", 0, 32, 4, "bf16")  # nothing replays an eager runner's grid
    for inp in (short, long):
        _assert_close(call_with_host_lengths(eager, inp), inp.reference(), 1e-2, "eager, either grid")


@pytest.mark.parametrize("name,layout", [("triton", 16), ("triton_fused", 16), ("flashinfer", 0),
                                         ("flashinfer", 16), ("aiter", 0), ("aiter", 1)])
def test_the_output_buffer_is_reused_and_grows_only_for_more_rows(name, layout, monkeypatch, device):
    """The same buffer for the same and for fewer new tokens; a larger call grows it once and
    the smaller calls after it keep the grown one."""
    _, variant, runner, where = _any_runner(monkeypatch, device, name, layout, 16, 1, "fp8")
    big, small = (serving.make_input([1] * n, [30 + i for i in range(n)], 16, layout, "fp8", seed=n,
                                     device=where) for n in (5, 3))
    first = call_with_host_lengths(runner, big).data_ptr()
    for inp in (big, small):
        out = call_with_host_lengths(runner, inp)
        assert out.data_ptr() == first
    _assert_close(out, _expected(variant, small), 1e-2, "fewer rows")
    larger = serving.make_input([1] * 9, [20] * 9, 16, layout, "fp8", seed=9, device=where)
    grown = call_with_host_lengths(runner, larger)
    assert grown.shape[0] == 9 and grown.data_ptr() != first
    for inp in (larger, big):
        assert call_with_host_lengths(runner, inp).data_ptr() == grown.data_ptr()


@pytest.mark.parametrize("graph", [False, True])
def test_flash_mla_schedules_each_call_and_keeps_it_at_fixed_addresses_only_for_a_graph(graph, monkeypatch):
    """Every call and every step launches FlashMLA's schedule on the device. A graph's layers
    replay with the schedule's addresses of the capture, so a graph runner copies each step's
    schedule into buffers it keeps; an eager runner's layers read the schedule as FlashMLA
    made it (no copy)."""
    fm = _install(monkeypatch, "flashmla")
    made = []
    original = fm.get_mla_decoding_metadata

    def recording(*args, **kw):
        made.append(original(*args, **kw))
        return made[-1]
    monkeypatch.setattr(fm, "get_mla_decoding_metadata", recording)
    spec, _, runner = _runner("flashmla", 64, 16, 1, "bf16", graph=graph)
    addresses = []
    for seed, lens in ((1, [40, 70]), (2, [130, 1])):
        inp = serving_input(spec, lens, seed, "cpu")
        _assert_close(call_with_host_lengths(runner, inp), inp.reference(), 1e-2, f"lengths {lens}")
        step = runner.step(inp.qo_indptr, **inp.layout, q_lens_host=inp.q_lens, kv_lens_host=inp.kv_lens)
        _assert_close(step(inp.q, inp.kv, inp.kv_scale), inp.reference(), 1e-2, f"step, lengths {lens}")
        addresses.append(tuple(t.data_ptr() for t in step.sched))
        assert (step.sched[0] is made[-1][0]) == (not graph)
    assert (addresses[0] == addresses[1]) == graph
    assert fm.calls == {"get_mla_decoding_metadata": 4, "flash_mla_with_kvcache": 4}


# The vendors through their fakes and the own kernels (graph specs) where the tests run; then,
# last in the file with FlashMLA's fp8 last of all (a crash takes the CUDA context), the
# vendors on the H200.
PADDED_SLOT_CASES = [pytest.param(case, False, id=cell_id(case)) for case in [
    ("triton", 16, 16, 1, "fp8"), ("triton_fused", 16, 16, 1, "fp8"),
    ("flashmla", 64, 16, 1, "fp8"), ("flashinfer", 16, 16, 1, "bf16"), ("aiter", 1, 16, 1, "bf16")]] + [
    pytest.param(case, True, marks=pytest.mark.gpu, id=f"h200-{cell_id(case)}") for case in [
        ("flashinfer", 16, 128, 2, "bf16"), ("flashmla", 64, 16, 2, "bf16"),
        ("flashmla", 64, 16, 2, "fp8")]]


@pytest.mark.parametrize("case, h200", PADDED_SLOT_CASES)
def test_a_padded_slot_with_seq_len_0_spoils_no_other_row(case, h200, monkeypatch, device):
    """A graph padded past the live batch carries seq_len 0: every other sequence is right
    (and on the H200 nothing crashes)."""
    if h200:
        assert (reason := BACKENDS[case[0]].unavailable_reason()) is None, reason
        spec, variant, runner = _runner(*case, platform=gpu.detect(), device="cuda")
        where = "cuda"
    else:
        extra = {} if case[0] in PACKAGES else {"graph": True}
        spec, variant, runner, where = _any_runner(monkeypatch, device, *case, **extra)
    inp = serving_input(spec, [40, 5, 70], 23, where)
    ref = _expected(variant, inp)
    inp.seq_lens[1] = 0
    inp.kv_lens[1] = 0
    out = call_with_host_lengths(runner, inp)
    if where == "cuda":
        torch.cuda.synchronize()
    rows = [r for b in (0, 2) for r in range(sum(inp.q_lens[:b]), sum(inp.q_lens[: b + 1]))]
    _assert_close(out[rows], ref[rows], max_error(variant, where), "live sequences")
