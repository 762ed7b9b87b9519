"""Issue 11's levers on the H200, at the 8 leaderboard shapes, under the leaderboard's timing
protocol (mla_tune.tune.timing.time_call), each candidate checked under `strict` first.

Per shape:
- before: the current table's Gluon pick (tables/H200.yaml, its gluon_fused winner or
  alternate), built by the backend (the second reduction launch);
- the in-kernel reductions of kernels/gluon_decode.py (reduce "last" / "spin") at the
  pick's split count, half and double it, each with v_halves 1 and 2 (spin only where the
  grid is resident at once: gd_check_launch), plus v_halves 2 with the reduction launch;
- the plain-Triton hedge: kernels/fused_decode.py's v_split 2 against v_split 1 at
  triton_fused's run-3 picks (scripts/bench_peers.py FU_PICKS);
- FlashMLA's fp8 kernel with q quantized outside the timing (bench_peers's helper).

Every candidate of a shape is first called once from a thread pool (Triton compiles with
the GIL released), then checked and timed one by one. No shape starts after --budget
seconds. Prints one line per candidate as it goes, the hedge table, then the short table
last; writes every row to --out/bench_issue11.json.

    PYTHONPATH=. python3 scripts/bench_issue11.py [--reps 30] [--budget 170] [--threads 16]
        [--table tables/H200.yaml] [--shapes 4x1024,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mla_tune import problem
from mla_tune.backends import get_backend
from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, Shape, Variant
from mla_tune.kernels.fused_decode import fused_decode
from mla_tune.kernels.gluon_decode import (
    GD_MAX_INKERNEL_SPLITS,
    gd_check_launch,
    gd_kv_descriptor,
    gluon_decode,
)
from mla_tune.tune.timing import time_call
from scripts.bench_peers import FU_PICKS, SHAPES, flashmla_fp8_q_outside

SM_SCALE_LOG2 = SM_SCALE * math.log2(math.e)
# triton_fused's spin needs its grid resident: at most 255 registers x 128 threads leave room
# for 2 CTAs per SM with 4 warps (shared memory <= 46 KB at block_n <= 64), 1 with 8.
FU_CTAS_PER_SM = {4: 2, 8: 1}


def gluon_runner(data, *, num_splits: int, block_n: int, num_stages: int, v_path: str, reduce: str,
                 v_halves: int, sm_count: int):
    """A call of gluon_decode with its own buffers (counters zeroed once); refuses what
    gd_check_launch refuses, before any launch."""
    q, kv_data, _qo, kv_indptr, _config = data
    batch = q.shape[0]
    gd_check_launch(batch, num_splits, block_n=block_n, num_stages=num_stages, v_path=v_path, reduce=reduce,
                    v_halves=v_halves, sm_count=sm_count)
    kv8, kv_scale = kv_data["fp8"]
    desc = gd_kv_descriptor(kv8.view(-1, QK_DIM), block_n)
    dev = q.device
    part_o = torch.empty(batch * num_splits * 16 * V_DIM, dtype=torch.float32, device=dev)
    part_lse = torch.empty(batch * num_splits * 16, dtype=torch.float32, device=dev)
    count = torch.zeros(2 * batch, dtype=torch.int32, device=dev)
    flag = torch.zeros(2 * batch, dtype=torch.int32, device=dev)
    out = torch.empty((batch, 16, V_DIM), dtype=torch.bfloat16, device=dev)
    opts = dict(num_splits=num_splits, block_n=block_n, num_stages=num_stages, v_path=v_path,
                sm_scale_log2=SM_SCALE_LOG2, reduce=reduce, v_halves=v_halves, count=count, flag=flag,
                sm_count=sm_count)

    def call():
        gluon_decode(q, desc, kv_scale, kv_indptr, out, part_o, part_lse, **opts)
        return out

    return call


def fused_runner(data, *, family: dict, block_n: int, num_warps: int, num_stages: int, num_splits: int,
                 reduce: str, v_split: int):
    """A call of fused_decode (fp8 KV, pointer loads, split grid) with its own buffers."""
    q, kv_data, _qo, kv_indptr, _config = data
    batch = q.shape[0]
    kv8, kv_scale = kv_data["fp8"]
    dev = q.device
    slots = batch * num_splits
    part_o = torch.empty(slots * 16 * V_DIM, dtype=torch.float32, device=dev)
    part_lse = torch.empty(slots * 16, dtype=torch.float32, device=dev)
    count = torch.zeros(2 * batch, dtype=torch.int32, device=dev)
    flag = torch.zeros(2 * batch, dtype=torch.int32, device=dev)
    out = torch.empty((batch, 16, V_DIM), dtype=torch.bfloat16, device=dev)
    kv = kv8.view(-1, QK_DIM)
    opts = dict(num_splits=num_splits, kv_fmt="fp8", q_fp8=family["q"] == "fp8_dynamic", qk_dot=family["qk_dot"],
                pv_dot=family["pv_dot"], tok_m=family["tok_m"], block_n=block_n, reduce=reduce if num_splits > 1 else "none",
                num_warps=num_warps, num_stages=num_stages, sm_scale_log2=SM_SCALE_LOG2, v_split=v_split)

    def call():
        fused_decode(q, kv, kv_scale, kv_scale, kv_indptr, out, part_o, part_lse, count, flag, **opts)
        return out

    return call


def gluon_candidates(shape: Shape, pick: Variant, sm_count: int):
    """(label, group, params, how) for the pick and the in-kernel reduction / V-half levers."""
    p = pick.p
    base = dict(block_n=p["block_n"], num_stages=p["num_stages"], v_path=p["v_path"])
    tiles = -(-shape.kv_len // p["block_n"])
    s0 = p["num_splits"]
    out = [(f"before {pick}", "before", dict(variant=str(pick)), ("backend", pick))]
    plans = [(s0, "launch", 2)] if s0 > 1 or tiles > 1 else []
    if s0 == 1:
        plans.append((1, "launch", 2))  # one split: each V half writes the output directly
    for splits in sorted({max(1, s0 // 2), s0, 2 * s0}):
        if splits > tiles or splits > GD_MAX_INKERNEL_SPLITS:
            continue
        for reduce in ("last", "spin"):
            for halves in (1, 2):
                if splits == 1:
                    continue  # nothing to reduce (the v_halves 2 direct write is above)
                plans.append((splits, reduce, halves))
    for splits, reduce, halves in dict.fromkeys(plans):
        params = dict(**base, num_splits=splits, reduce=reduce, v_halves=halves)
        try:
            gd_check_launch(shape.batch, splits, block_n=base["block_n"], num_stages=base["num_stages"],
                            v_path=base["v_path"], reduce=reduce, v_halves=halves, sm_count=sm_count)
        except ValueError:
            continue  # not resident at once (spin): not a candidate here
        label = f"gluon {base['v_path']}/{base['num_stages']} splits {splits} reduce {reduce} halves {halves}"
        out.append((label, "new", params, ("gluon", params)))
    return out


def fused_candidates(shape: Shape, sm_count: int):
    """triton_fused's run-3 pick at v_split 1 and 2 (spin only with the grid resident)."""
    family, bn, nw, st, ns, red = FU_PICKS[(shape.batch, shape.kv_len)]
    out = []
    for v_split in (1, 2):
        reduces = [red] if ns == 1 else ["last"]
        if ns > 1 and red == "spin" and shape.batch * ns * v_split <= sm_count * FU_CTAS_PER_SM.get(nw, 1):
            reduces.append("spin")
        for reduce in reduces:
            params = dict(family=family, block_n=bn, num_warps=nw, num_stages=st, num_splits=ns, reduce=reduce,
                          v_split=v_split)
            label = f"hedge fused bn{bn}/w{nw}/st{st} splits {ns} reduce {reduce} v_split {v_split}"
            out.append((label, f"hedge{v_split}", {k: v for k, v in params.items() if k != "family"}, ("fused", params)))
    return out


