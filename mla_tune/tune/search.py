"""Successive halving, the one implementation both sweeps use, and a leaderboard shape's
state re-derived from the results file.

Rung 0: every candidate passes the gate and gets rungs[0] samples. After each rung but the
last, `promote` keeps the best fraction (never fewer than min_keep), the carried candidates
(the serving sweep's neighbour winners: never cut before the last rung), and for the
leaderboard each backend's best (tables keep it as `alternates`, for restricted exports)
and the baseline; the rest are recorded as cut. The last rung is the full timing (and, on
the leaderboard, the wall-time figure). `ranked` is the order both sweeps rank a rung by:
time, then the candidate's place in the plan (`Timed.rank`), then its text.

Results-file kinds this module reads and the sweep writes (docs/architecture.md):
  step       a candidate timed at a rung before its last (status ok), with `rung`, `samples`
  rung       a rung's decision for a shape: `kept` (variant texts), `cut_budget`, `skipped`
  candidate  a candidate's final outcome (as in older files, plus `rung`): ok after the
             last rung, pruned when a rung cut it, or rejected/failed/crashed/timeout
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mla_tune.core import Shape, Variant
from mla_tune.tune.results import candidate_key


def key_of(shape: Shape, text: str) -> tuple:
    return candidate_key({"batch": shape.batch, "kv_len": shape.kv_len}, text)


@dataclass
class Timed:
    text: str  # the variant as built (fp8_static with its q_amax)
    backend: str
    median_us: float
    rank: int = 0  # its place in the plan: breaks ties of time before the text does


def ranked(timed: list[Timed]) -> list[Timed]:
    """Best first: by time, then place in the plan, then text."""
    return sorted(timed, key=lambda t: (t.median_us, t.rank, t.text))


def survivors(n: int, keep: float, min_keep: int) -> int:
    """How many of n timed candidates a rung keeps by time: the best `keep` fraction,
    never fewer than min_keep, never more than n."""
    return min(n, max(min_keep, math.ceil(keep * n)))


def promote(timed: list[Timed], keep: float, min_keep: int, baseline: str | None,
            carried: tuple[str, ...] | list[str] = (), each_backend: bool = True) -> tuple[list[str], list[str], int]:
    """(the texts to promote in priority order, the texts cut, how many of the first the
    budget may not cut). First the baseline, the overall best and the `carried` texts that
    were timed (never cut), then each backend's best (with `each_backend`), then the best
    fraction (never fewer than min_keep)."""
    order_ = ranked(timed)
    if not order_:
        return [], [], 0
    n = survivors(len(order_), keep, min_keep)
    must = [t.text for t in order_ if baseline is not None and t.backend == baseline]
    if order_[0].text not in must:
        must.append(order_[0].text)
    texts = {t.text for t in order_}
    must += [text for text in dict.fromkeys(carried) if text in texts and text not in must]
    order = list(must)
    best_per_backend: dict[str, str] = {}
    if each_backend:
        for t in order_:
            best_per_backend.setdefault(t.backend, t.text)
    for text in list(best_per_backend.values()) + [t.text for t in order_[:n]]:
        if text not in order:
            order.append(text)
    return order, [t.text for t in order_ if t.text not in order], len(must)


@dataclass
class ShapeSearch:
    """One shape's progress through the rungs, rebuilt from results records on resume."""

    shape: Shape
    planned: list[Variant]
    n_rungs: int
    steps: dict[int, dict[tuple, dict]] = field(default_factory=dict)  # rung -> key -> step record
    finals: dict[tuple, dict] = field(default_factory=dict)  # key -> final candidate record
    decisions: dict[int, dict] = field(default_factory=dict)  # rung -> rung record
    first_step: dict[tuple, dict] = field(default_factory=dict)  # key -> rung-0 record (checks)

    @classmethod
    def from_records(cls, shape: Shape, planned: list[Variant], n_rungs: int, records: list[dict]):
        s = cls(shape, list(planned), n_rungs)
        here = {"batch": shape.batch, "kv_len": shape.kv_len}
        for r in records:
            if r.get("shape") != here:
                continue
            kind = r.get("kind", "candidate")
            if kind == "rung":
                s.decisions[int(r["rung"])] = r
                continue
            key = key_of(shape, r["variant"])
            if kind == "step":
                s.steps.setdefault(int(r["rung"]), {})[key] = r
            elif kind == "candidate":
                s.finals[key] = r
            if int(r.get("rung") or 0) == 0 and kind in ("step", "candidate") and "samples" in r:
                s.first_step.setdefault(key, r)
        return s

    def entrants(self, rung: int) -> list[str]:
        """The variant texts that enter `rung` (as built, for rungs after the first)."""
        if rung == 0:
            return [str(v) for v in self.planned]
        return list(self.decisions[rung - 1]["kept"])

    def pending(self, rung: int) -> list[str]:
        done = set(self.steps.get(rung, {}))
        out = []
        for text in self.entrants(rung):
            key = key_of(self.shape, text)
            final = self.finals.get(key)
            if key in done or (final is not None and int(final.get("rung", 0)) <= rung) or (
                    final is not None and "rung" not in final):  # an older file's final record
                continue
            out.append(text)
        return out

    def start_rung(self) -> int:
        """The first rung without a decision (the last rung never has one)."""
        rung = 0
        while rung < self.n_rungs - 1 and rung in self.decisions:
            rung += 1
        return rung

    def timed(self, rung: int) -> list[Timed]:
        """The entrants' times at `rung`, less those that ended there or before (cut, failed);
        one that went on to a later rung counts (a re-opened rung is decided again)."""
        out = []
        entrants = {key_of(self.shape, t) for t in self.entrants(rung)}
        for key, r in self.steps.get(rung, {}).items():
            final = self.finals.get(key)
            if key in entrants and r["status"] == "ok" and (final is None or int(final.get("rung") or 0) > rung):
                out.append(Timed(r["variant"], r["backend"], r["time"]["median_us"]))
        return out

    def undecided_cuts(self, rung: int) -> list[dict]:
        """Step records of candidates rung `rung` did not keep that have no final record
        yet (the sweep was stopped between the decision and those lines)."""
        kept = {key_of(self.shape, t) for t in self.decisions[rung]["kept"]}
        return [r for key, r in self.steps.get(rung, {}).items()
                if key not in kept and key not in self.finals and r["status"] == "ok"]

    def best(self) -> tuple[float, str] | None:
        """The best time so far (at the highest rung measured) and its variant."""
        ok = [(r["time"]["median_us"], r["variant"]) for r in self.finals.values() if r["status"] == "ok"]
        if ok:
            return min(ok)
        for rung in sorted(self.steps, reverse=True):
            timed = [(r["time"]["median_us"], r["variant"]) for r in self.steps[rung].values()
                     if r["status"] == "ok"]
            if timed:
                return min(timed)
        return None
