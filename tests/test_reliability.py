"""Reliability: parameter rules, read-only or full disks, Ctrl-C, 4-tuples, a NaN in fp8 KV."""

import builtins
import copy
import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from mla_tune import runtime
from mla_tune.backends import BACKEND_MODULES, EXTRA_BACKENDS_ENV
from mla_tune.backends.params import PARAM_RULES, check_space_value
from mla_tune.fileio import WriteError
from mla_tune.problem import check, generate_input, get_rule, reference
from mla_tune.report import _save
from mla_tune.serving.config import ServingConfigError, load_serving_config
from mla_tune.tables.table import write_table
from mla_tune.tune.config import ConfigError, load_config
from mla_tune.tune.procs import sigint_held
from mla_tune.tune.results import read_results
from tests.fakes import EXTRA_BACKENDS
from tests.helpers import CPU_TABLE, REPO, invoke, sigint_as_in_a_terminal

DATA = REPO / "tests" / "data"
GOOD = "triton(block_n=16,dot_dtype=fp16,kv=fp8,num_splits=2,num_stages=1,num_warps=4,q=bf16)"


# ----------------------------------------------------------- parameter rules as data
def test_show_refuses_what_export_refuses_with_the_same_line_and_without_torch(tmp_path):
    bad = {edit: str(tmp_path / f"bad_{edit}.yaml") for edit in ("num_splitz=4", "num_splits=two")}
    for edit, path in bad.items():  # the CPU table with one winner's variant text edited
        Path(path).write_text(CPU_TABLE.read_text().replace(GOOD, GOOD.replace("num_splits=2", edit), 1))
    code = textwrap.dedent(f"""
        import json, sys
        from typer.testing import CliRunner
        from mla_tune import cli
        out = {{}}
        for edit, bad in {bad!r}.items():
            for name, args in (("show", ["show", "--table", bad]), ("show_json", ["show", "--table", bad, "--json"]),
                               ("diff", ["diff", {str(CPU_TABLE)!r}, bad])):
                result = CliRunner().invoke(cli.app, args)
                out[edit + " " + name] = [result.exit_code, result.output]
        out["torch"] = "torch" in sys.modules
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["torch"] is False, "show or diff imported torch"
    for edit in bad:
        export = invoke("export", "--table", bad[edit], "-o", tmp_path / "sub.py")
        lines = export.output.strip().splitlines()
        assert export.exit_code == 1 and len(lines) == 1, export.output
        assert "winner.variant: triton: " in lines[0], export.output
        assert ("unknown parameter num_splitz" if "splitz" in edit else "num_splits=two is not allowed") in lines[0]
        for name in ("show", "show_json", "diff"):
            code_, text = out[f"{edit} {name}"]
            assert code_ == 1, (name, text)
            assert text.strip().splitlines() == lines, name
    assert not (tmp_path / "sub.py").exists()


def test_every_backend_has_rules_and_space_values_are_checked_one_by_one():
    assert set(PARAM_RULES) == set(BACKEND_MODULES)
    check_space_value(PARAM_RULES["triton"], "num_splits", 4)
    check_space_value(PARAM_RULES["triton"], "max_splits", 64)  # the serving form's key
    check_space_value(PARAM_RULES["triton"], "unknown_key", 0)  # left to candidates()
    check_space_value(PARAM_RULES["aiter"], "max_split_per_batch", -1)
    for backend, name, value, message in (("triton", "block_n", 48, "block_n=48 is not allowed"),
                                          ("aiter", "mode", "turbo", "mode=turbo is not allowed"),
                                          ("gluon_fused", "v_path", "rs4", "v_path=rs4 is not allowed")):
        with pytest.raises(ValueError, match=message):
            check_space_value(PARAM_RULES[backend], name, value)


# ------------------------------------------------ values refused at config load
SERVING = yaml.safe_load((REPO / "configs" / "serving.yaml").read_text())
FIRST = next(iter(SERVING["backends"]))  # the serving config's first backend
LEFT_OUT = {"max_tokens": 10, "why": "a test"}


def _serving(**changes) -> str:
    raw = copy.deepcopy(SERVING)
    raw["backends"].update(changes.pop("backends", {}))
    return yaml.safe_dump({**raw, **changes})


@pytest.mark.parametrize("text, error, match", [
    ("  triton: {num_splits: [1, 0], block_n: [16], kv: [bf16], dot_dtype: [fp16]}\n",
     ConfigError, r"field 'backends\.triton\.num_splits'.*num_splits=0 is not allowed"),
    ("  triton: {num_splits: [1], block_n: [16], kv: [bf16], dot_dtype: [fp16], hip: {waves_per_eu: [17]}}\n",
     ConfigError, r"field 'backends\.triton\.hip\.waves_per_eu'.*waves_per_eu=17 is not allowed"),
    ("  triton: {grids: [{num_splits: [2]}, {num_splits: [300]}], kv: [bf16], dot_dtype: [fp16]}\n",
     ConfigError, r"field 'backends\.triton\.grids\[1\]\.num_splits'.*num_splits=300 is not allowed"),
    (_serving(backends={FIRST: {"max_splits": [0]}}), ServingConfigError,
     rf"backends\.{FIRST}\.max_splits.*max_splits=0 is not allowed"),
    (_serving(check_seeds=[1, 2**64]), ServingConfigError, "check_seeds.*must be two distinct integers from"),
    (_serving(left_out=[{**LEFT_OUT, "kv_format": "FP8"}]), ServingConfigError,
     r"left_out\[0\]\.kv_format.*'FP8' matches no family; the families' kv_format: bf16, fp8"),
    (_serving(left_out=[{**LEFT_OUT, "heads": "sixteen"}]), ServingConfigError,
     r"left_out\[0\]\.heads.*matches no family"),
], ids=["num_splits", "waves_per_eu", "grids", "serving max_splits", "serving seeds", "serving kv_format",
        "serving heads"])
def test_a_config_value_nothing_can_carry_fails_at_load_and_the_dry_run_in_one_line(tmp_path, text, error, match):
    path = tmp_path / "config.yaml"
    path.write_text(text if error is ServingConfigError else (DATA / "sweep_torch.yaml").read_text() + text)
    with pytest.raises(error, match=match):
        (load_serving_config if error is ServingConfigError else load_config)(path)
    result = invoke("sweep", "--gpu", "cpu", "--config", path, "--dry-run")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert re.search(match, " ".join(result.output.split())), result.output


# ------------------------------------------- read-only folders and full disks, per command
class FailingFolder:
    """Every write under `folder` fails as a read-only file system (EROFS) does, or, with
    code ENOSPC, as a full disk does after `after` writes succeed: the failing write stores
    half of its bytes first, as a real short write would. Root ignores permissions, so the
    OS calls are patched rather than the folder chmodded."""

    def __init__(self, monkeypatch, folder: Path, code: int, after: int = 0):
        self.folder, self.code, self.left = Path(folder).resolve(), code, after
        self.full = after == 0  # fsync fails once the disk is full
        real_write, real_builtin_open = os.write, builtins.open
        rofs = code == errno.EROFS
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

        def fail(path):
            raise OSError(code, os.strerror(code), str(path))

        def refuse(name, refused):  # os.NAME fails naming the path refused(*args) gives, if any
            real = getattr(os, name)

            def fake(*args, **kwargs):
                if (path := refused(*args)) is not None:
                    fail(path)
                return real(*args, **kwargs)

            monkeypatch.setattr(os, name, fake)

        def under(path) -> bool:
            try:
                return Path(os.fsdecode(path)).resolve().is_relative_to(self.folder)
            except (TypeError, ValueError):
                return False

        def spent() -> bool:
            if self.left <= 0:
                self.full = True
                return True
            self.left -= 1
            return False

        def tracked(fd) -> bool:  # the file the descriptor has open lies under the folder
            try:
                return under(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                return False

        def fake_write(fd, data):
            if not rofs and tracked(fd) and spent():
                real_write(fd, bytes(data)[: max(1, len(data) // 2)])
                fail(f"fd {fd}")
            return real_write(fd, data)

        def fake_builtin_open(file, mode="r", *args, **kwargs):
            if under(file) and set(mode) & set("wax+") and (rofs or spent()):  # under() is False for an fd
                fail(file)
            return real_builtin_open(file, mode, *args, **kwargs)

        if rofs:  # nothing under the folder is opened for writing, made or replaced
            refuse("open", lambda path, flags, *_: path if flags & writes and under(path) else None)
            refuse("mkdir", lambda p, *_: p if under(p) and not Path(p).exists() else None)
            refuse("replace", lambda _src, dst, *_: dst if under(dst) else None)
        refuse("fsync", lambda fd: f"fd {fd}" if not rofs and tracked(fd) and self.full else None)
        monkeypatch.setattr(os, "write", fake_write)
        monkeypatch.setattr(builtins, "open", fake_builtin_open)


def _one_line(result, *needles, progress: bool = False):
    """The command failed in one red line (after its progress lines, if `progress`)."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and (progress or len(lines) == 1), result.output
    assert [x for x in lines if x.startswith("error")] == lines[-1:], result.output
    assert lines[-1].startswith("error: cannot write ") and "Traceback" not in result.output
    assert all(needle in lines[-1] for needle in needles), lines[-1]
    return lines[-1]


FULL = "No space left on device; free some space or write elsewhere"
PNG = b"\x89PNG" + b"0" * 1000
VERIFY_REPORTS = sorted((REPO / "docs" / "data" / "verify").glob("*.json.gz"))[:1]


@pytest.mark.parametrize("code", [30, 28])
@pytest.mark.parametrize("command", ["export", "sweep", "serving sweep", "verify --json"])
def test_a_command_into_a_read_only_or_full_folder_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, code, command):
    out = tmp_path / "ro"
    out.mkdir()
    args, needles = {
        "export": (["export", "--table", CPU_TABLE, "-o", out / "sub.py", "--only", "torch"],
                   [str(out / "sub.py"), "write elsewhere"]),
        "sweep": (["sweep", "--gpu", "cpu", "--config", DATA / "sweep_torch.yaml", "--out", out / "cpu.yaml"],
                  [str(out / "cpu.results.jsonl.lock"), "write the table elsewhere (--out)"]),
        "serving sweep": (["sweep", "--gpu", "cpu", "--config", REPO / "configs" / "serving.yaml", "--force",
                           "--out", out / "cpu.serving.yaml"],
                          [str(out), "read-only" if code == 30 else "No space left on device"]),
        "verify --json": (["verify", "--table", REPO / "tables" / "H200.serving.yaml", "--rescore",
                           *VERIFY_REPORTS, "--json", out / "v.json"],
                          [f"cannot write {out / 'v.json'}: "]),
    }[command]
    FailingFolder(monkeypatch, out, code)
    line = _one_line(invoke(*args), *needles, progress=command == "verify --json")
    if code == errno.ENOSPC and command in ("export", "verify --json"):  # the whole line, word for word
        assert line == f"error: cannot write {out / ('sub.py' if command == 'export' else 'v.json')}: {FULL}"
    monkeypatch.undo()
    assert list(out.rglob("*")) == []  # no table, no results, no lock naming this live process


