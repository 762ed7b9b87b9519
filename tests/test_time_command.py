"""`mla-tune time` (mla_tune/time_cli.py) on the CPU: its pieces, refusals, and each subcommand
end to end on Triton's interpreter (times are wall clock there, meaningless). Its help and
options' help are test_cli.py's, with every command's."""

import json
import math
from pathlib import Path

import pytest
import torch

from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.serving import gate as gate_module
from mla_tune.serving import measure as measure_module
from mla_tune.serving.inputs import ServingInput
from mla_tune.serving.table import (
    Cell,
    Family,
    FamilyKey,
    GraphPick,
    ServingTable,
    kv_bucket,
    load_serving_table,
    write_serving_table,
)
from mla_tune.serving.time_picks import bucket_lengths, parse_ints, parse_lens, with_budget
from mla_tune.tune import time_variants
from mla_tune.tune.time_variants import parse_shapes
from mla_tune.tune.timing import Timing
from tests.helpers import WIDE, invoke

CONFIG = Path(__file__).parent / "data" / "serving_time_cpu.yaml"
# The config's two triton candidates for a family at 16 heads, q_len 1 (every family also
# offers triton's default serving variant: the second).
SPLIT16, DEFAULT = (
    f"triton(block_h=16,block_n={bn},dot_dtype=fp16,kv={{kv}},max_splits=4,num_stages=2,num_warps=4,q=bf16,"
    f"tokens_per_split={tps})" for bn, tps in ((16, 16), (64, 256)))


def _invoke(*args):
    return invoke("time", *args, env=WIDE)


def _run(*args) -> str:
    """The output of `mla-tune time ARGS --device cpu`, which exits 0."""
    result = _invoke(*args, "--device", "cpu")
    assert result.exit_code == 0, result.output
    return result.output


def test_the_scanned_lengths_span_their_bucket_a_budget_copy_takes_tritons_budget_and_lists_parse_by_name():
    buckets = [512, 1024, 2048, 4096]
    for bucket in buckets:
        lens = bucket_lengths(bucket, 8)
        assert len(lens) == 8 and lens == sorted(lens)
        assert {kv_bucket(buckets, n) for n in lens} == {bucket}
        assert lens[0] < bucket * 0.75 and lens[-1] > bucket * 1.25  # both halves of the octave
    # triton's budget (none without a split or the hook: test_capabilities.py)
    split = Variant.make("triton", kv="fp8", q="bf16", block_n=64, block_h=16, max_splits=17,
                         tokens_per_split=512, num_warps=8, num_stages=2, dot_dtype="bf16")
    budget = with_budget(split, 2, 128, sm_count=132, heads=128)
    assert budget.p == {**split.p, "split_budget": math.ceil(2 * 132 / 8), "tokens_per_split": 128}
    # lists, lengths and shapes are parsed (plain lists: the commands below) or refused by name
    assert parse_lens("7,1024*3") == [7, 1024, 1024, 1024]
    for parse, bad, name in [*[(lambda t: parse_ints(t, "--lengths"), text, "--lengths") for text in ("25,x", "0", "")],
                             (parse_lens, "5*x", "--lens"), (parse_lens, "0", "--lens"),
                             (parse_shapes, "4x0", "--shapes"), (parse_shapes, "4by1024", "--shapes")]:
        with pytest.raises(MlaTuneError, match=name):
            parse(bad)


def test_bad_options_and_without_a_gpu_each_subcommand_are_refused_by_name_in_one_line(monkeypatch):
    scan = ["scan", "--kv", "bf16", "--heads", "16", "--config", CONFIG, "--device", "cpu"]
    for extra, says in [(["--mix", "90,7", "--batch", "2"], "--mix is one ragged batch"),
                        (["--batch", "2"], "give --batch with --bucket"),
                        (["--mix", "9", "--budget-waves", "1,x"], "--budget-waves"),
                        (["--mix", "9", "--backends", "flashmla"], "offers bf16 KV, page 64, 16 heads, q_len 1 no")]:
        result = _invoke(*scan, *extra)
        assert result.exit_code == 1 and says in result.output, result.output
    result = _invoke("variants", "triton(", "--device", "cpu")
    assert result.exit_code == 1 and "is not a variant" in result.output
    if not torch.cuda.is_available():  # each subcommand says it needs one
        for args in (["variants", "torch(kv=bf16,q=bf16)", "--shapes", "1x8"],
                     ["mix", "--table", "t.yaml", "--kv", "fp8", "--heads", "16", "--lens", "8"],
                     ["scan", "--kv", "fp8", "--heads", "16", "--mix", "8,9"],
                     ["points", "--table", "t.yaml"]):
            result = _invoke(*args)
            assert result.exit_code == 1, result.output
            assert "needs a CUDA GPU" in result.output and len(result.output.strip().splitlines()) == 1
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = _invoke("variants", "torch(kv=bf16,q=bf16)", "--shapes", "1x8", "--device", "cpu")
    assert result.exit_code == 1 and "TRITON_INTERPRET=1" in result.output


