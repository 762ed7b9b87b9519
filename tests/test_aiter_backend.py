"""The AITER backend on the CPU through tests/fakes/aiter: the `aiter` fixture runs a test under
the fakes of v0.1.11, f3be04a12 (the contest runner's build) and v0.1.20.post1, which refuse
arguments past the leading tensors passed by position (the keyword rule)."""

import inspect
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from mla_tune import gpu, problem, runtime
from mla_tune.backends import aiter_mla
from mla_tune.core import SM_SCALE, Shape, Variant
from mla_tune.tune.config import expand_space, load_config
from tests import aiter_helpers
from tests.aiter_helpers import BF16_NP, BF16_PERSISTENT, SHAPE, direct_call_args, install, is_new
from tests.helpers import REPO, expected_output, vendor_fakes

aiter = aiter_helpers.aiter  # the fixture: each test runs under every faked release
STRICT = problem.RULES["strict"]


@pytest.fixture
def data():
    return problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=7, device="cpu")


# Parameter lists of ROCm/aiter v0.1.11 and f3be04a12a (aiter/mla.py, aiter/ops/attention.py).
_V0111_DECODE = [
    "q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q",
    ("page_size", 1), ("nhead_kv", 1), ("sm_scale", None), ("logit_cap", 0.0), ("num_kv_splits", None),
    ("num_kv_splits_indptr", None), ("work_meta_data", None), ("work_indptr", None), ("work_info_set", None),
    ("reduce_indptr", None), ("reduce_final_map", None), ("reduce_partial_map", None), ("q_scale", None),
    ("kv_scale", None), ("intra_batch_mode", False), ("return_logits", False), ("return_lse", False),
]
_V01120_DECODE = _V0111_DECODE + [("g_kv_indptr", None), ("cp_world_size", 1), ("cp_rank", 0), ("causal", True)]
_V0111_INFO = [
    "batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype", "is_sparse",
    ("fast_mode", True), ("num_kv_splits", 32), ("intra_batch_mode", False),
]
_V01120_INFO = _V0111_INFO + [("max_split_per_batch", -1)]
_V0111_BUILDER = [
    "seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k", "num_heads_k",
    "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr", "reduce_indptr", "reduce_final_map",
    "reduce_partial_map", ("page_size", 1), ("kv_granularity", 16), ("max_seqlen_qo", -1),
    ("uni_seqlen_qo", -1), ("fast_mode", True), ("topk", -1), ("max_split_per_batch", -1),
    ("intra_batch_mode", False), ("dtype_q", None), ("dtype_kv", None),
]
# v0.1.20.post1 inserts these before the legacy dtype_q / dtype_kv aliases
_V01120_BUILDER = _V0111_BUILDER[:-2] + [
    ("is_cp_round_robin", False), ("mla_version", 0), ("dtype_q_nope", None), ("dtype_q_rope", None),
    ("dtype_kv_nope", None), ("dtype_kv_rope", None), ("dtype_q", None), ("dtype_kv", None),
]
# The two ops under mla_decode_fwd's persistent path (compile_ops stubs; their pybind
# declarations in csrc/include/rocm_ops.hpp name the same arguments)
_V0111_STAGE1 = [
    "Q", "KV", "qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_lens", "num_kv_splits_indptr",
    "work_meta_data", "work_indptr", "work_info_set", "max_seqlen_q", "page_size", "nhead_kv", "softmax_scale",
    "splitData", "splitLse", "output", ("q_scale", None), ("kv_scale", None),
]
# v0.1.20.post1: `lse` between output and q_scale (a positional q_scale lands in lse), then
# context parallelism, gfx1250 scratch and `causal`
_V01120_STAGE1 = _V0111_STAGE1[:17] + [
    ("lse", None), ("q_scale", None), ("kv_scale", None), ("g_kv_indptr", None), ("cp_world_size", 1),
    ("cp_rank", 0), ("valid_split_count", None), ("use_valid_split_count_reduce", 0), ("causal", True),
]
_V0111_REDUCE = ["partial_output", "partial_lse", "reduce_indptr", "reduce_final_map", "reduce_partial_map",
                 "max_seqlen_q", "final_output", ("final_lse", None)]
_V01120_REDUCE = _V0111_REDUCE[:6] + ["num_kv_splits"] + _V0111_REDUCE[6:]  # required, before final_output
_OLD = (_V0111_DECODE, _V0111_INFO, _V0111_BUILDER, _V0111_STAGE1, _V0111_REDUCE)
_SIGNATURES = {"0.1.11": _OLD, aiter_helpers.F3BE04A12: _OLD,
               "0.1.20.post1": (_V01120_DECODE, _V01120_INFO, _V01120_BUILDER, _V01120_STAGE1, _V01120_REDUCE)}


