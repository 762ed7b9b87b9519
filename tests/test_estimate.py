"""The eager estimate's interpolation (serving/estimate.py `interpolate`): log-log between the
measured points in batch and length, past the last length by the last slope, and a variant a
point lacks taken from the others' ratio there, or left out."""

from __future__ import annotations

import pytest

from mla_tune.core import Variant
from mla_tune.serving.estimate import interpolate

A = Variant.parse("flashinfer(kernel=fa3,kv=bf16,q=bf16)")
B = Variant.parse("flashmla(kv=bf16,q=bf16)")
C = Variant.parse("triton(block_h=16,block_n=32,dot_dtype=bf16,kv=bf16,max_splits=64,num_stages=2,"
                  "num_warps=4,q=bf16,tokens_per_split=128)")


def _points() -> dict:
    return {(8, 16384): {A: 60.0, B: 80.0}, (8, 32768): {A: 100.0, B: 130.0},
            (16, 16384): {A: 96.0, B: 127.0}, (16, 32768): {A: 166.0, B: 202.0}}


def test_interpolate_is_log_log_and_takes_a_variant_a_point_lacks_from_the_others_ratio():
    points = _points()
    assert interpolate(points, 8, 16384) == {A: pytest.approx(60.0), B: pytest.approx(80.0)}
    mid = interpolate(points, 8, 16384 * 2 ** 0.5)
    assert mid[A] == pytest.approx((60.0 * 100.0) ** 0.5)
    both = interpolate(points, 11, 32768)  # 11 is 0.46 of the way from 8 to 16 in log
    w = 0.45943161863729726
    assert both[B] == pytest.approx(130.0 ** (1 - w) * 202.0 ** w)
    past = interpolate(points, 16, 65536)  # slope log(166/96)/log 2 = 0.79: 166 x 2^0.79
    assert past[A] == pytest.approx(166.0 * 2 ** 0.7901, rel=1e-3)
    assert interpolate(points, 64, 16384) == interpolate(points, 16, 16384)  # beyond: the nearest
    points[(16, 16384)] = {B: 127.0}  # A not timed there
    # where that point weighs more than half (12 is 0.58 of the way to 16), A drops out ...
    assert set(interpolate(points, 12, 16384)) == {B}
    # ... and where it weighs less (10: 0.32), A is taken there as B's time scaled by A's
    # ratio to B at 8 x 16384: 127 x 60 / 80
    w = 0.32192809488736235
    est = interpolate(points, 10, 16384)
    assert est[A] == pytest.approx(60.0 ** (1 - w) * (127.0 * 60.0 / 80.0) ** w)
    assert est[B] == pytest.approx(80.0 ** (1 - w) * 127.0 ** w)
    # with no variant timed at both points there is no ratio to go by: both drop out
    points[(16, 16384)] = {C: 127.0}
    assert set(interpolate(points, 10, 16384)) == set()
