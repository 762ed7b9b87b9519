"""Reads and validates a serving-sweep config (configs/serving.yaml).

A serving config names the call families to tune (the product of its KV formats, page
sizes, head counts and q_lens; each family is one exact key of the serving table), the
call flags every family shares (mixed q_len, lengths on the host, CUDA graphs), the batch
and kv buckets, the rules that leave cells out, the correctness gate's probes, the search,
the budget, and one serving search space per backend. Only the safe YAML loader reads it;
every error names the file and the field (`backends.triton.mma_rows`), so a typo costs one
run. The hash is taken over the parsed content (tune/config.py's config_hash): comments
and formatting do not change it, any value that changes the sweep does.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_tune import gpu
from mla_tune.backends import capabilities, get_backend, known_backends
from mla_tune.core import SEED_RANGE, CallSpec, Variant
from mla_tune.errors import MlaTuneError
from mla_tune.fileio import read_yaml
from mla_tune.problem import Rule, get_rule
from mla_tune.serving.table import FamilyKey
from mla_tune.tune.config import check_space_rules, config_hash, expand_space

TOP_LEVEL = {"name", "description", "rule", "check_seeds", "families", "call", "batch_buckets",
             "kv_buckets", "left_out", "gate", "search", "budget_s", "gate_workers", "backends"}
REQUIRED = ("name", "rule", "check_seeds", "families", "batch_buckets", "kv_buckets", "gate",
            "search", "backends")
FAMILY_FIELDS = ("kv_format", "page_size", "heads", "q_len")
CALL_FIELDS = {"mixed_q_len", "host_lengths", "graph"}
GATE_FIELDS = {"ragged_kv_lens", "tail_kv_len", "tail_batch", "margin", "reference_q"}
REFERENCE_Q = ("exact", "variant")
SEARCH_FIELDS = {"rungs", "keep", "min_keep", "cross_top"}
SEARCH_OPTIONAL = {"cell_lengths", "batch_edge", "step_layers"}
STEP_LAYERS_MAX = 64
CELL_LENGTHS = ("aligned", "spread")  # sweep.cell_kv_lens
LEFT_OUT_CONDITIONS = ("max_kv_bytes", "max_tokens")
LEFT_OUT_MATCH = ("kv_format", "heads", "q_len", "page_size")
CONFIG_MAX_BYTES = 1 << 20
# Bytes per cached token of each serving KV format (576 values of 2 or 1 bytes; the fp8
# cache's per-tensor scale is negligible).
KV_BYTES_PER_TOKEN = {"bf16": 2 * 576, "fp8": 576}


class ServingConfigError(MlaTuneError, ValueError):
    """A serving config that cannot be swept; the message names the file and the field."""


@dataclass(frozen=True)
class CallFlags:
    """What every family's calls share (CallSpec's flags): mixed_q_len (None: q_len > 1),
    host_lengths (the caller passes lengths on the host: backends that plan there may
    serve), graph (the calls are captured in CUDA graphs)."""

    mixed_q_len: bool | None = None
    host_lengths: bool = True
    graph: bool = True


@dataclass(frozen=True)
class GateSpec:
    """The correctness gate, once per (family, candidate): a ragged probe (these kv lengths,
    q_len cycling 1..max_q_len where the family mixes them) on check_seeds[0], and a
    uniform probe of tail_batch sequences of tail_kv_len tokens on check_seeds[1]; each
    must keep its failing share under margin x the rule's allowance, against the fp32
    reference with bf16 q (reference_q exact) or q quantized as the candidate's q mode
    (variant; gate.reference_q_format)."""

    ragged_kv_lens: tuple[int, ...]
    tail_kv_len: int
    tail_batch: int
    margin: float
    seeds: tuple[int, int]
    reference_q: str = "exact"


@dataclass(frozen=True)
class ServingSearch:
    """Successive halving per cell: every gated candidate gets rungs[0] samples, each later
    rung keeps the best `keep` fraction (at least min_keep, plus the neighbours' winners,
    never cut before the last rung); per batch bucket, the union of each kv cell's best
    `cross_top` is timed at every kv cell of the bucket (rungs[-1] samples) for its
    CUDA-graph pick. `cell_lengths` says which lengths a (batch, kv) cell is timed on
    (sweep.cell_kv_lens): `aligned`, every sequence at the bucket's length, or
    `spread`, the batch's lengths spread over the lengths the bucket serves. `batch_edge`:
    the union of the bucket's kv cells' best `cross_top` is also timed at every kv cell at
    the smallest batch the bucket serves (the bucket below plus one: cells.edge_batch), and
    a cell's eager pick weighs that edge beside the cell (build.eager_pick). `step_layers`
    N > 0: every time (the sweep's, verify's, calibrate's, `time points`') is a layer's in a decode step
    of N layers back to back (serving/measure.LayeredStep: the step's shared work once, each
    layer its own KV copy, the L2 flushed before the step), an engine's step, where 0 (the
    default) times one flushed call (docs/perf.md 2.7)."""

    rungs: tuple[int, ...]
    keep: float
    min_keep: int
    cross_top: int
    cell_lengths: str = "aligned"
    batch_edge: bool = False
    step_layers: int = 0


@dataclass(frozen=True)
class LeftOutRule:
    """Cells left out of the sweep: those over `limit` (KV bytes of one layer's cache, or
    batch x kv_len tokens) in the families it matches (empty: all), with why."""

    condition: str  # one of LEFT_OUT_CONDITIONS
    limit: int
    why: str
    match: tuple[tuple[str, tuple], ...] = ()

    def applies(self, key: FamilyKey, batch: int, kv_len: int) -> bool:
        if any(getattr(key, name) not in values for name, values in self.match):
            return False
        tokens = batch * kv_len
        size = tokens * KV_BYTES_PER_TOKEN[key.kv_format] if self.condition == "max_kv_bytes" else tokens
        return size > self.limit

    def reason(self, key: FamilyKey, batch: int, kv_len: int) -> str:
        size = batch * kv_len * (KV_BYTES_PER_TOKEN[key.kv_format] if self.condition == "max_kv_bytes" else 1)
        unit = "bytes of KV" if self.condition == "max_kv_bytes" else "tokens"
        return f"left out by rule: {size} {unit} > {self.condition} {self.limit} ({self.why})"


@dataclass(frozen=True)
class ServingConfig:
    name: str
    path: Path
    hash: str
    rule: Rule
    families: tuple[FamilyKey, ...]
    call: CallFlags
    batch_buckets: tuple[int, ...]
    kv_buckets: tuple[int, ...]
    left_out: tuple[LeftOutRule, ...]
    gate: GateSpec
    search: ServingSearch
    budget_s: float | None
    gate_workers: int
    backends: dict[str, list[dict]]  # name -> its space as plain grids (expand_space)
    raw: dict

    def spec(self, key: FamilyKey) -> CallSpec:
        """The CallSpec a family's candidates are built and gated for."""
        mixed = key.q_len > 1 if self.call.mixed_q_len is None else self.call.mixed_q_len
        return CallSpec(key.kv_format, key.page_size, key.heads, key.q_len, mixed_q_len=mixed,
                        graph=self.call.graph, host_lengths=self.call.host_lengths)

    def left_out_reason(self, key: FamilyKey, batch: int, kv_len: int) -> str | None:
        for rule in self.left_out:
            if rule.applies(key, batch, kv_len):
                return rule.reason(key, batch, kv_len)
        return None


