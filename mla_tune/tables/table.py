"""The dispatch table: built from sweep results, written atomically, loaded and validated.

A table (`tables/NAME.yaml`) is reviewed, versioned data: one row per benchmarked shape,
sorted by (batch, kv_len), naming the winning variant by its text form plus the evidence
for it (its time and spread, the runner-up, every backend's best, the baseline, the share
of the bandwidth floor, how many candidates were tried and why the rest lost). Loading
never executes anything from the file (fileio.read_yaml: a safe loader that refuses YAML
aliases, on a file of at most 16 MB; then Variant.parse), and every error names the file, the
row and the field, so a hand edit that breaks a row is caught at load.

Schema 1, top level: `schema`, `gpu`, `provenance`, `rows`; `provenance.row_count` (written
since 2026-12-05, optional at load) must equal the rows held. A row is a `Row` (below, the one
definition of its fields). Every variant is checked against its backend's parameter rules
as data (backends/params.py: names, choices, bounds), which import no torch; the backends'
whole validate() (which adds the rules over several parameters: the fused family's
combinations, a Gluon tile's shared memory, AITER's kernel pairs) runs too unless
`check_params=False` (show, diff), and only then are the backend modules imported.
A row's `candidates` counts {tried, ok, rejected, failed, crashed, timeout, pruned} and, from
a search with rungs, rung0, rung1, ... (candidates timed at each rung), dropped (cut by
the budget before running) and skipped (left untimed at rung 0 by the running clock).

A prior (`provenance.kind: prior`, e.g. configs/priors/MI355X.yaml) is a table of choices made
without measuring, for a GPU nobody has swept yet: every row has a winner, no `time_us`, and a
`prior` mapping whose `source` says where the choice came from; show and the export say so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mla_tune.backends import baseline_backend, get_backend, known_backends
from mla_tune.backends.params import check_variant_rules, param_rules
from mla_tune.core import KV_FORMATS, Q_MODES, QK_DIM, Shape, Variant
from mla_tune.errors import MlaTuneError
from mla_tune.fileio import WriteError, atomic_write_text, dump_yaml, read_yaml

SCHEMA_VERSION = 1
# A results record's status (tune/results.py writes them; a row counts each).
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


class TableError(MlaTuneError, ValueError):
    """A table (or the results it is built from) is missing, malformed or inconsistent."""


# A table whose provenance.kind is this holds choices that were never measured (a prior).
PRIOR_KIND = "prior"


def is_prior(provenance: Any) -> bool:
    """Whether a table's provenance marks it as a prior (untuned, no times)."""
    return isinstance(provenance, dict) and provenance.get("kind") == PRIOR_KIND


# ------------------------------------------------------------------------- the row type
def _kind(kind: str, **more) -> dict:
    return {"kind": kind, **more}


