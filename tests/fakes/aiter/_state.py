"""Configuration and call records of the fake, reset every time the fake is installed.

Environment (read at import; vendor_fakes.install re-imports the fake for every test):
  MLA_TUNE_FAKE_AITER_VERSION  the build imitated: 0.1.11 (default), 0.1.20.post1, or
                               f3be04a12 (the contest runner's build, an ancestor of 0.1.11
                               with its Python API; its version 0.1.10.post4.dev78+gf3be04a12a)
  MLA_TUNE_FAKE_AITER_CU_NUM   CUs of the fake GPU: MI355X 256 (default), MI300X 304
  MLA_TUNE_FAKE_AITER_ARCH     gfx950 (default, MI355X) or gfx942 (MI300X)
"""

import os

from aiter._version import __version__

# ROCm/aiter f3be04a12a (2026-03-04, "update_test (#2156)"), the commit the contest's runner
# built: seven commits before tag v0.1.11 (c4a3ff2a04), with the same aiter/mla.py,
# aiter/ops/attention.py, csrc/py_itfs_cu/asm_mla.cu and pybind declarations (read at both
# commits); what v0.1.11 adds is #2106, a fix to the v1_2 (fast-mode) builder for fp8 KV
# tails, which the fake does not model.
F3BE04A12 = "0.1.10.post4.dev78+gf3be04a12a"
RELEASES = ("0.1.11", "0.1.20.post1", F3BE04A12)
if __version__ not in RELEASES:
    raise ImportError(f"the fake aiter imitates {', '.join(RELEASES)}, not {__version__!r}; "
                      "set MLA_TUNE_FAKE_AITER_VERSION to one of them (or f3be04a12)")
release = __version__
# What 0.1.20.post1 has and 0.1.11 (and f3be04a12) lack: max_split_per_batch on the info
# call, get_mla_decode_fwd_max_splits, the context-parallel and `causal` arguments, `lse`
# (after `output`, before `q_scale`: 0.1.12) in mla_decode_stage1_asm_fwd, the required
# `num_kv_splits` of mla_reduce_v1 (0.1.16), the bf16 persistent -> non-persistent
# fallback (#4144, 0.1.18), the OPUS stage 1 and the Gluon decode.
new_api = release == "0.1.20.post1"

cu_num = int(os.environ.get("MLA_TUNE_FAKE_AITER_CU_NUM", "256"))
# the intra-batch split rule and the fp8 format differ by arch
arch = os.environ.get("MLA_TUNE_FAKE_AITER_ARCH", "gfx950")

calls = {"mla_decode_fwd": 0, "get_mla_metadata_v1": 0, "get_mla_metadata_info_v1": 0,
         "static_per_tensor_quant": 0, "dynamic_per_tensor_quant": 0,
         "mla_decode_fwd_opus_stage1": 0, "mla_gluon": 0,
         "mla_decode_stage1_asm_fwd": 0, "mla_reduce_v1": 0}
# work_metadata_ptrs.data_ptr() -> what get_mla_metadata_v1 built it for
metadata = {}
# splitData.data_ptr() -> what mla_decode_stage1_asm_fwd computed, for mla_reduce_v1
partials = {}
last_call = {}
