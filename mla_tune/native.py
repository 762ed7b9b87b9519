"""Small C helpers for host-time-critical loops, compiled on first use with the system's C
compiler and loaded with ctypes (as Triton builds its launchers).

`load(name, source)` compiles `source` once per machine into
$MLA_TUNE_CACHE/native/NAME-HASH.so (default ~/.cache/mla-tune/native; the hash is the
source's and the compiler's), written atomically, and returns the ctypes library, or
None where it cannot: no C compiler (`$CC`, else cc or gcc on PATH), a compile error (one
warning), or $MLA_TUNE_NO_NATIVE set. A caller then runs its Python path, which must give
the same results: the C code is compiled without fast-math and without floating-point
contraction, so its double arithmetic is IEEE's, operation by operation, as numpy's is.
Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

CACHE_ENV = "MLA_TUNE_CACHE"
DISABLE_ENV = "MLA_TUNE_NO_NATIVE"
FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=c99")

_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    """$MLA_TUNE_CACHE/native, else ~/.cache/mla-tune/native."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "mla-tune") / "native"


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def address(array) -> int:
    """The address of a C-contiguous numpy array's first element, for a C helper (the
    cheapest way ctypes offers; a read-only array takes numpy's own)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):
        return array.ctypes.data


def load(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled `source` (see the module), or None: the caller's Python path runs."""
    if os.environ.get(DISABLE_ENV):
        return None
    cc = compiler()
    key = f"{name}\0{cc}\0{' '.join(FLAGS)}\0{source}"
    if key in _loaded:
        return _loaded[key]
    lib = None
    if cc is not None:
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        path = cache_dir() / f"{name}-{digest}.so"
        try:
            if not path.exists():
                _build(cc, source, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            warnings.warn(f"mla_tune.native: cannot build {name} with {cc} ({' '.join(str(exc).split())[:200]}); "
                          "the Python path runs instead (same results, more host time)", stacklevel=3)
    _loaded[key] = lib
    return lib


def _build(cc: str, source: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "src.c", Path(tmp) / "lib.so"
        src.write_text(source, encoding="utf-8")
        done = subprocess.run([cc, *FLAGS, "-o", str(out), str(src)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"exit {done.returncode}: {(done.stderr or done.stdout).strip()}")
        os.replace(out, path)  # atomic: a concurrent builder of the same source writes the same bytes
