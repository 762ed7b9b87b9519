"""The Gluon decode: its backend's parameters, guard and warp specialization (`ws`: register
requests, candidates, launch) on the CPU (Gluon has no CPU interpreter; the split reduction is
plain Triton and runs here), the kernel on the H200 under `strict` against `kernel_math`, no
further from the exact answer than the leaderboard's reference.
"""

import functools
import importlib.util
import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import gluon_fused
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, QK_DIM, SM_SCALE, V_DIM, Shape, Variant
from mla_tune.gpu import detect, fake_platform
from mla_tune.kernels import gluon_decode
from mla_tune.serving.inputs import reference_q
from tests.helpers import DecodeBuffers, ragged_input, rel_l2, unavailable

BASE = dict(kv="fp8", q="fp8_dynamic", block_n=64, num_stages=3, num_splits=1, v_path="ss16")


def _variant(**params) -> Variant:
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


def run_gluon(data, bufs: DecodeBuffers, *, num_splits: int, reduce: str, v_halves: int = 1, block_n: int = 64,
              num_stages: int = 2, v_path: str = "rs8", ws: int = 0) -> torch.Tensor:
    """One gluon_decode call on the leaderboard inputs; the output is NaN-filled first, so
    an element no program writes fails the check."""
    q, kv_data, _qo, kv_indptr, _config = data
    kv8, kv_scale = kv_data["fp8"]
    out = bufs.out[: q.shape[0]]
    out.fill_(float("nan"))
    gluon_decode.gluon_decode(
        q, gluon_decode.gd_kv_descriptor(kv8.view(-1, QK_DIM), block_n), kv_scale, kv_indptr, out, bufs.part_o,
        bufs.part_lse, num_splits=num_splits, block_n=block_n, num_stages=num_stages, v_path=v_path,
        sm_scale_log2=SM_SCALE * math.log2(math.e), reduce=reduce, v_halves=v_halves, count=bufs.count,
        flag=bufs.flag, sm_count=torch.cuda.get_device_properties(0).multi_processor_count, ws=ws)
    return out


def run_twice(data, *, num_splits: int, **opts) -> torch.Tensor:
    """Two run_gluon calls (opts: its keywords) on fresh buffers; the first's output, which
    the second repeats bit for bit."""
    bufs = DecodeBuffers(data[0].shape[0], num_splits, "cuda")
    first = run_gluon(data, bufs, num_splits=num_splits, **opts).clone()
    again = run_gluon(data, bufs, num_splits=num_splits, **opts)
    assert torch.equal(first, again), f"{num_splits} splits, {opts}: a second call differs"
    return first


def test_validate_accepts_the_base_and_names_each_bad_parameter():
    assert not {"q_load", "part", "reduce", "ws"} & set(_variant().p)  # defaults: left out
    for ok in [dict(), dict(block_n=128, num_stages=2, v_path="rs8", num_splits=4), dict(v_path="rs8"),
               *(dict(v_path="rs8", num_stages=4, ws=ws) for ws in (0, 1, 2)), dict(v_path="ss16a", ws=1),
               dict(num_splits=4), dict(num_splits=4, q_load="first", part="bf16"), dict(reduce="spin")]:
        gluon_fused.validate(_variant(**ok))
    for params, match in [
        (dict(block_n=32), r"block_n=32 is not allowed; allowed: 64, 128"),
        (dict(v_path="ss8t"), r"v_path=ss8t is not allowed; allowed: ss16, rs16, rs8, ss16a"),
        (dict(kv="bf16"), r"kv=bf16 is not allowed; allowed: fp8"),
        (dict(q="bf16"), r"q=bf16 is not allowed"),
        (dict(num_stages=1), r"num_stages=1 is not allowed"),
        (dict(num_stages=5), r"num_stages=5 is not allowed; num_stages must be an int from 2 to 4"),
        (dict(num_splits=0), r"num_splits=0 is not allowed"),
        (dict(num_splits=257), r"num_splits=257 is not allowed; num_splits must be an int from 1 to 256"),
        (dict(num_warps=4), r"unknown parameter num_warps"),
        (dict(block_n=128, num_stages=3), r"needs 293144 B of shared memory .* use fewer stages"),
        (dict(num_stages=4, v_path="ss16a"), r"needs 241952 B of shared memory"),
        (dict(q_load="thrice"), "q_load=thrice is not allowed; allowed: twice, first"),
        (dict(part="fp16"), "part=fp16 is not allowed; allowed: fp32, bf16"),
        (dict(reduce="last"), "reduce"),  # last: not offered, slower wherever measured
        *((dict(v_path="rs8", ws=bad), rf"ws={shown} is not allowed; allowed: 0, 1, 2")
          for bad, shown in [(3, "3"), ("two", "two"), (True, "true")]),
        # ws 2 adds a second consumer's P^T and four fp16 boxes: ss16a at 3 stages does not fit
        (dict(v_path="ss16a", ws=2), r"needs 268944 B of shared memory .*ws 2\), over the 232448 B"),
    ]:
        with pytest.raises(ValueError, match=match):
            gluon_fused.validate(_variant(**params))
    with pytest.raises(ValueError, match="missing parameter v_path"):
        gluon_fused.validate(Variant.make("gluon_fused", **{k: v for k, v in BASE.items() if k != "v_path"}))


