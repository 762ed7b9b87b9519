"""Backend `gluon_fused`: the Gluon decode of kernels/gluon_decode.py (issue 11), sm_90 only.

Registered in backends.BACKEND_MODULES and swept from configs/leaderboard.yaml; strict vs
the reference on the H200 at the eight leaderboard shapes (docs/perf.md, "Issue 11").
Its serving call (build_serving, default_serving_variant, serving_candidates; the section
"the serving call" below) runs kernels/gluon_serving.py: paged (64, 128) or contiguous KV,
bf16 or fp8, 16 to 128 heads, q_len 1 to 4; a serving variant carries max_splits and
tokens_per_split (PARAM_RULES' serving form), a leaderboard one num_splits.

Leaderboard variant parameters:
  kv          fp8              the KV format read (fp8 e4m3 with a per-tensor scale)
  q           fp8_dynamic      q quantized in the kernel, one scale per (sequence, head)
  block_n     64 | 128         tokens per tile (the MMA's M: wgmma needs a multiple of 64)
  num_stages  2..4             depth of the TMA ring; with the tile, bounded by shared memory
  num_splits  1..256           programs per sequence; > 1 adds the reduction (reduce).
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
  q_load      twice | first    the q prologue (kernels/gluon_decode.py GD_Q_LOADS): q read
                               twice after the ring starts, or its five boxes loaded once
                               before anything waits. The same q either way. A later
                               parameter: absent means twice, left out of the variant.
  part        fp32 | bf16      the partials' type where num_splits > 1 (bf16: half the bytes
                               written and read back). A later parameter: absent means fp32;
                               candidates() offers bf16 only with more than one split.
"""

from __future__ import annotations

import math

import torch

from mla_tune.backends.params import (
    PARAM_RULES,
    check_variant_rules,
)
from mla_tune.core import (
    CORE_HEADS,
    QK_DIM,
    SM_SCALE,
    V_DIM,
    CallSpec,
    Capabilities,
    Shape,
    Variant,
    check_serving_spec,
    device_sm_count,
    require,
)
from mla_tune.kernels.gluon_decode import (
    GD_PART_DTYPES,
    GD_UNAVAILABLE,
    gd_check_launch,
    gd_kv_descriptor,
    gd_ws_smem_extra,
    gluon_decode,
)
from mla_tune.kernels.gluon_serving import (
    GS_MAX_Q_LEN,
    GS_MAX_SPLITS,
    GS_PAGE_SIZES,
    GS_ROWS,
    GS_UNAVAILABLE,
    GluonServingWorkspace,
    gluon_serving,
    gs_check_variant,
)
from mla_tune.kernels.serving_runner import OwnServingRunner

NAME = "gluon_fused"

CAPABILITIES = Capabilities(
    kv_formats=("fp8",),
    q_modes=("fp8_dynamic",),
    # The serving call: kernels/gluon_serving.py (a tile of 64 tokens in one page)
    serving_kv_formats=("bf16", "fp8"),
    serving=True,
    contiguous=True,
    page_sizes=GS_PAGE_SIZES,
    heads=CORE_HEADS,
    max_q_len=GS_MAX_Q_LEN,
    mixed_q_len=True,
    graph_safe=True,  # splits computed on the device, scratch sized from the maxima
    lse=True,
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
    "q_load": ["twice"],  # configs opt in to "first"
    "part": ["fp32"],  # configs opt in to "bf16"
}
# Parameters added later and the value that keeps the first behaviour (left out of variants).
GF_LATER_DEFAULTS = {"reduce": "launch", "ws": 0, "q_load": "twice", "part": "fp32"}


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
    shared memory holds (names and values only). A serving variant (max_splits,
    tokens_per_split: build_serving's) is checked by the serving form of backends/params.py,
    then by the kernel's own limits."""
    check_variant_rules(variant, PARAM_RULES[NAME])  # names, choices, bounds: backends/params.py
    if _gf_is_serving(variant):
        _gf_validate_serving(variant)
        return
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
    if p.get("part", "fp32") != "fp32" and p["num_splits"] == 1:
        return "one split writes no partials"
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
        state["part_o"] = torch.empty(slots * 16 * V_DIM, dtype=GD_PART_DTYPES[p["part"]], device=device)
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
                   reduce=p["reduce"], sm_count=sm_count or None, ws=p["ws"], q_load=p["q_load"])

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
    """One sequence with a tile per split: every constexpr (BN, STAGES, V_PATH, SPLIT, WS,
    Q_LOAD; the reduction's NS) and the partials' type come from the variant, and num_splits
    is the same int argument, so this compiles what `shape` runs (batch only sizes the grid,
    kv_len is read on the device)."""
    return Shape(1, variant.p["num_splits"] * variant.p["block_n"])


# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = tuple(GF_DEFAULT_SPACE)


# ------------------------------------------------------------------ the serving call
# kernels/gluon_serving.py: paged (64, 128) or contiguous KV, bf16 or fp8, 16 to 128 heads,
# q_len 1 to 4. Its variant: kv, q (fp8_dynamic with fp8 KV: q quantized in the kernel per
# (new token, head); bf16 with bf16 KV), block_h (heads per program; block_h x
# next_pow2(max_q_len) MMA rows, GS_ROWS), max_splits and tokens_per_split (the split rule,
# gluon_serving.gs_num_splits), num_stages (TMA ring depth), v_halves (1, or 2 programs
# per tile each multiplying half the V dims); optional split_budget (absent or 0: none; B:
# the batch's B splits shared by length, capped by max_splits and tokens_per_split).
_GF_SERVING_Q = {"bf16": "bf16", "fp8": "fp8_dynamic"}  # the q mode each KV format's kernel reads
_GF_SERVING_TOKENS_PER_SPLIT = 512
_GF_SERVING_MAX_SPLITS = 16  # the default's cap: scratch is max_splits x heads x 2 KiB per new token
_GF_BUDGET_MAX_SPLITS = 32  # a batch budget's cap on one sequence's splits
_GF_NO_SMS = 8  # a platform without SMs (the CPU) plans as if it had this many
# The serving search space (a backend section of configs/serving.yaml): MMA rows
# (block_h x next_pow2(max_q_len)), V halves, ring depth, split lengths, and the split caps
# as waves of the platform's SMs over the head tiles (split_waves) or as given (max_splits);
# batch_waves W adds variants whose batch shares ceil(W x SMs / programs per split) splits
# (split_budget, max_splits as much up to _GF_BUDGET_MAX_SPLITS).
_GF_SERVING_SPACE_KEYS = ("rows", "v_halves", "num_stages", "tokens_per_split", "split_waves", "max_splits",
                          "batch_waves")


def _gf_is_serving(variant: Variant) -> bool:
    return "max_splits" in variant.p or "tokens_per_split" in variant.p


def _gf_validate_serving(variant: Variant) -> None:
    p = variant.p
    require(p["q"] == _GF_SERVING_Q[p["kv"]],
            f"{NAME}: {variant} reads {p['kv']} KV, whose serving kernel takes q={_GF_SERVING_Q[p['kv']]}")
    # the fewest rows it can run with (max_q_len 1); the spec's rows are checked in build_serving
    gs_check_variant(max(p["block_h"], GS_ROWS[0]), p["v_halves"], p["num_stages"], p["kv"] == "fp8",
                     p["max_splits"])


def serving_q_reference(variant: Variant) -> str:
    """The q format (serving.inputs.reference's q_format) the serving gate's reference reads
    for `variant` under `reference_q: variant`: fp8_row for fp8 q (kernels/gluon_serving.py,
    like gluon_decode.py, quantizes q per (new token, head) row, amax / 448, e4m3fn:
    serving.inputs.quantize_fp8_rows), bf16 for bf16 q."""
    return "fp8_row" if str(variant.get("q", "bf16")).startswith("fp8") else "bf16"


