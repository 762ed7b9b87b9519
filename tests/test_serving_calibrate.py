"""The reduction's cost per step, measured for a serving table (mla_tune/serving/calibrate.py)."""

import dataclasses
import shutil

import pytest

from mla_tune.core import Variant
from mla_tune.gpu import Platform, simulated_platform
from mla_tune.kernels.split_rule import reduce_splits_per_step
from mla_tune.serving import calibrate as cal
from mla_tune.serving.config import load_serving_config
from mla_tune.serving.table import FamilyKey, load_serving_table
from mla_tune.tune import timing

TABLE = "tables/H200.serving.yaml"
FAMILY, KEY = "kv_format=bf16,heads=16,q_len=1", FamilyKey("bf16", 64, 16, 1)  # the family asked
H200 = Platform("H200", "NVIDIA H200 (simulated)", "sm_90", False, 132, simulated=True)


def test_each_probe_pairs_a_long_tail_with_the_uniform_batch_of_its_tokens(monkeypatch):
    table = load_serving_table(TABLE)
    probes = cal.plan_probes(table)
    assert probes, "the committed table has split-K models"
    for p in probes:
        batch = len(p.tail)
        assert len(p.uniform) == batch >= 2 and sum(p.uniform) == sum(p.tail)
        assert max(p.uniform) - min(p.uniform) <= 1 and p.tail[0] == cal.TAIL_KV_LEN
        assert reduce_splits_per_step(batch, p.key.q_len, p.key.heads) == p.per_step
        # the narrow grid's smallest batch bucket, the wide grid's largest
        same = [b for b in table.batch_buckets if b >= 2 and reduce_splits_per_step(b, p.key.q_len, p.key.heads)
                == p.per_step]
        assert batch == (min(same) if p.per_step == 16 else max(same))
        model = table.families[p.key].models[p.variant]
        assert (model.reduction_steps(p.key, p.uniform), model.reduction_steps(p.key, p.tail)) == p.steps
        assert p.steps[1] > p.steps[0]
    # a family without split-K models has none
    plain = [k for k, f in table.families.items() if not any(v.backend == "triton" for v in f.models)]
    assert not cal.plan_probes(table, plain)
    # a model blind at a probe's batch (its variant pruned early there) is not picked for it
    blind = {(p.key, len(p.tail)): p.variant for p in probes}
    real = table.estimator.model_estimates

    def estimates(family, kv_lens, calibrated=True):
        out = dict(real(family, kv_lens, calibrated))
        out.pop(blind.get((family.key, len(kv_lens))), None)
        return out

    monkeypatch.setattr(table.estimator, "model_estimates", estimates)
    again = cal.plan_probes(table)
    assert again, "other split-K models still make probes"
    for p in again:
        assert p.variant != blind[(p.key, len(p.tail))]
        spec_free = [real(table.families[p.key], list(lens), False).get(p.variant) for lens in (p.uniform, p.tail)]
        assert None not in spec_free


def test_the_table_keeps_the_step_cost_the_model_misses_on_a_tail_and_bad_runs_keep_none(tmp_path):
    """Another GPU, bad options and a dry run leave the table alone; then a calibration writes
    the cost per step that the model misses on the tail, for the family asked only."""
    path = shutil.copy(TABLE, tmp_path / "H200.serving.yaml")
    before = path.read_bytes()
    with pytest.raises(cal.CalibrateError, match="the table is for H200; this is MI355X"):
        cal.calibrate(path, platform=simulated_platform("MI355X"), families="heads=16,q_len=1,kv_format=bf16",
                      log=lambda _: None, measure_fn=lambda *a: pytest.fail("measured on the wrong GPU"))
    with pytest.raises(cal.CalibrateError, match="--reps and --rounds must be >= 1"):
        cal.calibrate(path, reps=0, log=lambda _: None)
    lines = []
    assert cal.calibrate(path, dry_run=True, log=lines.append)["path"] is None
    assert path.read_bytes() == before and "probes" in lines[0] and len(lines) > 1
    assert cal.main(["--table", str(tmp_path / "none.yaml"), "--dry-run"]) == 1
    table = load_serving_table(path)
    others = {k: dict(f.calibration) for k, f in table.families.items() if k != KEY}
    seen = []

    def fake_measure(probe, cfg, device, timer, reps, rounds):
        # the model's estimates, 3 us off on both batches, and 4.5 us per extra step on the tail
        seen.append(probe)
        spec = cfg.spec(probe.key)
        est = {n: table.model_estimates(spec, list(lens), calibrated=False)[probe.variant]
               for n, lens in (("uniform", probe.uniform), ("tail", probe.tail))}
        return {"uniform": est["uniform"] + 3.0, "tail": est["tail"] + 3.0 + 4.5 * (probe.steps[1] - probe.steps[0])}

    out = cal.calibrate(path, families=FAMILY, platform=H200, device="cpu",
                        measure_fn=fake_measure, log=lambda _: None)
    assert [p["per_step"] for p in out["probes"]] == [16, 64] and len(seen) == 2
    loaded = load_serving_table(path)
    assert loaded.families[KEY].calibration == {"triton": {"reduce_step_us": {16: 4.5, 64: 4.5}}}
    assert loaded.provenance["reduce_calibration"]["probes"][0]["steps"] == list(seen[0].steps)
    assert {k: f.calibration for k, f in loaded.families.items() if k != KEY} == others  # only the family asked
    # a model that is faster on the tail than it says gives 0, not a negative cost
    cal.calibrate(path, families=FAMILY, platform=H200, device="cpu",
                  measure_fn=lambda p, *a: {"uniform": 100.0, "tail": 1.0}, log=lambda _: None)
    assert load_serving_table(path).families[KEY].calibration == {"triton": {"reduce_step_us": {16: 0.0, 64: 0.0}}}


def test_a_probe_runs_checked_on_the_real_kernel(device):
    """A split-K variant on a tail batch and its uniform twin, both checked against the reference."""
    cfg = load_serving_config("configs/serving.yaml")
    dot = "fp16" if device == "cpu" else "bf16"  # the interpreter's bf16 dot is wrong (README)
    variant = Variant.parse(f"triton(block_h=16,block_n=16,dot_dtype={dot},kv=bf16,max_splits=64,num_stages=1,"
                            "num_warps=4,q=bf16,tokens_per_split=16)")
    probe = cal.ReduceProbe(KEY, 64, variant, (200, 16, 16), (78, 77, 77), (1, 2))
    times = cal.measure(probe, cfg, device, timing.cpu_time if device == "cpu" else timing.time_call, 1, 1)
    assert set(times) == {"uniform", "tail"} and all(t > 0 for t in times.values())
    # under a config's search.step_layers: each probe a LayeredStep, its figure over the layers
    stepped = dataclasses.replace(cfg, search=dataclasses.replace(cfg.search, step_layers=2))
    timed = []

    def stand_in(call, reps):
        timed.append(type(call).__name__)
        return timing.Timing(8.0, 8.0, 8.0, reps)
    assert cal.measure(probe, stepped, device, stand_in, 1, 2) == {"uniform": 4.0, "tail": 4.0}
    assert timed == ["LayeredStep"] * 4
