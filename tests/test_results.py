"""The results files, checked as they are read: both readers (the tuner's and the serving
sweep's) on a torn, a damaged and a wrong first line, messages word for word; a record
without its key fields; a gzipped file."""

import gzip
import json
import re

import pytest

from mla_tune.serving.results import SCHEMA as SERVING_SCHEMA
from mla_tune.serving.results import read_records
from mla_tune.tune.results import ResultsError, read_json_lines, read_results, repair_tail

FAMILY = {"kv_format": "bf16", "page_size": 1, "heads": 16, "q_len": 1}
TUNE = {"read": read_results, "header": {"kind": "header"},
        "record": {"kind": "candidate", "shape": {"batch": 2, "kv_len": 17}, "variant": "torch(kv=bf16,q=bf16)"},
        "redone": "that candidate will run again",
        "fix": "Fix or remove that line, or start over with --fresh (moves the file aside)",
        "not_header": "the first line is not a header; start over with --fresh"}
SERVING = {"read": read_records, "header": {"kind": "header", "schema": SERVING_SCHEMA},
           "record": {"kind": "gate", "family": FAMILY, "variant": "torch(kv=bf16)", "ok": True},
           "redone": "that record will be redone", "fix": "Fix or remove that line, or start over with --fresh",
           "not_header": (f"the first line is not a {SERVING_SCHEMA} header; is this a serving sweep's results "
                          "file? Start over with --fresh")}
READERS = pytest.mark.parametrize("reader", [TUNE, SERVING], ids=["tune", "serving"])


def _line(obj) -> bytes:
    return (json.dumps(obj) + "\n").encode()


@READERS
def test_a_torn_last_line_warns_and_repair_tail_cuts_it_once_but_a_damaged_line_or_header_raises(tmp_path, reader):
    """Naming the line and the fix, or the wrong header before it; a missing or empty file is nothing."""
    path = tmp_path / "r.jsonl"
    assert reader["read"](path) == (None, [], [])
    path.write_bytes(b"")
    assert reader["read"](path) == (None, [], [])
    torn, good = b'{"kind": "cand', _line(reader["header"]) + b"\n" + _line(reader["record"])
    path.write_bytes(good + torn)
    header, records, warnings = reader["read"](path)
    assert header == reader["header"] and records == [reader["record"]]  # the blank line skipped
    assert warnings == [f"{path}: ignoring a truncated last line ({len(torn)} bytes, a write cut short "
                        f"by a kill); {reader['redone']}"]
    assert repair_tail(path) and path.read_bytes() == good and not repair_tail(path)
    path.write_bytes(good + b"{not json\n")
    with pytest.raises(ResultsError) as info:
        reader["read"](path)
    exc = info.value
    assert isinstance(exc.__cause__, json.JSONDecodeError)
    assert str(exc) == (f"{path}, line 4: not valid JSON ({exc.__cause__}); the file was damaged or edited. "
                        f"{reader['fix']}")
    path.write_bytes(_line(reader["record"]) + b"{not json\n")
    with pytest.raises(ResultsError, match=f"^{re.escape(f'{path}: ' + reader['not_header'])}$"):
        reader["read"](path)


@pytest.mark.parametrize("record", [
    {"kind": "candidate", "shape": {"batch": 0, "kv_len": 4}, "variant": "torch(kv=bf16,q=bf16)", "status": "ok"},
    {"kind": "step", "shape": {"batch": 2, "kv_len": 17}, "status": "ok"},  # no variant
    {"kind": "rung", "shape": "2x17"},
])
def test_a_results_record_without_its_key_fields_is_one_line_naming_it(tmp_path, record):
    path = tmp_path / "r.jsonl"
    path.write_bytes(_line({"kind": "header"}) + _line(record) + _line({"kind": "note"}))
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