def _expected(spec):
    empty = inspect.Parameter.empty
    return [(s, "POSITIONAL_OR_KEYWORD", empty) if isinstance(s, str) else (s[0], "POSITIONAL_OR_KEYWORD", s[1])
            for s in spec]


def test_fake_has_the_signatures_of_its_release_and_the_backend_reads_them(aiter):
    entries = (aiter.mla.mla_decode_fwd, aiter.get_mla_metadata_info_v1, aiter.get_mla_metadata_v1,
               aiter.mla_decode_stage1_asm_fwd, aiter.mla_reduce_v1)
    for entry, spec in zip(entries, _SIGNATURES[aiter.__version__], strict=True):
        got = [(p.name, p.kind.name, p.default) for p in inspect.signature(entry).parameters.values()]
        assert got == _expected(spec), entry.__name__
    # pybind ops declared without py::arg names take positional arguments only
    for op in (aiter.static_per_tensor_quant, aiter.dynamic_per_tensor_quant):
        assert {p.kind.name for p in inspect.signature(op).parameters.values()} == {"POSITIONAL_ONLY"}
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
_NEW_ONLY = {"opus", "gluon"}


@pytest.mark.parametrize("params", FAMILIES,
                         ids=lambda p: f"{p['mode']}-{p['q']}-{p['kv']}{'-opus' if p.get('opus') else ''}")
def test_each_variant_family_builds_and_matches_the_reference(aiter, data, params, monkeypatch):
    variant = Variant.make("aiter", **params)
    if params["q"] == "fp8_static":
        calibration = problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=11, device="cpu")
        variant = variant.with_params(q_amax=float(calibration[0].abs().amax()))
    new_only = "opus" if params.get("opus") else params["mode"] if params["mode"] in _NEW_ONLY else None
    if new_only and not is_new(aiter):
        with pytest.raises(ValueError, match=rf"this AITER has no {'OPUS' if new_only == 'opus' else 'Gluon'}.*0\.1\.(20|18)\+"):
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


def test_fake_rejects_int64_indices_old_positional_calls_strided_buffers_and_bad_work_lists(aiter, data):
    args, kwargs = direct_call_args(data, index_dtype=torch.int64)
    with pytest.raises(RuntimeError, match="must be int32"):
        aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE)
    # before v0.1.10.post2 sm_scale followed max_seqlen_q; now that slot is page_size, and the
    # fake refuses the positional call outright (kwargs are in mla_decode_fwd's order)
    args, kwargs = direct_call_args(data)
    old_call = [*args, *kwargs.values(), SM_SCALE]
    with pytest.raises(TypeError, match="mla_decode_fwd: 9 positional arguments; the fake takes q, kv_buffer, o"):
        aiter.mla.mla_decode_fwd(*old_call)
    # what AITER itself does with it: page_size = sm_scale, which its checks refuse
    with pytest.raises(RuntimeError, match="page_size"):
        inspect.unwrap(aiter.mla.mla_decode_fwd)(*old_call)
    with pytest.raises(TypeError):  # the quant ops are pybind functions without argument names
        aiter.static_per_tensor_quant(out=torch.empty(2, dtype=torch.float8_e4m3fn),
                                      input=torch.ones(2, dtype=torch.bfloat16), scale=torch.ones(1))
    aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE)  # the right call passes
    # strided o and kv buffers (args as in the right call)
    args[2] = torch.empty((SHAPE.batch, 512, 16), dtype=torch.bfloat16).transpose(1, 2)
    with pytest.raises(RuntimeError, match="o must be dense"):
        aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE)
    args, kwargs = direct_call_args(data)
    wide = torch.zeros((SHAPE.total_kv, 1, 1, 1152), dtype=torch.bfloat16)
    wide[..., :576] = data[1]["bf16"].view(SHAPE.total_kv, 1, 1, 576)
    args[1] = wide[..., :576]  # same values, rows 1152 apart
    with pytest.raises(RuntimeError, match="kv_buffer's inner dims must be dense"):
        aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE)
    # a split indptr with work_meta_data, undersized and swapped work buffers
    args, kwargs = direct_call_args(data)
    qo, kvp, last = kwargs["qo_indptr"], kwargs["kv_indptr"], kwargs["kv_last_page_lens"]
    bf16 = torch.bfloat16
    work = aiter_helpers.work_buffers(aiter, SHAPE.batch, bf16, bf16, fast_mode=False, num_kv_splits=2, intra_batch_mode=True)
    long_kvp = torch.arange(SHAPE.batch + 1, dtype=torch.int32) * 2048  # 2048 // 196 = 10 splits possible
    with pytest.raises(RuntimeError, match="builder writes"):  # sized for 2 splits, asked for 8
        aiter_helpers.fill_work(aiter, qo, long_kvp, last, work, fast_mode=False, max_split_per_batch=8, intra_batch_mode=True)
    buffers = aiter_helpers.fill_work(aiter, qo, kvp, last, work, fast_mode=False, max_split_per_batch=1, intra_batch_mode=True)
    with pytest.raises(RuntimeError, match="never pass num_kv_splits_indptr"):
        aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE, num_kv_splits_indptr=qo, **buffers)
    swapped = dict(buffers, work_indptr=work[2], work_info_set=work[1])
    with pytest.raises(RuntimeError, match="swapped"):
        aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE, **swapped)
    aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE, **buffers)


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


