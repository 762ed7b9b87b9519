"""The results file: records resume and the table read by name are checked as they are read."""

from __future__ import annotations

import json

import pytest

from mla_tune.tune.results import ResultsError, read_results


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
