"""The Decoder of every serving backend against the fp32 reference, called twice (the first
answer and the partials poisoned with NaN). GPU: each declared cell at DeepSeek-V3's scale, a
few settings per cell, the LSE on every other cell, an fp8 cache as uint8 bytes through a
plan. CPU: the own kernels over a sample covering every pair of factors; the one decode call
(Decoder, decode): its buffers, specs, refusals and variants."""

import dataclasses
import itertools

import pytest
import torch

from mla_tune import gpu, problem
from mla_tune.backends import UnknownBackend, get_backend
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, CORE_HEADS, SM_SCALE, CallSpec, Shape, Variant
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import PREFERENCE, Decoder, clear_decoders, decode, infer_spec
from mla_tune.serving.decode_plan import DecodePlan
from tests.helpers import (
    CELL_GRID,
    CELL_KV_FORMATS,
    CELL_LAYOUTS,
    CELL_Q_LENS,
    assert_close,
    call_with_host_lengths,
    cell_id,
    cell_spec,
    declared_cells,
    max_error,
    serving_expected,
    serving_input,
    vendor_fakes,
)

OWN = ("triton", "triton_fused")
CPU = gpu.Platform("cpu", "cpu", "cpu", False, 0)
H200 = gpu.fake_platform("H200")
SCALE = CORE_DEEPSEEK_V3_SCALE
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


def _answer_into_poisoned_buffers(decoder: Decoder, inp: serving.ServingInput, warm=None):
    """Call `warm` (or `inp`), poison its answer (and LSE) and the partials, and call `inp`
    into them: the answer, or (answer, LSE) where the spec returns the LSE."""
    first = call_with_host_lengths(decoder, warm or inp)
    first = first if decoder.spec.return_lse else (first,)
    for tensor in first:
        tensor.fill_(float("nan"))
    for name in _PARTIALS.get(decoder.backend, ()):
        getattr(decoder.runner.workspace, name).fill_(float("nan"))
    again = call_with_host_lengths(decoder, inp)
    answer = again[0] if decoder.spec.return_lse else again
    if decoder.variant.backend not in LIBRARY_OUTPUTS:
        assert answer.data_ptr() == first[0].data_ptr(), "the runner allocated a new output for the same new tokens"
    return again


def _expected(variant: Variant, inp: serving.ServingInput, **kw):
    """The reference at the model's scale (kw: sm_scale, return_lse) on q as the variant's q
    mode sees it."""
    kw.setdefault("sm_scale", SCALE)
    return serving_expected(variant, inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout, **kw)


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
    one = Variant.make("triton_fused", kv=kv, q="bf16", qk_dot="bf16", pv_dot="bf16", max_splits=1, tokens_per_split=1,
                       block_n=64, block_h=block_h, num_warps=4, num_stages=2)
    plans = [one, one.with_params(max_splits=16, tokens_per_split=64, block_n=32, block_h=min(heads, 2 * block_h))]
    if kv == "fp8":
        plans.append(one.with_params(q="fp8_dynamic", qk_dot="fp8", pv_dot="fp16", max_splits=8, tokens_per_split=256))
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
    elif name == "gluon_fused":  # no splits at q_len 1; else two V halves, 4 splits, a batch budget
        default = variants[0]
        variants.append(default.with_params(max_splits=1) if spec.max_q_len == 1 else default.with_params(
            v_halves=2, max_splits=4, tokens_per_split=256, split_budget=24))
    return list(dict.fromkeys(variants))


def _serving_backends() -> list[str]:
    """Every serving backend that runs on an H200, in the order a Decoder tries them."""
    return [name for name in PREFERENCE if _caps(name).serving and _caps(name).runs_on(H200.tags)]


FUSED_GRID = list(itertools.product(CELL_LAYOUTS, (16, 32, 64, 128), CELL_Q_LENS, CELL_KV_FORMATS))
GLUON_64_HEADS = list(itertools.product((64,), (64,), CELL_Q_LENS, CELL_KV_FORMATS))
OTHERS = [name for name in _serving_backends() if name not in OWN]  # FlashMLA, FlashInfer, ...
GPU_CASES = (declared_cells("triton", CELL_GRID + ODD_CELLS)
             + declared_cells("triton_fused", FUSED_GRID + [c for c in ODD_CELLS if c not in FUSED_GRID])
             + [case for name in OTHERS for case in declared_cells(name)]
             + declared_cells("gluon_fused", GLUON_64_HEADS))


