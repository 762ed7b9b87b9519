"""The append-only results file of a sweep, its resume logic and the lock on its table.

`tables/NAME.results.jsonl` holds one JSON object per line: a header, then one record per
finished candidate (format in docs/architecture.md). Each append is a single write of one
line, then flush and fsync, so a kill -9 loses at most the candidate in flight; a torn last
line (killed mid-write) is dropped with a warning and cut off before the next append. A
write that fails (a full disk, a read-only folder) is cut back off at once and stops the
sweep with one line naming the file and saying that re-running resumes (RESUME_NOTE).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mla_tune.core import Variant
from mla_tune.errors import MlaTuneError
from mla_tune.fileio import LineLog, read_maybe_gzipped, writing

SCHEMA = 1
# What a failed write of a results file leaves: every line before it, whole.
RESUME_NOTE = "every finished step is kept in the results file; fix that and re-run the same command to resume"


class ResultsError(MlaTuneError, ValueError):
    """A results file or lock that stops the sweep; the message says what to do."""


def results_path_for(table_path: Path) -> Path:
    """tables/H200.yaml -> tables/H200.results.jsonl"""
    return table_path.with_name(table_path.name.removesuffix(".yaml") + ".results.jsonl")


def lock_path_for(table_path: Path) -> Path:
    """The lock of the table's results file (results_lock_path): tables/H200.yaml (or
    tables/H200) -> tables/H200.results.jsonl.lock, so two names of one file take one lock."""
    return results_lock_path(results_path_for(table_path))


def results_lock_path(results: Path) -> Path:
    """A results file's lock (either sweep's): its path plus .lock."""
    return results.with_name(results.name + ".lock")


def candidate_key(shape: dict, variant: str) -> tuple[int, int, str]:
    """What resume matches on: the shape and the variant as the backend offered it.

    The sweep adds a calibrated `q_amax` to fp8_static variants before building them, so
    it is dropped here: the offered variant and its recorded form share one key.
    """
    v = Variant.parse(variant)
    offered = Variant.make(v.backend, **{k: x for k, x in v.params if k != "q_amax"})
    return (int(shape["batch"]), int(shape["kv_len"]), str(offered))


def read_json_lines(path: Path, redone: str, fix: str) -> tuple[Iterator[tuple[int, Any]], list[str]]:
    """(the file's JSON values with their line numbers, warnings); blank lines are skipped
    and a missing file has no lines. A name ending in .gz is read through gzip (a results
    file committed for the record is merged from there; a sweep appends only to plain
    files). The readers of both results files use it.

    A last line without its newline is a write cut short by a kill: it is left out with a
    warning that ends in `redone` (what becomes of the record it held); repair_tail cuts it
    off. A line that is not JSON raises ResultsError naming it, its message ending in `fix`
    (what to do). Lines are parsed as the iterator reaches them, so an error the caller
    raises over an earlier line comes first.
    """
    if not path.exists():
        return iter(()), []
    try:
        data = read_maybe_gzipped(path)
    except (OSError, EOFError) as exc:
        raise ResultsError(f"{path}: not a whole gzip file ({exc}); {fix}") from exc
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    warnings = [f"{path}: ignoring a truncated last line ({len(tail)} bytes, a write cut short "
                f"by a kill); {redone}"] if tail else []

    def parsed() -> Iterator[tuple[int, Any]]:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ResultsError(f"{path}, line {number}: not valid JSON ({exc}); the file was damaged "
                                   f"or edited. {fix}") from exc
            yield number, obj

    return parsed(), warnings


RECORD_KINDS = ("candidate", "step", "rung", "note")  # docs/architecture.md, "Results file"


def read_results(path: Path, kinds: tuple[str, ...] = ("candidate",)) -> tuple[dict | None, list[dict], list[str]]:
    """(header, the records of `kinds`, warnings). A missing file gives (None, [], []).

    A last line without its newline is a write cut short by a kill: it is ignored with a
    warning (repair_tail cuts it off). A bad line anywhere else means the file was edited
    or damaged, which resume cannot trust: that raises.
    """
    lines, warnings = read_json_lines(
        path, redone="that candidate will run again",
        fix="Fix or remove that line, or start over with --fresh (moves the file aside)")
    header = None
    records: list[dict] = []
    for number, obj in lines:
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if number == 1:
            if kind != "header":
                raise ResultsError(
                    f"{path}: the first line is not a header; start over with --fresh"
                )
            header = obj
        elif kind not in RECORD_KINDS:
            raise ResultsError(f"{path}, line {number}: unknown record kind {kind!r}")
        else:
            _check_record(obj, kind, path, number)
            if kind in kinds:
                records.append(obj)
    return header, records, warnings


def _check_record(obj: dict, kind: str, path: Path, number: int) -> None:
    """The fields resume and the table read by name: a record without them was edited or
    damaged, and would otherwise surface later as a KeyError deep in the sweep."""
    if kind not in ("candidate", "step", "rung"):
        return
    shape = obj.get("shape")
    ok = isinstance(shape, dict) and all(
        isinstance(shape.get(k), int) and not isinstance(shape.get(k), bool) and shape[k] >= 1
        for k in ("batch", "kv_len"))
    if kind != "rung":
        ok = ok and isinstance(obj.get("variant"), str)
    if not ok:
        raise ResultsError(
            f"{path}, line {number}: a {kind} record without a valid shape"
            + ("" if kind == "rung" else " or variant")
            + "; the file was edited or damaged. Fix or remove that line, or start over with "
            "--fresh (moves the file aside)"
        )


def repair_tail(path: Path) -> bool:
    """Cut a torn last line off, so the next append starts on a fresh line. True if cut."""
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    keep = data.rfind(b"\n") + 1
    with writing(path, RESUME_NOTE), open(path, "r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return True


def move_aside(path: Path) -> Path:
    """Rename path to path.<timestamp>.old (never deleted), returning the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.{stamp}.old")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.{stamp}-{n}.old")
        n += 1
    with writing(target, "nothing was moved; fix that and run again, or drop --fresh to resume"):
        os.replace(path, target)
    return target


