"""The committed serving table's eager picks (and held-out graph picks), rescored on recorded
verify runs (CORPORA) that no lookup rule or graph pick was chosen on, stay within the limits
claimed here; by hand: `mla-tune verify --table tables/H200.serving.yaml --max-p95 0.05
--max-regret 0.15 --rescore docs/data/verify/recheck-2026-12-05`."""

import re
from pathlib import Path

import pytest

from mla_tune.serving.rescore import rescore
from mla_tune.serving.table import load_serving_table

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tables" / "H200.serving.yaml"
VERIFY = ROOT / "docs" / "data" / "verify"
RUN_P95, RUN_MAX = 0.05, 0.15  # a run passes with its eager p95 and max regret within these


def _seed(path: Path) -> int:
    return int(re.search(r"seed(\d+)", path.name).group(1))


# corpus: its runs, the seeds they hold, how many of them pass the run limits at least, the
# pooled p95 and max at most, and the pooled graph regret's geomean and p95 at most where the
# corpus is held out from the graph picks (`verify --repick-graph` chose them on the even seeds)
CORPORA = {
    "odd-seeds": (sorted(p for p in (VERIFY / "gluon-2026-12-03").glob("*.json.gz")
                         if _seed(p) % 2), [95, 97, 99, 101], 4, 0.02, 0.12, (0.046, 0.25)),
    "fresh-seeds": (sorted((VERIFY / "recheck-2026-12-03").glob("*.json.gz")),
                    [*range(103, 118), 119], 15, 0.025, 0.18, None),
    "fresh-seeds-2026-12-05": (sorted((VERIFY / "recheck-2026-12-05").glob("*.json.gz")),
                               list(range(120, 134)), 14, 0.035, 0.15, (0.05, 0.30)),
    # the table's own fresh seeds (seed 134's run stopped at 12 shapes, its budget spent compiling)
    "fresh-seeds-lastrung-2026-12-05": (sorted(p for p in (VERIFY / "lastrung-2026-12-05").glob("*.json.gz")
                                               if _seed(p) != 134), list(range(135, 141)), 6, 0.015, 0.10,
                                        (0.05, 0.30)),
    # the committed table's (8005039's) own fresh seeds; too few shapes to judge its graph picks
    "fresh-seeds-2026-12-06": (sorted((VERIFY / "recheck-2026-12-06").glob("*.json.gz")),
                               [141, 142], 2, 0.01, 0.10, None),
    # the odd seeds above recorded again three times on one machine, and seeds 126 and 127 once
    "recorded-again-2026-12-05": (sorted((VERIFY / "repeat-2026-12-05").glob("*.json.gz")),
                                  [95] * 3 + [97] * 3 + [99] * 3 + [101] * 3 + [126, 127], 13, 0.035, 0.20,
                                  (0.05, 0.30)),
}


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_every_pick_was_measured_and_the_eager_and_held_out_graph_regret_stay_within_limits(name):
    runs, seeds, passing, max_p95, max_max, graph = CORPORA[name]
    assert sorted(_seed(p) for p in runs) == seeds  # the corpus holds the runs it names
    scored = rescore(TABLE, runs, log=lambda _line: None)
    assert scored["unmeasured"] == 0
    assert all(r["regret"]["eager"] is not None for r in scored["shapes"])
    # enough runs keep their eager regret within the run limits
    failing = [(Path(r["path"]).name, r["eager"]) for r in scored["reports"]
               if not (r["eager"]["p95"] <= RUN_P95 and r["eager"]["max"] <= RUN_MAX)]
    assert len(scored["reports"]) - len(failing) >= passing, failing
    # the pooled eager regret stays within its limits
    pooled = scored["summary"]["eager"]["all"]
    assert pooled["n"] == 40 * len(runs)
    assert pooled["p95"] <= max_p95, pooled
    assert pooled["max"] <= max_max, pooled
    if graph is not None:  # the graph regret (summarized whatever the judge)
        chosen_on = load_serving_table(TABLE).provenance["graph_repick"]["reports"]
        assert chosen_on and all(_seed(Path(n)) % 2 == 0 for n in chosen_on)
        pooled = scored["summary"]["graph"]["all"]
        assert pooled["n"] >= 160 and pooled["geomean"] <= graph[0] and pooled["p95"] <= graph[1], pooled