def load_serving_config(path: str | Path) -> ServingConfig:
    """Read and validate a serving config; raises ServingConfigError naming file and field."""
    path = Path(path)
    raw = read_yaml(path, "serving config", ServingConfigError, max_bytes=CONFIG_MAX_BYTES,
                    missing_hint="pass the path of a serving config, e.g. configs/serving.yaml")
    return serving_config_from_dict(raw, path)


def is_serving_config(path: str | Path) -> bool:
    """Whether `path` reads as a serving config (it has `families`, or the serving grid's
    `batch_buckets` or `kv_buckets`, so that a misspelt `families` is named by the serving
    config's own message), so that `mla-tune sweep --config` can hand it to the serving
    sweep; a file that does not read is left to the caller's own loader and its message."""
    try:
        raw = read_yaml(Path(path), "config", ServingConfigError, max_bytes=CONFIG_MAX_BYTES)
    except ServingConfigError:
        return False
    return isinstance(raw, dict) and bool({"families", "batch_buckets", "kv_buckets"} & set(raw))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def serving_config_from_dict(raw: Any, path: str | Path = "<serving config>",
                             platform_name: str = "H200") -> ServingConfig:
    """Validate an already-parsed serving config (see load_serving_config). Each backend's
    space is tried on every family for `platform_name` (its candidates must exist and be
    valid), so a bad value fails here, not in the sweep."""
    path = Path(path)

    def fail(field: str, message: str) -> ServingConfigError:
        return ServingConfigError(f"{path}: field '{field}': {message}")

    if not isinstance(raw, dict):
        raise ServingConfigError(f"{path}: a serving config must be a YAML mapping, got {type(raw).__name__}")
    unknown = sorted(map(str, set(raw) - TOP_LEVEL))
    if unknown:
        raise fail(unknown[0], f"unknown field; known fields: {', '.join(sorted(TOP_LEVEL))}")
    for name in REQUIRED:
        if name not in raw:
            raise fail(name, "missing (required)")
    if not isinstance(raw["name"], str) or not raw["name"].strip():
        raise fail("name", f"must be a non-empty string, got {raw['name']!r}")
    try:
        rule = get_rule(raw["rule"]) if isinstance(raw["rule"], str) else None
    except ValueError as exc:
        raise fail("rule", str(exc)) from exc
    if rule is None:
        raise fail("rule", f"must be a rule name (strict, leaderboard), got {raw['rule']!r}")
    seeds = raw["check_seeds"]
    if not (isinstance(seeds, list) and len(seeds) == 2 and all(_int(s) for s in seeds) and seeds[0] != seeds[1]
            and all(SEED_RANGE[0] <= s <= SEED_RANGE[1] for s in seeds)):
        raise fail("check_seeds", f"must be two distinct integers from {SEED_RANGE[0]} to {SEED_RANGE[1]} "
                   f"(the ragged probe's seed, the tail probe's), got {seeds!r}")
    families = _families(raw["families"], fail)
    call = _call(raw.get("call"), fail)
    batch_buckets = _buckets(raw["batch_buckets"], "batch_buckets", fail)
    kv_buckets = _buckets(raw["kv_buckets"], "kv_buckets", fail)
    budget = raw.get("budget_s")
    if budget is not None and not (_number(budget) and budget > 0):
        raise fail("budget_s", f"must be a positive number of seconds, got {budget!r}")
    workers = raw.get("gate_workers", 0)
    if not (_int(workers) and 0 <= workers <= 64):
        raise fail("gate_workers", f"must be an integer 0..64 (0: gate in the sweep's own process), got {workers!r}")
    cfg = ServingConfig(
        name=raw["name"], path=path, hash=config_hash(raw), rule=rule, families=families,
        call=call, batch_buckets=batch_buckets, kv_buckets=kv_buckets,
        left_out=_left_out(raw.get("left_out"), families, fail), gate=_gate(raw["gate"], tuple(seeds), fail),
        search=_search(raw["search"], fail), budget_s=float(budget) if budget is not None else None,
        gate_workers=workers, backends=_backends(raw["backends"], fail), raw=raw,
    )
    _check_spaces(cfg, platform_name, fail)
    return cfg


