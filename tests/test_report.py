"""`mla-tune report` (Markdown without matplotlib; plots when it is installed) and the
plain-text rendering rules shared by show, diff and the sweep's summary."""

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from mla_tune.core import Shape
from mla_tune.report import (
    ReportError,
    param_curves,
    read_candidates,
    report_markdown,
    write_report,
)
from mla_tune.tables.render import summary_lines, variant_lines, wrap
from mla_tune.tables.table import load_table
from mla_tune.tune.progress import summarize
from mla_tune.tune.results import read_results
from tests.helpers import CPU_TABLE, REPO

H200_RESULTS = REPO / "tables" / "H200.results.jsonl"
# the H200 table and results before the budgeted search: fixed numbers for exact assertions
H200_FIXED = REPO / "tests" / "data" / "H200.pre-search.yaml"
H200_FIXED_RESULTS = REPO / "tests" / "data" / "H200.pre-search.results.jsonl"


def _images(text: str) -> list[str]:
    """The files a report's Markdown links as images."""
    return [line.split("](")[1].rstrip(")") for line in text.splitlines() if line.startswith("![")]


def test_the_markdown_has_every_shape_its_floor_backends_and_curves_or_says_what_is_missing_or_unreadable(
        monkeypatch, tmp_path):
    """Unreadable: a record without a shape or backend, or a prior; docs/report is the committed table's."""
    table = load_table(H200_FIXED, check_params=False)
    candidates = read_candidates(H200_FIXED_RESULTS)
    text = report_markdown(table, candidates, plots={})
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("| 4x1024 |"))
    # winner, time, spread, floor, share, then flashinfer flashmla torch triton triton_fused
    assert row == "| 4x1024 | triton | 14.7 | 3.9% | 0.56 | 3.8% | 17.5 | 18.7 | 29.3 | 14.7 | 15.5 |"
    for shape, r in table.rows.items():
        assert f"- {shape}: `{r.winner['variant']}`" in lines and f"### {shape}" in lines
    assert "![" not in text  # no plots drawn, none linked
    # the curve tables: each value's best time over the backend's other parameters
    curve = param_curves(candidates, Shape(4, 1024), "num_splits")
    best_16 = min(c["median_us"] for c in candidates if c["shape"] == Shape(4, 1024)
                  and c["backend"] == "triton" and c["params"].get("num_splits") == 16)
    assert dict(curve["triton"])[16] == best_16 == table.rows[Shape(4, 1024)].time_us
    assert "flashmla" not in curve  # it has no num_splits
    # without a results file: says what is left out
    text = report_markdown(load_table(CPU_TABLE, check_params=False), None, plots={})
    assert "No results file next to the table" in text and "| 3x16 | none |" in text
    # `mla-tune report --gpu H200` run from the repository root wrote docs/report/ for the committed table
    monkeypatch.chdir(REPO)
    report = Path("docs/report/report.md")
    text = report.read_text()
    keys = {"time_per_shape.png": "time", "bandwidth_share.png": "share"}
    linked = {keys.get(n, "params " + n.removeprefix("params_").removesuffix(".png")): n
              for n in _images(text)}
    table = load_table(Path("tables/H200.yaml"), check_params=False)
    assert text == report_markdown(table, read_candidates(H200_RESULTS), plots=linked)
    for name in linked.values():
        assert (report.parent / name).is_file()
    # a results record without a shape or a backend is one line naming it
    results = tmp_path / "r.jsonl"
    good = {"kind": "candidate", "shape": {"batch": 1, "kv_len": 8}, "backend": "torch",
            "variant": "torch(kv=bf16,q=bf16)", "status": "ok", "params": {}, "time": {"median_us": 3.0}}
    # no shape: the results reader refuses it, naming the line (results.read_results checks
    # shapes); no backend: the reader passes it but the report cannot use it
    for left_out, message in (("shape", r"line 3: a candidate record without a valid shape"),
                              ("backend", r"candidate record 2: missing or malformed 'backend'")):
        bad = {k: v for k, v in good.items() if k != left_out}
        results.write_text("\n".join(json.dumps(r) for r in ({"kind": "header"}, good, bad)) + "\n")
        with pytest.raises(ReportError, match=message) as info:
            read_candidates(results)
        assert "\n" not in str(info.value)
    # a prior has no times: refused by name, nothing written
    with pytest.raises(ReportError, match="is a prior .* it has no times to report"):
        write_report(REPO / "configs" / "priors" / "MI355X.yaml", tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_write_report_draws_the_plots_and_links_them(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (the `report` extra) is not installed: "
                                             "the plots cannot be drawn here")
    table = tmp_path / "H200.yaml"
    table.write_text((REPO / "tables" / "H200.yaml").read_text())
    (tmp_path / "H200.results.jsonl").write_text(H200_RESULTS.read_text())
    out = write_report(table, tmp_path / "report")
    text = out.read_text()
    images = _images(text)
    assert "time_per_shape.png" in images and "bandwidth_share.png" in images
    assert len(images) == 2 + 8  # one time-against-parameters plot per shape
    for name in images:
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrapping_never_splits_a_parameter_and_the_sweep_summary_has_full_winners_in_80_columns(monkeypatch):
    text = "triton_fused(" + ",".join(f"param_{i}=value_{i}" for i in range(12)) + ")"
    lines = variant_lines("  4x1024  winner ", text, 60)  # each line repeats the lead
    assert all(len(line) <= 60 and line.startswith("  4x1024  winner ") for line in lines)
    assert "".join(line[len("  4x1024  winner "):].strip() for line in lines) == text
    for i in range(12):
        assert sum(f"param_{i}=value_{i}" in line for line in lines) == 1
    assert wrap("x: ", "a" * 300, 80) == ["x: " + "a" * 74 + "..."]  # one huge word: cut
    _header, records, _ = read_results(H200_FIXED_RESULTS)
    records.append({"kind": "candidate", "variant": "torch(kv=bf16,q=bf16)", "status": "ok"})  # no shape
    records.append({"kind": "candidate", "shape": {"batch": 2, "kv_len": 17}, "status": "rejected",
                    "variant": "torch(kv=bf16,q=bf16)", "backend": "torch"})
    lines, winners = summary_lines(records, "torch", 80)
    assert max(map(len, lines)) <= 80 and "…" not in "".join(lines)
    assert winners["4x1024"]["variant"].startswith("triton(block_n=64")
    for shape, winner in winners.items():
        mine = [line for line in lines if line.split()[:2] == [shape, "winner"]]
        assert "".join(line.split(maxsplit=2)[2].strip() for line in mine) == winner["variant"]
    assert "  2x17      winner none: no candidate passed the gate and was timed" in lines
    assert lines[-1] == "  1 record(s) without a readable shape or variant were left out"
    # summarize prints it through the sweep's console, without escape codes
    monkeypatch.setenv("COLUMNS", "80")
    _header, records, _ = read_results(H200_RESULTS)
    buffer = io.StringIO()
    winners = summarize(records, Console(file=buffer, width=80, force_terminal=False))
    out = buffer.getvalue()
    assert out.startswith("sweep summary") and "\x1b[" not in out
    assert max(map(len, out.splitlines())) <= 80 and len(winners) == 8
