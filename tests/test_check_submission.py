"""scripts/check_submission.py's paired ratio: two files timed alternately compare only
figures taken at the same position in a round (the H200 shows a position effect)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from check_submission import paired_ratio  # noqa: E402


def _rounds(first: float, second: float, rounds: int, mine_scale: float):
    """Figures as check_submission records them: mine[0] first, then round k (theirs
    first when k is even), with a position effect first -> second."""
    mine = [first * mine_scale]
    theirs = []
    for k in range(rounds):
        if k % 2 == 0:
            theirs.append(first)
            mine.append(second * mine_scale)
        else:
            mine.append(first * mine_scale)
            theirs.append(second)
    return mine, theirs


@pytest.mark.parametrize("rounds", [1, 2, 3, 5])
def test_a_position_effect_cancels_and_a_real_difference_shows(rounds):
    mine, theirs = _rounds(19.6, 21.5, rounds, 1.0)
    assert paired_ratio(mine, theirs) == pytest.approx(1.0)
    mine, theirs = _rounds(19.6, 21.5, rounds, 1.05)
    assert paired_ratio(mine, theirs) == pytest.approx(1.05)
