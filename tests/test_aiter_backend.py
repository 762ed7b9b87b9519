"""The AITER backend, on the CPU through tests/fakes/aiter (a fake of AITER v0.1.11)."""

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mla_tune import gpu, problem
from mla_tune.backends import aiter_mla
from mla_tune.core import SM_SCALE, Shape, Variant
from tests.helpers import expected_output

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("vendor_fakes", ROOT / "tests" / "fakes" / "vendor_fakes.py")
vendor_fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vendor_fakes)

SHAPE = Shape(3, 256)  # small, yet long enough for the intra-batch builder (>= 196 tokens)
STRICT = problem.RULES["strict"]


@pytest.fixture
def aiter(monkeypatch):
    return vendor_fakes.install(monkeypatch, "aiter")["aiter"]


@pytest.fixture
def data():
    return problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=7, device="cpu")


def _q_amax(seed_data):
    return float(seed_data[0].abs().amax())


def _params(sig):
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]


# Parameter lists read from ROCm/aiter tag v0.1.11 (aiter/mla.py, aiter/ops/attention.py).
_V0111_DECODE = [
    "q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens", "max_seqlen_q",
    ("page_size", 1), ("nhead_kv", 1), ("sm_scale", None), ("logit_cap", 0.0), ("num_kv_splits", None),
    ("num_kv_splits_indptr", None), ("work_meta_data", None), ("work_indptr", None), ("work_info_set", None),
    ("reduce_indptr", None), ("reduce_final_map", None), ("reduce_partial_map", None), ("q_scale", None),
    ("kv_scale", None), ("intra_batch_mode", False), ("return_logits", False), ("return_lse", False),
]
_V0111_INFO = [
    "batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype", "is_sparse",
    ("fast_mode", True), ("num_kv_splits", 32), ("intra_batch_mode", False),
]
_V0111_BUILDER = [
    "seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k", "num_heads_k",
    "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr", "reduce_indptr", "reduce_final_map",
    "reduce_partial_map", ("page_size", 1), ("kv_granularity", 16), ("max_seqlen_qo", -1),
    ("uni_seqlen_qo", -1), ("fast_mode", True), ("topk", -1), ("max_split_per_batch", -1),
    ("intra_batch_mode", False), ("dtype_q", None), ("dtype_kv", None),
]


def _expected(spec):
    empty = inspect.Parameter.empty
    return [(s, "POSITIONAL_OR_KEYWORD", empty) if isinstance(s, str) else (s[0], "POSITIONAL_OR_KEYWORD", s[1])
            for s in spec]


def test_fake_has_the_v0_1_11_signatures(aiter):
    assert aiter.__version__ == vendor_fakes.VERSIONS["aiter"] == "0.1.11"
    assert _params(inspect.signature(aiter.mla.mla_decode_fwd)) == _expected(_V0111_DECODE)
    assert _params(inspect.signature(aiter.get_mla_metadata_info_v1)) == _expected(_V0111_INFO)
    assert _params(inspect.signature(aiter.get_mla_metadata_v1)) == _expected(_V0111_BUILDER)
    # pybind ops declared without py::arg names take positional arguments only
    for op in (aiter.static_per_tensor_quant, aiter.dynamic_per_tensor_quant):
        assert {p.kind.name for p in inspect.signature(op).parameters.values()} == {"POSITIONAL_ONLY"}
    assert aiter.dtypes.fp8 is torch.float8_e4m3fn


def test_backend_reads_the_fakes_version_and_is_available(aiter):
    assert aiter_mla._ai_version(aiter) == "0.1.11"
    assert aiter_mla.unavailable_reason() is None


