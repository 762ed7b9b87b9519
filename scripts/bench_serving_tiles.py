"""Which head tiles and split rules the own serving kernels want (input to the serving sweep).

    PYTHONPATH=. python scripts/bench_serving_tiles.py [--heads 128] [--batch 32] [--budget 150] [--out DIR]

One serving cell per KV format (a ragged batch of kv_len 3980-4019, one new token each,
64-token pages, `--heads` heads): the own backends' serving variants over head tiles
(block_h), tiles (block_n), warps and split rules, compiled in a thread pool first, each
checked strict against mla_tune.serving.inputs' reference, then timed with time_call; FlashMLA's
default serving variant beside them. Prints the best per backend and the grid, writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mla_tune import problem
from mla_tune.core import CallSpec, Variant
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import Decoder
from mla_tune.tune.timing import time_call

PAGE = 64


def _variants(kv: str, heads: int):
    for block_h, block_n, warps, tokens in itertools.product((16, 32, 64), (32, 64), (4, 8), (512, 2048)):
        if heads % block_h:
            continue
        yield Variant.make("triton", kv=kv, q="bf16", block_n=block_n, block_h=block_h, max_splits=16,
                           tokens_per_split=tokens, num_warps=warps, num_stages=2, dot_dtype="bf16")
    for block_h, warps, tokens in itertools.product((16, 32), (4, 8), (512, 2048)):
        yield Variant.make("triton_fused", kv=kv, q="bf16", qk_dot="bf16", pv_dot="bf16", block_n=64,
                           block_h=block_h, max_splits=16, tokens_per_split=tokens, num_warps=warps,
                           num_stages=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = []
    kv_lens = [3980 + (i * 7) % 40 for i in range(args.batch)]
    for kv in ("bf16", "fp8"):
        inp = serving.make_input([1] * args.batch, kv_lens, args.heads, PAGE, kv, seed=3, device="cuda")
        ref = inp.reference()
        spec = CallSpec(kv, page_size=PAGE, heads=args.heads, max_q_len=1)
        layout = {"block_table": inp.block_table, "seq_lens": inp.seq_lens}
        decoders = {}

        def build(variant, spec=spec, inp=inp, layout=layout):
            try:
                dec = Decoder(spec, variant=variant, device="cuda")
                dec(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **layout)  # compiles
                return variant, dec, None
            except Exception as exc:  # noqa: BLE001 - a variant that cannot build is a row
                return variant, None, f"{type(exc).__name__}: {str(exc)[:160]}"

        candidates = list(_variants(kv, args.heads))
        try:
            candidates.append(Decoder(spec, backend="flashmla", device="cuda").variant)
        except Exception as exc:  # noqa: BLE001
            rows.append({"kv": kv, "variant": "flashmla", "error": str(exc)[:160]})
        with ThreadPoolExecutor(8) as pool:
            for variant, dec, error in pool.map(build, candidates):
                if error:
                    rows.append({"kv": kv, "variant": str(variant), "error": error})
                else:
                    decoders[variant] = dec
        for variant, dec in decoders.items():
            if time.perf_counter() - t0 > args.budget:
                rows.append({"kv": kv, "variant": str(variant), "error": "budget"})
                continue
            try:
                args_ = (inp.q, inp.qo_indptr, inp.kv, inp.kv_scale)
                call = lambda dec=dec, a=args_, kw=layout: dec(*a, **kw)  # noqa: E731
                got = problem.check(call().float(), ref, problem.RULES["strict"])
                timing = time_call(call, reps=15)
                rows.append({"kv": kv, "variant": str(variant), "backend": variant.backend, "strict": got.passed,
                             "us": round(timing.median_us, 1), "spread": round(timing.spread, 3)})
            except Exception:  # noqa: BLE001
                rows.append({"kv": kv, "variant": str(variant), "error": traceback.format_exc(limit=2)[-200:]})
        del inp, ref, decoders
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}: batch {args.batch}, {args.heads} heads, q_len 1, kv_len 3980-4019, "
          f"pages of {PAGE} ({time.perf_counter() - t0:.0f} s)")
    for kv in ("bf16", "fp8"):
        timed = sorted((r for r in rows if r["kv"] == kv and "us" in r), key=lambda r: r["us"])
        for backend in ("triton", "triton_fused", "flashmla"):
            best = next((r for r in timed if r["backend"] == backend), None)
            if best:
                print(f"{kv:5} best {backend:13} {best['us']:8.1f} us  strict {best['strict']}  {best['variant']}")
        errors = [r for r in rows if r["kv"] == kv and "error" in r]
        print(f"{kv:5} {len(timed)} timed, {len(errors)} not ({', '.join(sorted({r['error'][:40] for r in errors}))[:200]})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving_tiles.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