@dataclass(frozen=True)
class Row:
    """One row of a table, field for field as in the file.

    Every field after `winner` has a default, so a table written before a field existed
    still loads (the field takes its default); a field added later must get one too.
    `kind` in each field's metadata drives the generic type check at load: "number?" is a
    finite number or null, "text?" a string or null, "mapping" / "mapping?" a mapping (or
    null); "variant?" a {variant, ...} mapping or null, checked like a variant.
    """

    batch: int
    kv_len: int
    # {variant, backend, params} of the fastest candidate that passed the gate, or null
    winner: dict | None = field(metadata=_kind("variant?"))
    reason: str | None = field(default=None, metadata=_kind("text?"))  # why winner is null
    time_us: float | None = field(default=None, metadata=_kind("number?"))  # winner's median
    spread: float | None = field(default=None, metadata=_kind("number?"))  # (p90-p10)/median
    wall_us: float | None = field(default=None, metadata=_kind("number?"))  # host wall time
    runner_up: dict | None = field(default=None, metadata=_kind("variant?"))  # {variant, time_us}
    # {backend: its best time_us, or a reason such as "all rejected"}
    backends: dict = field(default_factory=dict, metadata=_kind("mapping"))
    baseline_us: float | None = field(default=None, metadata=_kind("number?"))  # the baseline backend's time
    floor_us: float | None = field(default=None, metadata=_kind("number?"))  # see FLOOR_NOTE
    floor_share: float | None = field(default=None, metadata=_kind("number?"))  # floor/time
    # {tried, ok, rejected, failed, crashed, timeout, pruned} counts; other keys are kept
    candidates: dict = field(default_factory=dict, metadata=_kind("mapping"))
    calibration: dict | None = field(default=None, metadata=_kind("mapping?"))  # fp8_static q_amax
    # {backend: {variant, time_us}}: each backend's pick, for an export limited to some backends
    alternates: dict = field(default_factory=dict, metadata=_kind("mapping"))
    # a prior's rows only: {source, note} saying where the unmeasured winner came from
    prior: dict | None = field(default=None, metadata=_kind("mapping?"))

    @property
    def shape(self) -> Shape:
        return Shape(self.batch, self.kv_len)

    @property
    def winner_variant(self) -> Variant | None:
        return None if self.winner is None else Variant.parse(self.winner["variant"])

    def __getitem__(self, name: str) -> Any:
        # Callers that read a row as the file's mapping (row["winner"]) keep working.
        if name not in ROW_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def as_dict(self) -> dict:
        """The row as written to the file (`reason` only when there is no winner, `prior`
        only in a prior's rows)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.winner is not None and self.reason is None:
            del out["reason"]
        if self.prior is None:
            del out["prior"]
        return out


ROW_FIELDS = tuple(f.name for f in fields(Row))
_REQUIRED_FIELDS = ("batch", "kv_len", "winner")


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
         bandwidth_gbps: float | None, baseline_name: str) -> Row:
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
    baseline = summary.get(baseline_name)
    common = dict(batch=shape.batch, kv_len=shape.kv_len, backends=summary,
                  baseline_us=baseline if isinstance(baseline, float) else None,
                  floor_us=None if floor_us is None else round(floor_us, 3), candidates=counts)
    winner = pick_best(parsed)
    if winner is None:
        reasons = "; ".join(f"{b}: {s}" for b, s in summary.items()) or "no candidates ran"
        return Row(winner=None, reason=f"no candidate passed the gate and was timed ({reasons})",
                   **common)
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
    return Row(
        winner={"variant": str(variant), "backend": variant.backend, "params": variant.p},
        time_us=round(time_us, 3),
        spread=round((p90 - p10) / time_us, 4) if _is_number(p10) and _is_number(p90) else None,
        wall_us=round(wall["median_us"], 3) if wall else None,
        runner_up={"variant": str(runner[1]), "time_us": round(float(runner[0]), 3)} if runner else None,
        floor_share=None if floor_us is None else round(floor_us / time_us, 4),
        calibration=calibration,
        alternates=alternates,
        **common,
    )


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
    baseline_name = baseline_backend()
    rows = [_row(s, list(latest[s].values()), backends, unavailable, bandwidth, baseline_name).as_dict()
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
        "row_count": len(rows),  # above the rows in the file: a file cut between rows is caught at load
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
    """Write the table as YAML atomically (temp file in the same folder, fsync, rename). A
    failure is a WriteError that also says the sweep's results keep every step."""
    try:
        return atomic_write_text(path, _header_comment(table) + dump_yaml(table))
    except WriteError as exc:
        raise WriteError(f"{exc}; the results file keeps every step, so re-running the same "
                         "command writes the table without timing anything again") from exc


# ------------------------------------------------------------------------------ load
@dataclass(frozen=True)
class Table:
    """A loaded, validated table. `rows` maps each Shape to its Row."""

    gpu: str
    provenance: dict
    rows: dict[Shape, Row] = field(default_factory=dict)
    path: Path | None = None

    @property
    def is_prior(self) -> bool:
        """True for a prior: choices never measured (see the module docstring)."""
        return is_prior(self.provenance)

    def variants(self, only_backends: Iterable[str] | None = None) -> dict[Shape, Variant]:
        """Each row's winner; with only_backends, each row's best allowed alternate instead
        (rows with none are left out, so the caller's fallback serves them)."""
        allowed = None if only_backends is None else set(only_backends)
        out: dict[Shape, Variant] = {}
        for shape, row in self.rows.items():
            winner = row.winner_variant
            if winner is None:
                continue
            if allowed is None or winner.backend in allowed:
                out[shape] = winner
                continue
            pick = pick_best((alt["time_us"], Variant.parse(alt["variant"]))
                             for b, alt in row.alternates.items() if b in allowed)
            if pick:
                out[shape] = pick[1]
        return out

    def as_dict(self) -> dict:
        """The table as in the file (schema, gpu, provenance, rows), e.g. for `--json`."""
        return {"schema": SCHEMA_VERSION, "gpu": self.gpu, "provenance": self.provenance,
                "rows": [row.as_dict() for _, row in sorted(self.rows.items())]}


