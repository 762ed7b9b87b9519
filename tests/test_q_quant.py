"""The one-launch q quantizer against torch's quantization, value for value (a zero's sign may
differ: no dot can tell), and a static q scale caught when a call's q exceeds it: the
quantizer's device counter, q_range_count, the runtime's check_q_range and q_saturation()."""

import warnings
from pathlib import Path

import pytest
import torch

from mla_tune import problem, runtime
from mla_tune.backends import flash_mla, triton_splitk
from mla_tune.core import Shape, Variant
from mla_tune.gpu import detect
from mla_tune.kernels.q_quant import QQuantizer, q_range_count
from mla_tune.problem import quantize_fp8
from mla_tune.tune import calibration
from tests.helpers import cpu_table, vendor_fakes

FP8 = torch.float8_e4m3fn
TRITON_SHAPE, FLASHMLA_SHAPE = Shape(2, 40), Shape(2, 64)


def _beyond(q: torch.Tensor, q_amax: float) -> int:
    return int((q.float().abs() > q_amax).sum())


def _q_amax(shape: Shape) -> float:
    """What the leaderboard config's generator calibration gives for this shape."""
    return calibration.calibrate(None, shape, list(range(11, 19)), "cpu")["q_amax"]


# --------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("seed", [0, 36, 39])  # 36 and 39 hold values that round to -0
def test_dynamic_quantization_matches_the_leaderboard_reference(device, seed):
    torch.manual_seed(seed)
    q = torch.randn((3, 16, 576), dtype=torch.bfloat16, device=device) * 3
    quant = QQuantizer("fp8_dynamic", 3, device, FP8)
    for x in (q, q * 0.25):  # a second call with other values recomputes the scale (no stale state)
        q8, scale = quant(x)
        ref8, ref_scale = quantize_fp8(x, FP8)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(q8.float(), ref8.float())  # values: -0.0 == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_static_quantization_matches_torch_clamps_and_needs_an_amax(device, seed):
    torch.manual_seed(seed)
    q = torch.randn((2, 16, 576), dtype=torch.bfloat16, device=device)
    q_amax = 0.8 * float(q.abs().amax())  # some values must clamp
    quant = QQuantizer("fp8_static", 2, device, FP8, q_amax=q_amax)
    q8, scale = quant(q)
    fp8_max = torch.finfo(FP8).max
    ref_scale = torch.tensor([q_amax / fp8_max], dtype=torch.float32, device=device)
    ref8 = (q / ref_scale).clamp(-fp8_max, fp8_max).to(FP8)
    assert torch.allclose(scale, ref_scale)
    assert torch.equal(q8.float(), ref8.float())  # some at +-fp8_max: 0.8 x amax clamps
    with pytest.raises(ValueError, match="q_amax"):
        QQuantizer("fp8_static", 1, device, FP8)


