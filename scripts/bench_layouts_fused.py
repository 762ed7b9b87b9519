"""Old vs general fused kernel on the GPU: the leaderboard kernel (backend triton_fused,
kernels/fused_decode.py's `fused_decode`) against `fused_decode_serving` on the same call.

    PYTHONPATH=. python scripts/bench_layouts_fused.py [--table tables/H200.yaml] [--reps 30]

Leaderboard shapes (batch {4, 32, 64, 256} x kv_len {1024, 8192}): each row's triton_fused
pick from the table (winner or alternate), run by the old kernel and by the general one
with the same tile, dots, warps and stages, tokens_per_split 1 and max_splits num_splits
(the same splits), block_h 16; both checked under the strict rule against the fp32
reference and timed under the leaderboard protocol (mla_tune.tune.timing.time_call). The
general kernel has no spin barrier, TMA, persistent grid or MXFP4: picks that use them
are timed for the old kernel only. Serving shapes (paged 64, 128 heads, q_len 2): the
general fused kernel and the split-K flash_decode_serving, checked and timed. The table
comes last; `within 3%` says whether the general kernel could take the leaderboard path
(it does not today: triton_fused keeps the old kernel).
"""

from __future__ import annotations

import argparse

import torch
import yaml

from mla_tune import problem
from mla_tune.backends import triton_fused
from mla_tune.core import Shape, Variant
from mla_tune.kernels.flash_decode import FlashDecodeServingWorkspace, flash_decode_serving
from mla_tune.kernels.fused_decode import FusedServingWorkspace, fused_decode_serving
from mla_tune.serving import inputs as serving
from mla_tune.tune.timing import time_call

LEADERBOARD_SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192)]
SERVING_SHAPES = [(32, 1024), (32, 8192), (128, 2048)]  # (batch, kv_len), paged 64, 128 heads, q_len 2


def _fused_pick(row: dict) -> Variant | None:
    if row.get("winner", {}).get("backend") == "triton_fused":
        return Variant.parse(row["winner"]["variant"])
    alt = (row.get("alternates") or {}).get("triton_fused")
    return Variant.parse(alt["variant"]) if alt else None


def _general_reason(p: dict) -> str | None:
    if p["kv"] == "mxfp4" or p.get("load", "ptr") != "ptr" or p.get("grid", "split") != "split" or not p["tok_m"]:
        return "mxfp4/tma/persistent/heads-on-M: old kernel only"
    return None


def _check(out, ref, what: str, rule: str = "strict") -> str:
    result = problem.check(out, ref, problem.RULES[rule])
    if not result.passed:
        print(f"  FAIL {what}: {result.reason}")
    return "ok" if result.passed else "FAIL"


def _leaderboard_row(pick: Variant, batch: int, kv_len: int, reps: int) -> tuple:
    p = pick.p
    data = problem.generate_input(batch, kv_len, seed=batch * 7 + kv_len, device="cuda")
    ref = problem.reference(data)
    run = triton_fused.build(pick, Shape(batch, kv_len), "cuda")
    # MXFP4 picks are held to the leaderboard rule (as tests/test_fused_decode.py does).
    old_ok = _check(run(*data[:4]), ref, f"old {pick}", "leaderboard" if p["kv"] == "mxfp4" else "strict")
    old_us = time_call(lambda: run(*data[:4]), reps=reps).median_us
    reason = _general_reason(p)
    if reason:
        return old_us, old_ok, None, reason
    inp = serving.from_leaderboard(data, p["kv"])
    ws = FusedServingWorkspace.allocate(batch, 16, p["num_splits"], "cuda")
    out = torch.empty((batch, 16, 512), dtype=torch.bfloat16, device="cuda")

    def general():
        fused_decode_serving(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, kv_indptr=inp.kv_indptr,
                             max_q_len=1, max_splits=p["num_splits"], tokens_per_split=1,
                             block_n=p["block_n"], block_h=16, num_warps=p["num_warps"],
                             num_stages=p["num_stages"], q_fp8=p["q"] == "fp8_dynamic",
                             qk_dot=p["qk_dot"], pv_dot=p["pv_dot"], workspace=ws)

    general()
    new_ok = _check(out, ref, f"general {pick}")
    return old_us, old_ok, time_call(general, reps=reps).median_us, new_ok


