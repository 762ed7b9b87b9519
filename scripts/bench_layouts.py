"""The split-K kernel's two launch paths side by side on one GPU, under the leaderboard's
timing protocol (mla_tune.tune.timing.time_call):

1. The 8 leaderboard shapes: `flash_decode` (the leaderboard kernel) against
   `flash_decode_serving` (the serving kernel, contiguous KV, 16 heads, q_len 1, the same
   splits given as tokens_per_split), each at the `triton` alternate of tables/H200.yaml
   (built-in copies below when the table is absent). Rounds alternate old and new; the
   figure is the median of the rounds' medians. Target: new/old <= 1.03 at every shape.
2. Serving shapes: paged KV (64-token pages, shuffled), 128 heads, 2 new tokens per
   sequence, fp8 and bf16 KV, a few launch configurations each; time per call, share of
   copy bandwidth (the KV bytes read once), host wall time of an eager call, and the
   strict check against the fp32 reference.

    PYTHONPATH=. python3 scripts/bench_layouts.py [--table tables/H200.yaml] [--rounds 3]

Prints the tables last; writes every row to $OUT/bench_layouts.jsonl (or --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
from pathlib import Path

import torch
import yaml

from mla_tune import problem
from mla_tune.core import Variant, fp8_dtype_for
from mla_tune.kernels.flash_decode import (
    FlashDecodeServingWorkspace,
    FlashDecodeWorkspace,
    flash_decode,
    flash_decode_serving,
)
from mla_tune.serving import inputs as serving
from mla_tune.tune.timing import time_call, wall_time

SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192)]
# tables/H200.yaml's triton alternates (2026-11-30), used when the table is absent.
BUILTIN_PICKS = {
    (4, 1024): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=16,num_stages=2,num_warps=4,q=bf16)",
    (4, 8192): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=32,num_stages=2,num_warps=4,q=bf16)",
    (32, 1024): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=8,num_stages=2,num_warps=4,q=bf16)",
    (32, 8192): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=8,num_stages=2,num_warps=4,q=bf16)",
    (64, 1024): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=4,num_stages=2,num_warps=4,q=fp8_static,q_amax=5.8094)",
    (64, 8192): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=4,num_stages=2,num_warps=4,q=bf16)",
    (256, 1024): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=1,num_stages=2,num_warps=4,q=bf16)",
    (256, 8192): "triton(block_n=64,dot_dtype=bf16,kv=bf16,num_splits=1,num_stages=2,num_warps=4,q=bf16)",
}
SERVING_SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 8192)]
SERVING_HEADS, SERVING_Q_LEN, SERVING_PAGE = 128, 2, 64
# (block_h, block_n, num_warps, num_stages): the MMA gets block_h * q_len rows. Picked from
# ptxas's spill report (Triton 3.6, sm_90, no GPU): 8 warps hold 32 rows without spilling.
SERVING_CONFIGS = [(16, 64, 8, 2), (16, 32, 8, 3), (32, 64, 8, 2), (16, 32, 4, 2)]
MAX_SPLITS = 16
DEVICE = "cuda"


def leaderboard_picks(table: Path) -> dict:
    if not table.exists():
        return {k: Variant.parse(v) for k, v in BUILTIN_PICKS.items()}
    rows = yaml.safe_load(table.read_text())["rows"]
    return {(r["batch"], r["kv_len"]): Variant.parse(r["alternates"]["triton"]["variant"]) for r in rows}


def copy_bandwidth(table: Path) -> float:
    """Bytes/s: the table's measured copy bandwidth, else a 1 GiB device copy timed here."""
    if table.exists():
        bw = yaml.safe_load(table.read_text()).get("provenance", {}).get("copy_bandwidth_gbps")
        if bw:
            return float(bw) * 1e9
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() / (t.median_us * 1e-6)


def alternate(fns: dict, rounds: int) -> dict:
    """Median over rounds of each fn's time_call median; the fns take turns per round."""
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(time_call(fn, reps=30).median_us)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_leaderboard(picks: dict, rounds: int) -> list[dict]:
    rows = []
    device = DEVICE
    q_fp8 = fp8_dtype_for(device)
    for batch, kv_len in SHAPES:
        v = picks[(batch, kv_len)]
        data = problem.generate_input(batch, kv_len, seed=1001, device=device)
        q, kv_data, qo_indptr, kv_indptr, _cfg = data
        kv, kv_scale = (kv_data["bf16"], None) if v.get("kv") == "bf16" else kv_data["fp8"]
        splits = v.get("num_splits")
        q_scale = v.get("q_amax") / torch.finfo(q_fp8).max if v.get("q") == "fp8_static" else None
        common = dict(block_n=v.get("block_n"), num_warps=v.get("num_warps"), num_stages=v.get("num_stages"),
                      dot_dtype=v.get("dot_dtype"), q_mode=v.get("q"), q_scale=q_scale, q_fp8_dtype=q_fp8)
        out_old = torch.empty((batch, 16, 512), dtype=torch.bfloat16, device=device)
        out_new = torch.full_like(out_old, float("nan"))
        ws_old = FlashDecodeWorkspace.allocate(batch, splits, device)
        ws_new = FlashDecodeServingWorkspace.allocate(batch, 16, splits, device)
        tokens_per_split = math.ceil(kv_len / splits)

        old = functools.partial(flash_decode, q, kv, kv_scale, kv_indptr, out_old, num_splits=splits,
                                workspace=ws_old, **common)
        new = functools.partial(flash_decode_serving, q, qo_indptr, kv, kv_scale, out_new,
                                kv_indptr=kv_indptr, max_q_len=1, max_splits=splits,
                                tokens_per_split=tokens_per_split, block_h=16, workspace=ws_new, **common)
        old()
        new()
        torch.cuda.synchronize()
        same = bool(torch.equal(out_old, out_new))
        times = alternate({"old": old, "new": new}, rounds)
        rows.append({"part": "leaderboard", "shape": f"{batch}x{kv_len}", "variant": str(v),
                     "old_us": round(times["old"], 3), "new_us": round(times["new"], 3),
                     "ratio": round(times["new"] / times["old"], 4), "bitwise_equal": same})
        print(rows[-1], flush=True)
    return rows