def test_shared_memory_and_residency_estimates_match_the_compilers_figures():
    # Triton 3.6 offline compiles for sm_90a (docs/perf.md): the backend's figure and the kernel module's
    smem, gf, per_sm = gluon_decode.gd_smem_bytes, gluon_fused._gf_smem_bytes, gluon_decode.gd_ctas_per_sm
    assert (gf(64, 3), gf(64, 4), gf(64, 3, "ss16a")) == (151832, 192800, 200984)
    assert (smem(64, 2, "rs8"), smem(64, 3, "rs8", 2), smem(64, 2, "ss16", 2)) == (94480, 135448, 110864)
    assert smem(64, 2, "ss16a") == gf(64, 2, "ss16a") == 160016
    assert smem(64, 2, "ss16a", 2) == 127248  # two fp16 box buffers, not four
    assert smem(128, 2, "ss16") == gf(128, 2) == 211216
    assert [per_sm(64, st, vp) for vp, st in [("rs8", 2), ("ss16", 2), ("rs8", 3), ("ss16a", 2)]] == [2, 2, 1, 1]
    # with warp specialization (ws 1, ws 2)
    assert [smem(64, st, "rs8", 1, 1) for st in (2, 3, 4, 5)] == [94564, 135548, 176516, 217500]
    assert [smem(64, st, "rs8", 1, 2) for st in (2, 3, 4, 5)] == [96880, 137872, 178832, 219824]
    assert smem(64, 2, "ss16", 1, 1) == 110948 and smem(128, 2, "ss16", 1, 1) == 211300
    assert [smem(64, st, "ss16", 1, 2) for st in (2, 3, 4)] == [129648, 170640, 211600]
    assert smem(64, 4, "rs16", 1, 2) == 211600 and smem(128, 2, "rs8", 1, 2) == 182896
    assert smem(64, 2, "ss16a", 2, 2) == 162416 and smem(64, 3, "ss16a", 1, 2) == 268944
    assert smem(64, 3, "ss16a", 1, 1) == 201084 and smem(64, 4, "rs16", 1, 1) == 192900
    assert gf(64, 3, "ss16", 2) == smem(64, 3, "ss16", 1, 2) == 170640  # (gf counts one fp16 box for rs8 too)
    assert [per_sm(64, 2, "rs8", 1, ws) for ws in (0, 1, 2)] == [2, 2, 1]  # ws 2: registers
    assert per_sm(64, 3, "rs8", 1, 1) == 1  # shared memory
    # registers per CTA at launch: maxnreg x all warps fits the file the given times
    for ws in (1, 2):
        warps = 4 * (1 + len(gluon_decode.GD_WS_WORKER_REGS[ws]))
        assert gluon_decode.GD_WS_MAXNREG[ws] * 32 * warps * gluon_decode.GD_WS_CTAS_PER_SM_BY_REGS[ws] <= 65536


def test_candidates_pass_validate_and_never_split_past_the_tiles():
    for shape, max_splits in [(Shape(4, 1024), 16), (Shape(1, 17), 1), (Shape(256, 8192), 32)]:
        found = gluon_fused.candidates(shape, {}, None)
        assert found and len(found) == len(set(found))
        for v in found:
            gluon_fused.validate(v)
        assert max(v.get("num_splits") for v in found) == max_splits
    wide = gluon_fused.candidates(Shape(4, 1024), {"block_n": [64, 128], "num_stages": [2, 3, 4]}, None)
    assert {(v.get("block_n"), v.get("num_stages"), v.get("v_path")) for v in wide} == {
        (64, 2, "ss16"), (64, 3, "ss16"), (64, 4, "ss16"), (128, 2, "ss16"),
        (64, 2, "rs16"), (64, 3, "rs16"), (64, 4, "rs16"), (128, 2, "rs16"),
        (64, 2, "ss16a"), (64, 3, "ss16a")}  # shared memory rules out the others
    space = {"num_stages": [2], "v_path": ["rs8"], "q_load": ["twice", "first"], "part": ["fp32", "bf16"]}
    found = gluon_fused.candidates(Shape(4, 1024), space, None)
    by = {(v.get("num_splits"), v.get("q_load", "twice"), v.get("part", "fp32")) for v in found}
    assert (1, "first", "fp32") in by and (16, "first", "bf16") in by
    assert not any(ns == 1 and part == "bf16" for ns, _q, part in by)  # one split writes no partials
    assert all("q_load=twice" not in str(v) and "part=fp32" not in str(v) for v in found)  # defaults left out
    with pytest.raises(ValueError, match=r"unknown search-space keys \['tok_m'\]"):
        gluon_fused.candidates(Shape(4, 1024), {"tok_m": [True]}, None)


