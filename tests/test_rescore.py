"""`mla-tune verify --rescore` (serving/rescore.py): a table's picks scored on a report's times."""

import gzip
import json
import math

import pytest

from mla_tune.core import Variant
from mla_tune.serving import rescore as rs
from mla_tune.serving.table import Cell, Family, FamilyKey, GraphPick, ServingTable
from mla_tune.serving.verify import VERIFY_SCHEMA, VerifyError

KEY = FamilyKey("bf16", 64, 16, 1)
OTHER = FamilyKey("fp8", 64, 128, 4)  # a family the table lacks
A, B, C, D, F = (  # F: the fallback
    str(Variant.parse(f"triton(block_h=16,block_n=32,dot_dtype=bf16,kv=bf16,max_splits={n},num_stages=2,"
                      "num_warps=4,q=bf16,tokens_per_split=128)")) for n in (2, 4, 8, 16, 64))


def _table(eager: str, graph: str = B, runner_up: dict | None = None) -> ServingTable:
    fam = Family(KEY)
    for kv in (512, 1024):
        fam.cells[(4, kv)] = Cell(4, kv, Variant.parse(eager), 1.0, runner_up=runner_up)
    fam.graph[4] = GraphPick(4, Variant.parse(graph), 0.1, 512)
    return ServingTable("H200", {}, [4], [512, 1024], {fam.key: fam})


def _shape(index: int, key: FamilyKey, final: dict, short=(), pruned=(), kind="uniform") -> dict:
    best = min(final, key=final.get)
    return {"index": index, "kind": kind, "family": key.as_dict(), "batch": 3,
            "kv_lens": 700 if kind == "uniform" else [600, 800], "mean_kv_len": 700.0,
            "roles": {"eager": A, "graph": B, "fallback": F}, "from_table": {"eager": True, "graph": True},
            "best": best, "best_us": final[best],
            "regret": {"eager": 0.0, "graph": 0.0, "fallback": final[F] / final[best] - 1},
            "final_us": final, "short_us": {**dict(short), **final}, "pruned": list(pruned), "failed": {},
            "checks": {v: {"passed": True, "reason": "ok"} for v in final}}


def _report(path, shapes, seed=1, **fields):
    """A verify report at `path` (its other top-level `fields`), gzipped where it ends in .gz."""
    report = {"schema": VERIFY_SCHEMA, "device": {"name": "H200"}, "options": {"seed": seed},
              "shapes": shapes, **fields}
    with gzip.open(path, "wt") if path.suffix == ".gz" else open(path, "w") as handle:
        handle.write(json.dumps(report))
    return path


@pytest.fixture
def reports(tmp_path):
    one = _report(tmp_path / "v1.json", [
        _shape(0, KEY, {A: 110.0, B: 130.0, C: 100.0, F: 200.0}),
        _shape(1, KEY, {B: 120.0, C: 100.0, F: 150.0}, {A: 104.0}, [D], kind="ragged"),
    ], seed=1)
    two = _report(tmp_path / "v2.json.gz", [
        _shape(0, KEY, {A: 100.0, B: 125.0, F: 300.0}, {C: 90.0}, [D]),
        _shape(1, OTHER, {F: 100.0, D: 80.0}),  # no family in the table: the fallback
    ], seed=2)
    return [one, two]


