"""The table schema: built from results, written atomically, loaded with precise errors; and
the atomic writes themselves (mla_tune/fileio.py): the umask honoured, and every OS failure
one line with nothing left behind."""

import errno
import os
import re
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import yaml

from mla_tune import fileio
from mla_tune.backends import BACKEND_MODULES, get_backend
from mla_tune.backends.params import PARAM_RULES, check_variant_rules
from mla_tune.core import Shape, Variant
from mla_tune.fileio import WriteError, atomic_write_text, dump_yaml
from mla_tune.gpu import fake_platform
from mla_tune.problem import get_rule
from mla_tune.tables.table import TableError, load_table, pick_best, table_from_results, write_table
from mla_tune.tune.config import ConfigError, load_config

DATA = Path(__file__).parent / "data"
TRITON_A = "triton(block_n=32,dot_dtype=bf16,kv=fp8,num_splits=4,num_stages=2,num_warps=4,q=bf16)"
TRITON_B = "triton(block_n=64,dot_dtype=bf16,kv=fp8,num_splits=2,num_stages=2,num_warps=4,q=bf16)"
STATIC = "triton(block_n=32,dot_dtype=bf16,kv=fp8,num_splits=1,num_stages=2,num_warps=4,q=fp8_static,q_amax=5.5)"
TORCH = "torch(kv=bf16,q=bf16)"


def _config(shapes=((4, 1024), (8, 64))):
    return SimpleNamespace(name="test", path=Path("configs/test.yaml"), rule=get_rule("leaderboard"), hash="abc123",
                           shapes=[Shape(b, n) for b, n in shapes], raw={"backends": {"torch": {}, "triton": {}}})


def _header(**extra):
    return {"kind": "header", "gpu": "H200", "schema": 1, "date": "2026-12-01",
            "platform": {"device_name": "NVIDIA H200", "arch": "sm_90", "driver": "570.1",
                         "versions": {"torch": "2.11.0", "triton": "3.6.0"}},
            "protocol": {"name": "leaderboard-emulation"}, "copy_bandwidth_gbps": 4280.0,
            "config": {"path": "configs/test.yaml", "hash": "abc123"},
            "rule": get_rule("leaderboard").as_dict(), "mla_tune_version": "0.1.0",
            "unavailable": {"aiter": "ROCm only"}, **extra}


def _record(variant, status="ok", median=None, shape=(4, 1024), p10=None, p90=None, **extra):
    v = Variant.parse(variant)
    time = None if median is None else {"median_us": median, "p10_us": p10 or median * 0.98,
                                        "p90_us": p90 or median * 1.02, "samples": 30}
    return {"kind": "candidate", "shape": {"batch": shape[0], "kv_len": shape[1]}, "variant": variant,
            "backend": v.backend, "params": v.p, "status": status, "reason": "" if status == "ok" else "because",
            "checks": [], "time": time, "wall": {"median_us": 40.0} if median else None, "calibration": None,
            "elapsed_s": 1.0, **extra}


def _row(table, batch, kv_len):
    return next(r for r in table["rows"] if (r["batch"], r["kv_len"]) == (batch, kv_len))


