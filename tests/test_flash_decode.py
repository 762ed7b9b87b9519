"""The split-K flash-decode kernels and the `triton` backend against the fp32 reference.

On the CPU the kernels run under Triton's interpreter with fp16 dots (its bf16 dots are
wrong); on a GPU the same tests use bf16 dots. Shapes stay tiny on the CPU.
"""

import dataclasses

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import triton_splitk
from mla_tune.core import Shape, Variant, fp8_dtype_for
from mla_tune.gpu import fake_platform
from mla_tune.kernels.flash_decode import FlashDecodeWorkspace, flash_decode
from tests.helpers import assert_close, ragged_input


def _calibrated_q_amax(batch: int, device: str, seeds=(901, 902)) -> float:
    """What the sweep does for fp8_static: the largest |q| seen on calibration inputs."""
    return max(float(problem.generate_input(batch, 1, seed, device=device)[0].abs().amax())
               for seed in seeds)


def _expected(data, kv: str, q: str, q_amax: float | None = None) -> torch.Tensor:
    """The fp32 reference in the formats the variant computes in."""
    if q != "fp8_static":  # bf16 or fp8_dynamic
        return problem.reference(data, "bf16" if q == "bf16" else "fp8", kv)
    # fp8_static: q quantized with the fixed scale (values beyond q_amax clamp), in fp32.
    dtype = fp8_dtype_for(data[0].device)
    fp8_max = torch.finfo(dtype).max
    scale = q_amax / fp8_max
    qf = (data[0].float() / scale).clamp(-fp8_max, fp8_max).to(dtype).float() * scale
    return problem.reference((qf, *data[1:]), "bf16", kv)


def _options(device) -> dict:
    """flash_decode's launch options at the tests' tiny shapes, with fp16 dots on the CPU."""
    dot = "bf16" if device == "cuda" else "fp16"
    return dict(block_n=16, num_warps=4, num_stages=1, dot_dtype=dot)


def _run_variant(variant: Variant, data, device):
    runner = triton_splitk.build(variant, Shape(data[0].shape[0], data[4]["kv_seq_len"]), device)
    return runner(*data[:4])


# (kv_lens, num_splits, block_n, kv, q, register-file options, seed): every kv format x q mode,
# kv_len 1 to 3001, empty splits, ragged batches; then AMD's v_split and qk_split in stage 1.
CASES = [
    ([1], 1, 16, "bf16", "bf16", {}, 7),
    ([17, 17], 2, 16, "fp8", "fp8_dynamic", {}, 7),
    ([100], 3, 32, "fp8", "bf16", {}, 7),
    ([100], 8, 32, "bf16", "fp8_static", {}, 7),
    ([1, 17, 40], 4, 16, "fp8", "fp8_static", {}, 7),
    ([1, 17, 40], 1, 32, "bf16", "fp8_dynamic", {}, 7),
] + [(lens, splits, block_n, kv, q, dict(v_split=v, qk_split=k), 11)
     for lens, splits, block_n, kv, q, v, k in [
         ([1], 1, 16, "bf16", "bf16", 2, 1),
         ([17, 40], 3, 16, "fp8", "fp8_dynamic", 1, 8),
         ([3001], 8, 64, "fp8", "bf16", 2, 4),
         ([1, 17, 100], 4, 32, "bf16", "fp8_static", 2, 2),
         ([17], 1, 16, "fp8", "fp8_static", 1, 4),
         ([100], 8, 32, "bf16", "fp8_dynamic", 2, 8),
         ([301, 17], 1, 32, "bf16", "bf16", 1, 2),
     ]]


@pytest.mark.parametrize("kv_lens,num_splits,block_n,kv,q,registers,seed", CASES)
def test_kernel_and_register_file_options_match_reference_in_their_formats(
        kv_lens, num_splits, block_n, kv, q, registers, seed, device):
    data = ragged_input(kv_lens, seed=seed, device=device)
    params = dict(_options(device), kv=kv, q=q, num_splits=num_splits, block_n=block_n, **registers)
    q_amax = None
    if q == "fp8_static":
        q_amax = 0.8 * _calibrated_q_amax(len(kv_lens), device)  # some q clamps (register cases: need not)
        assert registers or bool((data[0].abs() > q_amax).any())
        params["q_amax"] = q_amax
    out = _run_variant(Variant.make("triton", **params), data, device)
    assert out.dtype == torch.bfloat16
    assert_close(out, _expected(data, kv, q, q_amax))


def test_runner_reuses_its_output_and_follows_a_new_ragged_batch(device):
    variant = triton_splitk.default_variant(Shape(2, 40))
    runner = triton_splitk.build(variant, Shape(2, 40), device)
    first = problem.generate_input(2, 40, seed=1, device=device)
    out1 = runner(*first[:4])
    assert_close(out1, problem.reference(first, "bf16", "fp8"))
    assert runner(*first[:4]).data_ptr() == out1.data_ptr()
    ragged = ragged_input([1, 17, 40], seed=2, device=device)
    assert_close(runner(*ragged[:4]), problem.reference(ragged, "bf16", "fp8"))