def test_a_disk_that_fills_mid_sweep_stops_in_one_line_and_keeps_whole_lines(tmp_path, monkeypatch):
    out = tmp_path / "cpu.yaml"
    FailingFolder(monkeypatch, tmp_path, errno.ENOSPC, after=3)  # the lock's pid, the header, one step
    result = invoke("sweep", "--gpu", "cpu", "--config", DATA / "sweep_torch.yaml", "--out", out)
    assert _one_line(result, progress=True) == (
        f"error: cannot write {tmp_path / 'cpu.results.jsonl'}: {FULL}; every finished step is kept in the "
        "results file; fix that and re-run the same command to resume")
    monkeypatch.undo()
    assert not out.exists() and not (tmp_path / "cpu.results.jsonl.lock").exists()
    # what a re-run resumes from: the header and the finished step; the failed append was cut off
    header, records, warnings = read_results(tmp_path / "cpu.results.jsonl", kinds=("candidate", "step", "rung"))
    assert header is not None and records and warnings == []


# ------------------------------------------------------------ Ctrl-C from a terminal
@pytest.mark.parametrize("handler", ["python", "SIG_DFL", "not from Python"])
def test_a_ctrl_c_while_a_worker_starts_is_held_and_raised_not_dropped(tmp_path, capfd, monkeypatch, handler):
    log = tmp_path / "worker.log"
    before = signal.default_int_handler if handler == "python" else signal.SIG_DFL
    inherited = signal.signal(signal.SIGINT, before)  # the sweep's, whatever pytest's is
    if handler == "not from Python":  # an embedding host's C handler: signal.signal returns None for it
        real, calls = signal.signal, []

        def first_returns_none(signum, new_handler):
            calls.append(new_handler)
            previous = real(signum, new_handler)
            return None if len(calls) == 1 else previous

        monkeypatch.setattr(signal, "signal", first_returns_none)
    try:
        with pytest.raises(KeyboardInterrupt), sigint_held(log):  # where the sweep starts a worker
            subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('child traceback')"], check=True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # as a Ctrl-C reaches it
            time.sleep(0.05)  # noted, not raised in here
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, inherited)
    assert log.read_text() == "child traceback"  # the child's stderr, not this process's
    assert "child traceback" not in capfd.readouterr().err


