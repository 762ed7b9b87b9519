"""Tiny fake backends for the sweep's tests (CPU, fast), registered through
MLA_TUNE_EXTRA_BACKENDS so that spawned worker processes find them too."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import yaml

FAKES = ("fake_ok", "fake_wrong", "fake_raise", "fake_crash", "fake_hang", "fake_nogpu", "fake_poison",
         "fake_oom")
EXTRA_BACKENDS = ",".join(f"{name}=tests.fakes.{name}" for name in FAKES)


def ensure_table_module() -> None:
    """Use mla_tune.table when it exists; until then a stand-in with the same two
    functions, so the sweep's tests do not wait on it."""
    try:
        import mla_tune.table  # noqa: F401
        return
    except ModuleNotFoundError as exc:
        if exc.name != "mla_tune.table":
            raise

    def table_from_results(header: dict, records: list[dict], config) -> dict:
        rows = {}
        for r in records:
            if r["status"] != "ok":
                continue
            key = f"{r['shape']['batch']}x{r['shape']['kv_len']}"
            if key not in rows or r["time"]["median_us"] < rows[key]["median_us"]:
                rows[key] = {"variant": r["variant"], "median_us": r["time"]["median_us"]}
        return {"gpu": header["gpu"], "config": header["config"]["hash"], "rows": rows}

    def write_table(path, table: dict) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(yaml.safe_dump(table, sort_keys=True))
        os.replace(tmp, path)

    stub = types.ModuleType("mla_tune.table")
    stub.table_from_results = table_from_results
    stub.write_table = write_table
    sys.modules["mla_tune.table"] = stub
