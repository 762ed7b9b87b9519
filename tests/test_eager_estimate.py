"""The eager lookup's estimate: serving/estimate.py's interpolation between measured points,
FlashInfer's schedule model (replay, fit, estimate)."""

import warnings

import pytest

from mla_tune.backends.flashinfer_mla_schedule import (
    FIT_MIN_CELLS,
    FLASHINFER_FEATURES,
    VendorModel,
    fit_linear,
    flashinfer_mla_features,
    flashinfer_mla_works_per_cluster,
    predict,
    relative_errors,
)
from mla_tune.core import CallSpec, Variant
from mla_tune.serving.estimate import fit_models, interpolate
from mla_tune.serving.table import Cell, Family, FamilyKey, ServingTable

FI = Variant.parse("flashinfer(kernel=fa3,kv=bf16,q=bf16)")
FM = Variant.parse("flashmla(kv=bf16,q=bf16)")
TR = Variant.parse("triton(block_h=16,block_n=32,dot_dtype=bf16,kv=bf16,max_splits=64,num_stages=2,"
                   "num_warps=4,q=bf16,tokens_per_split=128)")
KEY = FamilyKey("bf16", 64, 16, 4)
SPEC = CallSpec("bf16", page_size=64, heads=16, max_q_len=4)
POINTS = {(8, 16384): {FI: 60.0, FM: 80.0}, (8, 32768): {FI: 100.0, FM: 130.0},
          (16, 16384): {FI: 96.0, FM: 127.0}, (16, 32768): {FI: 166.0, FM: 202.0}}


def test_interpolate_is_log_log_and_takes_a_variant_a_point_lacks_from_the_others_ratio():
    """In batch and length; past the last length by the last slope, past the last batch the
    nearest; a variant a point lacks is taken from the others' ratio there, or left out."""
    points = dict(POINTS)
    assert interpolate(points, 8, 16384) == {FI: pytest.approx(60.0), FM: pytest.approx(80.0)}
    assert interpolate(points, 8, 16384 * 2 ** 0.5)[FI] == pytest.approx((60.0 * 100.0) ** 0.5)
    w = 0.45943161863729726  # 11 is 0.46 of the way from 8 to 16 in log
    assert interpolate(points, 11, 32768)[FM] == pytest.approx(130.0 ** (1 - w) * 202.0 ** w)
    past = interpolate(points, 16, 65536)  # slope log(166/96)/log 2 = 0.79: 166 x 2^0.79
    assert past[FI] == pytest.approx(166.0 * 2 ** 0.7901, rel=1e-3)
    assert interpolate(points, 64, 16384) == interpolate(points, 16, 16384)  # beyond: the nearest
    points[(16, 16384)] = {FM: 127.0}  # FlashInfer not timed there
    # where that point weighs more than half (12 is 0.58 of the way to 16), FlashInfer drops out ...
    assert set(interpolate(points, 12, 16384)) == {FM}
    # ... and where it weighs less (10: 0.32), it is taken there as FlashMLA's time scaled by
    # their ratio at 8 x 16384: 127 x 60 / 80
    w = 0.32192809488736235
    est = interpolate(points, 10, 16384)
    assert est[FI] == pytest.approx(60.0 ** (1 - w) * (127.0 * 60.0 / 80.0) ** w)
    assert est[FM] == pytest.approx(80.0 ** (1 - w) * 127.0 ** w)
    # with no variant timed at both points there is no ratio to go by: both drop out
    points[(16, 16384)] = {TR: 127.0}
    assert set(interpolate(points, 10, 16384)) == set()


