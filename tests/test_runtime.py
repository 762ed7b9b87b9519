"""The runtime and the Dispatcher: table dispatch, fallback policy, input checks, no timing."""

from __future__ import annotations

import warnings

import pytest
import torch

import mla_tune.tune.timing
from mla_tune import runtime
from mla_tune.backends import get_backend, ragged_backends
from mla_tune.core import Shape, Variant
from mla_tune.gpu import detect
from mla_tune.problem import check, generate_input, generate_ragged_input, get_rule, reference
from mla_tune.tables.dispatch import Dispatcher
from mla_tune.tables.table import TableError
from tests.helpers import cpu_table

RULE = get_rule("leaderboard")
TORCH = Variant.make("torch", kv="bf16", q="bf16")


@pytest.fixture
def rt(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching table loads silently
        return runtime.load(table=cpu_table(tmp_path), device="cpu")


def _assert_correct(out, data, kv_format):
    ref = reference(data, q_format="bf16", kv_format=kv_format)
    result = check(out, ref, RULE)
    assert result.passed, result.reason
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (data[0].shape[0], 16, 512)


class _Spy:
    """A builder that records what it built and whose runner returns a marker; `dispatcher`
    serves a torch row at 1 x 8 (and torch elsewhere) through it."""

    def __init__(self):
        self.built: list[tuple[Variant, Shape]] = []
        self.calls = 0

    def __call__(self, variant, shape, device):
        self.built.append((variant, shape))

        def runner(q, kv_data, qo_indptr, kv_indptr):
            self.calls += 1
            return "ran"

        return runner

    def dispatcher(self):
        return Dispatcher({(1, 8): TORCH}, {"torch": self}, lambda shape: TORCH,
                          warn_on_miss=False, ragged_backends=frozenset())


def test_table_rows_run_their_variants_match_the_reference_and_time_nothing(rt, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the runtime must never time anything")

    monkeypatch.setattr(mla_tune.tune.timing, "time_call", forbidden)
    monkeypatch.setattr(mla_tune.tune.timing, "wall_time", forbidden)
    monkeypatch.setattr(torch.cuda, "Event", forbidden)
    assert rt.fallback_backend == "triton"
    torch_row = generate_input(1, 8, seed=1, device="cpu")  # torch winner
    _assert_correct(rt.decode(*torch_row[:4]), torch_row, "bf16")
    triton_row = generate_input(2, 40, seed=2, device="cpu")  # triton fp8 winner
    _assert_correct(rt.custom_kernel(triton_row), triton_row, "fp8")
    built = {key[0].backend for key in rt.dispatcher._runners}
    assert built == {"torch", "triton"}
    assert rt.dispatcher.misses == {}
    for data in (torch_row, triton_row):  # each row through both entry points
        rt.custom_kernel(data)
        rt.decode(*data[:4])


def test_unknown_and_ragged_shapes_run_the_fallback_and_are_counted(rt):
    data = generate_input(2, 24, seed=3, device="cpu")
    with pytest.warns(UserWarning, match=r"a shape the table lacks \(2x24\); running the fallback triton\("):
        out = rt.custom_kernel(data)
    _assert_correct(out, data, "fp8")
    expected = get_backend("triton").default_variant(Shape(2, 24))  # the table's rule: leaderboard
    assert rt.dispatcher.variant_for(2, 24) == expected
    ragged = generate_ragged_input([5, 17, 9], seed=4, device="cpu")
    with pytest.warns(UserWarning, match=r"a ragged batch \(3x17\)"):
        out = rt.decode(*ragged[:4])
    _assert_correct(out, ragged, "fp8")
    # A table row without a winner (3 x 16) goes to the fallback too.
    data = generate_input(3, 16, seed=5, device="cpu")
    with pytest.warns(UserWarning, match="3x16"):
        _assert_correct(rt.decode(*data[:4]), data, "fp8")
    assert rt.dispatcher.misses == {Shape(2, 24): 1, Shape(3, 17): 1, Shape(3, 16): 1}


def test_runners_are_built_lazily_once_per_shape():
    spy = _Spy()
    dispatcher = spy.dispatcher()
    assert spy.built == []
    data = generate_input(1, 8, seed=1, device="cpu")
    for _ in range(3):
        assert dispatcher(*data[:4]) == "ran"
        assert dispatcher(*data[:4], kv_len=8, check_indptr=False) == "ran"
    assert spy.built == [(TORCH, Shape(1, 8))] and spy.calls == 6
    other = generate_input(2, 8, seed=1, device="cpu")
    dispatcher(*other[:4])
    assert spy.built[-1] == (TORCH, Shape(2, 8)) and dispatcher.misses == {Shape(2, 8): 1}


def test_a_torch_fallback_refuses_ragged_batches_before_launching():
    backend, fallback = runtime.fallback_policy("leaderboard", allowed=["torch"])
    assert backend == "torch" and fallback(Shape(3, 3)) == TORCH
    spy = _Spy()
    dispatcher = Dispatcher({}, {"torch": spy}, fallback, warn_on_miss=False,
                            ragged_backends=ragged_backends(["torch"]))
    ragged = generate_ragged_input([3, 5], seed=1, device="cpu")
    with pytest.raises(ValueError, match="a ragged batch needs a fallback that reads kv_indptr"):
        dispatcher(*ragged[:4])
    assert spy.built == []
    with pytest.raises(ValueError, match="only aiter are allowed; allow one of them"):
        runtime.fallback_policy(allowed=["aiter"])


def _bad_inputs():
    """(name, edit of (q, kv_data, qo_indptr, kv_indptr, config), expected message)."""
    def q_to(dtype):
        return lambda d: (d[0].to(dtype), *d[1:])

    def noncontiguous_q(d):
        wide = torch.zeros((*d[0].shape[:2], 2 * d[0].shape[2]), dtype=torch.bfloat16)
        q = wide[:, :, ::2]
        q.copy_(d[0])
        return (q, *d[1:])

    def meta_q(d):
        return (torch.empty(d[0].shape, dtype=torch.bfloat16, device="meta"), *d[1:])

    def kv_drop(fmt):
        return lambda d: (d[0], {k: v for k, v in d[1].items() if k != fmt}, *d[2:])

    def short_kv(d):
        kv = dict(d[1])
        kv["bf16"] = kv["bf16"][:-1].contiguous()
        return (d[0], kv, *d[2:])

    def ptr(index, value):
        def edit(d):
            d = list(d)
            d[index] = value(d[index])
            return tuple(d)
        return edit

    # (name, edit, message, check_indptr): the message is matched with that setting.
    return [
        ("q dtype", q_to(torch.float32), "q must be bfloat16, got torch.float32", False),
        ("q shape", lambda d: (d[0][:, :, :512].contiguous(), *d[1:]), r"q must have shape \(batch, 16, 576\)", False),
        ("q layout", noncontiguous_q, "q must be contiguous", False),
        ("q device", meta_q, "KV is on cpu but q is on meta", False),
        ("kv missing", kv_drop("bf16"), "kv_data lacks the 'bf16' entry", False),
        ("kv total", short_kv, r"holds 7 tokens, not batch x kv_len = 1 x 8 = 8", False),
        ("kv total synced", short_kv, "kv_indptr ends at 8 but the KV cache holds 7 tokens", True),
        ("indptr dtype", ptr(3, lambda p: p.long()), "kv_indptr must be int32, got torch.int64", False),
        ("indptr length", ptr(3, lambda p: torch.cat([p, p[-1:]])), r"kv_indptr must have shape \(2,\)", False),
        ("qo_indptr values", ptr(2, lambda p: p * 2), "qo_indptr must be 0,1,2", True),
    ]


@pytest.mark.parametrize(("name", "edit", "message", "check_indptr"), _bad_inputs(),
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_raise_before_any_kernel_is_built(name, edit, message, check_indptr):
    spy = _Spy()
    dispatcher = spy.dispatcher()
    data = edit(generate_input(1, 8, seed=1, device="cpu"))
    with pytest.raises(ValueError, match=message):
        dispatcher(*data[:4], kv_len=8, check_indptr=check_indptr)
    with pytest.raises(ValueError):
        dispatcher(*data[:4])  # the host-side indptr check finds it as well
    assert spy.built == [] and spy.calls == 0


def test_indptr_that_disagrees_with_the_tensors_is_refused(rt):
    q, kv_data, qo, kv_indptr, config = generate_input(1, 8, seed=1, device="cpu")
    with pytest.raises(ValueError, match="kv_indptr ends at 9 but the KV cache holds 8 tokens"):
        rt.decode(q, kv_data, qo, torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_len=4 but kv_indptr gives 8"):
        rt.decode(q, kv_data, qo, kv_indptr, kv_len=4)
    with pytest.raises(ValueError, match=r'config\["batch_size"\] is 3 but q holds 1'):
        rt.custom_kernel((q, kv_data, qo, kv_indptr, {**config, "batch_size": 3}))
    with pytest.raises(ValueError, match="check_indptr=False needs kv_len"):
        rt.decode(q, kv_data, qo, kv_indptr, check_indptr=False)
    meta = torch.empty(q.shape, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="q must be on cpu, the device this runtime was loaded for"):
        rt.decode(meta, kv_data, qo, kv_indptr)


def test_a_table_for_another_gpu_is_refused_unless_allowed(tmp_path):
    path = cpu_table(tmp_path, gpu="H200")
    with pytest.raises(runtime.GpuMismatchError,
                       match=r"tuned on H200 but this process runs on cpu; .*--gpu cpu.*allow_other_gpu=True"):
        runtime.load(table=path)
    rt = runtime.load(table=path, allow_other_gpu=True)
    assert rt.table.gpu == "H200"
    with pytest.raises(TableError, match="was made for H200, not MI355X"):
        runtime.load(gpu="MI355X", table=path, allow_other_gpu=True)


def test_version_drift_warns_naming_the_field_and_both_versions(tmp_path):
    path = cpu_table(tmp_path, versions={"triton": "3.6.0", "sgl-flash-mla": "1.0.0"})
    with pytest.warns(UserWarning) as record:
        runtime.load(table=path)
    messages = [str(w.message) for w in record]
    here = detect().versions["triton"]
    assert any(f"provenance.versions.triton is 3.6.0 but this process has {here}" in m for m in messages)
    assert any("provenance.versions.sgl-flash-mla is 1.0.0 but this process has not installed" in m
               for m in messages)


def test_module_level_custom_kernel_loads_this_gpus_table_once(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime, "TABLES_DIR", tmp_path)
    # no table yet: the error names the file and how to make it
    with pytest.raises(TableError, match=r"cpu\.yaml does not exist; run `mla-tune sweep --gpu NAME`"):
        runtime.load()
    (tmp_path / "cpu.yaml").write_text(cpu_table(tmp_path).read_text())
    runtime.default_runtime.cache_clear()
    try:
        data = generate_input(1, 8, seed=9, device="cpu")
        _assert_correct(runtime.custom_kernel(data), data, "bf16")
        first = runtime.default_runtime()
        runtime.custom_kernel(data)
        assert runtime.default_runtime() is first
    finally:
        runtime.default_runtime.cache_clear()
