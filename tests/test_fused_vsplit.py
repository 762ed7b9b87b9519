"""fused_decode's V split (`v_split=2`: two programs per (split, sequence), each with half the
V dims), called directly. CPU: the interpreter (fp16 dots) under `strict` and a relative L2
bound, v_split 1 and 2, the `none` and `last` reductions. GPU: three leaderboard shapes (16, 4
and 1 split) under `strict` with `last` and `spin`, v_split 1 and 2.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton

from mla_tune import problem
from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, device_sm_count
from mla_tune.kernels.fused_decode import fused_decode
from tests.helpers import rel_l2

CPU = dict(q_fp8=False, qk_dot="fp16", pv_dot="fp16", num_warps=4, num_stages=1, block_n=16)


class _Bufs:
    """fused_decode's scratch for `slots` partials; counters for 2 x batch (v_split 2)."""

    def __init__(self, batch: int, num_splits: int, device):
        slots = batch * num_splits
        self.part_o = torch.empty(slots * 16 * V_DIM, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(slots * 16, dtype=torch.float32, device=device)
        self.count = torch.zeros(2 * batch, dtype=torch.int32, device=device)
        self.flag = torch.zeros(2 * batch, dtype=torch.int32, device=device)
        self.out = torch.empty((batch, 16, V_DIM), dtype=torch.bfloat16, device=device)


def run_fused(data, bufs: _Bufs, *, kv: str, num_splits: int, reduce: str, v_split: int, tok_m: bool = True,
              load: str = "ptr", **params) -> torch.Tensor:
    q, kv_data = data[0], data[1]
    entry = kv_data[kv]
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    cache, scale = (entry.view(-1, QK_DIM), dummy) if kv == "bf16" else (entry[0].view(-1, QK_DIM), entry[1])
    if load == "tma":  # the device descriptors' scratch
        triton.set_allocator(lambda size, _align, _stream: torch.empty(size, dtype=torch.int8,
                                                                         device=q.device))
    options = {**CPU, **params}
    fused_decode(q, cache, scale, dummy, data[3], bufs.out[: q.shape[0]], bufs.part_o, bufs.part_lse,
                 bufs.count, bufs.flag, num_splits=num_splits, kv_fmt=kv, tok_m=tok_m,
                 reduce=reduce if num_splits > 1 else "none", sm_scale_log2=SM_SCALE * math.log2(math.e),
                 load=load, v_split=v_split, **options)
    return bufs.out[: q.shape[0]]


def _check(out, data, kv: str, what: str, q_format: str = "bf16") -> None:
    ref = problem.reference(data, q_format=q_format, kv_format=kv)
    result = problem.check(out, ref, problem.RULES["strict"])
    assert result.passed, f"{what}: {result.reason}"
    assert rel_l2(out, ref) < 1e-2, f"{what}: rel L2 {rel_l2(out, ref):.2e}"


# (lens, num_splits, reduce, tok_m, load): a single token, a partial tile, ragged batches
# with empty splits in the short sequences, heads on M, and the TMA loads.
CASES = [
    ([1], 1, "none", True, "ptr"),
    ([17], 1, "none", True, "ptr"),
    ([17], 2, "last", False, "ptr"),
    ([17, 40, 3], 3, "last", True, "ptr"),
    ([100, 33], 4, "last", False, "ptr"),
    ([17, 40, 3], 3, "last", True, "tma"),
    ([100, 33], 4, "last", True, "tma_host"),
]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("lens,num_splits,reduce,tok_m,load", CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, list) else str(v))
def test_v_split_matches_the_reference_and_v_split_1(device, kv, lens, num_splits, reduce, tok_m, load):
    data = problem.generate_ragged_input(lens, seed=11, device=device)
    bufs = _Bufs(len(lens), num_splits, device)
    kwargs = dict(kv=kv, num_splits=num_splits, reduce=reduce, tok_m=tok_m, load=load)
    whole = run_fused(data, bufs, v_split=1, **kwargs).clone()
    bufs.out.fill_(float("nan"))  # every output element must be written by one of the halves
    halves = run_fused(data, bufs, v_split=2, **kwargs).clone()
    _check(whole, data, kv, f"v_split 1 {kwargs} at {lens}")
    _check(halves, data, kv, f"v_split 2 {kwargs} at {lens}")
    # The halves differ from the whole only by the scores' summation order (bf16 output).
    torch.testing.assert_close(halves.float(), whole.float(), rtol=1e-2, atol=1e-2)


def test_v_split_last_reducer_resets_its_counters_so_calls_repeat(device):
    data = problem.generate_ragged_input([50, 20, 9], seed=3, device=device)
    bufs = _Bufs(3, 3, device)
    calls = [run_fused(data, bufs, kv="fp8", num_splits=3, reduce="last", v_split=2).clone() for _ in range(3)]
    assert torch.equal(calls[0], calls[1]) and torch.equal(calls[0], calls[2])
    assert int(bufs.count.abs().sum()) == 0  # every (sequence, half) counter is back at zero
    _check(calls[0], data, "fp8", "v_split 2, 3 calls")


def test_v_split_refuses_what_it_does_not_run(device):
    data = problem.generate_ragged_input([17], seed=1, device=device)
    bufs = _Bufs(1, 2, device)
    for kwargs, match in [(dict(v_split=3), "v_split must be 1 or 2"),
                          (dict(v_split=2, programs=2), "split grid"),
                          (dict(v_split=2, num_splits=129), "at most 128 splits")]:
        with pytest.raises(ValueError, match=match):
            run_fused(data, bufs, **{**dict(kv="fp8", num_splits=2, reduce="last"), **kwargs})


# ----------------------------------------------------------------------------- H200
# triton_fused's fp8-q family (scripts/bench_peers.py FU_PICKS), strict at every shape.
GPU_FQ8 = dict(q_fp8=True, qk_dot="fp8", pv_dot="fp16", num_warps=4, num_stages=3, block_n=64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch,kv_len", [(4, 1024), (32, 1024), (256, 1024)])  # 16, 4 and 1 split
def test_v_split_at_the_leaderboard_shapes_under_strict(batch, kv_len):
    sm_count = device_sm_count(torch.device("cuda"))
    data = problem.generate_input(batch, kv_len, seed=1001, device="cuda")
    ref = problem.reference(data)
    splits = max(1, min(32, 128 // batch, kv_len // GPU_FQ8["block_n"]))
    for v_split in (1, 2):
        reduces = ["none"] if splits == 1 else ["last"] + (["spin"] if batch * splits * v_split <= sm_count else [])
        for reduce in reduces:
            bufs = _Bufs(batch, splits, "cuda")
            what = f"v_split {v_split}, {splits} splits, reduce {reduce} at {batch}x{kv_len}"
            first = run_fused(data, bufs, kv="fp8", num_splits=splits, reduce=reduce, v_split=v_split,
                              **GPU_FQ8).clone()
            result = problem.check(first, ref, problem.RULES["strict"])
            assert result.passed, f"{what}: {result.reason}"
            for _ in range(2):
                assert torch.equal(first, run_fused(data, bufs, kv="fp8", num_splits=splits, reduce=reduce,
                                                    v_split=v_split, **GPU_FQ8)), f"{what}: a repeated call differs"
