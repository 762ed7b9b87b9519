"""The compile check of a plan: capture, bind, compile each distinct binary once (in
parallel processes, cached by binary key), and the candidates the plan should drop.

The result is a plain dict (JSON), the same whether it was computed here or read back from
`python -m mla_tune.xcompile` under another interpreter (`run_in`):

    {"gpu", "arch", "target", "triton", "image_triton", "lds_limit", "jobs", "wall_s",
     "compiled", "cached", "not_compiled": {backend: candidates (not mla-tune's Triton)},
     "binaries": [{key, kernel, ok, error, <resources.py's fields>, over_lds, users}],
     "capture_errors": [{shape, label, error}],
     "drops": {shape: {variant: reason}}}

A candidate is dropped when one of its binaries fails to compile, when one needs more
shared memory (LDS) than the target allows, or when its launches are those of an earlier
candidate at the same shape: the same binaries (instruction SHA and resources), grids and
plain argument values, so timing it would repeat that candidate's time.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import triton

from mla_tune import gpu as gpu_mod
from mla_tune.core import Shape, Variant
from mla_tune.errors import MlaTuneError
from mla_tune.fileio import atomic_write_text
from mla_tune.xcompile.capture import capture_candidate, capture_q_quant, captured, recording
from mla_tune.xcompile.targets import bind, compile_bound, target_for

CACHE_ENV = "MLA_TUNE_CACHE"


class CompileCheckError(MlaTuneError, ValueError):
    """The compile check cannot run; the message says what was wrong and what to do."""


def facts_for(name: str) -> gpu_mod.GpuFacts:
    facts = gpu_mod.KNOWN_GPUS.get(name)
    if facts is None:
        raise CompileCheckError(f"no architecture facts for GPU {name!r}: the compile check knows "
                                f"{', '.join(gpu_mod.KNOWN_GPUS)} (mla_tune/gpu.py KNOWN_GPUS)")
    return facts


def cache_dir() -> Path:
    """$MLA_TUNE_CACHE/compile, else ~/.cache/mla-tune/compile."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "mla-tune") / "compile"


def version_note(name: str, triton_version: str = triton.__version__) -> str | None:
    """Why this Triton's numbers may not be the target image's, or None when they are."""
    image = facts_for(name).image_triton
    if image and image != triton_version:
        return (f"this is Triton {triton_version}; {name}'s image runs Triton {image}, whose register "
                f"use, spills and duplicates differ: pass --triton PYTHON with a Python that has "
                f"triton {image} and mla_tune installed")
    return None