def _gpu_spec(name: str, layout: int, heads: int, q_len: int, kv: str) -> CallSpec:
    """The cell's call, returning the LSE on every other cell of a backend that declares it."""
    lse = _caps(name).lse and (layout + heads // 16 + q_len) % 2 == 1
    return dataclasses.replace(_spec(name, layout, heads, q_len, kv), return_lse=lse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=cell_id)
def test_every_declared_cell_matches_the_reference_on_the_gpu(case):
    """And the answer is not the default softmax scale's: the model's scale reached the kernel."""
    name, *cell = case
    assert (reason := get_backend(name).unavailable_reason()) is None, reason
    spec = _gpu_spec(name, *cell)
    inp = serving_input(spec, [3000, 1, 17, 63, 64, 65, 1000, 129], 31, "cuda")
    for variant in _gpu_variants(name, tuple(cell), spec, 0.8 * float(inp.q.abs().amax()), gpu.detect()):
        decoder = Decoder(spec, variant=variant, device="cuda")
        got = _answer_into_poisoned_buffers(decoder, inp)
        out, lse = got if spec.return_lse else (got, None)
        torch.cuda.synchronize()
        what = f"{cell_id(case)} {variant}"
        ref, ref_lse = _expected(variant, inp, return_lse=True)
        assert_close(out, ref, max_error(variant, "cuda"), what)
        assert not problem.check(out.float(), _expected(variant, inp, sm_scale=SM_SCALE),
                                 problem.RULES["strict"]).passed, f"{what}: the answer ignores the scale"
        if lse is not None:
            assert lse.shape == ref_lse.shape and lse.dtype == torch.float32, what
            assert float((lse - ref_lse).abs().max()) < 5e-2, f"{what}: LSE"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["triton", "triton_fused", "flashmla"])
def test_an_fp8_cache_as_uint8_bytes_through_a_plan(backend):
    """The engines' uint8 cache and a Python float scale; the second call replays what the
    first recorded (own kernels)."""
    assert (reason := get_backend(backend).unavailable_reason()) is None, reason
    spec = CallSpec("fp8", page_size=64, heads=128, max_q_len=1, sm_scale=SCALE, cache_dtype="uint8")
    plan = DecodePlan(spec, max_batch=8, backend=backend, device="cuda")
    inp = serving.make_input([1] * 6, [1, 17, 64, 65, 300, 3000], 128, 64, "fp8", seed=6, device="cuda")
    picked = plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    for _ in range(2):
        out = plan.run(inp.q, inp.kv.view(torch.uint8), float(inp.kv_scale))
    torch.cuda.synchronize()
    assert_close(out, _expected(picked, inp), max_error(picked, "cuda"), f"{backend} uint8")


def test_the_gpu_matrix_covers_every_cell_and_setting_and_its_variants_build(monkeypatch):
    """Every declared cell and odd cell, split-K setting, q mode and fused setting is in it; on
    the CPU each case's variants validate, and the own ones build."""
    cases = {name: {tuple(c[1:]) for c in GPU_CASES if c[0] == name} for name in _serving_backends()}
    assert cases["triton"] == set(CELL_GRID) | set(ODD_CELLS)
    assert cases["triton_fused"] == set(FUSED_GRID) | set(ODD_CELLS)
    assert {c[0] for c in cases["flashmla"]} == {64} and len(cases["flashmla"]) == 12
    assert {c[0] for c in cases["flashinfer"]} == set(CELL_LAYOUTS) and len(cases["flashinfer"]) == 48
    assert {c[1] for c in cases["gluon_fused"]} == {16, 64, 128} and len(cases["gluon_fused"]) == 30
    for name in OTHERS:
        declared = {c for c in CELL_GRID if _caps(name).refusal(_spec(name, *c)) is None}
        assert cases[name] and cases[name] - set(GLUON_64_HEADS) == declared
    for name, cells in cases.items():  # the LSE on and off; split-K's from stage 2's merge too
        assert {_gpu_spec(name, *c).return_lse for c in cells} == {_caps(name).lse, False}, name
    assert any(_gpu_spec("triton", *c).return_lse and _splitk_variant(*c).get("max_splits") > 1
               for c in cases["triton"])
    settings = {(v.get("max_splits"), v.get("block_h") * (1 << (c[2] - 1).bit_length()) >= 64, v.get("q"))
                for c in cases["triton"] for v in [_splitk_variant(*c)]}
    assert {s[0] for s in settings} == {1, 8, 16} and {s[1] for s in settings} == {True, False}
    assert {s[2] for s in settings} == {"bf16", "fp8_dynamic"}
    assert all(len(_fused_variants(*c[1:])) == (3 if c[3] == "fp8" else 2) for c in cases["triton_fused"])
    vendor_fakes.install(monkeypatch, "flash_mla", "flashinfer")
    built = 0
    for name, *cell in GPU_CASES:
        spec = _spec(name, *cell)
        for variant in _gpu_variants(name, tuple(cell), spec, 6.0, H200):
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
# max_splits, tokens_per_split, split-K's q mode; fused: bf16 q) with fp16 dots, or None: the
# default variant.
_ROWS = [(0, 16, 1, "bf16"), (0, 32, 2, "fp8"), (0, 16, 4, "fp8"), (1, 32, 1, "bf16"), (1, 16, 2, "fp8"),
         (1, 32, 4, "bf16"), (16, 16, 1, "fp8"), (16, 32, 2, "bf16"), (16, 16, 4, "bf16"), (64, 32, 1, "fp8"),
         (64, 16, 2, "bf16"), (64, 32, 4, "fp8")]