def test_unavailable_reason_says_why_the_kernel_cannot_run_here():
    reason = gluon_fused.unavailable_reason()
    assert gluon_decode.gluon is None or gluon_decode.GD_UNAVAILABLE is None  # every name there
    if gluon_decode.GD_UNAVAILABLE is not None:
        assert reason == gluon_decode.GD_UNAVAILABLE and "triton 3.6" in reason
    elif not torch.cuda.is_available():  # the version is fine (3.6 or 3.9): the GPU is missing
        assert reason == "gluon_fused needs an NVIDIA sm_90 GPU (Gluon has no CPU interpreter)"
    if reason is not None:  # always here on the CPU; on the H200 the GPU tests build it
        with pytest.raises(ValueError, match=r"gluon_fused cannot run here: "):
            gluon_fused.build(_variant(), Shape(1, 64), "cpu")


def _fresh_gluon_decode(name: str):
    """kernels/gluon_decode.py imported anew, as `name`, under the test's monkeypatches."""
    spec = importlib.util.spec_from_file_location(name, Path(gluon_decode.__file__))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_module_imports_without_gluon_and_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton.experimental.gluon", None)  # the import raises
    module = _fresh_gluon_decode("gluon_decode_without_gluon")
    assert module.gluon is None
    assert module.GD_UNAVAILABLE.startswith("this Triton (")
    assert "has no usable Gluon" in module.GD_UNAVAILABLE and module.GD_UNAVAILABLE.endswith("install triton 3.6")
    with pytest.raises(RuntimeError, match="no usable Gluon"):
        module.gluon_decode(None, None, None, None, None, None, None, num_splits=1, block_n=64,
                            num_stages=3, v_path="ss16", sm_scale_log2=1.0)


def test_a_gluon_without_a_name_the_kernel_calls_says_which(monkeypatch):
    if gluon_decode.gluon is None:
        pytest.skip(f"no Gluon in this Triton: {gluon_decode.GD_UNAVAILABLE}")
    from triton.experimental.gluon.language.nvidia.hopper import tma

    for name in ("async_load", "async_copy_global_to_shared"):  # 3.9's name and 3.6's
        monkeypatch.delattr(tma, name, raising=False)
    module = _fresh_gluon_decode("gluon_decode_without_a_tma_load")
    assert "lacks tma.async_load or tma.async_copy_global_to_shared, which the Gluon kernel calls" in (
        module.GD_UNAVAILABLE)
    assert module.GD_UNAVAILABLE.endswith("install triton 3.6 (run on the H200) or 3.9 (compiled for sm_90)")


def test_the_modules_pass_the_exporters_rules_beside_every_backend():
    from mla_tune.backends import BACKEND_MODULES
    from mla_tune.export.modules import module_closure, prepare_modules

    roots = [(module, name) for name, module in BACKEND_MODULES.items()]
    modules = module_closure(roots + [("mla_tune.backends.gluon_fused", "gluon_fused")])
    assert "mla_tune.kernels.gluon_decode" in [m.name for m in modules]
    hoisted = prepare_modules(modules)  # refuses a name collision or a vendor import at top level
    assert not any("gluon" in line for line in hoisted)  # the guarded import stays in its try


def test_the_split_reduction_combines_partials_by_their_lse(device):
    batch, splits = 2, 3
    gen = torch.Generator().manual_seed(3)
    part_o = torch.randn(batch, splits, 16, 512, generator=gen)
    lse = torch.randn(batch, splits, 16, generator=gen) * 4
    lse[1, 2] = float("-inf")  # an empty split
    out = torch.empty(batch, 16, 512, dtype=torch.bfloat16, device=device)
    gluon_decode.gd_reduce(part_o.to(device).flatten(), lse.to(device).flatten(), out, splits)
    w = torch.softmax(lse * torch.log(torch.tensor(2.0)), dim=1)  # 2^lse, normalized over splits
    ref = (w[..., None] * part_o).sum(1)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=1e-2, atol=1e-2)