def _families(value: Any, fail) -> tuple[FamilyKey, ...]:
    if not isinstance(value, dict) or set(value) != set(FAMILY_FIELDS):
        raise fail("families", f"must be a mapping of exactly {', '.join(FAMILY_FIELDS)} to lists "
                   "(the families are their product)")
    lists = []
    for name in FAMILY_FIELDS:
        items = value[name]
        if not isinstance(items, list) or not items or len(set(map(str, items))) != len(items):
            raise fail(f"families.{name}", f"must be a non-empty list without repeats, got {items!r}")
        lists.append(items)
    keys = []
    for kv_format, page_size, heads, q_len in itertools.product(*lists):
        try:
            keys.append(FamilyKey.of(CallSpec(kv_format, page_size, heads, q_len)))
        except (ValueError, TypeError) as exc:
            raise fail("families", f"{kv_format}, page {page_size}, {heads} heads, q_len {q_len}: {exc}") from None
        if kv_format not in KV_BYTES_PER_TOKEN:
            raise fail("families.kv_format", f"the serving call reads {', '.join(KV_BYTES_PER_TOKEN)} KV, "
                       f"not {kv_format}")
    return tuple(keys)


def _call(value: Any, fail) -> CallFlags:
    if value is None:
        return CallFlags()
    if not isinstance(value, dict) or set(value) - CALL_FIELDS:
        raise fail("call", f"must be a mapping with some of {', '.join(sorted(CALL_FIELDS))}")
    for name, flag in value.items():
        if not isinstance(flag, bool):
            raise fail(f"call.{name}", f"must be true or false, got {flag!r}")
    return CallFlags(value.get("mixed_q_len"), value.get("host_lengths", True), value.get("graph", True))


