"""Side by side on one GPU, under the leaderboard's timing protocol: the tuned runtime,
mla-tune's own kernel families at their best configuration (triton, triton_fused,
gluon_fused), FlashInfer fa3 (bf16 and fp8 KV), FlashMLA (bf16, and fp8 q x fp8 KV) and the
torch baseline, at the 8 leaderboard shapes. FlashMLA's fp8 path is timed both ways: q
quantized inside the timed call (the backend, what a submission pays) and outside it
(`peer:flashmla-fp8-q-outside`, q quantized once before timing: the kernel alone).

Prints microseconds, GB/s, share of copy bandwidth and the ratio to the best peer; writes
every row to $OUT/bench_peers.jsonl (or --out). A contender that cannot run says why.

    PYTHONPATH=. python3 scripts/bench_peers.py [--table tables/H200.yaml]
        [--results tables/H200.results.jsonl] [--shapes 4x1024,...] [--reps 30]

Own families' configurations: the best `ok` row per (backend, shape) in --results when
that file exists, else the built-in picks below (from scripts/explore_fused.py at 9401329).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
from pathlib import Path

import torch

from mla_tune import problem
from mla_tune.backends import EXTRA_BACKENDS_ENV, get_backend, known_backends
from mla_tune.core import Shape, Variant
from mla_tune.gpu import detect
from mla_tune.tune.timing import time_call

COPY_BW = 4.28e12  # bytes/s, the H200's measured copy bandwidth (PROBLEM.md)
BYTES_PER_TOKEN = {"bf16": 1152, "fp8": 576, "mxfp4": 288 + 18}
SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192)]
PEERS = ("flashinfer", "flashmla")
_FQ8 = dict(kv="fp8", q="fp8_dynamic", qk_dot="fp8", pv_dot="fp16", tok_m=True)
_F16 = dict(kv="fp8", q="bf16", qk_dot="fp16", pv_dot="fp16", tok_m=True)
# triton_fused's best strict-passing configuration per shape in the second run of
# scripts/explore_fused.py at 9401329 (2026-11-30, H200; docs/perf.md): family, block_n,
# num_warps, num_stages, splits, reduce
FU_PICKS = {
    (4, 1024): (_F16, 32, 4, 3, 32, "spin"), (4, 8192): (_FQ8, 64, 4, 3, 32, "spin"),
    (32, 1024): (_FQ8, 64, 4, 3, 4, "spin"), (32, 8192): (_FQ8, 128, 8, 3, 4, "spin"),
    (64, 1024): (_FQ8, 128, 8, 3, 2, "spin"), (64, 8192): (_FQ8, 128, 8, 3, 2, "spin"),
    (256, 1024): (_FQ8, 64, 4, 3, 1, "none"), (256, 8192): (_FQ8, 64, 4, 3, 1, "none"),
}


def fused_pick(shape: Shape) -> Variant:
    family, bn, nw, st, ns, red = FU_PICKS[(shape.batch, shape.kv_len)]
    return Variant.make("triton_fused", **family, block_n=bn, num_warps=nw, num_stages=st, num_splits=ns, reduce=red)


def best_from_results(path: Path) -> dict:
    """(backend, batch, kv_len) -> fastest ok variant text in a sweep's results file."""
    best: dict = {}
    if not path.exists():
        return best
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") != "candidate" or row.get("status") != "ok" or not row.get("time"):
            continue
        key = (row["backend"], row["shape"]["batch"], row["shape"]["kv_len"])
        if key not in best or row["time"]["median_us"] < best[key][0]:
            best[key] = (row["time"]["median_us"], row["variant"])
    return {k: v[1] for k, v in best.items()}


def contenders(shape: Shape, platform, best: dict, table: str | None):
    """(label, kv format, runner or None, reason) for every contender at this shape."""
    out = []
    if table and Path(table).exists():
        from mla_tune import runtime

        rt = runtime.load(table=table)
        out.append(("runtime(table)", None, rt.custom_kernel, ""))
    else:
        out.append(("runtime(table)", None, None, f"no table at {table}"))
    for family in ("gluon_fused", "triton_fused", "triton"):
        text = best.get((family, shape.batch, shape.kv_len))
        if text:
            variant = Variant.parse(text)
        elif family == "triton_fused":
            variant = fused_pick(shape)
        elif family == "triton":
            variant = get_backend("triton").default_variant(shape, platform.sm_count)
        else:
            out.append((family, None, None, "no ok record in the results file"))
            continue
        out.append((f"own:{variant}", variant.get("kv"), ("variant", variant), ""))
    out.append(("peer:flashmla-fp8-q-outside", "fp8", ("q_outside", None), ""))
    for name in (*PEERS, "torch"):
        try:
            backend = get_backend(name)
        except Exception as exc:  # a missing module is reported, not fatal
            out.append((name, None, None, f"{type(exc).__name__}: {exc}"))
            continue
        reason = backend.unavailable_reason()
        if reason:
            out.append((name, None, None, reason))
            continue
        for variant in backend.candidates(shape, {}, platform):
            if variant.get("q") == "fp8_static":
                continue  # needs a calibrated q_amax; fp8_dynamic stands for fp8 q here
            out.append((f"peer:{variant}" if name != "torch" else f"base:{variant}",
                        variant.get("kv"), ("variant", variant), ""))
    return out


