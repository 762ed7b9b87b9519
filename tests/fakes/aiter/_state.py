"""Configuration and call records of the fake, reset every time the fake is installed.

Environment (read at import; vendor_fakes.install re-imports the fake for every test):
  MLA_TUNE_FAKE_AITER_VERSION  the release imitated: 0.1.11 (default) or 0.1.20.post1
  MLA_TUNE_FAKE_AITER_CU_NUM   CUs of the fake GPU: MI355X 256 (default), MI300X 304
  MLA_TUNE_FAKE_AITER_ARCH     gfx950 (default, MI355X) or gfx942 (MI300X)
"""

import os

from aiter._version import __version__

RELEASES = ("0.1.11", "0.1.20.post1")
if __version__ not in RELEASES:
    raise ImportError(f"the fake aiter imitates {' or '.join(RELEASES)}, not {__version__!r}; "
                      "set MLA_TUNE_FAKE_AITER_VERSION to one of them")
release = __version__
# What 0.1.20.post1 has and 0.1.11 lacks: max_split_per_batch on the info call,
# get_mla_decode_fwd_max_splits, the context-parallel and `causal` arguments, the bf16
# persistent -> non-persistent fallback (0.1.18), the OPUS stage 1 and the Gluon decode.
new_api = release == "0.1.20.post1"

cu_num = int(os.environ.get("MLA_TUNE_FAKE_AITER_CU_NUM", "256"))
# the intra-batch split rule and the fp8 format differ by arch
arch = os.environ.get("MLA_TUNE_FAKE_AITER_ARCH", "gfx950")

calls = {"mla_decode_fwd": 0, "get_mla_metadata_v1": 0, "get_mla_metadata_info_v1": 0,
         "static_per_tensor_quant": 0, "dynamic_per_tensor_quant": 0,
         "mla_decode_fwd_opus_stage1": 0, "mla_gluon": 0}
# work_metadata_ptrs.data_ptr() -> what get_mla_metadata_v1 built it for
metadata = {}
last_call = {}
