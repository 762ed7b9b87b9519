"""The AITER backend on the CPU through tests/fakes/aiter: the `aiter` fixture runs a test under
the fakes of v0.1.11, f3be04a12 (the contest runner's build) and v0.1.20.post1, which refuse
arguments past the leading tensors passed by position (the keyword rule). Also its direct mode
(stage 1 and mla_reduce_v1 without mla_decode_fwd), its softmax scale and the #4144 gate."""

import ast
import functools
import inspect
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from mla_tune import gpu, problem
from mla_tune.backends import aiter_mla, get_backend
from mla_tune.core import SM_SCALE, CallSpec, Shape, Variant
from mla_tune.tune.config import expand_space, load_config
from tests.helpers import REPO, expected_output, vendor_fakes

SHAPE = Shape(3, 256)  # small, yet long enough for the intra-batch builder (>= 196 tokens)
BF16_NP = Variant.make("aiter", kv="bf16", q="bf16", mode="nonpersistent", num_kv_splits=1)
BF16_PERSISTENT = Variant.make("aiter", kv="bf16", q="bf16", mode="persistent", fast_mode=True,
                               intra_batch=False, max_split_per_batch=-1, kv_granularity=16)
DIRECT = {"mode": "direct", "fast_mode": False, "intra_batch": True, "max_split_per_batch": 4,
          "kv_granularity": 16}
BF16_DIRECT = Variant.make("aiter", kv="bf16", q="bf16", **DIRECT)
F3BE04A12 = "0.1.10.post4.dev78+gf3be04a12a"  # setuptools_scm's version of the runner's commit
STRICT = problem.RULES["strict"]
MI355X = gpu.fake_platform("MI355X")


def install(monkeypatch, release, **config):
    """The fake of `release` (a version, or f3be04a12), installed in this process."""
    monkeypatch.setenv("MLA_TUNE_FAKE_AITER_VERSION", release)
    return vendor_fakes.install(monkeypatch, "aiter", **config)["aiter"]


@pytest.fixture(params=("0.1.11", "0.1.20.post1", F3BE04A12), ids=("v0.1.11", "v0.1.20.post1", "f3be04a12"))
def aiter(monkeypatch, request):
    """The fake of each faked release in turn, installed in this process."""
    return install(monkeypatch, request.param)


@pytest.fixture
def data():
    return problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=7, device="cpu")


def is_new(aiter) -> bool:
    """Whether `aiter` is the fake of 0.1.20.post1, the newest release faked."""
    return aiter.__version__ == "0.1.20.post1"


def _matches(out, data, sm_scale=SM_SCALE):
    """Whether `out` is, within 2e-2, the fp32 attention of bf16 q over bf16 KV at `sm_scale`."""
    reference = problem.reference(data, "bf16", "bf16", sm_scale)
    return torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2)