FAMILIES = [
    {"kv": "fp8", "q": "fp8_static", "mode": "nonpersistent", "num_kv_splits": 2},
    {"kv": "fp8", "q": "fp8_dynamic", "mode": "nonpersistent", "num_kv_splits": 1},
    {"kv": "bf16", "q": "bf16", "mode": "nonpersistent", "num_kv_splits": 4},
    {"kv": "fp8", "q": "fp8_static", "mode": "persistent", "fast_mode": False, "intra_batch": True,
     "max_split_per_batch": 8, "kv_granularity": 16},
    {"kv": "fp8", "q": "bf16", "mode": "persistent", "fast_mode": True, "intra_batch": False,
     "max_split_per_batch": -1, "kv_granularity": 64},
    {"kv": "bf16", "q": "bf16", "mode": "persistent", "fast_mode": False, "intra_batch": False,
     "max_split_per_batch": -1, "kv_granularity": 16},
]


@pytest.mark.parametrize("params", FAMILIES, ids=lambda p: f"{p['mode']}-{p['q']}-{p['kv']}")
def test_each_variant_family_builds_and_matches_the_reference(aiter, data, params):
    variant = Variant.make("aiter", **params)
    if params["q"] == "fp8_static":
        calibration = problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=11, device="cpu")
        variant = variant.with_params(q_amax=_q_amax(calibration))
    runner = aiter_mla.build(variant, SHAPE, "cpu")
    out = runner(*data[:4])
    assert out.shape == (SHAPE.batch, 16, 512) and out.dtype == torch.bfloat16
    result = problem.check(out, expected_output(data, variant), STRICT)
    assert result.passed, result.reason
    assert aiter._state.last_call["mode"] == params["mode"]
    again = runner(*data[:4])
    assert again.data_ptr() == out.data_ptr()  # the runner's own buffer, reused


def test_persistent_metadata_is_built_once_in_build(aiter, data):
    variant = Variant.make("aiter", kv="fp8", q="fp8_dynamic", mode="persistent", fast_mode=False,
                           intra_batch=True, max_split_per_batch=16, kv_granularity=16)
    runner = aiter_mla.build(variant, SHAPE, "cpu")
    assert aiter._state.calls["get_mla_metadata_v1"] == 1
    for _ in range(3):
        runner(*data[:4])
    assert aiter._state.calls["get_mla_metadata_v1"] == 1
    assert aiter._state.calls["mla_decode_fwd"] == 3
    assert aiter._state.calls["dynamic_per_tensor_quant"] == 3  # amax recomputed every call


def test_torch_quantizers_stand_in_for_missing_aiter_ones(aiter, monkeypatch, data):
    results = {}
    for q_mode in ("fp8_static", "fp8_dynamic"):
        variant = Variant.make("aiter", kv="fp8", q=q_mode, mode="nonpersistent", num_kv_splits=2)
        if q_mode == "fp8_static":
            variant = variant.with_params(q_amax=_q_amax(data) * 1.1)
        results[q_mode] = aiter_mla.build(variant, SHAPE, "cpu")(*data[:4]).clone()
    monkeypatch.delattr(aiter, "static_per_tensor_quant")
    monkeypatch.delattr(aiter, "dynamic_per_tensor_quant")
    calls_before = dict(aiter._state.calls)
    for q_mode, vendor_out in results.items():
        variant = Variant.make("aiter", kv="fp8", q=q_mode, mode="nonpersistent", num_kv_splits=2)
        if q_mode == "fp8_static":
            variant = variant.with_params(q_amax=_q_amax(data) * 1.1)
        torch_out = aiter_mla.build(variant, SHAPE, "cpu")(*data[:4])
        assert torch.equal(torch_out, vendor_out), q_mode
    assert aiter._state.calls["static_per_tensor_quant"] == calls_before["static_per_tensor_quant"]


def _direct_call_args(data, q=None, kv=None, index_dtype=torch.int32):
    q_in, kv_data, _qo, _kv, _cfg = data
    batch, total = q_in.shape[0], kv_data["bf16"].shape[0]
    kv_in = kv_data["bf16"] if kv is None else kv
    o = torch.empty((batch, 16, 512), dtype=torch.bfloat16)
    return [q_in if q is None else q, kv_in.view(total, 1, 1, 576), o,
            torch.arange(batch + 1, dtype=index_dtype), torch.arange(batch + 1, dtype=index_dtype) * SHAPE.kv_len,
            torch.arange(total, dtype=index_dtype), torch.ones(batch, dtype=index_dtype), 1]