def test_the_static_quantizer_and_q_range_count_count_elements_beyond_q_amax_on_the_device(device):
    torch.manual_seed(0)
    q = torch.randn((2, 16, 576), dtype=torch.bfloat16, device=device)
    q_amax = _q_amax(Shape(2, 1))
    quant = QQuantizer("fp8_static", 2, device, FP8, q_amax=q_amax)
    quant(q)
    assert int(quant.saturated.item()) == _beyond(q, q_amax) == 0  # the generator's own q fits
    big = q * 8  # a real model's q is not standard-normal
    quant(big)
    expected = _beyond(big, q_amax)
    assert int(quant.saturated.item()) == expected > 0.5 * big.numel()  # most elements: the clamp is no corner case
    quant(big)
    assert int(quant.saturated.item()) == 2 * expected  # summed over calls, until zeroed
    dynamic = QQuantizer("fp8_dynamic", 2, device, FP8)
    dynamic(big)
    assert int(dynamic.saturated.item()) == 0  # a dynamic scale never clamps
    count = torch.zeros((1,), dtype=torch.int64, device=device)  # the count alone, one launch each
    q_range_count(big, 5.0, count)
    q_range_count(big, 5.0, count)
    assert int(count.item()) == 2 * _beyond(big, 5.0) > 0
    with pytest.raises(ValueError, match=r"needs a \(1,\) int64 count"):
        q_range_count(big, 5.0, torch.zeros((1,), dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"needs contiguous \(batch, 16, 576\) q"):
        q_range_count(big[:, :, :512], 5.0, count)


# --------------------------------------------------------------------- the runtime
def _row(shape: Shape, variant: Variant, q_amax: float) -> dict:
    return {
        "batch": shape.batch, "kv_len": shape.kv_len,
        "winner": {"variant": str(variant), "backend": variant.backend, "params": variant.p},
        "time_us": 8.0, "spread": 0.03, "wall_us": 35.0, "runner_up": None,
        "backends": {variant.backend: 8.0}, "baseline_us": None, "floor_us": 0.01, "floor_share": 0.001,
        "candidates": {"tried": 1, "ok": 1, "rejected": 0, "failed": 0, "crashed": 0, "timeout": 0, "pruned": 0},
        "calibration": {"q_amax": q_amax, "kind": "generator", "method": "max |q| x 1.1",
                        "source": "the leaderboard input generator (randn q), seeds [11, ..., 18]"},
        "alternates": {variant.backend: {"variant": str(variant), "time_us": 8.0}}}


@pytest.fixture
def static_table(tmp_path) -> Path:
    """The CPU test table with fp8_static winners: triton at 2x40, flashmla at 2x64."""
    amax = _q_amax(TRITON_SHAPE)
    triton = Variant.make("triton", block_n=16, dot_dtype="fp16", kv="fp8", num_splits=2, num_stages=1,
                          num_warps=4, q="fp8_static", q_amax=amax)
    flashmla = Variant.make("flashmla", kv="fp8", q="fp8_static", q_amax=amax)

    def edit(data):
        rows = [r for r in data["rows"] if (r["batch"], r["kv_len"]) != (2, 40)]
        rows += [_row(TRITON_SHAPE, triton, amax), _row(FLASHMLA_SHAPE, flashmla, amax)]
        data["rows"] = sorted(rows, key=lambda r: (r["batch"], r["kv_len"]))

    return cpu_table(tmp_path, "static.yaml", edit=edit)


def _scaled(shape: Shape, factor: float, seed: int = 3):
    q, kv_data, qo, kv_indptr, config = problem.generate_input(shape.batch, shape.kv_len, seed, device="cpu")
    return (q * factor).contiguous(), kv_data, qo, kv_indptr, config


def _load(path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning from loading
        return runtime.load(table=path, device="cpu", **kwargs)


def test_the_default_runtime_counts_saturated_q_without_a_sync_per_call(static_table, monkeypatch):
    vendor_fakes.install(monkeypatch, "flash_mla")
    rt = _load(static_table)
    for shape in (TRITON_SHAPE, FLASHMLA_SHAPE):
        data = _scaled(shape, 1.0)
        assert problem.check(rt.custom_kernel(data), problem.reference(data), problem.RULES["leaderboard"]).passed
    assert rt.q_saturation() == 0
    expected = 0
    for shape in (TRITON_SHAPE, FLASHMLA_SHAPE):
        data = _scaled(shape, 8.0)
        out = rt.custom_kernel(data)
        expected += _beyond(data[0], _q_amax(TRITON_SHAPE))
        # what the counter is for: the clamped answer is wrong, and nothing else says so
        assert not problem.check(out, problem.reference(data), problem.RULES["leaderboard"]).passed
    assert rt.q_saturation() == expected > 0
    # flashmla counts inside its quantizer: no extra launch wraps its runner
    runners = {key[0].backend: r for key, r in rt.dispatcher._runners.items()}
    assert runners["flashmla"].__name__ == "run_flash_mla"
    assert runners["triton"].__name__ == "run_checked"
    dynamic = flash_mla.build(Variant.make("flashmla", kv="fp8", q="fp8_dynamic"), FLASHMLA_SHAPE, "cpu")
    assert dynamic.q_saturation is None  # no counter where nothing clamps
    rt.reset_q_saturation()
    assert rt.q_saturation() == 0


def test_check_mode_raise_refuses_before_the_launch_warn_runs_and_warns_off_counts_only_where_free(
        static_table, monkeypatch):
    flash_mla_fake = vendor_fakes.install(monkeypatch, "flash_mla")["flash_mla"]
    rt = _load(static_table, check_q_range=True)
    rt.custom_kernel(_scaled(TRITON_SHAPE, 1.0))  # in range: runs
    launched = []
    monkeypatch.setattr(triton_splitk, "flash_decode", lambda *a, **k: launched.append(1))
    with pytest.raises(runtime.QRangeError, match=r"of 18432 q elements exceed q_amax=.* that triton\(.*q=fp8_static"
                                                  r".*\(the leaderboard input generator .*calibration: \{q_sample"):
        rt.custom_kernel(_scaled(TRITON_SHAPE, 8.0))
    assert launched == []
    rt.custom_kernel(_scaled(TRITON_SHAPE, 1.0))
    assert launched == [1]  # the spy sees launches: none happened for the refused call
    with pytest.raises(runtime.QRangeError):
        rt.custom_kernel(_scaled(FLASHMLA_SHAPE, 8.0))
    assert flash_mla_fake.calls["flash_mla_with_kvcache"] == 0
    assert rt.q_saturation() > 0
    rt, big = _load(static_table, check_q_range="warn"), _scaled(TRITON_SHAPE, 8.0)
    with pytest.warns(UserWarning, match="q elements exceed q_amax"):
        rt.custom_kernel(big)
    assert launched == [1, 1] and rt.q_saturation() == _beyond(big[0], _q_amax(TRITON_SHAPE))
    off = _load(static_table, check_q_range=False)
    off.custom_kernel(big)
    assert off.q_saturation() == 0  # the triton kernel quantizes q inside: not counted when off
    off.custom_kernel(_scaled(FLASHMLA_SHAPE, 8.0))
    assert off.q_saturation() > 0  # flashmla's quantizer counts for free
    with pytest.raises(ValueError, match="check_q_range must be one of off, count, warn, raise"):
        runtime.load(table=static_table, device="cpu", check_q_range="loud")


# ------------------------------------------------------------------ on the H200
@pytest.mark.gpu
def test_real_flashmla_fp8_static_counts_saturation_and_check_mode_raises(tmp_path):
    """q scaled by 8 against a generator calibration: FlashMLA's answer is wrong and the
    counter says how many elements were clamped."""
    assert flash_mla.unavailable_reason() is None, flash_mla.unavailable_reason()
    shape = Shape(4, 1024)
    amax = calibration.calibrate(None, shape, list(range(11, 19)), "cuda")["q_amax"]
    runner = flash_mla.build(Variant.make("flashmla", kv="fp8", q="fp8_static", q_amax=amax), shape, "cuda")
    q, kv_data, qo, kv_indptr, config = problem.generate_input(shape.batch, shape.kv_len, 1001, device="cuda")
    runner(q, kv_data, qo, kv_indptr)
    torch.cuda.synchronize()
    assert int(runner.q_saturation.item()) == 0
    big = (q * 8).contiguous()
    out = runner(big, kv_data, qo, kv_indptr)
    torch.cuda.synchronize()
    assert int(runner.q_saturation.item()) == _beyond(big, amax) > 0
    result = problem.check(out, problem.reference((big, kv_data, qo, kv_indptr, config)), problem.RULES["leaderboard"])
    assert not result.passed  # the wrong answer the counter exists for
    # the same through the runtime, with a table row for this shape
    path = cpu_table(tmp_path, "gpu_static.yaml", gpu=detect().name,
                     rows=[_row(shape, Variant.make("flashmla", kv="fp8", q="fp8_static", q_amax=amax), amax)])
    rt = runtime.load(table=path)
    rt.custom_kernel((big, kv_data, qo, kv_indptr, config))
    assert rt.q_saturation() == _beyond(big, amax)
    strict = runtime.load(table=path, check_q_range="raise")
    with pytest.raises(runtime.QRangeError):
        strict.custom_kernel((big, kv_data, qo, kv_indptr, config))
