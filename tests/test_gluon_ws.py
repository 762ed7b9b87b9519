"""Warp specialization (`ws`) of the Gluon decode. CPU: its register requests, candidates and
launch (the kernel replaced by a recorder; validation, shared memory and residency:
tests/test_gluon_decode.py). GPU: ws 1 and 2 against tests/gluon_helpers.py's `check`.
"""

import math

import pytest
import torch

from mla_tune import problem
from mla_tune.backends import gluon_fused
from mla_tune.core import QK_DIM, Shape
from mla_tune.gpu import fake_platform
from mla_tune.kernels import gluon_decode
from tests.gluon_helpers import check, check_backend, expect, gluon_gpu, gluon_variant, run_twice
from tests.helpers import ragged_input


# ------------------------------------------------------------------------------- CPU
def test_the_kernels_register_requests_are_the_modules_constants():
    """gl.warp_specialize takes its warps and registers as literals in the kernel (a jitted
    function reads no dict): they must be GD_WS_WORKER_REGS."""
    import inspect

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
        assert plain and all("ws" not in v.p for v in plain)  # the default space: as before
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
    p = dict(gluon_variant(v_path="rs8", ws=2, num_stages=2, num_splits=4).p)
    assert "one ring slot" in gluon_fused._gf_ws_reason(p, Shape(4, 8192), sm)
    assert "second consumer idle" in gluon_fused._gf_ws_reason({**p, "num_stages": 3, "num_splits": 16},
                                                               Shape(4, 1024), sm)
    assert "one CTA per SM" in gluon_fused._gf_ws_reason({**p, "num_stages": 3}, Shape(64, 1024), sm)
    assert gluon_fused._gf_ws_reason({**p, "num_stages": 3}, Shape(64, 1024), 0) is None  # no GPU: not judged
    assert gluon_fused._gf_ws_reason({**p, "ws": 1}, Shape(4, 1024), sm) is None


class _Recorder:
    """Stands in for the jitted kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, kwargs)) or "compiled"


def test_gluon_decode_launches_with_ws_its_register_budget_and_q_load_and_refuses_bad_values(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(gluon_decode, "GD_UNAVAILABLE", None)
    monkeypatch.setattr(gluon_decode, "_gd_decode_kernel", rec)
    q = torch.zeros(3, 16, QK_DIM)
    indptr = torch.arange(4, dtype=torch.int32)
    common = dict(num_splits=1, block_n=64, num_stages=4, v_path="rs8", sm_scale_log2=1.0)
    for ws in (0, 1, 2):
        assert gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, ws=ws, **common) == "compiled"
    (g0, k0), (g1, k1), (g2, k2) = rec.calls
    assert g0 == g1 == g2 == (1, 3)
    assert "WS" not in k0 and "maxnreg" not in k0  # ws 0 launches exactly as before
    assert (k1["WS"], k1["maxnreg"], k2["WS"], k2["maxnreg"]) == (1, 128, 2, 168)
    assert all(k["num_warps"] == 4 for k in (k0, k1, k2))
    with pytest.raises(ValueError, match="ws must be one of"):
        gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, ws=4, **common)
    with pytest.raises(ValueError, match="q_load must be one of twice, first; got 'once'"):
        gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, q_load="once", **common)
    with pytest.raises(ValueError, match="part_o must be float32 or bfloat16"):
        gluon_decode.gluon_decode(q, None, None, indptr, None, torch.empty(4, dtype=torch.float16), None,
                                  **{**common, "num_splits": 2})
    assert len(rec.calls) == 3  # refused before any launch
    assert "Q_LOAD" not in k0  # q_load "twice" (the default) launches as before it existed too
    gluon_decode.gluon_decode(q, None, None, indptr, None, None, None, q_load="first", **common)
    assert rec.calls[-1][1]["Q_LOAD"] == 1


# ----------------------------------------------------------------------------- H200
def run_ws(data, *, ws: int, num_splits: int, reduce: str = "launch", num_stages: int = 4,
           **opts) -> torch.Tensor:
    """run_twice (fresh buffers, the second call bit-identical) with `ws`, rs8 at 4 stages
    unless told; one split launches with reduce "launch" (nothing to combine)."""
    if num_splits == 1:
        reduce = "launch"
    return run_twice(data, ws=ws, num_splits=num_splits, reduce=reduce, num_stages=num_stages,
                     **opts)


# The best ws 0 configurations with ws 1, and a ws 2 plan per shape: (v_path, stages, splits, reduce, v_halves) and (splits, reduce) for rs8/4.
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
    exp = expect(data)
    ref = problem.reference(data)
    (v_path, stages, splits, reduce, halves), (splits2, reduce2) = LEADERBOARD_PLANS[(batch, kv_len)]
    for what, out in [
        (f"ws 1 {v_path}/{stages} s{splits} {reduce} h{halves} at {batch}x{kv_len}",
         run_ws(data, ws=1, num_splits=splits, reduce=reduce, num_stages=stages, v_path=v_path, v_halves=halves)),
        (f"ws 2 rs8/4 s{splits2} {reduce2} at {batch}x{kv_len}", run_ws(data, ws=2, num_splits=splits2, reduce=reduce2)),
    ]:
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
                out = run_ws(data, ws=ws, num_splits=splits, num_stages=stages)
                check(out, exp, f"ws {ws} rs8/{stages} s{splits} at {batch}x{kv_len}")


@gluon_gpu
@pytest.mark.parametrize("ws", [1, 2])
def test_ws_with_the_in_kernel_reductions_and_v_halves(ws):
    data = problem.generate_input(4, 3000, seed=43, device="cuda")
    ragged = ragged_input([1, 17, 3000, 64, 130], seed=9, device="cuda")
    exp, exp_ragged = expect(data), expect(ragged)
    for reduce in ("last", "spin"):
        for halves in (1, 2):
            out = run_ws(data, ws=ws, num_splits=4, reduce=reduce, v_halves=halves)  # 12/12/12/11 tiles
            check(out, exp, f"ws {ws} s4 {reduce} h{halves} at 4x3000")
            out = run_ws(ragged, ws=ws, num_splits=4, reduce=reduce, v_halves=halves)
            check(out, exp_ragged, f"ws {ws} s4 {reduce} h{halves}, ragged with empty splits")


@gluon_gpu
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("path", ["ss16/3", "rs16/3", "ss16a/2"])
def test_ws_on_the_other_v_paths(path, ws):
    v_path, stages = path.split("/")
    halves = 2 if v_path == "ss16a" and ws == 2 else 1  # ss16a x 2 consumers x 4 boxes: too much smem
    for batch, kv_len, splits in [(4, 3000, 4), (3, 130, 1)]:
        data = problem.generate_input(batch, kv_len, seed=batch + kv_len, device="cuda")
        out = run_ws(data, ws=ws, num_splits=splits, num_stages=int(stages), v_path=v_path, v_halves=halves)
        check(out, expect(data), f"ws {ws} {path} h{halves} s{splits} at {batch}x{kv_len}")


@gluon_gpu
@pytest.mark.parametrize("params", [dict(ws=1, num_stages=2, num_splits=4, reduce="spin"),
                                    dict(ws=2, num_stages=4, num_splits=4, reduce="spin"),
                                    dict(ws=2, num_stages=3, num_splits=1)], ids=str)
def test_the_backend_with_ws_matches_and_repeats(params):
    data = problem.generate_input(32, 1024, seed=77, device="cuda")
    variant = gluon_variant(v_path="rs8", **params)
    check_backend(variant, Shape(32, 1024), data, f"backend {params}", repeats=2)