def test_binary_eras_the_drift_note_and_the_warning_at_table_load():
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
    # a table from another AITER build warns at load, saying so
    table = types.SimpleNamespace(path="tables/MI355X.yaml", gpu="MI355X", provenance={"versions": {
        "torch": "2.9", "amd-aiter": "0.1.11", "amd-aiter-commit": "c4a3ff2a04"}})
    here = types.SimpleNamespace(versions={"torch": "2.9", "amd-aiter": "0.1.20.post1",
                                           "amd-aiter-commit": "de07f3885e"})
    with pytest.warns(UserWarning) as caught:
        runtime._warn_versions(table, here)
    texts = [str(w.message) for w in caught]
    assert any("provenance.versions.amd-aiter is 0.1.11 but this process has 0.1.20.post1; AITER's kernel "
               "binaries differ between these builds" in t for t in texts)
    assert any("provenance.versions.amd-aiter-commit is c4a3ff2a04" in t for t in texts)


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
    assert aiter_mla.aiter_provenance() == {"amd-aiter": "0.1.21.dev4+g1234abc.d20260901",
                                            "amd-aiter-commit": "1234abc",
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


def test_build_refuses_bad_variants_before_touching_aiter_and_runners_other_shapes(aiter, data):
    for q, splits, message in (("fp8_static", 1, "q_amax"), ("bf16", 1, "no nonpersistent kernel"),
                               ("fp8_dynamic", 4, "num_kv_splits must be an int in 1..2")):  # 256 / 128
        with pytest.raises(ValueError, match=message):
            aiter_mla.build(BF16_NP.with_params(kv="fp8", q=q, num_kv_splits=splits), SHAPE, "cpu")
    assert aiter._state.calls["mla_decode_fwd"] == 0
    runner = aiter_mla.build(BF16_NP, Shape(2, 256), "cpu")
    with pytest.raises(ValueError, match="built for 2x256"):  # a runner refuses another shape
        runner(*data[:4])


def _mi355x_candidates(shape, platform):
    space = load_config(REPO / "configs" / "mi355x.yaml").backends["aiter"]
    return list(dict.fromkeys(v for grid in expand_space(space)
                              for v in aiter_mla.candidates(shape, grid, platform)))


def test_candidates_come_only_on_a_hip_platform(aiter):
    shape = Shape(4, 1024)
    assert _mi355x_candidates(shape, gpu.fake_platform("H200")) == []
    variants = _mi355x_candidates(shape, gpu.fake_platform("MI355X"))
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


@pytest.mark.parametrize("shape", [Shape(4, 8192), Shape(32, 1024), Shape(64, 8192), Shape(256, 1024)],
                         ids=str)
def test_persistent_caps_are_offered_once_per_distinct_metadata(aiter, shape):
    """Two candidates whose work lists would be identical are never both offered, and the
    caps that change the work at this shape are all there."""
    variants = [v for v in _mi355x_candidates(shape, gpu.fake_platform("MI355X")) if v.get("mode") == "persistent"]
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


@pytest.mark.parametrize("release", ["0.1.20.post1", "f3be04a12"])  # 0.1.11, the default, runs in test_end_to_end
def test_a_worker_subprocess_sees_the_fake_through_subprocess_env(release):
    env = vendor_fakes.subprocess_env("aiter", cu_num=304, arch="gfx942")
    env["MLA_TUNE_FAKE_AITER_VERSION"] = release  # the runner's build by its commit: the alias
    code = ("import aiter; from mla_tune.backends import aiter_mla; "
            "print(aiter.__version__, aiter._state.cu_num, aiter._state.arch, aiter_mla.unavailable_reason())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [aiter_helpers.F3BE04A12 if release == "f3be04a12" else release, "304", "gfx942", "None"]


# ------------------------------------------------------- what the fake enforces
def test_fake_refuses_kernelless_dtype_pairs_and_splits_past_what_stage_2_reads(aiter, data):
    fp8_q, q_scale = problem.quantize_fp8(data[0])
    kv8, kv_scale = data[1]["fp8"]
    args, kwargs = direct_call_args(data, q=fp8_q, kv=kv8)
    batch = SHAPE.batch

    def splits(n):
        return dict(num_kv_splits=n, num_kv_splits_indptr=torch.arange(batch + 1, dtype=torch.int32) * n)

    with pytest.raises(RuntimeError, match=r"num_kv_splits=3 is past what stage 2 reads at kv_len 256 \(1..2\)"):
        aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE, q_scale=q_scale, kv_scale=kv_scale, **splits(3))
    aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE, q_scale=q_scale, kv_scale=kv_scale, **splits(2))
    with pytest.raises(RuntimeError, match=r"\(1..4\)"):  # bf16 q: 64 tokens per split
        args, kwargs = direct_call_args(data)
        aiter.mla.mla_decode_fwd(*args, **kwargs, sm_scale=SM_SCALE, **splits(5))
    # a dtype pair AITER has no kernel for
    args, kwargs = direct_call_args(data, q=fp8_q)
    with pytest.raises(RuntimeError, match="no nonpersistent MLA decode kernel"):  # fp8 q x bf16 KV
        aiter.mla.mla_decode_fwd(*args, **kwargs, q_scale=q_scale, kv_scale=q_scale)
    args, kwargs = direct_call_args(data, kv=kv8)
    with pytest.raises(RuntimeError, match="no nonpersistent MLA decode kernel"):  # bf16 q x fp8 KV
        aiter.mla.mla_decode_fwd(*args, **kwargs, kv_scale=kv_scale)


