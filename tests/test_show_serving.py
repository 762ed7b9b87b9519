"""`mla-tune show` and `mla-tune diff` on serving tables (mla_tune/serving/render.py)."""

import json
import shutil
from pathlib import Path

from mla_tune.core import Variant
from mla_tune.serving.table import (
    Cell,
    Family,
    FamilyKey,
    GraphPick,
    ServingTable,
    load_serving_table,
    write_serving_table,
)
from tests.helpers import CPU_TABLE as LEADERBOARD
from tests.helpers import NARROW, REPO, assert_commands_import_no_torch, invoke

COMMITTED = REPO / "tables" / "H200.serving.yaml"
LEADERBOARD_H200 = REPO / "tables" / "H200.yaml"
BATCHES = [1, 32, 256]
KVS = [1024, 8192, 65536]
FP8, BF16 = FamilyKey("fp8", 64, 128, 2), FamilyKey("bf16", 0, 16, 1)


def _v(splits: int, kv: str = "fp8") -> Variant:
    return Variant.parse(f"triton(block_h=16,block_n=64,dot_dtype=bf16,kv={kv},max_splits={splits},"
                         "num_stages=2,num_warps=4,q=bf16,tokens_per_split=128)")


def _table() -> ServingTable:
    fp8 = Family(FP8)
    for batch in BATCHES:
        for kv in KVS:
            variant = _v(8) if kv < 65536 else _v(64)
            fp8.cells[(batch, kv)] = Cell(batch, kv, variant, 10.0 * batch + kv / 100)
        fp8.graph[batch] = GraphPick(batch, _v(8), 0.125, 65536)
    del fp8.cells[(256, 65536)]
    fp8.left_out.append({"batch": 256, "kv_len": 65536, "reason": "over max_kv_bytes"})
    del fp8.cells[(256, 8192)]  # neither a pick nor a reason: '.'
    fp8.points = {(1, 1024): {_v(8): 20.24}, (32, 1024): {_v(8): 330.24}}
    fp8.calibration = {"triton": {"reduce_step_us": {16: 2.0}}}
    flashinfer = Variant.parse("flashinfer(kernel=fa3,kv=bf16,q=bf16)")
    bf16 = Family(BF16)
    bf16.cells[(1, 1024)] = Cell(1, 1024, flashinfer, 15.0)
    bf16.graph[1] = GraphPick(1, flashinfer, 0.0, 0)
    return ServingTable("H200", {"date": "2026-12-01", "config": {"path": "configs/serving.yaml",
                                                                  "hash": "6c0e034f4930b8a9c3de"},
                                 "versions": {"flashinfer-python": "0.6.18", "triton": "3.6.0"},
                                 "candidates": {str(FP8): {"triton": 10, "flashinfer": 1}},
                                 "gate_refused": {str(FP8): {"flashmla(kv=fp8,q=fp8_dynamic)": "ragged probe"}}},
                        BATCHES, KVS, {FP8: fp8, BF16: bf16})


def _write(tmp_path: Path, name: str = "H200.serving.yaml") -> Path:
    return write_serving_table(tmp_path / name, _table())


def _shown(*args, env=NARROW) -> str:
    """The output of `mla-tune ARGS`, which exits 0 within 80 columns and without colour."""
    result = invoke(*args, env=env)
    assert result.exit_code == 0, result.output
    assert max(map(len, result.output.splitlines())) <= 80 and "\x1b[" not in result.output
    return result.output


def _legend(lines: list[str], tag: str) -> dict[str, str]:
    """label -> the variant rebuilt from its lines (`  TAG LABEL  text`, continued)."""
    out: dict[str, str] = {}
    for line in lines:
        words = line.split(maxsplit=2)
        if len(words) == 3 and words[0] == tag:
            out[words[1]] = out.get(words[1], "") + words[2].strip()
    return out


