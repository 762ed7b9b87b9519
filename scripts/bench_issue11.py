"""Issue 11's levers on the H200, at the 8 leaderboard shapes, under the leaderboard's timing
protocol (mla_tune.tune.timing.time_call), each candidate checked under `strict` first.

--mode ws (the default; the third step, warp specialization), per shape:
- best ws0: the best configuration measured so far (docs/perf.md, second step; WS_BEST);
- ws1: the same configuration with the loader warp (kernels/gluon_decode.py WS 1);
- ws2: two consumer warpgroups and the loader warp (WS 2), rs8 with 4 stages at the best
  configuration's split count and half of it (spin where the grid is resident at one CTA
  per SM, else the reduction launch);
- FlashMLA's fp8 kernel with q quantized outside the timing (bench_peers's helper).
Prints one line per candidate as it goes, then the short table last; writes every row to
--out/bench_issue11.json.

--mode levers2 (the second step, kept to reproduce it): per shape the table's Gluon pick, the
in-kernel reductions (last / spin) and V halves at the pick's split count, half and double
it, the plain-Triton hedge (triton_fused v_split 2 vs 1) and FlashMLA.

--compile (no GPU; Triton 3.6, e.g. /work/wt/gluon-venv): compiles the decode kernel offline
for sm_90a at WS 0 / 1 / 2 and prints ptxas's registers and spills, shared memory, the
setmaxnreg values and warp counts of the partitions (from the PTX), and the highest register
the SASS names.

Every candidate of a shape is first called once from a thread pool (Triton compiles with
the GIL released), then checked and timed one by one. No shape starts after --budget
seconds.

    PYTHONPATH=. python3 scripts/bench_issue11.py [--mode ws|levers2] [--reps 30] [--budget 120]
        [--threads 16] [--table tables/H200.yaml] [--shapes 4x1024,...] [--out DIR]
    PYTHONPATH=. /work/wt/gluon-venv/bin/python scripts/bench_issue11.py --compile [--configs ...]
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
                 v_halves: int, sm_count: int, ws: int = 0):
    """A call of gluon_decode with its own buffers (counters zeroed once); refuses what
    gd_check_launch refuses, before any launch."""
    q, kv_data, _qo, kv_indptr, _config = data
    batch = q.shape[0]
    gd_check_launch(batch, num_splits, block_n=block_n, num_stages=num_stages, v_path=v_path, reduce=reduce,
                    v_halves=v_halves, sm_count=sm_count, ws=ws)
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
                sm_count=sm_count, ws=ws)

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


# The best ws 0 configuration per shape measured in the second step (docs/perf.md, "Issue 11,
# second step", best of "before" and "best new"): v_path, num_stages, num_splits, reduce, v_halves.
WS_BEST = {
    (4, 1024): ("ss16", 2, 16, "spin", 2),
    (4, 8192): ("rs8", 2, 32, "spin", 1),
    (32, 1024): ("rs8", 2, 4, "launch", 1),
    (32, 8192): ("rs8", 2, 8, "spin", 1),
    (64, 1024): ("rs8", 2, 4, "spin", 1),
    (64, 8192): ("rs8", 2, 4, "spin", 1),
    (256, 1024): ("rs8", 2, 1, "launch", 1),
    (256, 8192): ("rs8", 2, 1, "launch", 1),
}
WS2_STAGES = 4  # two consumers: two ring slots each


def ws_candidates(shape: Shape, sm_count: int):
    """(label, group, params, how) for the third step at `shape`: the best ws 0 configuration,
    the same with ws 1, and ws 2 (rs8, WS2_STAGES stages) at its split count and half of it."""
    v_path, stages, s0, reduce, halves = WS_BEST[(shape.batch, shape.kv_len)]
    best = dict(block_n=64, num_stages=stages, v_path=v_path, num_splits=s0, reduce=reduce, v_halves=halves)
    out = []
    for ws in (0, 1):
        params = dict(best, ws=ws)
        label = f"ws{ws} {v_path}/{stages} s{s0} {reduce} h{halves}"
        out.append((label, f"ws{ws}", params, ("gluon", params)))
    tiles = -(-shape.kv_len // 64)
    for splits in sorted({max(1, s0 // 2), s0}):
        if splits > tiles:
            continue
        params = dict(block_n=64, num_stages=WS2_STAGES, v_path="rs8", num_splits=splits, reduce="launch",
                      v_halves=1, ws=2)
        if splits > 1:
            try:  # the in-kernel reduction where the grid is resident at one CTA per SM
                gd_check_launch(shape.batch, splits, block_n=64, num_stages=WS2_STAGES, v_path="rs8", reduce="spin",
                                sm_count=sm_count, ws=2)
                params["reduce"] = "spin"
            except ValueError:
                pass
        label = f"ws2 rs8/{WS2_STAGES} s{splits} {params['reduce']} h1"
        out.append((label, "ws2", params, ("gluon", params)))
    out.append(("FlashMLA fp8, q outside", "flashmla", {}, ("flashmla", None)))
    return out


def bench_shape(shape: Shape, cands: list, sm_count: int, reps: int, threads: int) -> list[dict]:
    data = problem.generate_input(shape.batch, shape.kv_len, seed=1001, device="cuda")
    ref = problem.reference(data)
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


def _geomean(values: list[float], n: int) -> str:
    return f"{math.exp(sum(map(math.log, values)) / n):.1f}" if values and len(values) == n else "-"


def print_levers2(rows: list[dict], shapes, elapsed: float) -> None:
    print(f"\nhedge (triton_fused at its run-3 pick, us): v_split 1 vs 2 ({elapsed:.0f} s so far)")
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
                logs[key].append(r["us"])
        ratio = f"{best['us'] / fm['us']:.2f}" if best and fm else "-"
        print(f"{f'{batch}x{kv_len}':9s} {before['us'] if before else '-':>7} {_short(new):>40s} "
              f"{fm['us'] if fm else '-':>9} {ratio:>13s}")
    geo = {k: _geomean(v, len(shapes)) for k, v in logs.items()}
    print(f"{'geomean':9s} {geo['before']:>7s} {geo['new']:>40s} {geo['flashmla']:>9s}   best of before/new "
          f"{geo['best']} us ({elapsed:.0f} s)")


def print_ws(rows: list[dict], shapes, elapsed: float) -> None:
    """The third step's short table: median us per shape, each row strict-checked."""
    print(f"\n{'shape':9s} {'ws0 (best so far)':>36s} {'ws1 same':>9s} {'ws2 best (params)':>32s} {'FlashMLA':>9s} "
          f"{'best/FM':>8s}")
    logs: dict = {"ws0": [], "ws1": [], "ws2": [], "best": [], "flashmla": []}
    for batch, kv_len in shapes:
        sr = [r for r in rows if r["shape"] == str(Shape(batch, kv_len))]
        w0, w1, w2, fm = (_best(sr, g) for g in ("ws0", "ws1", "ws2", "flashmla"))
        best = min((r for r in (w0, w1, w2) if r), key=lambda r: r["us"], default=None)
        for key, r in (("ws0", w0), ("ws1", w1), ("ws2", w2), ("best", best), ("flashmla", fm)):
            if r:
                logs[key].append(r["us"])
        ratio = f"{best['us'] / fm['us']:.2f}" if best and fm else "-"
        w2_text = f"{w2['us']:.1f} (s{w2['params']['num_splits']} {w2['params']['reduce']})" if w2 else "-"
        w1_text = f"{w1['us']:.1f}" if w1 else "-"
        fm_text = f"{fm['us']:.1f}" if fm else "-"
        print(f"{f'{batch}x{kv_len}':9s} {_short(w0):>36s} {w1_text:>9s} {w2_text:>32s} {fm_text:>9s} {ratio:>8s}")
    geo = {k: _geomean(v, len(shapes)) for k, v in logs.items()}
    print(f"{'geomean':9s} {geo['ws0']:>36s} {geo['ws1']:>9s} {geo['ws2']:>32s} {geo['flashmla']:>9s}   "
          f"best of ws0/1/2 {geo['best']} us ({elapsed:.0f} s)")


