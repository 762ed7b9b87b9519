"""Backend `gluon_fused`: the Gluon decode of kernels/gluon_decode.py (issue 11), sm_90 only.

Registered in backends.BACKEND_MODULES and swept from configs/leaderboard.yaml; strict vs
the reference on the H200 at the eight leaderboard shapes (docs/perf.md, "Issue 11").

Variant parameters:
  kv          fp8              the KV format read (fp8 e4m3 with a per-tensor scale)
  q           fp8_dynamic      q quantized in the kernel, one scale per (sequence, head)
  block_n     64 | 128         tokens per tile (the MMA's M: wgmma needs a multiple of 64)
  num_stages  2..4             depth of the TMA ring; with the tile, bounded by shared memory
  num_splits  1..256           programs per sequence; > 1 adds a reduction launch.
                               candidates() keeps, per shape, those giving batch x num_splits
                               programs in [sm_count / 8, 2 x sm_count] (see _gf_waves_reason)
  v_path      ss16 | rs16 | rs8 | ss16a  how V^T reaches the PV MMA (kernels/gluon_decode.py;
                               ss16a: four fp16 box buffers, asynchronous PV MMAs)
  reduce      launch | spin    how the splits combine: a second launch, or in the kernel
                               after a spin barrier (offered only where the whole grid is
                               resident at once, gd_check_launch). Added later: a variant
                               without it is "launch", and candidates() leaves that value out
                               of the variant, so older tables read as they were.
  ws          0 | 1 | 2        warp specialization (kernels/gluon_decode.py WS): 0 none; 1 a
                               loader warp feeding the ring; 2 a loader warp and two consumer
                               warpgroups taking alternate tiles (one CTA per SM). A later
                               parameter like reduce: absent means 0 and 0 is left out of
                               the variant. candidates() offers ws 2 only with >= 3 stages,
                               >= 2 tiles per program and, on a known GPU, one wave of
                               programs (_gf_ws_reason); ws 1 wherever the config asks.
"""

from __future__ import annotations

import math

import torch

from mla_tune.backends.params import PARAM_RULES, check_variant_rules
from mla_tune.core import (
    QK_DIM,
    SM_SCALE,
    V_DIM,
    Capabilities,
    Shape,
    Variant,
    device_sm_count,
    require,
)
from mla_tune.kernels.gluon_decode import (
    GD_UNAVAILABLE,
    gd_check_launch,
    gd_kv_descriptor,
    gd_ws_smem_extra,
    gluon_decode,
)

NAME = "gluon_fused"

CAPABILITIES = Capabilities(
    kv_formats=("fp8",),
    q_modes=("fp8_dynamic",),
    platforms=(("cuda", "sm_90"),),  # Gluon's wgmma and TMA, Triton 3.6
    precompile=True,
)

# Hopper's shared memory per block (227 KB); the kernel's use is _gf_smem_bytes.
_GF_SMEM_LIMIT = 232448

GF_DEFAULT_SPACE = {
    "kv": ["fp8"],
    "q": ["fp8_dynamic"],
    "block_n": [64],
    "num_stages": [2, 3, 4],
    "num_splits": [1, 2, 4, 8, 16, 32],
    "v_path": ["ss16", "rs16", "ss16a"],
    "reduce": ["launch"],  # configs opt in to "spin"
    "ws": [0],  # configs opt in to warp specialization (1, 2)
}
# Parameters added later and the value that keeps the first behaviour (left out of variants).
GF_LATER_DEFAULTS = {"reduce": "launch", "ws": 0}


def unavailable_reason() -> str | None:
    if GD_UNAVAILABLE is not None:
        return GD_UNAVAILABLE
    if not torch.cuda.is_available():
        return "gluon_fused needs an NVIDIA sm_90 GPU (Gluon has no CPU interpreter)"
    if torch.version.hip:
        return "gluon_fused is written for NVIDIA Hopper (wgmma, TMA), not ROCm"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"gluon_fused needs sm_90 (wgmma, TMA); this GPU is sm_{major}{minor}"
    return None


def _gf_smem_bytes(block_n: int, num_stages: int, v_path: str = "ss16", ws: int = 0) -> int:
    """Shared memory the kernel allocates: the fp8 ring, q, P^T, the fp16 V box(es; four for
    ss16a), the barriers, and 256 B the compiler adds (its figures are in
    tests/test_gluon_decode.py); plus what warp specialization adds (gd_ws_smem_extra)."""
    v16_boxes = 4 if v_path == "ss16a" else 1
    return (num_stages * 5 * block_n * 128 + 5 * 16 * 128 + block_n * 16 * 2 + v16_boxes * block_n * 128 * 2
            + 8 * num_stages + 256 + gd_ws_smem_extra(block_n, num_stages, v_path, 1, ws))