def flashmla_fp8_q_outside(shape: Shape, data):
    """FlashMLA's fp8 kernel alone: q quantized (dynamic per-tensor scale) once, before the
    timing, so the timed call is flash_mla_with_kvcache only."""
    import flash_mla

    from mla_tune.core import NUM_HEADS, NUM_KV_HEADS, QK_DIM, SM_SCALE, V_DIM
    from mla_tune.kernels.q_quant import QQuantizer

    page = 64  # FlashMLA's page size
    q, kv_data = data[0], data[1]
    kv, kv_scale = kv_data["fp8"]
    batch, kv_len = shape.batch, shape.kv_len
    num_pages = shape.total_kv // page
    block_table = torch.arange(num_pages, dtype=torch.int32, device="cuda").view(batch, kv_len // page)
    seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    sched = flash_mla.get_mla_metadata()[0]
    sched.tile_scheduler_metadata, sched.num_splits = flash_mla.get_mla_decoding_metadata(
        seqlens, NUM_HEADS // NUM_KV_HEADS, NUM_KV_HEADS, h_q=NUM_HEADS, is_fp8_kvcache=True,
        use_legacy=True)
    q8, q_scale = QQuantizer("fp8_dynamic", batch, "cuda", torch.float8_e4m3fn)(q)
    q8, q_scale = q8.clone(), q_scale.clone()
    pages = kv.view(num_pages, page, NUM_KV_HEADS, QK_DIM)

    def call():
        out, _lse = flash_mla.flash_mla_with_kvcache(
            q8.view(batch, 1, NUM_HEADS, QK_DIM), pages, block_table, seqlens, V_DIM, sched,
            softmax_scale=SM_SCALE, causal=False, is_fp8_kvcache=True, use_legacy=True,
            descale_q=q_scale, descale_k=kv_scale)
        return out.view(batch, NUM_HEADS, V_DIM)

    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default="tables/H200.yaml")
    ap.add_argument("--results", default="tables/H200.results.jsonl")
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if "triton_fused" not in known_backends():  # until the registry lists it
        extra = os.environ.get(EXTRA_BACKENDS_ENV, "")
        os.environ[EXTRA_BACKENDS_ENV] = ",".join(filter(None, [extra, "triton_fused=mla_tune.backends.triton_fused"]))
    platform = detect()
    best = best_from_results(Path(args.results))
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = []
    log = open(os.path.join(args.out, "bench_peers.jsonl"), "w")
    for batch, kv_len in shapes:
        shape = Shape(batch, kv_len)
        data = problem.generate_input(batch, kv_len, seed=1001, device="cuda")
        ref = problem.reference(data)
        shape_rows = []
        for label, kv, how, reason in contenders(shape, platform, best, args.table):
            row = {"shape": str(shape), "who": label}
            try:
                if how is None:
                    raise RuntimeError(reason)
                if isinstance(how, tuple) and how[0] == "q_outside":
                    fn = flashmla_fp8_q_outside(shape, data)
                elif isinstance(how, tuple):
                    variant = how[1]
                    fn = functools.partial(get_backend(variant.backend).build(variant, shape, "cuda"), *data[:4])
                else:
                    fn = functools.partial(how, data)
                out = fn().clone()
                strict = problem.check(out, ref, problem.RULES["strict"])
                board = problem.check(out, ref, problem.RULES["leaderboard"])
                t = time_call(fn, reps=args.reps)
                row.update(us=t.median_us, strict=strict.passed, leaderboard=board.passed, mismatch=strict.mismatch)
                if kv:
                    nbytes = batch * kv_len * BYTES_PER_TOKEN[kv] + batch * 16 * (576 + 512) * 2
                    row.update(gbs=nbytes / t.median_us / 1e3, pct_copy=100 * nbytes / (t.median_us * 1e-6) / COPY_BW)
            except Exception as exc:  # reported per contender: the others still run
                row["skip"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            shape_rows.append(row)
        peer_us = [r["us"] for r in shape_rows if r["who"].startswith("peer:") and "us" in r and r["leaderboard"]]
        for r in shape_rows:
            if "us" in r and peer_us:
                r["vs_best_peer"] = r["us"] / min(peer_us)
            log.write(json.dumps(r) + "\n")
        rows += shape_rows
        data = ref = None  # free before the next shape
        torch.cuda.empty_cache()
    log.close()

    def num(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"

    print(f"\n{'shape':9s} {'contender':100s} {'us':>8s} {'GB/s':>7s} {'%copy':>6s} {'xpeer':>6s} strict board")
    for r in rows:
        if "skip" in r:
            print(f"{r['shape']:9s} {r['who'][:100]:100s} skipped: {r['skip']}")
            continue
        print(f"{r['shape']:9s} {r['who'][:100]:100s} {r['us']:8.2f} {num(r, 'gbs', '7.0f'):>7s} "
              f"{num(r, 'pct_copy', '6.1f'):>6s} {num(r, 'vs_best_peer', '6.2f'):>6s} {r['strict']!s:6s} {r['leaderboard']}")
    by_who: dict = {}
    for r in rows:
        if "us" in r:
            # own families by name (their picks differ per shape); peers and the base by variant
            who = r["who"].split("(")[0] if r["who"].startswith("own:") else r["who"]
            by_who.setdefault(who, []).append(r["us"])
    print("\ngeomean over shapes where each contender ran all of them:")
    for who, vals in by_who.items():
        if len(vals) == len(shapes):
            print(f"  {who[:90]:90s} {math.exp(sum(map(math.log, vals)) / len(vals)):8.2f} us")


if __name__ == "__main__":
    main()
