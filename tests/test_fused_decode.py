"""The one-launch fused decode (backend triton_fused, and fused_decode called directly for its
V split) against the fp32 reference. CPU: fp16 dots, reductions `none` and `last`; GPU (`spin`
too): the 8 leaderboard shapes under `strict` (MXFP4 under `leaderboard`). An fp8 dot casts to
the KV's fp8 dtype (gfx942's e4m3fnuz: fused_decode.fu_dot_code).
"""

import math

import pytest
import torch
import triton

from mla_tune import problem
from mla_tune.backends import triton_fused
from mla_tune.core import QK_DIM, SM_SCALE, Shape, Variant, device_sm_count
from mla_tune.gpu import fake_platform
from mla_tune.kernels.fused_decode import FU_DOT_CODES, FU_DOT_FP8_FNUZ, fu_dot_code, fused_decode
from tests.helpers import DecodeBuffers, assert_close, ragged_input, rel_l2

CPU_BASE = dict(q="bf16", qk_dot="fp16", pv_dot="fp16", tok_m=True, block_n=16, num_warps=4, num_stages=1)


def _variant(**params) -> Variant:
    return Variant.make("triton_fused", **{**CPU_BASE, **params})


# (kv, lens, params, seed): every KV format at 1 token, a partial tile, ragged batches with empty
# splits; then TMA loads, the persistent grid (3 "SMs" here: sequences cut between programs), MXFP4.
CASES = [(kv, lens, dict(num_splits=num_splits, reduce=reduce, tok_m=tok_m), 7)
         for kv in ("bf16", "fp8", "mxfp4") for lens, num_splits, reduce, tok_m in [
             ([1], 1, "none", True),  # a single token
             ([17], 1, "none", False),  # not a multiple of block_n, heads on M
             ([17, 40, 3], 3, "last", True),  # ragged, empty splits in the short sequences
             ([100, 33], 4, "last", False),
         ]] + [(kv, lens, params, 11) for kv, lens, params in [
             ("fp8", [1], dict(load="tma")),  # a single token: the rest of the tile is zero-filled
             # the next sequence's rows masked:
             ("bf16", [17, 40, 3], dict(load="tma", num_splits=3, reduce="last")),
             ("fp8", [100, 33], dict(load="tma_host", num_splits=4, reduce="last", tok_m=False)),
             ("fp8", [1], dict(grid="persistent")),
             ("fp8", [17, 40, 3], dict(grid="persistent")),  # 2 pieces, direct writes, an idle program
             ("bf16", [100, 33], dict(grid="persistent", waves=2)),  # a 4-piece sequence
             ("fp8", [17, 40, 3], dict(grid="persistent", load="tma")),
             ("mxfp4", [1], dict()),
             ("mxfp4", [100, 33], dict(num_splits=4, reduce="last", tok_m=False)),
             ("mxfp4", [17, 40, 3], dict(grid="persistent", load="tma")),
             ("mxfp4", [17, 40, 3], dict(load="tma_host")),
         ]]


@pytest.mark.parametrize("kv,lens,params,seed", CASES)
def test_fused_decode_and_its_levers_match_the_reference(device, kv, lens, params, seed):
    data = ragged_input(lens, seed=seed, device=device)
    p = dict(kv=kv, num_splits=1, reduce="last" if params.get("grid") == "persistent" else "none")
    out = triton_fused.build(_variant(**{**p, **params}), Shape(len(lens), max(lens)), device)(*data[:4])
    assert out.shape == (len(lens), 16, 512) and out.dtype == torch.bfloat16
    assert rel_l2(out, problem.reference(data, q_format="bf16", kv_format=kv)) < 1e-2  # bf16 rounding: ~3e-3


# The first plan is for one sequence: the first call's larger ragged batch grows the buffers.
@pytest.mark.parametrize("lens,params,seed,plan_batch", [([50, 20], dict(num_splits=3), 3, 1),
                                                         ([50, 20, 9], dict(num_splits=1, grid="persistent"), 5, 3)])
