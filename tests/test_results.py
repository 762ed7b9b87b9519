"""The results file: records resume and the table read by name are checked as they are read."""

from __future__ import annotations

import gzip
import json

import pytest

from mla_tune.tune.results import ResultsError, read_json_lines, read_results


@pytest.mark.parametrize("record", [
    {"kind": "candidate", "variant": "torch(kv=bf16,q=bf16)", "status": "ok"},
    {"kind": "candidate", "shape": {"batch": 0, "kv_len": 4}, "variant": "torch(kv=bf16,q=bf16)", "status": "ok"},
    {"kind": "step", "shape": {"batch": 2, "kv_len": 17}, "status": "ok"},  # no variant
    {"kind": "rung", "shape": "2x17"},
])
def test_a_results_record_without_its_key_fields_is_one_line_naming_it(tmp_path, record):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"kind": "header"}) + "\n" + json.dumps(record) + "\n"
                    + json.dumps({"kind": "note"}) + "\n")
    with pytest.raises(ResultsError, match=r"line 2: a \w+ record without a valid shape") as info:
        read_results(path, kinds=("candidate", "step", "rung"))
    assert "\n" not in str(info.value) and "--fresh" in str(info.value)


def test_a_gzipped_results_file_reads_as_the_plain_one(tmp_path):
    # results committed for the record are gzipped (docs/data/sweep); --merge reads them so
    plain = tmp_path / "r.jsonl"
    plain.write_text('{"kind": "header"}\n\n{"kind": "candidate", "n": 1}\n{"kind": "cand')
    packed = tmp_path / "r.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    (a, wa), (b, wb) = (read_json_lines(p, redone="redo", fix="fix") for p in (plain, packed))
    assert list(a) == list(b) == [(1, {"kind": "header"}), (3, {"kind": "candidate", "n": 1})]
    assert len(wa) == len(wb) == 1
    broken = tmp_path / "cut.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:-6])
    with pytest.raises(ResultsError, match="not a whole gzip file"):
        read_json_lines(broken, redone="redo", fix="fix")