def _gf_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _gf_serving_variant(spec: CallSpec, rows: int, v_halves: int, num_stages: int, max_splits: int,
                        tokens_per_split: int, split_budget: int = 0) -> Variant | None:
    """The serving variant of these choices for `spec`, or None where the kernel cannot run it
    (a head tile that does not divide the heads, registers, shared memory)."""
    block_h = rows // _gf_pow2(spec.max_q_len)
    if block_h < 1 or spec.heads % block_h:
        return None
    try:
        gs_check_variant(rows, v_halves, num_stages, spec.kv_format == "fp8", max_splits)
    except ValueError:
        return None
    return Variant.make(NAME, kv=spec.kv_format, q=_GF_SERVING_Q[spec.kv_format], block_h=block_h,
                        max_splits=max_splits, tokens_per_split=tokens_per_split, num_stages=num_stages,
                        v_halves=v_halves, **({"split_budget": split_budget} if split_budget else {}))


def _gf_split_cap(spec: CallSpec, rows: int, waves: float, sm_count: int, cap: int) -> int:
    """Splits that let one sequence fill `waves` waves of the SMs with its head tiles."""
    tiles = spec.heads * _gf_pow2(spec.max_q_len) // rows
    return max(1, min(math.ceil(waves * sm_count / max(tiles, 1)), cap))


def default_serving_variant(spec: CallSpec, platform) -> Variant:
    """A correct, untuned serving variant for `spec` on `platform`: 32 MMA rows where the
    heads allow (16 at 16 heads and q_len 1), every V dim in one program, two stages, a
    split per 512 tokens and max_splits that let one sequence fill the SMs (capped at 16)."""
    check_serving_spec(NAME, spec, CAPABILITIES)
    sm_count = getattr(platform, "sm_count", 0) or _GF_NO_SMS
    for rows in sorted(GS_ROWS, reverse=True):
        if rows > spec.heads * _gf_pow2(spec.max_q_len):
            continue
        max_splits = _gf_split_cap(spec, rows, 1, sm_count, _GF_SERVING_MAX_SPLITS)
        variant = _gf_serving_variant(spec, rows, 1, 2, max_splits, _GF_SERVING_TOKENS_PER_SPLIT)
        if variant is not None:
            return variant
    raise ValueError(f"{NAME}: no head tile of {', '.join(map(str, GS_ROWS))} rows serves {spec.heads} heads at "
                     f"max_q_len {spec.max_q_len}; use heads from {', '.join(map(str, CORE_HEADS))}")


def _gf_space_list(space: dict, key: str, default: list) -> list:
    value = space.get(key, default)
    values = value if isinstance(value, list) else [value]
    waves = key in ("split_waves", "batch_waves")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
           or (not waves and not isinstance(v, int))]
    if bad:
        raise ValueError(f"{NAME} serving space: {key} must hold positive "
                         f"{'numbers' if waves else 'integers'}, got {bad}")
    return values


