"""The one-launch q quantizer against torch's quantization, bit for bit."""

import torch

from mla_tune.kernels.q_quant import QQuantizer
from mla_tune.problem import quantize_fp8


def _torch_static(q, q_amax, dtype):
    fp8_max = torch.finfo(dtype).max
    scale = torch.tensor([q_amax / fp8_max], dtype=torch.float32, device=q.device)
    return (q / scale).clamp(-fp8_max, fp8_max).to(dtype), scale


def test_dynamic_quantization_matches_the_leaderboard_reference_bit_for_bit(device):
    q = torch.randn((3, 16, 576), dtype=torch.bfloat16, device=device) * 3
    quant = QQuantizer("fp8_dynamic", 3, device, torch.float8_e4m3fn)
    q8, scale = quant(q)
    ref8, ref_scale = quantize_fp8(q, torch.float8_e4m3fn)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q8.view(torch.uint8), ref8.view(torch.uint8))
    # a second call with other values recomputes the scale (no stale state)
    q2 = q * 0.25
    q8, scale = quant(q2)
    ref8, ref_scale = quantize_fp8(q2, torch.float8_e4m3fn)
    assert torch.equal(scale, ref_scale) and torch.equal(q8.view(torch.uint8), ref8.view(torch.uint8))


def test_static_quantization_matches_torch_and_clamps(device):
    q = torch.randn((2, 16, 576), dtype=torch.bfloat16, device=device)
    q_amax = 0.8 * float(q.abs().amax())  # some values must clamp
    quant = QQuantizer("fp8_static", 2, device, torch.float8_e4m3fn, q_amax=q_amax)
    q8, scale = quant(q)
    ref8, ref_scale = _torch_static(q, q_amax, torch.float8_e4m3fn)
    assert torch.allclose(scale, ref_scale)
    assert torch.equal(q8.view(torch.uint8), ref8.view(torch.uint8))
    assert float(q8.float().abs().amax()) == torch.finfo(torch.float8_e4m3fn).max


def test_static_quantization_refuses_a_missing_amax(device):
    try:
        QQuantizer("fp8_static", 1, device, torch.float8_e4m3fn)
    except ValueError as exc:
        assert "q_amax" in str(exc)
    else:
        raise AssertionError("fp8_static without q_amax was accepted")