# ------------------------------------------------------------------ end to end (CPU)
@pytest.fixture
def interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU runs: Triton's interpreter")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _stand_in(monkeypatch, lost_at: int | None = None) -> list:
    """The serving commands' timer, replaced: each measurement returns 10, 20, 30, ... us
    without calling (every call still runs once for its check), and the lost_at-th raises
    as a lost CUDA context does; the list of what was timed."""
    timed = []

    def timer_for(device):
        def timer(fn, reps):
            timed.append(fn)
            if len(timed) == lost_at:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            us = 10.0 * len(timed)
            return Timing(us, us, us, reps)
        return timer

    monkeypatch.setattr(time_variants, "timer_for", timer_for)
    return timed


KEY = FamilyKey("fp8", 16, 16, 1)
S16, DEF = (Variant.parse(v.format(kv="fp8")) for v in (SPLIT16, DEFAULT))
CELLS = {(2, 32): Cell(2, 32, S16, 5.0), (2, 64): Cell(2, 64, S16, 7.0)}
# the cells' points, and one at 1 x 32 with one variant: nothing to compare
POINTS = {(2, 32): {S16: 5.0, DEF: 6.0}, (2, 64): {S16: 7.0, DEF: 7.5}, (1, 32): {S16: 4.0}}


def _table(tmp_path, cells=CELLS, **family) -> Path:
    """A CPU serving table of KEY's family as CONFIG sweeps it; family: Family's other fields."""
    return write_serving_table(tmp_path / "CPU.serving.yaml", ServingTable(
        "CPU", {"config": {"path": str(CONFIG)}}, [1, 2, 4], [32, 64],
        {KEY: Family(KEY, cells=dict(cells), **family)}))


def test_variants_are_checked_and_timed_a_failing_one_is_a_row_and_the_floor_row_times_one_launch(
        interpreter, monkeypatch):
    good = "torch(kv=bf16,q=bf16)"
    output = _run("variants", good, "nobackend(kv=bf16)", "--shapes", "1x8,2x5", "--reps", "1")
    lines = output.strip().splitlines()
    ok = [line for line in lines if line.endswith(good)]
    assert [line.split()[0] for line in ok] == ["1x8", "2x5"]
    assert all(line.split()[4] == "ok" and line.split()[5] in ("ok", "FAIL") for line in ok)  # lb, strict
    errors = [line for line in lines if "nobackend" in line]
    assert len(errors) == 2 and all(" error " in line and "unknown backend" in line for line in errors)
    assert time_variants.FLOOR_ROW not in output  # no --floor
    # --floor: one tiny launch timed before each shape's variants
    timed = _stand_in(monkeypatch)
    output = _run("variants", good, "--shapes", "1x8,2x5", "--reps", "1", "--floor")
    rows = [line.split() for line in output.strip().splitlines()[1:]]
    assert [(r[0], r[-1]) for r in rows] == [("1x8", "element"), ("1x8", good), ("2x5", "element"), ("2x5", good)]
    assert [r[1] for r in rows] == ["10.0", "20.0", "30.0", "40.0"]  # timed in that order
    assert timed[0].__name__ == "zero_" and timed[0].__self__.numel() == 1  # one element, one launch
    assert time_variants.FLOOR_ROW in output


