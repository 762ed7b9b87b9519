"""The runtime: load this GPU's table, check its provenance, dispatch decode calls.

`load()` finds `tables/<gpu>.yaml` (or takes a path), refuses a table tuned on another GPU
unless told otherwise, warns when the software versions differ from the ones the table
was tuned with, and wires a Dispatcher to the backends the table names. Nothing here
times anything: the choice was made offline by `mla-tune sweep`. See docs/runtime.md.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_tune.backends import get_backend
from mla_tune.backends.aiter_mla import aiter_drift_note
from mla_tune.core import Shape, Variant, require
from mla_tune.dispatch import Dispatcher
from mla_tune.gpu import Platform, detect
from mla_tune.table import Table, TableError, load_table

TABLES_DIR = Path(__file__).resolve().parent.parent / "tables"
# Versions whose change can move kernel timings or behaviour; python's cannot.
VERSION_FIELDS = ("torch", "triton", "cuda", "hip", "amd-aiter", "amd-aiter-commit", "flashinfer-python",
                  "sgl-flash-mla")
DEFAULT_SM_COUNT = 132  # an H200's; only shapes the fallback's split count when none is known


class GpuMismatchError(ValueError):
    """The table was tuned on another GPU than the one this process runs on."""


def backend_unavailable(name: str) -> str | None:
    """Why backend `name` cannot run here (None when it can); a missing module is a reason."""
    try:
        module = get_backend(name)
    except ModuleNotFoundError as exc:
        return f"its module cannot be imported ({exc})"
    return module.unavailable_reason()


def fallback_policy(sm_count: int = DEFAULT_SM_COUNT,
                    allowed: Iterable[str] | None = None) -> tuple[str, Callable[[Shape], Variant]]:
    """(backend, shape -> Variant) for shapes the table lacks and for ragged batches.

    The triton backend's `default_variant` when triton may be used and runs here (it is
    correct for every kv_len >= 1 and reads kv_indptr per sequence); otherwise the torch
    baseline's variant, which serves uniform batches only (the Dispatcher refuses a ragged
    batch for it with a clear error rather than computing a wrong answer).
    """
    allowed = None if allowed is None else set(allowed)
    if allowed is None or "triton" in allowed:
        reason = backend_unavailable("triton")
        if reason is None:
            module = get_backend("triton")
            if hasattr(module, "default_variant"):
                return "triton", functools.partial(module.default_variant,
                                                   sm_count=sm_count or DEFAULT_SM_COUNT)
    if allowed is not None and "torch" not in allowed:
        raise ValueError(f"the fallback needs the triton or the torch backend, but only "
                         f"{', '.join(sorted(allowed))} are allowed; allow one of them")
    torch_variant = get_backend("torch").candidates(Shape(1, 1), {}, None)[0]
    return "torch", lambda shape: torch_variant


def _warn_versions(table: Table, platform: Platform) -> None:
    tuned = table.provenance.get("versions") or {}
    here = platform.versions or {}
    for name in VERSION_FIELDS:
        if name in tuned and tuned[name] != here.get(name):
            now = here.get(name) or "not installed"
            # AITER's kernel binaries changed at some releases only: say whether they differ
            note = aiter_drift_note(tuned[name], here.get(name)) if name == "amd-aiter" else ""
            warnings.warn(
                f"table {table.path}: provenance.versions.{name} is {tuned[name]} but this "
                f"process has {now}; {note}timings may have moved, re-run `mla-tune sweep --gpu "
                f"{table.gpu}` to refresh the table", stacklevel=3)


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@dataclass
class Runtime:
    """A loaded table wired to its backends: `decode()` and the leaderboard's `custom_kernel`."""

    table: Table
    platform: Platform
    dispatcher: Dispatcher
    fallback_backend: str
    device: torch.device | None = None

    def decode(self, q, kv_data, qo_indptr, kv_indptr, kv_len: int | None = None,
               check_indptr: bool = True):
        """MLA decode: (batch, 16, 512) bf16. The result is the runner's reused buffer: copy
        it to keep it past the next call of the same shape."""
        if self.device is not None:
            require(isinstance(q, torch.Tensor) and _same_device(q.device, self.device),
                    f"q must be on {self.device}, the device this runtime was loaded for, got "
                    f"{getattr(q, 'device', type(q).__name__)}")
        return self.dispatcher(q, kv_data, qo_indptr, kv_indptr, kv_len=kv_len,
                               check_indptr=check_indptr)

    def custom_kernel(self, data):
        """The leaderboard's entry: data = (q, kv_data, qo_indptr, kv_indptr, config). Trusts
        config["kv_seq_len"] for a uniform batch, so it never syncs the device."""
        require(isinstance(data, (tuple, list)) and len(data) == 5,
                "data must be (q, kv_data, qo_indptr, kv_indptr, config)")
        q, kv_data, qo_indptr, kv_indptr, config = data
        require(isinstance(config, dict) and "kv_seq_len" in config,
                'config must be a dict with "kv_seq_len"')
        if "batch_size" in config and hasattr(q, "shape"):
            require(config["batch_size"] == q.shape[0],
                    f'config["batch_size"] is {config["batch_size"]} but q holds {q.shape[0]} queries')
        return self.decode(q, kv_data, qo_indptr, kv_indptr, kv_len=config["kv_seq_len"],
                           check_indptr=False)


