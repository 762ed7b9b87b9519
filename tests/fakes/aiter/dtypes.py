"""Fake aiter.dtypes for gfx950 (MI355X): fp8 is OCP e4m3fn there (e4m3fnuz on gfx942)."""

import torch

fp8 = torch.float8_e4m3fn
fp8_e8m0 = torch.float8_e8m0fnu
fp4x2 = torch.float4_e2m1fn_x2
bf16 = torch.bfloat16
fp16 = torch.float16
fp32 = torch.float32
i8 = torch.int8
i32 = torch.int32
u8 = torch.uint8
