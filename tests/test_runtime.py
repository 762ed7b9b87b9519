"""The runtime and the Dispatcher: table dispatch, input checks and out-of-range table parameters
refused in one line before any build, no timing, and one fallback policy (mla_tune.tables.dispatch)
that passes the table's rule at short lengths (kv_len 1, 2, 17, 63) in the runtime and the exported
file, its split count asked of the device."""

import re
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import yaml

import mla_tune.tune.timing
from mla_tune import core, runtime
from mla_tune.backends import get_backend, ragged_backends, triton_splitk
from mla_tune.core import Shape, Variant
from mla_tune.export import export_submission
from mla_tune.problem import RULES, check, generate_input, reference
from mla_tune.tables.dispatch import DISPATCH_FALLBACKS, Dispatcher, dispatch_fallback
from mla_tune.tables.table import TableError
from tests.helpers import REPO, cpu_table, exported_outputs, ragged_input

RULE = RULES["leaderboard"]
STRICT = RULES["strict"]
TORCH = Variant.make("torch", kv="bf16", q="bf16")


@pytest.fixture
def rt(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching table loads silently
        return runtime.load(table=cpu_table(tmp_path), device="cpu")


def _assert_correct(out, data, kv_format):
    result = check(out, reference(data, q_format="bf16", kv_format=kv_format), RULE)
    assert result.passed, result.reason
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (data[0].shape[0], 16, 512)


class _Spy:
    """A builder that records what it built and whose runner returns a marker; `dispatcher`
    serves a row of `variant` (torch by default) at `row` (1 x 8), and it elsewhere, through it."""

    def __init__(self):
        self.built: list[tuple[Variant, Shape]] = []
        self.calls = 0

    def __call__(self, variant, shape, device):
        self.built.append((variant, shape))

        def runner(q, kv_data, qo_indptr, kv_indptr):
            self.calls += 1
            return "ran"

        return runner

    def dispatcher(self, variant=TORCH, row=(1, 8)):
        return Dispatcher({row: variant}, {variant.backend: self}, lambda shape: variant,
                          warn_on_miss=False, ragged_backends=frozenset())


def test_table_rows_run_their_variants_other_shapes_the_counted_fallback_and_nothing_is_timed(rt, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the runtime must never time anything")

    monkeypatch.setattr(mla_tune.tune.timing, "time_call", forbidden)
    monkeypatch.setattr(mla_tune.tune.timing, "wall_time", forbidden)
    monkeypatch.setattr(torch.cuda, "Event", forbidden)
    # (1, 8): a torch winner; (2, 40): a triton fp8 winner; each through both entry points
    for seed, (batch, kv_len, kv_format) in enumerate([(1, 8, "bf16"), (2, 40, "fp8")], 1):
        data = generate_input(batch, kv_len, seed=seed, device="cpu")
        _assert_correct(rt.decode(*data[:4]), data, kv_format)
        _assert_correct(rt.custom_kernel(data), data, kv_format)
    assert {key[0].backend for key in rt.dispatcher._runners} == {"torch", "triton"}
    assert rt.dispatcher.misses == {}
    data = generate_input(2, 24, seed=3, device="cpu")
    with pytest.warns(UserWarning, match=r"a shape the table lacks \(2x24\); running the fallback triton\("):
        out = rt.custom_kernel(data)
    _assert_correct(out, data, "fp8")
    expected = get_backend("triton").default_variant(Shape(2, 24))  # the table's rule: leaderboard
    assert rt.dispatcher.variant_for(2, 24) == expected
    ragged = ragged_input([5, 17, 9], seed=4, device="cpu")
    with pytest.warns(UserWarning, match=r"a ragged batch \(3x17\)"):
        out = rt.decode(*ragged[:4])
    _assert_correct(out, ragged, "fp8")
    # A table row without a winner (3 x 16) goes to the fallback too.
    data = generate_input(3, 16, seed=5, device="cpu")
    with pytest.warns(UserWarning, match="3x16"):
        _assert_correct(rt.decode(*data[:4]), data, "fp8")
    assert rt.dispatcher.misses == {Shape(2, 24): 1, Shape(3, 17): 1, Shape(3, 16): 1}


def test_runners_are_built_lazily_once_per_shape_and_a_miss_is_counted_every_time():
    spy = _Spy()
    dispatcher = spy.dispatcher()
    assert spy.built == []
    data = generate_input(1, 8, seed=1, device="cpu")
    for _ in range(3):
        assert dispatcher(*data[:4]) == "ran"
        assert dispatcher(*data[:4], kv_len=8, check_indptr=False) == "ran"
    # a repeated tuned call takes the fast path, to the same runner
    assert dispatcher._fast and spy.built == [(TORCH, Shape(1, 8))] and spy.calls == 6
    other = generate_input(2, 8, seed=1, device="cpu")
    dispatcher(*other[:4])
    for _ in range(2):  # a shape the table lacks never takes the fast path
        dispatcher(*other[:4], kv_len=8, check_indptr=False)
    assert spy.built == [(TORCH, Shape(1, 8)), (TORCH, Shape(2, 8))]
    assert dispatcher.misses == {Shape(2, 8): 3}


def test_a_ragged_batch_runs_only_on_a_backend_whose_record_reads_kv_indptr():
    backend, torch_fallback = runtime.fallback_policy("leaderboard", allowed=["torch"])
    assert backend == "torch" and torch_fallback(Shape(3, 3)) == TORCH
    with pytest.raises(ValueError, match="only aiter are allowed; allow one of them"):
        runtime.fallback_policy(allowed=["aiter"])
    fused = Variant.make("triton_fused", kv="fp8", q="bf16", num_splits=1, block_n=32)
    split = Variant.make("triton", kv="fp8", q="bf16", num_splits=1, block_n=32)
    ragged = ragged_input([3, 5], seed=1, device="cpu")
    uniform = generate_input(2, 5, seed=1, device="cpu")

    def spy_dispatcher(spy, fallback, names):
        """Backends `names` built by spy, the ragged readers among them as their records say."""
        return Dispatcher({}, dict.fromkeys(names, spy), fallback, warn_on_miss=False,
                          ragged_backends=ragged_backends(names))

    refused = r"a ragged batch needs a fallback that reads kv_indptr per sequence \(no backend wired here does\)"
    for fallback, names in [(torch_fallback, ["torch"]), (lambda shape: fused, ["triton_fused", "torch"])]:
        spy = _Spy()
        with pytest.raises(ValueError, match=refused):
            spy_dispatcher(spy, fallback, names)(*ragged[:4])
        assert spy.built == []
    spy = _Spy()
    assert spy_dispatcher(spy, lambda shape: split, ["triton"])(*ragged[:4]) == "ran"
    assert spy.built == [(split, Shape(2, 5))]
    assert spy_dispatcher(spy, lambda shape: fused, ["triton_fused"])(*uniform[:4]) == "ran"


def _bad_inputs():
    """(name, edit of (q, kv_data, qo_indptr, kv_indptr, config), expected message, the
    check_indptr setting the message is matched with)."""
    def short_kv(d):
        return (d[0], {**d[1], "bf16": d[1]["bf16"][:-1].contiguous()}, *d[2:])

    def ptr(index, value):
        return lambda d: tuple(value(x) if i == index else x for i, x in enumerate(d))

    def noncontiguous_q(d):  # every other column of a zeroed buffer twice as wide
        wide = torch.zeros((*d[0].shape[:2], 2 * d[0].shape[2]), dtype=torch.bfloat16)
        return (wide[:, :, ::2].copy_(d[0]), *d[1:])

    return [
        ("q dtype", lambda d: (d[0].float(), *d[1:]), "q must be bfloat16, got torch.float32", False),
        ("q shape", lambda d: (d[0][:, :, :512].contiguous(), *d[1:]), r"q must have shape \(batch, 16, 576\)", False),
        ("q layout", noncontiguous_q, "q must be contiguous", False),
        ("q device", lambda d: (torch.empty(d[0].shape, dtype=torch.bfloat16, device="meta"), *d[1:]),
         "KV is on cpu but q is on meta", False),
        ("kv missing", lambda d: (d[0], {k: v for k, v in d[1].items() if k != "bf16"}, *d[2:]),
         "kv_data lacks the 'bf16' entry", False),
        ("kv total", short_kv, r"holds 7 tokens, not batch x kv_len = 1 x 8 = 8", False),
        ("kv total synced", short_kv, "kv_indptr ends at 8 but the KV cache holds 7 tokens", True),
        ("indptr dtype", ptr(3, lambda p: p.long()), "kv_indptr must be int32, got torch.int64", False),
        ("indptr length", ptr(3, lambda p: torch.cat([p, p[-1:]])), r"kv_indptr must have shape \(2,\)", False),
        ("qo_indptr values", ptr(2, lambda p: p * 2), "qo_indptr must be 0,1,2", True),
    ]


@pytest.mark.parametrize(("name", "edit", "message", "check_indptr"), _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise_before_any_kernel_is_built(name, edit, message, check_indptr):
    spy = _Spy()
    dispatcher = spy.dispatcher()
    data = edit(generate_input(1, 8, seed=1, device="cpu"))
    with pytest.raises(ValueError, match=message):
        dispatcher(*data[:4], kv_len=8, check_indptr=check_indptr)
    with pytest.raises(ValueError):
        dispatcher(*data[:4])  # the host-side indptr check finds it as well
    assert spy.built == [] and spy.calls == 0


def test_indptr_that_disagrees_with_the_tensors_is_refused(rt):
    q, kv_data, qo, kv_indptr, config = generate_input(1, 8, seed=1, device="cpu")
    with pytest.raises(ValueError, match="kv_len=4 but kv_indptr gives 8"):
        rt.decode(q, kv_data, qo, kv_indptr, kv_len=4)
    with pytest.raises(ValueError, match=r'config\["batch_size"\] is 3 but q holds 1'):
        rt.custom_kernel((q, kv_data, qo, kv_indptr, {**config, "batch_size": 3}))
    with pytest.raises(ValueError, match="check_indptr=False needs kv_len"):
        rt.decode(q, kv_data, qo, kv_indptr, check_indptr=False)
    meta = torch.empty(q.shape, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="q must be on cpu, the device this runtime was loaded for"):
        rt.decode(meta, kv_data, qo, kv_indptr)


FP8_TRITON = Variant.make("triton", block_n=16, dot_dtype="fp16", kv="fp8", num_splits=1, num_stages=1,
                          num_warps=4, q="bf16")
MXFP4_FUSED = Variant.make("triton_fused", kv="mxfp4", q="bf16", qk_dot="fp16", pv_dot="fp16", tok_m=True,
                           block_n=16, num_warps=4, num_stages=1, num_splits=1, reduce="none")


@pytest.mark.parametrize("check_indptr", [False, True])
def test_fp8_kv_as_uint8_bytes_and_a_python_float_scale_are_refused_in_one_line(check_indptr):
    spy, fused_spy = _Spy(), _Spy()
    dispatcher, fused = spy.dispatcher(FP8_TRITON), fused_spy.dispatcher(MXFP4_FUSED)
    data = generate_input(1, 8, seed=1, device="cpu")
    kv8, scale = data[1]["fp8"]

    def call(fmt, entry, to=dispatcher):
        """`to` called on data with kv_data[fmt] replaced by entry."""
        return to(data[0], {**data[1], fmt: entry}, *data[2:4], kv_len=8, check_indptr=check_indptr)

    with pytest.raises(ValueError, match=r"fp8 KV must have an fp8 dtype .*got torch\.uint8; pass fp8 bytes "
                                         r"held as torch\.uint8 as kv\.view\(torch\.float8_e4m3fn\)"):
        call("fp8", (kv8.view(torch.uint8), scale))  # how vLLM keeps an fp8 cache
    for other in (torch.int8, torch.float8_e5m2):  # other bytes are not e4m3 codes either
        with pytest.raises(ValueError, match="fp8 KV must have an fp8 dtype"):
            call("fp8", (kv8.view(other), scale))
    for bad in (float(scale), None, [float(scale)]):
        with pytest.raises(ValueError, match=r"fp8 KV scale must be a \(1,\) float32 tensor on q's device, got "
                                             r"\w+; make it once with torch\.tensor\(\[scale\]"):
            call("fp8", (kv8, bad))
    with pytest.raises(ValueError, match="kv_data\\[\"fp8\"\\]\\[0\\] must be a tensor, got float"):
        call("fp8", (1.0, scale))
    with pytest.raises(ValueError, match="mxfp4 scales must be a .* tensor of E8M0 bytes, got float"):
        call("mxfp4", (data[1]["mxfp4"][0], 1.0), to=fused)
    assert spy.built == [] and fused_spy.built == []
    assert call("fp8", (kv8.view(torch.uint8).view(torch.float8_e4m3fn), scale)) == "ran"


def test_the_entry_reuses_the_runner_for_the_same_inputs_checks_anything_new_and_misses_uncached():
    spy = _Spy()

    def entry():
        return runtime.Runtime(table=None, platform=None, fallback_backend="triton",
                               dispatcher=spy.dispatcher(FP8_TRITON, row=(4, 64)))

    rt = entry()
    data = generate_input(4, 64, 5, device="cpu")  # (q, kv_data, qo, kv_indptr, config)
    for _ in range(3):
        rt.custom_kernel(data)
    assert spy.calls == 3 and rt._last is not None and rt._last[8] is not None
    # The same objects with another kv_seq_len: checked again, and refused with its message.
    with pytest.raises(ValueError, match=r"holds 256 tokens, not batch x kv_len .* config\[\"kv_seq_len\"\]"):
        rt.custom_kernel((*data[:4], {**data[4], "kv_seq_len": 65}))
    assert rt._last is None  # a failed call leaves nothing to reuse
    assert not rt.dispatcher.misses  # named before the lookup: not a shape the table lacks
    # The KV entry swapped inside the same dict: checked, refused.
    rt.custom_kernel(data)
    kv, scale = data[1]["fp8"]
    data[1]["fp8"] = (kv.view(torch.uint8), scale)
    with pytest.raises(ValueError, match="fp8 KV must have an fp8 dtype"):
        rt.custom_kernel(data)
    data[1]["fp8"] = (kv, scale)
    # Anything new after a good call: the dispatcher's fast path refuses what the full path
    # refuses, with its message; a config whose batch_size disagrees with q too.
    for spoiled, words in [((data[0].float(), *data[1:]), "q must be bfloat16"),
                           ((data[0], {**data[1], "fp8": (kv.view(torch.uint8), scale)}, *data[2:]),
                            "fp8 KV must have an fp8 dtype"),
                           ((data[0], {**data[1], "fp8": (kv, scale.double())}, *data[2:]),
                            "fp8 KV scale must be one float32 value"),
                           ((*data[:2], data[2].long(), *data[3:]), "qo_indptr must be int32"),
                           ((data[0], {**data[1], "fp8": (kv[:-1], scale)}, *data[2:]),
                            "holds 255 tokens, not batch x kv_len"),
                           ((*data[:4], {**data[4], "batch_size": 5}), 'config\\["batch_size"\\] is 5')]:
        rt.custom_kernel(data)
        with pytest.raises(ValueError, match=words):
            rt.custom_kernel(spoiled)
    # no shortcut for a shape the table lacks
    rt = entry()
    other = generate_input(2, 64, 6, device="cpu")
    for _ in range(3):
        rt.custom_kernel(other)
    assert rt._last is None and sum(rt.dispatcher.misses.values()) == 3


def _table_with(tmp_path, variant: Variant):
    def edit(data):
        data["rows"][1]["winner"] = {"variant": str(variant), "backend": variant.backend, "params": variant.p}
        data["rows"][1]["alternates"] = {variant.backend: {"variant": str(variant), "time_us": 8.0}}
        data["rows"][1]["backends"] = {variant.backend: 8.0}

    return cpu_table(tmp_path, edit=edit)


FUSED = Variant.make("triton_fused", kv="fp8", q="bf16", qk_dot="fp16", pv_dot="fp16", tok_m=True, block_n=32,
                     num_warps=4, num_stages=3, num_splits=2, reduce="last")


@pytest.mark.parametrize(("variant", "message"), [
    (FP8_TRITON.with_params(num_splits=1000000000), "num_splits=1000000000 is not allowed; num_splits must be an "
                                                    "int from 1 to 256"),
    (FP8_TRITON.with_params(block_n=1 << 20), "block_n must be a power of two from 16 to 256"),
    (FP8_TRITON.with_params(num_warps=64), "num_warps must be a power of two from 1 to 32"),
    (FP8_TRITON.with_params(num_stages=100), "num_stages must be an int from 1 to 8"),
    (FP8_TRITON.with_params(waves_per_eu=1000), "waves_per_eu must be an int from 0 to 16"),
    (FUSED.with_params(num_splits=1000000000), "num_splits must be an int from 1 to 256"),
    (FUSED.with_params(num_stages=99), "num_stages must be an int from 1 to 8"),
    (FUSED.with_params(num_warps=128), "num_warps must be a power of two from 1 to 32"),
])
def test_parameters_no_gpu_can_run_fail_at_table_load(tmp_path, variant, message):
    with pytest.raises(TableError, match=r"row 2 \(batch 2, kv_len 40\): winner\.variant: .*" + message):
        runtime.load(table=_table_with(tmp_path, variant), device="cpu")
    with pytest.raises(ValueError, match=message):
        get_backend(variant.backend).build(variant, None, "cpu")  # build validates first


def test_the_largest_allowed_values_still_load(tmp_path):
    variant = FP8_TRITON.with_params(num_splits=256, block_n=256, num_warps=32, num_stages=8)
    rt = runtime.load(table=_table_with(tmp_path, variant), device="cpu")
    assert rt.dispatcher.variant_for(2, 40) == variant


def test_custom_kernel_loads_this_gpus_table_once_and_another_gpus_only_if_allowed(monkeypatch, tmp_path):
    path = cpu_table(tmp_path, "H200.yaml", gpu="H200")
    with pytest.raises(runtime.GpuMismatchError,
                       match=r"tuned on H200 but this process runs on cpu; .*--gpu cpu.*allow_other_gpu=True"):
        runtime.load(table=path)
    assert runtime.load(table=path, allow_other_gpu=True).table.gpu == "H200"
    with pytest.raises(TableError, match="was made for H200, not MI355X"):
        runtime.load(gpu="MI355X", table=path, allow_other_gpu=True)
    monkeypatch.setattr(runtime, "TABLES_DIR", tmp_path)
    # no table yet: the error names the file and how to make it
    with pytest.raises(TableError, match=r"cpu\.yaml does not exist; run `mla-tune sweep --gpu NAME`"):
        runtime.load()
    (tmp_path / "cpu.yaml").write_text(cpu_table(tmp_path).read_text())
    runtime.default_runtime.cache_clear()
    try:
        data = generate_input(1, 8, seed=9, device="cpu")
        _assert_correct(runtime.custom_kernel(data), data, "bf16")
        first = runtime.default_runtime()
        runtime.custom_kernel(data)
        assert runtime.default_runtime() is first
    finally:
        runtime.default_runtime.cache_clear()


# ------------------------------------------------- the fallback per rule, at short lengths
def test_the_policy_per_rule_and_backend_and_why_strict_needs_its_own():
    strict = dispatch_fallback("triton", "strict", triton_splitk.default_variant)(Shape(2, 17))
    assert (strict.get("kv"), strict.get("q")) == ("fp8", "fp8_dynamic")
    loose = dispatch_fallback("triton", "leaderboard", triton_splitk.default_variant)(Shape(2, 17))
    assert (loose.get("kv"), loose.get("q")) == ("fp8", "bf16")
    # bf16 q fails strict there: the reference's scores come from fp8 q, 17 tokens do not average it
    data = generate_input(2, 17, seed=117, device="cpu")
    out = triton_splitk.build(loose, Shape(2, 17), "cpu")(*data[:4])
    result = check(out, reference(data), STRICT)
    assert not result.passed and result.mismatch > 0.05
    assert check(out, reference(data), RULE).passed
    # a rule the policy does not know is served as the tightest it knows
    assert dispatch_fallback("triton", "custom", triton_splitk.default_variant)(Shape(2, 17)) == strict
    torch_strict = dispatch_fallback("torch", "strict")
    assert torch_strict(Shape(2, 512)) == TORCH
    with pytest.raises(ValueError, match=r"no fallback passes the strict rule at 2x17: the torch fallback "
                                         r"\(q bf16, KV bf16\) passes from kv_len 512 on; make the triton"):
        torch_strict(Shape(2, 17))
    assert set(DISPATCH_FALLBACKS) == {"triton", "torch"}


def test_a_strict_runtime_and_its_export_fall_back_to_what_passes_strict(tmp_path):
    table = cpu_table(tmp_path, "strict.yaml", edit=lambda data: data["provenance"].update(rule=STRICT.as_dict()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt = runtime.load(table=table, device="cpu")
    assert rt.dispatcher.variant_for(2, 17).get("q") == "fp8_dynamic"
    data = generate_input(2, 17, seed=5, device="cpu")
    with pytest.warns(UserWarning, match="a shape the table lacks"):
        out = rt.custom_kernel(data)
    assert check(out, reference(data), STRICT).passed
    # the export of the same table: its fallback passes strict at the short lengths, against
    # the gate's reference (fp8 q x fp8 KV, the leaderboard's), on two seeds each
    text = export_submission(table, tmp_path / "strict_sub.py").read_text()
    assert "_export_fallback = dispatch_fallback('triton', 'strict', _default_variant_triton)" in text
    cases = [generate_input(2, kv_len, seed=100 * seed + kv_len, device="cpu")
             for kv_len in (1, 2, 17, 63) for seed in (1, 2)]
    outs, misses = exported_outputs(tmp_path, "strict_sub", cases)
    for out, case in zip(outs, cases, strict=True):
        result = check(out, reference(case), STRICT)
        assert result.passed, f"2x{case[1]['bf16'].shape[0] // 2}: {result.reason}"
    assert misses == [[2, 1], [2, 2], [2, 17], [2, 63]]


def test_the_sm_count_is_asked_of_the_device_once_and_hard_coded_nowhere(monkeypatch):
    """An H200's 132 SMs are stated once, in gpu.KNOWN_GPUS (the GPUs a sweep can be planned
    for); every other module, backends and kernels included, asks the device or a Platform."""
    assert core.device_sm_count() == 0 and core.device_sm_count("cpu") == 0  # no GPU here
    asked = []

    def props(index):
        asked.append(index)
        return SimpleNamespace(multi_processor_count=77)

    core._core_sm_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    try:
        assert core.device_sm_count() == 77 and core.device_sm_count("cuda:0") == 77
        assert core.device_sm_count(1) == 77
        assert asked == [0, 1]  # cached per device
        # the default variant sizes its splits from it: 77 SMs / batch 4 -> 32 splits at 8192
        assert triton_splitk.default_variant(Shape(4, 8192)).get("num_splits") == 32
        assert triton_splitk.default_variant(Shape(64, 8192)).get("num_splits") == 2
    finally:
        core._core_sm_count.cache_clear()
    for path in sorted((REPO / "mla_tune").rglob("*.py")):
        name = path.relative_to(REPO / "mla_tune").as_posix()
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b132\b", line):
                in_table = name == "gpu.py" and re.match(
                    r'\s+"[A-Z0-9]+": GpuFacts\("[^"]+", "\w+", (True|False), \d+, \d+, \d+, [^()]*\),$', line)
                assert in_table, f"mla_tune/{name} line {lineno} names 132 SMs: {line.strip()}"


H200_TABLE = REPO / "tables" / "H200.yaml"
SHAPES = "2x1,2x2,2x17,2x63,8x63"  # the fallback's, on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["strict", "leaderboard"])
def test_an_export_passes_its_tables_rule_at_lengths_only_its_fallback_serves(rule, tmp_path):
    """The committed table exported as is (`leaderboard`) and with provenance naming `strict`
    (rows untouched): scripts/check_submission.py finds every fallback shape passing."""
    data = yaml.safe_load(H200_TABLE.read_text())
    data["provenance"]["rule"] = RULES[rule].as_dict()
    table = tmp_path / f"H200.{rule}.yaml"
    table.write_text(yaml.safe_dump(data, sort_keys=False))
    submission = export_submission(table, tmp_path / f"{rule}_sub.py")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_submission.py"), str(submission),
                           "--shapes", SHAPES, "--require", rule, "--reps", "10", "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the {rule}-rule export at {SHAPES}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
