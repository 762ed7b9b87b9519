"""Reference math shared by the backend tests."""

import torch

from mla_tune import problem


def expected_output(data, variant):
    """fp32 attention on the operands the variant reads: q as its q mode quantizes it."""
    q_mode, kv = variant.get("q"), variant.get("kv")
    if q_mode != "fp8_static":
        return problem.reference(data, "bf16" if q_mode == "bf16" else "fp8", kv)
    fp8 = torch.float8_e4m3fn
    fp8_max = torch.finfo(fp8).max
    scale = variant.get("q_amax") / fp8_max
    q = (data[0].float() / scale).clamp(-fp8_max, fp8_max).to(fp8).float() * scale
    return problem.reference((q, *data[1:]), "bf16", kv)
