"""Where an fp8_static variant's q scale comes from, stated by the config and recorded.

A static q scale is q_amax / fp8_max, fixed when the table is made. A q element beyond
q_amax is clamped, and the answer is wrong without any error: calibrated on the
leaderboard's standard-normal q, FlashMLA's fp8_static rows put 74-75% of elements out of
tolerance when q is 8 times larger (measured on the H200, issue 12). So a config says where
q_amax comes from, in its `calibration:` mapping, with exactly one source:

    calibration: {generator: leaderboard}             # max |q| of the leaderboard's randn q
                                                      # over calibration_seeds, x margin
    calibration: {q_sample: q_layers.pt}              # max |q| of a tensor saved with
                                                      # torch.save (last dim 576), x margin
    calibration: {q_distribution: normal, q_std: 2.5} # q's elements ~ N(0, q_std^2)
    calibration: {q_amax: 40.0}                       # stated outright

`margin` (default 1.1) widens the two sample maxima for draws the sample did not hold. A
config without `calibration` calibrates on the generator, as before. A config with
`purpose: serving` serves real traffic, whose q the generator says nothing about: it must
name one of the other sources when it offers fp8_static, and calibrate() refuses the
generator for it. The record calibrate() returns lands in the table row (`calibration`:
q_amax, kind, method, source). At run time a call beyond q_amax is counted or refused: see
mla_tune.runtime (check_q_range, q_saturation) and docs/runtime.md.

Nothing here depends on the softmax scale: q_amax bounds q itself, and every kernel
multiplies the scores by the model's sm_scale (CallSpec.sm_scale, build's sm_scale) after
the dot, so a model's scale (DeepSeek-V3's 0.1352 beside the leaderboard's 1/sqrt(576))
keeps the same calibration. The quantization's error in a score grows with the scale as
every other score error does (tests/test_model_call_facts.py checks an fp8_static call at
DeepSeek-V3's scale against the reference of the same static q at that scale).
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mla_tune.core import NUM_HEADS, QK_DIM, Shape

PURPOSES = ("leaderboard", "serving")
SOURCES = ("generator", "q_sample", "q_distribution", "q_amax")
GENERATORS = ("leaderboard",)
DISTRIBUTIONS = ("normal",)
FIELDS = (*SOURCES, "q_std", "margin")
# Sample maxima grow slowly with more draws (randn: about 4.5 sigma at 10^5 draws, 5.3 at
# 10^7); 10% headroom covers draws the sample did not hold.
DEFAULT_MARGIN = 1.1
# A stated distribution gives q_amax by its tail: expected elements beyond q_amax in one
# call of the shape's batch (one clamped element moves one score by a little; this keeps
# even that to one call in ten thousand).
TAIL_PER_CALL = 1e-4


class CalibrationError(ValueError):
    """A calibration that cannot be made or is not allowed; one line naming the fix."""


@dataclass(frozen=True)
class CalibrationSpec:
    """A config's `purpose` and `calibration`, as plain values (it travels to the workers as
    as_dict()). `source` None: a serving config that names none (then fp8_static fails)."""

    purpose: str = "leaderboard"
    source: str | None = "generator"
    generator: str | None = "leaderboard"
    q_sample: str | None = None  # an absolute path
    q_distribution: str | None = None
    q_std: float | None = None
    q_amax: float | None = None
    margin: float = DEFAULT_MARGIN
    stated: bool = False  # written in the config (not the default)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict | None) -> CalibrationSpec:
        return cls(**value) if value else cls()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _offers_fp8_static(backends: dict) -> list[str]:
    """Backends whose search space names q=fp8_static (in a list or a sub-grid)."""
    named = []
    for name, space in (backends or {}).items():
        grids = [space, *(space.get("grids") or [])] if isinstance(space, dict) else []
        for grid in grids:
            q = grid.get("q") if isinstance(grid, dict) else None
            values = q if isinstance(q, (list, tuple)) else [q]
            if "fp8_static" in values:
                named.append(name)
                break
    return named


def parse_calibration(raw: dict, config_dir: Path, fail) -> CalibrationSpec:
    """The config's `purpose` and `calibration` keys, checked; fail(field, message) makes
    the config's error. A q_sample path is read relative to the config's folder, and the
    sample is loaded here, so a bad file costs no sweep."""
    purpose = raw.get("purpose", "leaderboard")
    if purpose not in PURPOSES:
        raise fail("purpose", f"must be one of {', '.join(PURPOSES)}, got {purpose!r}")
    value = raw.get("calibration")
    if value is None:
        spec = CalibrationSpec(purpose=purpose)
    else:
        if not isinstance(value, dict):
            raise fail("calibration", f"must be a mapping with one of {', '.join(SOURCES)}, got {value!r}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise fail(f"calibration.{unknown[0]}", f"unknown field; known: {', '.join(FIELDS)}")
        given = [s for s in SOURCES if s in value]
        if len(given) != 1:
            raise fail("calibration", f"needs exactly one source of {', '.join(SOURCES)}, got "
                                      f"{', '.join(given) or 'none'}")
        spec = _spec(given[0], value, purpose, config_dir, fail)
    if purpose == "serving" and spec.source in (None, "generator"):
        offered = _offers_fp8_static(raw.get("backends"))
        if offered:
            raise fail("calibration", f"a serving config offers q=fp8_static ({', '.join(offered)}) "
                       "but calibrates on the leaderboard's generator only; give calibration: "
                       "{q_sample: FILE.pt} (real q), {q_distribution: normal, q_std: S} or "
                       "{q_amax: A}, or drop fp8_static")
        spec = CalibrationSpec(purpose=purpose, source=None, generator=None, stated=spec.stated)
    return spec


def _spec(source: str, value: dict, purpose: str, config_dir: Path, fail) -> CalibrationSpec:
    margin = value.get("margin", DEFAULT_MARGIN)
    if not _is_number(margin) or not 1.0 <= margin <= 10.0:
        raise fail("calibration.margin", f"must be a number from 1 to 10, got {margin!r}")
    if "margin" in value and source not in ("generator", "q_sample"):
        raise fail("calibration.margin", f"applies to generator and q_sample only, not {source}")
    if "q_std" in value and source != "q_distribution":
        raise fail("calibration.q_std", "goes with q_distribution only")
    base = dict(purpose=purpose, source=source, generator=None, margin=float(margin), stated=True)
    if source == "generator":
        if value["generator"] not in GENERATORS:
            raise fail("calibration.generator", f"must be one of {', '.join(GENERATORS)}, "
                       f"got {value['generator']!r}")
        return CalibrationSpec(**{**base, "generator": value["generator"]})
    if source == "q_amax":
        amax = value["q_amax"]
        if not _is_number(amax) or amax <= 0:
            raise fail("calibration.q_amax", f"must be a finite number > 0, got {amax!r}")
        return CalibrationSpec(**base, q_amax=float(amax))
    if source == "q_distribution":
        if value["q_distribution"] not in DISTRIBUTIONS:
            raise fail("calibration.q_distribution", f"must be one of {', '.join(DISTRIBUTIONS)}, "
                       f"got {value['q_distribution']!r}")
        std = value.get("q_std")
        if not _is_number(std) or std <= 0:
            raise fail("calibration.q_std", f"must be a finite number > 0 (q's standard "
                       f"deviation), got {std!r}")
        return CalibrationSpec(**base, q_distribution=value["q_distribution"], q_std=float(std))
    path = value["q_sample"]
    if not isinstance(path, str) or not path.strip():
        raise fail("calibration.q_sample", f"must be a file path, got {path!r}")
    full = (config_dir / path).resolve()
    try:
        load_q_sample(full)
    except CalibrationError as exc:
        raise fail("calibration.q_sample", str(exc)) from exc
    return CalibrationSpec(**base, q_sample=str(full))


def load_q_sample(path: str | Path) -> tuple[float, int, str]:
    """(max |q|, element count, sha256 of the file) of a q sample saved with torch.save: a
    floating tensor whose last dim is 576 (q's head dim), finite. Loaded with
    weights_only=True, so the file cannot run code."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CalibrationError(f"cannot read the q sample {path} ({exc.strerror or exc})") from exc
    try:
        sample = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file: reported as one line
        raise CalibrationError(f"{path} is not a tensor saved with torch.save ({type(exc).__name__}: "
                               f"{' '.join(str(exc).split())[:200]})") from exc
    if not isinstance(sample, torch.Tensor) or not sample.is_floating_point():
        raise CalibrationError(f"{path} must hold one floating tensor of q, got {type(sample).__name__}")
    if sample.numel() == 0 or sample.shape[-1] != QK_DIM:
        raise CalibrationError(f"{path} must hold q with last dim {QK_DIM} ((n, {NUM_HEADS}, {QK_DIM}) "
                               f"as decode sees it), got shape {tuple(sample.shape)}")
    amax = float(sample.float().abs().amax())
    if not math.isfinite(amax) or amax <= 0:
        raise CalibrationError(f"{path}: the q sample holds no finite nonzero values (max |q| {amax})")
    return amax, sample.numel(), hashlib.sha256(data).hexdigest()


def normal_tail_amax(std: float, batch: int) -> float:
    """|q| that N(0, std^2) elements of one call (batch x 16 x 576 of them) exceed, in
    expectation, TAIL_PER_CALL times."""
    elements = batch * NUM_HEADS * QK_DIM
    return std * -statistics.NormalDist().inv_cdf(TAIL_PER_CALL / (2 * elements))


def calibrate(spec: CalibrationSpec | dict | None, shape: Shape, seeds: list[int], device) -> dict:
    """fp8_static's calibration for `shape`: {q_amax, kind, method, source, ...} (the table
    row's `calibration`). The generator draws q from `seeds` (disjoint from the gate's)."""
    if not isinstance(spec, CalibrationSpec):
        spec = CalibrationSpec.from_dict(spec)
    if spec.source is None or (spec.purpose == "serving" and spec.source == "generator"):
        raise CalibrationError("a serving config calibrates fp8_static from real q only: give "
                               "calibration: {q_sample: FILE.pt}, {q_distribution: normal, q_std: S} "
                               "or {q_amax: A}")
    stated = "" if spec.stated else " (the default: the config names no calibration)"
    if spec.source == "generator":
        from mla_tune import problem

        amax = 0.0
        for seed in seeds:
            # q is drawn first from the seed's generator, so kv_len 1 yields the same q as
            # the real shape without generating its (possibly GB-sized) KV cache.
            q = problem.generate_input(shape.batch, 1, seed, device=device)[0]
            amax = max(amax, float(q.abs().amax()))
        return {"q_amax": round(amax * spec.margin, 4), "kind": "generator",
                "method": f"max |q| x {spec.margin}",
                "source": f"the {spec.generator} input generator (randn q), seeds {list(seeds)}{stated}",
                "seeds": list(seeds), "observed_amax": amax}
    if spec.source == "q_sample":
        amax, count, digest = load_q_sample(spec.q_sample)
        return {"q_amax": round(amax * spec.margin, 4), "kind": "q_sample",
                "method": f"max |q| x {spec.margin}",
                "source": f"q sample {spec.q_sample} ({count} elements, sha256 {digest[:16]})",
                "observed_amax": amax}
    if spec.source == "q_distribution":
        amax = normal_tail_amax(spec.q_std, shape.batch)
        return {"q_amax": round(amax, 4), "kind": "q_distribution",
                "method": f"normal tail: {TAIL_PER_CALL:g} elements beyond q_amax expected per "
                          f"call of batch {shape.batch}",
                "source": f"stated distribution: normal, q_std {spec.q_std}"}
    return {"q_amax": round(spec.q_amax, 4), "kind": "q_amax", "method": "stated",
            "source": f"q_amax {spec.q_amax} stated in the config"}
