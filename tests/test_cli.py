"""The `mla-tune` command line: help, show, export, diff, sweep's option passing, clean errors."""

import itertools
import json
import subprocess
import sys
import textwrap
import time

import pytest
import typer.main
import yaml

from mla_tune import __version__
from mla_tune.backends import known_backends
from mla_tune.cli import app
from mla_tune.tables.table import load_table
from tests.helpers import CPU_TABLE as TABLE
from tests.helpers import NARROW, REPO, cpu_table, invoke

# the H200 table before the budgeted search: fixed numbers for exact assertions
H200_FIXED = REPO / "tests" / "data" / "H200.pre-search.yaml"


def _output(*args, code=0, env=None):
    """What `mla-tune ARGS` prints, asserting it exits with `code`."""
    result = invoke(*args, env=env)
    assert result.exit_code == code, result.output
    return result.output


def _error_lines(*args, code=1):
    return _output(*args, code=code).strip().splitlines()


def _commands(command, path=()):
    """(path, command) for every command and group under `command`, depth first."""
    for name, sub in getattr(command, "commands", {}).items():
        yield (*path, name), sub
        yield from _commands(sub, (*path, name))


def test_every_command_and_parameter_has_sentences_of_help_with_h_too_in_80_columns_and_no_negative_twin():
    """A docstring's own line breaks would print ragged lines (rich help keeps them); a group's
    help lists its commands, and `mla-tune` alone every command; --version prints the version."""
    says = {("sweep",): "Sweep every candidate kernel per shape", ("show",): "Show a dispatch table",
            ("export",): "Write a table as one self-contained leaderboard submission file",
            ("diff",): "Compare two tables shape by shape", ("report",): "Write a Markdown report of a table",
            ("verify",): "Re-time a serving table's picks"}
    commands = dict(_commands(typer.main.get_command(app)))
    assert ("time", "scan") in commands and set(says) <= set(commands)
    listed = invoke().output
    assert all(command in listed for (command,) in says)
    assert _output("--version").strip() == f"mla-tune {__version__}"
    assert invoke("sweep", "--no-dry-run", "--gpu", "H200").exit_code == 2
    for path, command in commands.items():
        assert (command.help or "").strip(), path
        for param in command.params:
            if param.name == "help":
                continue
            assert not param.secondary_opts, f"{path} {param.opts} has {param.secondary_opts}"
            text = getattr(param, "help", None) or ""  # arguments' help too
            assert text[:1].isupper() and text.rstrip().endswith("."), f"{path} {param.opts}: {text!r}"
        output = _output(*path, "--help")
        assert _output(*path, "-h") == output
        assert says.get(path, "") in " ".join(output.split())
        assert all(name in output for name in getattr(command, "commands", {})), path
        lines = output.splitlines()
        start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
        text = [line.rstrip() for line in lines[start:next(i for i, line in enumerate(lines) if "╭" in line)]]
        for line, after in itertools.pairwise(text):
            if line and after:  # two lines of one paragraph: the second's first word did not fit
                assert len(line) + 1 + len(after.split()[0]) > 78, f"mla-tune {' '.join(path)}: {line!r}"


