"""The harness of tests/test_crash_resume.py: a sweep with an injected crashing candidate,
killed with kill -9 halfway and started again, keeps every other result and A's clear winners.

A: the sweep, uninterrupted; B1: the same sweep SIGKILLed (whole group) at kill_after of A's
candidates, a torn line appended where the kill left none; B2: the same command again, which
resumes. Findings go to OUT/report.json; `run` returns 0 when every check passed, 1 when one
failed, 2 when a step could not run.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from mla_tune.backends import EXTRA_BACKENDS_ENV
from mla_tune.fileio import atomic_write_text
from mla_tune.tune.results import (
    ResultsError,
    candidate_key,
    lock_path_for,
    read_results,
    results_path_for,
)

REPO = Path(__file__).resolve().parents[1]
CLEAR_GAP = 0.10  # a winner this much faster than its runner-up must win the resumed sweep too
CRASH_REASON = re.compile(r"illegal|worker died|launch failure", re.IGNORECASE)
TORN_LINE = b'{"kind": "candidate", "shape": {"ba'  # what a kill in the middle of a write leaves
SWEEP_MAIN = "from mla_tune.cli import app; app()"  # mla_tune.cli has no __main__ guard


class DemoError(RuntimeError):
    """A step that could not run at all (a sweep that failed, a deadline passed)."""


def say(text: str) -> None:
    print(text, flush=True)


# --------------------------------------------------------------------- subprocesses
def sweep_env(extra_backends: str) -> dict[str, str]:
    """This environment plus the extra backends (ours win a clash), this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    entries = {}
    for item in filter(None, (env.get(EXTRA_BACKENDS_ENV, "") + "," + extra_backends).split(",")):
        name, _, module = item.partition("=")
        entries[name.strip()] = module.strip()
    env[EXTRA_BACKENDS_ENV] = ",".join(f"{n}={m}" for n, m in entries.items())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("COLUMNS", "200")  # rich wraps at 80 columns in a log file otherwise
    return env


def sweep_command(args, table: Path) -> list[str]:
    cmd = [sys.executable, "-c", SWEEP_MAIN, "sweep", "--gpu", args.gpu, "--config",
           str(args.config), "--out", str(table)]
    if args.candidate_timeout is not None:
        cmd += ["--candidate-timeout", str(args.candidate_timeout)]
    return cmd


def _group_alive(pgid: int) -> list[int]:
    """Pids of the process group that still run (zombies excluded; Linux /proc)."""
    alive = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            alive.append(int(entry.name))
    return alive