def validate(variant: Variant) -> None:
    """Refuse a missing, unknown or ill-valued parameter, or a tile and ring deeper than
    shared memory holds (names and values only)."""
    check_variant_rules(variant, PARAM_RULES[NAME])  # names, choices, bounds: backends/params.py
    ws, block_n = variant.get("ws", 0), variant.get("block_n")
    stages, v_path = variant.get("num_stages"), variant.get("v_path")
    smem = _gf_smem_bytes(block_n, stages, v_path, ws)
    if smem > _GF_SMEM_LIMIT:
        raise ValueError(f"{NAME}: {variant} needs {smem} B of shared memory (block_n {block_n} x "
                         f"{stages} stages, v_path {v_path}{f', ws {ws}' if ws else ''}), over the "
                         f"{_GF_SMEM_LIMIT} B an sm_90 block has; use fewer stages")


def _gf_reason(p: dict, shape: Shape, sm_count: int = 0) -> str | None:
    """Why this parameter set cannot run at `shape` (None: it can); sm_count 0 (no GPU)
    leaves the residency of a spin barrier to build."""
    if p["num_splits"] > max(1, math.ceil(shape.kv_len / p["block_n"])):
        return "more splits than tiles"
    reduce = p.get("reduce", "launch")
    if reduce != "launch" and p["num_splits"] == 1:
        return "one split has nothing to reduce"
    if reduce != "launch" and sm_count:
        try:
            gd_check_launch(shape.batch, p["num_splits"], block_n=p["block_n"], num_stages=p["num_stages"],
                            v_path=p["v_path"], reduce=reduce, sm_count=sm_count, ws=p.get("ws", 0))
        except ValueError as exc:
            return str(exc)
    return None


def _gf_ws_reason(p: dict, shape: Shape, sm_count: int) -> str | None:
    """Why candidates() leaves this warp specialization out at `shape` (None: it offers it).
    ws 2 (two consumer warpgroups, alternate tiles, one CTA per SM) pays only where each
    consumer has a tile to overlap and a slot to prefetch into, and where the SMs it takes
    from a second CTA were idle anyway (docs/perf.md, "Issue 11, third step")."""
    if p.get("ws", 0) != 2:
        return None
    if p["num_stages"] < 3:
        return "ws 2 with 2 stages leaves each consumer one ring slot: every load would be waited for"
    tiles = math.ceil(shape.kv_len / p["block_n"])
    if math.ceil(tiles / p["num_splits"]) < 2:
        return "ws 2 with one tile per program leaves the second consumer idle"
    if sm_count and shape.batch * p["num_splits"] > sm_count:
        return f"ws 2 holds one CTA per SM: {shape.batch * p['num_splits']} programs are more than {sm_count} SMs"
    return None


# The split counts candidates() offers: batch x num_splits programs from an eighth of the SMs
# to two waves. On the H200 probe (docs/perf.md) the split count min(32, 128 // batch), about
# one program per SM, beat triton_fused at 6 of 8 shapes; this window keeps a factor of ~8
# below and 2 above it (4x8192: 8..32 splits; 32x: 1..8; 64x: 1..4; 256x: 1).
_GF_MIN_FILL = 1 / 8
_GF_MAX_WAVES = 2


def _gf_waves_reason(num_splits: int, shape: Shape, sm_count: int) -> str | None:
    """Why candidates() leaves this split count out at `shape` (None: it offers it). No
    sm_count (a platform without SMs, the CPU): every split count with a tile is offered."""
    if not sm_count or num_splits == 1 and shape.batch >= sm_count * _GF_MIN_FILL:
        return None
    programs = shape.batch * num_splits
    if programs > _GF_MAX_WAVES * sm_count:
        return f"{programs} programs, over {_GF_MAX_WAVES} waves of {sm_count} SMs"
    if programs < _GF_MIN_FILL * sm_count:
        return f"{programs} programs fill under {_GF_MIN_FILL:.0%} of {sm_count} SMs"
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    space = {**GF_DEFAULT_SPACE, **(space or {})}
    sm_count = getattr(platform, "sm_count", 0) or 0
    unknown = set(space) - set(GF_DEFAULT_SPACE)
    require(not unknown, f"gluon_fused: unknown search-space keys {sorted(unknown)}")
    out: list[Variant] = []
    keys = list(GF_DEFAULT_SPACE)

    def walk(i: int, chosen: dict) -> None:
        if i == len(keys):
            smem = _gf_smem_bytes(chosen["block_n"], chosen["num_stages"], chosen["v_path"], chosen["ws"])
            if (_gf_reason(chosen, shape, sm_count) is None and smem <= _GF_SMEM_LIMIT
                    and _gf_waves_reason(chosen["num_splits"], shape, sm_count) is None
                    and _gf_ws_reason(chosen, shape, sm_count) is None):
                shown = {k: v for k, v in chosen.items() if GF_LATER_DEFAULTS.get(k, object()) != v}
                out.append(Variant.make(NAME, **shown))
            return
        for value in space[keys[i]]:
            walk(i + 1, {**chosen, keys[i]: value})

    walk(0, {})
    return list(dict.fromkeys(out))


