"""The serving table (mla_tune/serving/table.py): bucket rules, the graph pick by
worst case, lookup, a write/load round trip, and load errors that name file, family, field."""

import bisect
import copy
import math
import re

import pytest

from mla_tune.backends.flash_mla_schedule import FlashMLAModel
from mla_tune.backends.flashinfer_mla_schedule import VendorModel
from mla_tune.backends.triton_splitk_schedule import SplitKModel
from mla_tune.core import CallSpec, Variant
from mla_tune.fileio import dump_yaml
from mla_tune.serving.build import eager_pick
from mla_tune.serving.table import (
    Cell,
    Family,
    FamilyKey,
    GraphPick,
    ServingTable,
    batch_bucket,
    choose_graph_pick,
    kv_bucket,
    kv_bucket_edges,
    load_serving_table,
    write_serving_table,
)
from mla_tune.tables.table import TableError
from tests.helpers import REPO

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
KVS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
FP8, BF16 = FamilyKey("fp8", 64, 128, 2), FamilyKey("bf16", 64, 16, 4)
FI = Variant.parse("flashinfer(kernel=fa3,kv=bf16,q=bf16)")
FM = Variant.parse("flashmla(kv=bf16,q=bf16)")
SPLITK = Variant.parse("triton(block_h=16,block_n=32,dot_dtype=bf16,kv=bf16,max_splits=1,num_stages=2,"
                       "num_warps=4,q=bf16,tokens_per_split=128)")


def _v(splits: int, kv: str = "fp8") -> Variant:
    return Variant.parse(f"triton(block_n=64,dot_dtype=bf16,kv={kv},num_splits={splits},"
                         "num_stages=2,num_warps=4,q=bf16)")


def test_batch_goes_up_to_the_next_bucket_and_kv_len_takes_the_nearest_in_log_scale():
    assert [batch_bucket(BATCHES, b) for b in (1, 3, 4, 5, 33, 256, 300)] == [1, 4, 4, 8, 64, 256, 256]
    # the boundary between 4096 and 8192 is their geometric mean, 5792.6
    assert kv_bucket(KVS, 5792) == 4096 and kv_bucket(KVS, 5793) == 8192
    assert kv_bucket(KVS, 1) == 512 and kv_bucket(KVS, 10**6) == 65536
    assert kv_bucket(KVS, 1024) == 1024 and kv_bucket(KVS, 1400) == 1024
    # a step's one bisect over the edges: the same bucket at every length, the edges included
    edges = kv_bucket_edges(KVS)
    for x in [*range(1, 70000, 7), *edges, *(math.nextafter(e, 0) for e in edges), 10**6]:
        assert KVS[bisect.bisect_right(edges, x)] == kv_bucket(KVS, x), x