def test_winner_is_the_fastest_the_row_carries_its_evidence_and_a_lost_shape_a_reason():
    records = [
        _record(TRITON_A, median=20.0, p10=19.0, p90=21.0),
        _record(TRITON_B, median=25.0),
        _record(TORCH, median=40.0),
        _record("triton(block_n=16,kv=fp8,num_splits=8,q=bf16)", status="rejected"),
        _record("triton(block_n=16,kv=fp8,num_splits=16,q=bf16)", status="pruned"),
        _record(TRITON_A, status="rejected", shape=(8, 64)),
        _record(TORCH, status="failed", shape=(8, 64)),
    ]
    table = table_from_results(_header(), records, _config())
    row = _row(table, 4, 1024)
    assert row["winner"] == {"variant": TRITON_A, "backend": "triton", "params": Variant.parse(TRITON_A).p}
    assert row["time_us"] == 20.0 and row["spread"] == pytest.approx(0.1)
    assert row["wall_us"] == 40.0
    assert row["runner_up"] == {"variant": TRITON_B, "time_us": 25.0}
    assert row["backends"] == {"triton": 20.0, "torch": 40.0, "aiter": "unavailable: ROCm only"}
    assert row["baseline_us"] == 40.0
    # 4 x 1024 tokens x 576 bytes of fp8 KV at 4280 GB/s
    assert row["floor_us"] == pytest.approx(4 * 1024 * 576 / 4280e3, abs=1e-3)
    assert row["floor_share"] == pytest.approx(row["floor_us"] / 20.0, abs=1e-4)
    assert row["candidates"] == {"tried": 5, "ok": 3, "rejected": 1, "failed": 0, "crashed": 0,
                                 "timeout": 0, "pruned": 1}
    assert row["alternates"] == {"triton": {"variant": TRITON_A, "time_us": 20.0},
                                 "torch": {"variant": TORCH, "time_us": 40.0}}
    prov = table["provenance"]
    assert prov["config"] == {"path": "configs/test.yaml", "hash": "abc123"}
    assert prov["rule"] == {"name": "leaderboard", "rtol": 0.1, "atol": 0.1, "allowance": 0.05}
    assert prov["versions"]["triton"] == "3.6.0" and prov["copy_bandwidth_gbps"] == 4280.0
    # a shape without an ok candidate: a null winner and a reason
    row = _row(table, 8, 64)
    assert row["winner"] is None and row["time_us"] is None and row["alternates"] == {}
    assert "triton: all rejected" in row["reason"] and "torch: none ok: 1 failed" in row["reason"]
    assert row["backends"]["aiter"] == "unavailable: ROCm only"


def test_ties_within_one_percent_go_to_the_earlier_backend_then_the_text_and_a_rerun_counts_once():
    # torch is 0.5% faster, but within the tie tolerance triton comes first in BACKEND_MODULES
    records = [_record(TORCH, median=10.0), _record(TRITON_B, median=10.05), _record(TRITON_A, median=10.08)]
    row = _row(table_from_results(_header(), records, _config()), 4, 1024)
    assert row["winner"]["variant"] == TRITON_A  # same backend: the smaller text wins
    assert row["alternates"]["triton"]["variant"] == TRITON_A
    # Outside the tolerance the faster one wins.
    records = [_record(TORCH, median=10.0), _record(TRITON_A, median=10.2)]
    row = _row(table_from_results(_header(), records, _config()), 4, 1024)
    assert row["winner"]["variant"] == TORCH
    assert pick_best([]) is None
    # a rerun counts once, and an fp8_static winner records its calibration
    calibration = {"seeds": [11, 12], "method": "max |q| over calibration seeds x 1.25"}
    records = [_record(STATIC, status="crashed"),
               _record(STATIC, median=5.0, calibration=calibration), _record(TORCH, median=9.0)]
    row = _row(table_from_results(_header(), records, _config()), 4, 1024)
    assert row["candidates"]["tried"] == 2 and row["candidates"]["ok"] == 2
    assert row["candidates"]["crashed"] == 0  # the rerun's latest record counts, once
    assert row["winner"]["variant"] == STATIC
    assert row["calibration"] == {**calibration, "q_amax": 5.5}


def test_results_that_do_not_belong_to_the_config_are_refused():
    with pytest.raises(TableError, match="config hash zzz"):
        table_from_results(_header(config={"path": "x", "hash": "zzz"}), [], _config())
    with pytest.raises(TableError, match="record 1 is for shape 2x2"):
        table_from_results(_header(), [_record(TORCH, median=1.0, shape=(2, 2))], _config())
    with pytest.raises(TableError, match="unknown status 'great'"):
        table_from_results(_header(), [_record(TORCH, status="great")], _config())


