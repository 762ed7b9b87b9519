"""fp8_static q calibration: the config's sources, what a row records, serving's refusals."""

import copy
import dataclasses
import re

import pytest
import torch
import yaml

from mla_tune import problem
from mla_tune.core import Shape
from mla_tune.tune import worker
from mla_tune.tune.calibration import CalibrationError, CalibrationSpec, calibrate, normal_tail_amax
from mla_tune.tune.config import ConfigError, config_from_dict, load_config
from tests.helpers import REPO

SHAPE = Shape(2, 16)
FP8_STATIC = {"torch": {}, "triton": {"kv": ["fp8"], "q": ["bf16", "fp8_static"]}}  # offers q=fp8_static


def _raw(**changes) -> dict:
    return {**yaml.safe_load((REPO / "tests" / "data" / "sweep_torch.yaml").read_text()), **copy.deepcopy(changes)}


def test_generator_calibration_is_the_max_over_calibration_seeds_and_says_so():
    config = load_config(REPO / "configs" / "leaderboard.yaml")  # states it: generator, margin 1.1
    assert config.calibration == CalibrationSpec(stated=True)
    record = calibrate(None, SHAPE, [11, 12], "cpu")
    amax = max(float(problem.generate_input(2, 1, s, device="cpu")[0].abs().amax()) for s in (11, 12))
    assert record["q_amax"] == round(amax * 1.1, 4)
    # drawn without the KV cache (kv_len 1): the q of the real shape all the same
    q_full = problem.generate_input(2, 40, 11, device="cpu")[0]
    assert torch.equal(problem.generate_input(2, 1, 11, device="cpu")[0], q_full)
    assert record["kind"] == "generator" and record["method"] == "max |q| x 1.1"
    assert "leaderboard input generator" in record["source"] and "the config names no calibration" in record["source"]
    stated = calibrate(CalibrationSpec(stated=True), SHAPE, [11, 12], "cpu")
    assert "config names no calibration" not in stated["source"]


def test_a_q_sample_file_calibrates_from_its_max_and_records_its_hash(tmp_path):
    sample = torch.randn(5, 16, 576) * 8
    sample[0, 0, 0] = 70.0  # the real q's outlier channel
    torch.save(sample, tmp_path / "q.pt")
    config = config_from_dict(_raw(calibration={"q_sample": "q.pt", "margin": 1.2},
                                   backends=FP8_STATIC), tmp_path / "c.yaml")
    spec = config.calibration
    assert spec.source == "q_sample" and spec.q_sample == str((tmp_path / "q.pt").resolve())
    record = calibrate(spec.as_dict(), SHAPE, [11], "cpu")  # as it travels to the worker
    assert record["q_amax"] == round(70.0 * 1.2, 4) and record["kind"] == "q_sample"
    assert f"{sample.numel()} elements, sha256 " in record["source"]


def test_a_stated_distribution_calibrates_from_its_tail_and_a_stated_q_amax_as_is():
    spec = config_from_dict(_raw(calibration={"q_distribution": "normal", "q_std": 8.0})).calibration
    record = calibrate(spec, SHAPE, [11], "cpu")
    assert record["q_amax"] == round(normal_tail_amax(8.0, SHAPE.batch), 4)
    assert record["kind"] == "q_distribution" and "q_std 8.0" in record["source"]
    # 1e-4 expected elements beyond per call of 2 x 16 x 576: about 6 sigma, more for a bigger batch
    assert 5.8 < normal_tail_amax(1.0, 2) < 6.2 < normal_tail_amax(1.0, 256) < 7.0
    draws = torch.randn(64, 16, 576, generator=torch.Generator().manual_seed(0))
    assert float(draws.abs().amax()) < normal_tail_amax(1.0, 64)
    # a stated q_amax is used as is
    spec = config_from_dict(_raw(calibration={"q_amax": 40})).calibration
    assert calibrate(spec, SHAPE, [11], "cpu") == {
        "q_amax": 40.0, "kind": "q_amax", "method": "stated", "source": "q_amax 40.0 stated in the config"}


