"""Configuration and call records of the fake, reset every time the fake is installed."""

import os

# CUs the fake GPU has: MI355X 256, MI300X 304 (get_mla_metadata_info_v1 sizes buffers by it).
cu_num = int(os.environ.get("MLA_TUNE_FAKE_AITER_CU_NUM", "256"))
# gfx950 (MI355X) or gfx942 (MI300X): the intra-batch split rule differs.
arch = os.environ.get("MLA_TUNE_FAKE_AITER_ARCH", "gfx950")

calls = {"mla_decode_fwd": 0, "get_mla_metadata_v1": 0, "get_mla_metadata_info_v1": 0,
         "static_per_tensor_quant": 0, "dynamic_per_tensor_quant": 0}
# work_metadata_ptrs.data_ptr() -> what get_mla_metadata_v1 built it for
metadata = {}
last_call = {}