def test_written_table_round_trips_without_yaml_aliases(tmp_path):
    records = [_record(TRITON_A, median=20.0), _record(TORCH, median=40.0), _record(TORCH, median=3.0, shape=(8, 64))]
    table = table_from_results(_header(), records, _config())
    shared = {"note": "the same object twice"}  # still written out twice, never as an alias
    table["rows"][0]["calibration"] = shared
    table["rows"][1]["calibration"] = shared
    path = write_table(tmp_path / "H200.yaml", table)
    text = path.read_text()
    assert text.startswith("# mla-tune dispatch table for H200, generated by `mla-tune sweep`")
    assert "floor_us counts only the fp8 KV cache" in text
    loaded = load_table(path)  # the loader refuses any YAML alias
    assert loaded.gpu == "H200" and loaded.path == path and loaded.provenance["row_count"] == 2
    assert list(loaded.rows) == [Shape(4, 1024), Shape(8, 64)]
    assert loaded.rows[Shape(4, 1024)].time_us == 20.0
    assert loaded.rows[Shape(4, 1024)]["time_us"] == 20.0  # a row reads as the file's mapping too
    assert loaded.variants() == {Shape(4, 1024): Variant.parse(TRITON_A), Shape(8, 64): Variant.parse(TORCH)}
    assert loaded.variants(only_backends=["torch"]) == {Shape(4, 1024): Variant.parse(TORCH),
                                                        Shape(8, 64): Variant.parse(TORCH)}
    assert loaded.variants(only_backends=["aiter"]) == {}
    assert loaded.rows[Shape(8, 64)].calibration == shared


def test_a_table_cut_between_rows_is_refused_by_its_row_count(tmp_path):
    text = (DATA.parent.parent / "tables" / "H200.yaml").read_text()
    rows = text.split("\n- batch: ")  # the committed table states its 8 rows
    cut = tmp_path / "cut.yaml"
    cut.write_text("\n- batch: ".join(rows[:6]) + "\n")  # a valid YAML file of 5 rows
    with pytest.raises(TableError, match=r"holds 5 rows, but its provenance.row_count says 8: the file was cut"):
        load_table(cut)
    cut.write_text("\n- batch: ".join(rows[:6]).replace("  row_count: 8\n", "") + "\n")
    assert len(load_table(cut).rows) == 5  # a table from before row_count: not checked


def _broken(tmp_path, edit) -> Path:
    data = yaml.safe_load((DATA / "table_cpu.yaml").read_text())
    edit(data)
    path = tmp_path / "broken.yaml"
    path.write_text(dump_yaml(data))  # no aliases: the loader refuses them
    return path


def _set_variant(entry: dict, drop: tuple = (), **change) -> None:
    """Rewrite the variant of a winner / runner_up / alternate entry (and its params)."""
    variant = Variant.parse(entry["variant"])
    params = {k: v for k, v in {**variant.p, **change}.items() if k not in drop}
    variant = Variant.make(variant.backend, **params)
    entry["variant"] = str(variant)
    if "params" in entry:
        entry["params"] = variant.p