def serving_splits(batch: int, kv_len: int, head_tiles: int, sm_count: int) -> int:
    """tokens_per_split giving about two waves of programs (at most MAX_SPLITS splits)."""
    want = max(1, min(MAX_SPLITS, math.ceil(2 * sm_count / (batch * head_tiles))))
    return max(64, math.ceil(kv_len / want))


def bench_serving(copy_bw: float) -> list[dict]:
    rows = []
    device = DEVICE
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for kv_format in ("fp8", "bf16"):
        for batch, kv_len in SERVING_SHAPES:
            kv_lens = [kv_len] * batch
            inp = serving.make_input([SERVING_Q_LEN] * batch, kv_lens, SERVING_HEADS, SERVING_PAGE,
                                     kv_format, seed=7, device=device)
            ref = inp.reference("bf16")
            kv_bytes = sum(kv_lens) * 576 * inp.kv.element_size()
            total_q = inp.q.shape[0]
            workspace = FlashDecodeServingWorkspace.allocate(total_q, SERVING_HEADS, MAX_SPLITS, device)
            out = torch.empty((total_q, SERVING_HEADS, 512), dtype=torch.bfloat16, device=device)
            for block_h, block_n, num_warps, num_stages in SERVING_CONFIGS:
                tps = serving_splits(batch, kv_len, SERVING_HEADS // block_h, sm_count)

                call = functools.partial(
                    flash_decode_serving, inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, **inp.layout,
                    max_q_len=SERVING_Q_LEN, max_splits=MAX_SPLITS, tokens_per_split=tps,
                    block_n=block_n, block_h=block_h, num_warps=num_warps, num_stages=num_stages,
                    dot_dtype="bf16", workspace=workspace)
                row = {"part": "serving", "kv": kv_format, "shape": f"{batch}x{kv_len}",
                       "config": f"h{block_h} n{block_n} w{num_warps} s{num_stages} tps{tps}"}
                try:
                    out.fill_(float("nan"))
                    call()
                    torch.cuda.synchronize()
                    check = problem.check(out, ref, problem.RULES["strict"])
                    t = time_call(call, reps=30)
                    row.update(us=round(t.median_us, 3), spread=round(t.spread, 3),
                               copy_bw_share=round(kv_bytes / (t.median_us * 1e-6) / copy_bw, 4),
                               wall_us=round(wall_time(call, reps=10).median_us, 1),
                               strict=check.passed, mismatch=check.mismatch)
                except Exception as exc:  # one failing config must not hide the others
                    row.update(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                rows.append(row)
                print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="tables/H200.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_layouts.jsonl"))
    args = parser.parse_args()
    table = Path(args.table)
    copy_bw = copy_bandwidth(table)
    lb = bench_leaderboard(leaderboard_picks(table), args.rounds)
    sv = bench_serving(copy_bw)
    out = Path(args.out)
    if out.is_dir():  # `--out $OUT` names the folder: the file goes inside it
        out = out / "bench_layouts.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in lb + sv))

    print(f"\n{torch.cuda.get_device_name(0)}, copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print("leaderboard shapes: flash_decode (old) vs flash_decode_serving (new), us")
    print(f"{'shape':>10} {'old':>9} {'new':>9} {'new/old':>8} {'same out':>9}")
    for r in lb:
        print(f"{r['shape']:>10} {r['old_us']:>9.2f} {r['new_us']:>9.2f} {r['ratio']:>8.3f} {str(r['bitwise_equal']):>9}")
    worst = max(r["ratio"] for r in lb)
    print(f"worst new/old {worst:.3f}: {'within' if worst <= 1.03 else 'OUTSIDE'} the 3% target")
    print(f"\nserving: paged {SERVING_PAGE}, {SERVING_HEADS} heads, q_len {SERVING_Q_LEN}")
    print(f"{'kv':>5} {'shape':>9} {'config':>26} {'us':>9} {'copy bw':>8} {'wall us':>8} {'strict':>7}")
    for r in sv:
        if "error" in r:
            print(f"{r['kv']:>5} {r['shape']:>9} {r['config']:>26}  {r['error'][:60]}")
        else:
            print(f"{r['kv']:>5} {r['shape']:>9} {r['config']:>26} {r['us']:>9.2f} "
                  f"{r['copy_bw_share']:>8.1%} {r['wall_us']:>8.1f} {str(r['strict']):>7}")


if __name__ == "__main__":
    main()