# --------------------------------------------------------------------------- offline compile
COMPILE_CONFIGS = ("64/2/rs8/spin/h1/ws0", "64/2/rs8/spin/h1/ws1", "64/4/rs8/spin/h1/ws2",
                   "64/2/ss16/spin/h2/ws0", "64/2/ss16/spin/h2/ws1", "64/3/ss16/launch/h1/ws2",
                   "64/2/rs8/one/h1/ws1", "64/4/rs8/one/h1/ws2", "64/5/rs8/last/h1/ws2", "64/3/rs16/launch/h1/ws2",
                   "64/2/ss16a/launch/h2/ws2", "64/2/rs8/spin/h2/ws2")


def compile_report(configs: list[str]) -> None:
    """Compile the decode kernel offline (Triton 3.6, sm_90a, no GPU) per configuration
    block_n/stages/v_path/one|launch|last|spin/h1|h2/ws0|ws1|ws2 and print what the
    compiler says about it. ptxas -v reports the kernel-wide register limit (maxnreg for a
    warp-specialized kernel); the per-partition counts are the PTX's setmaxnreg values, and
    the SASS's highest register is what the widest partition uses."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from mla_tune.kernels.gluon_decode import (
        GD_REDUCE_CODES,
        GD_V_PATHS,
        GD_WS_MAXNREG,
        _gd_decode_kernel,
        gd_smem_bytes,
    )
    from scripts.gluon_probe import registers, sass_summary

    print(f"Gluon decode, offline: triton {triton.__version__}, sm_90a, 4 default warps")
    print(f"{'config':<26} {'ptxas':<18} {'smem':>7} {'=est':>4} {'warps':>5}  {'setmaxnreg (PTX, in order)':<34}"
          f" {'max R':>5}  LDS.U8 QGMMA HGMMA BAR")
    for text in configs:
        bn, stages, v_path, mode, halves, ws = text.split("/")
        bn, stages, halves, ws = int(bn), int(stages), int(halves[1:]), int(ws[2:])
        split = mode != "one"
        red = GD_REDUCE_CODES[mode] if split and mode != "one" else 0
        desc = gd_kv_descriptor(torch.empty(256, QK_DIM, dtype=torch.float8_e4m3fn), bn)
        sig = {"kv_desc": mangle_type(desc), "Q": "*bf16", "KV_SCALE": "*fp32", "KV_INDPTR": "*i32",
               "OUT": "*bf16", "PART_O": "*fp32", "PART_LSE": "*fp32", "sm_scale_log2": "fp32",
               "num_splits": "i32", "COUNT": "*i32", "FLAG": "*i32", "BN": "constexpr", "STAGES": "constexpr",
               "V_PATH": "constexpr", "SPLIT": "constexpr", "REDUCE": "constexpr", "V_HALVES": "constexpr",
               "NS": "constexpr", "WS": "constexpr"}
        consts = {"BN": bn, "STAGES": stages, "V_PATH": GD_V_PATHS[v_path], "SPLIT": split, "REDUCE": red,
                  "V_HALVES": halves, "NS": 8 if red else 2, "WS": ws}
        options = {"num_warps": 4, **({"maxnreg": GD_WS_MAXNREG[ws]} if ws else {})}
        try:
            k = triton.compile(GluonASTSource(_gd_decode_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                               options=options)
        except Exception as exc:  # one configuration failing is itself a result
            msg = " | ".join(line for line in str(exc).splitlines() if line.strip())[:300]
            print(f"{text:<26} compile failed: {msg}")
            continue
        ptx = k.asm["ptx"]
        counts, sass = sass_summary(k.asm["cubin"])
        setmax = [f"{m.group(1)[0]}{m.group(2)}" for m in re.finditer(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]
        seen = list(dict.fromkeys(setmax))
        max_r = max((int(r) for r in re.findall(r"\bR(\d+)\b", sass)), default=0)
        est = gd_smem_bytes(bn, stages, v_path, halves, ws)
        qgmma, hgmma, bar = (sum(v for key, v in counts.items() if key.split(".")[0] == prefix)
                             for prefix in ("QGMMA", "HGMMA", "BAR"))
        print(f"{text:<26} {registers(ptx):<18} {k.metadata.shared:>7} {'ok' if est == k.metadata.shared else est:>4} "
              f"{k.metadata.num_warps:>5}  {' '.join(seen) or '-':<34} {max_r:>5}  {counts.get('LDS.U8', 0):>6} "
              f"{qgmma:>5} {hgmma:>5} {bar:>3}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("ws", "levers2"), default="ws")
    ap.add_argument("--compile", action="store_true", help="compile offline (Triton 3.6, no GPU) and report; no timing")
    ap.add_argument("--configs", default=",".join(COMPILE_CONFIGS),
                    help="--compile: block_n/stages/v_path/one|launch|last|spin/h1|h2/ws0|ws1|ws2, comma-separated")
    ap.add_argument("--table", default="tables/H200.yaml")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--budget", type=float, default=120.0, help="no shape starts after this many seconds")
    ap.add_argument("--threads", type=int, default=16, help="threads for the first (compiling) calls")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.compile:
        compile_report([c.strip() for c in args.configs.split(",") if c.strip()])
        return
    t0 = time.monotonic()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    picks = {}
    if args.mode == "levers2":
        from mla_tune.tables.table import load_table

        picks = load_table(args.table).variants(only_backends=["gluon_fused"])
    rows: list[dict] = []
    for batch, kv_len in shapes:
        shape = Shape(batch, kv_len)
        if time.monotonic() - t0 > args.budget:
            rows.append({"shape": str(shape), "who": "-", "group": "-", "params": {},
                         "skip": f"not started: the {args.budget:.0f} s budget was spent"})
            print(f"{shape}: not started, budget spent", flush=True)
            continue
        if args.mode == "ws":
            cands = ws_candidates(shape, sm_count)
        else:
            pick = picks.get(shape)
            cands = (gluon_candidates(shape, pick, sm_count) if pick else []) + fused_candidates(shape, sm_count)
            cands.append(("FlashMLA fp8, q outside", "flashmla", {}, ("flashmla", None)))
        rows += bench_shape(shape, cands, sm_count, args.reps, args.threads)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_issue11.json").write_text(json.dumps(rows, indent=1))
    (print_ws if args.mode == "ws" else print_levers2)(rows, shapes, time.monotonic() - t0)


if __name__ == "__main__":
    main()
