"""On the GPU: an export passes its table's rule at lengths no table holds (its fallback).

The committed table is exported as is (`leaderboard`) and with provenance naming `strict`
(rows untouched); scripts/check_submission.py must find every fallback shape passing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "tables" / "H200.yaml"
SHAPES = "2x1,2x2,2x17,2x63,8x63"


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["strict", "leaderboard"])
def test_an_export_passes_its_tables_rule_at_lengths_only_its_fallback_serves(rule, tmp_path):
    from mla_tune.export import export_submission
    from mla_tune.problem import RULES

    data = yaml.safe_load(TABLE.read_text())
    data["provenance"]["rule"] = RULES[rule].as_dict()
    table = tmp_path / f"H200.{rule}.yaml"
    table.write_text(yaml.safe_dump(data, sort_keys=False))
    submission = export_submission(table, tmp_path / f"{rule}_sub.py")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_submission.py"), str(submission),
                           "--shapes", SHAPES, "--require", rule, "--reps", "10", "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the {rule}-rule export at {SHAPES}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
