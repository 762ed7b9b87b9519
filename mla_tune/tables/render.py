"""Plain-text views of a table, a sweep's results and a table diff, readable anywhere.

The same text goes to a terminal, a pipe, a file or a CI log: no box drawing, no colour, no
truncation, and no line wider than the width (the terminal's, from COLUMNS when set, else 80;
never below 80). The rules, which `show`, the sweep's summary and `diff` all follow:

- Numbers and shapes sit in a grid of right-aligned columns and are never broken; a
  column is as wide as its widest cell, and a number is formatted to at most 8 characters.
- Each shape's variant is printed in full on lines of its own, each line starting with the
  shape and the role (`4x1024  winner triton(block_n=64,...`). A variant longer than the
  width continues on the next line, broken only after a comma between parameters (a
  `k=v` is never split), and that line repeats the shape and role, indented two more
  spaces. So `grep num_splits=16` finds the line, and the line says whose variant it is.
- Free text (a reason, a path, a version list) wraps at spaces or commas the same way; a
  single word longer than the whole line is cut with `...` (only free text can hold one).
- Free text from a file is clipped to MAX_TEXT characters first, so a huge field in a
  tampered table prints a few lines, not megabytes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Sequence

MIN_WIDTH = 80
MAX_WIDTH = 200
MAX_TEXT = 400
CONTINUE_INDENT = 2


def line_width() -> int:
    """The width to fit: the terminal's (COLUMNS first), at least 80, at most 200; 80 in a pipe."""
    columns = shutil.get_terminal_size((MIN_WIDTH, 24)).columns
    return max(MIN_WIDTH, min(MAX_WIDTH, columns))


def clip(text: object, limit: int = MAX_TEXT) -> str:
    """`text` on one line (whitespace runs become one space), at most `limit` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _pieces(text: str, sep: str) -> list[str]:
    """Split after each `sep`, keeping it on the piece before: 'a,b,c' -> ['a,', 'b,', 'c']."""
    parts = text.split(sep)
    return [p + sep for p in parts[:-1]] + [parts[-1]]


def wrap(lead: str, text: str, width: int, sep: str = " ") -> list[str]:
    """`lead` + `text` in lines of at most `width`, broken only after `sep`; continuation
    lines repeat `lead` and indent CONTINUE_INDENT more (see the module docstring)."""
    lines: list[str] = []
    current = ""
    for piece in _pieces(text, sep):
        prefix = lead + (" " * CONTINUE_INDENT if lines else "")
        room = width - len(prefix)
        if current and len(current) + len(piece.rstrip()) > room:
            lines.append(prefix + current.rstrip())
            current = ""
            prefix = lead + " " * CONTINUE_INDENT
            room = width - len(prefix)
        if not current and len(piece.rstrip()) > room:  # one word longer than a line: cut
            piece = piece[: max(room - 3, 1)] + "..."
        current += piece
    if current or not lines:
        prefix = lead + (" " * CONTINUE_INDENT if lines else "")
        lines.append(prefix + current.rstrip())
    return lines


def fit_lines(lines: Iterable[str], width: int | None = None) -> list[str]:
    """Each line at most `width` wide (default `line_width()`): a longer one broken at spaces
    (`wrap`), its leading spaces its lead, its continuation lines indented two more."""
    width = width or line_width()
    out: list[str] = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
        else:
            text = line.lstrip(" ")
            out += wrap(line[: len(line) - len(text)], text, width)
    return out


def fitting(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` with each message fitted to the width first (`fit_lines`): the printer of the
    serving dry run, verify and rescore, which log plain lines."""
    def fitted(text: str) -> None:
        for line in fit_lines(text.split("\n")):
            log(line)
    return fitted


def variant_lines(lead: str, variant_text: str, width: int) -> list[str]:
    """A variant's full text after `lead`, broken only between parameters."""
    return wrap(lead, variant_text, width, sep=",")