def test_a_scan_times_every_candidate_and_its_budget_copies_at_each_shape(interpreter, tmp_path, monkeypatch):
    """One batch at two lengths: the config's two split-K candidates and their budget copies,
    each checked and timed at each shape, the worst regrets printed and the times written; and
    a ragged mix, one shape."""
    stand_in_timer = _stand_in(monkeypatch)
    out = tmp_path / "scan.json"
    scan = ("scan", "--heads", "16", "--page", "16", "--config", CONFIG, "--reps", "1", "--json", out)
    output = _run(*scan, "--kv", "fp8", "--batch", "1", "--lengths", "20,40", "--budget-waves", "1")
    data = json.loads(out.read_text())
    assert data["shapes"] == ["1x20", "1x40"] and data["family"] == str(KEY)
    assert {SPLIT16.format(kv="fp8"), DEFAULT.format(kv="fp8")} < set(data["times"])
    budgeted = [v for v in data["times"] if "split_budget=" in v]
    assert len(budgeted) == 2 and len(data["times"]) == 4 and len(stand_in_timer) == 8
    assert all(set(t) == {"1x20", "1x40"} for t in data["times"].values())
    assert "fails the check" not in output
    # the worst regrets, from the times written
    best = {n: min(t[n] for t in data["times"].values()) for n in data["shapes"]}
    rows = sorted((max(regrets), v, regrets) for v, t in data["times"].items()
                  for regrets in [[t[n] / best[n] - 1 for n in data["shapes"]]])
    assert [line for line in output.splitlines() if line.startswith("worst")] == [
        f"worst {100 * w:5.1f}%  " + " ".join(f"{100 * r:5.1f}" for r in rs) + f"  {v}" for w, v, rs in rows]
    # a ragged mix scans as one shape
    output = _run(*scan, "--kv", "bf16", "--mix", "9,30")
    data = json.loads(out.read_text())
    assert data["shapes"] == ["mix2~19"] and data["batches"] == [2] and len(data["times"]) == 2
    assert all(set(t) == {"mix2~19"} for t in data["times"].values())
    assert "fails the check" not in output and data["protocol"] == "one flushed call"
    # --layers: each time a layer's of a step (wall clock here), not the stand-in timer's
    timed = len(stand_in_timer)
    output = _run(*scan, "--kv", "bf16", "--mix", "9,30", "--layers", "2")
    data = json.loads(out.read_text())
    assert data["protocol"] == "a layer of a 2-layer step" and "times: a layer of a 2-layer step" in output
    # the same timer, over a step of 2 layers: its 11th and 12th figures, halved
    assert [type(call).__name__ for call in stand_in_timer[timed:]] == ["LayeredStep"] * 2
    assert sorted(t["mix2~19"] for t in data["times"].values()) == [55.0, 60.0]


def test_a_mix_runs_the_tables_picks_and_extra_variants_and_with_layers_each_as_a_steps_layers(
        interpreter, tmp_path, monkeypatch):
    """The table's eager and graph picks and the extra variants, each checked; --layers N: each
    role also as N back-to-back layers of one step (a LayeredStep, by the same timer: its figure
    over N), its last layer checked; past the KV copies' bound the layered column is an error
    with the reason, the flushed call's figures stand."""
    stand_in_timer = _stand_in(monkeypatch)
    extra = SPLIT16.format(kv="fp8").replace("max_splits=4", "max_splits=1")
    table = _table(tmp_path, graph={2: GraphPick(2, DEF, 0.1, 64)})
    args = ("mix", "--table", table, "--kv", "fp8", "--heads", "16", "--page", "16", "--lens", "30,34",
            "--reps", "1", "--layers", "2")
    lines = _run(*args, "--variant", extra, "--variant", "nobackend(kv=fp8)").strip().splitlines()
    assert lines[0].startswith(f"{KEY}: 2 sequences, kv_lens [30, 34] (mean 32)")
    assert lines[1] == f"the table's cell 2 x 32: {S16}, 5.0 us as swept"
    skipped = [line for line in lines if " not timed, it cannot serve this here: " in line]
    # no GPU here: each vendor backend with a serving call is named, with why it did not run
    assert [line.split(":")[0] for line in skipped] == ["aiter", "flashinfer", "flashmla"]
    assert any(line.startswith("layer us: each role as 2 back-to-back layers of one step") for line in lines)
    header = lines.index(next(line for line in lines if line.split()[:2] == ["role", "us"]))
    assert lines[header].split()[:6] == ["role", "us", "x", "best", "check", "layer"]
    rows = {line.split()[0]: line.split() for line in lines[header + 1:]}
    assert set(rows) == {"eager", "graph", "extra1", "extra2"}
    assert [rows[r][-1] for r in ("eager", "graph", "extra1")] == [str(S16), str(DEF), extra]
    # the stand-in's 10, 20, ... us in order: each role's call, then its step of 2 layers
    # (halved); ratios to the fastest, each checked
    assert [rows[r][1:6] for r in ("eager", "graph", "extra1")] == [
        ["10.0", "1.000", "ok", "10.0", "1.000"], ["30.0", "3.000", "ok", "20.0", "2.000"],
        ["50.0", "5.000", "ok", "30.0", "3.000"]]
    assert [type(call).__name__ for call in stand_in_timer][1::2] == ["LayeredStep"] * 3
    assert rows["extra2"][1] == "error" and "nobackend" in " ".join(rows["extra2"])
    monkeypatch.setattr(measure_module, "LAYERED_KV_BYTES", 1)
    lines = _run(*args).strip().splitlines()
    eager = next(line for line in lines if line.split()[0] == "eager")
    assert eager.split()[2:5] == ["1.000", "ok", "error"]  # the stand-in timer counts on: 70, 80
    assert "2 layers need 0.0 GiB of KV copies, over 0 GiB: give fewer layers or shorter lengths)" in eager