def test_ctrl_c_to_the_process_group_while_the_workers_start_prints_no_traceback(tmp_path):
    out = tmp_path / "cpu.yaml"
    env = {**os.environ, EXTRA_BACKENDS_ENV: EXTRA_BACKENDS, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "mla_tune", "sweep", "--gpu", "cpu", "--config",
                             str(DATA / "sweep_resume.yaml"), "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_as_in_a_terminal)
    lock = tmp_path / "cpu.results.jsonl.lock"
    deadline = time.monotonic() + 60
    while not lock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the worker is importing torch now (it takes seconds)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "interrupted: the workers are stopped" in stdout and "resume with: mla-tune sweep" in stdout


# ------------------------------------------------------- custom_kernel given a 4-tuple
def test_the_runtime_names_the_five_tuple():
    """The exported file's twin of this check is in test_export's torch-only test."""
    data = generate_input(1, 8, seed=3, device="cpu")
    rt = runtime.load(table=CPU_TABLE, device="cpu", allow_other_gpu=True)
    with pytest.raises(ValueError, match=r"^custom_kernel: data must be the 5-tuple \(q, kv_data, qo_indptr, "
                                         r"kv_indptr, config\), got a tuple of 4$"):
        rt.custom_kernel(tuple(data[:4]))
    with pytest.raises(ValueError, match=r"got a dict$"):
        rt.custom_kernel({"q": data[0]})


# ------------------------------------------------------------ a NaN byte in fp8 KV
def test_a_nan_in_the_fp8_cache_cannot_vanish_in_the_gate():
    rule = get_rule("leaderboard")
    data = list(generate_input(4, 16, seed=5, device="cpu"))
    kv, scale = data[1]["fp8"]
    raw = kv.view(torch.uint8).clone()
    raw.view(-1)[3 * 16 * 576 + 5] = 0x7F  # e4m3fn NaN, in sequence 3 (token 0 of 16)
    data[1] = {**data[1], "fp8": (raw.view(kv.dtype), scale)}
    ref = reference(tuple(data), "fp8", "fp8")
    assert torch.isnan(ref[3]).all() and not torch.isnan(ref[:3]).any()  # the fp32 reference says NaN
    finite = torch.nan_to_num(ref, nan=0.0)  # a kernel that hides the NaN
    result = check(finite, ref, rule)
    assert not result.passed and "the reference is NaN at 8192 elements where the output is finite" in result.reason
    # 1 of 4 sequences is 25% of the elements; hidden in 1 of 256 sequences it still fails
    big_ref = torch.zeros(256, 16, 512)
    big_ref[7] = float("nan")
    assert not check(torch.zeros(256, 16, 512), big_ref, rule).passed
    assert check(ref.clone(), ref, rule).passed  # NaN where the reference is NaN: they agree
    wrong = ref.clone()
    wrong[0, 0, 0] = float("nan")
    assert not check(wrong, ref, rule).passed and check(wrong, ref, rule).reason == "output holds NaN"


def _savefig(path, dpi, format):
    with open(path, "wb") as f:
        f.write(PNG)


def _report_plot(path, fill):  # a figure with what report._save needs, without matplotlib
    figure = SimpleNamespace(tight_layout=lambda: None, clf=lambda: None, savefig=_savefig)
    assert _save(figure, path.parent, "ok.png") == "ok.png"
    fill()
    _save(figure, path.parent, path.name)


def _write_table(path, fill):
    fill()
    write_table(path, yaml.safe_load(CPU_TABLE.read_text()))


@pytest.mark.parametrize("write, name, advice, kept", [
    (_report_plot, "full.png", "", {"ok.png": PNG}),
    (_write_table, "cpu.yaml", "; the results file keeps every step, so re-running the same command writes the table "
     "without timing anything again", {}),
], ids=["report plot", "sweep table"])
def test_a_write_on_a_full_disk_is_one_write_error_naming_the_file_and_leaves_no_partial_file(
        tmp_path, monkeypatch, write, name, advice, kept):
    with pytest.raises(WriteError) as caught:
        write(tmp_path / name, lambda: FailingFolder(monkeypatch, tmp_path, errno.ENOSPC))
    monkeypatch.undo()
    assert str(caught.value) == f"cannot write {tmp_path / name}: {FULL}{advice}"
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*")} == kept
