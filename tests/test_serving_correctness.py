"""The Decoder of every serving backend against the fp32 reference, called twice (the first
answer and the partials poisoned with NaN). GPU: each declared cell at DeepSeek-V3's scale, a
few settings per cell. CPU: the own kernels over a sample covering every pair of factors."""

import itertools

import pytest
import torch

from mla_tune import gpu
from mla_tune.backends import get_backend
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, CallSpec, Variant
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import PREFERENCE, Decoder
from tests.helpers import (
    CELL_GRID,
    CELL_KV_FORMATS,
    CELL_LAYOUTS,
    CELL_Q_LENS,
    assert_close,
    call_with_host_lengths,
    cell_id,
    cell_spec,
    max_error,
    serving_expected,
    serving_input,
    vendor_fakes,
)

OWN = ("triton", "triton_fused")
SCALE = CORE_DEEPSEEK_V3_SCALE
GPU_KV_LENS = [3000, 1, 17, 63, 64, 65, 1000, 129]
GPU_SEED = 31
# Beyond the grid: pages of 2, 8 and 128 tokens, q_len 3 (padded to 4 rows), 32 and 64 heads.
ODD_CELLS = [(8, 32, 3, "fp8"), (128, 64, 2, "bf16"), (128, 32, 1, "fp8"), (2, 64, 4, "fp8"),
             (16, 64, 1, "bf16"), (0, 32, 1, "fp8")]


def _caps(name: str):
    return get_backend(name).CAPABILITIES


def _spec(name: str, layout: int, heads: int, q_len: int, kv: str) -> CallSpec:
    """The cell's call at the model's softmax scale."""
    return cell_spec(name, layout, heads, q_len, kv, sm_scale=SCALE)


# The own kernels' partials: stage 2 (or the fused reduction) must read only what this call wrote.
_PARTIALS = {"triton": ("part_out", "part_lse", "q_amax"), "triton_fused": ("part_o", "part_lse")}


# Libraries that return a new output tensor per eager call: their answers are checked, not buffers.
LIBRARY_OUTPUTS = ("flashmla",)


def _answer_into_poisoned_buffers(decoder: Decoder, inp: serving.ServingInput, warm=None) -> torch.Tensor:
    """Call `warm` (or `inp`), poison its answer and the partials, and call `inp` into them."""
    first = call_with_host_lengths(decoder, warm or inp)
    first.fill_(float("nan"))
    for name in _PARTIALS.get(decoder.backend, ()):
        getattr(decoder.runner.workspace, name).fill_(float("nan"))
    again = call_with_host_lengths(decoder, inp)
    if decoder.variant.backend not in LIBRARY_OUTPUTS:
        assert again.data_ptr() == first.data_ptr(), "the runner allocated a new output for the same new tokens"
    return again


def _expected(variant: Variant, inp: serving.ServingInput) -> torch.Tensor:
    """The reference at the model's scale on q as the variant's q mode sees it."""
    return serving_expected(variant, inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout, sm_scale=SCALE)


