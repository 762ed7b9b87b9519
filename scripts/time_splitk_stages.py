"""Time our split-K serving kernel's launches one by one at a batch of chosen lengths and at the
uniform batch of the same tokens: where a ragged batch's extra time goes.

    PYTHONPATH=. python scripts/time_splitk_stages.py --kv bf16 --heads 16 --q-len 1 \
        --variant "triton(block_h=16,block_n=64,...,tokens_per_split=512)" \
        --lens 56161,7600*48 [--reps 30] [--json out.json]
    PYTHONPATH=. python scripts/time_splitk_stages.py --variant ... \
        --report docs/data/verify/h200-2026-12-01-seed14.json.gz --index 72

For each batch: the whole call under the leaderboard protocol (timing.time_call), then each
recorded launch (stage 1, the reduction) alone, replayed through its launcher with CUDA
events around it (no L2 flush; a launch this short is partly the launch itself), the most
splits of one sequence and the split items. Session 14 (docs/perf.md) found the reduction's
longest loop here: 49 sequences with one of 56161 tokens took 206 us against 177 for the
uniform batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_mix import parse_lens  # noqa: E402  (scripts/ is not a package)

from mla_tune.core import Variant  # noqa: E402
from mla_tune.kernels import flash_decode as fd  # noqa: E402
from mla_tune.serving.inputs import make_input  # noqa: E402
from mla_tune.serving.rescore import read_report  # noqa: E402
from mla_tune.tune import timing  # noqa: E402

PARAMS = ("block_h", "block_n", "dot_dtype", "max_splits", "num_stages", "num_warps", "tokens_per_split",
          "split_budget")


def launch_us(rec, reps: int) -> float:
    """Median GPU time of one recorded launch, replayed alone between CUDA events."""
    values = [v.data_ptr() if hasattr(v, "data_ptr") else v for v in rec.values]
    c, stream = rec.compiled, rec.get_stream(rec.device)

    def go():
        c.run(*rec.grid, stream, c.function, c.packed_metadata, None, None, None, *values)

    for _ in range(3):
        go()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        go()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def time_batch(lens: list[int], kv: str, heads: int, q_len: int, params: dict, reps: int) -> dict:
    inp = make_input([min(q_len, n) for n in lens], lens, heads, 64, kv, seed=1, device="cuda")
    ws = fd.FlashDecodeServingWorkspace.allocate(inp.q.shape[0], heads, params["max_splits"], "cuda",
                                                 max_q_len=q_len)
    out = torch.empty((inp.q.shape[0], heads, 512), dtype=torch.bfloat16, device="cuda")

    def call(record=None):
        return fd.flash_decode_serving(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, **inp.layout,
                                       max_q_len=q_len, workspace=ws, record=record, **params)

    record: list = []
    call(record)
    counts = ws.split_count[:len(lens)].tolist()
    return {"batch": len(lens), "mean": round(sum(lens) / len(lens)), "max": max(lens),
            "call_us": round(timing.time_call(call, reps=reps).median_us, 2),
            "launch_us": [round(launch_us(r, reps), 2) for r in record],
            "most_splits": max(counts), "items": sum(counts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, help="A triton(...) serving variant.")
    p.add_argument("--kv", choices=("bf16", "fp8"))
    p.add_argument("--heads", type=int)
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--lens", help="Comma-separated KV lengths; LEN*N for N sequences of LEN.")
    p.add_argument("--report", help="A verify report (--json) to take a ragged mix from, with --index.")
    p.add_argument("--index", type=int)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json")
    args = p.parse_args()
    variant = Variant.parse(args.variant)
    if variant.backend != "triton":
        raise SystemExit(f"--variant must be our split-K kernel's (triton(...)), got {variant}")
    if args.report:
        shape = next((s for s in read_report(args.report)["shapes"] if s["index"] == args.index), None)
        if shape is None or shape["kind"] != "ragged":
            raise SystemExit(f"{args.report} has no ragged shape #{args.index}")
        lens, fam = shape["kv_lens"], shape["family"]
        kv, heads, q_len = fam["kv_format"], fam["heads"], fam["q_len"]
    elif args.lens and args.kv and args.heads:
        lens, kv, heads, q_len = parse_lens(args.lens), args.kv, args.heads, args.q_len
    else:
        raise SystemExit("give --lens with --kv and --heads, or --report with --index")
    params = {k: v for k, v in variant.params if k in PARAMS}
    total, batch = sum(lens), len(lens)
    uniform = [total // batch + 1] * (total % batch) + [total // batch] * (batch - total % batch)
    rows = {name: time_batch(ls, kv, heads, q_len, params, args.reps) for name, ls in (("ragged", lens),
                                                                                     ("uniform", uniform))}
    print(f"{variant}, {kv} KV, {heads} heads, q_len {q_len}")
    print(f"{'batch':>8} {'n':>4} {'mean':>6} {'max':>6} {'call us':>8} {'launches us':>18} {'most splits':>11} {'items':>6}")
    for name, r in rows.items():
        print(f"{name:>8} {r['batch']:4} {r['mean']:6} {r['max']:6} {r['call_us']:8.1f} {str(r['launch_us']):>18} "
              f"{r['most_splits']:11} {r['items']:6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": str(variant), "kv": kv, "heads": heads, "q_len": q_len,
                                               "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
