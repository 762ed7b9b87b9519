"""A tiny serving sweep config (TINY) and made-up times for it (tests/test_serving_sweep.py,
tests/test_verify.py), and timers by name that a worker process imports (the sweep times in
worker processes when its timer is a name): the same times, so that a sweep timed in a worker
writes the table of one timed in the sweep's own process."""

import os
import time

from mla_tune.core import Variant
from mla_tune.serving.sweep import RAGGED_PROBE_KV
from mla_tune.tune.timing import Timing

TINY = {
    "name": "tiny", "rule": "strict", "check_seeds": [1, 2],
    "families": {"kv_format": ["fp8"], "page_size": [16], "heads": [16], "q_len": [2]},
    "call": {"mixed_q_len": True},
    "batch_buckets": [1, 2], "kv_buckets": [32, 64],
    "gate": {"ragged_kv_lens": [1, 17, 63, 64, 65, 100], "tail_kv_len": 77, "tail_batch": 2, "margin": 0.5,
             "reference_q": "exact"},
    "search": {"rungs": [1, 2], "keep": 0.5, "min_keep": 1, "cross_top": 3},
    "backends": {"triton": {"tokens_per_split": [16, 64]}, "triton_fused": {}, "wrong_serving": {}},
}
TRITON = {"16": "A", "64": "B"}  # the two triton candidates' tokens_per_split
# Made-up times (us per sequence): A wins at kv 32, B at kv 64; the fused candidate C is
# never best but its worst regret (12%) is the smallest (A 33%, B 20%), while its mean
# regret (11%) is not (B 10%): the graph pick must be C. wrong_serving would win everywhere.
# D is triton's default serving variant, which every family's candidates include: slow here.
TIMES = {32: {"A": 10.0, "B": 12.0, "C": 11.2, "D": 50.0, "W": 1.0},
         64: {"A": 20.0, "B": 15.0, "C": 16.5, "D": 50.0, "W": 1.0},
         RAGGED_PROBE_KV: {"A": 15.0, "B": 14.0, "C": 14.5, "D": 50.0, "W": 1.0}}  # the ragged mix


def name(variant: Variant) -> str:
    if variant.backend == "wrong_serving":
        return "W"
    if variant.backend == "triton_fused":
        return "C"
    return TRITON.get(str(variant.get("tokens_per_split")), "D")


def crashing_time(call, reps: int) -> Timing:
    """TIMES, in a worker, except that D (never kept: 50 us against 10-20) kills its worker at
    batch 1, kv 32, as a kernel that segfaults would. A's runner really runs at its first
    measurement (the worker builds and feeds it: the interpreter's run costs a second, so only
    that one)."""
    if call.batch == 1 and call.kv_len == 32 and name(call.variant) == "D":
        os._exit(11)
    if (call.batch, call.kv_len, reps, name(call.variant)) == (1, 32, 1, "A"):
        call()
    t = TIMES[call.kv_len][name(call.variant)] * call.batch
    return Timing(t, t, t, reps)


def hanging_time(call, reps: int) -> Timing:
    """TIMES, in a worker, except that D hangs at batch 1, kv 32 (a kernel waiting on itself):
    its worker is killed at its limit, or at the budget's hard deadline."""
    if call.batch == 1 and call.kv_len == 32 and name(call.variant) == "D":
        time.sleep(3600)
    t = TIMES[call.kv_len][name(call.variant)] * call.batch
    return Timing(t, t, t, reps)