ROW1, ROW2 = r"row 1 \(batch 1, kv_len 8\)", r"row 2 \(batch 2, kv_len 40\)"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(schema=2), r"schema is 2, this mla-tune reads schema 1"),
        (lambda d: d.update(schema="serving/6"), r"a serving table \(serving/6\), not a leaderboard table"),
        (lambda d: d.pop("gpu"), r"field `gpu`"),
        (lambda d: d["provenance"].pop("date"), r"provenance\.date"),
        (lambda d: d["provenance"].update(row_count=True), "row_count says True"),
        (lambda d: d["rows"][1]["winner"].update(variant="warp(kv=fp8,q=bf16)", backend="warp"),
         r"row 2 \(batch 2, kv_len 40\): winner\.variant names unknown backend 'warp'"),
        (lambda d: d["rows"][1]["winner"]["params"].update(num_splits=8),
         r"row 2 \(batch 2, kv_len 40\): winner\.params .* disagrees with winner\.variant"),
        (lambda d: d["rows"][0]["winner"].update(variant="torch(kv=bf16"),
         rf"{ROW1}: winner\.variant: variant text"),
        (lambda d: d["rows"][0]["winner"].update(variant="torch(q=bf16)", params={"q": "bf16"}),
         rf"{ROW1}: winner\.variant torch\(q=bf16\) must carry kv"),
        (lambda d: d["rows"][0].pop("winner"), rf"{ROW1}: missing field\(s\) winner"),
        (lambda d: d["rows"][0].update(time_uss=1.0), rf"{ROW1}: unknown field\(s\) time_uss"),
        (lambda d: d["rows"][0].update(spread=float("nan")), rf"{ROW1}: spread must be a finite"),
        (lambda d: d["rows"][0]["candidates"].update(ok=-1), r"candidates\.ok must be a count"),
        (lambda d: d["rows"][0].update(time_us="fast"), rf"{ROW1}: time_us must be"),
        (lambda d: d["rows"][2].pop("reason"), r"row 3 \(batch 3, kv_len 16\): winner is null, so field `reason`"),
        (lambda d: d["rows"][0].update(batch=0), r"row 1 \(batch 0, kv_len 8\): Shape\.batch"),
        (lambda d: d["rows"].append(dict(d["rows"][0])), r"row 4 \(batch 1, kv_len 8\): a second row"),
        (lambda d: d["rows"][0]["alternates"].update(torch=d["rows"][0]["alternates"]["triton"]),
         r"alternates\.torch holds a triton variant"),
        (lambda d: d["rows"][0]["backends"].update(warp=1.0), r"backends names unknown backend 'warp'"),
        # each backend's parameter rules at load
        (lambda d: _set_variant(d["rows"][1]["winner"], drop=("num_splits",), num_splitz=2),
         rf"{ROW2}: winner\.variant: triton: unknown parameter num_splitz; known: kv, q, num_splits"),
        (lambda d: _set_variant(d["rows"][1]["winner"], num_warps=True),
         rf"{ROW2}: winner\.variant: triton: num_warps=true is not allowed"),
        (lambda d: _set_variant(d["rows"][1]["winner"], dot_dtype=16),
         rf"{ROW2}: winner\.variant: triton: dot_dtype=16 is not allowed; allowed: fp16, bf16"),
        (lambda d: _set_variant(d["rows"][1]["winner"], drop=("dot_dtype",)),
         rf"{ROW2}: winner\.variant: triton: missing parameter dot_dtype; triton variants need "),
        (lambda d: _set_variant(d["rows"][1]["winner"], q="fp8_static"),
         rf"{ROW2}: winner\.variant: triton: q_amax=\(missing\) is not allowed; q=fp8_static needs"),
        (lambda d: _set_variant(d["rows"][0]["runner_up"], block_n=48),
         rf"{ROW1}: runner_up\.variant: triton: block_n=48"),
        (lambda d: _set_variant(d["rows"][1]["alternates"]["torch"], extra=1),
         rf"{ROW2}: alternates\.torch\.variant: torch: unknown parameter extra; known: kv, q"),
        (lambda d: _set_variant(d["rows"][0]["winner"], kv="fp8"),
         rf"{ROW1}: winner\.variant: torch: kv=fp8 is not allowed; allowed: bf16"),
    ],
)
def test_a_broken_table_or_a_variant_its_backend_refuses_fails_naming_the_file_the_row_and_the_field(
        tmp_path, edit, message):
    path = _broken(tmp_path, edit)
    with pytest.raises(TableError, match=message) as info:
        load_table(path)
    assert re.match(rf"table {re.escape(str(path))}(, row \d|: )", str(info.value))


BACKEND_CASES = {
    # backend: (platform, search space): spaces wide enough to offer every kind of variant
    "triton": ("H200", {"kv": ["fp8", "bf16"], "q": ["bf16", "fp8_dynamic", "fp8_static"],
                        "num_splits": [1, 2, 8], "block_n": [16, 64], "num_warps": [4, 8],
                        "num_stages": [1, 2], "dot_dtype": ["fp16", "bf16"]}),
    "triton@MI355X": ("MI355X", {"num_splits": [1, 4], "block_n": [32], "num_warps": [4, 8],
                                 "num_stages": [1, 2], "hip": {"waves_per_eu": [0, 1, 2],
                                 "matrix_instr_nonkdim": [16, 32], "kpack": [1, 2]}}),
    "triton_fused": ("H200", {"kv": ["fp8", "bf16", "mxfp4"], "load": ["ptr", "tma", "tma_host"],
                              "grid": ["split", "persistent"], "waves": [1, 2],
                              "tok_m": [True, False]}),
    "torch": ("H200", {}),
    "aiter": ("MI355X", {"kv_granularity": [16, 64]}),
    "aiter@MI300X": ("MI300X", {}),
    "flashinfer": ("H200", {}),
    "flashmla": ("H200", {}),
    "gluon_fused": ("H200", {"v_path": ["ss16", "rs16", "rs8", "ss16a"], "block_n": [64, 128]}),
}


