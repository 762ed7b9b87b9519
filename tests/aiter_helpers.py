"""The fakes of AITER's releases (tests/fakes/aiter), the shape and variants, and the direct
calls that tests/test_aiter_backend.py and tests/test_aiter_direct.py share."""

import pytest
import torch

from mla_tune import problem
from mla_tune.core import Shape, Variant
from tests.helpers import vendor_fakes

SHAPE = Shape(3, 256)  # small, yet long enough for the intra-batch builder (>= 196 tokens)
BF16_NP = Variant.make("aiter", kv="bf16", q="bf16", mode="nonpersistent", num_kv_splits=1)
BF16_PERSISTENT = Variant.make("aiter", kv="bf16", q="bf16", mode="persistent", fast_mode=True,
                               intra_batch=False, max_split_per_batch=-1, kv_granularity=16)
F3BE04A12 = "0.1.10.post4.dev78+gf3be04a12a"  # setuptools_scm's version of the runner's commit
RELEASES = ("0.1.11", "0.1.20.post1", F3BE04A12)


def install(monkeypatch, release, **config):
    """The fake of `release` (a version, or f3be04a12), installed in this process."""
    monkeypatch.setenv("MLA_TUNE_FAKE_AITER_VERSION", release)
    return vendor_fakes.install(monkeypatch, "aiter", **config)["aiter"]


@pytest.fixture(params=RELEASES, ids=("v0.1.11", "v0.1.20.post1", "f3be04a12"))
def aiter(monkeypatch, request):
    """The fake of each release in RELEASES in turn, installed in this process."""
    return install(monkeypatch, request.param)


def is_new(aiter) -> bool:
    """Whether `aiter` is the fake of 0.1.20.post1, the newest release faked."""
    return aiter.__version__ == "0.1.20.post1"


def direct_call_args(data, q=None, kv=None, index_dtype=torch.int32):
    """mla_decode_fwd's leading tensors (positional) and the rest of a call (by keyword)."""
    q_in, kv_data, _qo, _kv, _cfg = data
    batch, total = q_in.shape[0], kv_data["bf16"].shape[0]
    kv_in = kv_data["bf16"] if kv is None else kv
    o = torch.empty((batch, 16, 512), dtype=torch.bfloat16)
    return [q_in if q is None else q, kv_in.view(total, 1, 1, 576), o], dict(
        qo_indptr=torch.arange(batch + 1, dtype=index_dtype),
        kv_indptr=torch.arange(batch + 1, dtype=index_dtype) * (total // batch),
        kv_indices=torch.arange(total, dtype=index_dtype), kv_last_page_lens=torch.ones(batch, dtype=index_dtype),
        max_seqlen_q=1)


def work_buffers(aiter, batch, q_dtype, kv_dtype, **info_kwargs):
    """Empty work-list buffers of the sizes and dtypes get_mla_metadata_info_v1 asks for."""
    info = aiter.get_mla_metadata_info_v1(batch_size=batch, max_seqlen_qo=1, num_head_qo=16, q_dtype=q_dtype,
                                          kv_dtype=kv_dtype, is_sparse=False, **info_kwargs)
    return [torch.empty(size, dtype=dtype) for size, dtype in info]


def fill_work(aiter, qo, kvp, last, work, **kwargs):
    """get_mla_metadata_v1 by keyword; the builder takes work_info_set before work_indptr."""
    aiter.get_mla_metadata_v1(qo, kvp, kv_last_page_lens=last, num_heads_per_head_k=16, num_heads_k=1,
                              is_causal=True, work_metadata_ptrs=work[0], work_info_set=work[2],
                              work_indptr=work[1], reduce_indptr=work[3], reduce_final_map=work[4],
                              reduce_partial_map=work[5], **kwargs)
    return dict(work_meta_data=work[0], work_indptr=work[1], work_info_set=work[2], reduce_indptr=work[3],
                reduce_final_map=work[4], reduce_partial_map=work[5])


def bf16_persistent_call(aiter, case, shape, **extra):
    """mla_decode_fwd of bf16 `case` over a fast-mode work list built here, plus `extra`."""
    args, kwargs = direct_call_args(case)
    qo, kvp, last = kwargs["qo_indptr"], kwargs["kv_indptr"], kwargs["kv_last_page_lens"]
    work = work_buffers(aiter, shape.batch, torch.bfloat16, torch.bfloat16)
    aiter.mla.mla_decode_fwd(*args, **kwargs, **fill_work(aiter, qo, kvp, last, work), **extra)


def persistent_case(batch):
    """(shape, input) at kv_len 200 for a persistent call at this batch."""
    shape = Shape(batch, 200)
    return shape, problem.generate_input(shape.batch, shape.kv_len, seed=3, device="cpu")
