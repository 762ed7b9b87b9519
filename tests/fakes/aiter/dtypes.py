"""Fake aiter.dtypes: fp8 follows the arch, as AITER's does (aiter/utility/dtypes.py):
OCP e4m3fn on gfx950 (MI355X), e4m3fnuz on gfx942 (MI300X)."""

import torch
from aiter import _state

fp8 = torch.float8_e4m3fnuz if _state.arch.startswith("gfx942") else torch.float8_e4m3fn
fp8_e8m0 = torch.float8_e8m0fnu
fp4x2 = torch.float4_e2m1fn_x2
bf16 = torch.bfloat16
fp16 = torch.float16
fp32 = torch.float32
i8 = torch.int8
i32 = torch.int32
u8 = torch.uint8