_SETTINGS = [
    ([300, 1, 17], (64, 16, 8, 32, "bf16")), ([65, 1], (32, 32, 4, 32, "fp8_dynamic")),
    ([63, 4, 64], (16, 4, 1, 1, "bf16")), ([17, 64], (16, 32, 2, 32, "bf16")),
    ([300, 1, 65], (64, 8, 4, 64, "fp8_static")), ([18, 5], (16, 16, 3, 8, "bf16")),
    ([1, 63, 65, 17], (32, 16, 4, 16, "fp8_dynamic")), ([64, 2], (16, 32, 2, 48, "bf16")),
    ([65, 17, 4], (16, 8, 8, 16, "bf16")), ([65, 1], (32, 16, 4, 32, "bf16")),
    ([300, 17, 64], (64, 16, 16, 32, "bf16")), ([17, 63], (16, 16, 2, 16, "fp8_dynamic")),
]
CPU_CASES = ([(name, *row, lens, s) for name in OWN for row, (lens, s) in zip(_ROWS, _SETTINGS, strict=True)]
             + [("triton", 16, 16, 2, "fp8", [300, 17], None), ("triton", 0, 16, 1, "bf16", [300, 1], None),
                ("triton_fused", 64, 16, 1, "fp8", [300, 17], None),
                ("triton_fused", 1, 16, 2, "bf16", [300, 2], None)])


def _cpu_variant(name: str, kv: str, setting: tuple, q_amax: float) -> Variant:
    tiles = dict(zip(("block_n", "block_h", "max_splits", "tokens_per_split"), setting[:4], strict=True))
    if name == "triton_fused":
        return Variant.make(name, kv=kv, q="bf16", qk_dot="fp16", pv_dot="fp16", **tiles, num_warps=4, num_stages=1)
    return Variant.make(name, kv=kv, q=setting[4], **tiles, num_warps=4, num_stages=1, dot_dtype="fp16",
                        **({"q_amax": q_amax} if setting[4] == "fp8_static" else {}))


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


# ------------------------------------------------ the one decode call (Decoder, decode)
@pytest.fixture
def fresh_decoders():
    clear_decoders()  # decode() keeps a Decoder per spec otherwise
    yield
    clear_decoders()


