"""The Gluon decode's checks that tests/test_gluon_decode.py and tests/test_gluon_ws.py share:
`gluon_variant`, `kernel_math`, `check` against it and the exact answer, `gluon_gpu`, and
direct calls."""

import functools
import math

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import gluon_fused
from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, Shape, Variant
from mla_tune.kernels import gluon_decode
from tests.helpers import DecodeBuffers, rel_l2, unavailable

BASE = dict(kv="fp8", q="fp8_dynamic", block_n=64, num_stages=3, num_splits=1, v_path="ss16")


def gluon_variant(**params) -> Variant:
    """gluon_fused's BASE variant with `params` changed."""
    return Variant.make("gluon_fused", **{**BASE, **params})


def kernel_math(data, q_scale_per: str = "head") -> torch.Tensor:
    """_gd_decode_kernel's arithmetic in torch, (batch, 16, 512) fp32 holding bf16 values.
    q_scale_per "tensor" swaps in the leaderboard reference's q scale (for the CPU test)."""
    q, kv_data, _qo_indptr, kv_indptr, _config = data
    kv8, kv_scale = kv_data["fp8"]
    k_all = kv8.reshape(-1, QK_DIM).float()  # the fp8 codes; the scale is applied as the kernel does
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True) if q_scale_per == "head" else qf.abs().amax().expand(*q.shape[:2], 1)
    q_scale = amax.clamp(min=1e-12) / 448.0
    q8 = (qf / q_scale).to(torch.float8_e4m3fn).float()
    col_scale = q_scale * (kv_scale * (SM_SCALE * math.log2(math.e)))  # scores in log2 units
    bounds = kv_indptr.tolist()
    out = torch.empty((q.shape[0], 16, V_DIM), dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        k = k_all[bounds[b] : bounds[b + 1]]
        s = (q8[b] @ k.T) * col_scale[b]
        p = torch.exp2(s - s.amax(-1, keepdim=True))
        o = p.half().float() @ k[:, :V_DIM]  # the PV MMA reads P in fp16; l sums it in fp32
        out[b] = (o * (kv_scale / p.sum(-1, keepdim=True))).to(torch.bfloat16).float()
    return out


# The independent check: the kernel's distance from the exact answer may exceed the leaderboard
# reference's by this factor (a q scale per head is no coarser than one per tensor).
ACCURACY_FACTOR = 1.25


def expect(data) -> dict:
    """The two expectations for `data` (computed once where several outputs share it):
    kernel_math, and the bound on the relative L2 distance from the exact answer."""
    exact = problem.reference(data, "bf16", "bf16")
    return dict(math=kernel_math(data), exact=exact,
                bound=ACCURACY_FACTOR * rel_l2(problem.reference(data), exact))


def check(out, exp: dict, what: str) -> None:
    """strict vs kernel_math, and relative L2 vs the exact answer within the bound; the
    message carries both numbers."""
    result = problem.check(out, exp["math"], problem.RULES["strict"])
    err, bound = rel_l2(out, exp["exact"]), exp["bound"]
    assert result.passed, f"{what}: vs kernel_math {result.reason}; rel L2 vs exact {err:.2e} (bound {bound:.2e})"
    assert err <= bound, f"{what}: rel L2 vs exact {err:.2e} > {bound:.2e} (strict vs kernel_math: ok)"


def gluon_gpu(test):
    """Marks a test `gpu`; where gluon_fused cannot run (its unavailable_reason, asked when
    the test runs, so that collecting the module touches no GPU) it goes through
    `unavailable`: a skip, a failure in require mode on a CUDA GPU."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        reason = gluon_fused.unavailable_reason()
        if reason is not None:
            unavailable(reason)
        return test(*args, **kwargs)

    return pytest.mark.gpu(run)


def check_backend(variant: Variant, shape: Shape, data, what: str, repeats: int = 1):
    """The backend's output for `variant` on the GPU, checked (`check`) and bit-identical on
    `repeats` more calls."""
    run = gluon_fused.build(variant, shape, "cuda")
    first = run(*data[:4]).clone()
    check(first, expect(data), what)
    for _ in range(repeats):
        assert torch.equal(first, run(*data[:4])), f"{what}: a later call differs"
    return first


def run_gluon(data, bufs: DecodeBuffers, *, num_splits: int, reduce: str, v_halves: int = 1,
              block_n: int = 64, num_stages: int = 2, v_path: str = "rs8",
              ws: int = 0) -> torch.Tensor:
    """One gluon_decode call on the leaderboard inputs; the output is NaN-filled first, so
    an element no program writes fails the check."""
    q, kv_data, _qo, kv_indptr, _config = data
    kv8, kv_scale = kv_data["fp8"]
    kv = kv8.view(-1, QK_DIM)
    out = bufs.out[: q.shape[0]]
    out.fill_(float("nan"))
    gluon_decode.gluon_decode(
        q, gluon_decode.gd_kv_descriptor(kv, block_n), kv_scale, kv_indptr, out, bufs.part_o, bufs.part_lse,
        num_splits=num_splits, block_n=block_n, num_stages=num_stages, v_path=v_path,
        sm_scale_log2=SM_SCALE * math.log2(math.e), reduce=reduce, v_halves=v_halves, count=bufs.count,
        flag=bufs.flag, sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
        ws=ws)
    return out


def run_twice(data, *, num_splits: int, **opts) -> torch.Tensor:
    """Two run_gluon calls (opts: its keywords) on fresh buffers; the first's output, which
    the second repeats bit for bit."""
    bufs = DecodeBuffers(data[0].shape[0], num_splits, "cuda")
    first = run_gluon(data, bufs, num_splits=num_splits, **opts).clone()
    again = run_gluon(data, bufs, num_splits=num_splits, **opts)
    assert torch.equal(first, again), f"{num_splits} splits, {opts}: a second call differs"
    return first