def test_kernel_math_is_the_reference_math_but_for_the_q_scale_and_meets_the_bound():
    for batch, kv_len in [(1, 1), (4, 17), (1, 300)]:
        data = problem.generate_input(batch, kv_len, seed=batch * 31 + kv_len, device="cpu")
        ref = problem.reference(data)
        # With the reference's per-tensor q scale the emulation is the reference up to P in
        # fp16 and bf16 output: strict passes, so its other steps (log2 units, scales) are right.
        per_tensor = problem.check(kernel_math(data, "tensor"), ref, problem.RULES["strict"])
        assert per_tensor.passed, f"{batch}x{kv_len}: {per_tensor.reason}"
        ours = kernel_math(data)
        check(ours, expect(data), f"kernel_math at {batch}x{kv_len}")
        if kv_len == 17:  # why the strict expectation is kernel_math, not the reference
            assert problem.check(ours, ref, problem.RULES["strict"]).mismatch > 0.10
    # The check can fail: a mask that drops each sequence's last token (an off-by-one at the
    # partial tile) is caught.
    q, kv_data, qo_indptr, kv_indptr, config = data = problem.generate_input(4, 17, seed=5, device="cpu")
    kv8, kv_scale = kv_data["fp8"]
    packed = kv8.reshape(4, 17, -1)[:, :16].reshape(64, 1, QK_DIM)
    off_by_one = kernel_math((q, {"fp8": (packed, kv_scale)}, qo_indptr, torch.arange(5) * 16, config))
    with pytest.raises(AssertionError, match="vs kernel_math"):
        check(off_by_one, expect(data), "the last token dropped")


def test_the_backend_passes_ws_q_load_and_the_partials_type_to_the_kernel_or_refuses_them(monkeypatch):
    seen = []
    monkeypatch.setattr(gluon_fused, "unavailable_reason", lambda: None)
    monkeypatch.setattr(gluon_fused, "gd_kv_descriptor", lambda kv, block_n: ("desc", block_n))
    monkeypatch.setattr(gluon_fused, "gluon_decode", lambda *args, **kwargs: seen.append((args, kwargs)))
    data = problem.generate_input(2, 256, seed=3, device="cpu")
    for params, ws, q_load, stages, part in [
        (dict(), 0, "twice", 3, torch.float32),
        (dict(q_load="first"), 0, "first", 3, torch.float32),
        (dict(num_splits=2, part="bf16"), 0, "twice", 3, torch.bfloat16),
        (dict(v_path="rs8"), 0, "twice", 3, torch.float32),
        (dict(v_path="rs8", ws=1), 1, "twice", 3, torch.float32),
        (dict(v_path="rs8", ws=2, num_stages=4, num_splits=2), 2, "twice", 4, torch.float32),
    ]:
        out = gluon_fused.build(_variant(**params), Shape(2, 256), "cpu")(*data[:4])
        args, kwargs = seen[-1]
        assert out.shape == (2, 16, V_DIM) and args[5].dtype == part  # part_o, the sixth argument
        assert (kwargs["ws"], kwargs["q_load"], kwargs["num_stages"]) == (ws, q_load, stages)
    with pytest.raises(ValueError, match="one split writes no partials"):
        gluon_fused.build(_variant(part="bf16"), Shape(1, 64), "cpu")
    with pytest.raises(ValueError, match="one split has nothing to reduce"):  # candidates() never offer it
        gluon_fused.build(_variant(num_splits=1, v_path="rs8", reduce="spin"), Shape(3, 17), "cpu")


# ------------------------------------------------------------- warp specialization (ws)
def test_the_kernels_register_requests_are_the_modules_constants():
    """gl.warp_specialize takes its warps and registers as literals in the kernel (a jitted
    function reads no dict): they must be GD_WS_WORKER_REGS."""
    kernel = gluon_decode._gd_decode_kernel
    source = inspect.getsource(getattr(kernel, "fn", kernel))
    one, two = gluon_decode.GD_WS_WORKER_REGS[1], gluon_decode.GD_WS_WORKER_REGS[2]
    assert f"], [1], [{one[0]}])" in source
    assert f"], [4, 1], [{two[0]}, {two[1]}])" in source


def test_candidates_offer_ws_only_where_asked_and_where_it_can_pay():
    h200 = fake_platform("H200")
    sm = h200.sm_count
    for shape in (Shape(4, 1024), Shape(32, 8192), Shape(256, 1024)):
        plain = gluon_fused.candidates(shape, {}, h200)
        assert plain and all("ws" not in v.p for v in plain)  # the default space offers no ws
        space = {"ws": [0, 1, 2], "num_stages": [2, 3, 4], "v_path": ["rs8"], "reduce": ["launch", "spin"]}
        found = gluon_fused.candidates(shape, space, h200)
        assert len(found) == len(set(found))
        ws0 = [v for v in found if "ws" not in v.p]
        assert 0 not in {v.p.get("ws") for v in found}  # ws 0 is left out of the variant
        assert {str(v) for v in ws0} >= {str(v) for v in gluon_fused.candidates(shape, {**space, "ws": [0]}, h200)}
        assert {v.p.get("ws") for v in found} >= {None, 1}
        ws2 = [v for v in found if v.p.get("ws") == 2]
        for v in found:
            gluon_fused.validate(v)
            if v in ws2:
                tiles = math.ceil(shape.kv_len / 64)
                assert v.p["num_stages"] >= 3 and math.ceil(tiles / v.p["num_splits"]) >= 2
                assert shape.batch * v.p["num_splits"] <= sm
        assert bool(ws2) == (shape.batch != 256)  # 256 programs: two waves at one CTA per SM
    # ws 2's rules, each with its reason
    p = dict(_variant(v_path="rs8", ws=2, num_stages=2, num_splits=4).p)
    assert "one ring slot" in gluon_fused._gf_ws_reason(p, Shape(4, 8192), sm)
    assert "second consumer idle" in gluon_fused._gf_ws_reason({**p, "num_stages": 3, "num_splits": 16},
                                                               Shape(4, 1024), sm)
    assert "one CTA per SM" in gluon_fused._gf_ws_reason({**p, "num_stages": 3}, Shape(64, 1024), sm)
    assert gluon_fused._gf_ws_reason({**p, "num_stages": 3}, Shape(64, 1024), 0) is None  # no GPU: not judged
    assert gluon_fused._gf_ws_reason({**p, "ws": 1}, Shape(4, 1024), sm) is None


