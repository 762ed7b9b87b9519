"""One device's share of the sweep: its shapes, rung by rung, through its worker.

Per shape: rung 0 runs every planned candidate (gate, then rungs[0] samples) unless the
budget cannot cover it (the baseline always runs); after each rung but the last the
survivors are chosen (search.promote), trimmed to what the shape's share of the budget
covers, and recorded; the last rung times them in full. Every finished step is one fsynced
line, so a resumed sweep re-derives where each shape stood; a resume with time for what
rung 0 skipped times it and decides the rungs again, keeping what they kept (`_reopen`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape

from mla_tune.backends import baseline_backend
from mla_tune.core import Shape, Variant
from mla_tune.tune.config import Config
from mla_tune.tune.progress import Progress
from mla_tune.tune.results import ResultsWriter
from mla_tune.tune.schedule import (
    BudgetClock,
    CostModel,
    FittedPlan,
    compile_class,
    survivors_after,
    wall_samples,
)
from mla_tune.tune.search import ShapeSearch, key_of, promote
from mla_tune.tune.worker import (
    Step,
    StepResult,
    WorkerGone,
    WorkerHandle,
    WorkerTimeout,
    signal_name,
)


@dataclass
class Shared:
    """What the device threads share; `lock` guards the writer, records, costs, progress."""

    config: Config
    rungs: tuple[int, ...]
    timeout: float
    writer: ResultsWriter
    clock: BudgetClock
    costs: CostModel
    console: Console
    progress: Progress
    records: list[dict] = field(default_factory=list)
    first_calls: set = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    interrupted: bool = False
    budget_spent: bool = False  # a step ran into the budget's hard deadline: the sweep stopped

    def append(self, record: dict) -> None:
        with self.lock:
            if self.stop.is_set():
                return
            self.writer.append(record)
            self.records.append(record)


class DeviceRunner:
    """Runs one device's shapes through its worker, one step at a time."""

    def __init__(self, worker: WorkerHandle, shapes, shared: Shared, old_records: list[dict],
                 fitted: FittedPlan):
        self.worker = worker
        self.shapes = shapes
        self.shared = shared
        self.old_records = old_records
        self.fitted = fitted
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for i, (shape, variants) in enumerate(self.shapes):
                if self.shared.stop.is_set():
                    return
                later = sum(self._planned_s(s) for s, _ in self.shapes[i:])
                self._shape(shape, variants, self.shared.clock.shape_deadline(self._planned_s(shape), later))
        except BaseException as exc:  # handed to the main thread, which re-raises it
            self.error = exc

    def _planned_s(self, shape: Shape) -> float:
        plan = self.fitted.estimate.shapes.get(shape)
        return plan.seconds if plan else 0.0

    # ----------------------------------------------------------------- one shape
    def _shape(self, shape: Shape, variants: list[Variant], deadline: float) -> None:
        sh = self.shared
        rungs, last = sh.rungs, len(sh.rungs) - 1
        search = ShapeSearch.from_records(shape, variants, len(rungs), self.old_records)
        for rung in sorted(search.decisions):  # a stop between a decision and its cut lines
            for step in search.undecided_cuts(rung):
                self._record_cut(search, step, rung, "halving", search.decisions[rung])
        carried = self._reopen(search, deadline)
        for rung in range(search.start_rung(), len(rungs)):
            skipped = []
            pending = search.pending(rung)
            for text in pending:
                if sh.stop.is_set():
                    return
                variant = Variant.parse(text)
                if rung == 0 and variant.backend != baseline_backend() and not self._fits_rung0(
                        search, variant, deadline):
                    skipped.append(text)
                    continue
                self._step(search, text, rung)
            if sh.stop.is_set():
                return
            if rung < last:
                self._decide(search, rung, skipped, deadline, carried.get(rung, ()))
            if pending:
                sh.progress.shape_line(shape, search, rung, len(rungs))

    def _reopen(self, search: ShapeSearch, deadline: float) -> dict[int, list[str]]:
        """A resume of a shape whose rung 0 skipped candidates (the clock was short) re-opens
        its rungs when the first of them fits now: its decisions are set aside, so the
        skipped candidates are timed at rung 0 and each rung is decided again over all it
        timed, and those the earlier decisions kept are carried (never cut: their later
        steps and final times stand). Returns rung -> the texts to carry; {} when nothing
        re-opens."""
        first = search.decisions.get(0)
        skipped = [t for t in (first or {}).get("skipped") or () if t in {str(v) for v in search.planned}]
        if not skipped or not self._fits_rung0(search, Variant.parse(skipped[0]), deadline):
            return {}
        carried = {rung: list(d["kept"]) for rung, d in search.decisions.items()}
        search.decisions.clear()
        return carried

    def _fits_rung0(self, search: ShapeSearch, variant: Variant, deadline: float) -> bool:
        """Whether this candidate's rung 0, and the later rungs of the survivors it would
        join, fit before the shape's deadline (the baseline is never asked)."""
        sh = self.shared
        timed = search.timed(0)
        guess = sorted(t.median_us for t in timed)[len(timed) // 2] * 1e-6 if timed else 0.0
        with sh.lock:
            cost = sh.costs.cost(variant.backend)
            first = (str(variant), compile_class(search.shape)) not in sh.first_calls
        need = cost.step(0, sh.rungs[0], wall_samples(sh.rungs, 0), guess) + (cost.first_s if first else 0.0)
        entrants = sorted([(t.median_us * 1e-6, t.backend) for t in timed] + [(guess, variant.backend)])
        n = survivors_after(len(entrants), len({b for _, b in entrants}), sh.config.search.keep,
                            sh.config.search.min_keep)
        return time.monotonic() + need + self._finish_cost(entrants[:n], 0) <= deadline

    def _finish_cost(self, entrants: list[tuple[float, str]], rung: int) -> float:
        """Seconds for `entrants` ((seconds per call, backend), best first) entering rung+1
        to go through the last rung, the survivors of each rung being the first ones."""
        sh = self.shared
        total = 0.0
        for r in range(rung + 1, len(sh.rungs)):
            with sh.lock:
                total += sum(sh.costs.cost(b).step(r, sh.rungs[r], wall_samples(sh.rungs, r), call_s)
                             for call_s, b in entrants)
            n = survivors_after(len(entrants), len({b for _, b in entrants}), sh.config.search.keep,
                                sh.config.search.min_keep)
            entrants = entrants[:n]
        return total

    def _decide(self, search: ShapeSearch, rung: int, skipped: list[str], deadline: float,
                carried: tuple[str, ...] | list[str] = ()) -> None:
        sh = self.shared
        timed = search.timed(rung)
        order, cut, n_must = promote(timed, sh.config.search.keep, sh.config.search.min_keep, baseline_backend(),
                                     carried)
        per_call = {t.text: (t.median_us * 1e-6, t.backend) for t in timed}
        k = len(order)
        while k > n_must and time.monotonic() + self._finish_cost([per_call[t] for t in order[:k]], rung) > deadline:
            k -= 1
        kept, budget_cut = order[:k], order[k:]
        decision = {
            "kind": "rung", "shape": {"batch": search.shape.batch, "kv_len": search.shape.kv_len},
            "rung": rung, "entered": len(search.entrants(rung)), "timed": len(timed), "kept": kept,
            "cut_budget": len(budget_cut), "skipped": skipped, "next_samples": sh.rungs[rung + 1],
        }
        sh.append(decision)
        search.decisions[rung] = decision
        by_text = {r["variant"]: r for r in search.steps.get(rung, {}).values()}
        for text in cut + budget_cut:
            self._record_cut(search, by_text[text], rung, "budget" if text in budget_cut else "halving", decision)

    def _record_cut(self, search: ShapeSearch, step: dict, rung: int, why: str, decision: dict) -> None:
        if why == "budget":
            reason = (f"rung {rung}: cut to fit the budget ({step['time']['median_us']:.1f} us; "
                      f"{len(decision['kept'])} of {decision['timed']} kept)")
        else:
            reason = (f"rung {rung}: {step['time']['median_us']:.1f} us, not among the "
                      f"{len(decision['kept'])} of {decision['timed']} kept for the next rung")
        key = key_of(search.shape, step["variant"])
        first = search.first_step.get(key, step)
        record = {**{k: v for k, v in step.items() if k not in ("samples", "wall_samples", "elapsed_s")},
                  "kind": "candidate", "status": "pruned", "reason": reason, "cut": why,
                  "checks": first.get("checks", []), "calibration": first.get("calibration"),
                  "elapsed_s": 0.0, "samples": None, "rung": rung}
        self.shared.append(record)
        search.finals[key] = record
        self.shared.progress.advance()

    # ----------------------------------------------------------------- one step
    def _step(self, search: ShapeSearch, text: str, rung: int) -> None:
        sh = self.shared
        shape, rungs, last = search.shape, sh.rungs, len(sh.rungs) - 1
        config = sh.config
        step = Step(shape, text, rung, rungs[rung], wall_samples(rungs, rung), rung == 0, config.rule,
                    tuple(config.check_seeds), tuple(config.calibration_seeds),
                    config.calibration.as_dict())
        if not self.worker.alive:  # a fresh worker's start-up is not this candidate's cost
            self.worker.reap()
            self.worker.start()
        t0 = time.monotonic()
        result = self._run(step)
        elapsed = time.monotonic() - t0
        if result is None:  # the budget's hard deadline: the sweep stops here
            with sh.lock:
                if not sh.stop.is_set():
                    sh.progress.print(escape(f"budget: {shape} {text} was still running at the budget's "
                                             "hard deadline; it is not recorded and the sweep stops"))
                sh.budget_spent = True
                sh.stop.set()
            return
        if sh.stop.is_set():
            return  # interrupted: the kill was ours, not the candidate's
        variant = Variant.parse(result.variant)
        first_key = (text.split(",q_amax")[0], compile_class(shape))
        with sh.lock:
            first = first_key not in sh.first_calls
            sh.first_calls.add(first_key)
            if result.status == "ok":
                sh.costs.observe(variant.backend, rung, step.samples + step.wall_samples, elapsed, first,
                                 result.time["median_us"] * 1e-6)
        key = key_of(shape, result.variant)
        record = {
            "kind": "step" if result.status == "ok" and rung < last else "candidate",
            "shape": {"batch": shape.batch, "kv_len": shape.kv_len}, **result.fields(),
            "rung": rung, "samples": step.samples, "wall_samples": step.wall_samples,
            "elapsed_s": round(elapsed, 3), "device": self.worker.device,
            "timing_reps": step.samples, "budget_reduced": tuple(rungs) != tuple(config.search.rungs),
        }
        if rung > 0:  # the gate ran at rung 0: its checks and calibration stay on the record
            first_rec = search.first_step.get(key, {})
            record.update(checks=first_rec.get("checks", []), calibration=first_rec.get("calibration"))
        sh.append(record)
        if rung == 0:
            search.first_step.setdefault(key, record)
        if record["kind"] == "step":
            search.steps.setdefault(rung, {})[key] = record
        else:
            search.finals[key] = record
            sh.progress.advance()
            if result.status not in ("ok", "pruned"):
                sh.progress.print(escape(f"{result.status}: {shape} {result.variant}: {result.reason}"))

    def _run(self, step: Step) -> StepResult | None:
        """The step's result; None where the budget's hard deadline killed it (not its own
        limit): nothing is recorded, the sweep stops, and a resume runs it."""
        timeout = self.shared.timeout
        if Variant.parse(step.variant).backend != baseline_backend():  # the baseline always runs
            timeout = self.shared.clock.timeout(timeout)
        try:
            result = self.worker.request(step, timeout)
        except WorkerTimeout:
            self.worker.reap()
            if timeout < self.shared.timeout and self.shared.clock.past_hard_deadline():
                return None
            return StepResult(step.variant, "timeout",
                              f"ran past the {timeout:.0f} s limit; its worker was killed")
        except WorkerGone as gone:
            return StepResult(step.variant, "crashed",
                              f"its worker died ({signal_name(gone.exitcode)}) while running it; "
                              f"the worker log {self.worker.log_path} holds its last output",
                              stderr_tail=gone.tail)
        if result.restart_worker:
            self.worker.wait_exit()
        return result