def _buckets(value: Any, field: str, fail) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value or not all(_int(v) and v >= 1 for v in value)
            or value != sorted(set(value))):
        raise fail(field, f"must be a non-empty increasing list of positive integers, got {value!r}")
    return tuple(value)


def _left_out(value: Any, families: tuple[FamilyKey, ...], fail) -> tuple[LeftOutRule, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise fail("left_out", "must be a list of rules, each {max_kv_bytes or max_tokens: N, why: text}")
    rules = []
    for i, item in enumerate(value):
        where = f"left_out[{i}]"
        if not isinstance(item, dict):
            raise fail(where, f"must be a mapping, got {item!r}")
        unknown = sorted(set(item) - {*LEFT_OUT_CONDITIONS, *LEFT_OUT_MATCH, "why"})
        if unknown:
            raise fail(f"{where}.{unknown[0]}", f"unknown field; known: {', '.join((*LEFT_OUT_CONDITIONS, *LEFT_OUT_MATCH, 'why'))}")
        conditions = [c for c in LEFT_OUT_CONDITIONS if c in item]
        if len(conditions) != 1:
            raise fail(where, f"needs exactly one of {', '.join(LEFT_OUT_CONDITIONS)}")
        limit = item[conditions[0]]
        if not (_int(limit) and limit >= 1):
            raise fail(f"{where}.{conditions[0]}", f"must be a positive integer, got {limit!r}")
        why = item.get("why")
        if not isinstance(why, str) or not why.strip():
            raise fail(f"{where}.why", "must say why these cells are left out (the table records it)")
        match = []
        for name in LEFT_OUT_MATCH:
            if name in item:
                values = item[name] if isinstance(item[name], list) else [item[name]]
                known = sorted({getattr(key, name) for key in families}, key=str)
                stray = [v for v in values if v not in known]
                if stray or not values:
                    raise fail(f"{where}.{name}", f"{stray[0] if stray else values!r} matches no family; the "
                               f"families' {name}: {', '.join(map(str, known))}")
                match.append((name, tuple(values)))
        rules.append(LeftOutRule(conditions[0], limit, " ".join(why.split()), tuple(match)))
    return tuple(rules)


def _gate(value: Any, seeds: tuple[int, int], fail) -> GateSpec:
    if not isinstance(value, dict) or set(value) != GATE_FIELDS:
        raise fail("gate", f"must be a mapping of exactly {', '.join(sorted(GATE_FIELDS))}")
    lens = value["ragged_kv_lens"]
    if not (isinstance(lens, list) and len(lens) >= 2 and all(_int(n) and n >= 1 for n in lens)):
        raise fail("gate.ragged_kv_lens", f"must be a list of at least two positive lengths, got {lens!r}")
    for name in ("tail_kv_len", "tail_batch"):
        if not (_int(value[name]) and value[name] >= 1):
            raise fail(f"gate.{name}", f"must be a positive integer, got {value[name]!r}")
    margin = value["margin"]
    if not (_number(margin) and 0 < margin <= 1):
        raise fail("gate.margin", f"must be a fraction in (0, 1] of the rule's allowance (the "
                   f"leaderboard sweep's gate uses 0.5), got {margin!r}")
    reference_q = value["reference_q"]
    if reference_q not in REFERENCE_Q:
        raise fail("gate.reference_q", f"must be exact (bf16 q: the exact answer) or variant (q quantized "
                   f"as the candidate's q mode), got {reference_q!r}")
    return GateSpec(tuple(lens), value["tail_kv_len"], value["tail_batch"], float(margin), seeds, reference_q)


def _search(value: Any, fail) -> ServingSearch:
    if not isinstance(value, dict) or not SEARCH_FIELDS <= set(value) <= SEARCH_FIELDS | SEARCH_OPTIONAL:
        raise fail("search", f"must be a mapping of {', '.join(sorted(SEARCH_FIELDS))} and optionally "
                   f"{', '.join(sorted(SEARCH_OPTIONAL))}")
    cell_lengths = value.get("cell_lengths", ServingSearch.cell_lengths)
    if cell_lengths not in CELL_LENGTHS:
        raise fail("search.cell_lengths", f"must be one of {', '.join(CELL_LENGTHS)}, got {cell_lengths!r}")
    rungs = value["rungs"]
    if (not isinstance(rungs, list) or not rungs or not all(_int(r) and 1 <= r <= 10_000 for r in rungs)
            or rungs != sorted(set(rungs))):
        raise fail("search.rungs", f"must be an increasing list of sample counts, e.g. [5, 12, 30], got {rungs!r}")
    keep = value["keep"]
    if not (_number(keep) and 0 < keep <= 1):
        raise fail("search.keep", f"must be a fraction in (0, 1], got {keep!r}")
    for name in ("min_keep", "cross_top"):
        if not (_int(value[name]) and value[name] >= 1):
            raise fail(f"search.{name}", f"must be an integer >= 1, got {value[name]!r}")
    batch_edge = value.get("batch_edge", ServingSearch.batch_edge)
    if not isinstance(batch_edge, bool):
        raise fail("search.batch_edge", f"must be true or false, got {batch_edge!r}")
    step_layers = value.get("step_layers", ServingSearch.step_layers)
    if not (_int(step_layers) and 0 <= step_layers <= STEP_LAYERS_MAX):
        raise fail("search.step_layers", f"must be an integer 0..{STEP_LAYERS_MAX} (layers of a decode step "
                   f"each time is a layer of; 0: one flushed call), got {step_layers!r}")
    return ServingSearch(tuple(rungs), float(keep), value["min_keep"], value["cross_top"], cell_lengths,
                         batch_edge, step_layers)


def _backends(value: Any, fail) -> dict[str, list[dict]]:
    if not isinstance(value, dict) or not value:
        raise fail("backends", "must be a non-empty mapping of backend name -> serving search space")
    known = known_backends()
    spaces = {}
    for name, space in value.items():
        where = f"backends.{name}"
        if name not in known:
            raise fail(where, f"unknown backend {name!r}; known backends: {', '.join(known)}")
        if not capabilities(name).serving:
            raise fail(where, f"backend {name} has no serving call (its CAPABILITIES.serving is false)")
        space = {} if space is None else space
        if not isinstance(space, dict):
            raise fail(where, f"must be a mapping (the serving search space), got {space!r}")
        grids = space.get("grids")
        if grids is not None and (not isinstance(grids, list) or not grids
                                  or not all(isinstance(g, dict) for g in grids)):
            raise fail(f"{where}.grids", "must be a non-empty list of mappings (sub-grids)")
        # values no variant may carry (max_splits: [0]) fail here, as in a sweep config
        check_space_rules(name, [(where, space)] + [(f"{where}.grids[{i}]", g) for i, g in enumerate(grids or [])],
                          fail)
        spaces[name] = expand_space(space)
    return spaces


def _check_spaces(cfg: ServingConfig, platform_name: str, fail) -> None:
    """Each backend's space, tried on every family for the planned GPU: serving_candidates
    judges its keys and values (ValueError naming them). A backend without
    serving_candidates takes its default serving variant and no space at all."""
    platform = gpu.fake_platform(platform_name)
    for name, grids in cfg.backends.items():
        module = get_backend(name)
        offer = getattr(module, "serving_candidates", None)
        if offer is None:
            if any(grid for grid in grids):
                raise fail(f"backends.{name}", f"backend {name} has no serving_candidates: it takes "
                           "its default serving variant per family, so its section must be empty ({})")
            continue
        for key in cfg.families:
            for grid in grids:
                try:
                    variants = offer(cfg.spec(key), dict(grid), platform)
                except ValueError as exc:
                    raise fail(f"backends.{name}", " ".join(str(exc).split())) from None
                if not all(isinstance(v, Variant) and v.get("kv") == key.kv_format for v in variants):
                    raise fail(f"backends.{name}", f"serving_candidates offered a variant not of "
                               f"{key.kv_format} KV for {key}")