def test_fake_rejects_a_dtype_pair_aiter_has_no_kernel_for(aiter, data):
    fp8_q, q_scale = problem.quantize_fp8(data[0])
    with pytest.raises(RuntimeError, match="no nonpersistent MLA decode kernel"):  # fp8 q x bf16 KV
        aiter.mla.mla_decode_fwd(*_direct_call_args(data, q=fp8_q), q_scale=q_scale, kv_scale=q_scale)
    kv8, kv_scale = data[1]["fp8"]
    with pytest.raises(RuntimeError, match="no nonpersistent MLA decode kernel"):  # bf16 q x fp8 KV
        aiter.mla.mla_decode_fwd(*_direct_call_args(data, kv=kv8), kv_scale=kv_scale)


def test_fake_rejects_int64_indices_and_an_old_positional_call(aiter, data):
    with pytest.raises(RuntimeError, match="must be int32"):
        aiter.mla.mla_decode_fwd(*_direct_call_args(data, index_dtype=torch.int64), sm_scale=SM_SCALE)
    # before v0.1.10.post2 sm_scale followed max_seqlen_q; now that slot is page_size
    with pytest.raises(RuntimeError, match="page_size"):
        aiter.mla.mla_decode_fwd(*_direct_call_args(data), SM_SCALE)
    with pytest.raises(TypeError):  # the quant ops are pybind functions without argument names
        aiter.static_per_tensor_quant(out=torch.empty(2, dtype=torch.float8_e4m3fn),
                                      input=torch.ones(2, dtype=torch.bfloat16), scale=torch.ones(1))
    aiter.mla.mla_decode_fwd(*_direct_call_args(data), sm_scale=SM_SCALE)  # the right call passes


def test_fake_rejects_split_indptr_with_work_meta_data_and_undersized_buffers(aiter, data):
    args = _direct_call_args(data)
    qo, kvp, last = args[3], args[4], args[6]
    bf16 = torch.bfloat16
    info = aiter.get_mla_metadata_info_v1(SHAPE.batch, 1, 16, bf16, bf16, False, fast_mode=False,
                                          num_kv_splits=2, intra_batch_mode=True)
    work = [torch.empty(size, dtype=dtype) for size, dtype in info]
    long_kvp = torch.arange(SHAPE.batch + 1, dtype=torch.int32) * 2048  # 2048 // 196 = 10 splits possible
    with pytest.raises(RuntimeError, match="builder writes"):  # sized for 2 splits, asked for 8
        aiter.get_mla_metadata_v1(qo, long_kvp, last, 16, 1, True, work[0], work[2], work[1], work[3], work[4], work[5],
                                  fast_mode=False, max_split_per_batch=8, intra_batch_mode=True)
    aiter.get_mla_metadata_v1(qo, kvp, last, 16, 1, True, work[0], work[2], work[1], work[3], work[4], work[5],
                              fast_mode=False, max_split_per_batch=1, intra_batch_mode=True)
    buffers = dict(work_meta_data=work[0], work_indptr=work[1], work_info_set=work[2], reduce_indptr=work[3],
                   reduce_final_map=work[4], reduce_partial_map=work[5])
    with pytest.raises(RuntimeError, match="never pass num_kv_splits_indptr"):
        aiter.mla.mla_decode_fwd(*args, sm_scale=SM_SCALE, num_kv_splits_indptr=qo, **buffers)
    swapped = dict(buffers, work_indptr=work[2], work_info_set=work[1])
    with pytest.raises(RuntimeError, match="swapped"):
        aiter.mla.mla_decode_fwd(*args, sm_scale=SM_SCALE, **swapped)
    aiter.mla.mla_decode_fwd(*args, sm_scale=SM_SCALE, **buffers)