def test_the_graph_pick_minimises_the_worst_case_and_the_eager_pick_does_not_follow_one_buckets_outlier():
    """The graph pick has the least worst-case regret; a cell's eager pick weighs the adjacent batch
    buckets and the edge stage's smallest batch; a variant that wins the cell by a wide margin keeps it."""
    best = {512: 10.0, 8192: 100.0}
    times = {
        _v(4): {512: 10.0, 8192: 140.0},  # mean regret 20%, worst 40%
        _v(16): {512: 12.5, 8192: 101.0},  # mean regret 13%, worst 25%
        _v(64): {512: 19.0, 8192: 100.0},  # mean regret 45%, worst 90%
        _v(32): {512: 10.0},  # not timed everywhere: does not compete
    }
    variant, regret, worst_kv = choose_graph_pick(times, best)
    assert variant == _v(16) and regret == pytest.approx(0.25) and worst_kv == 512
    assert choose_graph_pick({_v(32): {512: 10.0}}, best) is None
    buckets = [16, 32, 48, 64, 96]
    times = {32: {"fi": 37.0, "tr": 55.0}, 48: {"fi": 63.0, "tr": 58.0}, 64: {"fi": 56.0, "tr": 70.0}}
    assert eager_pick(times, 48, buckets) == "fi"
    times[48] = {"fi": 90.0, "tr": 58.0}  # 55% behind at the cell itself: the cell decides
    assert eager_pick(times, 48, buckets) == "tr"
    assert eager_pick({48: {"a": 2.0, "b": 1.0}}, 48, buckets) == "b"  # no neighbours: the cell's best
    assert eager_pick({32: {"a": 1.0}}, 48, buckets) is None  # nothing timed at the cell
    # the edge (search.batch_edge) weighs as much as the cell; an empty edge changes nothing
    buckets = [64, 80, 96, 112]
    times = {80: {"fmla": 76.3, "tr": 73.6}, 96: {"fmla": 77.7, "tr": 83.5}, 112: {"fmla": 82.1, "tr": 93.1}}
    assert eager_pick(times, 96, buckets) == "fmla"
    assert eager_pick(times, 96, buckets, edge={"fmla": 76.6, "tr": 64.8}) == "tr"
    assert eager_pick(times, 96, buckets, edge={}) == "fmla"
    # a variant the edge did not time (not among the cell's finalists) cannot win
    assert eager_pick({96: {"a": 1.0, "b": 1.5}}, 96, buckets, edge={"b": 2.0}) == "b"
    # edge times of variants the cell did not time are ignored
    assert eager_pick({96: {"a": 1.0, "b": 1.5}}, 96, buckets, edge={"c": 0.1}) == "a"


def _table() -> ServingTable:
    """An fp8 family of cells, graph picks and a left-out cell, and a bf16 family of points,
    one schedule model of each kind and a calibration."""
    fam = Family(FP8)
    fam.cells[(32, 1024)] = Cell(32, 1024, _v(8), 40.0, {"variant": str(_v(16)), "time_us": 41.0})
    fam.cells[(32, 8192)] = Cell(32, 8192, _v(16), 200.0)
    fam.graph[32] = GraphPick(32, _v(16), 0.04, 1024)
    fam.left_out.append({"batch": 256, "kv_len": 65536, "reason": "over the sweep budget"})
    models = Family(BF16)
    models.points = {(8, 16384): {FI: 60.0, FM: 80.0}, (8, 32768): {FI: 100.0, FM: 130.0},
                     (16, 16384): {FI: 96.0, FM: 127.0}, (16, 32768): {FI: 166.0, FM: 202.0}}
    models.models = {SPLITK: SplitKModel(SPLITK, 1, 10.0, 132, 0.001, item_tokens=64),  # as loaded:
                     FI: VendorModel(FI, (1.0, 0.05, 0.0, 0.0, 0.0, 0.0), 132, 0.031),  # in the
                     FM: FlashMLAModel(FM, (20.0, 1.5, 0.4, 0.05), 132, 0.02)}  # backends' order
    models.calibration = {"triton": {"reduce_step_us": {16: 5.0, 64: 1.0}}}
    return ServingTable("H200", {"date": "2026-11-30"}, BATCHES, KVS, {FP8: fam, BF16: models})


def _bf16(data: dict) -> dict:
    return data["families"][0]  # as_dict sorts the families: bf16's first


def _fp8(data: dict) -> dict:
    return data["families"][1]


def _model(data: dict, backend: str) -> dict:
    return next(m for m in _bf16(data)["models"] if m["backend"] == backend)