@pytest.mark.parametrize(("calib", "message"), [
    ({"q_amax": 1, "q_std": 2}, "calibration.q_std': goes with q_distribution only"),
    ({"q_amax": 1, "generator": "leaderboard"}, "needs exactly one source of generator, q_sample, "
                                                "q_distribution, q_amax, got generator, q_amax"),
    ({}, "needs exactly one source"),
    ({"q_amx": 3}, "'calibration.q_amx': unknown field"),
    ({"q_amax": float("nan")}, "calibration.q_amax': must be a finite number > 0"),
    ({"q_amax": -1}, "calibration.q_amax': must be a finite number > 0"),
    ({"q_distribution": "laplace", "q_std": 1}, "must be one of normal"),
    ({"q_distribution": "normal"}, "q_std': must be a finite number > 0"),
    ({"generator": "vllm"}, "calibration.generator': must be one of leaderboard"),
    ({"generator": "leaderboard", "margin": 0.5}, "calibration.margin': must be a number from 1 to 10"),
    ({"q_amax": 3, "margin": 1.2}, "applies to generator and q_sample only"),
    ({"q_sample": "missing.pt"}, "cannot read the q sample"),
    ("q.pt", "must be a mapping"),
    # a q sample that is not q: q.pt holds the object given (saved with torch.save) or the bytes
    ({"q_sample": torch.randn(3, 512)}, "must hold q with last dim 576"),
    ({"q_sample": {"q": torch.randn(3, 576)}}, "must hold one floating tensor of q, got dict"),
    ({"q_sample": torch.full((2, 576), float("inf"))}, "holds no finite nonzero values"),
    ({"q_sample": b"import os"}, "is not a tensor saved with torch.save"),  # a text file
])
def test_bad_calibrations_fail_at_config_load_naming_the_field(tmp_path, calib, message):
    held = calib.get("q_sample", "") if isinstance(calib, dict) else ""
    if isinstance(held, bytes):
        (tmp_path / "q.pt").write_bytes(held)
    elif not isinstance(held, str):
        torch.save(held, tmp_path / "q.pt")
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(_raw(calibration=calib if isinstance(held, str) else {"q_sample": "q.pt"}),
                         tmp_path / "c.yaml")


def test_a_serving_config_refuses_generator_calibration_of_fp8_static():
    sub_grid = {"torch": {}, "triton": {"grids": [{"kv": ["fp8"], "q": ["fp8_static"]}]}}  # in a sub-grid too
    for backends, calib in ((FP8_STATIC, {}), (FP8_STATIC, {"calibration": {"generator": "leaderboard"}}),
                            (sub_grid, {})):
        with pytest.raises(ConfigError, match=r"'calibration': a serving config offers q=fp8_static \(triton\) "
                                              r"but calibrates on the leaderboard's generator only"):
            config_from_dict(_raw(purpose="serving", backends=backends, **calib))
    with pytest.raises(ConfigError, match="'purpose': must be one of leaderboard, serving"):
        config_from_dict(_raw(purpose="prod"))
    # with a real source it loads; without fp8_static it needs none
    ok = config_from_dict(_raw(purpose="serving", backends=FP8_STATIC, calibration={"q_amax": 30.0}))
    assert ok.calibration.source == "q_amax" and ok.calibration.purpose == "serving"
    assert config_from_dict(_raw(purpose="serving")).calibration.source is None


def test_the_worker_runs_fp8_static_with_the_configs_calibration_or_fails_the_candidate():
    spec = config_from_dict(_raw(calibration={"q_amax": 40.0})).calibration
    variant = "triton(block_n=16,dot_dtype=fp16,kv=bf16,num_splits=1,num_stages=1,num_warps=4,q=fp8_static)"
    step = worker.Step(Shape(1, 16), variant, rung=0, samples=1, wall_samples=1, gate=True,
                       rule=problem.RULES["leaderboard"], check_seeds=(1, 2), calibration_seeds=(11,),
                       calibration=spec.as_dict())
    result, _state = worker.run_step(step, None, "cpu", has_gpu=False)
    record = result.fields()
    assert record["status"] == "ok", record["reason"]
    assert record["variant"].endswith("q=fp8_static,q_amax=40.0)")
    assert record["calibration"]["kind"] == "q_amax"
    # a serving spec without a source (flashmla and aiter offer fp8_static unasked), or with the
    # generator, fails the candidate, not the sweep
    serving = config_from_dict(_raw(purpose="serving")).calibration.as_dict()
    for spec in (serving, CalibrationSpec(purpose="serving")):
        with pytest.raises(CalibrationError, match="a serving config calibrates fp8_static from real q only"):
            calibrate(spec, SHAPE, [11], "cpu")
    result, _state = worker.run_step(dataclasses.replace(step, calibration=serving), None, "cpu", has_gpu=False)
    record = result.fields()
    assert record["status"] == "failed" and "from real q only" in record["reason"]
