"""Check and time chosen variants at chosen shapes, side by side, on the GPU.

    PYTHONPATH=. python scripts/time_variants.py "triton(block_n=32,...)" ... [--shapes 4x1024,...]

For quick looks during development; the sweep is the tool that decides. Each variant is
checked against the fp32 reference (leaderboard and strict rules) on fresh inputs and
timed under the leaderboard protocol; fp8_static variants get q_amax from 8 seeds.
"""

from __future__ import annotations

import argparse

import torch

from mla_tune.backends import get_backend
from mla_tune.core import Shape, Variant
from mla_tune.problem import RULES, check, generate_input, reference
from mla_tune.tune.timing import time_call

DEFAULT_SHAPES = "4x1024,4x8192,32x1024,32x8192,64x1024,64x8192,256x1024,256x8192"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    variants = [Variant.parse(text) for text in args.variants]
    print(f"{'shape':>10} {'us':>8} {'p10':>7} {'p90':>7} {'lb':>4} {'strict':>6}  variant")
    for text in args.shapes.split(","):
        batch, kv_len = (int(x) for x in text.split("x"))
        shape = Shape(batch, kv_len)
        data = generate_input(batch, kv_len, seed=batch * 7 + kv_len, device="cuda")
        inputs = data[:4]
        ref = reference(data)
        q_amax = 1.1 * max(
            float(generate_input(batch, 1, seed=s, device="cuda")[0].abs().amax()) for s in range(8)
        )
        for variant in variants:
            if variant.get("q") == "fp8_static":
                variant = variant.with_params(q_amax=round(q_amax, 3))
            try:
                runner = get_backend(variant.backend).build(variant, shape, "cuda")
                out = runner(*inputs).clone()
                lb, strict = check(out, ref, RULES["leaderboard"]), check(out, ref, RULES["strict"])
                t = time_call(lambda runner=runner, inputs=inputs: runner(*inputs), reps=args.reps)
                print(
                    f"{str(shape):>10} {t.median_us:8.1f} {t.p10_us:7.1f} {t.p90_us:7.1f} "
                    f"{'ok' if lb.passed else 'FAIL':>4} {'ok' if strict.passed else 'FAIL':>6}  {variant}",
                    flush=True,
                )
            except Exception as exc:  # a development tool: show every failure and go on
                print(f"{str(shape):>10} {'error':>8}  {variant}: {type(exc).__name__}: {exc}", flush=True)
        del data, inputs, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