def test_show_prints_rows_notes_provenance_and_json_in_80_columns_40_lines_piped_too_and_diff_flags_changes(tmp_path):
    """On a wide terminal each winner is on one line; a huge text field is clipped; diff flags
    winner changes and times outside the noise."""
    # `mla-tune show --gpu H200 | cat`: no terminal and no COLUMNS, so 80 columns
    env = {"PATH": "/usr/bin:/bin", "NO_COLOR": "1"}
    piped = subprocess.run([sys.executable, "-m", "mla_tune", "show", "--gpu", "H200"],
                           capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert piped.returncode == 0, piped.stderr
    fixed = _output("show", "--table", H200_FIXED)
    for path, output in ((REPO / "tables" / "H200.yaml", piped.stdout), (H200_FIXED, fixed)):
        lines = output.splitlines()
        assert len(lines) <= 40 and max(map(len, lines)) <= 80, output
        assert "…" not in output and "\x1b[" not in output  # no rich ellipsis, no ANSI
        wide = _output("show", "--table", path, env={**NARROW, "COLUMNS": "200"}).splitlines()
        for shape, row in load_table(path, check_params=False).rows.items():
            assert any(line.endswith(row.winner["variant"]) for line in wide)
            mine = [line for line in lines if line.split()[:2] == [str(shape), "winner"]]
            # the variant's full text, rebuilt from its lines, each k=v whole on one line
            text = "".join(line.split(maxsplit=2)[2].strip() for line in mine)
            assert text == row.winner["variant"]
        # grep for one parameter finds the line, and the line names the shape
        hits = [line for line in lines if "num_splits=16" in line]
        assert hits and hits[0].split()[:2] == ["4x1024", "winner"]
    assert "2.00x" in fixed and "69/85/0" in fixed  # the pre-search table's speedup, ok/pruned/bad
    out = _output("show", "--table", TABLE)
    assert "  1x8  winner torch(kv=bf16,q=bf16)" in out and "2x40" in out
    assert "1.38x" in out  # baseline 11.0 / triton 8.0
    assert "3x16 winner none: no candidate passed the gate" in out and "triton: all" in out
    assert "provenance:" in out and "rule: leaderboard rtol=0.1 atol=0.1" in out
    assert "config: configs/test.yaml (hash 0123abcd)" in out
    data = json.loads(_output("show", "--table", TABLE, "--json"))
    assert data["gpu"] == "cpu" and data["path"] == str(TABLE)
    assert [(r["batch"], r["kv_len"]) for r in data["rows"]] == [(1, 8), (2, 40), (3, 16)]
    assert data["rows"][1]["winner"]["variant"].startswith("triton(block_n=16")
    reason = next(line for line in TABLE.read_text().splitlines() if line.startswith("  reason: "))
    big = tmp_path / "big.yaml"
    big.write_text(TABLE.read_text().replace(reason, "  reason: '" + "why " * 3_000_000 + "'"))  # 12 MB
    started = time.monotonic()
    lines = _output("show", "--table", big).splitlines()
    assert time.monotonic() - started < 10 and len(lines) <= 40 and max(map(len, lines)) <= 80
    data = yaml.safe_load(TABLE.read_text())
    data["rows"][0]["time_us"] = 12.0  # 1x8: +20%, outside its 2% spread: flagged
    data["rows"][1]["time_us"] = 8.1  # 2x40: +1.25%, inside its 3% spread
    data["rows"][1]["winner"] = {"variant": "torch(kv=bf16,q=bf16)", "backend": "torch",
                                 "params": {"kv": "bf16", "q": "bf16"}}
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(data, sort_keys=False))
    lines = _output("diff", TABLE, new).splitlines()
    assert max(map(len, lines)) <= 80
    row = {line.split()[0]: line for line in lines if line[:1].isdigit()}
    assert "+20.0%" in row["1x8"] and "SLOWER" in row["1x8"] and "same winner" in row["1x8"]
    assert "+1.2%" in row["2x40"] and "within noise" in row["2x40"] and "winner changed" in row["2x40"]
    assert any(line.split()[:3] == ["2x40", "new", "torch(kv=bf16,q=bf16)"] for line in lines)
    data = json.loads(_output("diff", TABLE, new, "--json"))
    by_shape = {c["shape"]: c for c in data["shapes"]}
    assert by_shape["1x8"]["flagged"] is True and by_shape["1x8"]["noise"] == 0.02
    assert by_shape["2x40"]["flagged"] is False and by_shape["2x40"]["status"] == "winner changed"
    assert by_shape["3x16"]["change"] is None


@pytest.mark.parametrize("bad", ["", "../../x", "H200/..", "a b", "-x"])
def test_a_gpu_name_that_is_not_a_name_is_refused_in_one_line(bad):
    for command in (["show"], ["export", "-o", "x.py"], ["sweep", "--dry-run"], ["report"]):
        assert _error_lines(*command, f"--gpu={bad}", code=2) == [
            f"error: --gpu {bad!r} is not a GPU name; use letters, digits, '-' and '_' only, like H200 or MI355X"]
    assert "--gpu NAME or a table file with --table PATH" in _output("show", code=2)