def test_default_variant_uses_fp16_dots_under_the_interpreter_and_fills_the_gpu():
    v = triton_splitk.default_variant(Shape(4, 8192), sm_count=132)
    assert v.get("kv") == "fp8" and v.get("q") == "bf16"
    assert v.get("dot_dtype") == ("fp16" if triton_splitk._tsk_interpreted() else "bf16")
    assert 32 * triton_splitk.default_variant(Shape(32, 8192), sm_count=132).get("num_splits") >= 132
    assert triton_splitk.default_variant(Shape(256, 8192)).get("num_splits") == 1
    assert triton_splitk.default_variant(Shape(4, 1)).get("num_splits") == 1
    assert triton_splitk.unavailable_reason() is None


VALID = dict(kv="fp8", q="bf16", num_splits=1, block_n=32, num_warps=4, num_stages=1, dot_dtype="fp16")


@pytest.mark.parametrize("change,message", [(dict(num_stages=None), "num_stages"), (dict(color=1), "color"),
                                            (dict(q="fp8_static"), "q_amax"), (dict(kv="mxfp4"), "mxfp4"),
                                            (dict(v_split=3), "v_split"), (dict(qk_split=3), "qk_split"),
                                            (dict(qk_split=16), "qk_split")])
def test_build_rejects_bad_variants_and_register_file_options_by_name(change, message):
    params = {k: v for k, v in {**VALID, **change}.items() if v is not None}  # None: left out
    with pytest.raises(ValueError, match=message):
        triton_splitk.build(Variant.make("triton", **params), Shape(2, 40), "cpu")


SPACE = {"kv": ["fp8", "bf16"], "q": ["bf16", "fp8_static"], "num_splits": [1, 2, 4, 8],
         "block_n": [32], "num_warps": [4], "num_stages": [1], "dot_dtype": ["bf16"]}


@pytest.mark.parametrize("shape,splits,kept", [
    (Shape(4, 100), [1, 2, 4, 8], {1, 2}),  # 100 / 4 = 25 < 32: splits shorter than a tile
    (Shape(4, 1), [1, 2, 4, 8], {1}),
    (Shape(256, 8192), [4, 8], {4}),  # 256 x 8 > 4 x 132; 4 is the smallest
    (Shape(4, 8192), [4, 8], {4, 8}),
], ids=["short-splits", "one-token", "over-four-waves", "within-four-waves"])
def test_candidates_drop_splits_shorter_than_a_tile_and_grids_over_four_waves(shape, splits, kept):
    space = {**SPACE, "num_splits": splits}
    variants = triton_splitk.candidates(shape, space, fake_platform("H200"))
    assert {v.get("num_splits") for v in variants} == kept
    assert len(variants) == 2 * 2 * len(kept)  # every kv x q
    assert all(v.get("kv") and v.get("q") for v in variants)
    assert all(v.get("q_amax") is None for v in variants)


# ---------------------------------------------------- stage 1 for AMD's register file
def test_v_split_halves_write_every_column_and_one_lse_and_a_bad_qk_split_is_refused(device):
    data = problem.generate_input(2, 70, seed=4, device=device)
    q, kv_data, _qo, kv_indptr, _cfg = data
    kv, kv_scale = kv_data["fp8"]
    workspace = FlashDecodeWorkspace.allocate(2, 3, device)
    workspace.part_out.fill_(float("nan"))
    workspace.part_lse.fill_(float("nan"))  # a column or an lse no program writes stays NaN
    out = torch.full((2, 16, 512), float("nan"), dtype=torch.bfloat16, device=device)
    flash_decode(q, kv, kv_scale, kv_indptr, out, num_splits=3, workspace=workspace, v_split=2, qk_split=4,
                 **_options(device))
    assert not workspace.part_out.isnan().any() and not workspace.part_lse.isnan().any()
    assert_close(out, problem.reference(data, "bf16", "fp8"))
    with pytest.raises(ValueError, match="qk_split must be one of 1, 2, 4, 8"):
        flash_decode(q, kv, kv_scale, kv_indptr, out, num_splits=3, qk_split=3, **_options(device))