class ResultsWriter:
    """Appends lines durably: one write per line, then fsync (fileio.LineLog: a failed
    write leaves no torn line, and an OS failure is a WriteError naming the file and saying
    that re-running resumes)."""

    def __init__(self, path: Path):
        self.path = path
        self._log = LineLog(path, RESUME_NOTE)

    def append(self, obj: dict[str, Any]) -> None:
        self._log.append((json.dumps(obj, sort_keys=True, allow_nan=False) + "\n").encode())

    def close(self) -> None:
        self._log.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class SweepLock:
    """An OS-level lock (fcntl.flock) on the table's lock file, held for the sweep's life,
    so two sweeps never write one table.

    The kernel arbitrates: of two sweeps starting together exactly one gets the flock, and
    the lock dies with its process (kill -9 included), so it is never taken over while its
    holder lives. The holder's pid is written into the file for the refusal message. A file
    naming a dead pid (a sweep killed before it could remove its lock) is taken over with
    a warning; a file naming a live pid whose process holds no flock (a lock from an older
    mla-tune) is refused, since that pid may be a sweep.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.warning: str | None = None
        self._fd: int | None = None

    def acquire(self) -> SweepLock:
        """Take the lock; ResultsError when another sweep holds it, WriteError (one line
        naming the file and the fix) when the folder cannot hold it (read-only, full)."""
        with writing(self.path, "nothing was swept; write the table elsewhere (--out) or fix the folder"):
            return self._acquire()

    def _acquire(self) -> SweepLock:
        import fcntl  # POSIX only: imported here so that reading results works anywhere

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                pid = self._holder(wait_s=1.0)  # the holder writes its pid right after flock
                who = f"another sweep (pid {pid})" if pid else "another sweep (its pid not yet written)"
                raise ResultsError(f"{who} holds the lock {self.path}; wait for it to finish") from None
            if self._same_file(fd):
                break
            os.close(fd)  # a releasing sweep removed the file under us: lock the new one
        pid = self._read_pid(fd)
        if pid is not None and _pid_alive(pid):
            os.close(fd)
            raise ResultsError(
                f"another sweep (pid {pid}) holds the lock {self.path}; wait for it to finish, "
                f"or if pid {pid} is not a sweep, delete {self.path}"
            )
        if pid is not None:
            self.warning = (
                f"taking over a stale lock {self.path} left by pid {pid}, which is no "
                "longer running (a sweep that was killed)"
            )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            os.fsync(fd)
        except OSError:  # a full disk: leave no lock behind that names this live process
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    @staticmethod
    def _read_pid(fd: int) -> int | None:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else None

    def _holder(self, wait_s: float = 0.0) -> int | None:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                text = self.path.read_text().strip()
            except OSError:
                text = ""
            if text.isdigit() or time.monotonic() >= deadline:
                return int(text) if text.isdigit() else None
            time.sleep(0.02)

    def release(self) -> None:
        """Remove the file while still holding the flock, then drop it: a sweep waiting on
        the old file sees it gone (_same_file) and locks a fresh one."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> SweepLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