def serving_candidates(spec: CallSpec, space: dict, platform) -> list[Variant]:
    """The serving variants to sweep for the family `spec`: the product of the space's lists
    (_GF_SERVING_SPACE_KEYS; defaults: 16 and 32 rows, one and two V halves, 2 stages, a
    split per 512 tokens, one wave) where the kernel runs them; max_splits from split_waves
    (waves of the SMs over the head tiles, capped at GS_MAX_SPLITS) and the explicit
    max_splits; each batch_waves adds variants with that batch budget (split_budget).
    Nothing for a spec the record refuses."""
    if CAPABILITIES.refusal(spec) is not None:
        return []
    space = dict(space or {})
    unknown = sorted(set(space) - set(_GF_SERVING_SPACE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the {NAME} serving space; known: "
                         f"{', '.join(_GF_SERVING_SPACE_KEYS)}")
    sm_count = getattr(platform, "sm_count", 0) or _GF_NO_SMS
    lists = {key: _gf_space_list(space, key, default) for key, default in (
        ("rows", [16, 32]), ("v_halves", [1, 2]), ("num_stages", [2]),
        ("tokens_per_split", [_GF_SERVING_TOKENS_PER_SPLIT]), ("split_waves", [1]), ("max_splits", []),
        ("batch_waves", []))}
    out: list[Variant] = []
    for rows in lists["rows"]:
        caps = {_gf_split_cap(spec, rows, w, sm_count, GS_MAX_SPLITS) for w in lists["split_waves"]}
        caps |= {min(m, GS_MAX_SPLITS) for m in lists["max_splits"]}
        for v_halves in lists["v_halves"]:
            for stages in lists["num_stages"]:
                for max_splits in sorted(caps):
                    # one split: the split length is moot, one variant (the largest)
                    lengths = [max(lists["tokens_per_split"])] if max_splits == 1 else lists["tokens_per_split"]
                    for tokens in lengths:
                        variant = _gf_serving_variant(spec, rows, v_halves, stages, max_splits, tokens)
                        if variant is not None:
                            out.append(variant)
                for waves in lists["batch_waves"]:
                    programs = spec.heads * _gf_pow2(spec.max_q_len) // rows * v_halves  # per split
                    budget = math.ceil(waves * sm_count / programs)
                    max_splits = min(budget, _GF_BUDGET_MAX_SPLITS)
                    if max_splits == 1:  # one split per sequence: the budget is moot
                        continue
                    for tokens in lists["tokens_per_split"]:
                        variant = _gf_serving_variant(spec, rows, v_halves, stages, max_splits, tokens, budget)
                        if variant is not None:
                            out.append(variant)
    return list(dict.fromkeys(out))


def build_serving(variant: Variant, spec: CallSpec, device):
    """A runner(q, qo_indptr, kv, kv_scale, *, kv_indptr | block_table + seq_lens) -> out
    (or (out, lse) with spec.return_lse) for calls of `spec` (the serving-call contract,
    docs/runtime.md), at the softmax scale spec.sm_scale: an OwnServingRunner
    (kernels/serving_runner.py) over gluon_serving, whose launches are not replayed (every
    layer launches through gluon_serving)."""
    validate(variant)
    if not _gf_is_serving(variant):
        raise ValueError(f"{NAME}: {variant} is a leaderboard variant (num_splits); the serving call takes "
                         "max_splits and tokens_per_split (default_serving_variant makes one)")
    check_serving_spec(NAME, spec, CAPABILITIES, variant)
    p = variant.p
    rows = p["block_h"] * _gf_pow2(spec.max_q_len)
    if spec.heads % p["block_h"] or rows not in GS_ROWS:
        raise ValueError(f"{NAME}: block_h={p['block_h']} must divide {spec.heads} heads and give block_h x "
                         f"{_gf_pow2(spec.max_q_len)} (next_pow2(max_q_len)) rows in {GS_ROWS}")
    gs_check_variant(rows, p["v_halves"], p["num_stages"], p["kv"] == "fp8", p["max_splits"])
    reason = GS_UNAVAILABLE or unavailable_reason()
    require(reason is None, f"{NAME} cannot run here: {reason}")
    launch = dict(max_q_len=spec.max_q_len, block_h=p["block_h"], max_splits=p["max_splits"],
                  tokens_per_split=p["tokens_per_split"], num_stages=p["num_stages"], v_halves=p["v_halves"],
                  split_budget=p.get("split_budget", 0), sm_scale=spec.sm_scale)
    return OwnServingRunner(NAME, spec, torch.device(device), gluon_serving, GluonServingWorkspace,
                            p["max_splits"], launch)