@pytest.mark.parametrize("backend", OWN)
def test_a_decoder_runs_a_given_variant_with_splits_at_128_heads(backend, device):
    """The default's max_splits is 1 at 128 heads on the interpreter's stand-in SMs; a given
    variant (32-head tiles) splits every 32 tokens, up to 4 splits."""
    spec = CallSpec("fp8", 16, 128, max_q_len=2, mixed_q_len=True)
    default = get_backend(backend).default_serving_variant(spec, CPU)
    assert default.get("max_splits") == 1
    variant = default.with_params(max_splits=4, tokens_per_split=32, block_h=32)
    decoder = Decoder(spec, variant=variant, device=device)
    assert (decoder.backend, decoder.variant) == (backend, variant)
    inp = serving.make_input([2, 1, 2], [100, 33, 2], 128, 16, "fp8", seed=3, device=device)
    out = decoder(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    assert_close(out, inp.reference(), 1e-2, f"{backend} with splits")


def test_a_decoder_checks_host_lengths_q_len_and_kv_scale_against_its_spec(device, fresh_decoders):
    inp = serving.make_input([2, 1], [9, 40], 16, 0, "bf16", seed=9, device=device)
    out = decode(inp.q, inp.qo_indptr, inp.kv, **inp.layout, max_q_len=2,
                 q_lens_host=inp.q_lens, kv_lens_host=inp.kv_lens)
    assert_close(out, inp.reference(), 1e-2, "host lengths")
    decoder = Decoder(CallSpec("bf16", 0, 16, 2, True, host_lengths=True), device=device)
    with pytest.raises(ValueError, match="pass q_lens_host and kv_lens_host"):
        decoder(inp.q, inp.qo_indptr, inp.kv, **inp.layout, q_lens_host=inp.q_lens)
    decoder = Decoder(CallSpec("bf16"), device="cpu")  # one new token each
    inp = serving.make_input([2, 1], [9, 40], 16, 0, "bf16", seed=8)
    with pytest.raises(ValueError, match="max_q_len 1"):
        decoder(inp.q, inp.qo_indptr, inp.kv, **inp.layout)
    with pytest.raises(ValueError, match="takes no kv_scale"):
        one = serving.make_input([1, 1], [9, 40], 16, 0, "bf16", seed=8)
        decoder(one.q, one.qo_indptr, one.kv, torch.ones(1), **one.layout)


def test_decode_keeps_one_decoder_per_spec_and_picks_the_own_split_k_kernel_first(device, monkeypatch,
                                                                                 fresh_decoders):
    built = []
    original = get_backend("triton").build_serving
    monkeypatch.setattr(get_backend("triton"), "build_serving",
                        lambda *a: built.append(a[1]) or original(*a))
    inp = serving.make_input([1, 1], [9, 40], 16, 0, "bf16", seed=2, device=device)
    for _ in range(3):
        decode(inp.q, inp.qo_indptr, inp.kv, **inp.layout)
    paged = serving.make_input([1, 1], [9, 40], 16, 16, "bf16", seed=2, device=device)
    decode(paged.q, paged.qo_indptr, paged.kv, **paged.layout)
    assert [s.page_size for s in built] == [0, 16]


# ---------------------------------------------------------------------------- the spec
def test_infer_spec_reads_shapes_and_dtypes_only():
    inp = serving.make_input([2, 1], [9, 40], 128, 64, "fp8", seed=2)
    spec = infer_spec(inp.q, inp.qo_indptr, inp.kv, block_table=inp.block_table, max_q_len=2)
    assert spec == CallSpec("fp8", 64, 128, 2, True)
    one = serving.make_input([1, 1], [9, 40], 16, 0, "bf16", seed=2)
    assert infer_spec(one.q, one.qo_indptr, one.kv) == CallSpec("bf16", 0, 16, 1, False)
    with pytest.raises(ValueError, match="pass max_q_len"):
        infer_spec(inp.q, inp.qo_indptr, inp.kv, block_table=inp.block_table)
    with pytest.raises(ValueError, match=r"kv\.view\(torch\.float8_e4m3fn\)"):
        infer_spec(inp.q, inp.qo_indptr, inp.kv.view(torch.uint8), block_table=inp.block_table, max_q_len=2)


# ------------------------------------------------------------------------- refusals
def test_a_spec_no_backend_serves_or_a_named_backend_refuses_is_refused_saying_why(fresh_decoders):
    with pytest.raises(ValueError, match="no backend serves") as info:
        Decoder(CallSpec("bf16", 16, 16, max_q_len=8), device="cpu")
    message = str(info.value)
    for name in PREFERENCE:
        assert f"{name}: " in message
    assert "q_len up to 4, not 8" in message
    # a named backend that refuses says why and which would serve
    spec = CallSpec("bf16", 16, 16, max_q_len=2, mixed_q_len=True)
    with pytest.raises(ValueError, match=r"backend flashmla cannot serve .*pages of 64 tokens.*"
                                         r"backends that would: triton, triton_fused"):
        Decoder(spec, backend="flashmla", device="cpu")
    inp = serving.make_input([1], [9], 16, 16, "bf16", seed=1)
    with pytest.raises(ValueError, match="backend flashmla cannot serve"):
        decode(inp.q, inp.qo_indptr, inp.kv, **inp.layout, backend="flashmla")
    with pytest.raises(ValueError, match=r"mxfp4.*no backend here would"):
        Decoder(CallSpec("mxfp4"), backend="triton_fused", device="cpu")
    with pytest.raises(UnknownBackend, match="known backends"):
        Decoder(spec, backend="nope", device="cpu")
    with pytest.raises(ValueError, match="belongs to backend triton, not triton_fused"):
        Decoder(spec, backend="triton_fused", variant=Variant.make("triton", kv="bf16"), device="cpu")


def _fp8(heads=16, page_size=16):
    return serving.make_input([2, 1], [9, 40], heads, page_size, "fp8", seed=8)


# name: (the arguments that differ from a right call of CallSpec('fp8', 16, 16, max_q_len=2), the refusal)
INP, FLAT = _fp8(), _fp8(page_size=0)
MISMATCHES = {
    "heads": (dict(q=_fp8(heads=32).q), r"\(total_q, 16, 576\)"),
    "page_size": (dict(kv=_fp8(page_size=64).kv), r"\(num_pages, 16, 576\)"),
    "contiguous": (dict(kv=FLAT.kv, kv_indptr=FLAT.kv_indptr, block_table=None, seq_lens=None),
                   "pass block_table and seq_lens"),
    "both": (dict(kv_indptr=FLAT.kv_indptr), "not kv_indptr"),
    "bf16_kv": (dict(kv=torch.zeros(INP.kv.shape, dtype=torch.bfloat16), kv_scale=None), "kv must have an fp8 dtype"),
    "no_scale": (dict(kv_scale=None), "fp8 KV needs kv_scale"),
    # a Python float is a kv_scale (tests/test_model_call_facts.py); this is not
    "float64_scale": (dict(kv_scale=torch.tensor([0.5], dtype=torch.float64)), "fp8 KV needs kv_scale"),
    "batch": (dict(qo_indptr=torch.tensor([0, 1, 2, 3], dtype=torch.int32)),
              r"block_table must be an int32 \(3, max_pages\)"),
    "too_many_tokens": (dict(q=torch.zeros((5, 16, 576), dtype=torch.bfloat16)), "each brings 1 to 2"),
    "block_table_dtype": (dict(block_table=INP.block_table.long()), "block_table must be an int32"),
    "seq_lens_rows": (dict(seq_lens=INP.seq_lens[:1]), r"seq_lens must be a contiguous int32 \(2,\)"),
    # the same values in a strided view: the kernels would read its gaps as lengths
    "seq_lens_strided": (dict(seq_lens=INP.seq_lens.repeat_interleave(2)[::2]),
                         r"seq_lens must be a contiguous int32 \(2,\)"),
    "qo_indptr_strided": (dict(qo_indptr=INP.qo_indptr.repeat_interleave(2)[::2]),
                          "qo_indptr must be a contiguous int32"),
    "q_dtype": (dict(q=INP.q.float()), "contiguous bfloat16"),
}


@pytest.mark.parametrize("name", MISMATCHES)
def test_a_call_that_does_not_match_its_decoder_is_refused_before_launch(name):
    decoder = Decoder(CallSpec("fp8", 16, 16, max_q_len=2, mixed_q_len=True), device="cpu")
    args = dict(q=INP.q, qo_indptr=INP.qo_indptr, kv=INP.kv, kv_scale=INP.kv_scale, **INP.layout)
    with pytest.raises(ValueError, match=MISMATCHES[name][1]):
        decoder(**{**args, **MISMATCHES[name][0]})


@pytest.mark.parametrize("backend", OWN)
def test_the_runners_beneath_refuse_strided_index_tensors(backend):
    """A runner called directly (no Decoder) reads qo_indptr, kv_indptr and seq_lens element by
    element: a strided view of the right values is refused, not read through its gaps."""
    for page_size, field in ((16, "seq_lens"), (0, "kv_indptr"), (16, "qo_indptr")):
        spec = CallSpec("fp8", page_size, 16, max_q_len=2, mixed_q_len=True)
        runner = Decoder(spec, backend=backend, device="cpu").runner
        inp = _fp8(page_size=page_size)
        args = dict(qo_indptr=inp.qo_indptr, **inp.layout)
        args[field] = args[field].repeat_interleave(2)[::2]
        with pytest.raises(ValueError, match=rf"{field} must be contiguous .* pass {field}\.contiguous\(\)"):
            runner(inp.q, args.pop("qo_indptr"), inp.kv, inp.kv_scale, **args)


# ---------------------------------------------------------------- variants and specs
PLATFORMS = [CPU, H200, gpu.Platform("gpu78", "gpu78", "sm_89", False, 78)]


@pytest.mark.parametrize("backend", OWN)
@pytest.mark.parametrize("platform", PLATFORMS, ids=lambda p: p.name)
def test_default_serving_variants_validate_and_build_for_every_spec(backend, platform):
    module = get_backend(backend)
    for page_size, heads, max_q_len, kv in itertools.product((0, 1, 16, 64, 128), CORE_HEADS, (1, 2, 3, 4),
                                                             CELL_KV_FORMATS):
        spec = CallSpec(kv, page_size, heads, max_q_len, max_q_len > 1)
        variant = module.default_serving_variant(spec, platform)
        module.validate(variant)
        assert Variant.parse(str(variant)) == variant
        assert variant.get("kv") == kv and variant.get("q") == "bf16"
        rows = 1 << (max_q_len - 1).bit_length()
        # 16 MMA rows (interpreter, fused); split-K on a GPU 64, at most all heads (docs/perf.md)
        want = min(heads * rows, 64) if backend == "triton" and platform.has_gpu else 16
        assert heads % variant.get("block_h") == 0 and variant.get("block_h") * rows == want
        splits = variant.get("max_splits")
        assert 1 <= splits <= 64
        if platform.sm_count:  # from the platform's SMs: enough for one sequence to fill them
            assert splits == min(64, -(-platform.sm_count // (heads // variant.get("block_h"))))
        dots = [variant.get(k) for k in ("dot_dtype", "qk_dot", "pv_dot") if k in variant.p]
        assert set(dots) == {"bf16" if platform.has_gpu else "fp16"}
        module.build_serving(variant, spec, "cpu")  # builds; allocates on its first call


@pytest.mark.parametrize("backend,params,message", [
    ("triton", dict(block_h=3), "block_h=3"), ("triton", dict(block_h=256), "block_h=256"),
    ("triton", dict(max_splits=0), "max_splits=0"), ("triton", dict(max_splits=257), "max_splits=257"),
    ("triton", dict(tokens_per_split=0), "tokens_per_split=0"), ("triton", dict(q="fp8_static"), "q_amax"),
    ("triton", dict(num_splits=4), "unknown parameter num_splits"), ("triton", dict(kv="mxfp4"), "kv=mxfp4"),
    ("triton_fused", dict(block_h=3), "block_h=3"), ("triton_fused", dict(max_splits=300), "max_splits=300"),
    ("triton_fused", dict(tokens_per_split=-1), "tokens_per_split=-1"), ("triton_fused", dict(kv="mxfp4"), "kv=mxfp4"),
    ("triton_fused", dict(qk_dot="fp8"), "q=fp8_dynamic goes with qk_dot=fp8"),
    ("triton_fused", dict(q="fp8_dynamic", qk_dot="fp8", pv_dot="fp8"), "fp8 dots read an fp8 KV cache"),
    ("triton_fused", dict(reduce="last"), "unknown parameter reduce"),
    ("triton_fused", dict(block_n=256), "block_n=256"),
])
def test_serving_variants_are_validated_by_name(backend, params, message):
    module = get_backend(backend)
    variant = module.default_serving_variant(CallSpec("bf16", 16, 16), CPU).with_params(**params)
    with pytest.raises(ValueError, match=message):
        module.validate(variant)


@pytest.mark.parametrize("backend", OWN)
def test_build_and_build_serving_take_only_their_own_parameter_set(backend):
    module = get_backend(backend)
    spec = CallSpec("fp8", 64, 128, max_q_len=2, mixed_q_len=True)
    serving_variant = module.default_serving_variant(spec, CPU)
    with pytest.raises(ValueError, match="serving variant"):
        module.build(serving_variant, Shape(4, 64), "cpu")
    leaderboard = module.candidates(Shape(4, 1024), {}, CPU)[0]
    module.validate(leaderboard)
    with pytest.raises(ValueError, match="leaderboard variant"):
        module.build_serving(leaderboard, spec, "cpu")
    h32 = CallSpec("fp8", 64, 32, max_q_len=2, mixed_q_len=True)
    q8 = CallSpec("fp8", 64, 128, max_q_len=8)
    for change, call_spec, message in ((dict(kv="bf16"), spec, "make the variant with kv=fp8"),
                                       (dict(block_h=4), spec, "use block_h=8"),
                                       (dict(block_h=64), h32, "must divide 32 heads"),
                                       ({}, q8, "q_len up to 4, not 8")):
        with pytest.raises(ValueError, match=message):
            module.build_serving(serving_variant.with_params(**change), call_spec, "cpu")
    with pytest.raises(ValueError, match="q_len up to 4, not 8"):
        module.default_serving_variant(q8, CPU)