@pytest.fixture
def no_vendor_libraries(monkeypatch):
    """validate() must not import a vendor library: importing one here fails."""
    for name in ("aiter", "aiter.mla", "flashinfer", "flashinfer.mla", "flash_mla"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("case", list(BACKEND_CASES))
def test_validate_accepts_every_candidate_of_its_backend_and_refuses_an_unknown_parameter(case, no_vendor_libraries):
    name = case.split("@")[0]
    platform, space = BACKEND_CASES[case]
    backend = get_backend(name)
    variants = [v for shape in (Shape(4, 1024), Shape(2, 64))
                for v in backend.candidates(shape, space, fake_platform(platform))]
    assert variants, f"{case}: no candidates to check"
    for variant in variants:
        if variant.get("q") == "fp8_static":
            with pytest.raises(ValueError, match=rf"^{name}: q_amax=\(missing\) is not allowed"):
                backend.validate(variant)  # as candidates() offers it: the sweep adds q_amax
            variant = variant.with_params(q_amax=5.5)
        backend.validate(variant)
        with pytest.raises(ValueError, match=rf"^{name}: unknown parameter bogus; known: "):
            backend.validate(variant.with_params(bogus=1))
    assert set(BACKEND_MODULES) == {c.split("@")[0] for c in BACKEND_CASES}  # one case per backend


# (variant, message) refused by the parameter rules as data (backends/params.py), which give
# validate()'s very line; then those refused by a backend's own validate(), past the rules
RULE_CASES = [
    ("triton(block_n=16,dot_dtype=fp16,kv=fp8,num_splits=two,num_stages=1,num_warps=4,q=bf16)",
     "num_splits=two is not allowed"),
    ("triton(block_h=16,block_n=32,dot_dtype=bf16,kv=fp8,max_splits=8,num_stages=1,num_warps=4,"
     "q=bf16,tokens_per_split=256,split_budget=-1)", "split_budget=-1 is not allowed"),
    ("triton(block_n=32,dot_dtype=bf16,kv=fp8,num_splits=8,num_stages=1,num_warps=4,q=bf16,"
     "waves_per_eu=17)", "waves_per_eu=17 is not allowed"),
    ("triton(block_n=32,dot_dtype=bf16,kpack=3,kv=fp8,num_splits=1,num_stages=2,num_warps=4,"
     "q=bf16)", r"kpack=3 is not allowed; allowed: 1, 2"),
    ("triton_fused(block_n=48,kv=fp8,num_splits=1,num_stages=3,num_warps=4,pv_dot=fp16,q=bf16,"
     "qk_dot=fp16,reduce=none,tok_m=true)", r"block_n=48 is not allowed; allowed: 16, 32, 64, 128"),
    ("triton_fused(block_n=32,kv=fp8,num_splits=1,num_stages=3,num_warps=4,pv_dot=fp16,q=bf16,"
     "qk_dot=fp16,reduce=none,tok_m=1)", r"tok_m=1 is not allowed; allowed: true, false"),
    ("triton_fused(block_n=32,kv=fp8,num_splits=1,num_stages=3,num_warps=4,pv_dot=fp16,q=bf16,"
     "qk_dot=fp16,tok_m=true)", r"missing parameter reduce"),
    ("triton_fused(block_n=32,grid=ring,kv=fp8,num_splits=1,num_stages=3,num_warps=4,pv_dot=fp16,"
     "q=bf16,qk_dot=fp16,reduce=none,tok_m=true)",
     r"grid=ring is not allowed; allowed: split, persistent"),
    ("triton_fused(block_n=64,kv=fp8,num_splits=1,num_stages=3,num_warps=4,pv_dot=fp16,q=bf16,"
     "qk_dot=fp16,reduce=none,tok_m=true,waves=3)", "waves=3 is not allowed; allowed: 1, 2"),
    ("gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=5,q=fp8_dynamic,v_path=rs8)",
     "num_stages=5 is not allowed; num_stages must be an int from 2 to 4"),
    ("aiter(kv=fp8,mode=nonpersistent,num_kv_splits=0,q=fp8_dynamic)",
     r"num_kv_splits=0 is not allowed; num_kv_splits must be an int >= 1"),
    ("aiter(kv=fp8,mode=persistent,num_kv_splits=4,q=fp8_dynamic)",
     "num_kv_splits is not a parameter of mode=persistent, which takes kv_granularity, "
     "max_split_per_batch, fast_mode, intra_batch, opus"),
    ("aiter(kv=fp8,mode=turbo,q=fp8_dynamic)", "mode=turbo is not allowed; allowed: nonpersistent, "
     "persistent, direct, gluon"),
    ("aiter(fast_mode=false,intra_batch=true,kv=fp8,kv_granularity=24,max_split_per_batch=8,"
     "mode=persistent,q=fp8_dynamic)", r"kv_granularity=24 is not allowed; .*power of two"),
    ("aiter(fast_mode=0,intra_batch=false,kv=fp8,kv_granularity=16,max_split_per_batch=-1,"
     "mode=persistent,q=fp8_dynamic)", r"fast_mode=0 is not allowed; allowed: true, false"),
    ("flashinfer(kernel=fa4,kv=bf16,q=bf16)", r"kernel=fa4 is not allowed; allowed: fa3, fa2"),
    ("flashinfer(kv=bf16,q=bf16)", r"missing parameter kernel"),
    ("flashmla(kv=bf16,q=bf16,q_amax=3.0)", r"q_amax=3.0 is not allowed with q=bf16"),
]
OWN_CASES = [("aiter(fast_mode=false,intra_batch=true,kv=fp8,kv_granularity=16,max_split_per_batch=-1,"
              "mode=persistent,q=fp8_dynamic)", r"max_split_per_batch=-1 is not allowed with intra_batch=true")]


@pytest.mark.parametrize(("text", "message"), RULE_CASES + OWN_CASES)
def test_validate_names_the_parameter_the_value_and_what_is_allowed(text, message, no_vendor_libraries):
    variant = Variant.parse(text)
    with pytest.raises(ValueError, match=rf"^{variant.backend}: .*{message}") as caught:
        get_backend(variant.backend).validate(variant)
    if (text, message) in RULE_CASES:
        with pytest.raises(ValueError) as same:
            check_variant_rules(variant, PARAM_RULES[variant.backend])
        assert str(same.value) == str(caught.value)


# ------------------------------------------------------------- old tables, odd files, attacks
def test_an_old_table_without_the_later_fields_loads_with_their_defaults(tmp_path):
    def drop_later_fields(data):
        for row in data["rows"]:
            for name in ("wall_us", "floor_us", "floor_share", "calibration", "alternates", "spread", "baseline_us"):
                row.pop(name, None)
            row["candidates"]["rungs"] = [12, 4]  # a key a later sweep adds: kept, not checked

    table = load_table(_broken(tmp_path, drop_later_fields))
    row = table.rows[Shape(2, 40)]
    assert row.alternates == {} and row.floor_share is None and row.calibration is None
    assert row.candidates["rungs"] == [12, 4]
    # no alternates: only a torch winner is allowed, the fallback serves the rest
    assert table.variants(only_backends=["torch"]) == {Shape(1, 8): Variant.parse(TORCH)}


@pytest.mark.parametrize("libyaml", [True, False], ids=["libyaml", "pure-python-yaml"])
def test_a_yaml_alias_bomb_fails_fast_in_one_line(tmp_path, monkeypatch, libyaml):
    if not libyaml:  # the loader without libyaml's C parser refuses aliases too
        monkeypatch.delattr(yaml, "CSafeLoader", raising=False)

    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\nschema: 1\n")
    started = time.monotonic()
    with pytest.raises(TableError, match=r"bomb\.yaml is not valid YAML: line 2: a YAML alias "
                                         r"\(\*a0\); mla-tune never writes aliases") as info:
        load_table(bomb)
    assert time.monotonic() - started < 1.0 and "\n" not in str(info.value)


@pytest.mark.parametrize("load, name, content, message", [
    (load_table, "nope.yaml", None, r"nope\.yaml does not exist; run `mla-tune sweep"),
    (load_table, "bad.yaml", b"rows: [\n", "is not valid YAML"),
    # safe_load refuses a python tag: nothing in a table is executed
    (load_table, "exec.yaml", b"schema: !!python/object/apply:os.system ['echo hi']\n", "is not valid YAML"),
    (load_table, "huge.yaml", 17 * 1024 * 1024, r"is over 16777216 bytes, far larger than any table"),
    (load_table, "fifo.yaml", os.mkfifo, r"is not a regular file"),
    (load_table, "binary.yaml", b"\xff\xfe\x00schema", r"is not UTF-8 text"),
    # a config's own hint, mapping and size limit through the same reader (fileio.read_yaml)
    (load_config, "adir", Path.mkdir, "is a directory"),
    (load_config, "missing.yaml", None, "does not exist; pass the path of a config"),
    (load_config, "list.yaml", b"- 1\n- 2\n", "must be a YAML mapping"),
    (load_config, "huge.yaml", b"name: x\n" + b"#" * (1 << 20), "over 1048576 bytes"),
])
def test_missing_unparsable_or_odd_files_are_refused_in_one_line_naming_the_file(
        tmp_path, load, name, content, message):
    path = tmp_path / name
    if callable(content):
        content(path)
    elif isinstance(content, int):  # sparse: 17 MB that take no disk
        with open(path, "wb") as handle:
            handle.truncate(content)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError if load is load_config else TableError, match=message) as info:
        load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)  # ConfigError and TableError are ValueErrors too


