"""The append-only results file of a sweep, its resume logic and the lock on its table.

`tables/NAME.results.jsonl` holds one JSON object per line: a header, then one record per
finished candidate (format in docs/architecture.md). Each append is a single write of one
line, then flush and fsync, so a kill -9 loses at most the candidate in flight; a torn last
line (killed mid-write) is dropped with a warning and cut off before the next append.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mla_tune.core import Variant

SCHEMA = 1
STATUSES = ("ok", "rejected", "failed", "crashed", "timeout", "pruned")


class ResultsError(ValueError):
    """A results file or lock that stops the sweep; the message says what to do."""


def results_path_for(table_path: Path) -> Path:
    """tables/H200.yaml -> tables/H200.results.jsonl"""
    return table_path.with_name(table_path.name.removesuffix(".yaml") + ".results.jsonl")


def lock_path_for(table_path: Path) -> Path:
    return table_path.with_name(table_path.name + ".lock")


def candidate_key(shape: dict, variant: str) -> tuple[int, int, str]:
    """What resume matches on: the shape and the variant as the backend offered it.

    The sweep adds a calibrated `q_amax` to fp8_static variants before building them, so
    it is dropped here: the offered variant and its recorded form share one key.
    """
    v = Variant.parse(variant)
    offered = Variant.make(v.backend, **{k: x for k, x in v.params if k != "q_amax"})
    return (int(shape["batch"]), int(shape["kv_len"]), str(offered))


RECORD_KINDS = ("candidate", "step", "rung", "note")  # docs/architecture.md, "Results file"


def read_results(path: Path, kinds: tuple[str, ...] = ("candidate",)) -> tuple[dict | None, list[dict], list[str]]:
    """(header, the records of `kinds`, warnings). A missing file gives (None, [], []).

    A last line without its newline is a write cut short by a kill: it is ignored with a
    warning (repair_tail cuts it off). A bad line anywhere else means the file was edited
    or damaged, which resume cannot trust: that raises.
    """
    if not path.exists():
        return None, [], []
    data = path.read_bytes()
    warnings: list[str] = []
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    if tail:
        warnings.append(
            f"{path}: ignoring a truncated last line ({len(tail)} bytes, a write cut short "
            "by a kill); that candidate will run again"
        )
    header = None
    records: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ResultsError(
                f"{path}, line {number}: not valid JSON ({exc}); the file was damaged or edited. "
                "Fix or remove that line, or start over with --fresh (moves the file aside)"
            ) from exc
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if number == 1:
            if kind != "header":
                raise ResultsError(
                    f"{path}: the first line is not a header; start over with --fresh"
                )
            header = obj
        elif kind in kinds:
            records.append(obj)
        elif kind not in RECORD_KINDS:
            raise ResultsError(f"{path}, line {number}: unknown record kind {kind!r}")
    return header, records, warnings


def repair_tail(path: Path) -> bool:
    """Cut a torn last line off, so the next append starts on a fresh line. True if cut."""
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as f:
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
    os.replace(path, target)
    return target


class ResultsWriter:
    """Appends lines durably: one write per line, then flush and fsync."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")

    def append(self, obj: dict[str, Any]) -> None:
        line = (json.dumps(obj, sort_keys=True, allow_nan=False) + "\n").encode()
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class SweepLock:
    """An O_EXCL lock file holding the sweep's pid, so two sweeps never write one table.

    A lock whose pid is dead (a sweep killed with -9) is taken over with a warning.
    """

    def __init__(self, path: Path):
        self.path = path
        self.warning: str | None = None
        self._held = False

    def acquire(self) -> SweepLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _attempt in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pid = self._holder()
                if pid is not None and _pid_alive(pid):
                    raise ResultsError(
                        f"another sweep (pid {pid}) holds {self.path}; wait for it to finish, "
                        f"or if pid {pid} is not a sweep, delete {self.path}"
                    ) from None
                self.warning = (
                    f"taking over a stale lock {self.path} left by pid {pid}, which is no "
                    "longer running (a sweep that was killed)"
                )
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self._held = True
            return self
        raise ResultsError(f"could not take the lock {self.path}: another sweep took it first")

    def _holder(self) -> int | None:
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def release(self) -> None:
        if self._held and self._holder() == os.getpid():
            os.unlink(self.path)
        self._held = False

    def __enter__(self) -> SweepLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
