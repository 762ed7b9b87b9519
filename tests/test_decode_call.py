"""The one decode call (Decoder, decode) over the own serving runners, against the fp32
reference; the full matrix is in tests/test_serving_correctness.py."""

import itertools

import pytest
import torch

from mla_tune.backends import UnknownBackend, get_backend
from mla_tune.core import CORE_HEADS, CallSpec, Shape, Variant, device_sm_count
from mla_tune.gpu import Platform, fake_platform
from mla_tune.kernels.flash_decode import fill_splits
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import PREFERENCE, Decoder, clear_decoders, decode, infer_spec
from tests.helpers import assert_close

KV_FORMATS = ("bf16", "fp8")
OWN = ("triton", "triton_fused")
CPU = Platform("cpu", "cpu", "cpu", False, 0)


@pytest.fixture(autouse=True)
def _fresh_decoders():
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


def test_a_split_k_variant_with_a_batch_budget_splits_by_batch_size(device):
    """split_budget reaches the kernel: 3 sequences under a budget of 7 run 2 splits each (150
    tokens -> 192 in 64-token tiles) where max_splits alone gives 3 (4 of 75 -> 128 tokens); on a
    GPU fill_splits raises the share to max_splits (the 3 of no budget)."""
    spec = CallSpec("bf16", 16, 16, max_q_len=1)
    variant = get_backend("triton").default_serving_variant(spec, CPU).with_params(
        max_splits=4, tokens_per_split=32, split_budget=7)
    runner = get_backend("triton").build_serving(variant, spec, device)
    inp = serving.make_input([1, 1, 1], [300, 300, 300], 16, 16, "bf16", seed=5, device=device)
    out = runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    assert_close(out, inp.reference(), 1e-2, "split_budget")
    share = fill_splits(7, 3, 16 // variant.get("block_h"), 4, device_sm_count(device))
    assert runner.workspace.split_count[:3].tolist() == {2: [2, 2, 2], 4: [3, 3, 3]}[share]
    unbudgeted = get_backend("triton").build_serving(variant.with_params(split_budget=0), spec, device)
    unbudgeted(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    assert unbudgeted.workspace.split_count[:3].tolist() == [3, 3, 3]


def test_the_output_buffer_is_allocated_once_and_reused(device):
    """The same buffer for the same and for fewer new tokens; a larger call grows it once."""
    spec = CallSpec("bf16", 16, 16, max_q_len=2, mixed_q_len=True)
    for backend in OWN:
        decoder = Decoder(spec, backend=backend, device=device)
        big = serving.make_input([2, 2, 1], [30, 5, 9], 16, 16, "bf16", seed=5, device=device)
        small = serving.make_input([1, 2], [7, 12], 16, 16, "bf16", seed=6, device=device)
        first = decoder(big.q, big.qo_indptr, big.kv, **big.layout)
        ptr = first.data_ptr()
        assert decoder(big.q, big.qo_indptr, big.kv, **big.layout).data_ptr() == ptr
        out = decoder(small.q, small.qo_indptr, small.kv, **small.layout)
        assert out.data_ptr() == ptr and out.shape[0] == 3
        assert_close(out, small.reference(), 1e-2, f"{backend} smaller call")
        larger = serving.make_input([2] * 4, [20] * 4, 16, 16, "bf16", seed=7, device=device)
        grown = decoder(larger.q, larger.qo_indptr, larger.kv, **larger.layout).data_ptr()
        assert grown != ptr
        assert decoder(larger.q, larger.qo_indptr, larger.kv, **larger.layout).data_ptr() == grown
        assert decoder(big.q, big.qo_indptr, big.kv, **big.layout).data_ptr() == grown


def test_a_decoder_checks_host_lengths_q_len_and_kv_scale_against_its_spec(device):
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


def test_decode_keeps_one_decoder_per_spec_and_picks_the_own_split_k_kernel_first(device, monkeypatch):
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
    # decode picks the own split-K kernel first
    assert PREFERENCE[:2] == OWN and Decoder(CallSpec("bf16"), device=device).backend == "triton"


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
def test_a_spec_no_backend_serves_or_a_named_backend_refuses_is_refused_saying_why():
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
MISMATCHES = {
    "heads": (lambda inp, flat: dict(q=_fp8(heads=32).q), r"\(total_q, 16, 576\)"),
    "page_size": (lambda inp, flat: dict(kv=_fp8(page_size=64).kv), r"\(num_pages, 16, 576\)"),
    "contiguous": (lambda inp, flat: dict(kv=flat.kv, kv_indptr=flat.kv_indptr, block_table=None,
                                          seq_lens=None), "pass block_table and seq_lens"),
    "both": (lambda inp, flat: dict(kv_indptr=flat.kv_indptr), "not kv_indptr"),
    "bf16_kv": (lambda inp, flat: dict(kv=torch.zeros(inp.kv.shape, dtype=torch.bfloat16), kv_scale=None),
                "kv must have an fp8 dtype"),
    "no_scale": (lambda inp, flat: dict(kv_scale=None), "fp8 KV needs kv_scale"),
    # a Python float is a kv_scale (tests/test_model_call_facts.py); this is not
    "float64_scale": (lambda inp, flat: dict(kv_scale=torch.tensor([0.5], dtype=torch.float64)),
                      "fp8 KV needs kv_scale"),
    "batch": (lambda inp, flat: dict(qo_indptr=torch.tensor([0, 1, 2, 3], dtype=torch.int32)),
              r"block_table must be an int32 \(3, max_pages\)"),
    "too_many_tokens": (lambda inp, flat: dict(q=torch.zeros((5, 16, 576), dtype=torch.bfloat16)),
                        "each brings 1 to 2"),
    "block_table_dtype": (lambda inp, flat: dict(block_table=inp.block_table.long()),
                          "block_table must be an int32"),
    "seq_lens_rows": (lambda inp, flat: dict(seq_lens=inp.seq_lens[:1]),
                      r"seq_lens must be a contiguous int32 \(2,\)"),
    # the same values in a strided view: the kernels would read its gaps as lengths
    "seq_lens_strided": (lambda inp, flat: dict(seq_lens=inp.seq_lens.repeat_interleave(2)[::2]),
                         r"seq_lens must be a contiguous int32 \(2,\)"),
    "qo_indptr_strided": (lambda inp, flat: dict(qo_indptr=inp.qo_indptr.repeat_interleave(2)[::2]),
                          "qo_indptr must be a contiguous int32"),
    "q_dtype": (lambda inp, flat: dict(q=inp.q.float()), "contiguous bfloat16"),
}


@pytest.mark.parametrize("name", MISMATCHES)
def test_a_call_that_does_not_match_its_decoder_is_refused_before_launch(name):
    decoder = Decoder(CallSpec("fp8", 16, 16, max_q_len=2, mixed_q_len=True), device="cpu")
    inp = _fp8()
    args = dict(q=inp.q, qo_indptr=inp.qo_indptr, kv=inp.kv, kv_scale=inp.kv_scale, **inp.layout)
    edit, message = MISMATCHES[name]
    with pytest.raises(ValueError, match=message):
        decoder(**{**args, **edit(inp, _fp8(page_size=0))})


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
PLATFORMS = [CPU, fake_platform("H200"), Platform("gpu78", "gpu78", "sm_89", False, 78)]


@pytest.mark.parametrize("backend", OWN)
@pytest.mark.parametrize("platform", PLATFORMS, ids=lambda p: p.name)
def test_default_serving_variants_validate_and_build_for_every_spec(backend, platform):
    module = get_backend(backend)
    for page_size, heads, max_q_len, kv in itertools.product((0, 1, 16, 64, 128), CORE_HEADS, (1, 2, 3, 4),
                                                             KV_FORMATS):
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
    ("triton", dict(block_h=3), "block_h=3"),
    ("triton", dict(block_h=256), "block_h=256"),
    ("triton", dict(max_splits=0), "max_splits=0"),
    ("triton", dict(max_splits=257), "max_splits=257"),
    ("triton", dict(tokens_per_split=0), "tokens_per_split=0"),
    ("triton", dict(num_splits=4), "unknown parameter num_splits"),
    ("triton", dict(q="fp8_static"), "q_amax"),
    ("triton", dict(kv="mxfp4"), "kv=mxfp4"),
    ("triton_fused", dict(block_h=3), "block_h=3"),
    ("triton_fused", dict(max_splits=300), "max_splits=300"),
    ("triton_fused", dict(tokens_per_split=-1), "tokens_per_split=-1"),
    ("triton_fused", dict(kv="mxfp4"), "kv=mxfp4"),
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