def test_last_reducer_and_persistent_grid_reset_their_counters_so_calls_repeat(device, lens, params, seed, plan_batch):
    data = ragged_input(lens, seed=seed, device=device)
    run = triton_fused.build(_variant(kv="fp8", reduce="last", **params), Shape(plan_batch, 50), device)
    first = run(*data[:4]).clone()
    other = ragged_input([9, 61], seed=6, device=device)  # another batch between
    assert rel_l2(run(*other[:4]), problem.reference(other, q_format="bf16", kv_format="fp8")) < 1e-2
    assert torch.equal(first, run(*data[:4]))
    assert rel_l2(first, problem.reference(data, q_format="bf16", kv_format="fp8")) < 1e-2


def _mx_rows_through_decode(scale_bytes: list[int], params: dict, device, exact_from: int):
    """The decode of single-token rows with q = 0 (so the output is the token's V row as the
    kernel dequantized it), whose 16 V blocks take `scale_bytes` (others 127) and hold every
    E2M1 code in both nibbles: asserted equal to the fp32 dequantization where the scale byte is
    >= exact_from; returns (the largest error anywhere, each output dim's scale byte)."""
    rows = -(-len(scale_bytes) // 16)
    flat = torch.full((rows * 16,), 127, dtype=torch.uint8)
    flat[: len(scale_bytes)] = torch.tensor(scale_bytes, dtype=torch.uint8)
    scales = torch.full((rows, 18), 127, dtype=torch.uint8)
    scales[:, :16] = flat.reshape(rows, 16)
    i, j = torch.arange(16), torch.arange(18)
    packed = (i[None, :] | (((i[None, :] + j[:, None]) % 16) << 4)).to(torch.uint8).reshape(1, 288).repeat(rows, 1)
    q = torch.zeros(rows, 16, 576, dtype=torch.bfloat16, device=device)
    indptr = torch.arange(rows + 1, dtype=torch.int32, device=device)
    variant = Variant.make("triton_fused", **{**params, "kv": "mxfp4", "q": "bf16", "num_splits": 1, "reduce": "none"})
    run = triton_fused.build(variant, Shape(rows, 1), device)
    out = run(q, {"mxfp4": (packed.to(device), scales.to(device))}, indptr, indptr).float().cpu()
    ref = problem.dequantize_mxfp4(packed, scales)[:, None, :512].expand_as(out)
    byte = scales[:, :16].repeat_interleave(32, dim=1).int()
    exact = (byte >= exact_from)[:, None, :].expand_as(out)
    assert torch.equal(out[exact], ref[exact])
    return float((out - ref).abs().max()), byte


def test_mxfp4_bit_dequantization_is_exact_for_every_code_at_the_fp16_dots_scales(device):
    # fp16 dots: c x 2^(b - 127) is exact in fp16 for bytes 104..140 (above: inf K); bytes below
    # round to fp16's subnormal grid of 2^-24, so only their error is checked.
    err, byte = _mx_rows_through_decode(list(range(141)), CPU_BASE, device, exact_from=104)
    assert set(byte[byte >= 104].tolist()) == set(range(104, 141))  # (and byte 127's padding)
    assert err <= 2.0**-25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tok_m", [True, False])
def test_mxfp4_bit_dequantization_is_exact_for_every_code_and_scale_on_the_gpu(tok_m):
    # bf16 dots: every c x 2^(b - 127) is a normal bf16 value for bytes 2..252 (253 and up
    # overflow fp32 for c = 6: inf K, NaN scores). Bytes 0 and 1 involve fp32 subnormals
    # (byte 0's scale 2^-127 itself, byte 1's 0.5 x 2^-126), which the GPU may flush; all
    # their values are below 2^-123, so only the error's size is checked there.
    params = {**GPU_FAMILIES["mxfp4"], "tok_m": tok_m}
    err, _ = _mx_rows_through_decode(list(range(253)), params, "cuda", exact_from=2)
    assert err < 2.0**-123


def test_candidates_follow_the_validity_rules_leave_default_levers_out_and_build_refuses_the_rest():
    plat = fake_platform("H200")
    space = {"kv": ["fp8", "bf16"], "q": ["bf16", "fp8_dynamic"], "qk_dot": ["fp16", "fp8"],
             "pv_dot": ["fp16", "fp8"], "num_splits": [1, 2, 64], "reduce": ["last", "spin"]}
    cands = triton_fused.candidates(Shape(4, 1024), space, plat)
    assert cands
    for v in cands:
        p = v.p
        assert (p["qk_dot"] == "fp8") == (p["q"] == "fp8_dynamic")
        assert p["kv"] == "fp8" or "fp8" not in (p["qk_dot"], p["pv_dot"])
        assert (p["num_splits"] == 1) == (p["reduce"] == "none")
        assert Variant.parse(str(v)) == v
    # 256 x 2 programs do not fit 132 SMs at once: no spin there
    big = triton_fused.candidates(Shape(256, 1024), {"num_splits": [2]}, plat)
    assert big and all(v.get("reduce") == "last" for v in big)
    # more splits than 64-token tiles are refused
    assert not triton_fused.candidates(Shape(4, 64), {"num_splits": [2], "block_n": [64]}, plat)
    with pytest.raises(ValueError, match="unknown search-space keys"):
        triton_fused.candidates(Shape(2, 64), {"splits": [2]}, plat)
    bad = _variant(kv="bf16", q="fp8_dynamic", qk_dot="fp8", num_splits=1, reduce="none")
    with pytest.raises(ValueError, match="fp8 KV cache"):
        triton_fused.build(bad, Shape(2, 64), "cpu")
    # levers left at their defaults stay out of the variant texts, and set ones expand the space
    plain = triton_fused.candidates(Shape(4, 1024), {"num_splits": [1, 2], "reduce": ["last"]}, plat)
    assert plain and all("load" not in v.p and "grid" not in v.p and "waves" not in v.p for v in plain)
    space = {"kv": ["fp8", "mxfp4"], "q": ["bf16"], "qk_dot": ["fp16", "bf16"], "pv_dot": ["fp16", "bf16"],
             "block_n": [32], "num_warps": [4], "num_splits": [1, 2], "reduce": ["last"],
             "load": ["ptr", "tma"], "grid": ["split", "persistent"], "waves": [1, 2]}
    cands = triton_fused.candidates(Shape(4, 1024), space, plat)
    pers = [v for v in cands if v.get("grid") == "persistent"]
    assert pers and all(v.get("num_splits") == 1 and v.get("reduce") == "last" for v in pers)
    assert {v.get("waves", 1) for v in pers} == {1, 2}
    assert all(v.get("waves", 1) == 1 for v in cands if v.get("grid") != "persistent")
    assert all(v.get("qk_dot") == v.get("pv_dot") for v in cands if v.get("kv") == "mxfp4")
    assert any(v.get("load") == "tma" for v in cands) and len(set(cands)) == len(cands)
    assert all(Variant.parse(str(v)) == v for v in cands)


# ----------------------------------------------------------------- gfx942's fp8 (fnuz)
def test_an_fp8_dot_follows_the_caches_fp8_so_fused_decode_reads_an_fnuz_cache(device):
    fn, fnuz = (torch.empty(4, 576, dtype=dtype) for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz))
    assert fu_dot_code("fp8", fn) == FU_DOT_CODES["fp8"]
    assert fu_dot_code("fp8", fnuz) == FU_DOT_FP8_FNUZ != FU_DOT_CODES["fp8"]
    for dot in ("fp16", "bf16"):
        assert fu_dot_code(dot, fnuz) == fu_dot_code(dot, fn) == FU_DOT_CODES[dot]
    # fp8 q x fp8 K and fp8 P x fp8 V (P scaled into fnuz's 240): a few percent off even with
    # e4m3fn at these sizes, so the fnuz cache must do as well as the e4m3fn one.
    ocp = ragged_input([17, 40], seed=5, device=device)
    kv8, scale = ocp[1]["fp8"]  # requantized to e4m3fnuz (max 240) per tensor:
    values = kv8.float() * scale
    fnuz_scale = values.abs().amax().reshape(1) / torch.finfo(torch.float8_e4m3fnuz).max
    fnuz = (ocp[0], {**ocp[1], "fp8": ((values / fnuz_scale).to(torch.float8_e4m3fnuz), fnuz_scale.float())},
            *ocp[2:])
    for q, qk_dot, pv_dot in (("fp8_dynamic", "fp8", "fp16"), ("bf16", "fp16", "fp8"),
                              ("fp8_dynamic", "fp8", "fp8")):
        variant = _variant(kv="fp8", q=q, qk_dot=qk_dot, pv_dot=pv_dot, num_splits=1, reduce="none")
        run = triton_fused.build(variant, Shape(2, 40), device)
        errs = [rel_l2(run(*data[:4]), problem.reference(data, q_format="bf16", kv_format="fp8"))
                for data in (ocp, fnuz)]
        assert errs[1] < min(0.1, 1.5 * errs[0] + 0.01), \
            f"{variant}: relative L2 error e4m3fn {errs[0]:.4f}, fnuz {errs[1]:.4f}"