def interpreting() -> bool:
    """Whether this process's Triton kernels were made by TRITON_INTERPRET's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ------------------------------------------------------------------ compiling
_PENDING: list = []  # the bound launches a forked worker compiles, by index
_LDS_LIMIT = [0]


def _compile_at(index: int) -> dict:
    return compile_bound(_PENDING[index], _LDS_LIMIT[0])


def _compile_all(bounds: list, lds_limit: int, jobs: int, log, keep=None) -> list[dict]:
    """compile_bound of each, in `jobs` forked processes (serially with jobs 1); `keep` is
    called with each record as it comes (the cache), so a stopped check keeps its work."""
    keep = keep or (lambda record: None)
    _PENDING[:] = bounds
    _LDS_LIMIT[0] = lds_limit
    records: list[dict | None] = [None] * len(bounds)
    every = max(1, len(bounds) // 10)

    def note(done: int, i: int) -> None:  # about ten progress lines, and every error
        keep(records[i])
        if done % every == 0 or done == len(bounds) or not records[i]["ok"]:
            log(f"compiled {done}/{len(bounds)}: {bounds[i].name} "
                + ("ok" if records[i]["ok"] else f"ERROR {records[i]['error']}"))

    if jobs <= 1 or len(bounds) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for i in range(len(bounds)):
            records[i] = _compile_at(i)
            note(i + 1, i)
        return records
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(_compile_at, i): i for i in range(len(bounds))}
        for done, future in enumerate(as_completed(futures), 1):
            i = futures[future]
            try:
                records[i] = future.result()
            except BrokenProcessPool:
                records[i] = {"key": bounds[i].key, "kernel": bounds[i].name, "ok": False, "crashed": True,
                              "error": "the compiler's process died (a crash in Triton or LLVM)"}
            note(done, i)
    _PENDING.clear()
    return records


def _load_cached(folder: Path, key: str) -> dict | None:
    try:
        record = json.loads((folder / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("key") == key else None


# ------------------------------------------------------------------ the check
def check_plan(plan: dict[Shape, list[Variant]], gpu: str, jobs: int | None = None,
               use_cache: bool = True, q_quant: bool = True, log=None) -> dict:
    """Compile every distinct binary the plan's own-kernel candidates launch, for `gpu`."""
    log = log or (lambda text: None)
    started = time.monotonic()
    facts = facts_for(gpu)
    if interpreting():  # this process's kernels are the interpreter's: compile in a clean one
        return run_in(sys.executable, gpu, jobs, use_cache, plan=plan, q_quant=q_quant, log=log)
    target = target_for(facts)
    jobs = max(1, jobs or os.cpu_count() or 1)
    bounds: dict[str, object] = {}
    users: dict[str, list] = {}
    item_launches: list[tuple[Shape, str, list]] = []  # candidates: (shape, label, [(key, launch)])
    capture_errors, not_compiled = [], {}
    with recording(facts) as launches:
        items = []
        for shape, variants in plan.items():
            for v in variants:
                if captured(v.backend):
                    items.append(capture_candidate(v, shape, facts, launches))
                else:
                    not_compiled[v.backend] = not_compiled.get(v.backend, 0) + 1
        if q_quant:
            firsts = {}
            for shape in plan:
                firsts.setdefault(shape.batch, shape)
            for shape in firsts.values():
                items += capture_q_quant(shape, facts, launches)
    for item in items:
        if item.error is None and not item.launches:
            item.error = "capture found no Triton launch"
        keyed = []
        for launch in item.launches:
            try:
                b = bind(launch.kernel, launch.grid, launch.args, launch.kwargs, target)
            except Exception as exc:
                item.error = f"binding {getattr(launch.kernel, '__name__', launch.kernel)} failed: " \
                             f"{type(exc).__name__}: {exc}"
                break
            bounds.setdefault(b.key, b)
            if (str(item.shape), item.label) not in users.setdefault(b.key, []):
                users[b.key].append((str(item.shape), item.label))
            keyed.append((b.key, b.launch))
        if item.error is not None:
            capture_errors.append({"shape": str(item.shape), "label": item.label, "error": item.error})
        elif item.backend != "q_quant":
            item_launches.append((item.shape, item.label, keyed))
    log(f"captured {len(items)} launch sets: {len(bounds)} distinct binaries for {facts.arch}")
    folder = cache_dir()
    records: dict[str, dict] = {}
    if use_cache:
        for key in bounds:
            cached = _load_cached(folder, key)
            if cached is not None:
                records[key] = cached
    todo = [b for key, b in bounds.items() if key not in records]
    log(f"{len(records)} cached, {len(todo)} to compile in {min(jobs, max(1, len(todo)))} processes")
    def keep(record: dict) -> None:
        if use_cache and not record.get("crashed"):
            try:
                atomic_write_text(folder / f"{record['key']}.json", json.dumps(record))
            except MlaTuneError as exc:  # an unwritable cache costs the next run time, no more
                log(f"compile cache not written: {exc}")

    for record in _compile_all(todo, facts.lds_bytes, jobs, log, keep):
        records[record["key"]] = record
    binaries = []
    for key in bounds:
        record = dict(records[key])
        record["over_lds"] = bool(record.get("ok") and record.get("lds", 0) > facts.lds_bytes)
        record["users"] = [list(u) for u in users[key]]
        binaries.append(record)
    binaries.sort(key=lambda r: (r["kernel"], r["users"][0][0], r["users"][0][1]))
    return {
        "gpu": gpu, "arch": facts.arch, "target": f"{target.backend}:{target.arch}",
        "triton": triton.__version__, "image_triton": facts.image_triton,
        "version_note": version_note(gpu), "lds_limit": facts.lds_bytes, "jobs": jobs,
        "compiled": len(todo), "cached": len(bounds) - len(todo),
        "wall_s": round(time.monotonic() - started, 1), "not_compiled": not_compiled,
        "binaries": binaries, "capture_errors": capture_errors,
        "drops": plan_drops(item_launches, {r["key"]: r for r in binaries}, gpu, facts.lds_bytes),
    }


def _fingerprint(record: dict) -> tuple:
    fields = ("sha", "vgprs", "registers", "scratch", "lds", "num_warps")
    return tuple(record.get(f) for f in fields)


