"""The dispatcher's fast path for a tuned uniform shape called again: the full path's checks and
messages, the same runner, misses still counted."""

import pytest
import torch

from mla_tune import problem
from mla_tune.core import Variant, check_decode_inputs
from mla_tune.tables.dispatch import Dispatcher

TUNED = Variant.parse("triton(block_n=64,dot_dtype=bf16,kv=fp8,num_splits=16,num_stages=2,num_warps=4,q=bf16)")


def _dispatcher(calls: list):
    def build(variant, shape, device):
        def run(q, kv_data, qo_indptr, kv_indptr):
            calls.append((variant, shape))
            return shape
        return run
    return Dispatcher({(4, 64): TUNED}, {"triton": build}, lambda s: TUNED, warn_on_miss=False,
                      ragged_backends=frozenset({"triton"}))


def test_a_repeated_tuned_call_takes_the_same_runner_and_a_miss_is_counted_every_time():
    calls = []
    d = _dispatcher(calls)
    data = problem.generate_input(4, 64, 1, device="cpu")
    for _ in range(3):
        d(*data[:4], kv_len=64, check_indptr=False)
    assert d._fast and len(calls) == 3 and {c[0] for c in calls} == {TUNED}
    other = problem.generate_input(2, 64, 2, device="cpu")
    for _ in range(3):
        d(*other[:4], kv_len=64, check_indptr=False)
    assert sum(d.misses.values()) == 3  # a shape the table lacks never takes the fast path
    for kv in ("bf16", "fp8"):  # the quick predicate agrees with the checks on good inputs
        data = problem.generate_input(3, 17, 4, device="cpu")
        assert check_decode_inputs(*data[:4], kv) == 3


@pytest.mark.parametrize("spoil, words", [
    (lambda q, kv, qo, ki: (q.float(), kv, qo, ki), "q must be bfloat16"),
    (lambda q, kv, qo, ki: (q, {**kv, "fp8": (kv["fp8"][0].view(torch.uint8), kv["fp8"][1])}, qo, ki),
     "fp8 KV must have an fp8 dtype"),
    (lambda q, kv, qo, ki: (q, {**kv, "fp8": (kv["fp8"][0], kv["fp8"][1].double())}, qo, ki),
     "fp8 KV scale must be one float32 value"),
    (lambda q, kv, qo, ki: (q, kv, qo.long(), ki), "qo_indptr must be int32"),
    (lambda q, kv, qo, ki: (q, {**kv, "fp8": (kv["fp8"][0][:-1], kv["fp8"][1])}, qo, ki),
     "holds 255 tokens, not batch x kv_len"),
])
def test_the_fast_path_refuses_what_the_full_path_refuses_with_its_message(spoil, words):
    d = _dispatcher([])
    data = problem.generate_input(4, 64, 3, device="cpu")
    d(*data[:4], kv_len=64, check_indptr=False)  # the fast path is set up
    with pytest.raises(ValueError, match=words):
        d(*spoil(*data[:4]), kv_len=64, check_indptr=False)


def _runtime(calls: list):
    from mla_tune.runtime import Runtime

    return Runtime(table=None, platform=None, dispatcher=_dispatcher(calls), fallback_backend="triton")


def test_the_entry_reuses_the_runner_for_the_same_inputs_checks_anything_new_and_misses_uncached():
    calls = []
    rt = _runtime(calls)
    data = problem.generate_input(4, 64, 5, device="cpu")  # (q, kv_data, qo, kv_indptr, config)
    for _ in range(3):
        rt.custom_kernel(data)
    assert len(calls) == 3 and rt._last is not None and rt._last[8] is not None
    # The same objects with another kv_seq_len: checked again, and refused with its message.
    with pytest.raises(ValueError, match=r"holds 256 tokens, not batch x kv_len .* config\[\"kv_seq_len\"\]"):
        rt.custom_kernel((*data[:4], {**data[4], "kv_seq_len": 65}))
    assert rt._last is None  # a failed call leaves nothing to reuse
    assert not rt.dispatcher.misses  # named before the lookup: not a shape the table lacks
    # A new q of the wrong dtype after a good call: checked, refused.
    rt.custom_kernel(data)
    with pytest.raises(ValueError, match="q must be bfloat16"):
        rt.custom_kernel((data[0].float(), *data[1:]))
    # The KV entry swapped inside the same dict: checked, refused.
    rt.custom_kernel(data)
    kv, scale = data[1]["fp8"]
    data[1]["fp8"] = (kv.view(torch.uint8), scale)
    with pytest.raises(ValueError, match="fp8 KV must have an fp8 dtype"):
        rt.custom_kernel(data)
    data[1]["fp8"] = (kv, scale)
    # A config whose batch_size disagrees with q: refused.
    rt.custom_kernel(data)
    with pytest.raises(ValueError, match='config\\["batch_size"\\] is 5'):
        rt.custom_kernel((*data[:4], {**data[4], "batch_size": 5}))
    # no shortcut for a shape the table lacks
    rt = _runtime(calls)
    other = problem.generate_input(2, 64, 6, device="cpu")
    for _ in range(3):
        rt.custom_kernel(other)
    assert rt._last is None and sum(rt.dispatcher.misses.values()) == 3