def kill_group(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the process's whole group; returns the pids still running 10 s later."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 10
    while (left := _group_alive(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def count_candidates(results: Path) -> int:
    """Complete candidate lines in a results file (a torn last line is not counted)."""
    try:
        data = results.read_bytes()
    except FileNotFoundError:
        return 0
    return sum(1 for line in data.split(b"\n")[:-1] if b'"kind": "candidate"' in line)


def _start(cmd: list[str], env: dict, out) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_to_end(cmd: list[str], env: dict, log: Path, limit_s: float, what: str) -> dict:
    """Run a sweep to its end; a sweep past limit_s is killed (whole group) and raises."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = _start(cmd, env, out)
        try:
            rc = proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise DemoError(f"{what} ran past {limit_s:.0f} s and was killed; the end of {log}:\n"
                            f"{log_tail(log)}") from None
    elapsed = round(time.monotonic() - t0, 1)
    if rc != 0:
        raise DemoError(f"{what} exited with code {rc} after {elapsed} s; the end of {log}:\n{log_tail(log)}")
    return {"rc": rc, "elapsed_s": elapsed, "log": str(log)}


def run_and_kill(cmd: list[str], env: dict, log: Path, results: Path, target: int,
                 limit_s: float) -> dict:
    """Start a sweep in its own process group; SIGKILL the group at `target` candidate lines."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = _start(cmd, env, out)
        while (written := count_candidates(results)) < target:
            if proc.poll() is not None:
                raise DemoError(
                    f"the sweep to be killed ended by itself (exit code {proc.returncode}) with "
                    f"{written} of {target} records written; the end of {log}:\n{log_tail(log)}")
            if time.monotonic() - t0 > limit_s:
                kill_group(proc)
                raise DemoError(f"the sweep to be killed wrote only {written} of {target} records "
                                f"in {limit_s:.0f} s; the end of {log}:\n{log_tail(log)}")
            time.sleep(0.01)
        stragglers = kill_group(proc)
    return {"elapsed_s": round(time.monotonic() - t0, 1), "target": target,
            "exit_code": proc.returncode, "stragglers": stragglers, "log": str(log)}


# --------------------------------------------------------------------------- checks
class Checks:
    def __init__(self):
        self.items: list[dict] = []

    def add(self, name: str, passed: bool, detail: str, level: str = "required") -> None:
        self.items.append({"check": name, "passed": bool(passed), "detail": detail, "level": level})
        mark = "ok  " if passed else ("FAIL" if level == "required" else "WARN")
        say(f"  [{mark}] {name}: {detail}")

    @property
    def failed(self) -> list[dict]:
        return [c for c in self.items if not c["passed"] and c["level"] == "required"]


def key_of(record: dict) -> tuple[int, int, str]:
    return candidate_key(record["shape"], record["variant"])


def _shape_name(key) -> str:
    return f"{key[0]}x{key[1]}"


def check_crash(checks: Checks, label: str, records: list[dict], backend: str) -> dict | None:
    """The injected candidate is crashed/failed with a telling reason and ok ones follow it."""
    index = next((i for i, r in enumerate(records) if r["backend"] == backend), None)
    if index is None:
        checks.add(f"{label}: the injected {backend} candidate is recorded", False,
                   f"no {backend} record in {label}; is it in the config and in {EXTRA_BACKENDS_ENV}?")
        return None
    crash = records[index]
    ok = crash["status"] in ("crashed", "failed") and CRASH_REASON.search(crash["reason"] or "")
    checks.add(f"{label}: the injected {backend} candidate is recorded as crashed or failed", bool(ok),
               f"{crash['status']} at {_shape_name(key_of(crash))}: {crash['reason'][:300]}")
    after = [r for r in records[index + 1:] if r["status"] == "ok"]
    checks.add(f"{label}: candidates after the crash still ran", bool(after),
               f"{len(after)} ok record(s) after it, out of {len(records) - index - 1}")
    return crash


def compare_winners(checks: Checks, table_a: dict, table_b: dict) -> list[dict]:
    rows_b = {(r["batch"], r["kv_len"]): r for r in table_b.get("rows", [])}
    shapes = []
    for row in table_a.get("rows", []):
        shape = (row["batch"], row["kv_len"])
        other = rows_b.get(shape, {})
        a_win, b_win = row.get("winner"), other.get("winner")
        runner = row.get("runner_up")
        gap = (runner["time_us"] / row["time_us"] - 1.0) if a_win and runner and row["time_us"] else None
        same = bool(a_win and b_win) and (
            candidate_key({"batch": shape[0], "kv_len": shape[1]}, a_win["variant"])
            == candidate_key({"batch": shape[0], "kv_len": shape[1]}, b_win["variant"]))
        compared = gap is not None and gap > CLEAR_GAP
        shapes.append({
            "shape": _shape_name(shape), "a_winner": a_win and a_win["variant"], "a_us": row.get("time_us"),
            "b_winner": b_win and b_win["variant"], "b_us": other.get("time_us"),
            "gap": None if gap is None else round(gap, 4), "compared": compared, "same": same,
        })
        if compared:
            checks.add(f"{_shape_name(shape)}: B has A's winner (A's lead {gap:.0%} > {CLEAR_GAP:.0%})", same,
                       f"A {a_win['variant']} {row['time_us']} us; B "
                       f"{b_win['variant'] if b_win else None} {other.get('time_us')} us")
    n = sum(s["compared"] for s in shapes)
    checks.add("winners clearly apart to compare", n > 0,
               f"{n} of {len(shapes)} shapes had a winner more than {CLEAR_GAP:.0%} ahead of its "
               "runner-up" + ("" if n else "; the winner comparison is inconclusive"), level="warning")
    return shapes


def print_table(shapes: list[dict]) -> None:
    def us(x):
        return "-" if x is None else f"{x:.1f}"

    say(f"\n{'shape':<9} {'A us':>8} {'B us':>8} {'gap':>8}  {'same?':<6} winner (A's; B's below when it differs)")
    for s in shapes:
        same = ("yes" if s["same"] else "NO") + ("" if s["compared"] else "*")
        gap = "-" if s["gap"] is None else f"{s['gap']:.0%}"
        say(f"{s['shape']:<9} {us(s['a_us']):>8} {us(s['b_us']):>8} {gap:>8}  {same:<6} {s['a_winner']}")
        if not s["same"]:
            say(f"{'':<44}B: {s['b_winner']}")
    if not all(s["compared"] for s in shapes):
        say(f"* not compared: A's winner leads its runner-up by {CLEAR_GAP:.0%} or less (gap = "
            "runner-up time / winner time - 1)")


# ----------------------------------------------------------------------------- main
@dataclass
class Demo:
    """What to run; kill_after is the fraction of A's candidates at which B is killed."""

    gpu: str
    config: Path
    out: Path
    extra_backends: str = "fake_oob=tests.fakes.fake_oob"
    crash_backend: str = "fake_oob"
    kill_after: float = 0.5
    candidate_timeout: float | None = None
    deadline: float = 540.0

    def __post_init__(self):
        if not 0 < self.kill_after < 1:
            raise ValueError(f"kill_after must lie strictly between 0 and 1, got {self.kill_after}")
        if not Path(self.config).is_file():
            raise ValueError(f"config {self.config} is not a file")
        self.config = Path(self.config).resolve()
        self.out = Path(self.out).resolve()
        for sub in ("a", "b"):
            if (self.out / sub).exists() and any((self.out / sub).iterdir()):
                raise ValueError(f"{self.out / sub} already holds files (a sweep there would resume, not "
                                 "start fresh); pass a new out folder or remove that one")

    @property
    def report(self) -> Path:
        return self.out / "report.json"


def run(args: Demo) -> int:
    started = time.monotonic()

    def left() -> float:
        return started + args.deadline - time.monotonic()

    env = sweep_env(args.extra_backends)
    a_dir, b_dir = args.out / "a", args.out / "b"
    for folder in (a_dir, b_dir):
        folder.mkdir(parents=True, exist_ok=True)
    a_table, b_table = a_dir / f"{args.gpu}.yaml", b_dir / f"{args.gpu}.yaml"
    a_results, b_results = results_path_for(a_table), results_path_for(b_table)
    checks = Checks()
    report: dict = {"steps": {}, "checks": checks.items}
    code = 2
    try:
        say(f"[A] the uninterrupted sweep -> {a_table} (log {a_dir / 'sweep.log'})")
        report["steps"]["a"] = run_to_end(sweep_command(args, a_table), env, a_dir / "sweep.log",
                                          left(), "sweep A")
        _header, a_records, _ = read_results(a_results)
        n_a = len(a_records)
        say(f"[A] done in {report['steps']['a']['elapsed_s']} s: {n_a} candidate records")
        if n_a < 2:
            raise DemoError(f"sweep A recorded {n_a} candidates; the demo needs at least 2 to kill one halfway")
        target = min(n_a - 1, max(1, int(args.kill_after * n_a + 0.5)))

        say(f"[B1] the same sweep -> {b_table}, SIGKILL to its process group at {target} of {n_a} records")
        kill = run_and_kill(sweep_command(args, b_table), env, b_dir / "sweep_killed.log", b_results,
                            target, left())
        snapshot = b_results.read_bytes()
        kept = snapshot[: snapshot.rfind(b"\n") + 1]
        kill.update(lines_at_kill=count_candidates(b_results), torn_tail_bytes=len(snapshot) - len(kept),
                    lock_left=lock_path_for(b_table).exists())
        if kill["torn_tail_bytes"]:
            kill["torn_tail"] = "real (the kill landed mid-write)"
        else:
            with open(b_results, "ab") as f:
                f.write(TORN_LINE)
            kill["torn_tail"] = f"simulated: {len(TORN_LINE)} bytes appended after the kill"
        report["steps"]["b_killed"] = kill
        say(f"[B1] killed after {kill['elapsed_s']} s with {kill['lines_at_kill']} records written; "
            f"torn tail: {kill['torn_tail']}; lock left behind: {kill['lock_left']}")
        checks.add("B was killed halfway", 0 < kill["lines_at_kill"] < n_a,
                   f"{kill['lines_at_kill']} of {n_a} candidate records written at the kill")
        checks.add("the kill took the whole process group", not kill["stragglers"],
                   f"still running 10 s after SIGKILL: {kill['stragglers'] or 'none'}")
        checks.add("the killed sweep left its lock behind", kill["lock_left"],
                   f"{lock_path_for(b_table)} {'exists' if kill['lock_left'] else 'is missing'}")

        say(f"[B2] the same command again, resuming (log {b_dir / 'sweep_resumed.log'})")
        report["steps"]["b_resumed"] = run_to_end(sweep_command(args, b_table), env,
                                                  b_dir / "sweep_resumed.log", left(), "sweep B2")
        text = " ".join((b_dir / "sweep_resumed.log").read_text(errors="replace").split())
        say(f"[B2] done in {report['steps']['b_resumed']['elapsed_s']} s")

        def said(check: str, needle: str) -> None:
            checks.add(check, needle in text,
                       f"its output {'says' if needle in text else 'does not say'} '{needle}'")

        said("B2 took over the stale lock", "stale lock")
        said("B2 dropped the torn last line", "truncated last line")
        said("B2 resumed rather than starting over", f"{kill['lines_at_kill']} already recorded")
        code = 1
        _, b_records, warnings = read_results(b_results)
        checks.add("B's results read back cleanly", not warnings, "; ".join(warnings) or "no warnings")
        checks.add("B's first lines are byte-identical to those written before the kill",
                   b_results.read_bytes().startswith(kept),
                   f"the first {len(kept)} bytes ({kill['lines_at_kill']} records and the header)")
        a_keys = [key_of(r) for r in a_records]
        b_keys = [key_of(r) for r in b_records]
        dupes = sorted({k for k in b_keys if b_keys.count(k) > 1})
        missing, extra = sorted(set(a_keys) - set(b_keys)), sorted(set(b_keys) - set(a_keys))
        checks.add("every candidate of A is in B exactly once", not (dupes or missing or extra),
                   f"{len(b_keys)} records in B, {len(a_keys)} in A; duplicates {dupes or 'none'}, "
                   f"missing {missing or 'none'}, extra {extra or 'none'}")
        crash_a = check_crash(checks, "A", a_records, args.crash_backend)
        crash_b = check_crash(checks, "B", b_records, args.crash_backend)
        report["crash_records"] = {"a": crash_a, "b": crash_b}
        table_a = yaml.safe_load(a_table.read_text())
        table_b = yaml.safe_load(b_table.read_text())
        report["shapes"] = compare_winners(checks, table_a, table_b)
        code = 1 if checks.failed else 0
        print_table(report["shapes"])
    except (DemoError, ResultsError, OSError, yaml.YAMLError) as exc:
        checks.add("the demo ran to the end", False, f"{type(exc).__name__}: {exc}")
    finally:
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        report["passed"] = code == 0
        report["log_tails"] = {str(log.relative_to(args.out)): log_tail(log, 40)
                               for log in sorted(args.out.glob("*/*.log"))}
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.report, json.dumps(report, indent=2, default=str) + "\n")
    verdict = "PASS" if code == 0 else "FAIL"
    failed = "; ".join(c["check"] for c in checks.failed)
    say(f"\n{verdict}: {len(checks.items)} checks, {len(checks.failed)} failed{': ' + failed if failed else ''}"
        f" ({report['elapsed_s']} s); report {args.report}")
    return code
