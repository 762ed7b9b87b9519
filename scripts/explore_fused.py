"""GPU exploration of the triton_fused family: compile configs x shapes x split plans.

One command for one device call: compiles every config in parallel worker processes (which
fill Triton's cache and report registers, spills, shared memory and whether the PTX holds
wgmma), then per leaderboard shape checks every (config, num_splits, reduce) against the
leaderboard's reference under its rule and times it with mla_tune.timing.time_call. Rows go
to $OUT/explore.jsonl as they finish, so a killed run keeps what it measured; the summary
table prints last.

    PYTHONPATH=. python3 scripts/explore_fused.py [--configs base,fp8qk,...] [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait

import torch

from mla_tune import problem
from mla_tune.core import Shape, Variant

COPY_BW = 4.28e12  # bytes/s, measured on the H200 (PROBLEM.md)
BYTES_PER_TOKEN = {"bf16": 1152, "fp8": 576, "mxfp4": 288 + 18}
SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192)]
BASE = dict(kv="fp8", q="bf16", qk_dot="fp16", pv_dot="fp16", tok_m=True, block_n=64, num_warps=8, num_stages=2)

# name -> parameter overrides on BASE (compile-time parameters only; splits come from the
# plan). Call 1 (docs/perf.md) tried more; these are the survivors and their neighbours.
_FQ = dict(q="fp8_dynamic", qk_dot="fp8")
_KB = dict(kv="bf16", qk_dot="bf16", pv_dot="bf16")
CONFIGS = {
    "fq64w8s2": dict(_FQ),
    "fq64w4s2": dict(_FQ, num_warps=4),
    "fq64w4s3": dict(_FQ, num_warps=4, num_stages=3),
    "fq128w8s2": dict(_FQ, block_n=128),
    "fq128w8s3": dict(_FQ, block_n=128, num_stages=3),
    "fq128w4s2": dict(_FQ, block_n=128, num_warps=4),
    "fq256w8s2": dict(_FQ, block_n=256),
    "f32w4s2": dict(block_n=32, num_warps=4),
    "f32w4s3": dict(block_n=32, num_warps=4, num_stages=3),
    "f64w4s3": dict(num_warps=4, num_stages=3),
    "b64w4s2": dict(_KB, num_warps=4),
    "b32w4s3": dict(_KB, block_n=32, num_warps=4, num_stages=3),
    "b32w4s4": dict(_KB, block_n=32, num_warps=4, num_stages=4),
    "m32w4s2": dict(kv="mxfp4", qk_dot="bf16", pv_dot="bf16", block_n=32, num_warps=4),
}
WIDE_PLAN = set(CONFIGS)  # every config also tries reduce=last and more split counts


def split_plan(batch: int, wide: bool) -> list[tuple[int, str]]:
    """(num_splits, reduce) pairs worth timing at this batch (grids near 128-132 programs)."""
    plans = {
        4: [(8, "spin"), (16, "spin"), (32, "spin")],
        32: [(1, "none"), (2, "spin"), (4, "spin")],
        64: [(1, "none"), (2, "spin")],
        256: [(1, "none")],
    }[batch]
    if wide:
        plans += {4: [(8, "last")], 32: [(4, "last")], 64: [(2, "last")], 256: [(2, "last")]}[batch]
    return plans


def variant_for(name: str, num_splits: int, reduce: str) -> Variant:
    return Variant.make("triton_fused", **{**BASE, **CONFIGS[name]}, num_splits=num_splits, reduce=reduce)


def _warm_one(name: str, reduce: str, ns: int) -> dict:
    """In a worker process: compile (config, reduce, splits) on a tiny input; report the binary."""
    from mla_tune.backends import triton_fused

    t0 = time.time()
    try:
        v = variant_for(name, ns, reduce)
        kv_len = max(256, ns * v.get("block_n"))
        data = problem.generate_input(1, kv_len, seed=5, device="cuda")
        run = triton_fused.build(v, Shape(1, kv_len), "cuda")
        run(*data[:4])
        torch.cuda.synchronize()
        k = run.compiled
        ptx = k.asm.get("ptx", "")
        return {
            "config": name, "reduce": reduce, "ns": ns, "ok": True, "compile_s": round(time.time() - t0, 1),
            "n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
            "shared": getattr(k.metadata, "shared", None), "wgmma": "wgmma" in ptx,
            "mma_sync": "mma.sync" in ptx, "cp_async": "cp.async" in ptx,
        }
    except Exception as exc:  # a compile failure is a finding, reported with its reason
        return {"config": name, "reduce": reduce, "ns": ns, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def warm_all(names: list[str], out_dir: str, timeout_s: float) -> dict:
    jobs = sorted({(n, r, ns) for n in names for b in (4, 32, 64, 256) for ns, r in split_plan(b, n in WIDE_PLAN)})
    results = {}
    pool = ProcessPoolExecutor(max_workers=min(14, len(jobs)), mp_context=mp.get_context("spawn"))
    futs = {pool.submit(_warm_one, *job): job for job in jobs}
    done, pending = wait(futs, timeout=timeout_s)
    for f in done:
        results[futs[f]] = f.result()
    for f in pending:
        n, r, ns = futs[f]
        results[(n, r, ns)] = {"config": n, "reduce": r, "ns": ns, "ok": False, "error": f"no result within {timeout_s}s (hang?)"}
    for proc in list(getattr(pool, "_processes", {}).values()):
        proc.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    with open(os.path.join(out_dir, "compile.jsonl"), "w") as fh:
        for row in results.values():
            fh.write(json.dumps(row) + "\n")
    return results


def main() -> None:
    from mla_tune.backends import triton_fused
    from mla_tune.timing import time_call

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm-timeout", type=float, default=150)
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp/explore_out")
    os.makedirs(out_dir, exist_ok=True)
    names = args.configs.split(",")
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]

    t0 = time.time()
    comp = warm_all(names, out_dir, args.warm_timeout)
    print(f"compiled {sum(r['ok'] for r in comp.values())}/{len(comp)} in {time.time() - t0:.0f}s", flush=True)
    for _key, row in sorted(comp.items()):
        print("  ", json.dumps(row), flush=True)
    usable = {key for key, row in comp.items() if row["ok"]}

    rows = []
    log = open(os.path.join(out_dir, "explore.jsonl"), "w")
    for batch, kv_len in shapes:
        shape = Shape(batch, kv_len)
        data = problem.generate_input(batch, kv_len, seed=1001, device="cuda")
        ref = problem.reference(data)  # the leaderboard's math: fp8 q x fp8 KV, fp32
        for name in names:
            for ns, red in split_plan(batch, name in WIDE_PLAN):
                if (name, red, ns) not in usable:
                    continue
                v = variant_for(name, ns, red)
                kv = v.get("kv")
                row = {"config": name, "shape": str(shape), "num_splits": ns, "reduce": red, "variant": str(v)}
                try:
                    run = triton_fused.build(v, shape, "cuda")
                    out = run(*data[:4]).clone()
                    rule = problem.RULES["leaderboard" if kv == "mxfp4" else "strict"]
                    res = problem.check(out, ref, rule)
                    again = run(*data[:4])  # a second call must agree: counters reset, no race
                    row.update(rule=rule.name, passed=res.passed, mismatch=round(res.mismatch, 5),
                               repeat_same=bool(torch.equal(out, again)))
                    t = time_call(functools.partial(run, *data[:4]), reps=args.reps)
                    nbytes = batch * kv_len * BYTES_PER_TOKEN[kv] + batch * 16 * (576 + 512) * 2
                    row.update(us=round(t.median_us, 2), p10=round(t.p10_us, 2), p90=round(t.p90_us, 2),
                               gbs=round(nbytes / t.median_us / 1e3, 1),
                               pct_copy=round(100 * nbytes / (t.median_us * 1e-6) / COPY_BW, 1))
                except Exception as exc:
                    row.update(passed=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
        data = ref = None  # free before the next shape's inputs
        torch.cuda.empty_cache()
        print(f"shape {shape} done at {time.time() - t0:.0f}s", flush=True)

    print("\nconfig         shape      splits reduce  pass  mism    us      %copy")
    for r in rows:
        print(f"{r['config']:14s} {r['shape']:10s} {r['num_splits']:6d} {r['reduce']:6s} "
              f"{str(r.get('passed'))[:5]:5s} {r.get('mismatch', float('nan')):.4f} "
              f"{r.get('us', float('nan')):7.2f} {r.get('pct_copy', float('nan')):6.1f} {r.get('error', '')[:60]}")
    print("\nbest passing per shape (family = kv/q):")
    geo = {}
    for batch, kv_len in shapes:
        s = str(Shape(batch, kv_len))
        ok = [r for r in rows if r["shape"] == s and r.get("passed") and r.get("repeat_same") and "us" in r]
        fams = {}
        for r in ok:
            fam = f"{CONFIGS[r['config']].get('kv', 'fp8')}/{CONFIGS[r['config']].get('q', 'bf16')}"
            if r.get("rule") == "strict" or fam.startswith("mxfp4"):
                if fam not in fams or r["us"] < fams[fam]["us"]:
                    fams[fam] = r
        for fam, r in sorted(fams.items()):
            geo.setdefault(fam, []).append(r["us"])
            print(f"  {s:10s} {fam:18s} {r['us']:7.2f} us {r['pct_copy']:5.1f}%  {r['config']} ns={r['num_splits']} {r['reduce']}")
    for fam, vals in geo.items():
        if len(vals) == len(shapes):
            print(f"  geomean {fam}: {math.exp(sum(map(math.log, vals)) / len(vals)):.2f} us")


if __name__ == "__main__":
    sys.exit(main())
