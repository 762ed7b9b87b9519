"""The committed serving table's eager picks, rescored on the held-out half of the recorded
verify runs that time every candidate of its config (docs/data/verify/gluon-2026-12-03: the
odd seeds; the even seeds are the half a lookup rule or a graph pick may be chosen on), stay
within the limits this file claims. No GPU: the times are the reports'
(mla_tune/serving/rescore.py). The same figures by hand:

    mla-tune verify --table tables/H200.serving.yaml --max-p95 0.05 --max-regret 0.15 \\
        $(for f in docs/data/verify/gluon-2026-12-03/*seed*[13579].json.gz; do echo --rescore $f; done)

The limits are below. The committed table (re-fitted by 45062e0 with the split-K
occupancy cap of the compiled kernel, calibrated 2026-12-03) scores 1 of the 4 runs within the
run limits (seed 101's p95 is 5.01%), pooled p95 5.8%, max 11.8%; the table before it (8a09021,
the cap of the KV stages) 2 of 4, p95 5.8%, max 28.2%; the same sweep built by 89cca1c (no
gluon_fused model) 0 of 4, p95 16.0%, max 74.9% (docs/perf.md 2.3). The runs at the top of docs/data/verify predate gluon_fused in configs/serving.yaml and cannot score its picks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mla_tune.serving.rescore import rescore

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tables" / "H200.serving.yaml"
REPORTS = ROOT / "docs" / "data" / "verify" / "gluon-2026-12-03"

RUN_P95, RUN_MAX = 0.05, 0.15  # a run passes with its eager p95 and max regret within these
MIN_RUNS_PASSING = 1  # of the 4 held-out runs
MAX_POOLED_P95 = 0.06  # the eager regret's p95 over all held-out shapes
MAX_POOLED_MAX = 0.12  # and its worst


def _held_out() -> list[Path]:
    return sorted(p for p in REPORTS.glob("*.json.gz") if int(re.search(r"seed(\d+)", p.name).group(1)) % 2)


@pytest.fixture(scope="module")
def scored() -> dict:
    return rescore(TABLE, _held_out(), log=lambda _line: None)


def test_the_held_out_half_is_the_odd_seeds():
    held = _held_out()
    assert len(held) == 4, [p.name for p in held]


def test_every_eager_pick_was_measured_in_the_recorded_runs(scored):
    assert scored["unmeasured"] == 0
    assert all(r["regret"]["eager"] is not None for r in scored["shapes"])


def test_enough_held_out_runs_keep_their_eager_regret_within_the_run_limits(scored):
    failing = [(Path(r["path"]).name, r["eager"]) for r in scored["reports"]
               if not (r["eager"]["p95"] <= RUN_P95 and r["eager"]["max"] <= RUN_MAX)]
    assert len(scored["reports"]) - len(failing) >= MIN_RUNS_PASSING, failing


def test_the_pooled_eager_regret_stays_within_its_limits(scored):
    pooled = scored["summary"]["eager"]["all"]
    assert pooled["n"] >= 160
    assert pooled["p95"] <= MAX_POOLED_P95, pooled
    assert pooled["max"] <= MAX_POOLED_MAX, pooled
