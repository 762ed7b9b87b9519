"""FlashMLA's schedule model (backends/flash_mla_schedule.py): the replay of its partition
filling, in C and in Python; the fit over a family's cells; the estimate in a table's lookup;
and `sweep --merge RESULTS --refit TABLE`, which fits a committed table's models again."""

import json
import random
from unittest import mock

import pytest
import torch

from mla_tune.backends import flash_mla
from mla_tune.backends import flash_mla_schedule as fm
from mla_tune.backends.linear_schedule import predict
from mla_tune.core import Variant
from mla_tune.serving.build import ServingSweepError, refit_models
from mla_tune.serving.estimate import fit_models
from mla_tune.serving.render import show_lines
from mla_tune.serving.table import (
    Family,
    FamilyKey,
    ServingTable,
    load_serving_table,
    write_serving_table,
)
from tests.helpers import invoke, unavailable

FM = Variant.parse("flashmla(kv=bf16,q=bf16)")
FI = Variant.parse("flashinfer(kernel=fa3,kv=bf16,q=bf16)")
KEY = FamilyKey("bf16", 64, 128, 4)  # 512 q rows: 8 tiles, 132 // 8 = 16 partitions


def _python(lens, heads=128, q_len=4, sm=132):
    with mock.patch.object(fm, "_native", lambda: None):
        return fm.flash_mla_features(lens, heads, q_len, sm)


def test_the_replay_fills_flashmlas_partitions_in_order_and_splits_where_one_fills():
    assert fm.sm_parts(128, 4, 132) == 16 and fm.sm_parts(16, 1, 132) == 132
    assert fm.sm_parts(128, 4, 4) == 1
    # 32 x 1024 tokens: 16 blocks + 5 each, 672 over 16 partitions: two sequences each, none split
    assert _python([1024] * 32) == [1.0, 42.0, 0.0, 32.0]
    # 33: payload ceil(693 / 16) + 5 = 49; the third sequence splits after 2 blocks, and so on
    one, makespan, split, batch = _python([1024] * 33)
    assert makespan == 49.0 and split > 0 and batch == 33.0
    # 0, 1 and 64 tokens take one block, 65 two; 132 partitions of ceil(25 / 132) + 5 = 6 blocks:
    # one sequence each, the last split over two
    assert _python([0, 1, 64, 65], 16, 1) == [1.0, 6.0, 1.0, 4.0]
    rng = random.Random(5)
    for _ in range(300):  # the C replay is the Python one
        heads, q_len, sm = rng.choice((16, 128)), rng.randint(1, 4), rng.choice((132, 78, 8))
        lens = [int(2 ** rng.uniform(0, 16)) for _ in range(rng.randint(1, 300))]
        in_c = fm.flash_mla_features(lens, heads, q_len, sm)
        assert in_c == _python(lens, heads, q_len, sm), lens


TRUTH = (20.0, 1.5, 0.4, 0.05)  # FlashMLA's time over FLASHMLA_FEATURES in the made-up cells


def _cells():
    cells, points = {}, {}
    for b in (1, 2, 8, 16, 24, 32, 33, 40, 48, 49, 64):
        for kv in (512, 1024, 2048, 4096):
            t = predict(TRUTH, fm.flash_mla_features([kv] * b, KEY.heads, KEY.q_len, 132))
            cells[(b, kv)] = {str(FM): t, str(FI): 1.1 * t}
            points[(b, kv)] = {FM: t, FI: 1.1 * t}
    return cells, points


def _table(models: bool = True) -> ServingTable:
    cells, points = _cells()
    fitted = fit_models(KEY, points, cells, {"sm_count": 132, "smem_per_sm": 0}) if models else {}
    provenance = {"config": {"hash": "ab" * 32}, "search": {"rungs": [3, 8, 20]},
                  "gpu": {"sm_count": 132, "smem_per_sm": 233472}}
    family = Family(KEY, points=points, models=fitted)
    return ServingTable("H200", provenance, [1, 64], [512, 1024, 2048, 4096], {KEY: family})


