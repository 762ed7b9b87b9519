"""The `mla-tune` command line: help, show, export, sweep's option passing, clean errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import mla_tune.sweep
from mla_tune.cli import app

DATA = Path(__file__).parent / "data"
TABLE = DATA / "table_cpu.yaml"
CONFIG = Path(__file__).parents[1] / "configs" / "leaderboard.yaml"
WIDE = {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}


def _invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args], env=WIDE)


@pytest.mark.parametrize(
    ("command", "says"),
    [("sweep", "Sweep every candidate kernel per shape"),
     ("export", "Write a table as one self-contained leaderboard submission file"),
     ("show", "Show a dispatch table")],
)
def test_every_command_has_help(command, says):
    result = _invoke(command, "--help")
    assert result.exit_code == 0, result.output
    assert says in result.output


def test_no_arguments_prints_the_command_list():
    result = _invoke()
    assert "sweep" in result.output and "export" in result.output and "show" in result.output


def test_show_prints_rows_and_provenance():
    result = _invoke("show", "--table", TABLE)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "torch(kv=bf16,q=bf16)" in out and "1x8" in out and "2x40" in out
    assert "1.38x" in out  # baseline 11.0 / triton 8.0
    assert "3x16: no winner" in out and "triton: all rejected" in out
    assert "provenance" in out and "rule: leaderboard rtol=0.1 atol=0.1" in out
    assert "config: configs/test.yaml (hash 0123abcd)" in out


def test_export_writes_the_submission(tmp_path):
    out = tmp_path / "submission.py"
    result = _invoke("export", "--table", TABLE, "-o", out, "--only", "torch")
    assert result.exit_code == 0, result.output
    assert "backends limited to torch" in result.output
    assert out.read_text().splitlines()[:2] == ["#!POPCORN leaderboard amd-mixed-mla",
                                                "#!POPCORN gpu cpu"]


def test_domain_errors_exit_1_with_a_message_naming_the_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(TABLE.read_text().replace("schema: 1", "schema: 7"))
    result = _invoke("show", "--table", broken)
    assert result.exit_code == 1
    assert "error:" in result.output and str(broken) in result.output
    assert "schema is 7" in result.output and "Traceback" not in result.output
    result = _invoke("export", "--table", TABLE, "-o", tmp_path / "x.py", "--only", "aiter")
    assert result.exit_code == 1 and "add triton or torch to --only" in result.output
    result = _invoke("export", "--gpu", "H200", "--table", TABLE, "-o", tmp_path / "x.py")
    assert result.exit_code == 1 and "is for cpu, not H200" in result.output


def test_export_and_show_need_a_gpu_or_a_table():
    result = _invoke("show")
    assert result.exit_code == 2 and "--gpu NAME or a table file with --table PATH" in result.output


def test_sweep_passes_its_options_through(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(mla_tune.sweep, "run_sweep", lambda *a, **k: calls.append((a, k)))
    result = _invoke("sweep", "--gpu", "H200", "--config", tmp_path / "c.yaml", "--out",
                     tmp_path / "t.yaml", "--devices", "0,1", "--fresh", "--force")
    assert result.exit_code == 0, result.output
    assert calls == [((tmp_path / "c.yaml", "H200"),
                      {"out": tmp_path / "t.yaml", "dry_run": False, "force": True,
                       "devices": [0, 1], "fresh": True})]
    result = _invoke("sweep", "--gpu", "H200", "--devices", "zero")
    assert result.exit_code == 2 and "--devices must be GPU indices" in result.output


def test_sweep_dry_run_plans_the_leaderboard_config():
    result = _invoke("sweep", "--dry-run", "--gpu", "H200", "--config", CONFIG)
    assert result.exit_code == 0, result.output
    assert "dry run" in result.output and "4x1024" in result.output


def test_sweep_with_a_missing_config_exits_1_naming_it(tmp_path):
    result = _invoke("sweep", "--gpu", "H200", "--config", tmp_path / "none.yaml", "--dry-run")
    assert result.exit_code == 1, result.output
    assert "none.yaml" in result.output and "Traceback" not in result.output
