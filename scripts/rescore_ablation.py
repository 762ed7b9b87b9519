"""Which of the eager lookup's rules the recorded verify runs need: a rescore ablation.

    PYTHONPATH=. python scripts/rescore_ablation.py [--table tables/H200.serving.yaml]
        [--reports docs/data/verify [--reports FOLDER ...]] [ABLATION ...]

Each ablation takes one rule of the lookup (mla_tune/serving/estimate.py and the schedule
models, mla_tune/backends/*_schedule.py) out,
or sets it to an extreme, and rescores the table's eager picks (serving/rescore.py) on the
recorded runs split in two halves by seed: even seeds (the half a rule may be chosen on) and
odd seeds (the half it is judged on). A line per ablation: per half, the runs whose eager
p95 regret is within 5% and max within 15%, and the pooled geomean, p95 and max. No GPU.

Ablations (default: all): today, no_reduce_step_us, no_flashinfer_model, no_splitk_models,
MODEL_WINDOW=inf, MODEL_WORKS=inf, SplitKModel.floor=0, GluonModel.floor=0.9,
MIN_MEASURED_WEIGHT=0, MIN_MEASURED_WEIGHT=1, EXACT_WAVES=1000, gluon_EXACT_WAVES=2 and =1000
(gluon_fused's replays deal fewer, or all, waves exactly); envelope_batch, envelope_length and envelope_both, the
table's points replaced by their lower envelope (a variant's time at a point the least of its
times there and at every point of a larger batch, a longer length, or both); and backend_offsets, a change of
the lookup's form rather than a rule taken out: each family's estimates of a backend scaled by
the median ratio of measured to estimated time over the even half's variants within 15% of
their shape's best (fitted on the even half, so only the odd half judges it; the Python
estimate, the family's one-call C estimate set aside).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import statistics
from pathlib import Path

from mla_tune.backends import flashinfer_mla_schedule, gluon_fused_schedule, triton_splitk_schedule
from mla_tune.serving import estimate, table
from mla_tune.serving.rescore import read_report, rescore

RUN_P95, RUN_MAX = 0.05, 0.15
FAMILY_EDITS = {
    "no_reduce_step_us": lambda f: setattr(f, "calibration", {}),
    "no_flashinfer_model": lambda f: setattr(f, "models", {v: m for v, m in f.models.items() if v.backend != "flashinfer"}),
    "no_splitk_models": lambda f: setattr(f, "models", {v: m for v, m in f.models.items() if v.backend != "triton"}),
    "envelope_batch": lambda f: _envelope(f, lambda b, k, b2, k2: b2 >= b and k2 == k),
    "envelope_length": lambda f: _envelope(f, lambda b, k, b2, k2: b2 == b and k2 >= k),
    "envelope_both": lambda f: _envelope(f, lambda b, k, b2, k2: b2 >= b and k2 >= k),
}
CONSTANTS = {  # ablation -> (module, name, value)
    "MODEL_WINDOW=inf": (estimate, "MODEL_WINDOW", math.inf),
    "MODEL_WORKS=inf": (flashinfer_mla_schedule, "MODEL_WORKS", math.inf),
    "SplitKModel.floor=0": (triton_splitk_schedule.SplitKModel, "floor", 0.0),
    "GluonModel.floor=0.9": (gluon_fused_schedule.GluonModel, "floor", 0.9),
    "MIN_MEASURED_WEIGHT=0": (estimate, "MIN_MEASURED_WEIGHT", 0.0),
    "MIN_MEASURED_WEIGHT=1": (estimate, "MIN_MEASURED_WEIGHT", 1.0),
    "EXACT_WAVES=1000": (triton_splitk_schedule, "EXACT_WAVES", 1000),
    "gluon_EXACT_WAVES=2": (gluon_fused_schedule, "EXACT_WAVES", 2),
    "gluon_EXACT_WAVES=1000": (gluon_fused_schedule, "EXACT_WAVES", 1000),
}
FORMS = ("backend_offsets",)
ABLATIONS = ("today", *FAMILY_EDITS, *CONSTANTS, *FORMS)


def _envelope(family, beyond) -> None:
    """family.points with each variant's time at a point the least of its times at the points
    `beyond(batch, kv, batch2, kv2)` admits (the point itself included)."""
    points = family.points
    family.points = {(b, k): {v: min(t2[v] for (b2, k2), t2 in points.items() if v in t2 and beyond(b, k, b2, k2))
                              for v in times}
                     for (b, k), times in points.items()}


def _offsets(table_path: Path, reports: list[Path]) -> dict:
    """{(family key, backend): median measured / estimated} over the reports' uniform and
    ragged shapes, each variant measured within 15% of its shape's best."""
    loaded = table.load_serving_table(table_path)
    ratios: dict = {}
    for path in reports:
        for r in read_report(path)["shapes"]:
            key = table.FamilyKey(**r["family"])
            family = loaded.families.get(key)
            if family is None or not family.points:
                continue
            lens = r["kv_lens"] if isinstance(r["kv_lens"], list) else [r["kv_lens"]] * r["batch"]
            est = loaded.estimator.estimates(family, r["batch"], r["mean_kv_len"], lens)
            measured = {**(r.get("short_us") or {}), **(r.get("final_us") or {})}
            for v, t in est.items():
                m = measured.get(str(v))
                if m is not None and m < 1.15 * r["best_us"]:
                    ratios.setdefault((key, v.backend), []).append(math.log(m / t))
    return {k: math.exp(statistics.median(x)) for k, x in ratios.items() if len(x) >= 3}