def direct_call_args(data, q=None, kv=None, index_dtype=torch.int32):
    """mla_decode_fwd's leading tensors (positional) and the rest of a call (by keyword)."""
    q_in, kv_data, _qo, _kv, _cfg = data
    batch, total = q_in.shape[0], kv_data["bf16"].shape[0]
    kv_in = kv_data["bf16"] if kv is None else kv
    o = torch.empty((batch, 16, 512), dtype=torch.bfloat16)
    return [q_in if q is None else q, kv_in.view(total, 1, 1, 576), o], dict(
        qo_indptr=torch.arange(batch + 1, dtype=index_dtype),
        kv_indptr=torch.arange(batch + 1, dtype=index_dtype) * (total // batch),
        kv_indices=torch.arange(total, dtype=index_dtype), kv_last_page_lens=torch.ones(batch, dtype=index_dtype),
        max_seqlen_q=1)


def work_buffers(aiter, batch, q_dtype, kv_dtype, **info_kwargs):
    """Empty work-list buffers of the sizes and dtypes get_mla_metadata_info_v1 asks for."""
    info = aiter.get_mla_metadata_info_v1(batch_size=batch, max_seqlen_qo=1, num_head_qo=16, q_dtype=q_dtype,
                                          kv_dtype=kv_dtype, is_sparse=False, **info_kwargs)
    return [torch.empty(size, dtype=dtype) for size, dtype in info]


def fill_work(aiter, qo, kvp, last, work, **kwargs):
    """get_mla_metadata_v1 by keyword; the builder takes work_info_set before work_indptr."""
    aiter.get_mla_metadata_v1(qo, kvp, kv_last_page_lens=last, num_heads_per_head_k=16, num_heads_k=1,
                              is_causal=True, work_metadata_ptrs=work[0], work_info_set=work[2],
                              work_indptr=work[1], reduce_indptr=work[3], reduce_final_map=work[4],
                              reduce_partial_map=work[5], **kwargs)
    return dict(work_meta_data=work[0], work_indptr=work[1], work_info_set=work[2], reduce_indptr=work[3],
                reduce_final_map=work[4], reduce_partial_map=work[5])

# Parameter lists of ROCm/aiter v0.1.11 and f3be04a12a (aiter/mla.py, aiter/ops/attention.py).
_V0111_DECODE = ["q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q",
                 ("page_size", 1), ("nhead_kv", 1), ("sm_scale", None), ("logit_cap", 0.0), ("num_kv_splits", None),
                 ("num_kv_splits_indptr", None), ("work_meta_data", None), ("work_indptr", None),
                 ("work_info_set", None), ("reduce_indptr", None), ("reduce_final_map", None),
                 ("reduce_partial_map", None), ("q_scale", None), ("kv_scale", None), ("intra_batch_mode", False),
                 ("return_logits", False), ("return_lse", False)]
_V01120_DECODE = _V0111_DECODE + [("g_kv_indptr", None), ("cp_world_size", 1), ("cp_rank", 0), ("causal", True)]
_V0111_INFO = ["batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype", "is_sparse", ("fast_mode", True),
               ("num_kv_splits", 32), ("intra_batch_mode", False)]
_V01120_INFO = _V0111_INFO + [("max_split_per_batch", -1)]
_V0111_BUILDER = ["seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k", "num_heads_k",
                  "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr", "reduce_indptr",
                  "reduce_final_map", "reduce_partial_map", ("page_size", 1), ("kv_granularity", 16),
                  ("max_seqlen_qo", -1), ("uni_seqlen_qo", -1), ("fast_mode", True), ("topk", -1),
                  ("max_split_per_batch", -1), ("intra_batch_mode", False), ("dtype_q", None), ("dtype_kv", None)]
# v0.1.20.post1 inserts these before the legacy dtype_q / dtype_kv aliases
_V01120_BUILDER = _V0111_BUILDER[:-2] + [("is_cp_round_robin", False), ("mla_version", 0), ("dtype_q_nope", None),
                                         ("dtype_q_rope", None), ("dtype_kv_nope", None), ("dtype_kv_rope", None),
                                         ("dtype_q", None), ("dtype_kv", None)]
# The two ops under mla_decode_fwd's persistent path (compile_ops stubs; their pybind
# declarations in csrc/include/rocm_ops.hpp name the same arguments)
_V0111_STAGE1 = ["Q", "KV", "qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_lens", "num_kv_splits_indptr",
                 "work_meta_data", "work_indptr", "work_info_set", "max_seqlen_q", "page_size", "nhead_kv",
                 "softmax_scale", "splitData", "splitLse", "output", ("q_scale", None), ("kv_scale", None)]
# v0.1.20.post1: `lse` between output and q_scale (a positional q_scale lands in lse), then
# context parallelism, gfx1250 scratch and `causal`
_V01120_STAGE1 = _V0111_STAGE1[:17] + [("lse", None), ("q_scale", None), ("kv_scale", None), ("g_kv_indptr", None),
                                       ("cp_world_size", 1), ("cp_rank", 0), ("valid_split_count", None),
                                       ("use_valid_split_count_reduce", 0), ("causal", True)]
_V0111_REDUCE = ["partial_output", "partial_lse", "reduce_indptr", "reduce_final_map", "reduce_partial_map",
                 "max_seqlen_q", "final_output", ("final_lse", None)]
_V01120_REDUCE = _V0111_REDUCE[:6] + ["num_kv_splits"] + _V0111_REDUCE[6:]  # required, before final_output
_OLD = (_V0111_DECODE, _V0111_INFO, _V0111_BUILDER, _V0111_STAGE1, _V0111_REDUCE)
_SIGNATURES = {"0.1.11": _OLD, F3BE04A12: _OLD,
               "0.1.20.post1": (_V01120_DECODE, _V01120_INFO, _V01120_BUILDER, _V01120_STAGE1, _V01120_REDUCE)}
# Each entry point and how many leading arguments it takes positionally.
_LEADING = {"mla.mla_decode_fwd": 3, "get_mla_metadata_info_v1": 0, "get_mla_metadata_v1": 2,
            "mla_decode_stage1_asm_fwd": 2, "mla_reduce_v1": 2}
_LEADING_NEW = {"get_mla_decode_fwd_max_splits": 0, "ops.triton.gluon.mla_gluon.mla_gluon": 4}


def test_fake_has_the_signatures_of_its_release_and_the_keyword_rule_and_the_backend_reads_them(aiter):
    entries = (aiter.mla.mla_decode_fwd, aiter.get_mla_metadata_info_v1, aiter.get_mla_metadata_v1,
               aiter.mla_decode_stage1_asm_fwd, aiter.mla_reduce_v1)
    for entry, spec in zip(entries, _SIGNATURES[aiter.__version__], strict=True):
        got = [(p.name, p.kind.name, p.default) for p in inspect.signature(entry).parameters.values()]
        assert got == [(s, "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty) if isinstance(s, str)
                       else (s[0], "POSITIONAL_OR_KEYWORD", s[1]) for s in spec], entry.__name__
    # pybind ops declared without py::arg names take positional arguments only
    for op in (aiter.static_per_tensor_quant, aiter.dynamic_per_tensor_quant):
        assert {p.kind.name for p in inspect.signature(op).parameters.values()} == {"POSITIONAL_ONLY"}
    # the keyword rule: every entry point refuses arguments past its leading tensors (_LEADING)
    for dotted, count in dict(_LEADING, **(_LEADING_NEW if is_new(aiter) else {})).items():
        fn = functools.reduce(getattr, dotted.split("."), aiter)
        with pytest.raises(TypeError, match=rf"{dotted.split('.')[-1]}: {count + 1} positional arguments"):
            fn(*([None] * (count + 1)))
        # the signature inspect sees is still the real one (the gate reads it)
        assert list(inspect.signature(fn).parameters)[0] != "args", dotted
    assert aiter.dtypes.fp8 is torch.float8_e4m3fn
    assert hasattr(aiter, "get_mla_decode_fwd_max_splits") == is_new(aiter)
    assert hasattr(aiter, "mla_decode_fwd_opus_stage1") == is_new(aiter)
    if is_new(aiter):
        from aiter.ops.triton.gluon.mla_gluon import mla_gluon

        assert list(inspect.signature(mla_gluon).parameters)[:7] == [
            "q_nope", "q_pe", "kv_c", "o", "page_table", "seq_info", "sm_scale"]
    else:
        with pytest.raises(ModuleNotFoundError):
            __import__("aiter.ops.triton.gluon.mla_gluon")
    # what the backend reads of it
    assert aiter_mla._ai_version(aiter) == aiter.__version__
    assert aiter_mla.unavailable_reason() is None
    features = aiter_mla._ai_features(aiter)
    assert features["missing"] == []
    for key in ("info_split_cap", "max_splits", "opus", "gluon", "gluon_fp8_any_batch", "persistent_gate",
                "direct_lse", "direct_reduce_splits"):
        assert features[key] == is_new(aiter), key
    assert features["direct"] is True


def _family(kv, q, mode, *work, **extra):
    """A variant family's parameters; `work`: fast_mode, intra_batch, max_split_per_batch, kv_granularity."""
    keys = ("fast_mode", "intra_batch", "max_split_per_batch", "kv_granularity")
    return {"kv": kv, "q": q, "mode": mode, **dict(zip(keys, work, strict=False)), **extra}


FAMILIES = [
    _family("fp8", "fp8_static", "nonpersistent", num_kv_splits=2),
    _family("fp8", "fp8_dynamic", "nonpersistent", num_kv_splits=1),
    _family("bf16", "bf16", "nonpersistent", num_kv_splits=4),
    _family("fp8", "fp8_static", "persistent", False, True, 8, 16),
    _family("fp8", "bf16", "persistent", True, False, -1, 64),
    _family("bf16", "bf16", "persistent", False, False, -1, 16),
    # stage 1 and the reduction called directly, over the work lists of the three builders
    _family("fp8", "fp8_static", "direct", False, True, 8, 16),
    _family("fp8", "bf16", "direct", True, False, 2, 32),
    _family("bf16", "bf16", "direct", False, False, -1, 16),
    # 0.1.20+ only (the 0.1.11 fake refuses them at build, naming what to install)
    _family("fp8", "fp8_dynamic", "persistent", True, False, 2, 16, opus=True),
    _family("fp8", "bf16", "gluon"),
    _family("bf16", "bf16", "gluon"),
]


@pytest.mark.parametrize("params", FAMILIES,
                         ids=lambda p: f"{p['mode']}-{p['q']}-{p['kv']}{'-opus' if p.get('opus') else ''}")
def test_each_variant_family_builds_and_matches_the_reference(aiter, data, params, monkeypatch):
    variant = Variant.make("aiter", **params)
    if params["q"] == "fp8_static":
        calibration = problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=11, device="cpu")
        variant = variant.with_params(q_amax=float(calibration[0].abs().amax()))
    new_only = "OPUS" if params.get("opus") else "Gluon" if params["mode"] == "gluon" else None
    if new_only and not is_new(aiter):
        with pytest.raises(ValueError, match=rf"this AITER has no {new_only}.*0\.1\.(20|18)\+"):
            aiter_mla.build(variant, SHAPE, "cpu")
        return
    monkeypatch.setenv("AITER_MLA_USE_OPUS", "1")  # the runner pins it per call, whatever is set
    runner = aiter_mla.build(variant, SHAPE, "cpu")
    out = runner(*data[:4])
    assert aiter._state.last_call.get("stage1", "asm" if params["mode"] != "gluon" else None) == (
        "opus" if params.get("opus") else "asm" if params["mode"] != "gluon" else None)
    assert out.shape == (SHAPE.batch, 16, 512) and out.dtype == torch.bfloat16
    result = problem.check(out, expected_output(data, variant), STRICT)
    assert result.passed, result.reason
    assert aiter._state.last_call["mode"] == ("persistent" if params["mode"] == "direct" else params["mode"])
    if params["mode"] == "direct":
        assert aiter._state.last_call["entry"] == "mla_decode_stage1_asm_fwd" and aiter._state.last_call["reduced"]
        assert aiter._state.calls["mla_decode_fwd"] == 0
    again = runner(*data[:4])
    assert again.data_ptr() == out.data_ptr()  # the runner's own buffer, reused


def test_torch_quantizers_stand_in_for_missing_aiter_ones(aiter, monkeypatch, data):
    dynamic = BF16_NP.with_params(kv="fp8", q="fp8_dynamic", num_kv_splits=2)
    static = dynamic.with_params(q="fp8_static", q_amax=float(data[0].abs().amax()) * 1.1)
    variants = {"fp8_dynamic": dynamic, "fp8_static": static}
    results = {q: aiter_mla.build(v, SHAPE, "cpu")(*data[:4]).clone() for q, v in variants.items()}
    monkeypatch.delattr(aiter, "static_per_tensor_quant")
    monkeypatch.delattr(aiter, "dynamic_per_tensor_quant")
    calls_before = dict(aiter._state.calls)
    for q_mode, vendor_out in results.items():
        torch_out = aiter_mla.build(variants[q_mode], SHAPE, "cpu")(*data[:4])
        assert torch.equal(torch_out, vendor_out), q_mode
    assert aiter._state.calls["static_per_tensor_quant"] == calls_before["static_per_tensor_quant"]


def test_fake_refuses_what_aiter_refuses_or_would_misread_and_passes_the_right_calls(aiter, data):
    decode, bf16 = aiter.mla.mla_decode_fwd, torch.bfloat16
    args, kwargs = direct_call_args(data)
    call = dict(kwargs, sm_scale=SM_SCALE)
    # before v0.1.10.post2 sm_scale followed max_seqlen_q; now that slot is page_size
    old_call = [*args, *kwargs.values(), SM_SCALE]
    strided_o = torch.empty((SHAPE.batch, 512, 16), dtype=bf16).transpose(1, 2)
    wide = torch.zeros((SHAPE.total_kv, 1, 1, 1152), dtype=bf16)
    wide[..., :576] = args[1]  # same values, rows 1152 apart
    qo, kvp, last = kwargs["qo_indptr"], kwargs["kv_indptr"], kwargs["kv_last_page_lens"]
    intra = dict(fast_mode=False, intra_batch_mode=True)
    work = work_buffers(aiter, SHAPE.batch, bf16, bf16, num_kv_splits=2, **intra)
    buffers = fill_work(aiter, qo, kvp, last, work, max_split_per_batch=1, **intra)
    long_kvp = torch.arange(SHAPE.batch + 1, dtype=torch.int32) * 2048  # 2048 // 196 = 10 splits
    fp8_q, q_scale = problem.quantize_fp8(data[0])
    kv8, kv_scale = data[1]["fp8"]
    fp8_args, _ = direct_call_args(data, q=fp8_q, kv=kv8)
    scales = dict(q_scale=q_scale, kv_scale=kv_scale)

    def splits(n):
        indptr = torch.arange(SHAPE.batch + 1, dtype=torch.int32) * n
        return dict(num_kv_splits=n, num_kv_splits_indptr=indptr)

    def with_(**changes):  # a call with other leading tensors or index dtypes, and no sm_scale
        changed, more = direct_call_args(data, **changes)
        return lambda **extra: decode(*changed, **more, **extra)

    refused = [
        (RuntimeError, "must be int32", lambda: with_(index_dtype=torch.int64)(sm_scale=SM_SCALE)),
        # the fake refuses the old positional call outright (the keyword rule); what AITER itself
        # does with it: page_size = sm_scale, which its checks refuse
        (RuntimeError, "page_size", lambda: inspect.unwrap(decode)(*old_call)),
        (RuntimeError, "o must be dense", lambda: decode(args[0], args[1], strided_o, **call)),
        (RuntimeError, "kv_buffer's inner dims must be dense",
         lambda: decode(args[0], wide[..., :576], args[2], **call)),
        # work buffers sized for 2 splits, asked for 8
        (RuntimeError, "builder writes",
         lambda: fill_work(aiter, qo, long_kvp, last, work, max_split_per_batch=8, **intra)),
        (RuntimeError, "never pass num_kv_splits_indptr",
         lambda: decode(*args, **call, num_kv_splits_indptr=qo, **buffers)),
        (RuntimeError, "swapped", lambda: decode(
            *args, **call, **dict(buffers, work_indptr=work[2], work_info_set=work[1]))),
        (RuntimeError, r"num_kv_splits=3 is past what stage 2 reads at kv_len 256 \(1..2\)",
         lambda: decode(*fp8_args, **call, **scales, **splits(3))),
        # bf16 q: 64 tokens per split
        (RuntimeError, r"\(1..4\)", lambda: decode(*args, **call, **splits(5))),
        # dtype pairs AITER has no kernel for: fp8 q x bf16 KV, bf16 q x fp8 KV
        (RuntimeError, "no nonpersistent MLA decode kernel",
         lambda: with_(q=fp8_q)(q_scale=q_scale, kv_scale=q_scale)),
        (RuntimeError, "no nonpersistent MLA decode kernel",
         lambda: with_(kv=kv8)(kv_scale=kv_scale)),
    ]
    for error, message, refused_call in refused:
        with pytest.raises(error, match=message):
            refused_call()
    # the right calls pass
    decode(*args, **call)
    decode(*args, **call, **buffers)
    decode(*fp8_args, **call, **scales, **splits(2))


@pytest.mark.parametrize("version", ["0.1.dev123", "0.1.21.dev4+g1234", "0.1.20+rocm7.0", None])
def test_the_gate_takes_any_version_string_when_the_signatures_are_there(aiter, monkeypatch, version):
    """Builds from AITER's main say 0.1.devN (no tag on main before 0.1.12.post1) or
    0.1.21.devN; AMD's wheels say 0.1.20+rocm...; a copied tree may say nothing."""
    if version is None:
        monkeypatch.delattr(sys.modules["aiter._version"], "__version__")
        monkeypatch.delattr(aiter, "__version__")
        monkeypatch.setattr(aiter_mla, "_ai_version", lambda _module: None)  # and no distribution
    else:
        monkeypatch.setattr(sys.modules["aiter._version"], "__version__", version)
    verified = version == "0.1.20+rocm7.0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert aiter_mla.unavailable_reason() is None
        aiter_mla.build(BF16_NP, SHAPE, "cpu")
    texts = [str(w.message) for w in caught]
    if verified:
        assert texts == []
    else:
        shown = f"AITER {version}" if version else "AITER (no readable version)"
        assert texts and all(t.startswith(f"{shown} is not among the releases whose MLA API was read "
                                          "(0.1.10.post2 to 0.1.20.post1)") for t in texts)


def _decode_v0_1_7(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                   sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None,
                   work_meta_data=None, work_indptr=None, work_info_set=None, reduce_indptr=None,
                   reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None):
    raise AssertionError("never called: the gate refuses this AITER")


def test_the_gate_refuses_a_missing_feature_naming_it_and_what_to_install(aiter, monkeypatch):
    # PyPI's amd-aiter 0.1.7.post2.dev18: no page_size / nhead_kv / intra_batch_mode
    monkeypatch.setattr(aiter.mla, "mla_decode_fwd", _decode_v0_1_7)
    monkeypatch.setattr(sys.modules["aiter._version"], "__version__", "0.1.7.post2.dev18")
    reason = aiter_mla.unavailable_reason()
    assert reason == ("AITER 0.1.7.post2.dev18 lacks what mla-tune calls: mla_decode_fwd(page_size, nhead_kv, "
                      "intra_batch_mode); install amd-aiter 0.1.10.post2 or later, a ROCm build from AMD's "
                      "wheel index or from source (docs/amd.md); where AITER cannot change (a contest's "
                      "runner), export without it: mla-tune export --only triton,torch.")
    with pytest.raises(ValueError, match=r"lacks what mla-tune calls: mla_decode_fwd\(page_size"):
        aiter_mla.build(BF16_NP, SHAPE, "cpu")
    monkeypatch.delattr(aiter, "get_mla_metadata_v1")
    assert "get_mla_metadata_v1 (absent or unreadable)" in aiter_mla.unavailable_reason()


def test_binary_eras_and_the_drift_note():
    """The note in a table's version warning: tests/test_capabilities.py."""
    era = aiter_mla.aiter_binary_era
    assert [era(v) for v in ("0.1.11", "0.1.12", "0.1.16.post3", "0.1.17", "0.1.19.post1", "0.1.19.post2",
                             "0.1.20+rocm7.0", "0.1.21.dev4+g1234")] == [0, 1, 2, 3, 3, 4, 4, 4]
    # a dev build next to a change, or no version at all, cannot be placed
    assert era("0.1.12.dev5+gabc") is None and era("0.1.dev123") is None and era(None) is None
    assert era("0.1.18.dev2") == 3  # between 0.1.17 and 0.1.18: no change there
    note = aiter_mla.aiter_drift_note
    assert note("0.1.17", "0.1.18") == ""
    assert note("0.1.11", "0.1.20.post1") == "AITER's kernel binaries differ between these builds; "
    assert note("0.1.dev123", "0.1.20").startswith("cannot tell whether AITER's kernel binaries differ")


def _package(root: Path, version_line: str) -> Path:
    (root / "aiter").mkdir(parents=True)
    (root / "aiter" / "__init__.py").write_text("")
    (root / "aiter" / "_version.py").write_text(version_line)
    return root


def test_without_aiter_imported_the_reason_is_one_sentence_and_provenance_finds_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # makes `import aiter` raise ImportError
    reason = aiter_mla.unavailable_reason()
    assert reason.startswith("AITER cannot be imported") and reason.endswith(".")  # one sentence
    monkeypatch.delitem(sys.modules, "aiter")
    scm = _package(tmp_path / "scm", "__version__ = '0.1.21.dev4+g1234abc.d20260901'\n")
    monkeypatch.syspath_prepend(str(scm))
    assert aiter_mla.aiter_provenance() == {
        "amd-aiter": "0.1.21.dev4+g1234abc.d20260901", "amd-aiter-commit": "1234abc",
        "amd-aiter-persistent-gate": "bypassed (persistent calls pass num_kv_splits)"}
    assert "aiter" not in sys.modules  # found, not imported
    # a source checkout: the commit from the .git next to the package (a branch, packed)
    tree = _package(tmp_path / "tree", "__version__ = '0.1.dev123'\n")
    (tree / ".git" / "refs").mkdir(parents=True)
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    sha = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
    (tree / ".git" / "packed-refs").write_text(f"# pack-refs\n{sha} refs/heads/main\n")
    monkeypatch.syspath_prepend(str(tree))
    assert aiter_mla.aiter_provenance() == {
        "amd-aiter": "0.1.dev123", "amd-aiter-commit": sha,
        "amd-aiter-persistent-gate": "unknown build (persistent calls pass num_kv_splits where AITER has "
                                     "get_mla_decode_fwd_max_splits)"}
    versions = gpu.software_versions()
    assert versions["amd-aiter"] == "0.1.dev123" and versions["amd-aiter-commit"] == sha


def test_build_refuses_bad_variants_and_scales_before_touching_aiter_and_runners_other_shapes(aiter, data):
    for q, splits, message in (("fp8_static", 1, "q_amax"), ("bf16", 1, "no nonpersistent kernel"),
                               ("fp8_dynamic", 4, "num_kv_splits must be an int in 1..2")):  # 256 / 128
        with pytest.raises(ValueError, match=message):
            aiter_mla.build(BF16_NP.with_params(kv="fp8", q=q, num_kv_splits=splits), SHAPE, "cpu")
    for bad in (0.0, -1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="sm_scale must be a positive finite float"):
            aiter_mla.build(BF16_NP, SHAPE, "cpu", sm_scale=bad)
    assert aiter._state.calls["mla_decode_fwd"] == 0
    assert isinstance(aiter_mla._ai_sm_scale(1), float)  # AITER's ops refuse an int
    runner = aiter_mla.build(BF16_NP, Shape(2, 256), "cpu")
    with pytest.raises(ValueError, match="built for 2x256"):  # a runner refuses another shape
        runner(*data[:4])


def _mi355x_candidates(shape, platform):
    space = load_config(REPO / "configs" / "mi355x.yaml").backends["aiter"]
    return list(dict.fromkeys(v for grid in expand_space(space)
                              for v in aiter_mla.candidates(shape, grid, platform)))


def test_candidates_come_only_on_a_hip_platform_and_direct_ones_where_aiter_has_the_ops(aiter, monkeypatch):
    shape = Shape(4, 1024)
    assert _mi355x_candidates(shape, gpu.fake_platform("H200")) == []
    variants = _mi355x_candidates(shape, MI355X)
    assert len(variants) == len(set(variants)) > 20
    for v in variants:
        assert v.get("kv") in ("bf16", "fp8") and v.get("q") in ("bf16", "fp8_dynamic", "fp8_static")
        assert not (v.get("q") != "bf16" and v.get("kv") == "bf16")
        if v.get("mode") == "nonpersistent":
            assert (v.get("q") == "bf16") == (v.get("kv") == "bf16")
            assert v.get("num_kv_splits") <= (8 if v.get("q") != "bf16" else 16)
        aiter_mla._ai_validate(v.with_params(q_amax=4.0) if v.get("q") == "fp8_static" else v, shape)
    modes = {v.get("mode") for v in variants}
    # Gluon and OPUS only where the installed AITER has them (0.1.20.post1's fake does)
    assert modes == ({"nonpersistent", "persistent", "gluon"} if is_new(aiter) else {"nonpersistent", "persistent"})
    opus = [v for v in variants if v.get("opus")]
    assert bool(opus) == is_new(aiter) and all(v.get("q") != "bf16" and v.get("kv") == "fp8" for v in opus)
    mi300 = _mi355x_candidates(shape, gpu.fake_platform("MI300X"))
    assert all(v.get("max_split_per_batch") >= 16 for v in mi300 if v.get("intra_batch"))
    assert not any(v.get("mode") == "gluon" or v.get("opus") for v in mi300)  # gfx950 only
    # direct mode where the AITER has stage 1 and mla_reduce_v1
    space = {"mode": ["direct"], "kv": ["fp8", "bf16"], "q": ["fp8_static", "bf16"], "max_split_per_batch": [1, 4],
             "fast_mode": [False, True], "intra_batch": [True]}
    variants = aiter_mla.candidates(Shape(32, 1024), space, MI355X)
    assert variants and {v.get("mode") for v in variants} == {"direct"}
    assert {(v.get("q"), v.get("kv")) for v in variants} == {("fp8_static", "fp8"), ("bf16", "fp8"), ("bf16", "bf16")}
    assert not any("opus" in v.p for v in variants)
    for v in variants:
        aiter_mla._ai_validate(v.with_params(q_amax=4.0) if v.get("q") == "fp8_static" else v, Shape(32, 1024))
    monkeypatch.delattr(aiter, "mla_reduce_v1")
    assert aiter_mla.candidates(Shape(32, 1024), space, MI355X) == []
    with pytest.raises(ValueError, match="opus is not a parameter of mode=direct"):
        aiter_mla.validate(Variant.make("aiter", kv="fp8", q="fp8_dynamic", opus=True, **DIRECT))
    with pytest.raises(ValueError, match="direct mode passes"):
        aiter_mla.build(BF16_DIRECT, SHAPE, "cpu")


@pytest.mark.parametrize("shape", [Shape(4, 8192), Shape(32, 1024), Shape(64, 8192), Shape(256, 1024)], ids=str)
def test_persistent_caps_are_offered_once_per_distinct_metadata(aiter, shape):
    """Two candidates whose work lists would be identical are never both offered, and the
    caps that change the work at this shape are all there."""
    variants = [v for v in _mi355x_candidates(shape, MI355X) if v.get("mode") == "persistent"]
    cu = 256
    keys = {}
    for v in variants:
        cap, batch = v.get("max_split_per_batch"), shape.batch
        work = (("fast", "auto" if cap == -1 else min(cu, cap * batch)) if v.get("fast_mode")
                else ("intra", min(shape.kv_len // 196, -(-cu // batch), cap)))
        key = (v.get("kv"), v.get("q"), v.get("opus", False), v.get("kv_granularity"), work)
        assert key not in keys, f"{v} duplicates {keys[key]}"
        keys[key] = v
    intra = {k[-1][1] for k in keys if k[-1][0] == "intra" and k[:3] == ("fp8", "fp8_static", False)}
    fast = {k[-1][1] for k in keys if k[-1][0] == "fast" and k[:3] == ("fp8", "fp8_static", False)}
    expected_intra = {min(shape.kv_len // 196, -(-cu // shape.batch), c) for c in (1, 2, 4, 16)}
    expected_fast = {"auto"} | {min(cu, c * shape.batch) for c in (1, 2, 4, 16)}
    assert intra == expected_intra and fast == expected_fast


def test_a_worker_subprocess_sees_the_fake_through_subprocess_env():
    """The runner's build by its commit (the alias); 0.1.11 and 0.1.20.post1 reach the sweep's
    workers in test_end_to_end."""
    env = vendor_fakes.subprocess_env("aiter", cu_num=304, arch="gfx942") | {"MLA_TUNE_FAKE_AITER_VERSION": "f3be04a12"}
    code = ("import aiter; from mla_tune.backends import aiter_mla; "
            "print(aiter.__version__, aiter._state.cu_num, aiter._state.arch, aiter_mla.unavailable_reason())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [F3BE04A12, "304", "gfx942", "None"]


# ------------------------------------------------------- what the fake enforces
def test_fake_fp8_follows_the_arch(monkeypatch):
    fake = install(monkeypatch, "0.1.20.post1", arch="gfx942", cu_num=304)
    assert fake.dtypes.fp8 is torch.float8_e4m3fnuz
    x, scale = torch.ones(4, dtype=torch.bfloat16), torch.ones(1)
    with pytest.raises(RuntimeError, match="not support output type: torch.float8_e4m3fn"):
        fake.static_per_tensor_quant(torch.empty(4, dtype=torch.float8_e4m3fn), x, scale)
    out = torch.empty(4, dtype=torch.float8_e4m3fnuz)
    fake.static_per_tensor_quant(out, x, scale)
    assert out.float().tolist() == [1.0] * 4
    aiter_mla.build(BF16_NP, SHAPE, "cpu")  # the backend builds on gfx942's fp8


def test_the_mi355x_config_follows_gfx950_facts_and_plans_a_modest_sweep(aiter):
    """configs/mi355x.yaml: no kpack (Triton forces 1 on gfx950), 16x16 MFMA only, AITER's
    336 candidates (plus Gluon and OPUS where the AITER has them), and a header comment that
    states the plan this test computes."""
    config = load_config(REPO / "configs" / "mi355x.yaml")
    counts = {}
    for name, space in config.backends.items():
        backend = get_backend(name)
        per_shape = [set(v for grid in expand_space(space) for v in backend.candidates(shape, grid, MI355X))
                     for shape in config.shapes]
        counts[name] = sum(len(s) for s in per_shape)
        if name == "triton":
            for variant in set().union(*per_shape):
                assert "kpack" not in variant.p and variant.get("matrix_instr_nonkdim") == 16
    extra = 16 + 56 if is_new(aiter) else 0  # Gluon and OPUS where the AITER has them
    assert counts["aiter"] == 336 + extra and counts["torch"] == 8
    assert set(counts) == {"torch", "triton", "aiter"}
    comment = (REPO / "configs" / "mi355x.yaml").read_text()
    base = counts["triton"] + 336 + 8
    assert f"{counts['triton']} Triton" in comment and "336 AITER" in comment and "8 torch" in comment
    assert f"{base} candidates" in comment and f"({base + 16 + 56})" in comment


# ------------------------------------------------------------------ the keyword rule
# The AITER callables aiter_mla.py calls, and the arguments it may pass them positionally
# (the quant ops are pybind functions without argument names: positional only).
_BACKEND_LEADING = {"mla_decode_fwd": 3, "mla_gluon": 4, "get_mla_metadata_v1": 2, "get_mla_metadata_info_v1": 0,
                    "get_mla_decode_fwd_max_splits": 0, "stage1_op": 2, "reduce_op": 2, "vendor": 3}


def test_the_backend_passes_everything_past_the_leading_tensors_by_keyword():
    """An AST check of every call aiter_mla.py makes into AITER (the fakes refuse at call time)."""
    tree = ast.parse((REPO / "mla_tune" / "backends" / "aiter_mla.py").read_text())
    seen = set()
    for node in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in _BACKEND_LEADING:
            seen.add(name)
            positional = [a for a in node.args if not isinstance(a, ast.Starred)]
            assert len(positional) == len(node.args), f"line {node.lineno}: *args into {name}"
            assert len(positional) <= _BACKEND_LEADING[name], (
                f"line {node.lineno}: {name} gets {len(positional)} positional arguments")
    assert seen == set(_BACKEND_LEADING)


# ------------------------------------------------------------------ the direct mode
@pytest.mark.parametrize("mode, calls", [
    ("persistent", {"mla_decode_fwd": 3}),
    ("direct", {"mla_decode_fwd": 0, "mla_decode_stage1_asm_fwd": 3, "mla_reduce_v1": 3}),
], ids=["persistent", "direct"])
def test_the_work_list_is_built_once_in_build_and_direct_partials_are_known(aiter, data, mode, calls):
    params = dict(DIRECT, mode=mode, max_split_per_batch=16 if mode == "persistent" else 4)
    variant = Variant.make("aiter", kv="fp8", q="fp8_dynamic", **params)
    runner = aiter_mla.build(variant, SHAPE, "cpu")
    assert aiter._state.calls["get_mla_metadata_v1"] == 1
    outs = [runner(*data[:4]).data_ptr() for _ in range(3)]
    assert {name: aiter._state.calls[name] for name in calls} == calls
    assert aiter._state.calls["get_mla_metadata_v1"] == 1 and len(set(outs)) == 1  # one output buffer
    assert aiter._state.calls["dynamic_per_tensor_quant"] == 3  # amax recomputed every call
    if mode == "persistent":
        return
    assert len(aiter._state.partials) == 1  # one partial buffer, reused
    # the fake's reduction refuses partials stage 1 did not write (it knows them by address)
    other = torch.zeros((64, 1, 16, 512))
    extra = {"num_kv_splits": 256} if is_new(aiter) else {}
    assert next(iter(aiter._state.metadata.values()))["reduce"]  # the work list's reduce buffers are recorded
    with pytest.raises(RuntimeError, match="not written by mla_decode_stage1_asm_fwd"):
        aiter.mla_reduce_v1(
            other, torch.zeros((64, 1, 16, 1)), reduce_indptr=torch.zeros(4, dtype=torch.int32),
            reduce_final_map=None, reduce_partial_map=torch.zeros(4, dtype=torch.int32),
            max_seqlen_q=1, final_output=torch.empty((3, 16, 512), dtype=torch.bfloat16), **extra)


def test_direct_mode_reads_the_op_schema_and_passes_lse_and_the_split_bound_only_where_they_exist(
        aiter, data, monkeypatch):
    """AITER's compile_ops ops show (*args, **kwargs) to inspect.signature (no functools.wraps);
    their names are in the schema AITER registers from the stub (torch.library.infer_schema)."""
    schemas, seen = {}, {}

    def opaque(name, real):
        def wrapper_custom(*args, **kwargs):
            seen[name] = (len(args), dict(kwargs))
            return real(*args, **kwargs)

        return wrapper_custom

    for name in ("mla_decode_stage1_asm_fwd", "mla_reduce_v1"):
        real = getattr(aiter, name)
        text = torch.library.infer_schema(inspect.unwrap(real), mutates_args="unknown")
        schemas[name] = types.SimpleNamespace(default=types.SimpleNamespace(
            _schema=torch._C.parse_schema(f"aiter::{name}{text}")))
        monkeypatch.setattr(aiter, name, opaque(name, real))
    assert aiter_mla._ai_features(aiter)["direct"] is False  # nothing to read: not offered
    monkeypatch.setattr(torch.ops, "aiter", types.SimpleNamespace(**schemas), raising=False)
    features = aiter_mla._ai_features(aiter)
    assert features["direct"] is True and features["direct_lse"] == is_new(aiter)
    out = aiter_mla.build(BF16_DIRECT, SHAPE, "cpu")(*data[:4])
    (n1, stage1), (n2, reduce) = seen["mla_decode_stage1_asm_fwd"], seen["mla_reduce_v1"]
    assert n1 == n2 == 2
    assert ("lse" in stage1) == is_new(aiter) and stage1.get("lse") is None and stage1["q_scale"] is None
    assert reduce.get("num_kv_splits") == (256 if is_new(aiter) else None)  # get_mla_decode_fwd_max_splits
    assert _matches(out, data)


# ------------------------------------------------------------------ the softmax scale
_SCALED = [BF16_NP.with_params(num_kv_splits=2), BF16_PERSISTENT, BF16_DIRECT,
           Variant.make("aiter", kv="bf16", q="bf16", mode="gluon")]


@pytest.mark.parametrize("variant", _SCALED, ids=lambda v: v.get("mode"))
def test_the_softmax_scale_reaches_every_aiter_call(aiter, data, variant):
    if variant.get("mode") == "gluon" and not is_new(aiter):
        pytest.skip("AITER's Gluon decode is 0.1.18+ (the 0.1.20.post1 fake)")
    scale = 0.19  # far from 1/sqrt(576) = 0.0417: the scores change markedly
    default = aiter_mla.build(variant, SHAPE, "cpu")(*data[:4]).float().clone()
    scaled = aiter_mla.build(variant, SHAPE, "cpu", sm_scale=scale)(*data[:4]).float()
    assert (scaled - default).abs().max() > 0.05
    assert _matches(default, data) and _matches(scaled, data, scale)
    if variant.get("mode") == "nonpersistent":  # the serving call takes the spec's
        spec = CallSpec("bf16", sm_scale=scale)
        runner = aiter_mla.build_serving(aiter_mla.default_serving_variant(spec, MI355X), spec, "cpu")
        qo = torch.arange(SHAPE.batch + 1, dtype=torch.int32)
        assert _matches(runner(data[0], qo, data[1]["bf16"], None, kv_indptr=qo * SHAPE.kv_len), data, scale)


# ------------------------------------------------------------------ the #4144 gate
@pytest.mark.parametrize("release, cap, batch", [
    ("0.1.11", None, 32), ("f3be04a12", "1", 32), ("0.1.20.post1", None, 32),
    ("0.1.20.post1", "4", 4), ("0.1.20.post1", "0", 4),
], ids=["v0.1.11", "contest-build-has-no-gate", "newer-gates-at-32", "newer-gates-at-4",
        "newer-gate-off"])
def test_each_builds_persistent_gate_and_the_backend_stays_persistent(monkeypatch, release, cap, batch):
    """0.1.18+: a bf16 persistent call at batch >= AITER_MLA_DECODE_PERSISTENT_MAX_BATCH
    (default 32, <= 0 off) that leaves num_kv_splits to AITER runs non-persistent; the backend
    passes get_mla_decode_fwd_max_splits and stays persistent, and refuses to build without it."""
    if cap is not None:  # "1": every batch on 0.1.18+
        monkeypatch.setenv("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH", cap)
    fake = install(monkeypatch, release)
    gated = release == "0.1.20.post1"
    assert aiter_mla.aiter_persistent_gate(fake.__version__) == (
        "bypassed (persistent calls pass num_kv_splits)" if gated else "absent (before 0.1.18)")
    shape = Shape(batch, 200)
    case = problem.generate_input(shape.batch, shape.kv_len, seed=3, device="cpu")
    out = aiter_mla.build(BF16_PERSISTENT, shape, "cpu")(*case[:4])
    assert fake._state.last_call["mode"] == "persistent"
    assert fake._state.last_call["num_kv_splits"] == (256 if gated else None)
    result = problem.check(out, expected_output(case, BF16_PERSISTENT), STRICT)
    assert result.passed, result.reason
    if not gated:
        return
    # a work list handed over without num_kv_splits: gated at the cap, never where it is 0
    args, kwargs = direct_call_args(case)
    work = work_buffers(fake, shape.batch, torch.bfloat16, torch.bfloat16)
    qo, kvp, last = kwargs["qo_indptr"], kwargs["kv_indptr"], kwargs["kv_last_page_lens"]
    call = dict(kwargs, sm_scale=SM_SCALE, **fill_work(fake, qo, kvp, last, work))
    fake.mla.mla_decode_fwd(*args, **call)
    assert fake._state.last_call["mode"] == ("persistent" if cap == "0" else "nonpersistent")
    with pytest.raises(RuntimeError, match="num_kv_splits=8 is below the splits the metadata"):
        fake.mla.mla_decode_fwd(*args, **call, num_kv_splits=8)
    # without get_mla_decode_fwd_max_splits the backend cannot keep it persistent: refused
    monkeypatch.delattr(fake, "get_mla_decode_fwd_max_splits")
    with pytest.raises(ValueError, match="#4144.*use mode direct"):
        aiter_mla.build(BF16_PERSISTENT, shape, "cpu")