def test_the_replay_deals_chunks_as_flashinfer_does_and_short_sequences_split_into_small_chunks():
    # 16 heads x q_len 4 = 64 rows: one CTA per cluster, 132 clusters, q tiles of 64 rows.
    # 16 x 32768: the limit is 4096 (ceil(524288 / 132) = 3972, rounded up to 256) and the
    # 128 chunks fit the clusters: one each, cost 2 x 64 + 4096.
    one, makespan, works, merges, batch, merge = flashinfer_mla_features([32768] * 16, 16, 4, 132)
    assert (one, makespan, works, batch) == (1.0, 4224.0, 1.0, 16.0)
    assert merges == 16 * 8 and merge == 8 * 8  # 8 merge CTAs per sequence, 8 chunks x 8 rows each
    # 15 x 44654: limit 5120, 9 chunks each (8 full, one of 3694): 135 chunks on 132 clusters.
    # The last sequence's 7th and 8th full chunks and its partial go where the partials of
    # the first sequences are: 3822 + 5248 is the makespan.
    _, makespan, works, *_ = flashinfer_mla_features([44654] * 15, 16, 4, 132)
    assert makespan == 3822 + 5248 and works == 2
    assert flashinfer_mla_works_per_cluster([44654] * 15, 16, 4, 132) == pytest.approx(135 / 132)
    # short sequences: ceil(3 x 100 / 66) = 5 tokens per cluster -> a limit of 32: each
    # 100-token sequence is 4 chunks (32, 32, 32, 4), 12 in all, one per cluster
    feats = flashinfer_mla_features([100] * 3, 128, 1, 132)
    assert feats[2] == 1.0 and feats[1] == 2 * 128 + 32 and feats[3] == 3 * max(100 * 2 // 32, 1)
    assert len(FLASHINFER_FEATURES) == len(flashinfer_mla_features([10], 16, 1, 132))  # the names


def test_a_linear_fit_recovers_its_coefficients_and_zeroes_a_constant_column():
    truth = [5.0, 0.03, 2.0, 0.0, 0.1, 0.0]
    rows = [[1.0, 1000.0 * i, float(i % 3), 0.0, float((7 * i) % 5), 0.0] for i in range(1, 30)]
    times = [predict(truth, r) for r in rows]
    coef = fit_linear(rows, times)
    assert coef == pytest.approx(truth, rel=1e-4, abs=1e-4)
    assert max(relative_errors(coef, rows, times)) < 1e-5
    with pytest.raises(ValueError, match="needs at least"):
        fit_linear(rows[:3], times[:3])


def _table(model: VendorModel | None = None) -> ServingTable:
    fam = Family(KEY, models={model.variant: model} if model is not None else {})
    for (b, kv), times in POINTS.items():
        fam.points[(b, kv)] = dict(times)
        fam.cells[(b, kv)] = Cell(b, kv, FI, times[FI])
    return ServingTable("H200", {}, [8, 16], [16384, 32768], {fam.key: fam})


def test_the_eager_pick_is_the_fastest_estimate_and_flashinfers_comes_from_its_schedule():
    # 15 x 44654: interpolated FlashInfer (166 x 1.36^0.79 ~ 212) beats FlashMLA (~260)
    assert _table().lookup(SPEC, 15, 44654.0, kv_lens=[44654] * 15) == FI
    # a model whose time is its makespan / 20: 9070 / 20 = 453 us at 15 x 44654 (135 chunks
    # overflow the clusters), 4224 / 20 = 211 at 16 x 32768
    table = _table(VendorModel(FI, (0.0, 0.05, 0.0, 0.0, 0.0, 0.0), 132, 0.0))
    est = table.estimates(SPEC, 15, 44654.0, kv_lens=[44654] * 15)
    assert est[FI] == pytest.approx(9070 * 0.05) and est[FI] > est[FM]
    assert table.lookup(SPEC, 15, 44654.0, kv_lens=[44654] * 15) == FM
    assert table.lookup(SPEC, 15, 44654.0) == FM  # without the lengths, `batch` sequences of the mean
    # near FlashMLA's the model runs; over 1.5x from it either way, the interpolated time stands
    assert table.estimates(SPEC, 8, 16384.0)[FI] != pytest.approx(60.0)
    table.families[KEY].points[(8, 16384)] = {FI: 60.0, FM: 200.0}
    table.estimator.clear()
    assert table.estimates(SPEC, 8, 16384.0)[FI] == pytest.approx(60.0)
    assert table.lookup(SPEC, 15, graph=True) is None  # a graph pick still ignores the lengths
    # where no variant was measured at every point around the call, the cell decides
    fam = table.families[KEY]
    fam.points[(16, 32768)] = {TR: 300.0}
    fam.cells[(16, 32768)] = Cell(16, 32768, FM, 202.0)
    table.estimator.clear()
    assert table.estimates(SPEC, 15, 44654.0) == {} and table.lookup(SPEC, 15, 44654.0) == FM


def test_the_build_fits_flashinfers_model_to_its_aligned_cells():
    def _flashinfer_model(cells, points, sm_count):  # as serving/build.py fits a family's models
        return fit_models(KEY, points, cells, {"sm_count": sm_count, "smem_per_sm": 0}).get(FI)

    truth = (6.0, 0.03, 1.5, 0.02, 0.05, 0.01)
    cells, points = {}, {}
    for b in (1, 2, 4, 8, 12, 16):
        for kv in (512, 1024, 2048, 4096, 8192):
            t = predict(truth, flashinfer_mla_features([kv] * b, 16, 4, 132))
            cells[(b, kv)] = {str(FI): t, str(FM): 2 * t}
            points[(b, kv)] = {FI: t, FM: 2 * t}
    cells[(16, 0)] = {str(FI): 1e6}  # the graph stage's ragged mix: not a cell, not fitted
    model = _flashinfer_model(cells, points, 132)
    assert model.variant == FI and model.sm_count == 132 and model.fit_error_p90 < 1e-4
    for lens in ([3000] * 7, [44654] * 15, [600, 9000, 30000]):  # off the grid: features the grid
        feats = flashinfer_mla_features(lens, 16, 4, 132)  # only spans approximately
        assert model.time_us(KEY, lens) == pytest.approx(predict(truth, feats), rel=0.02)
    assert _flashinfer_model(cells, points, 0) is None  # no SM count in the results header
    few = dict(list(cells.items())[:FIT_MIN_CELLS - 1])
    assert _flashinfer_model(few, points, 132) is None
    no_fi = {p: {FM: t[FM]} for p, t in points.items()}
    assert _flashinfer_model(cells, no_fi, 132) is None  # FlashInfer is no eager pick


def test_the_lookup_warns_once_where_the_installed_vendor_is_not_the_tables(monkeypatch):
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "0.7.0" if d == "flashinfer-python" else real(d))
    for version, warned in (("0.6.18.post1", 1), ("0.7.0", 0)):
        table = _table(VendorModel(FI, (1.0, 0.01, 0.0, 0.0, 0.0, 0.0), 132, 0.05))
        table.provenance = {"versions": {"flashinfer-python": version}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in (9, 10, 11):
                table.lookup(SPEC, batch, 20000.0)
        said = [str(w.message) for w in caught if "flashinfer-python" in str(w.message)]
        assert len(said) == warned and all(version in m and "0.7.0" in m for m in said), said