def _results(path, config_hash: str):
    cells, _ = _cells()
    lines = [{"kind": "header", "schema": "serving-results/1", "config_hash": config_hash, "gpu": "H200"}]
    for (b, kv), times in cells.items():
        for variant, t in times.items():
            lines.append({"kind": "step", "family": KEY.as_dict(), "batch": b, "kv_len": kv, "variant": variant,
                          "samples": 20, "status": "ok", "time": {"median_us": t}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_model_fits_flashmlas_cells_and_refit_fits_it_again_keeping_every_other_entry(tmp_path):
    """The build's fit estimates FlashMLA's step at a split; `sweep --merge RESULTS --refit TABLE`
    (on the command line: the table's own results) fits the models again from the results."""
    table = _table()
    fam = table.families[KEY]
    model = fam.models[FM]
    assert isinstance(model, fm.FlashMLAModel) and model.fit_error_p90 < 1e-4
    # between grid points it follows the schedule: 36 x 700 splits, 32 x 700 does not
    for lens in ([700] * 36, [700] * 32, [100, 9000, 30000, 64]):
        assert model.time_us(KEY, lens) == pytest.approx(
            predict(TRUTH, fm.flash_mla_features(lens, KEY.heads, KEY.q_len, 132)), rel=1e-6)
    # in the lookup: the model's estimate, FlashMLA being within the window of FlashInfer
    lens = [700] * 36
    est = table.estimator.estimates(fam, 36, 700.0, lens)
    assert est[FM] == pytest.approx(model.time_us(KEY, lens), rel=1e-9)
    bare = write_serving_table(tmp_path / "H200.serving.yaml", _table(models=False))
    refit = ("sweep", "--gpu", "H200", "--config", "configs/serving.yaml", "--refit", bare)
    result = invoke(*refit)
    assert result.exit_code == 2 and "give them with --merge" in result.output
    out = tmp_path / "new.yaml"
    result = invoke(*refit, "--merge", _results(tmp_path / "r.jsonl", "ab" * 32), "--out", out)
    assert result.exit_code == 0, result.output
    new, old = load_serving_table(out), load_serving_table(bare)
    models = new.as_dict()["families"][0]["models"]
    assert models == table.as_dict()["families"][0]["models"]  # as the build fits them
    assert new.families[KEY].points == old.families[KEY].points
    assert new.provenance["models_refit"]["results"] == ["r.jsonl"]
    date = new.provenance["models_refit"]["date"]
    assert f"  models: fitted again {date} from r.jsonl" in show_lines(new, out, 80)
    # two: FlashMLA's and FlashInfer's
    assert result.output == f"wrote {out}: its schedule models fitted again from 1 results file(s), 0 -> 2\n"
    with pytest.raises(ServingSweepError, match="config hash cdcd.*give the results .* was built from"):
        refit_models(bare, [_results(tmp_path / "other.jsonl", "cd" * 32)])
    old.provenance = {}
    nameless = write_serving_table(tmp_path / "bare.serving.yaml", old)
    with pytest.raises(ServingSweepError, match="names no config hash"):
        refit_models(nameless, [tmp_path / "r.jsonl"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_replay_splits_the_sequences_flashmlas_own_scheduler_splits(fp8):
    """On the GPU: FlashMLA's get_mla_decoding_metadata (legacy, the wrapper of the op backends/flash_mla.py
    calls) makes as many partitions as sm_parts says and splits the sequences the replay splits."""
    if (reason := flash_mla.unavailable_reason()) is not None:
        unavailable(reason)
    import flash_mla as vendor

    sm = torch.cuda.get_device_properties(0).multi_processor_count
    rng = random.Random(3)
    for _ in range(40):
        heads, q_len = rng.choice((16, 128)), rng.randint(1, 4)
        lens = [int(2 ** rng.uniform(0, 16)) for _ in range(rng.randint(1, 200))]
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        meta, splits = vendor.get_mla_decoding_metadata(seq_lens, q_len * heads, 1, h_q=heads,
                                                        is_fp8_kvcache=fp8, use_legacy=True)
        assert meta.shape[0] == fm.sm_parts(heads, q_len, sm), (heads, q_len)
        pieces = torch.diff(splits.cpu()).tolist()
        split = sum(p > 1 for p in pieces)
        assert fm.flash_mla_features(lens, heads, q_len, sm)[2] == split, (heads, q_len, lens)