# ------------------------------------------------------------------------- atomic writes
def test_a_new_file_gets_the_mode_the_umask_gives_and_a_replaced_one_keeps_its_own(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "t.yaml", "a")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644 and path.read_text() == "a"
        os.umask(0o077)
        assert stat.S_IMODE(atomic_write_text(tmp_path / "private.yaml", "b").stat().st_mode) == 0o600
        path.chmod(0o664)
        atomic_write_text(path, "c")
        assert stat.S_IMODE(path.stat().st_mode) == 0o664 and path.read_text() == "c"
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private.yaml", "t.yaml"]


@pytest.mark.parametrize("case, match", [
    ("full disk", r"cannot write .*t\.yaml: No space left on device; free some space or write elsewhere"),
    pytest.param("read-only", r"t\.yaml: Permission denied; write somewhere you may write", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root writes into read-only folders anyway")),
    ("read-only faked", r"t\.yaml: Permission denied; write somewhere you may write"),  # as root too
    ("a directory", "Is a directory; name a file, not a directory"),
    ("a file in the path", r"cannot write .*t\.yaml/x\.yaml"),
])
def test_a_failed_write_is_one_line_and_leaves_the_old_file_and_nothing_else(tmp_path, monkeypatch, case, match):
    folder = tmp_path / "ro"
    folder.mkdir()
    old = folder / "t.yaml"
    old.write_text("old")
    if case == "full disk":
        monkeypatch.setattr(fileio.os, "fsync", mock.Mock(side_effect=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    elif case == "read-only faked":  # EACCES: a PermissionError
        monkeypatch.setattr(fileio.tempfile, "mkstemp",
                            mock.Mock(side_effect=OSError(errno.EACCES, os.strerror(errno.EACCES))))
    elif case == "read-only":
        folder.chmod(0o555)
    try:
        with pytest.raises(WriteError, match=match) as info:
            atomic_write_text({"a directory": folder, "a file in the path": old / "x.yaml"}.get(case, old), "new")
    finally:
        folder.chmod(0o755)
    assert "\n" not in str(info.value) and isinstance(info.value, OSError)
    assert old.read_text() == "old" and sorted(p.name for p in tmp_path.rglob("*")) == ["ro", "t.yaml"]
