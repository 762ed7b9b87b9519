"""`mla-tune diff OLD NEW`: what changed between two tables, shape by shape.

Per shape: whether the winner changed, the winner's time before and after, and whether the
time change is outside the noise. The noise is what both tables record: the larger of the
two rows' spreads ((p90 - p10) / median), and never less than the table's tie tolerance
(1%), so a change inside it is what a re-run of the same sweep could give. `noise`,
`time_change` and `flag_text` are that rule, which the serving tables' diff
(mla_tune/serving/render.py) follows too.
"""

from __future__ import annotations

from pathlib import Path

from mla_tune.tables.render import clip, grid, share, us, variant_lines, wrap
from mla_tune.tables.table import TIE_TOLERANCE, Row, Table


def noise(*spreads: float | None) -> float:
    """The noise of a time change: the largest of the spreads recorded (None: not recorded),
    never less than the tie tolerance."""
    return max([TIE_TOLERANCE, *(s for s in spreads if s is not None)])


def time_change(old_us: float | None, new_us: float | None,
                noise_share: float) -> tuple[float | None, bool]:
    """(new / old - 1, whether that is outside the noise); (None, False) without both times."""
    if not old_us or not new_us:
        return None, False
    change = new_us / old_us - 1.0
    return change, abs(change) > noise_share


def flag_text(change: float | None, flagged: bool) -> str:
    """The diff's flag column: SLOWER or FASTER outside the noise, else within noise
    (blank without a change)."""
    if not flagged:
        return "" if change is None else "within noise"
    return "SLOWER" if change > 0 else "FASTER"


def _change(old: Row | None, new: Row | None) -> dict:
    old_text = None if old is None or old.winner is None else old.winner["variant"]
    new_text = None if new is None or new.winner is None else new.winner["variant"]
    entry = {
        "old_winner": old_text, "new_winner": new_text,
        "old_us": None if old is None else old.time_us,
        "new_us": None if new is None else new.time_us,
        "change": None, "noise": None, "flagged": False,
    }
    if old is None or new is None:
        entry["status"] = "only in new" if old is None else "only in old"
        return entry
    entry["status"] = "same winner" if old_text == new_text else "winner changed"
    if old.time_us and new.time_us:
        share = noise(old.spread, new.spread)
        change, flagged = time_change(old.time_us, new.time_us, share)
        entry.update(change=round(change, 4), noise=round(share, 4), flagged=flagged)
    return entry


def diff_tables(old: Table, new: Table) -> list[dict]:
    """One entry per shape in either table, sorted by shape (see the module docstring)."""
    shapes = sorted(set(old.rows) | set(new.rows))
    return [{"shape": str(s), **_change(old.rows.get(s), new.rows.get(s))} for s in shapes]


def diff_lines(changes: list[dict], old_path: Path, new_path: Path, width: int) -> list[str]:
    """The text view of diff_tables: a grid, then the old and new winner of changed shapes."""
    changed = [c for c in changes if c["status"] != "same winner"]
    flagged = [c for c in changes if c["flagged"]]
    lines = [*wrap("old: ", clip(old_path), width), *wrap("new: ", clip(new_path), width)]
    lines += wrap("", f"{len(changes)} shapes: {len(changed)} with another winner (or only in "
                  f"one table), {len(flagged)} with a time change outside the noise; times in us",
                  width)
    cells = [[c["shape"], us(c["old_us"]), us(c["new_us"]),
              "-" if c["change"] is None else f"{c['change']:+.1%}",
              "-" if c["noise"] is None else share(c["noise"]), flag_text(c["change"], c["flagged"]), c["status"]]
             for c in changes]
    lines += grid(["shape", "old", "new", "change", "noise", "flag", "winner"], cells)
    shape_width = max((len(c["shape"]) for c in changes), default=5)
    for c in changed:
        for role, text in (("old", c["old_winner"]), ("new", c["new_winner"])):
            if c["status"] == f"only in {'new' if role == 'old' else 'old'}":
                continue
            lead = f"  {c['shape'].ljust(shape_width)}  {role} "
            lines += variant_lines(lead, text, width) if text else [lead + "none"]
    return lines
