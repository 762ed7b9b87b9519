"""Graph picks re-chosen on recorded verify runs (serving/repick.py, `verify --repick-graph`)."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_tune.core import CallSpec, Variant
from mla_tune.serving import repick
from mla_tune.serving.table import (
    Cell,
    Family,
    FamilyKey,
    GraphPick,
    ServingTable,
    gate_refused,
    load_serving_table,
    write_serving_table,
)
from mla_tune.serving.verify import VERIFY_SCHEMA, VerifyError
from mla_tune.tables.table import TableError
from tests.helpers import REPO, invoke

KEY = FamilyKey("bf16", 64, 16, 1)
SWEPT, BETTER, PARTIAL = (
    str(Variant.parse(f"triton(block_h=16,block_n=32,dot_dtype=bf16,kv=bf16,max_splits={n},num_stages=2,"
                      "num_warps=4,q=bf16,tokens_per_split=128)")) for n in (2, 4, 8))


def _table() -> ServingTable:
    fam = Family(KEY)
    for batch in (4, 8):
        fam.cells[(batch, 512)] = Cell(batch, 512, Variant.parse(SWEPT), 1.0)
        fam.graph[batch] = GraphPick(batch, Variant.parse(SWEPT), 0.1, 512)
    return ServingTable("H200", {"date": "2026-12-02"}, [4, 8], [512, 4096], {KEY: fam})


def _shape(batch: int, times: dict, kind: str = "uniform", mean: float = 3000.0) -> dict:
    best = min(times, key=times.get)
    return {"kind": kind, "family": KEY.as_dict(), "batch": batch, "mean_kv_len": mean,
            "kv_lens": int(mean) if kind == "uniform" else [int(mean) - 10, int(mean) + 10],
            "best": best, "best_us": times[best], "final_us": times, "short_us": {}}


def _report(path: Path, shapes: list) -> Path:
    path.write_text(json.dumps({"schema": VERIFY_SCHEMA, "shapes": shapes}))
    return path


def test_a_bucket_takes_the_variant_clearly_faster_over_enough_shapes_of_runs_that_timed_its_pick(tmp_path):
    # bucket 4: BETTER 10% faster than the swept pick at 6 shapes (one ragged, its worst);
    # bucket 8: only 2% faster (under MARGIN): kept
    shapes = [_shape(3, {SWEPT: 110.0, BETTER: 100.0}) for _ in range(5)]
    shapes.append(_shape(4, {SWEPT: 100.0, BETTER: 90.0, PARTIAL: 80.0}, kind="ragged", mean=900.0))
    shapes += [_shape(7, {SWEPT: 102.0, BETTER: 100.0}) for _ in range(6)]
    table = _table()
    lines = []
    changes = repick.repick_graph(table, [_report(tmp_path / "r.json", shapes)], log=lines.append)
    assert [(c["batch"], c["was"], c["now"], c["shapes"]) for c in changes] == [(4, SWEPT, BETTER, 6)]
    pick = table.families[KEY].graph[4]
    assert pick.variant == Variant.parse(BETTER)  # PARTIAL, timed at one shape of six, does not compete
    assert pick.worst_regret == pytest.approx(90.0 / 80.0 - 1.0)  # its worst: the ragged shape
    assert pick.worst_kv_len == 0
    assert pick.chosen_on == {"reports": 1, "shapes": 6, "geomean_regret": round(1.125 ** (1 / 6) - 1, 4),
                              "sweep_pick": SWEPT, "sweep_geomean_regret": round((1.1 ** 5 * 1.25) ** (1 / 6) - 1, 4)}
    assert table.families[KEY].graph[8].variant == Variant.parse(SWEPT) and table.families[KEY].graph[8].chosen_on is None
    assert table.provenance["graph_repick"] == {"reports": ["r.json"], "margin": repick.MARGIN,
                                                "min_shapes": repick.MIN_SHAPES, "replaced": 1}
    assert len(lines) == 1 and "batch 4" in lines[0]
    # too few shapes, a run under another timing protocol, a run that never timed the pick
    shapes = [_shape(3, {SWEPT: 150.0, BETTER: 100.0}) for _ in range(repick.MIN_SHAPES - 1)]
    table = _table()
    assert repick.repick_graph(table, [_report(tmp_path / "r.json", shapes)], log=lambda _: None) == []
    table.provenance = {**table.provenance, "search": {"step_layers": 8}}  # points timed as steps
    with pytest.raises(VerifyError, match="timed each candidate as one flushed call"):
        repick.repick_graph(table, [_report(tmp_path / "r.json", shapes)], log=lambda _: None)
    table.provenance = {k: v for k, v in table.provenance.items() if k != "search"}
    # an older run whose config did not offer the swept pick (it timed SWEPT nowhere) has
    # BETTER faster at 6 shapes: it cannot replace a pick it never ran; a run that timed
    # SWEPT somewhere (another bucket) can
    older = _report(tmp_path / "older.json", [_shape(3, {BETTER: 100.0, PARTIAL: 110.0}) for _ in range(6)])
    assert repick.repick_graph(table, [older], log=lambda _: None) == []
    assert table.families[KEY].graph[4].variant == Variant.parse(SWEPT)
    newer = _report(tmp_path / "newer.json", [_shape(3, {BETTER: 100.0}) for _ in range(6)]
                    + [_shape(7, {SWEPT: 100.0, BETTER: 100.0})])
    (change,) = repick.repick_graph(table, [older, newer], log=lambda _: None)
    assert (change["batch"], change["now"], change["shapes"]) == (4, BETTER, 6)
    # a pick not timed at every shape (pruned at one) gives way to the best timed everywhere
    shapes = [_shape(3, {SWEPT: 100.0, BETTER: 101.0}) for _ in range(6)] + [_shape(3, {BETTER: 100.0})]
    table = _table()
    (change,) = repick.repick_graph(table, [_report(tmp_path / "r.json", shapes)], log=lambda _: None)
    assert change["now"] == BETTER and change["was_geomean_regret"] is None


def _loop(path: Path, rows: dict, gpu: str = "H200", **fields) -> Path:
    """An engine-loop report (scripts/engine_loop.py's) of KEY's family: {batch: {variant: ms}}."""
    report = {"report": repick.ENGINE_REPORT, "gpu": gpu, "device": f"NVIDIA {gpu}", "table": "t.serving.yaml",
              **KEY.as_dict(), "layers": 61, "steps": 16, "lens": [500, 4000],
              "buckets": [{"bucket": b, "variant": SWEPT, "steps_ms": times} for b, times in rows.items()]}
    path.write_text(json.dumps({**report, **fields}))
    return path


def test_engine_loops_replace_a_slower_pick_leave_one_they_did_not_time_and_refuse_a_bad_report(tmp_path):
    table = _table()
    lines = []
    untimed = _loop(tmp_path / "u.json", {4: {BETTER: 1.0, PARTIAL: 1.5}})
    assert repick.repick_graph_on_steps(table, [untimed], log=lines.append) == []
    assert "not timed in every loop" in lines[0] and table.families[KEY].graph[4].variant == Variant.parse(SWEPT)
    for path, says in [(_loop(tmp_path / "h100.json", {4: {SWEPT: 2.0, BETTER: 1.0}}, gpu="H100"),
                        "timed on H100 .* the table is for H200"),
                       (_loop(tmp_path / "heads.json", {4: {SWEPT: 2.0}}, heads=128), "no family"),
                       (_loop(tmp_path / "bucket.json", {6: {SWEPT: 2.0}}), "batch 6 is not a batch bucket"),
                       (_loop(tmp_path / "zero.json", {4: {SWEPT: 0.0}}), "positive ms per step"),
                       (_loop(tmp_path / "kind.json", {4: {SWEPT: 1.0}}, report="other"), "not an engine-loop report"),
                       (_loop(tmp_path / "row.json", {}, buckets=[4]), "a bucket's row needs"),
                       (_loop(tmp_path / "text.json", {4: {"not a variant": 1.0}}), "batch 4: variant text"),
                       (tmp_path / "missing.json", "no such engine-loop report")]:
        with pytest.raises(VerifyError, match=says):
            repick.repick_graph_on_steps(table, [path], log=lambda _: None)
    assert table.families[KEY].graph[4].variant == Variant.parse(SWEPT)
    # bucket 4: BETTER's step 20% and 4% faster in two loops (geomean 11.7%): replaced, its
    # worst over the loops 0 (fastest in both); PARTIAL, timed in one loop of two, does not
    # compete, though it beat SWEPT there; bucket 8: 2% faster (under MARGIN): kept
    short = _loop(tmp_path / "short.json", {4: {SWEPT: 1.2, BETTER: 1.0, PARTIAL: 1.1}, 8: {SWEPT: 1.02, BETTER: 1.0}})
    long = _loop(tmp_path / "long.json", {4: {SWEPT: 2.08, BETTER: 2.0}})
    lines.clear()
    changes = repick.repick_graph_on_steps(table, [short, long], log=lines.append)
    assert [(c["batch"], c["was"], c["now"], c["shapes"]) for c in changes] == [(4, SWEPT, BETTER, 2)]
    pick = table.families[KEY].graph[4]
    assert (pick.variant, pick.worst_regret, pick.worst_kv_len) == (Variant.parse(BETTER), 0.0, 0)
    assert pick.chosen_on == {"reports": 2, "shapes": 2, "geomean_regret": 0.0, "sweep_pick": SWEPT,
                              "sweep_geomean_regret": round((1.2 * 1.04) ** 0.5 - 1, 4),
                              "engine_loops": ["short.json", "long.json"]}
    assert table.families[KEY].graph[8].variant == Variant.parse(SWEPT)
    assert table.provenance["graph_repick_steps"] == {"reports": ["short.json", "long.json"],
                                                      "margin": repick.MARGIN, "replaced": 1}
    assert len(lines) == 1 and "batch 4" in lines[0]
    back = load_serving_table(write_serving_table(tmp_path / "t.serving.yaml", table))
    assert back.families[KEY].graph == table.families[KEY].graph
    # verify runs that time the other variant 10% faster at both buckets re-choose bucket 8,
    # not bucket 4, whose pick the loops chose
    shapes = [_shape(3, {SWEPT: 100.0, BETTER: 110.0}) for _ in range(6)]
    shapes += [_shape(7, {SWEPT: 110.0, BETTER: 100.0}) for _ in range(6)]
    lines.clear()
    (change,) = repick.repick_graph(back, [_report(tmp_path / "r.json", shapes)], log=lines.append)
    assert change["batch"] == 8 and back.families[KEY].graph[4].variant == Variant.parse(BETTER)
    assert any("batch 4" in line and "chosen on engine loops; left" in line for line in lines)


def test_a_variant_the_sweeps_gate_refused_never_becomes_a_pick_on_either_source(tmp_path):
    """provenance.gate_refused (the sweep's records): BETTER, 20% faster in a loop and 10% over
    verify's shapes, was refused there, so the next fastest, PARTIAL, replaces the pick."""
    table = _table()
    table.provenance["gate_refused"] = {str(KEY): {BETTER: "ragged probe: 2.67% of elements outside"}}
    lines = []
    loop = _loop(tmp_path / "loop.json", {4: {SWEPT: 1.2, BETTER: 1.0, PARTIAL: 1.1}})
    (change,) = repick.repick_graph_on_steps(table, [loop], log=lines.append)
    assert (change["batch"], change["now"]) == (4, PARTIAL)
    assert [line for line in lines if "refused" in line] == [
        f"  {KEY}: {BETTER} was refused by the sweep's gate (ragged probe: 2.67% of elements outside); "
        "not a candidate"]
    shapes = [_shape(7, {SWEPT: 110.0, BETTER: 100.0}) for _ in range(6)]
    assert repick.repick_graph(table, [_report(tmp_path / "r.json", shapes)], log=lambda _: None) == []
    table.provenance["gate_refused"] = {str(KEY): [BETTER]}
    with pytest.raises(TableError, match="gate_refused.*must map variants to reasons"):
        repick.repick_graph_on_steps(table, [loop], log=lambda _: None)


def test_the_command_repicks_on_either_source_writes_the_table_and_leaves_the_input_alone(tmp_path):
    source = write_serving_table(tmp_path / "in.serving.yaml", _table())
    before = source.read_bytes()
    report = _report(tmp_path / "r.json", [_shape(3, {SWEPT: 120.0, BETTER: 100.0}) for _ in range(6)])
    loop = _loop(tmp_path / "loop.json", {8: {SWEPT: 1.3, BETTER: 1.0}})
    out = tmp_path / "out.serving.yaml"
    for runs, batch, next_step in [(["--rescore", report], 4, "--judge graph"),
                                   (["--engine-loop", loop], 8, "engine_loop.py")]:
        result = invoke("verify", "--table", source, *runs, "--repick-graph", out)
        assert result.exit_code == 0, result.output
        assert "1 graph pick(s) replaced" in result.output and next_step in result.output
        assert load_serving_table(out).families[KEY].graph[batch].variant == Variant.parse(BETTER)
    # never without runs, with both sources, over its own input, a file that is not a serving
    # table, or with options it would ignore
    text = tmp_path / "notes.txt"
    text.write_text("mine")
    for args, code, says in [(["--repick-graph", out], 2, "--rescore"),
                             (["--engine-loop", loop, "--rescore", report, "--repick-graph", out], 2,
                              "one of the two"),
                             (["--engine-loop", loop], 2, "give --repick-graph"),
                             (["--rescore", report, "--repick-graph", source], 2, "is the table it re-chooses from"),
                             (["--rescore", report, "--repick-graph", text], 1, "exists and is not a serving table"),
                             (["--rescore", report, "--repick-graph", out, "--json", tmp_path / "v.json"], 2,
                              "drop --json")]:
        refused = invoke("verify", "--table", source, *args)
        assert refused.exit_code == code and says in refused.output, refused.output
    assert source.read_bytes() == before and text.read_text() == "mine"


def test_the_engine_loops_candidates_expand_the_familys_picks_and_leave_out_what_the_gate_refused():
    """scripts/engine_loop.py's --variants on the committed table at fp8, 128 heads, q_len 4:
    graph-picks and cell-picks name the family's entries, each once, and FlashMLA's fp8
    kernel, which the sweep's gate refused there, is left out with the gate's reason."""
    loop = runpy.run_path(str(REPO / "scripts" / "engine_loop.py"))
    table = load_serving_table(REPO / "tables" / "H200.serving.yaml")
    spec = CallSpec("fp8", 64, 128, 4, graph=True, host_lengths=True)
    family = table.family(spec)
    fm = "flashmla(kv=fp8,q=fp8_dynamic)"
    graph = list(dict.fromkeys(g.variant for _, g in sorted(family.graph.items())))
    cells = {c.variant for c in family.cells.values()} | {
        c.runner_up_variant for c in family.cells.values() if c.runner_up_variant}
    variants, left = loop["loop_candidates"](f"graph-picks;cell-picks;{fm};{graph[0]}", table, spec)
    assert variants[:len(graph)] == graph and set(variants) == set(graph) | cells
    assert len(variants) == len(set(variants)) and Variant.parse(fm) not in variants
    assert left == [f"{fm}: refused by the sweep's gate ({gate_refused(table, family.key)[fm]}); not looped"]
    assert loop["loop_candidates"]("", table, spec) == ([], [])
    with pytest.raises(ValueError, match="no family for fp8 KV, 32 heads"):
        loop["loop_candidates"]("graph-picks", table, CallSpec("fp8", 64, 32, 1, graph=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_engine_loop_writes_a_report_the_re_choice_reads(tmp_path):
    """scripts/engine_loop.py on the GPU, 2 layers, buckets 1 and 2 of bf16 at 16 heads and
    q_len 2, the family's graph picks and FlashMLA as candidates (each checked strict by the
    script): its report names every candidate at every bucket, and the re-choice reads it."""
    table = REPO / "tables" / "H200.serving.yaml"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the vendors' path kept
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "engine_loop.py"), "--layers", "2", "--steps", "3", "--buckets", "1,2",
         "--kv", "bf16", "--heads", "16", "--q-len", "2", "--lens", "64,300", "--table", str(table),
         "--variants", "graph-picks;flashmla(kv=bf16,q=bf16)", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-2000:]
    report = repick.read_engine_report(tmp_path / "engine_loop.json")
    assert (report["heads"], report["q_len"], report["layers"], report["lens"]) == (16, 2, 2, [64, 300])
    chosen = load_serving_table(table)
    family = chosen.families[FamilyKey("bf16", 64, 16, 2)]
    candidates = {str(g.variant) for g in family.graph.values()} | {"flashmla(kv=bf16,q=bf16)"}
    assert [row["bucket"] for row in report["buckets"]] == [1, 2]
    assert all(set(row["steps_ms"]) == candidates for row in report["buckets"]), (
        [(row["bucket"], sorted(row["steps_ms"])) for row in report["buckets"]], done.stdout[-3000:])
    chosen.gpu = report["gpu"]  # the committed table's GPU may not be this one
    repick.repick_graph_on_steps(chosen, [tmp_path / "engine_loop.json"], log=lambda _line: None)