def make_fn(how, shape: Shape, data, sm_count: int):
    kind, what = how
    if kind == "backend":
        run = get_backend(what.backend).build(what, shape, "cuda")
        return lambda: run(*data[:4])
    if kind == "gluon":
        return gluon_runner(data, sm_count=sm_count, **what)
    if kind == "fused":
        return fused_runner(data, **what)
    return flashmla_fp8_q_outside(shape, data)


def first_call(fn):
    """Compile (and run once); the error text if that fails."""
    try:
        fn()
        return None
    except Exception as exc:  # reported per candidate, which is then skipped
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def bench_shape(shape: Shape, pick: Variant | None, sm_count: int, reps: int, threads: int) -> list[dict]:
    data = problem.generate_input(shape.batch, shape.kv_len, seed=1001, device="cuda")
    ref = problem.reference(data)
    cands = gluon_candidates(shape, pick, sm_count) if pick else []
    cands += fused_candidates(shape, sm_count)
    cands.append(("FlashMLA fp8, q outside", "flashmla", {}, ("flashmla", None)))
    rows, fns = [], []
    for label, group, params, how in cands:
        row = {"shape": str(shape), "who": label, "group": group, "params": params}
        try:
            fns.append(make_fn(how, shape, data, sm_count))
        except Exception as exc:  # a candidate that cannot be built is a row, not the end
            row["skip"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            fns.append(None)
        rows.append(row)
    t0 = time.monotonic()
    live = [(row, fn) for row, fn in zip(rows, fns, strict=True) if fn is not None]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        errors = list(pool.map(lambda rf: first_call(rf[1]), live))
    torch.cuda.synchronize()
    print(f"{shape}: {len(live)} candidates compiled and run once in {time.monotonic() - t0:.1f} s", flush=True)
    for (row, fn), err in zip(live, errors, strict=True):
        try:
            if err and first_call(fn):  # a thread-pool failure is retried once here
                raise RuntimeError(err)
            out = fn().clone()
            strict = problem.check(out, ref, problem.RULES["strict"])
            row.update(strict=strict.passed, mismatch=round(strict.mismatch, 5))
            if not strict.passed:
                row["skip"] = f"failed strict: {strict.reason}"
            else:
                t = time_call(fn, reps=reps)
                row.update(us=round(t.median_us, 2), spread=round(t.spread, 3))
        except Exception as exc:
            row["skip"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        print(f"  {row['shape']:9s} {row['who'][:90]:90s} "
              f"{row['us'] if 'us' in row else row.get('skip', '')}", flush=True)
    del data, ref
    torch.cuda.empty_cache()
    return rows


def _best(rows: list[dict], group: str) -> dict | None:
    timed = [r for r in rows if r["group"] == group and "us" in r]
    return min(timed, key=lambda r: r["us"]) if timed else None


def _short(r: dict | None) -> str:
    if r is None:
        return "-"
    p = r["params"]
    if "variant" in p:
        return f"{r['us']:.1f}"
    return f"{r['us']:.1f} ({p['v_path']}/{p['num_stages']} s{p['num_splits']} {p['reduce']} h{p['v_halves']})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="tables/H200.yaml")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget", type=float, default=170.0, help="no shape starts after this many seconds")
    ap.add_argument("--threads", type=int, default=16, help="threads for the first (compiling) calls")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.monotonic()
    from mla_tune.tables.table import load_table

    picks = load_table(args.table).variants(only_backends=["gluon_fused"])
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows: list[dict] = []
    for batch, kv_len in shapes:
        shape = Shape(batch, kv_len)
        if time.monotonic() - t0 > args.budget:
            rows.append({"shape": str(shape), "who": "-", "group": "-", "params": {},
                         "skip": f"not started: the {args.budget:.0f} s budget was spent"})
            print(f"{shape}: not started, budget spent", flush=True)
            continue
        rows += bench_shape(shape, picks.get(shape), sm_count, args.reps, args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_issue11.json").write_text(json.dumps(rows, indent=1))

    print(f"\nhedge (triton_fused at its run-3 pick, us): v_split 1 vs 2 ({time.monotonic() - t0:.0f} s so far)")
    for batch, kv_len in shapes:
        sr = [r for r in rows if r["shape"] == str(Shape(batch, kv_len))]
        cells = [f"{r['params']['reduce']}/v{r['params']['v_split']} {r['us']:.1f}" for r in sr
                 if r["group"].startswith("hedge") and "us" in r]
        print(f"  {f'{batch}x{kv_len}':9s} " + "  ".join(cells))
    print(f"\n{'shape':9s} {'before':>7s} {'best new (params)':>40s} {'FlashMLA':>9s} {'best/FlashMLA':>13s}")
    logs: dict = {"before": [], "new": [], "best": [], "flashmla": []}
    for batch, kv_len in shapes:
        sr = [r for r in rows if r["shape"] == str(Shape(batch, kv_len))]
        before, new, fm = _best(sr, "before"), _best(sr, "new"), _best(sr, "flashmla")
        best = min((r for r in (before, new) if r), key=lambda r: r["us"], default=None)
        for key, r in (("before", before), ("new", new), ("best", best), ("flashmla", fm)):
            if r:
                logs[key].append(math.log(r["us"]))
        ratio = f"{best['us'] / fm['us']:.2f}" if best and fm else "-"
        print(f"{f'{batch}x{kv_len}':9s} {before['us'] if before else '-':>7} {_short(new):>40s} "
              f"{fm['us'] if fm else '-':>9} {ratio:>13s}")
    geo = {k: f"{math.exp(sum(v) / len(v)):.1f}" if len(v) == len(shapes) else "-" for k, v in logs.items()}
    print(f"{'geomean':9s} {geo['before']:>7s} {geo['new']:>40s} {geo['flashmla']:>9s}   best of before/new "
          f"{geo['best']} us ({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