def test_gluon_decode_launches_with_ws_its_register_budget_and_q_load_and_refuses_bad_values(monkeypatch):
    calls = []

    class Kernel:  # stands in for the jitted kernel: kernel[grid](*args, **kwargs) records (grid, kwargs)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, kwargs)) or "compiled"

    monkeypatch.setattr(gluon_decode, "GD_UNAVAILABLE", None)
    monkeypatch.setattr(gluon_decode, "_gd_decode_kernel", Kernel())
    q = torch.zeros(3, 16, QK_DIM)
    indptr = torch.arange(4, dtype=torch.int32)
    common = dict(num_splits=1, block_n=64, num_stages=4, v_path="rs8", sm_scale_log2=1.0)
    for ws in (0, 1, 2):
        assert gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, ws=ws, **common) == "compiled"
    (g0, k0), (g1, k1), (g2, k2) = calls
    assert g0 == g1 == g2 == (1, 3)
    assert "WS" not in k0 and "maxnreg" not in k0  # ws 0 passes neither
    assert (k1["WS"], k1["maxnreg"], k2["WS"], k2["maxnreg"]) == (1, 128, 2, 168)
    assert all(k["num_warps"] == 4 for k in (k0, k1, k2))
    with pytest.raises(ValueError, match="ws must be one of"):
        gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, ws=4, **common)
    with pytest.raises(ValueError, match="q_load must be one of twice, first; got 'once'"):
        gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, q_load="once", **common)
    with pytest.raises(ValueError, match="part_o must be float32 or bfloat16"):
        gluon_decode.gluon_decode(q, None, None, indptr, None, torch.empty(4, dtype=torch.float16), None,
                                  **{**common, "num_splits": 2})
    assert len(calls) == 3  # refused before any launch
    assert "Q_LOAD" not in k0  # q_load "twice", the default, passes no Q_LOAD
    gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, q_load="first", **common)
    assert calls[-1][1]["Q_LOAD"] == 1


# ----------------------------------------------------------------------------- H200
GPU_VARIANTS = [dict(block_n=block_n, num_stages=stages, v_path=v_path) for block_n, stages, v_path in
                [(64, 3, "ss16"), (64, 4, "rs16"), (64, 2, "rs8"), (128, 2, "ss16"), (64, 3, "ss16a")]]


