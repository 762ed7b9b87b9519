"""The serving sweep's results file: one JSON object per line, appended as it goes.

`tables/NAME.serving.results.jsonl` (a shard's: `NAME.serving.shard-I-of-N.results.jsonl`)
starts with a header (schema, config path and hash, GPU, shard, versions, protocol), then
one record per event, each written whole in one write and flushed, so a killed sweep (kill
-9 included: the data is the kernel's once written) loses at most the line in flight; a
torn last line is dropped with a warning and cut off before the next append
(results.repair_tail). A sweep makes ~50 000 measurements, so the file is fsynced at each
cell, graph pick and at the end, not per line as tune/results.py's ResultsWriter does
(an fsync costs milliseconds): a machine crash loses at most the cell in flight. Kinds:

  gate   a candidate's gate for a family: ok, reason (crashed: / timeout: when its worker
         process died or was killed), the probes' mismatch and max error
  step   one measurement: family, batch, kv_len, variant, samples, status (ok | failed |
         crashed: it killed its worker process | timeout: its worker was killed at the limit |
         pruned: a first-rung probe over PRUNE_FACTOR x the cell's best, with probe_us),
         time {median_us, p10_us, p90_us, samples} or error
  cell   a cell's outcome: winner, time_us, runner_up, top (its best by the last rung),
         seeds (the neighbours' winners it started from), entrants per rung; or
         status failed with a reason when every candidate failed there
  graph  a batch bucket's CUDA-graph pick: variant, worst_regret, worst_kv_len, the union
         timed, the kv cells it was chosen over

Resume reads every record: a gate, step, cell or graph already recorded is never redone,
and the search replays its decisions from the recorded (rounded) times, so a resumed
sweep decides exactly as an uninterrupted one would have.
"""

from __future__ import annotations

import json
from pathlib import Path

from mla_tune.fileio import LineLog
from mla_tune.serving.table import FamilyKey
from mla_tune.tune.results import RESUME_NOTE, ResultsError, read_json_lines, repair_tail

SCHEMA = "serving-results/1"
KINDS = ("gate", "step", "cell", "graph")


def results_path_for(table_path: Path, shard: tuple[int, int] = (1, 1)) -> Path:
    """tables/H200.serving.yaml -> tables/H200.serving.results.jsonl (shard 2/4:
    tables/H200.serving.shard-2-of-4.results.jsonl)."""
    stem = table_path.name.removesuffix(".yaml")
    if shard != (1, 1):
        stem += f".shard-{shard[0]}-of-{shard[1]}"
    return table_path.with_name(stem + ".results.jsonl")


def family_of(record: dict) -> FamilyKey:
    raw = record["family"]
    return FamilyKey(raw["kv_format"], raw["page_size"], raw["heads"], raw["q_len"])


def read_records(path: Path) -> tuple[dict | None, list[dict], list[str]]:
    """(header, records, warnings); a missing file gives (None, [], []). A torn last line
    is ignored with a warning; a bad line elsewhere means the file was damaged or edited,
    which resume cannot trust: that raises, saying what to do."""
    lines, warnings = read_json_lines(path, redone="that record will be redone",
                                      fix="Fix or remove that line, or start over with --fresh")
    header, records = None, []
    for number, obj in lines:
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if number == 1:
            if kind != "header" or obj.get("schema") != SCHEMA:
                raise ResultsError(f"{path}: the first line is not a {SCHEMA} header; is this a serving "
                                   "sweep's results file? Start over with --fresh")
            header = obj
        elif kind not in KINDS or not isinstance(obj.get("family"), dict):
            raise ResultsError(f"{path}, line {number}: not a serving record (kind {kind!r}); "
                               "start over with --fresh")
        else:
            records.append(obj)
    return header, records, warnings


class Records:
    """The records of one or more results files, indexed for the sweep and the table."""

    def __init__(self, records: list[dict] | None = None):
        self.gates: dict[tuple, dict] = {}
        self.steps: dict[tuple, dict] = {}
        self.cells: dict[tuple, dict] = {}
        self.graphs: dict[tuple, dict] = {}
        for r in records or []:
            self.add(r)

    @staticmethod
    def step_key(key: FamilyKey, batch: int, kv_len: int, variant: str, samples: int) -> tuple:
        return (key, batch, kv_len, variant, samples)

    def add(self, r: dict) -> None:
        key = family_of(r)
        kind = r["kind"]
        if kind == "gate":
            self.gates.setdefault((key, r["variant"]), r)
        elif kind == "step":
            self.steps.setdefault(self.step_key(key, r["batch"], r["kv_len"], r["variant"], r["samples"]), r)
        elif kind == "cell":
            self.cells.setdefault((key, r["batch"], r["kv_len"]), r)
        elif kind == "graph":
            self.graphs.setdefault((key, r["batch"]), r)


class Recorder:
    """The results file a sweep appends to, with the records already there."""

    def __init__(self, path: Path, header: dict, log=print):
        self.path = path
        old_header, records, warnings = read_records(path)
        for warning in warnings:
            log(f"warning: {warning}")
        if old_header is not None:
            for field in ("config_hash", "gpu", "shard"):
                if old_header.get(field) != header.get(field):
                    raise ResultsError(
                        f"{path} was written with {field} {old_header.get(field)!r}, this sweep has "
                        f"{header.get(field)!r}; resume needs the same config, GPU and shard. Start over "
                        "with --fresh (moves the file aside) or pass another --out")
        repair_tail(path)
        self.records = Records(records)
        self.header = old_header or header
        self.resumed = old_header is not None
        self._log = LineLog(path, RESUME_NOTE)  # a failed write: one line, no torn record
        if old_header is None:
            self.append(header, durable=True)

    def append(self, record: dict, durable: bool = False) -> dict:
        """Write one record (one write of one line, flushed; fsynced when `durable`), then
        index it: only what is in the file counts."""
        self._log.append((json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode(), durable)
        if record.get("kind") != "header":
            self.records.add(record)
        return record

    def close(self) -> None:
        self._log.close()
