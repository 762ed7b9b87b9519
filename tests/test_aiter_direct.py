"""The AITER backend's keyword rule, its direct mode (mla_decode_stage1_asm_fwd and
mla_reduce_v1 called without mla_decode_fwd), its softmax scale and the #4144 persistent
gate, through the fakes of v0.1.11, f3be04a12 (the contest runner's build) and
v0.1.20.post1 (tests/fakes/aiter)."""

import ast
import functools
import inspect
import types

import pytest
import torch

from mla_tune import gpu, problem
from mla_tune.backends import aiter_mla
from mla_tune.core import SM_SCALE, CallSpec, Shape, Variant
from tests import aiter_helpers
from tests.aiter_helpers import BF16_NP, BF16_PERSISTENT, F3BE04A12, SHAPE, install, is_new
from tests.helpers import REPO

aiter = aiter_helpers.aiter  # the fixture: each test runs under every faked release
DIRECT = {"mode": "direct", "fast_mode": False, "intra_batch": True, "max_split_per_batch": 4,
          "kv_granularity": 16}


@pytest.fixture
def data():
    return problem.generate_input(SHAPE.batch, SHAPE.kv_len, seed=5, device="cpu")


def _matches(out, data, sm_scale=SM_SCALE):
    """Whether `out` is, within 2e-2, the fp32 attention of bf16 q over bf16 KV at `sm_scale`."""
    q = data[0].float()
    kv = data[1]["bf16"].float().reshape(q.shape[0], -1, 576)
    scores = torch.einsum("bhd,bnd->bhn", q, kv) * sm_scale
    reference = torch.einsum("bhn,bnd->bhd", scores.softmax(-1), kv[..., :512])
    return torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------ the keyword rule
# Each entry point and how many leading arguments it takes positionally.
_LEADING = {"mla.mla_decode_fwd": 3, "get_mla_metadata_info_v1": 0, "get_mla_metadata_v1": 2,
            "mla_decode_stage1_asm_fwd": 2, "mla_reduce_v1": 2}
_LEADING_NEW = {"get_mla_decode_fwd_max_splits": 0, "ops.triton.gluon.mla_gluon.mla_gluon": 4}


def test_every_fake_entry_point_refuses_arguments_past_its_leading_tensors(aiter):
    entries = dict(_LEADING, **(_LEADING_NEW if is_new(aiter) else {}))
    for dotted, count in entries.items():
        fn = functools.reduce(getattr, dotted.split("."), aiter)
        with pytest.raises(TypeError, match=rf"{dotted.split('.')[-1]}: {count + 1} positional arguments"):
            fn(*([None] * (count + 1)))
        # the signature inspect sees is still the real one (the gate reads it)
        assert list(inspect.signature(fn).parameters)[0] != "args", dotted
    # why the rule: from 0.1.20.post1's stage 1 on, the slot after `output` is `lse`; an older
    # positional caller hands it q_scale (the fake, unwrapped, shows where it lands)
    stage1 = inspect.unwrap(aiter.mla_decode_stage1_asm_fwd)
    names = list(inspect.signature(stage1).parameters)
    assert names[17] == ("lse" if is_new(aiter) else "q_scale")


# The AITER callables aiter_mla.py calls, and the arguments it may pass them positionally
# (the quant ops are pybind functions without argument names: positional only).
_BACKEND_LEADING = {"mla_decode_fwd": 3, "mla_gluon": 4, "get_mla_metadata_v1": 2, "get_mla_metadata_info_v1": 0,
                    "get_mla_decode_fwd_max_splits": 0, "stage1_op": 2, "reduce_op": 2, "vendor": 3}


def test_the_backend_passes_everything_past_the_leading_tensors_by_keyword():
    """An AST check of every call aiter_mla.py makes into AITER (the fakes refuse at call time)."""
    tree = ast.parse((REPO / "mla_tune" / "backends" / "aiter_mla.py").read_text())
    seen = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
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
    buffers = next(iter(aiter._state.metadata.values()))["reduce"]
    assert buffers  # the work list's reduce buffers are recorded
    with pytest.raises(RuntimeError, match="not written by mla_decode_stage1_asm_fwd"):
        aiter.mla_reduce_v1(
            other, torch.zeros((64, 1, 16, 1)), reduce_indptr=torch.zeros(4, dtype=torch.int32),
            reduce_final_map=None, reduce_partial_map=torch.zeros(4, dtype=torch.int32),
            max_seqlen_q=1, final_output=torch.empty((3, 16, 512), dtype=torch.bfloat16), **extra)