# ------------------------------------------------------------------------------ GPU
def _splitk_variant(layout: int, heads: int, q_len: int, kv: str) -> Variant:
    """The split-K setting of a GPU cell, rotated so every split setting, head tile (16
    heads; 64 rows) and dynamic q mode runs without a compile per combination."""
    rows = 1 << (q_len - 1).bit_length()
    spin = (layout + heads // 16 + q_len) % 3
    max_splits, tokens_per_split, block_n = [(1, 1, 64), (8, 256, 64), (16, 64, 32)][spin]
    block_h = 16 if spin != 1 else min(heads, 64 // rows)
    q_mode = "fp8_dynamic" if (kv == "fp8") == (q_len != 2) else "bf16"
    return Variant.make("triton", kv=kv, q=q_mode, block_n=block_n, block_h=block_h,
                        max_splits=max_splits, tokens_per_split=tokens_per_split,
                        num_warps=8 if block_h * rows >= 64 else 4, num_stages=2, dot_dtype="bf16")


def _fused_variants(heads: int, q_len: int, kv: str) -> list[Variant]:
    """One split (the direct write), 16 splits with a doubled head tile, and on fp8 KV fp8 q
    with an fp8 QK dot; 16 MMA columns (heads x next_pow2(q_len)) per program otherwise."""
    block_h = min(heads, 16 // (1 << (q_len - 1).bit_length()))
    common = dict(kv=kv, num_warps=4, num_stages=2)
    bf16 = dict(q="bf16", qk_dot="bf16", pv_dot="bf16")
    plans = [Variant.make("triton_fused", **common, **bf16, max_splits=1, tokens_per_split=1, block_n=64,
                          block_h=block_h),
             Variant.make("triton_fused", **common, **bf16, max_splits=16, tokens_per_split=64, block_n=32,
                          block_h=min(heads, 2 * block_h))]
    if kv == "fp8":
        plans.append(Variant.make("triton_fused", **common, q="fp8_dynamic", qk_dot="fp8", pv_dot="fp16",
                                  max_splits=8, tokens_per_split=256, block_n=64, block_h=block_h))
    return plans


def _gpu_variants(name: str, cell: tuple, spec: CallSpec, q_amax: float, platform) -> list[Variant]:
    """The default serving variant, then the cell's other settings (q_amax: FlashMLA's)."""
    variants = [get_backend(name).default_serving_variant(spec, platform)]
    if name == "triton":
        variants.append(_splitk_variant(*cell))
    elif name == "triton_fused":
        variants += _fused_variants(*cell[1:])
    elif name == "flashinfer" and cell in ((0, 128, 4, "fp8"), (64, 16, 2, "bf16")):
        variants.append(Variant.make("flashinfer", kernel="fa2", kv=cell[3], q="bf16"))
    elif name == "flashmla" and cell == (64, 128, 2, "fp8"):  # some values clamp, as in serving
        variants.append(Variant.make("flashmla", kv="fp8", q="fp8_static", q_amax=q_amax))
    return list(dict.fromkeys(variants))


def _declared(name: str, cells) -> list[tuple]:
    return [(name, *cell) for cell in cells if _caps(name).refusal(_spec(name, *cell)) is None]


def _serving_backends() -> list[str]:
    """Every serving backend that runs on an H200, in the order a Decoder tries them."""
    tags = gpu.fake_platform("H200").tags
    return [name for name in PREFERENCE if _caps(name).serving and _caps(name).runs_on(tags)]


FUSED_GRID = list(itertools.product(CELL_LAYOUTS, (16, 32, 64, 128), CELL_Q_LENS, CELL_KV_FORMATS))
OTHERS = [name for name in _serving_backends() if name not in OWN]  # FlashMLA, FlashInfer, ...
GPU_CASES = (_declared("triton", CELL_GRID + ODD_CELLS)
             + _declared("triton_fused", FUSED_GRID + [c for c in ODD_CELLS if c not in FUSED_GRID])
             + [case for name in OTHERS for case in _declared(name, CELL_GRID)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=cell_id)
def test_every_declared_cell_matches_the_reference_on_the_gpu(case):
    name, *cell = case
    backend = get_backend(name)
    reason = backend.unavailable_reason() if hasattr(backend, "unavailable_reason") else None
    assert reason is None, reason
    spec = _spec(name, *cell)
    inp = serving_input(spec, GPU_KV_LENS, GPU_SEED, "cuda")
    for variant in _gpu_variants(name, tuple(cell), spec, 0.8 * float(inp.q.abs().amax()), gpu.detect()):
        decoder = Decoder(spec, variant=variant, device="cuda")
        out = _answer_into_poisoned_buffers(decoder, inp)
        torch.cuda.synchronize()
        assert_close(out, _expected(variant, inp), max_error(variant, "cuda"), f"{cell_id(case)} {variant}")


def test_the_gpu_matrix_covers_every_cell_and_setting_and_its_variants_build(monkeypatch):
    """Every declared cell and odd cell, split-K setting, q mode and fused setting is in it; on
    the CPU each case's variants validate, and the own ones build."""
    cases = {name: {tuple(c[1:]) for c in GPU_CASES if c[0] == name} for name in _serving_backends()}
    assert {"flashmla", "flashinfer"} <= set(OTHERS)
    assert cases["triton"] == set(CELL_GRID) | set(ODD_CELLS)
    assert cases["triton_fused"] == set(FUSED_GRID) | set(ODD_CELLS)
    assert {c[0] for c in cases["flashmla"]} == {64} and len(cases["flashmla"]) == 12
    assert {c[0] for c in cases["flashinfer"]} == set(CELL_LAYOUTS) and len(cases["flashinfer"]) == 48
    for name in OTHERS:
        assert cases[name] and cases[name] == {c for c in CELL_GRID if _caps(name).refusal(_spec(name, *c)) is None}
    settings = {(v.get("max_splits"), v.get("block_h") * (1 << (c[2] - 1).bit_length()) >= 64, v.get("q"))
                for c in cases["triton"] for v in [_splitk_variant(*c)]}
    assert {s[0] for s in settings} == {1, 8, 16} and {s[1] for s in settings} == {True, False}
    assert {s[2] for s in settings} == {"bf16", "fp8_dynamic"}
    assert all(len(_fused_variants(*c[1:])) == (3 if c[3] == "fp8" else 2) for c in cases["triton_fused"])
    vendor_fakes.install(monkeypatch, "flash_mla", "flashinfer")
    h200 = gpu.fake_platform("H200")
    built = 0
    for name, *cell in GPU_CASES:
        spec = _spec(name, *cell)
        for variant in _gpu_variants(name, tuple(cell), spec, 6.0, h200):
            get_backend(name).validate(variant)
            assert variant.get("kv") == spec.kv_format
            if name in OWN:
                get_backend(name).build_serving(variant, spec, "cpu")  # allocates on its first call
                built += 1
    # split-K: default + rotated; fused: default + 2 bf16 settings (+ fp8 q on fp8 KV)
    assert built == 54 * 2 + 100 * 3 + 51


# ------------------------------------------------------------------------------ CPU
# (backend, layout, heads, q_len, kv, kv_lens, setting); 32 heads stand in for 128 (the
# interpreter runs a program per head in the reduction). Setting: (block_n, block_h,
# max_splits, tokens_per_split[, q mode]) with fp16 dots, or None: the default variant.
_ROWS = [(0, 16, 1, "bf16"), (0, 32, 2, "fp8"), (0, 16, 4, "fp8"), (1, 32, 1, "bf16"), (1, 16, 2, "fp8"),
         (1, 32, 4, "bf16"), (16, 16, 1, "fp8"), (16, 32, 2, "bf16"), (16, 16, 4, "bf16"), (64, 32, 1, "fp8"),
         (64, 16, 2, "bf16"), (64, 32, 4, "fp8")]
_SPLITK_SETTINGS = [
    ([300, 1, 17], (64, 16, 8, 32, "bf16")), ([65, 1], (32, 32, 4, 32, "fp8_dynamic")),
    ([63, 4, 64], (16, 4, 1, 1, "bf16")), ([17, 64], (16, 32, 2, 32, "bf16")),
    ([300, 1, 65], (64, 8, 4, 64, "fp8_static")), ([18, 5], (16, 16, 3, 8, "bf16")),
    ([1, 63, 65, 17], (32, 16, 4, 16, "fp8_dynamic")), ([64, 2], (16, 32, 2, 48, "bf16")),
    ([65, 17, 4], (16, 8, 8, 16, "bf16")), ([65, 1], (32, 16, 4, 32, "bf16")),
    ([300, 17, 64], (64, 16, 16, 32, "bf16")), ([17, 63], (16, 16, 2, 16, "fp8_dynamic")),
]
_FUSED_SETTINGS = [(lens, setting[:4]) for lens, setting in _SPLITK_SETTINGS]
CPU_CASES = ([("triton", *row, lens, s) for row, (lens, s) in zip(_ROWS, _SPLITK_SETTINGS, strict=True)]
             + [("triton_fused", *row, lens, s) for row, (lens, s) in zip(_ROWS, _FUSED_SETTINGS, strict=True)]
             + [("triton", 16, 16, 2, "fp8", [300, 17], None), ("triton", 0, 16, 1, "bf16", [300, 1], None),
                ("triton_fused", 64, 16, 1, "fp8", [300, 17], None), ("triton_fused", 1, 16, 2, "bf16", [300, 2], None)])


def _cpu_variant(name: str, kv: str, setting: tuple, q_amax: float) -> Variant:
    if name == "triton":
        block_n, block_h, max_splits, tokens_per_split, q_mode = setting
        return Variant.make("triton", kv=kv, q=q_mode, block_n=block_n, block_h=block_h, max_splits=max_splits,
                            tokens_per_split=tokens_per_split, num_warps=4, num_stages=1, dot_dtype="fp16",
                            **({"q_amax": q_amax} if q_mode == "fp8_static" else {}))
    block_n, block_h, max_splits, tokens_per_split = setting
    return Variant.make("triton_fused", kv=kv, q="bf16", qk_dot="fp16", pv_dot="fp16", block_n=block_n,
                        block_h=block_h, max_splits=max_splits, tokens_per_split=tokens_per_split, num_warps=4,
                        num_stages=1)


def test_cpu_sample_covers_every_pair_of_factors():
    factors = [CELL_LAYOUTS, (16, 32), CELL_Q_LENS, CELL_KV_FORMATS]
    for name in OWN:
        cases = [c[1:] for c in CPU_CASES if c[0] == name and c[6] is not None]
        for i, j in itertools.combinations(range(4), 2):
            seen = {(case[i], case[j]) for case in cases}
            assert seen == set(itertools.product(factors[i], factors[j])), (name, i, j)
        assert {1, 17, 63, 64, 65, 300} <= {n for case in cases for n in case[4]}, name
        splits = {min(s[2], max(-(-n // s[3]) for n in lens)) for *_, lens, s in cases}
        assert 1 in splits and any(1 < k for k in splits), name  # one split and several
        assert any(-(-max(lens) // s[3]) > s[2] for *_, lens, s in cases), name  # max_splits caps
        assert {s[1] for *_, s in cases} >= {4, 8, 16, 32}, name
        pages = {(s[0] > c[0]) - (s[0] < c[0]) for c in cases if c[0] > 1 for s in [c[5]]}
        assert pages == {-1, 0, 1}, name  # tiles shorter, equal and longer than a page
    assert {c[6][4] for c in CPU_CASES if c[0] == "triton" and c[6] is not None} \
        == {"bf16", "fp8_dynamic", "fp8_static"}
    assert {c[0] for c in CPU_CASES if c[6] is None} == set(OWN)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{cell_id(c)}-{'default' if c[6] is None else 'set'}")
def test_the_serving_call_matches_the_reference_on_a_covering_sample(case):
    name, layout, heads, q_len, kv, kv_lens, setting = case
    spec = _spec(name, layout, heads, q_len, kv)
    inp = serving_input(spec, kv_lens, 17, "cpu")
    assert max(inp.q_lens) == q_len
    if setting is None:
        variant = get_backend(name).default_serving_variant(spec, gpu.detect())
    else:  # fp8_static: a q_amax below the largest |q|, so some values clamp, as in serving
        variant = _cpu_variant(name, kv, setting, 0.8 * float(inp.q.abs().amax()))
    decoder = Decoder(spec, variant=variant, device="cpu")
    # the first call over the new tokens alone (each sequence holds just them): it sizes the buffers
    warm = serving.make_input(inp.q_lens, inp.q_lens, heads, layout, kv, seed=1)
    out = _answer_into_poisoned_buffers(decoder, inp, warm)
    assert_close(out, _expected(variant, inp), 1e-2, f"{cell_id(case)} {variant}")