def grid(headers: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1) -> list[str]:
    """Rows of cells under headers, the first `left` columns left-aligned, the rest right."""
    rows = [list(r) for r in rows]
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        out = [str(c).ljust(w) if i < left else str(c).rjust(w)
               for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    return [line(headers)] + [line(r) for r in rows]


# ------------------------------------------------------------------------ number cells
def us(value: float | None) -> str:
    """A time in microseconds, at most 8 characters: 14.7, 36558, 1.23e+07."""
    if value is None:
        return "-"
    if value < 1000:
        return f"{value:.1f}"
    if value < 1e7:
        return f"{value:.0f}"
    return f"{value:.2e}"


def share(value: float | None) -> str:
    """A fraction as a percentage, at most 7 characters: 3.9%, 250%, >9999%."""
    if value is None:
        return "-"
    if abs(value) >= 100:
        return ">9999%" if value > 0 else "<-9999%"
    return f"{value:.1%}" if abs(value) < 10 else f"{value:.0%}"


def ratio(value: float | None) -> str:
    """A speedup like 2.00x, at most 8 characters."""
    if value is None:
        return "-"
    return f"{value:.2f}x" if value < 1000 else f"{value:.2e}x"


def counts_cell(counts: dict) -> str:
    """ok/pruned/bad: timed, pruned as hopeless, and rejected+failed+crashed+timeout."""
    bad = sum(int(counts.get(s) or 0) for s in ("rejected", "failed", "crashed", "timeout"))
    return f"{int(counts.get('ok') or 0)}/{int(counts.get('pruned') or 0)}/{bad}"


LEGEND = ("spread: (p90-p10)/median; 2nd: runner-up; speedup: torch/winner; floor: share of "
          "the copy-bandwidth floor; bad: rejected+failed+crashed+timeout")


# ----------------------------------------------------------------------------- show
def prior_lines(table, width: int) -> list[str]:
    """`mla-tune show` of a prior: it says so, then each shape's choice and where it came from
    (no grid: nothing in a prior was measured)."""
    rows = sorted(table.rows.items())
    prov = table.provenance
    lines = wrap("", f"{clip(table.path)}: {clip(table.gpu, 40)}, {len(rows)} shapes, a PRIOR: choices "
                     "made without measuring, no times", width)
    lines += wrap("  ", f"from {clip(prov.get('source') or '-')}", width)
    shape_width = max((len(str(s)) for s, _ in rows), default=5)
    lines.append("choices:")
    for shape, row in rows:
        lead = f"  {str(shape).ljust(shape_width)}  "
        lines += variant_lines(lead + "prior ", row.winner["variant"], width)
        prior = row.prior or {}
        lines += wrap(lead + "from  ", f"{clip(prior.get('source'), 60)}: {clip(prior.get('note') or '-')}", width)
    rule = prov.get("rule") or {}
    lines.append("provenance:")
    lines += wrap("  written: ", f"{clip(prov.get('date'), 60)} for {clip(prov.get('arch'), 40)}", width)
    lines += wrap("  rule: ", f"{clip(rule.get('name'), 40)} rtol={rule.get('rtol')} atol={rule.get('atol')} "
                             f"allowance={rule.get('allowance')}", width)
    lines += wrap("", f"Shapes not listed run the fallback. For measured choices run `mla-tune sweep "
                      f"--gpu {clip(table.gpu, 40)}` on that GPU.", width)
    return lines


def table_lines(table, width: int) -> list[str]:
    """`mla-tune show`: the grid of rows, each winner's variant, the provenance, a legend
    (a prior: prior_lines)."""
    if getattr(table, "is_prior", False):
        return prior_lines(table, width)
    rows = sorted(table.rows.items())
    about = f"{clip(table.gpu, 40)}, {len(rows)} shapes, median times in us"
    lines = [f"{clip(table.path)}: {about}"]
    if len(lines[0]) > width:  # a long path: on its own lines, broken after a '/'
        lines = [*wrap("", f"{clip(table.path)}:", width, sep="/"), about]
    cells = []
    for shape, row in rows:
        speedup = (row.baseline_us / row.time_us
                   if row.winner and row.baseline_us and row.time_us else None)
        cells.append([str(shape), us(row.time_us), share(row.spread),
                      us((row.runner_up or {}).get("time_us")), us(row.baseline_us),
                      ratio(speedup), share(row.floor_share), counts_cell(row.candidates)])
    lines += grid(["shape", "time", "spread", "2nd", "torch", "speedup", "floor", "ok/pruned/bad"],
                  cells)
    shape_width = max((len(str(s)) for s, _ in rows), default=5)
    lines.append("winners:")
    for shape, row in rows:
        lead = f"  {str(shape).ljust(shape_width)} winner "
        if row.winner is None:
            lines += wrap(lead, f"none: {clip(row.reason)}; the fallback serves it", width)
        else:
            lines += variant_lines(lead, row.winner["variant"], width)
    prov = table.provenance
    rule, config = prov.get("rule") or {}, prov.get("config") or {}
    versions = ", ".join(f"{clip(k, 60)} {clip(v, 60)}" for k, v in (prov.get("versions") or {}).items() if v)
    lines.append("provenance:")
    for key, text, sep in (
        ("device", f"{clip(prov.get('device_name'), 80)} ({clip(prov.get('arch'), 40)}), driver "
                   f"{clip(prov.get('driver') or '-', 60)}", " "),
        ("versions", versions or "-", ", "),
        ("tuned", f"{clip(prov.get('date'), 60)} with mla-tune {clip(prov.get('mla_tune_version'), 40)}", " "),
        ("config", f"{clip(config.get('path'), 200)} (hash {clip(config.get('hash'), 200)[:12]})", " "),
        ("rule", f"{clip(rule.get('name'), 40)} rtol={rule.get('rtol')} atol={rule.get('atol')} "
                 f"allowance={rule.get('allowance')}", " "),
        ("timing", f"{clip((prov.get('protocol') or {}).get('name', '-'), 60)}; copy bandwidth "
                   f"{prov.get('copy_bandwidth_gbps') or '-'} GB/s", " "),
    ):
        lines += wrap(f"  {key}: ", text, width, sep=sep)
    lines += wrap("", LEGEND, width)
    return lines


# ---------------------------------------------------------------------- sweep summary
BAD_STATUSES = ("rejected", "failed", "crashed", "timeout")


def _record_shape(record: dict) -> str | None:
    try:
        return f"{int(record['shape']['batch'])}x{int(record['shape']['kv_len'])}"
    except (KeyError, TypeError, ValueError):
        return None


def summary_lines(records: list[dict], baseline: str, width: int) -> tuple[list[str], dict]:
    """The sweep's summary: per shape its winner, time, runner-up, baseline and counts, then
    each winner's variant; returns (lines, {shape text: {variant, median_us}})."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    unreadable = 0
    for record in records:
        name = _record_shape(record)
        if name is None or not isinstance(record.get("variant"), str):
            unreadable += 1
            continue
        batch, kv_len = (int(x) for x in name.split("x"))
        by_shape.setdefault((batch, kv_len), []).append(record)

    def median(record: dict) -> float:
        return float(record["time"]["median_us"])

    cells, winners = [], {}
    for key in sorted(by_shape):
        rows = by_shape[key]
        name = f"{key[0]}x{key[1]}"
        ok = sorted((r for r in rows if r.get("status") == "ok" and isinstance(r.get("time"), dict)
                     and isinstance(r["time"].get("median_us"), (int, float))),
                    key=lambda r: (median(r), r["variant"]))
        base = [r for r in ok if r.get("backend") == baseline]
        if ok:
            winners[name] = {"variant": ok[0]["variant"], "median_us": median(ok[0])}
        counts = {s: sum(r.get("status") == s for r in rows) for s in ("ok", "pruned", *BAD_STATUSES)}
        cells.append([name, ok[0]["variant"].split("(")[0] if ok else "-",
                      us(median(ok[0])) if ok else "-",
                      us(median(ok[1])) if len(ok) > 1 else "-",
                      ok[1]["variant"].split("(")[0] if len(ok) > 1 else "-",
                      us(median(base[0])) if base else "-", counts_cell(counts)])
    lines = ["sweep summary (times in us, median):"]
    lines += grid(["shape", "winner", "time", "2nd", "2nd by", baseline, "ok/pruned/bad"], cells,
                  left=2)
    shape_width = max((len(c[0]) for c in cells), default=5)
    for name, *_ in cells:
        lead = f"  {name.ljust(shape_width)}  winner "
        if name in winners:
            lines += variant_lines(lead, winners[name]["variant"], width)
        else:
            lines.append(lead + "none: no candidate passed the gate and was timed")
    if unreadable:
        lines.append(f"  {unreadable} record(s) without a readable shape or variant were left out")
    return lines, winners