LEADERBOARD_SHAPES = [(4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192)]
GPU_FAMILIES = {
    "fp8_q8": dict(kv="fp8", q="fp8_dynamic", qk_dot="fp8", pv_dot="fp16", block_n=128, num_warps=8, num_stages=2),
    "fp8_qbf16": dict(kv="fp8", q="bf16", qk_dot="fp16", pv_dot="fp16", block_n=32, num_warps=4, num_stages=2),
    "bf16": dict(kv="bf16", q="bf16", qk_dot="bf16", pv_dot="bf16", block_n=64, num_warps=4, num_stages=2),
    "mxfp4": dict(kv="mxfp4", q="bf16", qk_dot="bf16", pv_dot="bf16", block_n=32, num_warps=4, num_stages=2),
}


# The levers on the fp8-q and MXFP4 families (the fused reduction `last` where splits > 1);
# without a lever, every family with reductions `spin` and `last`.
GPU_LEVERS = {"tma": dict(load="tma"), "tma_host": dict(load="tma_host"),
              "persistent": dict(grid="persistent", num_splits=1, reduce="last"),
              "persistent_tma": dict(grid="persistent", load="tma", num_splits=1, reduce="last")}
GPU_CASES = [(family, None) for family in GPU_FAMILIES] + [
    (family, lever) for lever in GPU_LEVERS for family in ("fp8_q8", "mxfp4")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family,lever", GPU_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("batch,kv_len", LEADERBOARD_SHAPES)
def test_leaderboard_shapes_pass_the_rule(family, lever, batch, kv_len):
    data = problem.generate_input(batch, kv_len, seed=1001, device="cuda")
    ref = problem.reference(data)
    rule = problem.RULES["leaderboard" if family == "mxfp4" else "strict"]
    splits = max(1, min(32, 128 // batch, kv_len // GPU_FAMILIES[family]["block_n"]))
    reduces = ["none"] if splits == 1 else ["last"] if lever else ["spin", "last"]
    for reduce in reduces:
        params = {**GPU_FAMILIES[family], "num_splits": splits, "reduce": reduce, **GPU_LEVERS.get(lever, {})}
        variant = Variant.make("triton_fused", tok_m=True, **params)
        run = triton_fused.build(variant, Shape(batch, kv_len), "cuda")
        first = run(*data[:4]).clone()
        result = problem.check(first, ref, rule)
        assert result.passed, f"{variant}: {result.reason}"
        assert torch.equal(first, run(*data[:4])), f"{variant}: a second call differs"


# ----------------------------------------------------------- the V split, called directly
DIRECT_CPU = dict(q_fp8=False, qk_dot="fp16", pv_dot="fp16", num_warps=4, num_stages=1, block_n=16)


def run_fused(data, bufs: DecodeBuffers, *, kv: str, num_splits: int, reduce: str, v_split: int, tok_m: bool = True,
              load: str = "ptr", **params) -> torch.Tensor:
    q, entry = data[0], data[1][kv]
    dummy = torch.zeros(1, dtype=torch.float32, device=q.device)
    cache, scale = (entry.view(-1, QK_DIM), dummy) if kv == "bf16" else (entry[0].view(-1, QK_DIM), entry[1])
    if load == "tma":  # the device descriptors' scratch
        triton.set_allocator(lambda size, _align, _stream: torch.empty(size, dtype=torch.int8, device=q.device))
    fused_decode(q, cache, scale, dummy, data[3], bufs.out[: q.shape[0]], bufs.part_o, bufs.part_lse,
                 bufs.count, bufs.flag, num_splits=num_splits, kv_fmt=kv, tok_m=tok_m,
                 reduce=reduce if num_splits > 1 else "none", sm_scale_log2=SM_SCALE * math.log2(math.e),
                 load=load, v_split=v_split, **{**DIRECT_CPU, **params})
    return bufs.out[: q.shape[0]]


# (lens, num_splits, reduce, tok_m, load): a single token, a partial tile, ragged batches
# with empty splits in the short sequences, heads on M, and the TMA loads.
V_SPLIT_CASES = [([1], 1, "none", True, "ptr"), ([17], 1, "none", True, "ptr"), ([17], 2, "last", False, "ptr"),
                 ([17, 40, 3], 3, "last", True, "ptr"), ([100, 33], 4, "last", False, "ptr"),
                 ([17, 40, 3], 3, "last", True, "tma"), ([100, 33], 4, "last", True, "tma_host")]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("lens,num_splits,reduce,tok_m,load", V_SPLIT_CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, list) else str(v))
def test_v_split_matches_the_reference_and_v_split_1(device, kv, lens, num_splits, reduce, tok_m, load):
    data = ragged_input(lens, seed=11, device=device)
    bufs = DecodeBuffers(len(lens), num_splits, device)
    kwargs = dict(kv=kv, num_splits=num_splits, reduce=reduce, tok_m=tok_m, load=load)
    whole = run_fused(data, bufs, v_split=1, **kwargs).clone()
    bufs.out.fill_(float("nan"))  # every output element must be written by one of the halves
    halves = run_fused(data, bufs, v_split=2, **kwargs).clone()
    ref = problem.reference(data, q_format="bf16", kv_format=kv)
    assert_close(whole, ref, 1e-2, f"v_split 1 {kwargs} at {lens}")
    assert_close(halves, ref, 1e-2, f"v_split 2 {kwargs} at {lens}")
    # The halves differ from the whole only by the scores' summation order (bf16 output).
    torch.testing.assert_close(halves.float(), whole.float(), rtol=1e-2, atol=1e-2)


def test_v_split_resets_its_counters_so_calls_repeat_and_refuses_what_it_does_not_run(device):
    data = ragged_input([50, 20, 9], seed=3, device=device)
    bufs = DecodeBuffers(3, 3, device)
    calls = [run_fused(data, bufs, kv="fp8", num_splits=3, reduce="last", v_split=2).clone() for _ in range(3)]
    assert torch.equal(calls[0], calls[1]) and torch.equal(calls[0], calls[2])
    assert int(bufs.count.abs().sum()) == 0  # every (sequence, half) counter is back at zero
    assert_close(calls[0], problem.reference(data, q_format="bf16", kv_format="fp8"), 1e-2, "3 calls")
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
            bufs = DecodeBuffers(batch, splits, "cuda")
            what = f"v_split {v_split}, {splits} splits, reduce {reduce} at {batch}x{kv_len}"
            first = run_fused(data, bufs, kv="fp8", num_splits=splits, reduce=reduce, v_split=v_split,
                              **GPU_FQ8).clone()
            result = problem.check(first, ref, problem.RULES["strict"])
            assert result.passed, f"{what}: {result.reason}"
            for _ in range(2):
                assert torch.equal(first, run_fused(data, bufs, kv="fp8", num_splits=splits, reduce=reduce,
                                                    v_split=v_split, **GPU_FQ8)), f"{what}: a repeated call differs"
