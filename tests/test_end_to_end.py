"""End to end on the CPU: `mla-tune sweep` -> table -> runtime -> `mla-tune export` -> the file run
without mla_tune, checked against problem.reference: own kernels, the AITER fakes on a simulated
MI355X, and a simulated MI355X without AITER."""

import ast
import json
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

from mla_tune import gpu, runtime
from mla_tune.core import Variant
from mla_tune.problem import check, generate_input, get_rule, reference
from mla_tune.tables.table import load_table, write_table
from tests.helpers import REPO, WIDE, exported_env, invoke, run_exported, vendor_fakes

CPU_CONFIG = "tests/data/e2e_cpu.yaml"  # relative to REPO: the table records the path
AITER_CONFIG = "tests/data/e2e_aiter.yaml"
RULE = get_rule("leaderboard")
MISSING = (2, 24)  # a shape neither table has: the fallback serves it
_case = partial(generate_input, device="cpu")  # (batch, kv_len, seed=)


# ----------------------------------------------------------------------------- helpers
def _aiter_env(platform: str | None = "MI355X") -> dict[str, str]:
    env = vendor_fakes.subprocess_env("aiter", base=exported_env())
    if platform:
        env[gpu.FAKE_PLATFORM_ENV] = platform
    return env


def _mla_tune(*args, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    """The installed `mla-tune` command (the console script next to this python)."""
    script = Path(sys.executable).with_name("mla-tune")
    command = [str(script)] if script.exists() else [sys.executable, "-c", "from mla_tune.cli import app; app()"]
    return subprocess.run(command + [str(a) for a in args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _exports(folder: Path, gpu_name: str, n_shapes: int, exports: dict) -> dict[str, str]:
    """{name: (table, --only)} exported to folder/NAME.py: each file's text, once the command
    said what it wrote and the file is a Popcorn submission for gpu_name without mla_tune."""
    texts = {}
    for name, (table, only) in exports.items():
        result = invoke("export", "--table", table, "-o", folder / f"{name}.py", *(["--only", only] if only else []),
                        env=WIDE)
        assert result.exit_code == 0, result.output
        said = f"wrote {folder / name}.py: {n_shapes} shapes from {table}"
        assert said in " ".join(result.output.split()), result.output
        text = texts[name] = (folder / f"{name}.py").read_text()
        assert text.splitlines()[:2] == ["#!POPCORN leaderboard amd-mixed-mla", f"#!POPCORN gpu {gpu_name}"]
        assert "import mla_tune" not in text and "from mla_tune" not in text
        assert "from task import input_t, output_t" in text
        compile(text, "exported", "exec")
    return texts


def _sweep(tmp: Path, gpu_name: str, config: str, env: dict[str, str]) -> dict:
    out = tmp / f"{gpu_name}.yaml"
    done = _mla_tune("sweep", "--gpu", gpu_name, "--config", config, "--out", out, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line) for line in out.with_name(f"{gpu_name}.results.jsonl").read_text().splitlines()]
    return {"done": done, "path": out, "table": yaml.safe_load(out.read_text()), "header": results[0],
            "records": [r for r in results if r.get("kind") == "candidate"]}


def _records(sweep: dict, shape: tuple[int, int]) -> list[dict]:
    return [r for r in sweep["records"] if (r["shape"]["batch"], r["shape"]["kv_len"]) == shape]


def _rows(sweep: dict) -> dict[tuple[int, int], dict]:
    return {(r["batch"], r["kv_len"]): r for r in sweep["table"]["rows"]}


def _assert_matches(out: torch.Tensor, case) -> None:
    result = check(out, reference(case), RULE)
    assert result.passed, result.reason


def _assert_served(outs: list, cases: list, misses: list) -> None:
    """Every exported output matches the reference; the one miss is the shape neither table has."""
    for out, case in zip(outs, cases, strict=True):
        _assert_matches(out, case)
    assert misses == [list(MISSING)]


def _pin(row: dict, record: dict) -> None:
    """The table row's winner becomes the swept record's variant, with its time and calibration."""
    variant = Variant.parse(record["variant"])
    row["winner"] = {"variant": str(variant), "backend": variant.backend, "params": variant.p}
    row["time_us"] = round(record["time"]["median_us"], 3)
    row["calibration"] = record["calibration"]


def _exported_table(text: str) -> dict[tuple[int, int], str]:
    """The dispatch table literal of an exported file."""
    start = text.index("_EXPORT_TABLE_TEXT = {")
    literal = text[text.index("{", start): text.index("\n}\n", start) + 2]
    return ast.literal_eval(literal)


# ==================================================================== own kernels (CPU)
@pytest.fixture(scope="module")
def cpu_sweep(tmp_path_factory):
    return _sweep(tmp_path_factory.mktemp("cpu_sweep"), "cpu", CPU_CONFIG, exported_env())


def test_cpu_sweep_writes_a_row_per_shape_whose_winner_passed_and_the_runtime_serves_it(cpu_sweep):
    table, header = cpu_sweep["table"], cpu_sweep["header"]
    assert "sweep e2e_cpu on cpu" in cpu_sweep["done"].stdout
    assert table["gpu"] == "cpu" and header["gpu"] == "cpu" and not header["forced"]
    prov = table["provenance"]
    assert prov["device_name"] == "cpu" and prov["protocol"]["name"] == "cpu-wall-clock"
    assert prov["config"]["path"] == CPU_CONFIG and prov["rule"]["name"] == "leaderboard"
    rows = _rows(cpu_sweep)
    assert sorted(rows) == [(1, 17), (2, 40)]
    rt = runtime.load(table=cpu_sweep["path"], gpu="cpu")
    assert rt.platform.name == "cpu" and rt.fallback_backend == "triton"
    # triton: kv x num_splits; a split shorter than block_n 16 is not offered at kv_len 17.
    # How a row is made of its records: tests/test_table.py; the gate's seeds: test_sweep.py.
    expected_triton = {(2, 40): 4, (1, 17): 2}
    for seed, (shape, row) in enumerate(sorted(rows.items())):
        records = _records(cpu_sweep, shape)
        # every candidate (triton and triton_fused too) ran, passed and was timed
        assert all(r["status"] == "ok" and all(c["passed"] for c in r["checks"]) for r in records)
        triton_records = [r for r in records if r["backend"] == "triton"]
        assert len(triton_records) == expected_triton[shape] < len(records)
        assert all(r["params"]["dot_dtype"] == "fp16" for r in triton_records)
        assert all(isinstance(row["backends"][b], float) for b in ("torch", "triton", "triton_fused"))
        assert set(row["alternates"]) >= {"torch", "triton", "triton_fused"}
        assert str(rt.dispatcher.variant_for(*shape)) == row["winner"]["variant"]
        case = _case(*shape, seed=100 + seed)
        _assert_matches(rt.decode(*case[:4]).clone(), case)
        _assert_matches(rt.custom_kernel(case).clone(), case)  # the leaderboard entry, no sync
    assert rt.dispatcher.misses == {}  # the fallback on the CPU: tests/test_runtime.py


def test_cpu_export_of_own_triton_kernels_imports_without_mla_tune_and_matches_the_reference(cpu_sweep, tmp_path):
    """`--only triton_fused,triton` takes each row's best allowed alternate where its winner is
    excluded; the file runs in a subprocess on its cases (the full and the torch-only export:
    tests/test_export.py)."""
    table, rows = cpu_sweep["path"], _rows(cpu_sweep)
    text = _exports(tmp_path, "cpu", 2, {"own_triton": (table, "triton_fused,triton")})["own_triton"]
    expected = load_table(table).variants(only_backends=["triton_fused", "triton"])
    entries = _exported_table(text)
    assert entries == {(s.batch, s.kv_len): str(v) for s, v in expected.items()}
    for shape, row in rows.items():
        allowed = {b: a for b, a in row["alternates"].items() if b in ("triton", "triton_fused")}
        assert entries[shape] in {a["variant"] for a in allowed.values()}
    assert "def _build_torch(" not in text and "def _build_triton(" in text

    cases = [_case(*s, seed=200 + i) for i, s in enumerate([*sorted(rows), MISSING])]
    outs, report = run_exported(tmp_path, {"own_triton": cases}, exported_env())
    _assert_served(outs["own_triton"], cases, report["own_triton"]["misses"])
    assert report["mla_tune_modules"] == [] and report["let_through"] == []


# ========================================================= AITER through the fake (MI355X)
@pytest.fixture(scope="module")
def aiter_sweep(tmp_path_factory):
    return _sweep(tmp_path_factory.mktemp("aiter_sweep"), "MI355X", AITER_CONFIG, _aiter_env())


def test_mi355x_sweep_runs_every_aiter_family_through_the_fake_into_simulated_rows(aiter_sweep):
    stdout = " ".join(aiter_sweep["done"].stdout.split())
    assert "sweep e2e_aiter on AMD Instinct MI355X (simulated): 39 candidates over 2 shapes" in stdout
    header = aiter_sweep["header"]
    assert header["gpu"] == "MI355X" and not header["forced"] and header["unavailable"] == {}
    assert header["platform"]["device_name"] == "AMD Instinct MI355X (simulated)"
    assert header["protocol"]["name"] == "cpu-wall-clock"  # a simulated platform times on the CPU
    for shape, n_aiter in (((2, 200), 22), ((1, 40), 15)):
        records = _records(aiter_sweep, shape)
        assert all(r["status"] == "ok" for r in records), [(r["variant"], r["reason"]) for r in records
                                                          if r["status"] != "ok"]
        aiter = [r for r in records if r["backend"] == "aiter"]
        assert len(aiter) == n_aiter
        assert {r["params"]["q"] for r in aiter} == {"fp8_static", "fp8_dynamic", "bf16"}
        assert {(r["params"]["q"] != "bf16", r["params"]["kv"], r["params"]["mode"]) for r in aiter} == {
            (True, "fp8", "nonpersistent"), (True, "fp8", "persistent"), (False, "fp8", "persistent"),
            (False, "bf16", "nonpersistent"), (False, "bf16", "persistent")}
        static = [r for r in aiter if r["params"]["q"] == "fp8_static"]
        assert static and all(r["params"]["q_amax"] == r["calibration"]["q_amax"] > 0 for r in static)
        intra = [r for r in aiter if r["params"].get("intra_batch")]
        assert bool(intra) == (shape[1] >= 196)  # AITER's intra-batch builder needs >= 196 tokens
        assert {r["params"].get("fast_mode") for r in aiter if r["params"]["mode"] == "persistent"} == {True, False}
    prov = aiter_sweep["table"]["provenance"]
    assert prov["device_name"] == "AMD Instinct MI355X (simulated)" and prov["driver"] == "simulated"
    assert prov["arch"] == "gfx950" and prov["protocol"]["name"] == "cpu-wall-clock"
    rows = _rows(aiter_sweep)
    assert sorted(rows) == [(1, 40), (2, 200)]
    for row in rows.values():  # how a row is made of its records: tests/test_table.py
        assert isinstance(row["backends"]["aiter"], float) and isinstance(row["backends"]["torch"], float)
    # The table can never pass for a real MI355X's: without the hook this machine is a CPU.
    with pytest.raises(runtime.GpuMismatchError, match="tuned on MI355X but this process runs on cpu"):
        runtime.load(table=aiter_sweep["path"], gpu="MI355X")


def test_mi355x_sweep_without_the_fake_platform_is_refused_naming_the_cpu(tmp_path):
    out = tmp_path / "MI355X.yaml"
    done = _mla_tune("sweep", "--gpu", "MI355X", "--config", AITER_CONFIG, "--out", out, env=_aiter_env(platform=None))
    assert done.returncode == 1, done.stdout[-2000:]
    assert ("this machine has no GPU (cpu), not MI355X; run on an MI355X or pass --force"
            in " ".join(done.stderr.split())), done.stderr
    assert list(tmp_path.iterdir()) == []  # no table, no lock (released on the way out), no results


@pytest.fixture(scope="module")
def aiter_pinned_table(aiter_sweep, tmp_path_factory):
    """The MI355X table with each winner pinned to an aiter variant the sweep passed (on the CPU
    torch and the fake tie, so the sweep's winner is noise): (2, 200) the fastest fp8_static,
    (1, 40) the fastest non-persistent."""
    data = yaml.safe_load(aiter_sweep["path"].read_text())
    picks = {(2, 200): lambda r: r["params"]["q"] == "fp8_static",
             (1, 40): lambda r: r["params"]["mode"] == "nonpersistent"}
    for row in data["rows"]:
        shape = (row["batch"], row["kv_len"])
        _pin(row, min((r for r in _records(aiter_sweep, shape)
                       if r["backend"] == "aiter" and r["status"] == "ok" and picks[shape](r)),
                      key=lambda r: r["time"]["median_us"]))
    path = write_table(tmp_path_factory.mktemp("pinned") / "MI355X.yaml", data)
    load_table(path)  # still a valid table
    return path


def test_mi355x_runtime_decodes_through_the_fake_aiter(aiter_pinned_table, monkeypatch):
    """On the platform the fake platform hook names (without it this machine is a CPU:
    test_mi355x_sweep_runs_every_aiter_family_through_the_fake_into_simulated_rows)."""
    monkeypatch.setenv(gpu.FAKE_PLATFORM_ENV, "MI355X")
    fake = vendor_fakes.install(monkeypatch, "aiter")["aiter"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same software versions, every backend available
        rt = runtime.load(table=aiter_pinned_table, gpu="MI355X")
    found = rt.platform
    assert (found.name, found.arch, found.is_hip, found.sm_count) == ("MI355X", "gfx950", True, 256)
    assert found.device_name == "AMD Instinct MI355X (simulated)" and found.driver == "simulated"
    assert found.simulated and not found.has_gpu and rt.fallback_backend == "triton"  # kernels on the CPU
    calls = fake._state.calls
    for seed, (shape, row) in enumerate(sorted(load_table(aiter_pinned_table).rows.items())):
        variant = rt.dispatcher.variant_for(shape.batch, shape.kv_len)
        assert variant.backend == "aiter" and str(variant) == row["winner"]["variant"]
        case = _case(shape.batch, shape.kv_len, seed=300 + seed)
        before = dict(calls)
        _assert_matches(rt.custom_kernel(case).clone(), case)
        _assert_matches(rt.decode(*case[:4]).clone(), case)
        assert calls["mla_decode_fwd"] == before["mla_decode_fwd"] + 2
        if variant.get("q") == "fp8_static":
            assert calls["static_per_tensor_quant"] == before["static_per_tensor_quant"] + 2
    assert rt.dispatcher.misses == {}  # a miss or a ragged batch runs the fallback: tests/test_runtime.py


def test_mi355x_exports_import_with_the_fake_aiter_and_without_mla_tune(aiter_sweep, aiter_pinned_table, tmp_path):
    exports = {"plain": (aiter_sweep["path"], None),        # the sweep's winners, as they came out
               "aiter_only": (aiter_sweep["path"], "aiter,triton"),  # rows take aiter alternates
               "pinned": (aiter_pinned_table, None)}        # aiter winners, fp8_static included
    texts = _exports(tmp_path, "MI355X", 2, exports)
    rows = _rows(aiter_sweep)
    assert _exported_table(texts["plain"]) == {s: r["winner"]["variant"] for s, r in rows.items()}
    aiter_won = any(r["winner"]["backend"] == "aiter" for r in rows.values())
    assert ("This file needs the vendor libraries aiter installed." in texts["plain"]) == aiter_won
    assert ("needs no vendor library (torch and triton only)" in texts["plain"]) != aiter_won
    for name in ("aiter_only", "pinned"):
        assert "This file needs the vendor libraries aiter installed." in texts[name]
        assert "Backends used: triton, aiter; shapes the table lacks run the triton fallback." in texts[name]
        assert "def _build_aiter(" in texts[name] and "\n    import aiter\n" in texts[name]
    assert _exported_table(texts["aiter_only"]) == {s: r["alternates"]["aiter"]["variant"] for s, r in rows.items()}
    pinned = {(s.batch, s.kv_len): r["winner"]["variant"] for s, r in load_table(aiter_pinned_table).rows.items()}
    assert _exported_table(texts["pinned"]) == pinned

    shapes = [*sorted(rows), MISSING]
    cases = {name: [_case(*s, seed=400 + i) for i, s in enumerate(shapes)] for name in ("aiter_only", "pinned")}
    outs, report = run_exported(tmp_path, cases, _aiter_env(platform=None))
    for name, module_cases in cases.items():
        _assert_served(outs[name], module_cases, report[name]["misses"])
    # each file's two table rows went through the fake (one process: the counts add up)
    assert report["aiter_only"]["aiter_calls"]["mla_decode_fwd"] == 2
    assert report["pinned"]["aiter_calls"]["mla_decode_fwd"] == 4
    assert report["pinned"]["aiter_calls"]["static_per_tensor_quant"] >= 1
    # mla_tune was imported on behalf of the fake aiter (the runner refuses any other importer)
    assert any(imp.startswith("aiter") for _name, imp in report["let_through"])


# ============================================ AITER v0.1.20.post1 and no AITER at all
NEW_AITER_CONFIG = "tests/data/e2e_aiter_new.yaml"


@pytest.fixture(scope="module")
def aiter_new_sweep(tmp_path_factory):
    env = dict(_aiter_env(), MLA_TUNE_FAKE_AITER_VERSION="0.1.20.post1")
    return _sweep(tmp_path_factory.mktemp("aiter_new_sweep"), "MI355X", NEW_AITER_CONFIG, env)


def test_mi355x_sweep_through_the_newer_fake_gives_a_table_and_an_export(aiter_new_sweep, tmp_path):
    """The fake of 0.1.20.post1 adds OPUS and the Gluon decode: they pass the gate, and an
    export pinned to Gluon runs it through the fake."""
    header = aiter_new_sweep["header"]
    assert header["unavailable"] == {}
    assert header["platform"]["versions"]["amd-aiter"] == "0.1.20.post1"
    records = _records(aiter_new_sweep, (2, 200))
    assert all(r["status"] == "ok" for r in records), [(r["variant"], r["reason"]) for r in records]
    aiter = {(r["params"]["mode"], r["params"]["q"], r["params"]["kv"], r["params"].get("opus", False))
             for r in records if r["backend"] == "aiter"}
    assert aiter == {("nonpersistent", "fp8_dynamic", "fp8", False), ("persistent", "fp8_static", "fp8", False),
                     ("persistent", "fp8_static", "fp8", True), ("persistent", "bf16", "fp8", False),
                     ("gluon", "bf16", "fp8", False), ("gluon", "bf16", "bf16", False)}
    row = _rows(aiter_new_sweep)[(2, 200)]
    assert isinstance(row["backends"]["aiter"], float) and row["winner"] is not None

    # pin the row to the Gluon fp8 variant and export it: the file runs it through the fake
    data = yaml.safe_load(aiter_new_sweep["path"].read_text())
    gluon = next(r for r in records if r["params"].get("mode") == "gluon" and r["params"]["kv"] == "fp8")
    _pin(data["rows"][0], gluon)
    pinned = write_table(tmp_path / "MI355X.yaml", data)
    text = _exports(tmp_path, "MI355X", 1, {"gluon": (pinned, "aiter,triton")})["gluon"]
    assert _exported_table(text) == {(2, 200): str(Variant.parse(gluon["variant"]))}
    cases = {"gluon": [_case(2, 200, seed=500)]}
    env = dict(_aiter_env(platform=None), MLA_TUNE_FAKE_AITER_VERSION="0.1.20.post1")
    outs, report = run_exported(tmp_path, cases, env)
    _assert_matches(outs["gluon"][0], cases["gluon"][0])
    assert report["gluon"]["aiter_calls"]["mla_gluon"] == 1


def test_mi355x_sweep_without_aiter_says_what_to_install_and_tunes_triton(tmp_path):
    env = dict(exported_env(), **{gpu.FAKE_PLATFORM_ENV: "MI355X"})  # no fakes on the path: no aiter
    sweep = _sweep(tmp_path, "MI355X", "tests/data/e2e_no_aiter.yaml", env)
    said = " ".join((sweep["done"].stdout + sweep["done"].stderr).split())
    install = "install amd-aiter 0.1.10.post2 or later"
    assert "aiter" in said and f"{install}, a ROCm build from AMD's wheel index" in said
    row = sweep["table"]["rows"][0]
    assert isinstance(row["backends"]["triton"], float) and "aiter" not in row["alternates"]
    assert install in sweep["header"]["unavailable"]["aiter"]
    assert {r["backend"] for r in sweep["records"]} == {"torch", "triton"}
