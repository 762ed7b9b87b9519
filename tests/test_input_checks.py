"""Bad inputs and out-of-range table parameters are refused in one line before any build."""

from pathlib import Path

import pytest
import torch

from mla_tune import runtime
from mla_tune.backends import get_backend
from mla_tune.core import Variant
from mla_tune.problem import generate_input
from mla_tune.tables.dispatch import Dispatcher
from mla_tune.tables.table import TableError
from tests.helpers import cpu_table

FP8_TRITON = Variant.make("triton", block_n=16, dot_dtype="fp16", kv="fp8", num_splits=1, num_stages=1,
                          num_warps=4, q="bf16")
MXFP4_FUSED = Variant.make("triton_fused", kv="mxfp4", q="bf16", qk_dot="fp16", pv_dot="fp16", tok_m=True,
                           block_n=16, num_warps=4, num_stages=1, num_splits=1, reduce="none")


def _dispatcher(variant: Variant) -> tuple[Dispatcher, list]:
    """A dispatcher for variant at 1x8 and the variants it built."""
    built = []

    def build(picked, shape, device):
        built.append(picked)
        return lambda *args: "ran"

    return Dispatcher({(1, 8): variant}, {variant.backend: build}, lambda s: variant,
                      warn_on_miss=False, ragged_backends=frozenset()), built


@pytest.mark.parametrize("check_indptr", [False, True])
def test_fp8_kv_as_uint8_bytes_and_a_python_float_scale_are_refused_in_one_line(check_indptr):
    dispatcher, built = _dispatcher(FP8_TRITON)
    fused, fused_built = _dispatcher(MXFP4_FUSED)
    data = generate_input(1, 8, seed=1, device="cpu")
    kv8, scale = data[1]["fp8"]

    def call(fmt, entry, to=dispatcher):
        """`to` called on data with kv_data[fmt] replaced by entry."""
        return to(data[0], {**data[1], fmt: entry}, *data[2:4], kv_len=8, check_indptr=check_indptr)

    with pytest.raises(ValueError, match=r"fp8 KV must have an fp8 dtype .*got torch\.uint8; pass fp8 bytes "
                                         r"held as torch\.uint8 as kv\.view\(torch\.float8_e4m3fn\)"):
        call("fp8", (kv8.view(torch.uint8), scale))  # how vLLM keeps an fp8 cache
    for other in (torch.int8, torch.float8_e5m2):  # other bytes are not e4m3 codes either
        with pytest.raises(ValueError, match="fp8 KV must have an fp8 dtype"):
            call("fp8", (kv8.view(other), scale))
    for bad in (float(scale), None, [float(scale)]):
        with pytest.raises(ValueError, match=r"fp8 KV scale must be a \(1,\) float32 tensor on q's device, got "
                                             r"\w+; make it once with torch\.tensor\(\[scale\]"):
            call("fp8", (kv8, bad))
    with pytest.raises(ValueError, match="kv_data\\[\"fp8\"\\]\\[0\\] must be a tensor, got float"):
        call("fp8", (1.0, scale))
    with pytest.raises(ValueError, match="mxfp4 scales must be a .* tensor of E8M0 bytes, got float"):
        call("mxfp4", (data[1]["mxfp4"][0], 1.0), to=fused)
    assert built == [] and fused_built == []
    assert call("fp8", (kv8.view(torch.uint8).view(torch.float8_e4m3fn), scale)) == "ran"


def _table_with(tmp_path, variant: Variant) -> Path:
    def edit(data):
        data["rows"][1]["winner"] = {"variant": str(variant), "backend": variant.backend, "params": variant.p}
        data["rows"][1]["alternates"] = {variant.backend: {"variant": str(variant), "time_us": 8.0}}
        data["rows"][1]["backends"] = {variant.backend: 8.0}

    return cpu_table(tmp_path, edit=edit)


FUSED = Variant.make("triton_fused", kv="fp8", q="bf16", qk_dot="fp16", pv_dot="fp16", tok_m=True, block_n=32,
                     num_warps=4, num_stages=3, num_splits=2, reduce="last")


@pytest.mark.parametrize(("variant", "message"), [
    (FP8_TRITON.with_params(num_splits=1000000000), "num_splits=1000000000 is not allowed; num_splits must be an "
                                                    "int from 1 to 256"),
    (FP8_TRITON.with_params(block_n=1 << 20), "block_n must be a power of two from 16 to 256"),
    (FP8_TRITON.with_params(num_warps=64), "num_warps must be a power of two from 1 to 32"),
    (FP8_TRITON.with_params(num_stages=100), "num_stages must be an int from 1 to 8"),
    (FP8_TRITON.with_params(waves_per_eu=1000), "waves_per_eu must be an int from 0 to 16"),
    (FUSED.with_params(num_splits=1000000000), "num_splits must be an int from 1 to 256"),
    (FUSED.with_params(num_stages=99), "num_stages must be an int from 1 to 8"),
    (FUSED.with_params(num_warps=128), "num_warps must be a power of two from 1 to 32"),
])
def test_parameters_no_gpu_can_run_fail_at_table_load(tmp_path, variant, message):
    with pytest.raises(TableError, match=r"row 2 \(batch 2, kv_len 40\): winner\.variant: .*" + message):
        runtime.load(table=_table_with(tmp_path, variant), device="cpu")
    with pytest.raises(ValueError, match=message):
        get_backend(variant.backend).build(variant, None, "cpu")  # build validates first


def test_the_largest_allowed_values_still_load(tmp_path):
    variant = FP8_TRITON.with_params(num_splits=256, block_n=256, num_warps=32, num_stages=8)
    rt = runtime.load(table=_table_with(tmp_path, variant), device="cpu")
    assert rt.dispatcher.variant_for(2, 40) == variant