def _serving_row(batch: int, kv_len: int, q_fp8: bool, reps: int) -> tuple:
    heads, q_len, max_splits = 128, 2, 16
    lens = [kv_len] * batch
    inp = serving.make_input([q_len] * batch, lens, heads, 64, "fp8", seed=batch + kv_len, device="cuda")
    total_q = inp.q.shape[0]
    ref = inp.reference()
    if q_fp8:
        q = inp.q.float()
        scale = q.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
        ref = serving.reference((q / scale).to(torch.float8_e4m3fn).float() * scale, inp.qo_indptr,
                                inp.kv, inp.kv_scale, **inp.layout)
    out = torch.empty((total_q, heads, 512), dtype=torch.bfloat16, device="cuda")
    tps = max(64, -(-kv_len * batch * 8 // (132 * 16)))  # ~ one wave of 132 SMs over 8 head tiles
    ws = FusedServingWorkspace.allocate(total_q, heads, max_splits, "cuda")

    def fused():
        fused_decode_serving(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, **inp.layout, max_q_len=q_len,
                             max_splits=max_splits, tokens_per_split=tps, block_n=64, block_h=8, num_warps=4,
                             num_stages=2, q_fp8=q_fp8, qk_dot="fp8" if q_fp8 else "bf16", pv_dot="bf16",
                             workspace=ws)

    fused()
    fused_ok = _check(out, ref, f"fused serving {batch}x{kv_len}")
    fused_us = time_call(fused, reps=reps).median_us
    fws = FlashDecodeServingWorkspace.allocate(total_q, heads, max_splits, "cuda")

    def split_k():
        flash_decode_serving(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, **inp.layout, max_q_len=q_len,
                             max_splits=max_splits, tokens_per_split=tps, block_n=64, block_h=8, num_warps=4,
                             num_stages=2, dot_dtype="bf16", workspace=fws)

    split_k()
    sk_ok = _check(out, inp.reference(), f"split-K serving {batch}x{kv_len}")
    return fused_us, fused_ok, time_call(split_k, reps=reps).median_us, sk_ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", default="tables/H200.yaml")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    with open(args.table) as f:
        rows = {(r["batch"], r["kv_len"]): r for r in yaml.safe_load(f)["rows"]}
    lines = []
    for batch, kv_len in LEADERBOARD_SHAPES:
        pick = _fused_pick(rows.get((batch, kv_len), {}))
        if pick is None:
            lines.append(f"{batch:>5}x{kv_len:<5} no triton_fused pick in {args.table}")
            continue
        old_us, old_ok, new_us, new_ok = _leaderboard_row(pick, batch, kv_len, args.reps)
        if new_us is None:
            lines.append(f"{batch:>5}x{kv_len:<5} {old_us:8.2f} {old_ok:>4} {'-':>8} {'-':>4} {'-':>6}  {new_ok}")
            continue
        ratio = new_us / old_us
        verdict = "within 3%" if ratio <= 1.03 else "SLOWER"
        lines.append(f"{batch:>5}x{kv_len:<5} {old_us:8.2f} {old_ok:>4} {new_us:8.2f} {new_ok:>4} {ratio:6.3f}  "
                     f"{verdict}  {pick}")
    serving_lines = []
    for batch, kv_len in SERVING_SHAPES:
        for q_fp8 in (False, True):
            fu, fu_ok, sk, sk_ok = _serving_row(batch, kv_len, q_fp8, args.reps)
            serving_lines.append(f"{batch:>5}x{kv_len:<5} q {'fp8 ' if q_fp8 else 'bf16'} {fu:8.2f} {fu_ok:>4} "
                                 f"{sk:8.2f} {sk_ok:>4} {fu / sk:6.3f}")
    print("\nLeaderboard shapes: old fused kernel vs fused_decode_serving (median us, strict check)")
    print(f"{'shape':>11} {'old us':>8} {'chk':>4} {'new us':>8} {'chk':>4} {'new/old':>6}")
    print("\n".join(lines))
    print("\nServing: paged 64, 128 heads, q_len 2, fp8 KV (fused vs split-K flash_decode_serving, bf16 q)")
    print(f"{'shape':>11} {'q':>6} {'fused':>8} {'chk':>4} {'splitK':>8} {'chk':>4} {'f/s':>6}")
    print("\n".join(serving_lines))


if __name__ == "__main__":
    main()