def _where(path: Path, index: int | None = None, row: Any = None) -> str:
    if index is None:
        return f"table {path}"
    if isinstance(row, dict) and "batch" in row and "kv_len" in row:
        return f"table {path}, row {index} (batch {row['batch']!r:.20}, kv_len {row['kv_len']!r:.20})"
    return f"table {path}, row {index}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_variant_field(where: str, field_name: str, value: Any, known: list[str],
                        check_params: bool) -> Variant:
    """The Variant of a table entry's `{variant: text}` field, checked: it parses, names a
    known backend, carries kv and q, and (check_params) passes its backend's rules; any
    failure is a TableError naming `where` and `field_name`. The serving table uses it too."""
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
    # The backends' parameter rules as data (names, choices, bounds; backends/params.py,
    # no torch): the same messages validate() gives, for show and diff too.
    rules = param_rules(variant.backend)
    if rules is not None:
        try:
            check_variant_rules(variant, rules)
        except ValueError as exc:
            raise TableError(f"{where}: {field_name}.variant: {exc}") from exc
    if not check_params:
        return variant
    # The backend's whole validate() (adds the rules that compute over several parameters).
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


def _check_kinds(where: str, row: dict) -> None:
    """The generic type check, from each Row field's `kind`."""
    for f in fields(Row):
        kind = f.metadata.get("kind")
        value = row.get(f.name)
        if kind is None or f.name not in row or (value is None and kind.endswith("?")):
            continue
        if kind.startswith("number") and not _is_number(value):
            raise TableError(f"{where}: {f.name} must be a finite number or null, got {value!r:.60}")
        if kind.startswith("text") and not isinstance(value, str):
            raise TableError(f"{where}: {f.name} must be text or null, got {value!r:.60}")
        if kind.startswith("mapping") and not isinstance(value, dict):
            raise TableError(f"{where}: {f.name} must be a mapping, got {value!r:.60}")


def _check_row(path: Path, index: int, row: Any, known: list[str], check_params: bool,
               prior: bool = False) -> Row:
    where = _where(path, index, row)
    if not isinstance(row, dict):
        raise TableError(f"{where}: a row must be a mapping, got {type(row).__name__}")
    missing = [f for f in _REQUIRED_FIELDS if f not in row]
    if missing:
        raise TableError(f"{where}: missing field(s) {', '.join(missing)}; regenerate the table")
    unknown = [str(k) for k in row if k not in ROW_FIELDS]
    if unknown:
        raise TableError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(ROW_FIELDS)} (a table from a newer mla-tune? upgrade)")
    try:
        Shape(row["batch"], row["kv_len"])
    except ValueError as exc:
        raise TableError(f"{where}: {exc}") from exc
    _check_kinds(where, row)
    winner = row["winner"]
    if winner is None:
        if not isinstance(row.get("reason"), str):
            raise TableError(f"{where}: winner is null, so field `reason` must say why")
    else:
        variant = check_variant_field(where, "winner", winner, known, check_params)
        if winner.get("backend") != variant.backend:
            raise TableError(f"{where}: winner.backend {winner.get('backend')!r} disagrees with "
                             f"winner.variant {variant}")
        params = winner.get("params")
        if not isinstance(params, dict) or params != variant.p:
            raise TableError(f"{where}: winner.params {params!r:.200} disagrees with winner.variant "
                             f"{variant}; fix one so both say the same")
        if prior:
            _check_prior_row(where, row)
        elif not _is_number(row.get("time_us")) or row["time_us"] <= 0:
            raise TableError(f"{where}: time_us must be a positive number, got {row.get('time_us')!r}")
    if not prior and row.get("prior") is not None:
        raise TableError(f"{where}: field `prior` belongs in a prior's rows (provenance.kind: "
                         f"{PRIOR_KIND}); a measured row has none, so remove it")
    if row.get("runner_up") is not None:
        check_variant_field(where, "runner_up", row["runner_up"], known, check_params)
    for name, value in row.get("backends", {}).items():
        if name not in known:
            raise TableError(f"{where}: backends names unknown backend {name!r}; "
                             f"known backends: {', '.join(known)}")
        if not (_is_number(value) or isinstance(value, str)):
            raise TableError(f"{where}: backends.{name} must be a time or a reason, got {value!r:.60}")
    counts = row.get("candidates", {})
    for name in ("tried", *STATUSES):  # other keys (added by later sweeps) are kept unchecked
        value = counts.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TableError(f"{where}: candidates.{name} must be a count, got {value!r:.60}")
    for name, alt in row.get("alternates", {}).items():
        variant = check_variant_field(where, f"alternates.{name}", alt, known, check_params)
        if variant.backend != name:
            raise TableError(f"{where}: alternates.{name} holds a {variant.backend} variant")
        if not _is_number(alt.get("time_us")):
            raise TableError(f"{where}: alternates.{name}.time_us must be a number")
    return Row(**row)