def test_a_rescore_scores_a_folders_reports_in_order_unrunnable_picks_by_stand_ins_fails_an_unmeasured_pick(
        reports, tmp_path):
    """And refuses by name: a bad report, an unwritable --json, reports of another protocol."""
    (tmp_path / "notes.txt").write_text("not a report")
    assert rs.report_paths([tmp_path]) == sorted(reports)
    out = rs.rescore(_table(A), [tmp_path], log=lambda _: None)
    regrets = [(r["regret"]["eager"], r["measured"]["eager"]) for r in out["shapes"]]
    assert regrets == [(pytest.approx(0.10), "final"), (pytest.approx(0.04), "short"),
                       (pytest.approx(0.0), "final"), (pytest.approx(0.25), "final")]
    assert [r["regret"]["graph"] for r in out["shapes"]] == [pytest.approx(0.3), pytest.approx(0.2),
                                                             pytest.approx(0.25), pytest.approx(0.25)]
    assert out["shapes"][3]["roles"]["eager"] == F and not out["shapes"][3]["from_table"]["eager"]
    assert out["summary"]["eager"]["all"]["max"] == pytest.approx(0.25)
    assert [r["seed"] for r in out["reports"]] == [1, 2]
    assert out["reports"][0]["eager"]["max"] == pytest.approx(0.10)
    assert out["exit_code"] == 0 and not out["verdict"]["failed"]
    with pytest.raises(VerifyError, match="--judge must be"):
        rs.rescore(_table(A), reports, judge="mean", log=lambda _: None)
    # a pick the report did not measure fails and stays out of the statistics
    lines: list[str] = []
    out = rs.rescore(_table(D), reports, max_regret=0.5, json_path=tmp_path / "r.json", log=lines.append)
    assert [r["regret"]["eager"] for r in out["shapes"]][:3] == [None, None, None]  # D: absent, pruned, pruned
    assert out["unmeasured"] == 3 and out["summary"]["eager"]["all"]["n"] == 1
    assert out["exit_code"] == 1
    assert any("not measured there" in reason for reason in out["verdict"]["reasons"])
    assert any(line.startswith("FAIL") for line in lines)
    assert json.loads((tmp_path / "r.json").read_text())["schema"] == rs.RESCORE_SCHEMA
    # backends that cannot run are scored by the stand-ins a plan runs instead
    fm = str(Variant.make("flashmla", kv="bf16", q="bf16"))
    table = _table(fm, fm, runner_up={"variant": C, "time_us": 1.1})
    out = rs.rescore(table, reports, unrunnable=["flashmla"], log=lambda _: None)
    assert [r["roles"]["eager"] for r in out["shapes"]] == [C, C, C, F]  # the runner-up
    assert [r["roles"]["graph"] for r in out["shapes"]] == [F, F, F, F]  # no stand-in: the fallback
    assert [r["regret"]["eager"] for r in out["shapes"]][:3] == [0.0, 0.0, pytest.approx(-0.1)]
    assert out["unrunnable"] == ["flashmla"]
    with pytest.raises(VerifyError, match="--unrunnable flash_mla: not a backend"):
        rs.rescore(table, reports, unrunnable=["flash_mla"], log=lambda _: None)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "serving-results/1"}))
    for name, says in (("missing.json", "no such verify report"), ("bad.json", "not a verify report"),
                       ("other.json", "rescore reads 'serving-verify/1'")):
        with pytest.raises(VerifyError, match=says):
            rs.read_report(tmp_path / name)
    with pytest.raises(VerifyError, match="at least one verify report"):
        rs.rescore(_table(A), [], log=lambda _: None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerifyError, match="a folder with no verify reports"):
        rs.report_paths([tmp_path / "empty"])
    # a --json that cannot be written is refused before any work (verify's too: check_json_path)
    (tmp_path / "file").write_text("")
    for bad, says in ((tmp_path / "empty", "is a folder"), (tmp_path / "file" / "r.json", "cannot write into")):
        with pytest.raises(VerifyError, match=says):
            rs.rescore(_table(A), reports, json_path=bad, log=pytest.fail)
    # a table swept as 8-layer steps (search.step_layers) is not scored on reports of single
    # flushed calls, nor the other way round; reports of its own protocol are
    stepped = _table(A)
    stepped.provenance = {"search": {"step_layers": 8}}
    with pytest.raises(VerifyError, match=r"v1\.json timed each candidate as one flushed call, the table's "
                                          r"points were timed as a layer of a 8-layer step"):
        rs.rescore(stepped, reports, log=lambda _: None)
    shapes = [_shape(0, KEY, {A: 110.0, C: 100.0, F: 200.0})]
    steps = _report(tmp_path / "steps.json", shapes, seed=3, protocol={"step_layers": 8})
    assert len(rs.rescore(stepped, [steps], log=lambda _: None)["shapes"]) == 1
    with pytest.raises(VerifyError, match="as a layer of a 8-layer step, the table's points were timed as one "
                                          "flushed call"):
        rs.rescore(_table(A), [steps], log=lambda _: None)