def test_show_prints_every_pick_in_80_columns_wide_grids_split_its_json_every_cell_and_by_gpu_each_table(tmp_path):
    """The committed table too: each family's grid, and the graph picks engine loops chose."""
    path = _write(tmp_path)
    lines = _shown("show", "--table", path).splitlines()
    assert "batch buckets: 1 32 256" in lines and "kv buckets: 1024 8192 65536" in lines
    assert any(line.startswith(str(FP8)) and "(fp8/p64/h128/q2)" in line for line in lines)
    assert any(line.startswith(str(BF16)) and "(bf16/contig/h16/q1)" in line for line in lines)
    legend = _legend(lines, "fp8/p64/h128/q2")
    assert legend == {"A": str(_v(8)), "B": str(_v(64))}  # the most used first, each in full
    first = lines.index(next(line for line in lines if "(fp8/p64/h128/q2)" in line))
    start = next(i for i in range(first, len(lines)) if lines[i].split()[:1] == ["batch"])
    assert lines[start].split() == ["batch", "1024", "8192", "65536", "graph", "worst", "by"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[start + 1:start + 4]}
    assert rows == {"1": ["A", "A", "B", "A", "12.5%", "sweep"], "32": ["A", "A", "B", "A", "12.5%", "sweep"],
                    "256": ["A", ".", "-", "A", "12.5%", "sweep"]}
    assert "  candidates: triton 10, flashinfer 1" in lines
    assert "  refused by the gate: flashmla(kv=fp8,q=fp8_dynamic): ragged probe" in lines
    assert any("-: 1 cell(s) left out by the config, e.g. 256x65536: over max_kv_bytes" in line for line in lines)
    assert "  .: 1 cell(s) with no pick and no reason: the fallback serves them" in lines
    assert "  config: configs/serving.yaml (hash 6c0e034f4930)" in lines
    assert "  versions: flashinfer-python 0.6.18, triton 3.6.0" in lines
    # grep for one parameter finds lines that say whose variant it is
    assert all(line.split()[0] == "fp8/p64/h128/q2" for line in lines if "max_splits=64" in line)
    # --times adds each family's grid of times
    lines = _shown("show", "--table", path, "--times").splitlines()
    start = lines.index("  the eager picks' times (us), fp8/p64/h128/q2:")
    assert lines[start + 1].split() == ["batch", "1024", "8192", "65536"]
    assert lines[start + 2].split() == ["1", "20.2", "91.9", "665.4"]  # 10 x batch + kv / 100
    assert lines[start + 4].split() == ["256", "2570", ".", "-"]
    kvs = [2 ** i for i in range(6, 20)]  # 14 kv buckets, 64 .. 524288: too wide for 80 columns
    wide = _table()
    wide.kv_buckets = kvs
    wide.families[FP8].cells = {(b, k): Cell(b, k, _v(8), 1234.5) for b in BATCHES for k in kvs}
    wide.families[FP8].left_out = []
    lines = _shown("show", "--table", write_serving_table(tmp_path / "wide.serving.yaml", wide), "--times").splitlines()
    headers = [line.split() for line in lines if line.split()[:1] == ["batch"] and "buckets:" not in line]
    shown = [int(k) for h in headers for k in h[1:] if k.isdigit()]
    assert sorted(shown) == sorted(kvs * 4)  # every kv bucket in both families' picks and times grids
    assert sum(h[-3:] == ["graph", "worst", "by"] for h in headers) == 2  # once a family, after its last kvs
    # --json holds every cell, graph pick and left-out cell
    data = json.loads(invoke("show", "--table", path, "--json").output)
    assert data["kind"] == "serving" and data["path"] == str(path) and data["gpu"] == "H200"
    assert data["batch_buckets"] == BATCHES and data["kv_buckets"] == KVS
    fams = {f["name"]: f for f in data["families"]}
    fp8 = fams[str(FP8)]
    assert fp8["key"] == {"kv_format": "fp8", "page_size": 64, "heads": 128, "q_len": 2}
    assert len(fp8["cells"]) == 7 and fp8["cells"][0] == {"batch": 1, "kv_len": 1024, "variant": str(_v(8)),
                                                          "time_us": 20.24}
    assert fp8["graph"][2] == {"batch": 256, "variant": str(_v(8)), "worst_regret": 0.125, "worst_kv_len": 65536}
    assert fp8["left_out"] == [{"batch": 256, "kv_len": 65536, "reason": "over max_kv_bytes"}]
    assert fams[str(BF16)]["candidates"] == {} == fams[str(BF16)]["gate_refused"]
    assert fp8["gate_refused"] == {"flashmla(kv=fp8,q=fp8_dynamic)": "ragged probe"}
    # an unquoted YAML date is text in the JSON
    path.write_text(path.read_text().replace("date: '2026-12-01'", "date: 2026-12-01"))
    result = invoke("show", "--table", path, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["provenance"]["date"] == "2026-12-01"
    # --gpu shows the leaderboard table and names the serving one beside it
    shutil.copy(LEADERBOARD, tmp_path / "cpu.yaml")
    _write(tmp_path, "cpu.serving.yaml")
    env = {**NARROW, "MLA_TUNE_TABLES": str(tmp_path)}
    output = _shown("show", "--gpu", "cpu", env=env)
    assert "winner torch(kv=bf16,q=bf16)" in output  # the leaderboard table
    note = [line for line in output.splitlines() if "serving table" in line]
    assert note == ["A serving table sits beside it: `mla-tune show --gpu cpu --serving` shows it."]
    output = _shown("show", "--gpu", "cpu", "--serving", env=env)
    assert "serving table for H200, 2 families" in output
    result = invoke("show", "--gpu", "none", "--serving", env=env)
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "none.serving.yaml does not exist" in result.output
    # the committed table, in 80 columns: the acceptance, `COLUMNS=80 mla-tune show --table
    # tables/H200.serving.yaml | cat` (show in a pipe, in a process of its own: test_cli.py)
    lines = _shown("show", "--table", COMMITTED).splitlines()
    families = COMMITTED.read_text().count("\n- key:")  # each family's first line in the file
    heads = [line for line in lines if " KV, " in line and "): " in line]  # ... and in the view
    assert families >= 1 and len(heads) == families
    grids = [line for line in lines if line.split()[:1] == ["batch"] and "buckets:" not in line]
    assert len(grids) == families and all(g.split()[-3:] == ["graph", "worst", "by"] for g in grids)
    assert "provenance:" in lines and any(line.startswith("  config: configs/serving.yaml") for line in lines)
    # which graph picks engine loops chose (bf16 bucket 8 at 128 heads, q_len 1, among them)
    table = load_serving_table(COMMITTED)
    loops = table.provenance["graph_repick_steps"]
    assert any(line == f"  graph picks: {table.provenance['graph_repick']['replaced']} re-chosen on "
               f"{len(table.provenance['graph_repick']['reports'])} verify reports; {loops['replaced']} "
               f"re-chosen on {len(loops['reports'])} engine loops" for line in lines)
    first = lines.index(next(line for line in lines if "(bf16/p64/h128/q1)" in line))
    row = next(line.split() for line in lines[first:] if line.split()[:1] == ["8"])
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert row[-1] == "loops" and sum(r[-1] == "loops" for r in rows) == loops["replaced"]
    data = json.loads(invoke("show", "--table", COMMITTED, "--json").output)
    graph = next(f for f in data["families"] if f["tag"] == "bf16/p64/h128/q1")["graph"]
    assert next(g for g in graph if g["batch"] == 8)["chosen_on"]["engine_loops"] == [
        "engine_bf16_h128_q1_500-4000.json"]


def test_diff_of_serving_tables_flags_pick_and_time_changes_per_family_and_none_with_itself_without_torch(tmp_path):
    from mla_tune.serving.render import table_kind

    old = _write(tmp_path, "old.serving.yaml")
    changed = _table()  # the new table: picks, times, a left-out cell, a graph pick, points, calibration
    fp8 = changed.families[FP8]
    fp8.cells[(1, 1024)] = Cell(1, 1024, _v(16), fp8.cells[(1, 1024)].time_us * 1.2)  # pick and time
    fp8.cells[(32, 1024)] = Cell(32, 1024, _v(8), fp8.cells[(32, 1024)].time_us * 1.005)  # inside noise
    fp8.cells[(32, 8192)] = Cell(32, 8192, _v(8), fp8.cells[(32, 8192)].time_us * 0.9)  # faster
    del fp8.cells[(1, 65536)]
    fp8.left_out.append({"batch": 1, "kv_len": 65536, "reason": "over the budget"})
    fp8.graph[32] = GraphPick(32, _v(64), 0.05, 1024)
    # what the eager lookup reads besides the cells: one point entry added, one moved
    fp8.points[(1, 1024)][_v(16)] = 30.0
    fp8.points[(32, 1024)][_v(8)] *= 1.1
    fp8.calibration = {"triton": {"reduce_step_us": {16: 2.5}}}
    new = write_serving_table(tmp_path / "new.serving.yaml", changed)
    assert_commands_import_no_torch(["show", "--table", old], ["show", "--table", old, "--json"],
                                    ["diff", old, new], ["diff", old, new, "--json"],
                                    ["show", "--table", LEADERBOARD_H200],  # a leaderboard table's too
                                    ["show", "--table", LEADERBOARD, "--json"],
                                    ["diff", LEADERBOARD, LEADERBOARD_H200])
    output = _shown("diff", old, new)
    lines, text = output.splitlines(), " ".join(output.split())
    assert "8 cells: 2 with another pick (or in one table only), 2 with a time change outside" in text
    assert "6 graph picks: 1 changed" not in text and "4 graph picks: 1 changed" in text
    assert "point entries (what the eager lookup interpolates: + new, - gone, ~ a time change outside " \
           "the noise) +1 -0 ~1 of 3; calibration changed in 1 families" in text
    assert any(line.startswith(f"{FP8} (fp8/p64/h128/q2): 3 of 7 cells and 1 of 3") for line in lines)
    assert "graph picks changed; point entries +1 -0 ~1 of 3" in text
    assert '  old calibration: {"triton":{"reduce_step_us":{"16":2.0}}}' in lines
    assert '  new calibration: {"triton":{"reduce_step_us":{"16":2.5}}}' in lines
    rows = {line.split()[0]: line for line in lines if line.startswith("  ") and "x" in line.split()[0]}
    assert rows["1x1024"].split()[1:] == ["A", "C", "20.2", "24.3", "+20.0%", "SLOWER", "pick", "changed"]
    assert rows["32x8192"].split()[1:] == ["A", "A", "401.9", "361.7", "-10.0%", "FASTER", "same", "pick"]
    assert rows["1x65536"].split()[1:4] == ["B", "-", "665.4"] and "left out in new" in rows["1x65536"]
    assert "32x1024" not in rows  # same pick, inside the noise
    legend = _legend(lines, "fp8/p64/h128/q2")
    assert legend == {"A": str(_v(8)), "B": str(_v(64)), "C": str(_v(16))}  # the most used first
    graph = [line.split() for line in lines if line.startswith("  32 ")]
    assert graph == [["32", "A", "B", "12.5%", "5.0%", "sweep", "pick", "changed"]]
    data = json.loads(invoke("diff", old, new, "--json").output)
    assert data["kind"] == "serving" and data["noise"] == 0.01
    cells = {(c["batch"], c["kv_len"]): c for f in data["families"] if f["family"] == str(FP8) for c in f["cells"]}
    assert cells[(1, 1024)]["flagged"] and cells[(1, 1024)]["status"] == "pick changed"
    assert cells[(32, 1024)] | {"old_us": 0, "new_us": 0} == {
        "batch": 32, "kv_len": 1024, "old_pick": str(_v(8)), "new_pick": str(_v(8)), "old_us": 0, "new_us": 0,
        "change": 0.005, "noise": 0.01, "flagged": False, "status": "same pick"}
    assert cells[(1, 65536)]["status"] == "left out in new" and cells[(1, 65536)]["change"] is None
    fp8 = next(f for f in data["families"] if f["family"] == str(FP8))
    assert fp8["points"] == {"added": 1, "removed": 0, "changed": 1, "of": 3}
    assert fp8["calibration"] == {"old": {"triton": {"reduce_step_us": {"16": 2.0}}},
                                  "new": {"triton": {"reduce_step_us": {"16": 2.5}}}}
    # with itself nothing changes; with a leaderboard table (told by its schema line) it is one line
    serving = _write(tmp_path)
    text = " ".join(_shown("diff", serving, serving).split())
    assert "8 cells: 0 with another pick" in text and "0 with a time change" in text
    assert "graph picks: 0 changed" in text and "cells and" not in text  # no family listed
    assert "+0 -0 ~0 of 2; calibration changed in 0 families" in text
    for pair in ((LEADERBOARD, serving), (serving, LEADERBOARD)):
        result = invoke("diff", *pair)
        assert result.exit_code == 1
        assert result.output.count("\n") == 1 and result.output.startswith("error: cannot diff")
        assert "a leaderboard table" in result.output and "a serving table" in result.output
    result = invoke("diff", serving, tmp_path / "gone.serving.yaml")  # unreadable: its loader says why
    assert result.exit_code == 1 and "gone.serving.yaml does not exist" in result.output
    # show's options that would be ignored, or disagree, are refused
    for args, code, says in [(("--gpu", "MI355X", "--table", serving), 1, "is for H200, not MI355X"),
                             (("--gpu", "MI355X", "--table", LEADERBOARD), 1, "not MI355X"),
                             (("--table", LEADERBOARD, "--serving"), 2, "is not one"),
                             (("--table", LEADERBOARD, "--times"), 2, "--times shows a serving table's")]:
        result = invoke("show", *args)
        assert result.exit_code == code and says in result.output, (args, result.output)
    empty = tmp_path / "empty.yaml"  # no schema line, so not a serving table: but not a table at all
    empty.write_text("")
    result = invoke("diff", empty, serving)
    assert result.exit_code == 1 and "empty.yaml: the top level must be a mapping" in result.output, result.output
    # the kind of table, read from its schema line without parsing the table
    cases = {"a.yaml": "# c\nschema: serving/6\ngpu: H200\n", "b.yaml": "schema: 'serving/5'\n",
             "c.yaml": "schema: 1\nrows: []\n", "d.yaml": "{schema: serving/6}\n", "e.yaml": "gpu: x\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    assert [table_kind(tmp_path / n) for n in sorted(cases)] == [
        "serving", "serving", "leaderboard", "leaderboard", "leaderboard"]
    assert table_kind(tmp_path / "missing.yaml") is None and table_kind(tmp_path) is None
    assert table_kind(LEADERBOARD) == "leaderboard"