def plan_drops(item_launches, records: dict[str, dict], gpu: str, lds_limit: int) -> dict:
    """{shape: {variant: reason}}: candidates with a binary that does not compile, one over
    the LDS limit, or the same launches as an earlier candidate at the same shape."""
    drops: dict[str, dict[str, str]] = {}
    seen: dict[tuple, str] = {}
    version = triton.__version__
    for shape, label, keyed in item_launches:
        reason = None
        for key, _ in keyed:
            r = records[key]
            if not r.get("ok"):
                reason = f"{r['kernel']} does not compile for {gpu} with Triton {version}: {r['error']}"
                break
            if r.get("over_lds"):
                reason = (f"{r['kernel']} needs {r['lds']} B of shared memory (LDS), more than "
                          f"{gpu}'s {lds_limit} B")
                break
        if reason is None:
            fingerprint = (str(shape), tuple((_fingerprint(records[k]), launch) for k, launch in keyed))
            first = seen.setdefault(fingerprint, label)
            if first != label:
                reason = (f"compiles to the same code and launches as {first} (Triton {version}, "
                          f"{gpu}): timing it would repeat that candidate")
        if reason is not None:
            drops.setdefault(str(shape), {})[label] = reason
    return drops


def apply_drops(plan: dict[Shape, list[Variant]], report: dict) -> dict[Shape, list[Variant]]:
    """The plan less the report's drops."""
    drops = report.get("drops", {})
    return {s: [v for v in vs if str(v) not in drops.get(str(s), {})] for s, vs in plan.items()}


def run_in(python: str, gpu: str, jobs: int | None, use_cache: bool, config: Path | None = None,
           plan: dict[Shape, list[Variant]] | None = None, q_quant: bool = True, env: dict | None = None,
           timeout_s: float = 3600, log=None) -> dict:
    """The check of `config`'s plan (or of `plan`) for `gpu` under another interpreter (one
    with the target image's Triton and mla_tune installed, or this one without the CPU
    interpreter): `python -m mla_tune.xcompile`, its JSON read back."""
    log = log or (lambda text: None)
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)  # the CPU interpreter's kernels cannot be compiled
    command = [python, "-m", "mla_tune.xcompile", "--gpu", gpu]
    command += ["--jobs", str(jobs)] if jobs else []
    command += [] if use_cache else ["--no-cache"]
    command += [] if q_quant else ["--no-q-quant"]
    with tempfile.TemporaryDirectory(prefix="mla-tune-plan-") as tmp:
        if plan is not None:
            plan_file = Path(tmp) / "plan.json"
            plan_file.write_text(json.dumps({str(s): [str(v) for v in vs] for s, vs in plan.items()}))
            command += ["--plan", str(plan_file)]
        else:
            command += ["--config", str(config)]
        out_path = Path(tmp) / "report.json"
        tail: list[str] = []
        try:
            with open(out_path, "w") as out:
                child = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
                for line in child.stderr:  # its progress, passed on; the last lines kept for an error
                    tail = (tail + [line.rstrip()])[-3:]
                    if line.startswith(("captured ", "compiled ", "error: ")) or " cached, " in line:
                        log(line.rstrip())
                code = child.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise CompileCheckError(f"--triton {python}: could not run it ({exc})") from None
        if code != 0:
            raise CompileCheckError(f"--triton {python}: `{' '.join(command)}` exited {code}: "
                                    f"{' | '.join(tail)}; that Python needs triton, torch and mla_tune "
                                    "(pip install -e .)")
        text = out_path.read_text()
    try:
        return json.loads(text)
    except ValueError:
        raise CompileCheckError(f"--triton {python}: its output is not the compile check's JSON "
                                f"(starts {text[:80]!r})") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m mla_tune.xcompile --gpu NAME --config F [--jobs N] [--no-cache]`: the
    check's JSON on stdout (what run_in reads), progress on stderr."""
    import argparse

    from mla_tune.tune.config import load_config
    from mla_tune.tune.sweep import plan_candidates

    parser = argparse.ArgumentParser(prog="python -m mla_tune.xcompile")
    parser.add_argument("--gpu", required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", type=Path, help="a sweep config: its plan for --gpu")
    where.add_argument("--plan", type=Path, help="a JSON file {shape: [variant, ...]}")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--no-q-quant", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.plan is not None:
            raw = json.loads(args.plan.read_text())
            plan = {Shape(*map(int, s.split("x"))): [Variant.parse(t) for t in vs] for s, vs in raw.items()}
        else:
            plan = plan_candidates(load_config(args.config), gpu_mod.fake_platform(args.gpu),
                                   planning_only=True).plan
        report = check_plan(plan, args.gpu, args.jobs, not args.no_cache, not args.no_q_quant,
                            log=lambda text: print(text, file=sys.stderr, flush=True))
    except MlaTuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.config is not None:
        report["config"] = str(args.config)
    print(json.dumps(report))
    return 0
