"""The sweep lock: an OS-level lock held for the sweep's life (mla_tune.tune.results.SweepLock)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mla_tune.tune.results import ResultsError, SweepLock

ROOT = Path(__file__).resolve().parent.parent
TORCH = ROOT / "tests" / "data" / "sweep_torch.yaml"

# a sweep that only holds the lock a moment, through run_sweep's real lock handling
_RACER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import mla_tune.tune.sweep as sweep
    from mla_tune.tune.sweep import SweepError, run_sweep

    def hold(*args, **kwargs):
        print("RAN", flush=True)
        time.sleep(1.5)

    sweep._sweep = hold
    ready, config, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    (ready / str(os.getpid())).touch()
    while len(list(ready.iterdir())) < 2:  # both imported: go at the same moment
        pass
    try:
        run_sweep(config, "cpu", out=out)
    except SweepError as exc:
        print(f"REFUSED {exc}", flush=True)
        sys.exit(1)
""")


def test_two_sweeps_started_together_exactly_one_runs_the_other_names_lock_and_pid(tmp_path):
    out = tmp_path / "cpu.yaml"
    lock = tmp_path / "cpu.yaml.lock"
    lock.write_text("")  # what a sweep killed between creating and writing it leaves (issue 12)
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, str(ready), str(TORCH), str(out)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    by_code = {p.returncode: (p, stdout) for p, (stdout, _) in zip(procs, outputs, strict=True)}
    assert sorted(by_code) == [0, 1], outputs
    (winner, ran), (_, refused) = by_code[0], by_code[1]
    assert ran.strip() == "RAN"
    lines = refused.strip().splitlines()
    assert len(lines) == 1, refused
    assert str(lock) in lines[0] and f"pid {winner.pid}" in lines[0], lines[0]
    assert not lock.exists()  # the winner removed it on the way out


def _hold(path: Path, write_pid: bool) -> subprocess.Popen:
    """A process holding the flock of `path`, its pid written in if `write_pid` (no torch: fast)."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, time
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if {write_pid}:
            os.write(fd, f"{{os.getpid()}}\\n".encode())
        print("held", flush=True)
        time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_live_holder_is_never_taken_over_even_while_its_file_is_still_empty(tmp_path):
    path = tmp_path / "t.yaml.lock"
    holder = _hold(path, write_pid=False)
    try:
        assert path.read_text() == ""  # just created: no pid in it yet
        with pytest.raises(ResultsError, match="another sweep .* holds the lock"):
            SweepLock(path).acquire()
        assert path.exists()
    finally:
        holder.kill()
        holder.wait()
    lock = SweepLock(path).acquire()  # the holder died: its flock went with it
    assert lock.warning is None and path.read_text().strip() == str(os.getpid())
    lock.release()


def test_a_lock_of_a_killed_sweep_is_taken_over_with_a_warning_naming_its_pid(tmp_path):
    path = tmp_path / "t.yaml.lock"
    killed = _hold(path, write_pid=True)  # what SweepLock.acquire leaves: flock held, pid written
    killed.kill()
    killed.wait()
    assert path.read_text().strip() == str(killed.pid)
    lock = SweepLock(path).acquire()
    assert "stale lock" in lock.warning and f"left by pid {killed.pid}" in lock.warning
    assert path.read_text().strip() == str(os.getpid())
    with pytest.raises(ResultsError, match=f"pid {os.getpid()}"):
        SweepLock(path).acquire()  # a second sweep in this very process is refused too
    lock.release()
    assert not path.exists()