def test_points_retimes_a_tables_points_as_a_sweep_step_in_alternating_passes_or_a_steps_layer_into_the_table(
        interpreter, tmp_path, monkeypatch):
    stand_in_timer = _stand_in(monkeypatch)
    table = _table(tmp_path, points=POINTS)
    points = ("points", "--table", table, "--samples", "1")
    out = tmp_path / "points.json"
    output = _run(*points, "--passes", "2", "--json", out)
    data = json.loads(out.read_text())
    assert [(p["batch"], p["kv_len"]) for p in data["points"]] == [(2, 32), (2, 64)]
    # per point, the stand-in's 10, 20, ... us in the order timed: each variant as a sweep step
    # (the table's fastest first), then two rounds of two passes, the second round's order reversed
    # and each odd pass backwards from its turn's start
    assert data["points"][0]["variants"] == {
        str(S16): {"table": 5.0, "fresh": 10.0, "passes": 40.0, "again": 90.0},
        str(DEF): {"table": 6.0, "fresh": 20.0, "passes": 50.0, "again": 80.0}}
    assert data["points"][1]["variants"][str(S16)] == {"table": 7.0, "fresh": 110.0, "passes": 140.0, "again": 190.0}
    assert len(stand_in_timer) == 2 * (2 + 2 * 2 * 2)
    summary = data["summary"]
    assert all(s["pairs"] == 2 for s in summary.values())
    first = abs(math.log(50 / 40) - math.log(80 / 90))  # point 1, passes ~ again
    second = abs(math.log(150 / 140) - math.log(180 / 190))
    assert summary["passes ~ again"]["median"] == pytest.approx((first + second) / 2)
    assert "passes ~ again" in output and "fp8/p16/h16/q1 batch 2 kv 32" in output
    # passes / table: 40/5, 50/6, 140/7, 150/7.5
    assert data["by_backend"] == {"triton": {"n": 4, "median": pytest.approx((50 / 6 + 20) / 2)}}
    assert "passes / table per backend, median (n): triton 14.167 (4)" in output
    # with --workers, the gate first: a variant it rejects is named and not timed
    def gate(jobs, workers):
        assert workers == 3
        assert sorted(j.variant for j in jobs) == sorted(map(str, [S16, DEF]))  # once each
        return [(j, {"ok": j.variant != str(DEF), "reason": "wrong at kv 17"}) for j in jobs]
    monkeypatch.setattr(gate_module, "run_gates", gate)
    output = _run(*points, "--passes", "1", "--workers", "3", "--json", out)
    data = json.loads(out.read_text())
    assert all(list(p["variants"]) == [str(S16)] for p in data["points"])
    assert all(p["failed"] == {str(DEF): "the gate rejected it: wrong at kv 17"} for p in data["points"])
    assert f"not timed: the gate rejected it: wrong at kv 17  {DEF}" in output
    # refusals, by name in one line
    for args, says in [(["--families", "heads=128"], "matches none of the table's families"),
                       (["--points", "0"], "--points")]:
        result = _invoke("points", "--table", table, "--device", "cpu", *args)
        assert result.exit_code != 0 and says in result.output, result.output
    # --write: every point timed again into a copy of the table
    stand_in_timer.clear()
    out = tmp_path / "RETIMED.serving.yaml"
    output = _run(*points, "--passes", "2", "--points", "1", "--write", out)
    # every point (the one-variant one too, --points ignored), one round of two passes: 10, 20, ...
    assert len(stand_in_timer) == 2 + 4 + 4
    written = load_serving_table(out)
    assert written.families[KEY].points == {(1, 32): {S16: 15.0}, (2, 32): {S16: 40.0, DEF: 50.0},
                                            (2, 64): {S16: 80.0, DEF: 90.0}}
    assert written.families[KEY].cells == CELLS  # as swept
    retimed = written.provenance["points_retimed"][-1]
    assert [retimed[k] for k in ("families", "points", "variant_times", "kept")] == [[str(KEY)], 3, 5, 0]
    assert retimed["from"] == str(table) and retimed["passes"] == 2
    assert load_serving_table(table).families[KEY].points == POINTS  # the table given is untouched
    assert f"wrote {out}: 5 variant times at 3 points of 1 families timed again" in output
    assert "table ~ passes" in output
    rows = [line.split() for line in output.splitlines() if line.strip().startswith("triton")]
    assert all(r[2] == "-" and r[4] == "-" for r in rows)  # no fresh or again column
    # --layers N: each variant timed as a LayeredStep of N layers (the same timer, its figure
    # over N), every point's KV copied once for its variants; the provenance names the layers
    stand_in_timer.clear()
    _run(*points, "--passes", "2", "--write", tmp_path / "STEP.yaml", "--layers", "2")
    assert len(stand_in_timer) == 10 and {type(c).__name__ for c in stand_in_timer} == {"LayeredStep"}
    written = load_serving_table(tmp_path / "STEP.yaml")
    assert written.families[KEY].points == {(1, 32): {S16: 7.5}, (2, 32): {S16: 20.0, DEF: 25.0},
                                            (2, 64): {S16: 40.0, DEF: 45.0}}  # the passes' medians, halved
    assert written.provenance["points_retimed"][-1]["layers"] == 2

    # with the gate run first, no check per point (as the sweep): no reference is computed
    monkeypatch.setattr(gate_module, "run_gates", lambda jobs, workers: [(j, {"ok": True}) for j in jobs])
    monkeypatch.setattr(ServingInput, "reference", lambda *a, **k: pytest.fail("checked after the gate"))
    _run(*points, "--passes", "1", "--workers", "2", "--write", tmp_path / "gated.yaml")
    assert load_serving_table(tmp_path / "gated.yaml").provenance["points_retimed"][-1]["variant_times"] == 5
    # a run from a re-timed table adds its record after the first's (a long run split by family)
    _run("points", "--table", out, "--samples", "1", "--passes", "1", "--workers", "2", "--write",
         tmp_path / "chained.yaml")
    chain = load_serving_table(tmp_path / "chained.yaml").provenance["points_retimed"]
    assert [r["from"] for r in chain] == [str(table), str(out)]
    # a family the budget cuts short keeps all its times (its points are not mixed)
    output = _run(*points, "--passes", "1", "--write", out, "--budget", "0")
    assert load_serving_table(out).families[KEY].points == POINTS
    assert f"not reached in full, so left as swept: {KEY}" in output


@pytest.mark.parametrize("lost_at", [7, 9])  # the second point's first timing, or its first pass
def test_points_stop_where_the_cuda_context_is_lost_and_keep_what_was_timed(interpreter, tmp_path, monkeypatch,
                                                                            lost_at):
    table = _table(tmp_path, cells={(2, 32): CELLS[(2, 32)]}, points={k: POINTS[k] for k in [(2, 32), (2, 64)]})
    timed = _stand_in(monkeypatch, lost_at)  # six a point: 2 fresh, then 2 rounds of 2
    out = tmp_path / "points.json"
    output = _run("points", "--table", table, "--samples", "1", "--passes", "1", "--json", out)
    assert "the CUDA context was lost at this point: 0 points not timed" in output
    data = json.loads(out.read_text())
    assert [(p["batch"], p["kv_len"]) for p in data["points"]] == [(2, 32)]  # the first point only
    assert len(timed) == lost_at  # nothing after the lost context
