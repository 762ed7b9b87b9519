"""The one-launch q quantizer against torch's quantization, value for value.

Values, not bits: a tiny negative q that rounds to zero comes out +0 here and -0 from
torch (the rounding trick in flash_decode.round_to_mantissa drops the sign of a zero),
which no dot can tell apart. Seeded, so a failure reproduces."""

import pytest
import torch

from mla_tune.kernels.q_quant import QQuantizer
from mla_tune.problem import quantize_fp8


def _torch_static(q, q_amax, dtype):
    fp8_max = torch.finfo(dtype).max
    scale = torch.tensor([q_amax / fp8_max], dtype=torch.float32, device=q.device)
    return (q / scale).clamp(-fp8_max, fp8_max).to(dtype), scale


def _same_values(a, b):
    return torch.equal(a.float(), b.float())  # -0.0 == 0.0


@pytest.mark.parametrize("seed", [0, 36, 39])  # 36 and 39 hold values that round to -0
def test_dynamic_quantization_matches_the_leaderboard_reference(device, seed):
    torch.manual_seed(seed)
    q = torch.randn((3, 16, 576), dtype=torch.bfloat16, device=device) * 3
    quant = QQuantizer("fp8_dynamic", 3, device, torch.float8_e4m3fn)
    for x in (q, q * 0.25):  # a second call with other values recomputes the scale (no stale state)
        q8, scale = quant(x)
        ref8, ref_scale = quantize_fp8(x, torch.float8_e4m3fn)
        assert torch.equal(scale, ref_scale)
        assert _same_values(q8, ref8)


@pytest.mark.parametrize("seed", [0, 1])
def test_static_quantization_matches_torch_and_clamps(device, seed):
    torch.manual_seed(seed)
    q = torch.randn((2, 16, 576), dtype=torch.bfloat16, device=device)
    q_amax = 0.8 * float(q.abs().amax())  # some values must clamp
    quant = QQuantizer("fp8_static", 2, device, torch.float8_e4m3fn, q_amax=q_amax)
    q8, scale = quant(q)
    ref8, ref_scale = _torch_static(q, q_amax, torch.float8_e4m3fn)
    assert torch.allclose(scale, ref_scale)
    assert _same_values(q8, ref8)
    assert float(q8.float().abs().amax()) == torch.finfo(torch.float8_e4m3fn).max


def test_static_quantization_refuses_a_missing_amax(device):
    with pytest.raises(ValueError, match="q_amax"):
        QQuantizer("fp8_static", 1, device, torch.float8_e4m3fn)
