"""Caches as engines keep them: an fp8 cache as uint8 bytes (read as fp8 where CallSpec declares
cache_dtype="uint8", else refused with the fix by every path) and kv_scale as a Python float."""

from __future__ import annotations

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import get_backend
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, CallSpec
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import Decoder, decode
from mla_tune.serving.decode_plan import DecodePlan

DSV3 = CORE_DEEPSEEK_V3_SCALE
SPEC = CallSpec("fp8", page_size=16, heads=16, max_q_len=1, sm_scale=DSV3)
BYTES = CallSpec("fp8", page_size=16, heads=16, max_q_len=1, sm_scale=DSV3, cache_dtype="uint8")


def _input(seed: int = 21) -> serving.ServingInput:
    return serving.make_input([1, 1, 1], [3, 40, 77], 16, 16, "fp8", seed=seed)


def _close(out, inp):
    result = problem.check(out.float(), inp.reference(sm_scale=DSV3), problem.RULES["strict"])
    assert result.passed, result.reason


def test_callspec_takes_uint8_for_fp8_only():
    with pytest.raises(ValueError, match="use kv_format='fp8'"):
        CallSpec("bf16", cache_dtype="uint8")
    with pytest.raises(ValueError, match="cache_dtype must be one of"):
        CallSpec("fp8", cache_dtype="int8")


@pytest.mark.parametrize("backend", ["triton", "triton_fused"])
def test_a_declared_uint8_cache_is_read_as_fp8_and_kv_scale_may_be_a_python_float(backend):
    inp = _input()
    plan = DecodePlan(BYTES, max_batch=4, backend=backend)
    plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    raw = inp.kv.view(torch.uint8)
    _close(plan.run(inp.q, raw, inp.kv_scale).clone(), inp)
    _close(plan.run_checked(inp.q, raw, inp.kv_scale).clone(), inp)
    with pytest.raises(ValueError, match="uint8 tensor of fp8 bytes"):
        plan.run(inp.q, inp.kv, inp.kv_scale)  # the spec said bytes
    scale = float(inp.kv_scale)
    _close(plan.run(inp.q, raw, scale).clone(), inp)
    with pytest.raises(ValueError, match="positive and finite"):
        plan.run(inp.q, raw, -1.0)
    decoder = Decoder(SPEC)
    kept = decoder.inputs.scale(scale)
    assert kept.dtype == torch.float32 and tuple(kept.shape) == (1,)
    assert decoder.inputs.scale(scale) is kept
    _close(decoder(inp.q, inp.qo_indptr, inp.kv, scale, **inp.layout).clone(), inp)


def test_an_undeclared_uint8_cache_is_refused_by_every_path():
    inp = _input()
    raw = inp.kv.view(torch.uint8)
    plan = DecodePlan(SPEC, max_batch=4)
    plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    for run in (plan.run, plan.run_checked):
        with pytest.raises(ValueError, match="cache_dtype='uint8'"):
            run(inp.q, raw, inp.kv_scale)
    decoder = Decoder(SPEC)
    with pytest.raises(ValueError, match="cache_dtype='uint8'"):
        decoder(inp.q, inp.qo_indptr, raw, inp.kv_scale, **inp.layout)
    with pytest.raises(ValueError, match="kv.view"):
        decode(inp.q, inp.qo_indptr, raw, inp.kv_scale, **inp.layout)
    fused = get_backend("triton_fused")
    fused_runner = fused.build_serving(fused.default_serving_variant(SPEC, decoder.platform), SPEC,
                                       "cpu")
    for runner in (decoder.runner, fused_runner):  # the runners beneath, called directly
        with pytest.raises(ValueError, match="kv is uint8"):
            runner(inp.q, inp.qo_indptr, raw, inp.kv_scale, **inp.layout)
    # and the right cache still runs after the refusals
    _close(plan.run(inp.q, inp.kv, inp.kv_scale).clone(), inp)
    # a bf16 plan refuses an fp8 cache
    plan = DecodePlan(CallSpec("bf16", page_size=16, heads=16), max_batch=4)
    plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    with pytest.raises(ValueError, match="kv must be bf16"):
        plan.run(inp.q, inp.kv, inp.kv_scale)