def _check_prior_row(where: str, row: dict) -> None:
    """A prior's row: a winner chosen without measuring, so no times, and its source."""
    measured = [name for name in ("time_us", "spread", "wall_us", "baseline_us", "floor_share", "runner_up")
                if row.get(name) is not None] + (["alternates"] if row.get("alternates") else [])
    if measured:
        raise TableError(f"{where}: a prior's row holds no measurements, but it has {', '.join(measured)}; "
                         "remove them, or sweep the GPU for a measured table")
    source = (row.get("prior") or {}).get("source")
    if not isinstance(source, str) or not source:
        raise TableError(f"{where}: a prior's row needs `prior: {{source: ...}}` saying where its "
                         "winner came from")


def load_table(path: str | Path, check_params: bool = True) -> Table:
    """Read and validate a table file; every error names the file, row and field.

    Every variant is checked against its backend's parameter rules as data (names, choices,
    bounds: backends/params.py), with the messages the backends' validate() gives. With
    check_params=False the backends' validate() itself is not run: it needs the backend
    modules, which import torch (`mla-tune show` and `diff` read tables this way, and miss
    only the rules over several parameters; the runtime and the export check everything).
    """
    path = Path(path)
    data = read_yaml(path, "table", TableError)
    where = _where(path)
    if not isinstance(data, dict):
        raise TableError(f"{where}: the top level must be a mapping with schema, gpu, provenance, rows")
    if isinstance(data.get("schema"), str) and data["schema"].startswith("serving/"):
        raise TableError(f"{where}: a serving table ({data['schema']}), not a leaderboard table (per-shape "
                         "winners): the leaderboard runtime, export and report take tables/NAME.yaml; a "
                         "DecodePlan runs a serving table, and show, diff and verify read one")
    if data.get("schema") != SCHEMA_VERSION:
        raise TableError(f"{where}: schema is {data.get('schema')!r:.40}, this mla-tune reads schema "
                         f"{SCHEMA_VERSION}; regenerate it with `mla-tune sweep`")
    if not isinstance(data.get("gpu"), str) or not data["gpu"]:
        raise TableError(f"{where}: field `gpu` must name the GPU (e.g. H200)")
    provenance = data.get("provenance")
    if not isinstance(provenance, dict):
        raise TableError(f"{where}: field `provenance` must be a mapping")
    for name, kind in _PROVENANCE_FIELDS.items():
        if name not in provenance or not isinstance(provenance[name], kind):
            raise TableError(f"{where}: provenance.{name} is missing or of the wrong type "
                             f"(got {provenance.get(name)!r:.60})")
    if not isinstance(data.get("rows"), list):
        raise TableError(f"{where}: field `rows` must be a list")
    known = known_backends()
    rows: dict[Shape, Row] = {}
    prior = is_prior(provenance)
    for index, raw in enumerate(data["rows"], start=1):
        row = _check_row(path, index, raw, known, check_params, prior)
        if row.shape in rows:
            raise TableError(f"{_where(path, index, raw)}: a second row for this shape; keep one")
        rows[row.shape] = row
    stated = provenance.get("row_count")
    if stated is not None and (isinstance(stated, bool) or stated != len(data["rows"])):
        raise TableError(f"{where}: holds {len(data['rows'])} rows, but its provenance.row_count says "
                         f"{stated!r:.20}: the file was cut short or rows were removed; restore it (git) or "
                         "write it again with `mla-tune sweep` (its results file keeps every step)")
    return Table(gpu=data["gpu"], provenance=provenance, rows=rows, path=path)
