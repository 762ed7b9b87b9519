"""Host time of `DecodePlan.update` over ragged mixes with fresh lengths, from the first call.

    PYTHONPATH=. python scripts/bench_update.py [--table tables/H200.serving.yaml]
        [--mixes 1000] [--seed 0] [--picks picks.json] [--json out.json] [--tensors-first]
        [--no-lookup] [--device cpu|cuda] [--warm] [--by-family] [--by-backend]

One eager plan (serving/decode_plan.py; host lengths, 64-token pages, max_batch 256) per
family of the table (16 or 128 heads, q_len 1-4, fp8 or bf16 KV), made before the clock
starts with warm=False. On a machine without a GPU (`--device cpu`, the default there) no
kernel runs: the own runners are built under TRITON_INTERPRET=1, and the vendor
libraries' picks cannot run, so a step that picks one takes the plan's runnable stand-in,
as a plan without them does. On a GPU (`--device cuda`, the default there) the step's
tensors live on the device and the picked runner's step runs as an engine's does (the
vendors' host planning and device metadata included); the device is synchronized after
each timed call, outside its time. `--warm` makes the plans with warm=True, as an engine
does (every runner compiled and run once: the vendors' JIT modules loaded too; without it
a GPU plan's first update can spend seconds loading them). Then `mixes` steps, each of a
family drawn at random, a batch drawn uniformly from 1-256 and every sequence's length drawn log-uniformly
from 64-65536 tokens (fresh lengths every step), each sequence with the family's q_len new
tokens. The step's tensors are made before its clock starts; what is timed
(time.perf_counter_ns) is one `plan.update(...)` call with the host lengths, starting at
each plan's first call. Prints the median, p90, p99 and max in us over all steps and over
each plan's first step. `--picks` writes each step's pick (the table's own lookup, before
the plan's stand-in) so two versions of the lookup can be compared on the same mixes.
Python's garbage collector stays on, as in an engine. `--tensors-first` makes every step's
tensors before the first timed call instead (the same mixes): what making a step's tensors
just before its call (as an engine does, and the default) costs the call in cache misses.
`--no-lookup` makes the plans without the table (each runs its default variant): what an
update costs besides the table's lookup (its layout checks and the runner's step).
`--profile N` then runs the same steps again under cProfile, untimed, and prints the N
functions that took the most of update's time (cumulative), per backend of the variant
each step ran: where a step's host time goes.
`--by-family` adds a line per family (its own steps: about 1000 / 12 each), `--by-backend` a
line per backend of the variant each step ran (update's return: on a machine without the
vendors, the stand-in that ran); `--json` always holds both. Each plan's split partials are
printed too: `plan.scratch`, the one buffer its own runners share, beside the sum of what
each would hold alone (`scratch_bytes` at max_batch; only the runners built here); their
outputs, `plan.outputs`, beside one output buffer per own runner; and on a GPU the device
memory the plan took while it was made (torch.cuda.memory_allocated).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import random
import statistics
import time
import warnings
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the own runners are built on the CPU (none runs)

from mla_tune import native  # noqa: E402
from mla_tune.core import CallSpec  # noqa: E402
from mla_tune.serving.decode_plan import DecodePlan  # noqa: E402
from mla_tune.serving.table import load_serving_table  # noqa: E402

MAX_BATCH = 256
MIN_KV, MAX_KV = 64, 65536


def _mixes(families, count: int, seed: int):
    rng = random.Random(seed)
    lo, hi = math.log(MIN_KV), math.log(MAX_KV)
    for _ in range(count):
        key = rng.choice(families)
        batch = rng.randint(1, MAX_BATCH)
        yield key, [max(int(math.exp(rng.uniform(lo, hi))), key.q_len) for _ in range(batch)]


def _tensors(key, kv_lens: list[int], device: str) -> dict:
    batch = len(kv_lens)
    pages = [-(-n // key.page_size) for n in kv_lens]
    width = max(pages)
    return {"qo_indptr": torch.arange(0, batch * key.q_len + 1, key.q_len, dtype=torch.int32, device=device),
            "block_table": torch.zeros((batch, width), dtype=torch.int32, device=device),
            "seq_lens": torch.tensor(kv_lens, dtype=torch.int32, device=device),
            "q_lens_host": [key.q_len] * batch, "kv_lens_host": kv_lens}


def _replays() -> str:
    """Which schedule replays the lookup runs: C (mla_tune/native.py) or numpy."""
    return "numpy" if os.environ.get(native.DISABLE_ENV) or native.compiler() is None else "C"


def _tag(key) -> str:
    """A family's short name: kv format / heads / q_len, e.g. bf16/h16/q1."""
    return f"{key.kv_format}/h{key.heads}/q{key.q_len}"


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    n = len(ordered)
    return {"n": n, "median_us": round(statistics.median(ordered), 1),
            "p90_us": round(ordered[math.ceil(0.9 * n) - 1], 1),
            "p99_us": round(ordered[math.ceil(0.99 * n) - 1], 1), "max_us": round(ordered[-1], 1)}


