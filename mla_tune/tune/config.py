"""Reads and validates a sweep config (configs/*.yaml).

A config names the shapes to tune, the correctness rule, the seeds the gate checks on, the
timing effort, and one search-space section per backend. Only `yaml.safe_load` reads it and
nothing in it is executed. Every error names the file and the field, so a typo costs one
run, not a sweep. The config hash is taken over the parsed content in canonical JSON, so
comments, key order and formatting do not change it, while any value that changes what the
sweep does does.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_tune import gpu
from mla_tune.backends import capabilities, get_backend, known_backends
from mla_tune.backends.params import check_space_value, param_rules
from mla_tune.core import SEED_RANGE, Shape
from mla_tune.errors import MlaTuneError
from mla_tune.fileio import read_yaml
from mla_tune.problem import Rule, get_rule
from mla_tune.tune.calibration import CalibrationSpec, parse_calibration

TOP_LEVEL_FIELDS = {
    "name", "description", "rule", "check_seeds", "calibration_seeds", "timing", "budget_s",
    "shapes", "backends", "candidate_timeout_s", "purpose", "calibration", "search",
}
TIMING_FIELDS = {"reps", "prune_reps", "prune_factor"}
# Keys every backend section may hold besides the backend's own SPACE_KEYS.
SECTION_FIELDS = ("precompile", "grids")
CONFIG_MAX_BYTES = 1 << 20  # configs are hand-written: a few KB
# Where a backend's search space is tried at load time, so a bad value fails before a sweep.
_PROBE_SHAPE = Shape(4, 1024)
_PROBE_GPUS = ("H200", "MI355X")


class ConfigError(MlaTuneError, ValueError):
    """A config file that cannot be swept; the message names the file and the field."""


@dataclass(frozen=True)
class TimingSpec:
    reps: int  # full timing samples per candidate
    prune_reps: int  # quick samples that decide whether a candidate is worth the full timing
    prune_factor: float  # quick median > prune_factor x best median so far -> pruned


@dataclass(frozen=True)
class SearchSpec:
    """Successive halving (docs/architecture.md, "Search"): every candidate that passes the
    gate gets rungs[0] samples; each later rung keeps the best `keep` fraction (never fewer
    than `min_keep` per shape, plus each backend's best and the baseline) for rungs[i]
    samples; the last rung is the full timing and the wall-time figure."""

    rungs: tuple[int, ...]
    keep: float
    min_keep: int


SEARCH_FIELDS = {"rungs", "keep", "min_keep"}


def default_rungs(timing: TimingSpec) -> tuple[int, ...]:
    """Without `search.rungs`: prune_reps, about 40% of reps, then reps (5, 12, 30 for the
    leaderboard's timing), so timing.reps stays the final sample count."""
    middle = max(timing.prune_reps, round(timing.reps * 0.4))
    return tuple(sorted({min(timing.prune_reps, timing.reps), min(middle, timing.reps), timing.reps}))


@dataclass(frozen=True)
class Config:
    name: str
    path: Path
    rule: Rule
    hash: str
    shapes: list[Shape]
    check_seeds: list[int]
    calibration_seeds: list[int]
    timing: TimingSpec
    budget_s: float | None
    backends: dict[str, dict]  # name -> search space (the `precompile` key removed)
    precompile: dict[str, bool]  # name -> warm Triton's cache in a compile pool first
    candidate_timeout_s: float | None
    raw: dict
    # `purpose` and `calibration`: where fp8_static q scales come from (mla_tune.tune.calibration)
    calibration: CalibrationSpec = CalibrationSpec()
    search: SearchSpec | None = None  # always set by config_from_dict


def config_hash(raw: dict) -> str:
    """sha256 of the content in canonical JSON (sorted keys): stable across key order,
    comments and YAML formatting."""
    text = json.dumps(raw, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or a finite float (not a bool, not .nan or .inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_positive(value: Any) -> bool:
    return _is_number(value) and value > 0


def load_config(path: str | Path) -> Config:
    """Read and validate a config file; raises ConfigError naming the file and the field."""
    path = Path(path)
    raw = read_yaml(path, "config", ConfigError, max_bytes=CONFIG_MAX_BYTES,
                    missing_hint="pass the path of a config file, e.g. configs/leaderboard.yaml")
    return config_from_dict(raw, path)


def config_from_dict(raw: Any, path: str | Path = "<config>") -> Config:
    """Validate an already-parsed config mapping (see load_config)."""
    path = Path(path)

    def fail(field: str, message: str) -> ConfigError:
        return ConfigError(f"{path}: field '{field}': {message}")

    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a YAML mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - TOP_LEVEL_FIELDS)
    if unknown:
        raise fail(unknown[0], f"unknown field; known fields: {', '.join(sorted(TOP_LEVEL_FIELDS))}")
    for required in ("name", "rule", "check_seeds", "calibration_seeds", "timing", "shapes", "backends"):
        if required not in raw:
            raise fail(required, "missing (required)")

    name = raw["name"]
    if not isinstance(name, str) or not name.strip():
        raise fail("name", f"must be a non-empty string, got {name!r}")
    try:
        rule = get_rule(raw["rule"]) if isinstance(raw["rule"], str) else None
    except ValueError as exc:
        raise fail("rule", str(exc)) from exc
    if rule is None:
        raise fail("rule", f"must be a rule name (leaderboard, strict), got {raw['rule']!r}")

    check_seeds = _seed_list(raw["check_seeds"], "check_seeds", fail)
    if len(check_seeds) < 2:
        raise fail("check_seeds", f"needs at least 2 seeds (the gate checks on fresh inputs), got {check_seeds}")
    calibration_seeds = _seed_list(raw["calibration_seeds"], "calibration_seeds", fail)
    if not calibration_seeds:
        raise fail("calibration_seeds", "needs at least one seed")
    shared = sorted(set(check_seeds) & set(calibration_seeds))
    if shared:
        raise fail(
            "calibration_seeds",
            f"seeds {shared} are also check_seeds; calibrate on other seeds so the gate sees fresh inputs",
        )

    timing = _timing(raw["timing"], fail)

    budget_s = raw.get("budget_s")
    if budget_s is not None and not _is_positive(budget_s):
        raise fail("budget_s", f"must be a positive, finite number of seconds, got {budget_s!r}")
    timeout = raw.get("candidate_timeout_s")
    if timeout is not None and not _is_positive(timeout):
        raise fail("candidate_timeout_s", f"must be a positive, finite number of seconds, got {timeout!r}")

    shapes = _shapes(raw["shapes"], fail)
    backends, precompile = _backends(raw["backends"], fail)
    calibration = parse_calibration(raw, path.parent, fail)
    return Config(
        name=name,
        path=path,
        rule=rule,
        hash=config_hash(raw),
        shapes=shapes,
        check_seeds=check_seeds,
        calibration_seeds=calibration_seeds,
        timing=timing,
        budget_s=float(budget_s) if budget_s is not None else None,
        backends=backends,
        precompile=precompile,
        candidate_timeout_s=float(timeout) if timeout is not None else None,
        raw=raw,
        calibration=calibration,
        search=_search(raw.get("search"), timing, fail),
    )


def _seed_list(value: Any, field: str, fail) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(s) for s in value):
        raise fail(field, f"must be a list of integers, got {value!r}")
    if len(set(value)) != len(value):
        raise fail(field, f"seeds must be distinct, got {value}")
    if not all(SEED_RANGE[0] <= s <= SEED_RANGE[1] for s in value):
        raise fail(field, f"seeds must lie in {SEED_RANGE[0]} to {SEED_RANGE[1]} (torch's), got {value}")
    return list(value)


def _timing(value: Any, fail) -> TimingSpec:
    if not isinstance(value, dict):
        raise fail("timing", f"must be a mapping with {', '.join(sorted(TIMING_FIELDS))}")
    unknown = sorted(set(value) - TIMING_FIELDS)
    if unknown:
        raise fail(f"timing.{unknown[0]}", f"unknown field; known: {', '.join(sorted(TIMING_FIELDS))}")
    for key in ("reps", "prune_reps"):
        if key not in value:
            raise fail(f"timing.{key}", "missing (required)")
        if not _is_int(value[key]) or value[key] < 1:
            raise fail(f"timing.{key}", f"must be an integer >= 1, got {value[key]!r}")
    factor = value.get("prune_factor")
    if factor is None:
        raise fail("timing.prune_factor", "missing (required)")
    if not _is_number(factor) or factor < 1:
        raise fail("timing.prune_factor", f"must be a finite number >= 1, got {factor!r}")
    return TimingSpec(value["reps"], value["prune_reps"], float(factor))


def _search(value: Any, timing: TimingSpec, fail) -> SearchSpec:
    if value is None:
        return SearchSpec(default_rungs(timing), 0.25, 3)
    if not isinstance(value, dict):
        raise fail("search", f"must be a mapping with {', '.join(sorted(SEARCH_FIELDS))}, got {value!r}")
    unknown = sorted(set(value) - SEARCH_FIELDS)
    if unknown:
        raise fail(f"search.{unknown[0]}", f"unknown field; known: {', '.join(sorted(SEARCH_FIELDS))}")
    rungs = value.get("rungs", list(default_rungs(timing)))
    if (not isinstance(rungs, list) or not rungs or not all(_is_int(r) and 1 <= r <= 10_000 for r in rungs)
            or rungs != sorted(set(rungs))):
        raise fail("search.rungs", f"must be a non-empty increasing list of sample counts "
                   f"(1..10000), e.g. [5, 12, 30], got {rungs!r}")
    keep = value.get("keep", 0.25)
    if not _is_number(keep) or not 0 < keep <= 1:
        raise fail("search.keep", f"must be a fraction in (0, 1], e.g. 0.25, got {keep!r}")
    min_keep = value.get("min_keep", 3)
    if not _is_int(min_keep) or min_keep < 1:
        raise fail("search.min_keep", f"must be an integer >= 1, got {min_keep!r}")
    return SearchSpec(tuple(rungs), float(keep), min_keep)


def _shapes(value: Any, fail) -> list[Shape]:
    if not isinstance(value, list) or not value:
        raise fail("shapes", "must be a non-empty list of {batch, kv_len} mappings")
    shapes: list[Shape] = []
    for i, item in enumerate(value):
        where = f"shapes[{i}]"
        if not isinstance(item, dict) or set(item) != {"batch", "kv_len"}:
            raise fail(where, f"must be a mapping with exactly batch and kv_len, got {item!r}")
        try:
            shape = Shape(item["batch"], item["kv_len"])
        except ValueError as exc:
            raise fail(where, str(exc)) from exc
        if shape in shapes:
            raise fail(where, f"duplicate shape {shape} (already shapes[{shapes.index(shape)}])")
        shapes.append(shape)
    return shapes


def expand_space(space: dict) -> list[dict]:
    """A backend's search space as a list of plain grids.

    A space may hold `grids: [{...}, {...}]`: the candidates are then the union of the
    sub-grids, each laid over the space's other keys. That keeps a sweep small where
    parameters only pay together (fp8 KV with fp16 dots, bf16 KV with bf16 dots) instead
    of crossing every list with every other.
    """
    base = {k: v for k, v in space.items() if k != "grids"}
    grids = space.get("grids")
    return [{**base, **grid} for grid in grids] if grids else [base]


def default_precompile(backend: str) -> bool:
    """The backend's own word (its CAPABILITIES.precompile): whether its kernels compile on
    first use into an on-disk cache, so that the sweep warms them first."""
    return capabilities(backend).precompile


def _backends(value: Any, fail) -> tuple[dict[str, dict], dict[str, bool]]:
    if not isinstance(value, dict) or not value:
        raise fail("backends", "must be a non-empty mapping of backend name -> search space")
    known = known_backends()
    spaces: dict[str, dict] = {}
    precompile: dict[str, bool] = {}
    for name, space in value.items():
        where = f"backends.{name}"
        if name not in known:
            raise fail(where, f"unknown backend {name!r}; known backends: {', '.join(known)}")
        space = {} if space is None else space
        if not isinstance(space, dict):
            raise fail(where, f"must be a mapping (the search space), got {space!r}")
        space = dict(space)
        flag = space.pop("precompile") if "precompile" in space else default_precompile(name)
        if not isinstance(flag, bool):
            raise fail(f"{where}.precompile", f"must be true or false, got {flag!r}")
        grids = space.get("grids")
        if grids is not None and (
            not isinstance(grids, list) or not grids or not all(isinstance(g, dict) for g in grids)
        ):
            raise fail(f"{where}.grids", "must be a non-empty list of mappings (sub-grids)")
        _check_space(name, space, where, fail)
        spaces[name] = space
        precompile[name] = flag
    return spaces, precompile


def _check_space(name: str, space: dict, where: str, fail) -> None:
    """Refuse a key the backend does not take (its SPACE_KEYS), in the section or in a
    sub-grid, and a KV format or q mode its CAPABILITIES do not list; then let the
    backend's candidates() judge the values on a probe shape for each kind of GPU (it
    raises ValueError naming the key and the allowed values)."""
    backend = get_backend(name)
    keys = getattr(backend, "SPACE_KEYS", None)
    places = [(where, space)] + [(f"{where}.grids[{i}]", g) for i, g in enumerate(space.get("grids") or [])]
    if keys is not None:
        for place, section in places:
            allowed = (*keys, *SECTION_FIELDS) if section is space else tuple(keys)
            for key in section:
                if key not in allowed:
                    raise fail(f"{place}.{key}", f"unknown key for backend {name}; allowed: "
                               f"{', '.join(allowed) or 'none'}")
    caps = capabilities(name)
    for place, section in places:
        for key, allowed, what in (("kv", caps.kv_formats, "KV formats"), ("q", caps.q_modes, "q modes")):
            values = section.get(key, [])
            bad = [v for v in (values if isinstance(values, list) else [values]) if v not in allowed]
            if bad:
                raise fail(f"{place}.{key}", f"backend {name} does not offer {key}="
                           f"{', '.join(map(str, bad))}; its {what} (its CAPABILITIES): {', '.join(allowed)}")
    check_space_rules(name, places, fail)
    for grid in expand_space(space):
        for gpu_name in _PROBE_GPUS:
            try:
                backend.candidates(_PROBE_SHAPE, grid, gpu.fake_platform(gpu_name))
            except ValueError as exc:
                raise fail(where, ' '.join(str(exc).split())) from None


def check_space_rules(name: str, places: list[tuple[str, dict]], fail) -> None:
    """Refuse a listed value that no variant may carry, by the backend's parameter rules
    (backends/params.py, the ones a table is checked against): `num_splits: [0]` fails here,
    naming the field, instead of planning candidates that no run can use. A section's `hip`
    mapping (ROCm compiler options) is checked the same way; keys the rules do not name
    are left to the backend's candidates()."""
    rules = param_rules(name)
    if rules is None:  # a plugin backend: its candidates() and validate() judge
        return
    for place, section in places:
        nested = [(place, k, v) for k, v in section.items() if k not in (*SECTION_FIELDS, "hip")]
        if isinstance(section.get("hip"), dict):
            nested += [(f"{place}.hip", k, v) for k, v in section["hip"].items()]
        for where, key, values in nested:
            for value in values if isinstance(values, list) else [values]:
                try:
                    check_space_value(rules, key, value)
                except ValueError as exc:
                    raise fail(f"{where}.{key}", f"{exc}; no {name} variant can carry it") from None