def test_export_overwrites_only_its_own_files_and_errors_exit_1_in_one_line_naming_the_file_and_the_fix(
        tmp_path, monkeypatch):
    """An internal error (not an MlaTuneError) shows its traceback instead."""
    out = tmp_path / "submission.py"
    output = _output("export", "--table", TABLE, "-o", out, "--only", "torch")
    assert "backends limited to torch" in output
    assert out.read_text().splitlines()[:2] == ["#!POPCORN leaderboard amd-mixed-mla", "#!POPCORN gpu cpu"]
    # a second export over its own earlier file is fine; over its table, results or a config not
    _output("export", "--table", TABLE, "-o", out, "--only", "torch")
    table = tmp_path / "cpu.yaml"
    for target, before in ((table, TABLE.read_text()), (tmp_path / "test.yaml", "name: x\n"),
                           (tmp_path / "cpu.results.jsonl", '{"kind": "header"}\n')):
        target.write_text(before)
        assert _error_lines("export", "--table", table, "-o", target, "--only", "torch") == [
            f"error: -o {target} exists and is not a submission mla-tune wrote (it does not start "
            "with #!POPCORN); export overwrites only its own files, so choose another output path"]
        assert target.read_text() == before
    monkeypatch.chdir(REPO)  # where `--gpu NAME` looks for tables/NAME.yaml
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    broken = cpu_table(tmp_path, "broken.yaml", schema=7)
    typo = tmp_path / "typo.yaml"  # a serving config's field misspelt
    typo.write_text((REPO / "configs" / "serving.yaml").read_text().replace("\nfamilies:", "\nfamiles:"))
    cases = [
        (("show", "--table", tmp_path), f"table {tmp_path} is a directory; pass the path of a .yaml file"),
        (("show", "--table", loop), f"cannot read table {loop}: Too many levels of symbolic links"),
        (("export", "--table", TABLE, "-o", tmp_path, "--only", "torch"),
         f"-o {tmp_path} is a directory; name the submission file"),
        (("show", "--table", broken), f"table {broken}: schema is 7"),
        (("export", "--table", TABLE, "-o", tmp_path / "x.py", "--only", "aiter"),  # no fallback left
         "the fallback needs the triton or the torch backend, but --only allows only aiter; add triton or torch to --only"),
        (("export", "--gpu", "H200", "--table", TABLE, "-o", tmp_path / "x.py"), "is for cpu, not H200"),
        (("export", "--table", TABLE, "-o", tmp_path / "x.py", "--only", "warp"),
         f"unknown backend(s) warp; known backends: {', '.join(known_backends())}"),
        (("sweep", "--gpu", "H200", "--config", typo, "--dry-run"), "field 'familes': unknown field"),
        (("report", "--table", TABLE, "--out", tmp_path / "r"),
         'error: mla-tune report needs matplotlib for its plots; install it with pip install -e ".[report]"'),
        (("show", "--gpu", "h200"), "error: no table tables/h200.yaml for --gpu h200 (did you mean "
         "--gpu H200?); make one with `mla-tune sweep --gpu h200`"),
        (("export", "--gpu", "H100", "-o", "never.py"), "(tables here: H200"),
        (("verify", "--table", tmp_path / "nope.serving.yaml"), "nope.serving.yaml does not exist"),
    ]
    for args, says in cases:  # a message that starts with "error: " is the whole line
        lines = _error_lines(*args)
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
        assert lines == [says] or not says.startswith("error: ")
    assert not (tmp_path / "x.py").exists() and not (tmp_path / "r").exists()
    assert not (REPO / "never.py").exists()
    # a ValueError that is not an MlaTuneError is a bug: the CLI must not dress it up
    code = textwrap.dedent(f"""
        import mla_tune.tables.table
        def broken(*args, **kwargs):
            raise ValueError("an internal bug")
        mla_tune.tables.table.load_table = broken
        from mla_tune.cli import app
        app(["show", "--table", {str(TABLE)!r}])
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**NARROW, "PATH": "/usr/bin:/bin", "_TYPER_STANDARD_TRACEBACK": "1"})
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "ValueError: an internal bug" in done.stderr
    assert "error: an internal bug" not in done.stderr


def test_sweep_passes_its_options_and_budget_through_for_either_kind_of_config(monkeypatch, tmp_path):
    """Options reach the sweep as given, --budget replacing budget_s in either kind of config;
    a bad value is one line and exit 2."""
    sweep = ("sweep", "--gpu", "H200")
    seen = {}
    monkeypatch.setattr("mla_tune.serving.sweep.sweep_from_cli",
                        lambda config, gpu, **kw: seen.update(kw))  # None: exit 0
    _output(*sweep, "--config", "configs/serving.yaml", "--budget", "300")
    assert seen["budget"] == 300.0
    output = _output(*sweep, "--dry-run", "--budget", "60")
    assert "fits the budget of 60 s" in output and "dropped for the budget" in output
    assert "--budget must be a positive number of seconds" in _output(*sweep, "--budget", "-5", code=2)
    calls = []
    monkeypatch.setattr("mla_tune.tune.sweep.run_sweep", lambda *a, **k: calls.append((a, k)))
    _output(*sweep, "--config", tmp_path / "c.yaml", "--out", tmp_path / "t.yaml", "--devices", "0,1",
            "--fresh", "--force")
    assert calls == [((tmp_path / "c.yaml", "H200"),  # no candidate_timeout_s: the config's
                      {"out": tmp_path / "t.yaml", "dry_run": False, "force": True, "devices": [0, 1], "fresh": True})]
    _output(*sweep, "--config", tmp_path / "c.yaml", "--candidate-timeout", "7.5")
    assert calls[-1][1]["candidate_timeout_s"] == 7.5
    output = _output(*sweep, "--candidate-timeout", "0", code=2)
    assert "--candidate-timeout must be a positive number" in output and len(calls) == 2
    assert "--devices must be GPU indices" in _output(*sweep, "--devices", "zero", code=2)
    for bad in ("-1", "0,0"):  # either sweep (a serving config's too) is refused before it starts
        for config in ("configs/leaderboard.yaml", "configs/serving.yaml"):
            output = _output(*sweep, "--config", config, "--devices", bad, code=2)
            assert "--devices must be distinct GPU indices" in output, output


@pytest.mark.parametrize(("gpu", "config", "code", "says"), [
    ("H200", REPO / "configs" / "leaderboard.yaml", 0, ["dry run", "4x1024"]),
    ("H200", "configs/serving.yaml", 0, ["1404 cells", "estimated GPU time"]),  # the serving sweep
    ("H200", "none.yaml", 1, ["none.yaml"]),  # missing: exit 1, naming it
    ("H201", None, 0, ["warning: H201 is neither this machine's GPU nor one mla-tune knows"]),
], ids=["leaderboard", "serving", "missing", "unknown-gpu"])
def test_sweep_dry_run_plans_either_kind_of_config_or_names_a_missing_one_or_unknown_gpu(gpu, config, code, says):
    config_args = ["--config", config] if config else []  # none: the GPU's default config
    output = _output("sweep", "--gpu", gpu, *config_args, "--dry-run", code=code)
    assert all(word in " ".join(output.split()) for word in says) and "Traceback" not in output
    assert code or max(map(len, output.splitlines())) <= 80  # a plan wraps (an error is one line)


@pytest.mark.parametrize(("args", "says"), [
    (["sweep", "--gpu", "H200", "--dry-run", "--fresh"], "--fresh and --candidate-timeout apply to a sweep"),
    (["sweep", "--gpu", "H200", "--dry-run", "--candidate-timeout", "5"], "drop them, or drop --dry-run"),
    (["compile", "--gpu", "H200", "--json", "--markdown"], "two views of one report: pass one"),
    (["compile", "--gpu", "H200", "--markdown", "--users"], "drop --users"),
    (["verify", "--table", "tables/H200.serving.yaml", "--unrunnable", "flashmla"],
     "give them with --rescore"),
], ids=["dry-run-fresh", "dry-run-timeout", "json-markdown", "markdown-users", "unrunnable-without-rescore"])
def test_an_option_the_command_would_ignore_is_refused(args, says):
    output = _output(*args, code=2)
    assert says in " ".join(output.split()), output