def test_direct_mode_passes_lse_and_the_split_bound_only_where_the_signature_has_them(aiter, data, monkeypatch):
    seen = {}
    for name in ("mla_decode_stage1_asm_fwd", "mla_reduce_v1"):
        real = getattr(aiter, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] = (len(args), dict(kwargs))
            return _real(*args, **kwargs)

        spy.__signature__ = inspect.signature(real)
        monkeypatch.setattr(aiter, name, spy)
    variant = Variant.make("aiter", kv="bf16", q="bf16", **DIRECT)
    out = aiter_mla.build(variant, SHAPE, "cpu")(*data[:4])
    (n1, stage1), (n2, reduce) = seen["mla_decode_stage1_asm_fwd"], seen["mla_reduce_v1"]
    assert n1 == n2 == 2
    assert ("lse" in stage1) == is_new(aiter) and stage1.get("lse") is None and stage1["q_scale"] is None
    assert reduce.get("num_kv_splits") == (256 if is_new(aiter) else None)  # get_mla_decode_fwd_max_splits
    assert _matches(out, data)


def _opaque(fn):
    """A wrapper like AITER's torch_compile_guard returns: no functools.wraps."""
    def wrapper_custom(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper_custom


def test_direct_mode_is_read_from_the_torch_op_schema_behind_an_opaque_wrapper(aiter, data, monkeypatch):
    """AITER's compile_ops ops show (*args, **kwargs) to inspect.signature; the names are in
    the schema AITER registers from the stub (torch.library.infer_schema, as AITER does)."""
    schemas = {}
    for name in ("mla_decode_stage1_asm_fwd", "mla_reduce_v1"):
        real = getattr(aiter, name)
        text = torch.library.infer_schema(inspect.unwrap(real), mutates_args="unknown")
        schemas[name] = types.SimpleNamespace(default=types.SimpleNamespace(
            _schema=torch._C.parse_schema(f"aiter::{name}{text}")))

        monkeypatch.setattr(aiter, name, _opaque(real))
    assert aiter_mla._ai_features(aiter)["direct"] is False  # nothing to read: not offered
    monkeypatch.setattr(torch.ops, "aiter", types.SimpleNamespace(**schemas), raising=False)
    features = aiter_mla._ai_features(aiter)
    assert features["direct"] is True and features["direct_lse"] == is_new(aiter)
    variant = Variant.make("aiter", kv="bf16", q="bf16", **DIRECT)
    out = aiter_mla.build(variant, SHAPE, "cpu")(*data[:4])
    assert _matches(out, data)


def test_direct_candidates_join_where_the_aiter_has_the_ops(aiter, monkeypatch):
    space = {"mode": ["direct"], "kv": ["fp8", "bf16"], "q": ["fp8_static", "bf16"], "max_split_per_batch": [1, 4],
             "fast_mode": [False, True], "intra_batch": [True]}
    platform = gpu.fake_platform("MI355X")
    variants = aiter_mla.candidates(Shape(32, 1024), space, platform)
    assert variants and {v.get("mode") for v in variants} == {"direct"}
    assert {(v.get("q"), v.get("kv")) for v in variants} == {("fp8_static", "fp8"), ("bf16", "fp8"), ("bf16", "bf16")}
    assert not any("opus" in v.p for v in variants)
    for v in variants:
        aiter_mla._ai_validate(v.with_params(q_amax=4.0) if v.get("q") == "fp8_static" else v, Shape(32, 1024))
    monkeypatch.delattr(aiter, "mla_reduce_v1")
    assert aiter_mla.candidates(Shape(32, 1024), space, platform) == []
    with pytest.raises(ValueError, match="opus is not a parameter of mode=direct"):
        aiter_mla.validate(Variant.make("aiter", kv="fp8", q="fp8_dynamic", opus=True, **DIRECT))
    with pytest.raises(ValueError, match="direct mode passes"):
        aiter_mla.build(Variant.make("aiter", kv="bf16", q="bf16", **DIRECT), SHAPE, "cpu")


# ------------------------------------------------------------------ the softmax scale
_SCALED = [
    {"mode": "nonpersistent", "num_kv_splits": 2},
    {"mode": "persistent", "fast_mode": True, "intra_batch": False, "max_split_per_batch": -1, "kv_granularity": 16},
    DIRECT,
    {"mode": "gluon"},
]


@pytest.mark.parametrize("params", _SCALED, ids=lambda p: p["mode"])
def test_the_softmax_scale_reaches_every_aiter_call(aiter, data, params):
    if params["mode"] == "gluon" and not is_new(aiter):
        pytest.skip("AITER's Gluon decode is 0.1.18+ (the 0.1.20.post1 fake)")
    variant = Variant.make("aiter", kv="bf16", q="bf16", **params)
    scale = 0.19  # far from 1/sqrt(576) = 0.0417: the scores change markedly
    default = aiter_mla.build(variant, SHAPE, "cpu")(*data[:4]).float().clone()
    scaled = aiter_mla.build(variant, SHAPE, "cpu", sm_scale=scale)(*data[:4]).float()
    assert (scaled - default).abs().max() > 0.05
    assert _matches(default, data) and _matches(scaled, data, scale)


def test_build_refuses_a_softmax_scale_that_is_no_positive_float(aiter):
    for bad in (0.0, -1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="sm_scale must be a positive finite float"):
            aiter_mla.build(BF16_NP, SHAPE, "cpu", sm_scale=bad)
    assert isinstance(aiter_mla._ai_sm_scale(1), float)  # AITER's ops refuse an int


def test_the_serving_call_takes_the_specs_softmax_scale(aiter, data):
    spec = CallSpec("bf16", sm_scale=0.19)
    variant = aiter_mla.default_serving_variant(spec, gpu.fake_platform("MI355X"))
    runner = aiter_mla.build_serving(variant, spec, "cpu")
    qo = torch.arange(SHAPE.batch + 1, dtype=torch.int32)
    out = runner(data[0], qo, data[1]["bf16"], None, kv_indptr=qo * SHAPE.kv_len)
    assert _matches(out, data, 0.19)


# ------------------------------------------------------------------ the #4144 gate
@pytest.mark.parametrize("release, cap, batch", [("f3be04a12", "1", 32), ("0.1.20.post1", "4", 4),
                                                 ("0.1.20.post1", "0", 4)],
                         ids=["contest-build-has-no-gate", "newer-gates-at-4", "newer-gate-off"])
def test_each_builds_persistent_gate_and_the_backend_stays_persistent(monkeypatch, release, cap,
                                                                      batch):
    monkeypatch.setenv("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH", cap)  # "1": every batch on 0.1.18+
    fake = install(monkeypatch, release)
    assert fake.__version__ == {"f3be04a12": F3BE04A12}.get(release, release)
    gated = release == "0.1.20.post1"
    assert aiter_mla._ai_features(fake)["persistent_gate"] is gated
    assert aiter_mla.aiter_persistent_gate(fake.__version__) == (
        "bypassed (persistent calls pass num_kv_splits)" if gated else "absent (before 0.1.18)")
    shape, case = aiter_helpers.persistent_case(batch)
    out = aiter_mla.build(BF16_PERSISTENT, shape, "cpu")(*case[:4])
    assert fake._state.last_call["mode"] == "persistent"
    assert fake._state.last_call["num_kv_splits"] == (256 if gated else None)
    assert _matches(out, case)
    if gated:  # a work list handed over without num_kv_splits: gated at batch >= 4, not at 0 (off)
        aiter_helpers.bf16_persistent_call(fake, case, shape)
        assert fake._state.last_call["mode"] == ("nonpersistent" if cap == "4" else "persistent")


def test_build_refuses_a_gated_persistent_call_it_cannot_keep_persistent(monkeypatch):
    fake = install(monkeypatch, "0.1.20.post1")
    monkeypatch.delattr(fake, "get_mla_decode_fwd_max_splits")
    with pytest.raises(ValueError, match="#4144.*use mode direct"):
        aiter_mla.build(BF16_PERSISTENT, Shape(32, 200), "cpu")
