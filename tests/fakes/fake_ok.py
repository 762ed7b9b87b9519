"""A correct fake: answers with problem.reference, memoised per input so that the fast
variant costs microseconds; the others sleep, so winners differ clearly per shape.

Space: fast_for_batch (list of batch sizes: one variant each, fast only at that batch),
delay_us (sleep of a variant away from its batch), static (true: add an fp8_static
variant, which must arrive with a calibrated q_amax).
"""

import time

import torch

from mla_tune import problem
from mla_tune.core import Shape, Variant
from tests.fakes import unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_ok"


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    delay = space.get("delay_us", 50000)
    # best guess first, as a real backend would order them: the variant fast at this batch
    batches = sorted(space.get("fast_for_batch", [1, 2]), key=lambda b: b != shape.batch)
    out = [Variant.make(NAME, kv="fp8", q="bf16", fast_for_batch=b, delay_us=delay) for b in batches]
    if space.get("static"):
        out.append(Variant.make(NAME, kv="fp8", q="fp8_static", fast_for_batch=0, delay_us=delay))
    return out


def build(variant: Variant, shape: Shape, device):
    if variant.get("q") == "fp8_static":
        q_amax = variant.get("q_amax")
        if not isinstance(q_amax, float) or q_amax <= 0:
            raise ValueError(f"fp8_static variant built without a calibrated q_amax: {variant}")
    sleep_s = 0.0 if variant.get("fast_for_batch") == shape.batch else variant.get("delay_us") / 1e6
    memo: dict = {}

    def run_fake_ok(q, kv_data, qo_indptr, kv_indptr):
        key = (q.data_ptr(), q._version)
        if memo.get("key") != key:
            ref = problem.reference((q, kv_data, qo_indptr, kv_indptr, None))
            memo["out"] = ref.to(torch.bfloat16)
            memo["key"] = key
        if sleep_s:
            time.sleep(sleep_s)
        return memo["out"]

    return run_fake_ok