def test_a_shape_recorded_twice_is_summarized_across_recordings_and_the_points_agreement(reports, tmp_path):
    again = _report(tmp_path / "v3.json", [  # v1's shapes, recorded again: A stays 5% behind at #0
        _shape(0, KEY, {A: 105.0, B: 130.0, C: 100.0, F: 200.0}),
        _shape(1, KEY, {A: 90.0, B: 120.0, C: 100.0, F: 150.0}, pruned=[D], kind="ragged"),
    ], seed=1)
    assert rs.rescore(_table(A), reports[:1], log=lambda _: None)["repeats"] is None  # no shape twice
    lines: list[str] = []
    rep = rs.rescore(_table(A), [reports[0], again], log=lines.append)["repeats"]
    assert (rep["shapes"], rep["recordings"], rep["same_best"]) == (2, [2], 1)  # #1's best: C, then A
    assert [(s["reports"], s["index"], s["regrets"]) for s in rep["steady"]] == [
        ([str(reports[0]), str(again)], 0, [pytest.approx(0.10), pytest.approx(0.05)])]  # #1: 4%, then 0%
    text = " ".join(line.strip() for line in lines)  # its lines wrapped at 80 columns
    assert ("2 shapes recorded 2 times each: the same best in every recording at 1; "
            "eager regret over 1% in every recording at 1") in text
    assert "  R1  v1.json" in "\n".join(lines) and "  R2  v3.json" in "\n".join(lines)
    assert any(line.startswith("  R1  #0   ") and "10.0% / 5.0%" in line for line in lines)
    assert max(map(len, lines)) <= 80  # in a pipe: 80 columns
    with pytest.raises(VerifyError, match="given twice"):  # a file and its folder: one report, not two recordings
        rs.rescore(_table(A), [reports[0], tmp_path], log=lambda _: None)
    # the points' agreement: relative times just below a point, and between recordings
    table = _table(A)
    table.families[KEY].points = {(4, 1024): {Variant.parse(A): 50.0, Variant.parse(B): 52.5},
                                  (4, 512): {Variant.parse(A): 30.0, Variant.parse(B): 30.0}}

    def at(index, batch, kv, final):
        return {**_shape(index, KEY, final), "batch": batch, "kv_lens": kv, "mean_kv_len": kv * 1.0}
    shapes = [at(0, 4, 1010, {A: 100.0, B: 110.0, C: 90.0, F: 300.0}),  # 1.3% below 1024: B/A 1.10, the point's 1.05
              at(1, 4, 1030, {A: 100.0, B: 200.0, F: 300.0}),  # past the point: not compared
              at(2, 3, 1020, {A: 100.0, B: 200.0, F: 300.0}),  # not a point's batch
              at(3, 4, 490, {A: 100.0, B: 100.0, F: 300.0})]  # 4.3% below 512: too far
    one = _report(tmp_path / "a.json", shapes)
    again = _report(tmp_path / "b.json", [at(0, 4, 1010, {A: 100.0, B: 121.0, C: 95.0, F: 300.0}), *shapes[1:]])
    lines.clear()
    agree = rs.rescore(table, [one, again], log=lines.append)["agreement"]
    assert agree["shapes"] == 2 and agree["points"]["pairs"] == 2  # shape 0 in each report
    assert agree["points"]["median"] == pytest.approx((math.log(1.1 / 1.05) + math.log(1.21 / 1.05)) / 2)
    # between the recordings, relative to the first one's fastest: C at shape 0, A at the others
    again_pairs = sorted([abs(math.log(100 / 90) - math.log(100 / 95)), abs(math.log(110 / 90) - math.log(121 / 95)),
                          abs(math.log(300 / 90) - math.log(300 / 95)), *[0.0] * 6])
    assert agree["recorded_again"]["pairs"] == len(again_pairs)
    assert agree["recorded_again"]["median"] == pytest.approx(again_pairs[4])
    assert agree["recorded_again"]["p90"] == pytest.approx(again_pairs[-1])
    text = " ".join(line.strip() for line in lines)  # its lines wrapped at 80 columns
    assert ("relative times, the table's points against the final rounds at 2 uniform shapes "
            "within 2% below a point: median") in text
