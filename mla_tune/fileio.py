"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from mla_tune.errors import MlaTuneError


class WriteError(MlaTuneError, OSError):
    """A file could not be written (a directory in the way, no permission, a full disk)."""


_FIXES = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EACCES: "write somewhere you may write, or fix the folder's permissions",
    errno.EPERM: "write somewhere you may write, or fix the folder's permissions",
    errno.EROFS: "the file system is read-only; write elsewhere",
    errno.EISDIR: "name a file, not a directory",
    errno.ENOTDIR: "a part of the path is a file, not a directory; fix the path",
}


def _umask() -> int:
    """The process's umask without changing it (os.umask sets it, racing other threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    # The rename is durable only once the directory entry is; not every OS can open a folder.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temp file in the same folder, fsync, then rename:
    a crash leaves the old file or the new one, never a torn one.

    The new file gets the mode a plain `open(path, "w")` would give it (0666 less the
    umask), or keeps the mode of the file it replaces. Any OS failure (a directory at
    `path`, a read-only folder, a full disk) is a WriteError with one line naming the fix,
    and leaves no temp file behind.
    """
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _write_error(path, exc) from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)  # mkstemp made it 0600, and a rename keeps the mode
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from exc
        raise
    _fsync_dir(path.parent)
    return path


def _write_error(path: Path, exc: OSError) -> WriteError:
    reason = exc.strerror or str(exc)
    fix = _FIXES.get(exc.errno, "check the path and try again")
    return WriteError(f"cannot write {path}: {reason}; {fix}")