def test_candidates_offer_hip_options_only_on_rocm_leave_default_register_options_out_of_the_name():
    """hip options on ROCm only; v_split 1 and qk_split 1 add no key; unknown options are refused."""
    one = {**SPACE, "kv": ["fp8"], "q": ["bf16"], "num_splits": [1]}
    hip = {**one, "hip": {"waves_per_eu": [1, 2], "kpack": [2]}}
    amd = triton_splitk.candidates(Shape(4, 1024), hip, fake_platform("MI355X"))
    assert len(amd) == 2
    assert {v.get("waves_per_eu") for v in amd} == {1, 2} and all(v.get("kpack") == 2 for v in amd)
    nvidia = triton_splitk.candidates(Shape(4, 1024), hip, fake_platform("H200"))
    assert len(nvidia) == 1 and nvidia[0].get("waves_per_eu") is None
    space = {**one, "v_split": [1, 2], "qk_split": [1, 8]}
    variants = triton_splitk.candidates(Shape(4, 1024), space, fake_platform("MI355X"))
    assert len(variants) == 4
    assert Variant.make("triton", **{k: v[0] for k, v in SPACE.items() if k not in ("kv", "q")},
                        kv="fp8", q="bf16") in variants  # v_split 1, qk_split 1: no such keys
    assert {(v.get("v_split"), v.get("qk_split")) for v in variants} == {(None, None), (2, None), (None, 8), (2, 8)}
    for bad, message in [({"qk_split": [3]}, "qk_split"), ({"block_size": [32]}, "block_size.*known"),
                         ({"kv": ["mxfp4"]}, "mxfp4")]:
        with pytest.raises(ValueError, match=message):
            triton_splitk.candidates(Shape(4, 1024), {**space, **bad}, fake_platform("MI355X"))


def test_candidates_refuse_what_cannot_fit_the_platforms_lds():
    # gfx942's 64 KiB: bf16 KV at block_n 64, 2 stages needs 73728 B of LDS; block_n 32 fits. The
    # limit comes from gpu.KNOWN_GPUS, so planning without the GPU (a dry run) refuses too.
    space = {**SPACE, "kv": ["bf16"], "q": ["bf16"], "num_splits": [1], "block_n": [32, 64],
             "num_stages": [2]}
    mi300x, mi355x = fake_platform("MI300X"), fake_platform("MI355X")
    assert {v.get("block_n") for v in triton_splitk.candidates(Shape(4, 1024), space, mi300x)} == {32}
    big = Variant.make("triton", **{**VALID, "kv": "bf16", "block_n": 64, "num_stages": 2, "dot_dtype": "bf16"})
    reason = triton_splitk.lds_refusal(big, mi300x)
    assert "73728" in reason and "65536" in reason and "MI300X" in reason
    assert triton_splitk.lds_refusal(big, mi355x) is None  # 160 KiB
    assert len(triton_splitk.candidates(Shape(4, 1024), space, mi355x)) == 2
    # a platform that states no limit refuses nothing
    assert triton_splitk.lds_refusal(big, dataclasses.replace(mi300x, lds_bytes=0)) is None


# ------------------------------------------------------------------------------ GPU
LEADERBOARD_SHAPES = [Shape(b, n) for b in (4, 32, 64, 256) for n in (1024, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("q", ["bf16", "fp8_dynamic", "fp8_static"])
def test_leaderboard_shapes_on_gpu(kv, q, device):
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in LEADERBOARD_SHAPES:
        data = problem.generate_input(shape.batch, shape.kv_len, seed=1001, device=device)
        variant = triton_splitk.default_variant(shape, sm_count).with_params(
            kv=kv, q=q, block_n=64, dot_dtype="bf16")
        q_amax = None
        if q == "fp8_static":
            q_amax = _calibrated_q_amax(shape.batch, device)
            variant = variant.with_params(q_amax=q_amax)
        out = _run_variant(variant, data, device)
        torch.cuda.synchronize()
        assert_close(out, _expected(data, kv, q, q_amax))
        result = problem.check(out, problem.reference(data), problem.RULES["leaderboard"])
        assert result.passed, f"{shape} {variant} vs the leaderboard reference: {result.reason}"


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("v_split,qk_split,block_n,num_warps", [(1, 8, 32, 8), (2, 8, 32, 8), (1, 4, 16, 8), (2, 1, 32, 4)])
def test_register_file_options_at_leaderboard_shapes_on_gpu(kv, v_split, qk_split, block_n, num_warps, device):
    # configs/mi355x.yaml's 4-wave kernels (and v_split alone), on whatever GPU runs the test
    for shape in LEADERBOARD_SHAPES:
        data = problem.generate_input(shape.batch, shape.kv_len, seed=1001, device=device)
        for num_splits in (1, 4):
            variant = Variant.make("triton", kv=kv, q="bf16", num_splits=num_splits, block_n=block_n,
                                   num_warps=num_warps, num_stages=1, dot_dtype="bf16", v_split=v_split,
                                   qk_split=qk_split)
            out = _run_variant(variant, data, device)
            torch.cuda.synchronize()
            assert_close(out, _expected(data, kv, "bf16"))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_lens", [[1], [17], [3000, 3000], [1, 17, 3000, 640, 2]])
@pytest.mark.parametrize("num_splits", [1, 5, 16])
def test_odd_and_ragged_lengths_on_gpu(kv_lens, num_splits, device):
    data = ragged_input(kv_lens, seed=2002, device=device)
    for kv, q in (("fp8", "fp8_dynamic"), ("bf16", "bf16")):
        variant = Variant.make("triton", kv=kv, q=q, num_splits=num_splits, block_n=32,
                               num_warps=4, num_stages=2, dot_dtype="bf16")
        out = _run_variant(variant, data, device)
        assert_close(out, _expected(data, kv, q))