def _memory(plan: DecodePlan, before: int, device: str) -> dict:
    """A plan's split partials in GiB: shared (plan.scratch), each runner's alone summed,
    and on a GPU the device memory allocated while the plan was made."""
    own = [r for r in plan.runners.values() if hasattr(r, "scratch_bytes")]
    alone = sum(r.scratch_bytes(plan.max_total_q) for r in own)
    out = {"runners": len(plan.runners), "shared_gib": round(plan.scratch.nbytes / 2**30, 3),
           "alone_gib": round(alone / 2**30, 3), "outputs_gib": round(plan.outputs.nbytes / 2**30, 3),
           "outputs_alone_gib": round(len(own) * plan.outputs.nbytes / 2**30, 3)}
    if device != "cpu":
        out["allocated_gib"] = round((torch.cuda.memory_allocated() - before) / 2**30, 3)
    return out


def _profile(plans: dict, mixes: list, device: str, top: int) -> None:
    """The mixes' updates again under cProfile, untimed, a profile per backend of the
    variant each step ran (a step's pick is known after its update, so each update is
    profiled alone and added to its backend's); prints each one's `top` functions by
    cumulative time."""
    profiles: dict[str, pstats.Stats] = {}
    steps: dict[str, int] = {}
    for key, kv_lens in mixes:
        step = _tensors(key, kv_lens, device)
        qo = step.pop("qo_indptr")
        prof = cProfile.Profile()
        prof.enable()
        ran = plans[key].update(qo, **step)
        prof.disable()
        if device != "cpu":
            torch.cuda.synchronize()
        steps[ran.backend] = steps.get(ran.backend, 0) + 1
        if ran.backend in profiles:
            profiles[ran.backend].add(prof)
        else:
            profiles[ran.backend] = pstats.Stats(prof)
    for backend, stats in sorted(profiles.items()):
        n = steps[backend]
        print(f"\nupdate's profile over the {n} steps that ran {backend} (cumulative and own us per step, "
              "calls per step; under the profiler):")
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:top]
        for (path, line, func), (_cc, calls, own, cum, _callers) in rows:
            where = f"{Path(path).name}:{line}({func})" if line else func
            print(f"  {cum / n * 1e6:9.1f} {own / n * 1e6:9.1f} {calls / n:7.1f}  {where[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", default="tables/H200.serving.yaml")
    ap.add_argument("--mixes", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--picks", type=Path, help="write each step's table pick here (JSON)")
    ap.add_argument("--json", type=Path, help="write the statistics here (JSON)")
    ap.add_argument("--tensors-first", action="store_true",
                    help="make every step's tensors before the first timed call")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the step's tensors live and the plans' runners run (default: cuda where "
                         "there is a GPU, as an engine calls; the vendors' steps then run for real)")
    ap.add_argument("--warm", action="store_true",
                    help="make the plans with warm=True (each runner compiled and run once, as an engine "
                         "makes them; needs the GPU) rather than warm=False")
    ap.add_argument("--by-family", action="store_true",
                    help="also print the update's statistics per family (its steps only)")
    ap.add_argument("--by-backend", action="store_true",
                    help="also print the update's statistics per backend of the variant each step ran")
    ap.add_argument("--no-lookup", action="store_true",
                    help="plans without the table: the update's cost besides the lookup")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then the same steps again under cProfile (untimed): the N functions that took "
                         "the most of update's time, per backend of the variant each step ran")
    args = ap.parse_args()
    table = load_serving_table(args.table)
    keys = sorted(k for k in table.families if k.page_size > 0)
    plans, memory = {}, {}
    made = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the vendors' picks cannot run here: said once per plan
        for key in keys:
            spec = CallSpec(key.kv_format, page_size=key.page_size, heads=key.heads, max_q_len=key.q_len,
                            host_lengths=True)
            before = torch.cuda.memory_allocated() if args.device != "cpu" else 0
            plans[key] = DecodePlan(spec, MAX_BATCH, table=None if args.no_lookup else table, device=args.device,
                                    warm=args.warm)
            memory[key] = _memory(plans[key], before, args.device)
    made = time.perf_counter() - made
    times, first, picks, seen, by_family, by_backend = [], [], [], set(), {}, {}
    mixes = list(_mixes(keys, args.mixes, args.seed))
    made_first = [_tensors(key, kv_lens, args.device) for key, kv_lens in mixes] if args.tensors_first else None
    for i, (key, kv_lens) in enumerate(mixes):
        step = made_first[i] if made_first is not None else _tensors(key, kv_lens, args.device)
        plan = plans[key]
        qo = step.pop("qo_indptr")
        t0 = time.perf_counter_ns()
        ran = plan.update(qo, **step)
        us = (time.perf_counter_ns() - t0) / 1e3
        if args.device != "cpu":
            torch.cuda.synchronize()  # the step's device work ends before the next step's tensors
        times.append(us)
        by_family.setdefault(key, []).append(us)
        by_backend.setdefault(ran.backend, []).append(us)
        if key not in seen:
            seen.add(key)
            first.append(us)
        if args.picks:
            looked = table.lookup(plan.spec, len(kv_lens), sum(kv_lens) / len(kv_lens), kv_lens=kv_lens)
            picks.append({"family": key.as_dict(), "batch": len(kv_lens), "pick": str(looked)})
    out = {"table": args.table, "mixes": args.mixes, "seed": args.seed, "tensors_first": args.tensors_first,
           "no_lookup": args.no_lookup, "replays": _replays(), "device": args.device, "warm": args.warm,
           "plans": len(plans),
           "plans_made_s": round(made, 2), "update": _stats(times), "first_update": _stats(first),
           "by_family": {_tag(key): _stats(us) for key, us in sorted(by_family.items())},
           "by_backend": {name: _stats(us) for name, us in sorted(by_backend.items())},
           "memory": {_tag(key): m for key, m in sorted(memory.items())}}
    print(f"{len(plans)} plans made in {made:.2f} s ({out['replays']} replays); DecodePlan.update over {args.mixes} fresh mixes "
          "(us, from each plan's first call):")
    lines = [(name, out[name]) for name in ("update", "first_update")]
    lines += [*(out["by_family"].items() if args.by_family else ()),
              *(out["by_backend"].items() if args.by_backend else ())]
    for tag, s in lines:
        print(f"  {tag:<13} n {s['n']:>5}  median {s['median_us']:>8}  p90 {s['p90_us']:>8}  "
              f"p99 {s['p99_us']:>8}  max {s['max_us']:>8}")
    total = {name: round(sum(m.get(name, 0) for m in memory.values()), 2)
             for name in ("shared_gib", "alone_gib", "outputs_gib", "outputs_alone_gib", "allocated_gib")}
    print(f"split partials at max_batch {MAX_BATCH} (GiB): shared {total['shared_gib']}, each runner alone "
          f"{total['alone_gib']}; outputs shared {total['outputs_gib']}, each runner alone "
          f"{total['outputs_alone_gib']}" + (f"; the plans took {total['allocated_gib']} of device memory"
                                             if args.device != "cpu" else ""))
    for tag, m in (out["memory"].items() if args.by_family else ()):
        print(f"  {tag:<13} runners {m['runners']:>3}  shared {m['shared_gib']:>7}  alone {m['alone_gib']:>7}"
              f"  outputs {m['outputs_gib']:>6} / {m['outputs_alone_gib']:>6}"
              + (f"  allocated {m['allocated_gib']:>7}" if "allocated_gib" in m else ""))
    if args.profile:
        _profile(plans, mixes, args.device, args.profile)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.picks:
        args.picks.write_text(json.dumps(picks) + "\n")


if __name__ == "__main__":
    main()