def load(gpu: str | None = None, table: str | Path | None = None, allow_other_gpu: bool = False,
         device=None) -> Runtime:
    """Load the table for `gpu` (default: this GPU) from tables/, or the table at `table`."""
    dev = torch.device(device) if device is not None else None
    platform = detect(dev.index if dev is not None and dev.type == "cuda" else None)
    path = Path(table) if table is not None else TABLES_DIR / f"{gpu or platform.name}.yaml"
    loaded = load_table(path)
    if gpu is not None and loaded.gpu != gpu:
        raise TableError(f"table {path} was made for {loaded.gpu}, not {gpu}; pass the table "
                         f"for {gpu} or drop gpu=")
    if loaded.gpu != platform.name and not allow_other_gpu:
        raise GpuMismatchError(
            f"table {path} was tuned on {loaded.gpu} but this process runs on {platform.name}; "
            f"tune this GPU with `mla-tune sweep --gpu {platform.name}`, or pass "
            "allow_other_gpu=True to use it anyway")
    _warn_versions(loaded, platform)

    named = {Variant.parse(r["winner"]["variant"]).backend for r in loaded.rows.values() if r["winner"]}
    named |= {b for r in loaded.rows.values() for b in r["alternates"]}
    reasons = {name: backend_unavailable(name) for name in sorted(named)}
    available = [name for name, reason in reasons.items() if reason is None]
    variants = loaded.variants(only_backends=available)
    moved = [s for s, r in loaded.rows.items()
             if r["winner"] and reasons.get(r["winner"]["backend"]) is not None]
    if moved:
        warnings.warn(
            f"table {path}: the winners of {', '.join(map(str, sorted(moved)))} use backends "
            "that cannot run here ("
            + "; ".join(f"{n}: {r}" for n, r in reasons.items() if r) +
            "); those shapes run their best available alternate or the fallback", stacklevel=2)
    fallback_backend, fallback = fallback_policy(platform.sm_count)
    builders = {name: get_backend(name).build
                for name in {v.backend for v in variants.values()} | {fallback_backend}}
    dispatcher = Dispatcher({(s.batch, s.kv_len): v for s, v in variants.items()}, builders, fallback)
    return Runtime(loaded, platform, dispatcher, fallback_backend, dev)


@functools.lru_cache(maxsize=1)
def default_runtime() -> Runtime:
    """The runtime for this process's GPU, loaded once on first use."""
    return load()


def custom_kernel(data):
    """The leaderboard's entry point, backed by tables/<this GPU>.yaml."""
    return default_runtime().custom_kernel(data)
