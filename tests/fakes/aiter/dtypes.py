"""Fake aiter.dtypes: fp8 follows the arch, as AITER's does (aiter/utility/dtypes.py):
OCP e4m3fn on gfx950 (MI355X), e4m3fnuz on gfx942 (MI300X)."""

import torch
from aiter import _state

fp8 = torch.float8_e4m3fnuz if _state.arch.startswith("gfx942") else torch.float8_e4m3fn
bf16 = torch.bfloat16
