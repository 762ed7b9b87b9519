"""The dispatch table: built from sweep results, written atomically, loaded and validated.

A table (`tables/NAME.yaml`) is reviewed, versioned data: one row per benchmarked shape,
sorted by (batch, kv_len), naming the winning variant by its text form plus the evidence
for it (its time and spread, the runner-up, every backend's best, the baseline, the share
of the bandwidth floor, how many candidates were tried and why the rest lost). Loading
never executes anything from the file (yaml.safe_load, then Variant.parse), and every error
names the file, the row and the field, so a hand edit that breaks a row is caught at load.

Schema 1, top level: `schema`, `gpu`, `provenance`, `rows`. A row:

    batch, kv_len            the shape (a uniform batch)
    winner                   {variant, backend, params} or null (then `reason` says why)
    time_us, spread, wall_us the winner's median GPU time, (p90-p10)/median, wall time
    runner_up                {variant, time_us} or null
    backends                 {name: best time_us, or a string such as "all rejected"}
    baseline_us              the torch backend's time (null when it has none)
    floor_us, floor_share    see FLOOR_NOTE; floor_share = floor_us / time_us
    candidates               {tried, ok, rejected, failed, crashed, timeout, pruned}, and
                             from a search with rungs: rung0, rung1, ... (candidates timed
                             at each rung) and dropped (cut by the budget before running)
    calibration              how an fp8_static winner's q_amax was calibrated, else null
    alternates               {backend: {variant, time_us}}: each backend's pick, so an
                             export restricted to some backends can take the best allowed
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mla_tune.backends import get_backend, known_backends
from mla_tune.core import KV_FORMATS, Q_MODES, QK_DIM, Shape, Variant
from mla_tune.fileio import atomic_write_text

SCHEMA_VERSION = 1
STATUSES = ("ok", "rejected", "failed", "crashed", "timeout", "pruned")
# Medians within 1% are a tie: our spread on an H200 is a few percent, so ordering such
# candidates by time would pick by noise and make re-sweeps flip winners for nothing.
TIE_TOLERANCE = 0.01
FLOOR_NOTE = (
    "floor_us counts only the fp8 KV cache (batch * kv_len * 576 bytes, one byte per element) "
    "read once at the measured copy bandwidth; q, the KV scale and the output are not counted"
)
_PROVENANCE_FIELDS = {
    "device_name": str, "arch": str, "driver": str, "versions": dict, "date": str,
    "config": dict, "rule": dict, "protocol": dict, "copy_bandwidth_gbps": (int, float, type(None)),
    "mla_tune_version": str,
}
_ROW_FIELDS = (
    "batch", "kv_len", "winner", "time_us", "spread", "wall_us", "runner_up", "backends",
    "baseline_us", "floor_us", "floor_share", "candidates", "calibration", "alternates",
)


class TableError(ValueError):
    """A table (or the results it is built from) is missing, malformed or inconsistent."""


# ------------------------------------------------------------------------- picking
def _backend_rank(backend: str) -> int:
    order = known_backends()
    return order.index(backend) if backend in order else len(order)


def pick_best(items: Iterable[tuple[float, Variant]]) -> tuple[float, Variant] | None:
    """The fastest (time_us, variant); medians within TIE_TOLERANCE of the fastest tie, and a
    tie goes to the earlier backend in BACKEND_MODULES order, then to the smaller text."""
    items = list(items)
    if not items:
        return None
    best = min(t for t, _ in items)
    tied = [(t, v) for t, v in items if t <= best * (1.0 + TIE_TOLERANCE)]
    return min(tied, key=lambda tv: (_backend_rank(tv[1].backend), str(tv[1]), tv[0]))


# ------------------------------------------------------------------ build from results
def _timing(record: dict, key: str) -> dict | None:
    value = record.get(key)
    return value if isinstance(value, dict) and value.get("median_us") else None


def _backend_summary(records: list[dict], unavailable: str | None) -> str:
    if unavailable:
        return f"unavailable: {unavailable}"
    if not records:
        return "not run"
    counts = {s: sum(r["status"] == s for r in records) for s in STATUSES}
    if counts["rejected"] == len(records):
        return "all rejected"
    return "none ok: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)


def _rung_counts(records: list[dict]) -> dict[str, int]:
    """{rung0: n0, rung1: n1, ...}: candidates timed at each rung of the sweep's successive
    halving (a record's `rung` is the last it reached; cut there, or failed after being
    promoted to it). Empty for results from before the search had rungs."""
    reached = [(int(r["rung"]), r["status"] in ("ok", "pruned")) for r in records
               if isinstance(r.get("rung"), int) and not isinstance(r.get("rung"), bool)]
    if not reached:
        return {}
    top = max(rung for rung, _ in reached)
    return {f"rung{k}": sum(1 for rung, timed in reached if rung > k or (rung == k and timed))
            for k in range(top + 1)}


def _row(shape: Shape, records: list[dict], backends: list[str], unavailable: dict,
         bandwidth_gbps: float | None) -> dict:
    ok = [(r, _timing(r, "time")) for r in records if r["status"] == "ok"]
    ok = [(r, t) for r, t in ok if t is not None]
    by_text = {r["variant"]: (r, t) for r, t in ok}
    parsed = [(t["median_us"], Variant.parse(r["variant"])) for r, t in ok]

    summary: dict[str, Any] = {}
    alternates: dict[str, dict] = {}
    for backend in backends:
        mine = [(t, v) for t, v in parsed if v.backend == backend]
        pick = pick_best(mine)
        if pick:
            summary[backend] = round(float(min(t for t, _ in mine)), 3)
            alternates[backend] = {"variant": str(pick[1]), "time_us": round(float(pick[0]), 3)}
        else:
            summary[backend] = _backend_summary(
                [r for r in records if r["backend"] == backend], unavailable.get(backend))

    counts = {"tried": len(records)}
    counts.update({s: sum(r["status"] == s for r in records) for s in STATUSES})
    counts.update(_rung_counts(records))
    # What is counted is said in FLOOR_NOTE (and in the file's header comment).
    floor_us = (shape.total_kv * QK_DIM / (bandwidth_gbps * 1e3)) if bandwidth_gbps else None
    baseline = summary.get("torch")
    row: dict[str, Any] = {"batch": shape.batch, "kv_len": shape.kv_len}
    winner = pick_best(parsed)
    if winner is None:
        reasons = "; ".join(f"{b}: {s}" for b, s in summary.items()) or "no candidates ran"
        row.update(winner=None, reason=f"no candidate passed the gate and was timed ({reasons})")
        row.update({k: None for k in ("time_us", "spread", "wall_us", "runner_up")})
        row.update(backends=summary, baseline_us=baseline if isinstance(baseline, float) else None,
                   floor_us=None if floor_us is None else round(floor_us, 3), floor_share=None,
                   candidates=counts, calibration=None, alternates={})
        return row
    time_us, variant = float(winner[0]), winner[1]
    record, timing = by_text[str(variant)]
    p10, p90 = timing.get("p10_us"), timing.get("p90_us")
    rest = [(t, v) for t, v in parsed if v != variant]
    runner = min(rest, key=lambda tv: (tv[0], str(tv[1]))) if rest else None
    wall = _timing(record, "wall")
    calibration = None
    if variant.get("q") == "fp8_static":
        calibration = dict(record.get("calibration") or {})
        calibration.setdefault("q_amax", variant.get("q_amax"))
    row.update(
        winner={"variant": str(variant), "backend": variant.backend, "params": variant.p},
        time_us=round(time_us, 3),
        spread=round((p90 - p10) / time_us, 4) if _is_number(p10) and _is_number(p90) else None,
        wall_us=round(wall["median_us"], 3) if wall else None,
        runner_up={"variant": str(runner[1]), "time_us": round(float(runner[0]), 3)} if runner else None,
        backends=summary,
        baseline_us=baseline if isinstance(baseline, float) else None,
        floor_us=None if floor_us is None else round(floor_us, 3),
        floor_share=None if floor_us is None else round(floor_us / time_us, 4),
        candidates=counts,
        calibration=calibration,
        alternates=alternates,
    )
    return row


def table_from_results(header: dict, records: list[dict], config) -> dict:
    """Build the table dict from a results header, its candidate records and the config.

    Every config shape gets a row (winner null with a reason when nothing passed); a record
    for a shape outside the config, or results made with another config hash, is an error.
    A variant recorded twice (a resumed sweep) counts once: the later record wins.
    """
    if not header.get("gpu"):
        raise TableError("the results header names no gpu; the results file is damaged, "
                         "re-run `mla-tune sweep --fresh`")
    made_with = (header.get("config") or {}).get("hash")
    if made_with and made_with != config.hash:
        raise TableError(
            f"the results were made with config hash {made_with}, but {config.path} now hashes "
            f"to {config.hash}; re-run `mla-tune sweep --fresh` or restore the original config")
    shapes = list(config.shapes)
    latest: dict[Shape, dict[str, dict]] = {s: {} for s in shapes}
    for index, record in enumerate(records):
        if record.get("kind", "candidate") != "candidate":
            continue
        try:
            shape = Shape(int(record["shape"]["batch"]), int(record["shape"]["kv_len"]))
            status, text, backend = record["status"], record["variant"], record["backend"]
        except (KeyError, TypeError, ValueError) as exc:
            raise TableError(f"results record {index + 1} is malformed ({exc!r}); "
                             "it needs shape {batch, kv_len}, variant, backend, status") from exc
        if status not in STATUSES:
            raise TableError(f"results record {index + 1} has unknown status {status!r}; "
                             f"known: {', '.join(STATUSES)}")
        if shape not in latest:
            raise TableError(f"results record {index + 1} is for shape {shape}, which config "
                             f"{config.path} does not list; use the config the sweep ran with")
        try:
            parsed = Variant.parse(text)
        except ValueError as exc:
            raise TableError(f"results record {index + 1}: {exc}") from exc
        if parsed.backend != backend:
            raise TableError(f"results record {index + 1}: variant {text} is not of backend {backend}")
        latest[shape][text] = record
    unavailable = dict(header.get("unavailable") or {})
    named = set(unavailable) | set((config.raw or {}).get("backends") or {})
    named |= {r["backend"] for by_text in latest.values() for r in by_text.values()}
    backends = sorted(named, key=lambda b: (_backend_rank(b), b))
    bandwidth = header.get("copy_bandwidth_gbps")
    rows = [_row(s, list(latest[s].values()), backends, unavailable, bandwidth)
            for s in sorted(shapes, key=lambda s: (s.batch, s.kv_len))]
    dropped = ((header.get("search") or {}).get("dropped")) or {}
    for row in rows:
        if dropped:
            row["candidates"]["dropped"] = len(dropped.get(f"{row['batch']}x{row['kv_len']}", []))
    platform = header.get("platform") or {}
    provenance = {
        "device_name": str(platform.get("device_name", "")),
        "arch": str(platform.get("arch", "")),
        "driver": str(platform.get("driver", "")),
        "versions": {str(k): str(v) for k, v in (platform.get("versions") or {}).items()},
        "date": str(header.get("date", "")),
        "config": {"path": str(config.path), "hash": str(config.hash)},
        "rule": config.rule.as_dict(),
        "protocol": dict(header.get("protocol") or {}),
        "copy_bandwidth_gbps": bandwidth,
        "mla_tune_version": str(header.get("mla_tune_version", "")),
    }
    return {"schema": SCHEMA_VERSION, "gpu": str(header["gpu"]), "provenance": provenance,
            "rows": rows}


# ----------------------------------------------------------------------------- write
def _header_comment(table: dict) -> str:
    return (
        f"# mla-tune dispatch table for {table.get('gpu')}, generated by `mla-tune sweep`.\n"
        "# Reviewed, versioned data: diff it in review; regenerate it rather than hand-edit it\n"
        "# (a hand edit is validated at load, and nothing in it is ever executed).\n"
        f"# {FLOOR_NOTE}.\n"
    )


def write_table(path: str | Path, table: dict) -> Path:
    """Write the table as YAML atomically (temp file in the same folder, fsync, rename)."""
    text = _header_comment(table) + yaml.safe_dump(table, sort_keys=False, width=100)
    return atomic_write_text(path, text)


# ------------------------------------------------------------------------------ load
@dataclass(frozen=True)
class Table:
    """A loaded, validated table. `rows` maps each Shape to its row dict as in the file."""

    gpu: str
    provenance: dict
    rows: dict[Shape, dict] = field(default_factory=dict)
    path: Path | None = None

    def lookup(self, shape: Shape) -> dict | None:
        return self.rows.get(shape)

    def variants(self, only_backends: Iterable[str] | None = None) -> dict[Shape, Variant]:
        """Each row's winner; with only_backends, each row's best allowed alternate instead
        (rows with none are left out, so the caller's fallback serves them)."""
        allowed = None if only_backends is None else set(only_backends)
        out: dict[Shape, Variant] = {}
        for shape, row in self.rows.items():
            if row["winner"] is None:
                continue
            winner = Variant.parse(row["winner"]["variant"])
            if allowed is None or winner.backend in allowed:
                out[shape] = winner
                continue
            pick = pick_best((alt["time_us"], Variant.parse(alt["variant"]))
                             for b, alt in row["alternates"].items() if b in allowed)
            if pick:
                out[shape] = pick[1]
        return out


def _where(path: Path, index: int | None = None, row: Any = None) -> str:
    if index is None:
        return f"table {path}"
    if isinstance(row, dict) and "batch" in row and "kv_len" in row:
        return f"table {path}, row {index} (batch {row['batch']}, kv_len {row['kv_len']})"
    return f"table {path}, row {index}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_variant(where: str, field_name: str, value: Any, known: list[str]) -> Variant:
    if not isinstance(value, dict) or not isinstance(value.get("variant"), str):
        raise TableError(f"{where}: {field_name} must be a mapping with a `variant` text")
    try:
        variant = Variant.parse(value["variant"])
    except ValueError as exc:
        raise TableError(f"{where}: {field_name}.variant: {exc}") from exc
    if variant.backend not in known:
        raise TableError(f"{where}: {field_name}.variant names unknown backend "
                         f"{variant.backend!r}; known backends: {', '.join(known)}")
    if variant.get("kv") not in KV_FORMATS or variant.get("q") not in Q_MODES:
        raise TableError(f"{where}: {field_name}.variant {variant} must carry kv (one of "
                         f"{', '.join(KV_FORMATS)}) and q (one of {', '.join(Q_MODES)})")
    # The backend's own parameter rules (names and values, no device, no vendor import).
    # A backend module that cannot be imported here (its torch or triton missing), or a
    # plugin backend without validate(), leaves its variants to be checked at build time.
    try:
        validate = getattr(get_backend(variant.backend), "validate", None)
    except ImportError:
        validate = None
    if validate is not None:
        try:
            validate(variant)
        except ValueError as exc:
            raise TableError(f"{where}: {field_name}.variant: {exc}") from exc
    return variant


def _check_row(path: Path, index: int, row: Any, known: list[str]) -> Shape:
    where = _where(path, index, row)
    if not isinstance(row, dict):
        raise TableError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    missing = [f for f in _ROW_FIELDS if f not in row]
    if missing:
        raise TableError(f"{where}: missing field(s) {', '.join(missing)}; regenerate the table")
    try:
        shape = Shape(row["batch"], row["kv_len"])
    except ValueError as exc:
        raise TableError(f"{where}: {exc}") from exc
    winner = row["winner"]
    if winner is None:
        if not isinstance(row.get("reason"), str):
            raise TableError(f"{where}: winner is null, so field `reason` must say why")
    else:
        variant = _check_variant(where, "winner", winner, known)
        if winner.get("backend") != variant.backend:
            raise TableError(f"{where}: winner.backend {winner.get('backend')!r} disagrees with "
                             f"winner.variant {variant}")
        params = winner.get("params")
        if not isinstance(params, dict) or params != variant.p:
            raise TableError(f"{where}: winner.params {params!r} disagrees with winner.variant "
                             f"{variant}; fix one so both say the same")
        if not _is_number(row["time_us"]) or row["time_us"] <= 0:
            raise TableError(f"{where}: time_us must be a positive number, got {row['time_us']!r}")
    for name in ("spread", "wall_us", "baseline_us", "floor_us", "floor_share"):
        if row[name] is not None and not _is_number(row[name]):
            raise TableError(f"{where}: {name} must be a number or null, got {row[name]!r}")
    if row["runner_up"] is not None:
        _check_variant(where, "runner_up", row["runner_up"], known)
    if not isinstance(row["backends"], dict):
        raise TableError(f"{where}: backends must be a mapping of backend name to time or reason")
    for name, value in row["backends"].items():
        if name not in known:
            raise TableError(f"{where}: backends names unknown backend {name!r}; "
                             f"known backends: {', '.join(known)}")
        if not (_is_number(value) or isinstance(value, str)):
            raise TableError(f"{where}: backends.{name} must be a time or a reason, got {value!r}")
    counts = row["candidates"]
    if not isinstance(counts, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()):
        raise TableError(f"{where}: candidates must map tried/ok/rejected/... to counts")
    if not isinstance(row["alternates"], dict):
        raise TableError(f"{where}: alternates must be a mapping of backend to {{variant, time_us}}")
    for name, alt in row["alternates"].items():
        variant = _check_variant(where, f"alternates.{name}", alt, known)
        if variant.backend != name:
            raise TableError(f"{where}: alternates.{name} holds a {variant.backend} variant")
        if not _is_number(alt.get("time_us")):
            raise TableError(f"{where}: alternates.{name}.time_us must be a number")
    return shape


def load_table(path: str | Path) -> Table:
    """Read and validate a table file; every error names the file, row and field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise TableError(f"table {path} does not exist; run `mla-tune sweep --gpu NAME` to make "
                         "one, or pass the path of an existing table") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TableError(f"table {path} is not valid YAML: {exc}") from exc
    where = _where(path)
    if not isinstance(data, dict):
        raise TableError(f"{where}: the top level must be a mapping with schema, gpu, provenance, rows")
    if data.get("schema") != SCHEMA_VERSION:
        raise TableError(f"{where}: schema is {data.get('schema')!r}, this mla-tune reads schema "
                         f"{SCHEMA_VERSION}; regenerate it with `mla-tune sweep`")
    if not isinstance(data.get("gpu"), str) or not data["gpu"]:
        raise TableError(f"{where}: field `gpu` must name the GPU (e.g. H200)")
    provenance = data.get("provenance")
    if not isinstance(provenance, dict):
        raise TableError(f"{where}: field `provenance` must be a mapping")
    for name, kind in _PROVENANCE_FIELDS.items():
        if name not in provenance or not isinstance(provenance[name], kind):
            raise TableError(f"{where}: provenance.{name} is missing or of the wrong type "
                             f"(got {provenance.get(name)!r})")
    if not isinstance(data.get("rows"), list):
        raise TableError(f"{where}: field `rows` must be a list")
    known = known_backends()
    rows: dict[Shape, dict] = {}
    for index, row in enumerate(data["rows"], start=1):
        shape = _check_row(path, index, row, known)
        if shape in rows:
            raise TableError(f"{_where(path, index, row)}: a second row for this shape; keep one")
        rows[shape] = row
    return Table(gpu=data["gpu"], provenance=provenance, rows=rows, path=path)
