"""Where tables and configs are found: one lookup order for the CLI and the runtime.

A table is asked for by path or by GPU name. A GPU name is letters, digits, '-' and '_'
(H200, MI355X); anything else (a Path, or a string with a '/' or a '.') is a path and is
used as given. A name is looked up, first hit wins, in:

1. `$MLA_TUNE_TABLES` (a folder), when set;
2. `./tables` (the working directory's);
3. the packaged copy: `mla_tune/data/tables` in an installed wheel (setup.py copies the
   committed `tables/*.yaml` there at build time), or the checkout's `tables/` when
   mla_tune is imported from a source checkout (an editable install).

`NAME.yaml` is the leaderboard table, `NAME.serving.yaml` the serving table. Configs
(`configs/*.yaml`) ship the same way: a config path that does not exist under `configs/`
falls back to the packaged copy of that file. Folders that are the same directory are
searched once. Nothing here imports torch (`mla-tune show` uses it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENV_TABLES = "MLA_TUNE_TABLES"
# A GPU name becomes a file name (tables/NAME.yaml): letters, digits, '-' and '_' only.
GPU_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_PACKAGE = Path(__file__).resolve().parent


def packaged_dir(kind: str) -> Path | None:
    """The packaged copy of `kind` ("tables" or "configs"): mla_tune/data/<kind> in an
    installed wheel, else the source checkout's <kind>/ (beside pyproject.toml), else None."""
    if kind not in ("tables", "configs"):
        raise ValueError(f"kind must be 'tables' or 'configs', got {kind!r}")
    shipped = _PACKAGE / "data" / kind
    if shipped.is_dir():
        return shipped
    checkout = _PACKAGE.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / kind).is_dir():
        return checkout / kind
    return None


def is_gpu_name(value) -> bool:
    """A str that names a GPU (not a path): letters, digits, '-' and '_' only."""
    return isinstance(value, str) and GPU_NAME.fullmatch(value) is not None


def table_dirs(packaged: Path | None = None) -> list[tuple[str, Path]]:
    """The folders a GPU name is looked up in, in order, as (label, folder); the same
    directory twice is kept once. `packaged` replaces the packaged copy (tests)."""
    found: list[tuple[str, Path]] = []
    env = os.environ.get(ENV_TABLES)
    if env:
        found.append((f"${ENV_TABLES}", Path(env)))
    found.append(("./tables", Path("tables")))
    pkg = packaged if packaged is not None else packaged_dir("tables")
    if pkg is not None:
        found.append(("the packaged tables", Path(pkg)))
    unique, seen = [], set()
    for label, folder in found:
        key = _same(folder)
        if key not in seen:
            seen.add(key)
            unique.append((label, folder))
    return unique


def _same(folder: Path) -> str:
    try:
        return str(folder.resolve())
    except OSError:
        return str(folder.absolute())


def table_file(gpu: str, serving: bool = False) -> str:
    return f"{gpu}.serving.yaml" if serving else f"{gpu}.yaml"


def find_table(gpu: str, serving: bool = False, packaged: Path | None = None) -> Path | None:
    """The first `table_file(gpu, serving)` in `table_dirs()`, or None."""
    name = table_file(gpu, serving)
    for _label, folder in table_dirs(packaged):
        if (folder / name).is_file():
            return folder / name
    return None


def searched_text(gpu: str, serving: bool = False, packaged: Path | None = None) -> str:
    """Where `find_table` looked, for an error: each folder with its label."""
    return ", ".join(f"{label} ({folder})" if label.startswith(("$", "the ")) else label
                     for label, folder in table_dirs(packaged))


def available(serving: bool = False, packaged: Path | None = None) -> list[str]:
    """The GPU names with a table in any searched folder, sorted."""
    suffix = ".serving.yaml" if serving else ".yaml"
    names = set()
    for _label, folder in table_dirs(packaged):
        if folder.is_dir():
            names |= {p.name[: -len(suffix)] for p in folder.glob(f"*{suffix}")
                      if serving or not p.name.endswith(".serving.yaml")}
    return sorted(names)


def table_path(table, serving: bool = False, packaged: Path | None = None) -> Path:
    """A table's file from a path (returned as given) or a GPU name (looked up; a
    TableError naming every folder searched when none has it)."""
    if not is_gpu_name(table):
        if isinstance(table, (str, os.PathLike)):
            return Path(table)
        raise TypeError(f"a table is a path or a GPU name, got {type(table).__name__}")
    found = find_table(table, serving, packaged)
    if found is not None:
        return found
    from mla_tune.tables.table import TableError

    name = table_file(table, serving)
    there = available(serving, packaged)
    make = ("`mla-tune sweep --gpu NAME --config configs/serving.yaml`" if serving
            else "`mla-tune sweep --gpu NAME`")
    raise TableError(f"table {name} does not exist; run {make} on that GPU, or pass the "
                     f"table's path (searched {searched_text(table, serving, packaged)}; "
                     + (f"tables there: {', '.join(there)})" if there else "no tables there)"))


def config_path(path: str | Path) -> Path:
    """A config file: `path` when it exists, else the packaged copy of the same file name
    when `path` is a bare name or lies under a `configs/` folder, else `path` (whose reader
    then says it does not exist)."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    if path.parent in (Path("."), Path("configs")):
        pkg = packaged_dir("configs")
        if pkg is not None and (pkg / path.name).is_file():
            return pkg / path.name
    return path