def test_lookup_is_exact_on_the_family_and_bucketed_on_batch_and_kv():
    table = _table()
    spec = CallSpec("fp8", page_size=64, heads=128, max_q_len=2)
    assert table.lookup(spec, batch=20, mean_kv_len=900) == _v(8)  # bucket 32 x 1024
    assert table.lookup(spec, batch=32, mean_kv_len=7000) == _v(16)  # 32 x 8192
    assert table.lookup(spec, batch=20, mean_kv_len=900, graph=True) == _v(16)
    assert table.lookup(spec, batch=20) == _v(16)  # no mean length: the graph pick
    # a cell not in the table (left out): the bucket's nearest measured cell in log kv_len
    assert table.lookup(spec, batch=20, mean_kv_len=2048) == _v(8)  # 1024 is nearer than 8192
    assert table.lookup(spec, batch=20, mean_kv_len=5000) == _v(16)  # kv bucket 4096: 8192 nearer
    assert table.lookup(spec, batch=200, mean_kv_len=2048) is None  # bucket 256: nothing measured
    table.families[FP8].graph[256] = GraphPick(256, _v(4), 0.0, 1024)
    assert table.lookup(spec, batch=200, mean_kv_len=2048) == _v(4)  # ... but a graph pick
    # ... and before it the largest smaller batch bucket's cell at the same kv bucket
    assert table.lookup(spec, batch=200, mean_kv_len=900) == _v(8)  # 256 x 1024 left out: 32 x 1024
    assert table.lookup(CallSpec("fp8", page_size=64, heads=128, max_q_len=1), 20, 900) is None
    assert table.lookup(CallSpec("bf16", page_size=64, heads=128, max_q_len=2), 20, 900) is None


