"""Both results readers on a torn, a damaged and a wrong first line: messages, word for word."""

from __future__ import annotations

import json
import re

import pytest

from mla_tune.serving.results import SCHEMA as SERVING_SCHEMA
from mla_tune.serving.results import read_records
from mla_tune.tune.results import ResultsError, read_results

FAMILY = {"kv_format": "bf16", "page_size": 1, "heads": 16, "q_len": 1}
TUNE = {
    "read": read_results,
    "header": {"kind": "header"},
    "record": {"kind": "candidate", "shape": {"batch": 2, "kv_len": 17}, "variant": "torch(kv=bf16,q=bf16)"},
    "redone": "that candidate will run again",
    "fix": "Fix or remove that line, or start over with --fresh (moves the file aside)",
    "not_header": "the first line is not a header; start over with --fresh",
}
SERVING = {
    "read": read_records,
    "header": {"kind": "header", "schema": SERVING_SCHEMA},
    "record": {"kind": "gate", "family": FAMILY, "variant": "torch(kv=bf16)", "ok": True},
    "redone": "that record will be redone",
    "fix": "Fix or remove that line, or start over with --fresh",
    "not_header": (f"the first line is not a {SERVING_SCHEMA} header; is this a serving sweep's results "
                   "file? Start over with --fresh"),
}
READERS = pytest.mark.parametrize("reader", [TUNE, SERVING], ids=["tune", "serving"])


def _line(obj) -> bytes:
    return (json.dumps(obj) + "\n").encode()


@READERS
def test_a_missing_or_empty_file_reads_as_nothing(tmp_path, reader):
    path = tmp_path / "r.jsonl"
    assert reader["read"](path) == (None, [], [])
    path.write_bytes(b"")
    assert reader["read"](path) == (None, [], [])


@READERS
def test_a_torn_last_line_is_left_out_with_one_warning(tmp_path, reader):
    path = tmp_path / "r.jsonl"
    torn = b'{"kind": "cand'
    path.write_bytes(_line(reader["header"]) + b"\n" + _line(reader["record"]) + torn)
    header, records, warnings = reader["read"](path)
    assert header == reader["header"] and records == [reader["record"]]  # the blank line skipped
    assert warnings == [f"{path}: ignoring a truncated last line ({len(torn)} bytes, a write cut short "
                        f"by a kill); {reader['redone']}"]
    assert path.read_bytes().endswith(torn)  # reading never writes: repair_tail cuts it


@READERS
def test_a_damaged_line_raises_naming_it_and_the_fix_a_wrong_header_before_it(tmp_path, reader):
    path = tmp_path / "r.jsonl"
    path.write_bytes(_line(reader["header"]) + _line(reader["record"]) + b"{not json\n")
    with pytest.raises(ResultsError) as info:
        reader["read"](path)
    exc = info.value
    assert isinstance(exc.__cause__, json.JSONDecodeError)
    assert str(exc) == (f"{path}, line 3: not valid JSON ({exc.__cause__}); the file was damaged or edited. "
                        f"{reader['fix']}")
    path.write_bytes(_line(reader["record"]) + b"{not json\n")
    with pytest.raises(ResultsError, match=f"^{re.escape(f'{path}: ' + reader['not_header'])}$"):
        reader["read"](path)