def test_fake_fp8_follows_the_arch(monkeypatch):
    fake = install(monkeypatch, "0.1.20.post1", arch="gfx942", cu_num=304)
    assert fake.dtypes.fp8 is torch.float8_e4m3fnuz
    x, scale = torch.ones(4, dtype=torch.bfloat16), torch.ones(1)
    with pytest.raises(RuntimeError, match="not support output type: torch.float8_e4m3fn"):
        fake.static_per_tensor_quant(torch.empty(4, dtype=torch.float8_e4m3fn), x, scale)
    out = torch.empty(4, dtype=torch.float8_e4m3fnuz)
    fake.static_per_tensor_quant(out, x, scale)
    assert out.float().tolist() == [1.0] * 4
    # the backend sizes its q scale from AITER's fp8: 240 for e4m3fnuz
    assert aiter_mla.build(BF16_NP, SHAPE, "cpu") is not None
    assert torch.finfo(fake.dtypes.fp8).max == 240.0


def test_new_release_falls_back_to_non_persistent_unless_the_split_count_is_passed(aiter):
    """0.1.18+: a bf16 persistent call at batch >= 32 that leaves num_kv_splits to AITER runs
    non-persistent; the backend passes get_mla_decode_fwd_max_splits and stays persistent."""
    shape, case = aiter_helpers.persistent_case(32)
    out = aiter_mla.build(BF16_PERSISTENT, shape, "cpu")(*case[:4])
    assert aiter._state.last_call["mode"] == "persistent"
    assert aiter._state.last_call["num_kv_splits"] == (256 if is_new(aiter) else None)
    result = problem.check(out, expected_output(case, BF16_PERSISTENT), STRICT)
    assert result.passed, result.reason
    if not is_new(aiter):
        return
    aiter_helpers.bf16_persistent_call(aiter, case, shape, sm_scale=SM_SCALE)
    assert aiter._state.last_call["mode"] == "nonpersistent"
    with pytest.raises(RuntimeError, match="num_kv_splits=8 is below the splits the metadata may hold"):
        aiter_helpers.bf16_persistent_call(aiter, case, shape, sm_scale=SM_SCALE, num_kv_splits=8)


def test_the_mi355x_config_follows_gfx950_facts_and_plans_a_modest_sweep(aiter):
    """configs/mi355x.yaml: no kpack (Triton forces 1 on gfx950), 16x16 MFMA only, AITER's
    336 candidates (plus Gluon and OPUS where the AITER has them), and a header comment that
    states the plan this test computes."""
    from mla_tune.backends import get_backend

    config = load_config(REPO / "configs" / "mi355x.yaml")
    platform = gpu.fake_platform("MI355X")
    counts = {}
    for name, space in config.backends.items():
        backend = get_backend(name)
        per_shape = [set(v for grid in expand_space(space) for v in backend.candidates(shape, grid, platform))
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
