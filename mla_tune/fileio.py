"""Files: written so that a reader never sees half of one, YAML read within bounds, and
records read plain or gzipped."""

from __future__ import annotations

import contextlib
import errno
import gzip
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from mla_tune.errors import MlaTuneError

# A real table is tens of KB (the H200's is 20 KB); anything near this is not one, and
# reading it whole, or printing its strings, would hang `show`.
MAX_YAML_BYTES = 16 * 1024 * 1024


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
    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())

    return atomic_write_with(path, write)


def write_error(path: str | Path, exc: OSError, note: str = "") -> WriteError:
    """The one-line WriteError for an OS failure writing `path`: the file, what happened and
    the fix, then `note` (what became of the work so far, how to go on)."""
    reason = exc.strerror or str(exc)
    fix = _FIXES.get(exc.errno, "check the path and try again")
    return WriteError(f"cannot write {path}: {reason}; {fix}" + (f"; {note}" if note else ""))


@contextlib.contextmanager
def writing(path: str | Path, note: str = "") -> Iterator[None]:
    """Turn any OSError inside the block into write_error(path, exc, note)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as exc:
        raise write_error(path, exc, note) from exc


def atomic_write_with(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """atomic_write_text for a writer that takes a file name (a plot's savefig): `write(tmp)`
    fills a temp file in the same folder (named with `path`'s suffix, which savefig reads),
    which is then renamed to `path`, so a crash, a full disk or a failed write leaves the old
    file or the new one, never a partial one nor a temp file. The mode is atomic_write_text's;
    OS failures are WriteErrors."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise write_error(path, exc) from exc
    try:
        write(Path(tmp))
        os.chmod(tmp, mode)  # mkstemp made it 0600, and a rename keeps the mode
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_error(path, exc) from exc
        raise
    _fsync_dir(path.parent)
    return path


class LineLog:
    """An append-only file of lines (a sweep's results), each line written whole or not at
    all: one os.write loop per line, fsynced when `durable`; a write that fails (a full
    disk) is cut back off the file, so no torn line is left for the next append to follow.
    Every OS failure, opening included, is a WriteError naming the file, the fix and `note`
    (for a results file: that what is recorded is kept and re-running resumes)."""

    def __init__(self, path: str | Path, note: str = ""):
        self.path, self.note = Path(path), note
        with writing(self.path, note):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)

    def append(self, data: bytes, durable: bool = True) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        start = None
        try:
            start = os.fstat(self._fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            if durable:
                os.fsync(self._fd)
        except OSError as exc:
            if start is not None:
                try:
                    os.ftruncate(self._fd, start)  # no torn line behind
                except OSError:
                    pass
            raise write_error(self.path, exc, self.note) from exc

    def sync(self) -> None:
        if self._fd is not None:
            with writing(self.path, self.note):
                os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            except OSError:
                pass  # every line was fsynced or reported when it was appended
            os.close(fd)


# ------------------------------------------------------------------------------ YAML
class _NoAliasDumper(yaml.SafeDumper):
    """Writes a value that appears twice in full both times, so what mla-tune writes has no
    YAML aliases and read_yaml can refuse every alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class FlowMap(dict):
    """A mapping dump_yaml writes on one line ({a: 1, b: 2}); it reads back as a dict."""


_NoAliasDumper.add_representer(
    FlowMap, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True))


def read_maybe_gzipped(path: str | Path) -> bytes:
    """The file's bytes, through gzip where its name ends in .gz (records committed for the
    record are gzipped); OSError or EOFError where it is missing or not a whole gzip file."""
    path = Path(path)
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


def dump_yaml(data: Any) -> str:
    """YAML text for data (safe types only, keys in their order, no aliases)."""
    return yaml.dump(data, Dumper=_NoAliasDumper, sort_keys=False, width=100)


def _alias_message(event) -> str:
    return (f"line {event.start_mark.line + 1}: a YAML alias (*{event.anchor}); mla-tune never "
            "writes aliases, so write the value out in full")


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load that refuses YAML aliases: mla-tune never writes them, and a few KB of
    nested aliases (an "alias bomb") stand for billions of values, so anything that walks
    what was loaded (a check, an error message, `show`) would hang."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(_alias_message(event))
        return super().compose_node(parent, index)


def _safe_load_without_aliases(text: str) -> Any:
    fast = getattr(yaml, "CSafeLoader", None)  # libyaml: about 70 times faster on big files
    if fast is None:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader subclass)
    for event in yaml.parse(text, Loader=fast):  # events only: no alias is expanded here
        if isinstance(event, yaml.AliasEvent):
            raise yaml.YAMLError(_alias_message(event))
    return yaml.load(text, Loader=fast)  # noqa: S506 (the safe loader, in C)


def read_yaml(path: Path, what: str, error: type[MlaTuneError],
              max_bytes: int = MAX_YAML_BYTES,
              missing_hint: str = "run `mla-tune sweep --gpu NAME` to make one, or pass the "
                                  "path of an existing file") -> Any:
    """Parse a YAML file mla-tune reads (a table, say `what`): a regular file of at most
    max_bytes, without aliases, with the safe loader; every failure is one `error`
    naming the file."""
    try:
        info = path.stat()
    except FileNotFoundError as exc:
        raise error(f"{what} {path} does not exist; {missing_hint}") from exc
    except OSError as exc:  # a symlink loop, a path through a file, no permission
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}; pass a readable file") from exc
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{what} {path} is a directory; pass the path of a .yaml file")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what} {path} is not a regular file; pass the path of a .yaml file")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}; pass a readable file") from exc
    if len(raw) > max_bytes:
        raise error(f"{what} {path} is over {max_bytes} bytes, far larger than any "
                    f"{what}; pass the right file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        return _safe_load_without_aliases(text)
    except yaml.YAMLError as exc:
        raise error(f"{what} {path} is not valid YAML: {' '.join(str(exc).split())}") from exc