@gluon_gpu
@pytest.mark.parametrize("params", GPU_VARIANTS, ids=lambda p: f"{p['block_n']}-{p['num_stages']}-{p['v_path']}")
@pytest.mark.parametrize("kv_len", [1, 17, 1024, 3000])
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_gluon_decode_matches_the_reference_under_strict(batch, kv_len, params):
    shape = Shape(batch, kv_len)
    data = problem.generate_input(batch, kv_len, seed=batch * 31 + kv_len, device="cuda")
    tiles = -(-kv_len // params["block_n"])
    for splits in sorted({1, min(tiles, max(1, 128 // batch)), min(tiles, 3)}):
        variant = _variant(num_splits=splits, **params)
        check_backend(variant, shape, data, f"{variant} at {shape}")


@gluon_gpu
def test_the_backend_takes_the_models_softmax_scale():
    """At DeepSeek-V3's scale, against the reference with q quantized per (sequence, head) as
    the kernel does; the same answer fails strict against the default scale's reference."""
    shape = Shape(4, 1024)
    variant = gluon_fused.candidates(shape, {}, detect())[0]
    data = problem.generate_input(shape.batch, shape.kv_len, seed=9, device="cuda")
    out = gluon_fused.build(variant, shape, "cuda", sm_scale=CORE_DEEPSEEK_V3_SCALE)(*data[:4])
    torch.cuda.synchronize()
    rowwise = (reference_q(data[0], "fp8_row"), *data[1:])  # fp32 q: reference("bf16", ...) takes it as is
    ref = problem.reference(rowwise, "bf16", "fp8", sm_scale=CORE_DEEPSEEK_V3_SCALE)
    assert problem.check(out, ref, problem.RULES["strict"]).passed
    assert not problem.check(out, problem.reference(rowwise, "bf16", "fp8"), problem.RULES["strict"]).passed


# 4 splits on a ragged batch: the 1- and 17-token sequences leave splits empty.
RAGGED_VARIANTS = {
    **{v_path: dict(v_path=v_path) for v_path in ("ss16", "rs16", "rs8", "ss16a")},
    **{f"bf16-partials-{reduce}": dict(num_stages=2, v_path="rs8", part="bf16", q_load="first",
                                       reduce=reduce) for reduce in ("launch", "spin")},
}


@gluon_gpu
@pytest.mark.parametrize("params", list(RAGGED_VARIANTS.values()), ids=list(RAGGED_VARIANTS))
def test_gluon_decode_ragged_batch_with_empty_splits(params):
    data = ragged_input([1, 17, 3000, 64, 130], seed=9, device="cuda")
    variant = _variant(num_splits=4, **params)
    check_backend(variant, Shape(5, 3000), data, str(variant), repeats=0)


# (batch, kv_len, seed, params) of rs8: spin at 2 stages, two CTAs per SM, so 64 x 4 splits = 256
# programs are resident on 132 SMs (one split, nothing to reduce: the CPU test of build refuses
# it); then ws 1 and 2. Two more calls: the barrier's count and flag are left ready for the next.
BACKEND_REPEATS = [(b, n, b + n, dict(num_splits=splits, num_stages=2, reduce="spin"))
                   for b, n, splits in [(4, 1024, 16), (4, 8192, 32), (32, 1024, 4), (64, 8192, 4), (5, 3000, 8)]]
BACKEND_REPEATS += [(32, 1024, 77, params) for params in [dict(ws=1, num_stages=2, num_splits=4, reduce="spin"),
                                                          dict(ws=2, num_stages=4, num_splits=4, reduce="spin"),
                                                          dict(ws=2, num_stages=3, num_splits=1)]]


@gluon_gpu
@pytest.mark.parametrize("batch, kv_len, seed, params", BACKEND_REPEATS, ids=str)
def test_the_backend_with_reduce_spin_or_ws_matches_the_reference_and_repeats(batch, kv_len, seed, params):
    data = problem.generate_input(batch, kv_len, seed=seed, device="cuda")
    check_backend(_variant(v_path="rs8", **params), Shape(batch, kv_len), data, f"{params} at {batch}x{kv_len}",
                  repeats=2)


@gluon_gpu
@pytest.mark.parametrize("batch, kv_len, splits, reduce, v_path", [
    (4, 1024, 16, "spin", "ss16"), (4, 8192, 32, "spin", "rs8"), (32, 1024, 4, "launch", "rs8"),
    (64, 8192, 4, "spin", "rs8"), (1, 1, 1, "launch", "rs8"), (3, 17, 1, "launch", "ss16"), (5, 3000, 8, "launch", "ss16")])
def test_q_loaded_first_is_bit_identical_and_bf16_partials_pass_strict(batch, kv_len, splits, reduce, v_path):
    data = problem.generate_input(batch, kv_len, seed=batch * 5 + kv_len, device="cuda")
    shape = Shape(batch, kv_len)
    common = dict(num_splits=splits, num_stages=2, v_path=v_path, **({"reduce": reduce} if splits > 1 else {}))
    twice = gluon_fused.build(_variant(**common), shape, "cuda")(*data[:4]).clone()
    out = check_backend(_variant(q_load="first", **common), shape, data, f"q_load=first at {shape}")
    assert torch.equal(out, twice), f"q_load=first differs from twice at {shape}, {splits} splits"
    if splits > 1:
        check_backend(_variant(q_load="first", part="bf16", **common), shape, data,
                      f"bf16 partials, {splits} splits, {reduce} at {shape}")


# ------------------------------- in-kernel reductions and V halves (gluon_decode called directly)
def test_spin_is_refused_for_a_grid_the_gpu_cannot_hold_at_once():
    check = gluon_decode.gd_check_launch
    base = dict(block_n=64, num_stages=2, v_path="rs8", reduce="spin", sm_count=132)
    check(128, 2, **base)  # 256 programs, 2 CTAs per SM x 132 SMs = 264
    check(4, 32, v_halves=2, **base)  # 256 programs
    check(256, 2, **{**base, "reduce": "last"})  # the last-arriving reduction needs no residency
    check(256, 2, **{**base, "reduce": "launch"})
    check(256, 1, **base)  # one split: nothing to reduce, nothing to wait for
    # warp specialization: ws 1 keeps two CTAs per SM, ws 2 (registers) one
    check(64, 4, **base, ws=1)  # 256 programs
    check(32, 4, **{**base, "num_stages": 4}, ws=2)  # 128 programs
    check(64, 4, **{**base, "reduce": "launch"}, ws=2)  # two waves are fine without a barrier
    resident = r"reduce='spin' needs the whole grid resident at once: .* use reduce='last'"
    for args, more, match in [
        ((256, 2), {}, resident), ((4, 64), dict(v_halves=2), resident),
        ((4, 64), dict(num_stages=3), resident), ((33, 4), dict(v_halves=2, num_stages=3), resident),
        ((4, 4), dict(sm_count=None), "needs sm_count"),
        ((1, 65), dict(reduce="last"), "at most 64 splits"),
        ((1, 2), dict(reduce="atomic"), "reduce must be one of launch, last, spin"),
        ((1, 2), dict(v_halves=4), "v_halves must be 1 or 2"),
        ((64, 4), dict(ws=2), r"256 programs > 132 SMs x 1 CTAs per SM .*ws 2"),
        ((1, 1), dict(ws=3), r"ws must be one of 0, 1, 2"),
    ]:
        with pytest.raises(ValueError, match=match):
            check(*args, **{**base, **more})


@gluon_gpu
@pytest.mark.parametrize("v_halves", [1, 2])
@pytest.mark.parametrize("reduce", ["last", "spin"])
@pytest.mark.parametrize("kv_len", [1, 17, 1024, 3000])
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_inkernel_reduce_and_v_halves_match_under_strict(batch, kv_len, reduce, v_halves):
    data = problem.generate_input(batch, kv_len, seed=batch * 31 + kv_len, device="cuda")
    # 3 splits (a non-power of two), about one program per SM (at most 64), and 1 where the V
    # halves write the output directly
    tiles = -(-kv_len // 64)
    counts = {min(tiles, 3), min(tiles, gluon_decode.GD_MAX_INKERNEL_SPLITS, max(1, 128 // batch))}
    for splits in sorted(counts | ({1} if v_halves == 2 else set())):
        what = f"rs8/2, {splits} splits, reduce {reduce}, v_halves {v_halves} at {batch}x{kv_len}"
        out = run_twice(data, num_splits=splits, reduce=reduce, v_halves=v_halves)
        check(out, expect(data), what)


# (ws, path, reduce, v_halves): ws 0 with each in-kernel reduction and V halves; ws 1 and 2 with
# the reduce launch (ss16a x 2 consumers x 4 boxes: too much smem, so two V halves there)
OTHER_V_PATHS = [(0, path, reduce, halves) for path in ("ss16/2", "ss16a/2", "rs16/3")
                 for reduce in ("last", "spin") for halves in (1, 2)]
OTHER_V_PATHS += [(ws, path, "launch", 2 if path == "ss16a/2" and ws == 2 else 1)
                  for ws in (1, 2) for path in ("ss16/3", "rs16/3", "ss16a/2")]


@gluon_gpu
@pytest.mark.parametrize("ws, path, reduce, v_halves", OTHER_V_PATHS, ids=str)
def test_inkernel_reduce_v_halves_and_ws_on_the_other_v_paths(ws, path, reduce, v_halves):
    v_path, stages = path.split("/")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, kv_len, splits in [(4, 3000, 4), (3, 130, 1)] if ws else [(4, 3000, 32), (1, 17, 1)]:
        per_sm = gluon_decode.gd_ctas_per_sm(64, int(stages), v_path, v_halves)
        if reduce == "spin" and batch * splits * v_halves > sm_count * per_sm:
            continue  # not resident at once (ss16a/2 and rs16/3 hold one CTA per SM)
        seed = batch + kv_len if ws else batch * 31 + kv_len
        data = problem.generate_input(batch, kv_len, seed=seed, device="cuda")
        out = run_twice(data, ws=ws, num_splits=splits, reduce=reduce, v_halves=v_halves,
                        num_stages=int(stages), v_path=v_path)
        what = f"ws {ws}, {path}, {splits} splits, reduce {reduce}, v_halves {v_halves} at {batch}x{kv_len}"
        check(out, expect(data), what)


@gluon_gpu
@pytest.mark.parametrize("v_halves", [1, 2])
@pytest.mark.parametrize("reduce", ["last", "spin"])
@pytest.mark.parametrize("ws", [0, 1, 2])
def test_inkernel_reduce_ragged_batch_with_empty_splits(ws, reduce, v_halves):
    """rs8 at 2 stages (ws 0: the ragged batch at 3 and 4 splits) or 4 (ws 1 and 2: the ragged
    batch and 4x3000, 12/12/12/11 tiles, at 4 splits), each call twice, bit-identical."""
    ragged = ragged_input([1, 17, 3000, 64, 130], seed=9, device="cuda")
    other = (ragged, 3) if ws == 0 else (problem.generate_input(4, 3000, seed=43, device="cuda"), 4)
    for data, splits in [(ragged, 4), other]:
        out = run_twice(data, ws=ws, num_splits=splits, reduce=reduce, v_halves=v_halves,
                        num_stages=4 if ws else 2)
        what = f"ws {ws}, {splits} splits, reduce {reduce}, v_halves {v_halves} at batch {len(data[0])}"
        check(out, expect(data), what)


@gluon_gpu
@pytest.mark.parametrize("v_halves", [1, 2])
@pytest.mark.parametrize("reduce", ["last", "spin"])
def test_inkernel_reduce_counters_reset_so_calls_repeat(reduce, v_halves):
    bufs = DecodeBuffers(8, 16, "cuda")
    data = problem.generate_input(8, 1024, seed=21, device="cuda")
    other = ragged_input([300, 1024, 5], seed=22, device="cuda")
    calls = [run_gluon(data, bufs, num_splits=16, reduce=reduce, v_halves=v_halves).clone() for _ in range(3)]
    assert torch.equal(calls[0], calls[1]) and torch.equal(calls[0], calls[2]), "3 calls in a row differ"
    assert int(bufs.count.abs().sum()) == 0, "an arrival counter was left non-zero"
    check(calls[0], expect(data), f"reduce {reduce}, v_halves {v_halves}, third call")
    # Another batch on the same counters in between, then the first again.
    between = run_gluon(other, bufs, num_splits=16, reduce=reduce, v_halves=v_halves).clone()
    check(between, expect(other), f"reduce {reduce}, v_halves {v_halves}, a ragged batch between")
    assert torch.equal(calls[0], run_gluon(data, bufs, num_splits=16, reduce=reduce, v_halves=v_halves))
    assert int(bufs.count.abs().sum()) == 0, "an arrival counter was left non-zero"
    if reduce == "spin":  # a flag flips once per call of its (sequence, half): 5 or 4 calls
        expected = [1 if idx < 3 * v_halves else 0 for idx in range(8 * v_halves)]
        assert bufs.flag[: 8 * v_halves].tolist() == expected


# ------------------------------------------------------ warp specialization (ws), H200
# The best ws 0 configurations with ws 1, and a ws 2 plan per shape: (v_path, stages, splits,
# reduce, v_halves) and (splits, reduce) for rs8/4.
LEADERBOARD_PLANS = {
    (4, 1024): (("ss16", 2, 16, "spin", 2), (8, "spin")),
    (4, 8192): (("rs8", 2, 32, "spin", 1), (32, "spin")),
    (32, 1024): (("rs8", 2, 4, "launch", 1), (4, "spin")),
    (32, 8192): (("rs8", 2, 8, "spin", 1), (8, "launch")),
    (64, 1024): (("rs8", 2, 4, "spin", 1), (2, "spin")),
    (64, 8192): (("rs8", 2, 4, "spin", 1), (2, "launch")),
    (256, 1024): (("rs8", 2, 1, "launch", 1), (1, "launch")),
    (256, 8192): (("rs8", 2, 1, "launch", 1), (1, "launch")),
}


@gluon_gpu
@pytest.mark.parametrize("batch, kv_len", list(LEADERBOARD_PLANS), ids=lambda v: str(v))
def test_ws_matches_at_the_leaderboard_shapes(batch, kv_len):
    data = problem.generate_input(batch, kv_len, seed=batch * 7 + kv_len, device="cuda")
    exp, ref = expect(data), problem.reference(data)
    (v_path, stages, splits, reduce, halves), (splits2, reduce2) = LEADERBOARD_PLANS[(batch, kv_len)]
    ws1 = run_twice(data, ws=1, num_splits=splits, reduce=reduce, num_stages=stages, v_path=v_path, v_halves=halves)
    ws2 = run_twice(data, ws=2, num_splits=splits2, reduce=reduce2, num_stages=4)
    for what, out in [(f"ws 1 {v_path}/{stages} s{splits} {reduce} h{halves} at {batch}x{kv_len}", ws1),
                      (f"ws 2 rs8/4 s{splits2} {reduce2} at {batch}x{kv_len}", ws2)]:
        check(out, exp, what)
        # the leaderboard's own rule against its reference, as the bench checks it
        result = problem.check(out, ref, problem.RULES["strict"])
        assert result.passed, f"{what} vs problem.reference: {result.reason}"


@gluon_gpu
@pytest.mark.parametrize("kv_len", [1, 17, 3000])
@pytest.mark.parametrize("batch", [1, 4])
def test_ws_at_tiny_and_odd_lengths(batch, kv_len):
    """0, 1, 2 and odd tile counts per program: empty splits (1 and 17 tokens at 3 splits),
    a lone tile (the second consumer idle), 47 tiles in 1, 3 (16/16/15) and 8 splits."""
    data = problem.generate_input(batch, kv_len, seed=batch * 31 + kv_len, device="cuda")
    exp = expect(data)
    for ws in (1, 2):
        for splits in (1, 3, 8):
            for stages in ((2, 4) if ws == 1 else (3, 4)):
                out = run_twice(data, ws=ws, num_splits=splits, reduce="launch", num_stages=stages)
                check(out, exp, f"ws {ws} rs8/{stages} s{splits} at {batch}x{kv_len}")

