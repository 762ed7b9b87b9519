"""Host time of DecodePlan.run's cache guard per call (docs/serving.md, "The call").

`plan.run(q, kv, kv_scale)` checks one attribute (kv.dtype against the spec's) before the
step's layer call; a cache of fp8 bytes declared as such (cache_dtype "uint8") is viewed as
fp8 on the way, and a Python float kv_scale is swapped for its kept (1,) tensor. This
times that overhead on the host with CPU tensors and the layer call replaced by a no-op
stand-in: the median over rounds of the per-call time of `plan.run` minus that of calling
the stand-in directly.

    python scripts/time_run_guard.py [--calls 20000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU machine: the plan's kernels are never launched here

import torch  # noqa: E402

from mla_tune.core import CallSpec  # noqa: E402
from mla_tune.serving.decode_plan import DecodePlan  # noqa: E402


def _per_call_us(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    q = torch.zeros((4, 16, 576), dtype=torch.bfloat16)
    fp8 = torch.zeros((8, 64, 576), dtype=torch.float8_e4m3fn)
    scale = torch.ones((1,), dtype=torch.float32)
    cases = {
        "fp8 cache, tensor kv_scale": (CallSpec("fp8", page_size=64), fp8, scale),
        "fp8 cache, float kv_scale": (CallSpec("fp8", page_size=64), fp8, 1.0),
        "uint8 cache (cache_dtype uint8), tensor kv_scale": (CallSpec("fp8", page_size=64, cache_dtype="uint8"),
                                                             fp8.view(torch.uint8), scale),
    }
    print(f"per call, median of {args.rounds} rounds of {args.calls} calls (us)")
    for name, (spec, kv, kv_scale) in cases.items():
        plan = DecodePlan(spec, max_batch=4, warm=False)

        def stand_in(q, kv, kv_scale=None):
            return None

        plan._layer = stand_in  # the step's layer call, replaced: only the guard is timed
        bare = _Bare(stand_in)
        guarded, unguarded = [], []
        for _ in range(args.rounds):  # interleaved, so that load on the machine hits both alike
            guarded.append(_per_call_us(functools.partial(plan.run, q, kv, kv_scale), args.calls))
            unguarded.append(_per_call_us(functools.partial(bare.run, q, kv, kv_scale), args.calls))
        run_us, bare_us = statistics.median(guarded), statistics.median(unguarded)
        print(f"  {name}: run {run_us:.3f}, unguarded {bare_us:.3f}, guard {run_us - bare_us:.3f}")


class _Bare:
    """DecodePlan.run without its guard: the same method call and layer call."""

    def __init__(self, layer):
        self._layer = layer

    def run(self, q, kv, kv_scale=None):
        return self._layer(q, kv, kv_scale)


if __name__ == "__main__":
    main()
