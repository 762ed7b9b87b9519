"""One engine step through the serving table: 64 sequences of 4000-4019 tokens, 64-token pages.

    PYTHONPATH=. python scripts/serving_example.py [--table tables/H200.serving.yaml]
        [--heads 16] [--kv fp8,bf16] [--out DIR]

The leaderboard runtime ran this step's call (a length it had never seen) on its fallback at
160 us of GPU time. Here the same step goes through `DecodePlan` (64-token pages, q_len 1, an
eager call: the table's cell for batch bucket 64 and the kv bucket of the mean length) and,
beside it, through the plan without a table (the preferred backend's untuned default) and
through each vendor's default variant. Every output is checked against the fp32 reference
(strict rule) before it is timed. GPU us per call under the leaderboard protocol
(timing.time_call), host us per call with the GPU busy ahead (timing.host_time). Prints a
short table last; --out writes serving_example.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mla_tune import problem
from mla_tune.core import CallSpec
from mla_tune.serving import inputs as serving
from mla_tune.serving.decode_plan import DecodePlan
from mla_tune.tune.timing import host_time, time_call

PAGE = 64


def _measure(plan: DecodePlan, inp, q_format: str) -> dict:
    hosts = {"q_lens_host": inp.q_lens, "kv_lens_host": inp.kv_lens}
    variant = plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens, **hosts)
    out = plan.run(inp.q, inp.kv, inp.kv_scale)
    ref = serving.reference(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, block_table=inp.block_table,
                            seq_lens=inp.seq_lens, q_format=q_format)
    check = problem.check(out, ref, problem.RULES["strict"])
    if not check.passed:
        raise SystemExit(f"{variant}: wrong result ({check})")
    gpu = time_call(lambda: plan.run(inp.q, inp.kv, inp.kv_scale), reps=50)
    host = host_time(lambda: plan.run(inp.q, inp.kv, inp.kv_scale))
    return {"variant": str(variant), "gpu_us": round(gpu.median_us, 2), "gpu_p10_us": round(gpu.p10_us, 2),
            "gpu_p90_us": round(gpu.p90_us, 2), "host_us": round(host.median_us, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=Path("tables/H200.serving.yaml"))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv", default="fp8,bf16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    kv_lens = [4000 + i % 20 for i in range(64)]
    rows = []
    for kv_format in args.kv.split(","):
        inp = serving.make_input([1] * 64, kv_lens, args.heads, PAGE, kv_format, seed=4000, device="cuda")
        spec = CallSpec(kv_format, page_size=PAGE, heads=args.heads, max_q_len=1, graph=False, host_lengths=True)
        runs = {"table": DecodePlan(spec, max_batch=64, table=args.table, device="cuda"),
                "no table (default)": DecodePlan(spec, max_batch=64, device="cuda")}
        for backend in ("flashmla", "flashinfer", "triton", "triton_fused"):
            try:
                runs[f"{backend} default"] = DecodePlan(spec, max_batch=64, backend=backend, device="cuda")
            except (ValueError, RuntimeError, ImportError) as exc:  # a vendor missing: the row says so
                rows.append({"kv": kv_format, "run": f"{backend} default", "error": " ".join(str(exc).split())[:120]})
        for name, plan in runs.items():
            variant = plan.pick(64, sum(kv_lens) / len(kv_lens))
            q_format = "fp8" if str(variant.get("q") or "").startswith("fp8") else "bf16"
            rows.append({"kv": kv_format, "run": name, **_measure(plan, inp, q_format)})
        del inp
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}: 64 sequences of 4000-4019 tokens, {args.heads} heads, q_len 1, "
          f"pages of {PAGE}, eager DecodePlan.run; GPU us (leaderboard protocol, median of 50) and host us")
    for r in rows:
        if "error" in r:
            print(f"{r['kv']:5} {r['run']:20} {r['error']}")
            continue
        print(f"{r['kv']:5} {r['run']:20} GPU {r['gpu_us']:8.1f} us  host {r['host_us']:6.1f} us  {r['variant']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving_example.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