def build(variant: Variant, shape: Shape, device, *, sm_scale: float = SM_SCALE):
    """A runner(q, kv_data, qo_indptr, kv_indptr) -> out at softmax scale `sm_scale` (a
    runtime float of the kernel)."""
    validate(variant)
    p = {**GF_LATER_DEFAULTS, **variant.p}
    require(unavailable_reason() is None, f"gluon_fused cannot run here: {unavailable_reason()}")
    device = torch.device(device)
    sm_count = device_sm_count(device) if p["reduce"] != "launch" else 0
    reason = _gf_reason(p, shape, sm_count)
    require(reason is None, f"gluon_fused cannot run {variant} at {shape}: {reason}")
    num_splits = p["num_splits"]
    state = {"batch": 0, "desc_key": None, "desc": None}

    def grow(batch: int) -> None:
        slots = batch * num_splits if num_splits > 1 else 1
        state["part_o"] = torch.empty(slots * 16 * V_DIM, dtype=torch.float32, device=device)
        state["part_lse"] = torch.empty(slots * 16, dtype=torch.float32, device=device)
        state["out"] = torch.empty((batch, 16, V_DIM), dtype=torch.bfloat16, device=device)
        # in-kernel reduction's arrival counter and barrier flag: zero once, each call
        # leaves them ready for the next
        state["count"] = torch.zeros(2 * batch, dtype=torch.int32, device=device)
        state["flag"] = torch.zeros(2 * batch, dtype=torch.int32, device=device)
        state["batch"] = batch

    grow(shape.batch)
    options = dict(num_splits=num_splits, block_n=p["block_n"], num_stages=p["num_stages"],
                   v_path=p["v_path"], sm_scale_log2=sm_scale * math.log2(math.e),
                   reduce=p["reduce"], sm_count=sm_count or None, ws=p["ws"])

    def run_gluon_fused(q, kv_data, qo_indptr, kv_indptr):
        batch = q.shape[0]
        if batch > state["batch"]:
            if p["reduce"] == "spin":  # a larger grid may not be resident: refuse, never hang
                gd_check_launch(batch, num_splits, block_n=p["block_n"], num_stages=p["num_stages"],
                                v_path=p["v_path"], reduce="spin", sm_count=sm_count, ws=p["ws"])
            grow(batch)  # a larger ragged batch than planned: one allocation, once
        kv, kv_scale = kv_data["fp8"]
        require(kv.dtype == torch.float8_e4m3fn, f"gluon_fused reads float8_e4m3fn KV, not {kv.dtype}")
        kv = kv.view(-1, QK_DIM)
        # The descriptor is a host object over the cache's address and rows: remade only when
        # the cache changes.
        key = (kv.data_ptr(), kv.shape[0])
        if state["desc_key"] != key:
            require(kv.data_ptr() % 16 == 0, "gluon_fused: the KV cache must start 16-byte aligned for TMA")
            state["desc"], state["desc_key"] = gd_kv_descriptor(kv, p["block_n"]), key
        out = state["out"][:batch]
        run_gluon_fused.compiled = gluon_decode(q, state["desc"], kv_scale, kv_indptr, out, state["part_o"],
                                                state["part_lse"], count=state["count"], flag=state["flag"],
                                                **options)
        return out

    run_gluon_fused.compiled = None
    return run_gluon_fused



def compile_shape(variant: Variant, shape: Shape, sm_count: int | None) -> Shape:
    """One sequence with a tile per split: every constexpr (BN, STAGES, V_PATH, SPLIT, WS; the
    reduction's NS) comes from the variant and num_splits is the same int argument, so this
    compiles what `shape` runs (batch only sizes the grid, kv_len is read on the device)."""
    return Shape(1, variant.p["num_splits"] * variant.p["block_n"])


# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = tuple(GF_DEFAULT_SPACE)