def test_a_written_table_loads_back_equal_with_its_points_models_and_calibration(tmp_path):
    path = write_serving_table(tmp_path / "H200.serving.yaml", _table())
    text = path.read_text()
    assert "schema: serving/6" in text and "models:\n  - backend: triton" in text
    assert "- {batch: 8, kv_len: 16384, us: {0: 60.0, 1: 80.0}}" in text  # one line a point
    assert "reduce_step_us: {16: 5.0, 64: 1.0}" in text
    loaded = load_serving_table(path)
    assert loaded.families == _table().families and loaded.as_dict() == _table().as_dict()


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.update(schema="serving/5"),  # an older schema: the command that rebuilds it
     ("schema is 'serving/5', this mla-tune reads 'serving/6'; rebuild it", "mla-tune sweep")),
    (lambda d: d.update(batch_buckets=[4, 2]), "batch_buckets"),
    (lambda d: _fp8(d)["key"].update(page_size=3), "page_size"),
    (lambda d: _fp8(d)["key"].pop("q_len"), "key must be a mapping of exactly"),
    (lambda d: _fp8(d)["cells"][0].update(batch=33), "batch 33 is not one of"),
    (lambda d: _fp8(d)["cells"][0].update(kv_len=1000), "kv_len 1000 is not one of"),
    (lambda d: _fp8(d)["cells"][0].update(time_us=-1), "time_us"),
    (lambda d: _fp8(d)["cells"][0].update(variant="nosuch(kv=fp8,q=bf16)"), "unknown backend"),
    (lambda d: _fp8(d)["cells"][0].update(variant=str(_v(8, kv="bf16"))), "family's KV format"),
    (lambda d: _fp8(d)["cells"][0].update(runner_up={"variant": str(_v(8)), "time_us": "12.5"}),
     "runner_up: time_us must be a finite number"),  # a hand edit: show sorted it and raised
    (lambda d: _fp8(d)["cells"][0].update(runner_up={"variant": "nosuch(kv=fp8,q=bf16)", "time_us": 1.0}),
     "runner_up.variant names unknown backend 'nosuch'"),
    (lambda d: _fp8(d)["graph"][0].update(worst_kv_len=7), "worst_kv_len"),
    (lambda d: _fp8(d)["graph"][0].update(chosen_on={"reports": 1, "shapes": 1, "geomean_regret": 0.0,
                                                     "sweep_pick": "x", "sweep_geomean_regret": 0.1,
                                                     "engine_loops": "loop.json"}),
     "engine_loops, a list of report names"),
    (lambda d: _fp8(d)["left_out"][0].update(reason=""), "must say why"),
    (lambda d: _fp8(d)["left_out"].clear(), ("left_out 0 (stated 1)", "restore it")),  # entry_counts
    (lambda d: d["provenance"].update(gate_refused={str(FP8): ["flashmla(kv=fp8,q=fp8_dynamic)"]}),
     "provenance.gate_refused must map variants to reasons, per family"),
    (lambda d: d["families"].append(copy.deepcopy(_fp8(d))), "a second family"),
    # the points and the vendors' (linear) models
    (lambda d: _bf16(d)["points"][0].update(kv_len=1000), "kv_len 1000 is not one of"),
    (lambda d: _bf16(d)["points"][0].update(us={7: 1.0}), "not an index into"),
    (lambda d: _bf16(d)["points"][0].update(us={0: 0.0}), "is 0"),
    (lambda d: _bf16(d)["points"].append(dict(_bf16(d)["points"][0])), "a second point"),
    (lambda d: _bf16(d).update(variants="x"), "variants must be a list"),
    (lambda d: _model(d, "flashinfer").update(features=["one"]), "re-build the table"),
    (lambda d: _model(d, "flashinfer").update(coef=[1.0] * 5), "coef must be a list of 6"),
    (lambda d: _model(d, "flashinfer").update(coef=[1.0] * 5 + ["x"]), "coef[5] must be a finite number"),
    (lambda d: _model(d, "flashinfer").update(variant=str(FM)), "a flashinfer model, but variant is flashmla"),
    (lambda d: _model(d, "flashinfer").update(sm_count=0), "sm_count"),
    # the split-K model, which must carry its program's fixed cost (item_tokens)
    *((lambda d, edit=edit: _model(d, "triton").update(edit), words) for edit, words in (
        (dict(occupancy=0), "occupancy must be a positive integer"),
        (dict(backend="torch"), "backend 'torch' has no schedule model"),
        (dict(overhead_us=-1.0), "overhead_us must be a finite number"),
        (dict(item_tokens=-1), "item_tokens must be an integer >= 0"),
        (dict(item_tokens=1.5), "item_tokens must be an integer >= 0"))),
    (lambda d: _model(d, "triton").pop("item_tokens"), "is a mapping of backend, fit_error, item_tokens"),
    # the split-K calibration
    *((lambda d, bad=bad: _bf16(d).update(calibration=bad), words) for bad, words in (
        ({"triton": {"reduce_step_us": {32: 1.0}}}, "must map splits per reduction step"),
        ({"triton": {"reduce_step_us": {16: -1.0}}}, "[16] must be a finite"),
        ({"triton": {"reduce_step_us": [1.0]}}, "must map splits per reduction step"),
        ({"flashmla": {}}, "'flashmla' has no calibration"), ([1], "must map backends"))),
    # a text instead: a leaderboard table is named as one
    (lambda d: (REPO / "tables" / "H200.yaml").read_text(),
     "is a leaderboard table (schema 1, per-shape winners), not a serving table; pass a serving table"),
])
def test_a_broken_table_is_refused_naming_file_family_and_field(tmp_path, edit, words):
    data = _table().as_dict()
    text = edit(data)
    path = tmp_path / "bad.serving.yaml"
    path.write_text(text if isinstance(text, str) else dump_yaml(data))
    with pytest.raises(TableError) as err:
        load_serving_table(path)
    message = str(err.value)  # naming the file, and what is wrong
    assert all(w in message for w in ("bad.serving.yaml", *((words,) if isinstance(words, str) else words))), message


def test_a_table_cut_between_entries_or_with_entries_removed_is_refused(tmp_path):
    """provenance.entry_counts (above the families) catches what YAML alone reads as a smaller
    table; a table written without it loads unchecked."""
    lines = (REPO / "tables" / "H200.serving.yaml").read_text().splitlines(keepends=True)
    cut = max(i for i, line in enumerate(lines) if line.startswith("  - {batch:"))  # the last point
    path = tmp_path / "cut.serving.yaml"
    for broken, words in [("".join(lines[:cut]), "points 2615 (stated 2616)"),
                          ("".join(lines[:max(i for i, line in enumerate(lines) if line == "- key:\n")]),
                           "families 11 (stated 12)")]:
        path.write_text(broken)
        with pytest.raises(TableError, match=r"cut\.serving\.yaml: holds .*" + re.escape(words)):
            load_serving_table(path)
    data = _table().as_dict()
    _fp8(data)["left_out"].clear()  # removed by hand: refused in the matrix above, unless unstated
    del data["provenance"]["entry_counts"]
    path.write_text(dump_yaml(data))
    assert load_serving_table(path).families[FP8].left_out == []