@pytest.mark.parametrize("version", ["0.1.7.post2.dev18", "0.1.10.post1", "0.1.21"])
def test_an_unsupported_aiter_version_is_refused_with_the_supported_list(aiter, monkeypatch, version):
    monkeypatch.setattr(sys.modules["aiter._version"], "__version__", version)
    variant = Variant.make("aiter", kv="bf16", q="bf16", mode="nonpersistent", num_kv_splits=1)
    with pytest.raises(ValueError, match=rf"AITER {version} is not supported.*0\.1\.10\.post2.*0\.1\.20\.post1"):
        aiter_mla.build(variant, SHAPE, "cpu")
    assert f"AITER {version} is not supported" in aiter_mla.unavailable_reason()


def test_build_refuses_bad_variants_before_touching_aiter(aiter):
    with pytest.raises(ValueError, match="q_amax"):
        aiter_mla.build(Variant.make("aiter", kv="fp8", q="fp8_static", mode="nonpersistent", num_kv_splits=1),
                        SHAPE, "cpu")
    with pytest.raises(ValueError, match="no nonpersistent kernel"):
        aiter_mla.build(Variant.make("aiter", kv="fp8", q="bf16", mode="nonpersistent", num_kv_splits=1),
                        SHAPE, "cpu")
    with pytest.raises(ValueError, match="num_kv_splits must be an int in 1..2"):  # 256 tokens / 128
        aiter_mla.build(Variant.make("aiter", kv="fp8", q="fp8_dynamic", mode="nonpersistent", num_kv_splits=4),
                        SHAPE, "cpu")
    assert aiter._state.calls["mla_decode_fwd"] == 0


def test_a_runner_refuses_another_shape(aiter, data):
    runner = aiter_mla.build(Variant.make("aiter", kv="bf16", q="bf16", mode="nonpersistent", num_kv_splits=1),
                             Shape(2, 256), "cpu")
    with pytest.raises(ValueError, match="built for 2x256"):
        runner(*data[:4])


def test_candidates_come_only_on_a_hip_platform():
    space = yaml.safe_load((ROOT / "configs" / "mi355x.yaml").read_text())["backends"]["aiter"]
    shape = Shape(4, 1024)
    assert aiter_mla.candidates(shape, space, gpu.fake_platform("H200")) == []
    variants = aiter_mla.candidates(shape, space, gpu.fake_platform("MI355X"))
    assert len(variants) == len(set(variants)) > 20
    for v in variants:
        assert v.get("kv") in ("bf16", "fp8") and v.get("q") in ("bf16", "fp8_dynamic", "fp8_static")
        assert not (v.get("q") != "bf16" and v.get("kv") == "bf16")
        assert v.get("mode") == "persistent" or (v.get("q") == "bf16") == (v.get("kv") == "bf16")
        if v.get("mode") == "nonpersistent":
            assert v.get("num_kv_splits") <= (8 if v.get("q") != "bf16" else 16)
        aiter_mla._ai_validate(v.with_params(q_amax=4.0) if v.get("q") == "fp8_static" else v, shape)
    modes = {v.get("mode") for v in variants}
    assert modes == {"nonpersistent", "persistent"}
    mi300 = aiter_mla.candidates(shape, space, gpu.fake_platform("MI300X"))
    assert all(v.get("max_split_per_batch") >= 16 for v in mi300 if v.get("intra_batch"))


def test_unavailable_reason_is_one_sentence_when_aiter_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", None)  # makes `import aiter` raise ImportError
    reason = aiter_mla.unavailable_reason()
    assert reason.startswith("AITER cannot be imported") and reason.endswith(".")


def test_a_worker_subprocess_sees_the_fake_through_subprocess_env():
    env = vendor_fakes.subprocess_env("aiter", cu_num=304, arch="gfx942")
    code = ("import aiter; from mla_tune.backends import aiter_mla; "
            "print(aiter.__version__, aiter._state.cu_num, aiter._state.arch, aiter_mla.unavailable_reason())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.1.11", "304", "gfx942", "None"]