@contextlib.contextmanager
def _backend_offsets(table_path: Path, fit_on: list[Path]):
    """The lookup with backend_offsets in place: the Python estimate (Estimator.pick
    without a compiled family), its estimates scaled by `_offsets` of the reports fit_on."""
    compiled, plain = estimate.Estimator.compiled, estimate.Estimator.estimates
    factor = _offsets(table_path, fit_on)

    def scaled(self, family, batch, mean_kv_len, kv_lens):
        out = plain(self, family, batch, mean_kv_len, kv_lens)
        return {v: t * factor.get((family.key, v.backend), 1.0) for v, t in out.items()}
    estimate.Estimator.compiled = lambda self, family, own=False: None
    estimate.Estimator.estimates = scaled
    try:
        yield
    finally:
        estimate.Estimator.compiled, estimate.Estimator.estimates = compiled, plain


def halves(folders: list[Path]) -> dict[str, list[Path]]:
    reports = sorted(p for folder in folders for p in folder.glob("*.json.gz"))
    seed = {p: int(re.search(r"seed(\d+)", p.name).group(1)) for p in reports}
    return {"even": [p for p in reports if seed[p] % 2 == 0], "odd": [p for p in reports if seed[p] % 2]}


def score(table_path: Path, reports: list[Path], ablation: str, fit_on: list[Path]) -> str:
    if ablation in FORMS:
        with _backend_offsets(table_path, fit_on):
            return score(table_path, reports, "today", fit_on)
    loaded = table.load_serving_table(table_path)  # fresh: no estimates memoized under another rule
    for family in loaded.families.values():
        if ablation in FAMILY_EDITS:
            FAMILY_EDITS[ablation](family)
    module, name, value = CONSTANTS.get(ablation, (None, None, None))
    kept = getattr(module, name) if module is not None else None
    if module is not None:
        setattr(module, name, value)
    try:
        out = rescore(loaded, reports, log=lambda _line: None)
    finally:
        if module is not None:
            setattr(module, name, kept)
    runs = sum(r["eager"]["p95"] <= RUN_P95 and r["eager"]["max"] <= RUN_MAX for r in out["reports"])
    pooled = out["summary"]["eager"]["all"]
    return (f"{runs}/{len(out['reports'])} gm {pooled['geomean']:.2%} p95 {pooled['p95']:.2%} "
            f"max {pooled['max']:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ablations", nargs="*", metavar="ABLATION", help=", ".join(ABLATIONS))
    ap.add_argument("--table", type=Path, default=Path("tables/H200.serving.yaml"))
    ap.add_argument("--reports", type=Path, action="append",
                    help="A folder of verify reports (repeat for more); default docs/data/verify.")
    args = ap.parse_args()
    unknown = [a for a in args.ablations if a not in ABLATIONS]
    if unknown:
        ap.error(f"unknown ablation(s) {', '.join(unknown)}; choose from {', '.join(ABLATIONS)}")
    split = halves(args.reports or [Path("docs/data/verify")])
    print(f"{'ablation':<24} {'even seeds (' + str(len(split['even'])) + ' runs)':<36} "
          f"odd seeds ({len(split['odd'])} runs)")
    for ablation in args.ablations or ABLATIONS:
        print(f"{ablation:<24} {score(args.table, split['even'], ablation, split['even']):<36} "
              f"{score(args.table, split['odd'], ablation, split['even'])}", flush=True)


if __name__ == "__main__":
    main()
