"""Backend `triton_fused`: the one-launch decode of kernels/fused_decode.py.

Variant parameters (all explicit, so CPU interpreter tests can pick fp16 dots):
  kv         bf16 | fp8 | mxfp4   the KV format read
  q          bf16 | fp8_dynamic   fp8_dynamic quantizes q in the kernel with a per-(sequence,
                                  head) amax: no extra launch, no sync. fp8_static is not
                                  offered: the dynamic scale costs nothing here.
  qk_dot     fp16 | bf16 | fp8    operand dtype of S = q K^T (fp8 needs kv=fp8, q=fp8_dynamic)
  pv_dot     fp16 | bf16 | fp8    operand dtype of O = P V (fp8 needs kv=fp8)
  tok_m      true | false         tokens on the MMA's M dimension (wgmma-able) or heads
  block_n, num_warps, num_stages  tile and Triton launch options
  num_splits                      programs per sequence (the grid is num_splits x batch)
  reduce     none | last | spin   none iff num_splits = 1; spin needs the grid to fit the GPU
  load       ptr | tma | tma_host KV tiles through pointers, or TMA tensor descriptors made on
                                  the device (tl.make_tensor_descriptor) or on the host
  grid       split | persistent   persistent: min(SMs x waves, tiles) programs share the batch's
                                  tokens evenly (num_splits = 1, reduce = last: the reduction of
                                  sequences cut between programs)
  waves      1 | 2                programs per SM of the persistent grid (1 for split)
  load, grid and waves were added later: a variant that lacks them has their defaults (ptr,
  split, 1), and candidates() leaves default values out of the variant, so its text (and
  every table written before) stays as it was.

Serving variants (build_serving, kernels/fused_decode.py's fused_decode_serving; told apart
by max_splits / tokens_per_split) carry their own set:
  kv         bf16 | fp8           (no MXFP4 path)
  q, qk_dot, pv_dot               as above (q=fp8_dynamic: per-(new token, head) amax, which
                                  serving_q_reference names for the serving gate)
  block_n, num_warps, num_stages  as above
  block_h                         heads per program: a power of two dividing the heads,
                                  block_h x next_pow2(max_q_len) >= 16 MMA columns
  max_splits, tokens_per_split    sequence b runs in clamp(cdiv(seq_len, tokens_per_split),
                                  1, max_splits) splits, counted on the device; the last
                                  split to finish reduces
"""

from __future__ import annotations

import itertools
import math
import os

import torch

from mla_tune.backends.params import PARAM_RULES, check_variant_rules
from mla_tune.core import (
    CORE_HEADS,
    CORE_PAGE_SIZES,
    NUM_HEADS,
    PARAM_MAX_SPLITS,
    QK_DIM,
    SM_SCALE,
    V_DIM,
    CallSpec,
    Capabilities,
    Shape,
    Variant,
    device_sm_count,
    require,
)
from mla_tune.kernels.fused_decode import (
    FusedServingWorkspace,
    fu_persistent_slots,
    fused_decode,
    fused_decode_serving,
)
from mla_tune.kernels.launch import LaunchReplay
from mla_tune.kernels.serving_runner import (
    OwnServingRunner,
    check_serving_build,
    serving_launch_args,
)

NAME = "triton_fused"

CAPABILITIES = Capabilities(
    kv_formats=("bf16", "fp8", "mxfp4"),
    serving_kv_formats=("bf16", "fp8"),  # fused_decode_serving has no MXFP4 path
    q_modes=("bf16", "fp8_dynamic"),
    serving=True,  # kernels/fused_decode.py's fused_decode_serving
    contiguous=True,
    page_sizes=CORE_PAGE_SIZES,
    heads=CORE_HEADS,
    max_q_len=4,
    mixed_q_len=True,
    graph_safe=True,
    precompile=True,
    lse=True,  # fused_decode_serving writes it from the splits' reduction (lse=)
)

_FU_KV = ("bf16", "fp8", "mxfp4")
_FU_Q = ("bf16", "fp8_dynamic")
_FU_DOTS = ("fp16", "bf16", "fp8")
_FU_REDUCE = ("none", "last", "spin")
_FU_LOAD = ("ptr", "tma", "tma_host")
_FU_GRID = ("split", "persistent")
_FU_BLOCK_N = (16, 32, 64, 128)
_FU_SERVING_KV = ("bf16", "fp8")
# The later parameters and the values that keep the first behaviour (left out of variants).
FU_LATER_DEFAULTS = {"load": "ptr", "grid": "split", "waves": 1}
# The interpreter has no SMs; the persistent grid pretends to have this many, so CPU tests
# cut sequences between programs.
_FU_INTERPRET_SMS = 3
# The interpreter runs programs one after another: any grid is "resident".
_FU_NO_RESIDENCY_LIMIT = 1 << 30

# The search space when a config gives none: what docs/perf.md's two H200 runs found
# worth sweeping (every per-shape winner there lies inside it).
FU_DEFAULT_SPACE = {
    "kv": ["fp8", "bf16"],
    "q": ["fp8_dynamic", "bf16"],
    "qk_dot": ["fp8", "fp16", "bf16"],
    "pv_dot": ["fp16", "bf16"],
    "tok_m": [True],
    "block_n": [32, 64, 128],
    "num_warps": [4, 8],
    "num_stages": [3],
    "num_splits": [1, 2, 4, 8, 16, 32],
    "reduce": ["spin", "last"],
    "load": ["ptr"],
    "grid": ["split"],
    "waves": [1],
}


def unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            return None  # Triton's CPU interpreter (tests; fp16 dots only)
        return "no GPU here; set TRITON_INTERPRET=1 to run the kernels on the CPU (tests only)."
    if torch.version.hip:
        return "triton_fused targets NVIDIA GPUs (fp8 e4m3fn, sm_90 tuning); not tried on ROCm"
    return None


def _fu_combo_reason(p: dict) -> str | None:
    """Why this parameter set (load, grid and waves filled in) cannot run at any shape
    (None: it may run; _fu_valid adds what depends on the shape)."""
    if p["kv"] not in _FU_KV or p["q"] not in _FU_Q:
        return f"kv must be one of {_FU_KV} and q one of {_FU_Q}"
    if p["qk_dot"] not in _FU_DOTS or p["pv_dot"] not in _FU_DOTS:
        return f"qk_dot and pv_dot must be one of {_FU_DOTS}"
    if (p["qk_dot"] == "fp8") != (p["q"] == "fp8_dynamic"):
        return "q=fp8_dynamic goes with qk_dot=fp8 and only with it"
    if p["qk_dot"] == "fp8" and p["kv"] != "fp8":
        return "qk_dot=fp8 reads an fp8 KV cache"
    if p["pv_dot"] == "fp8" and p["kv"] != "fp8":
        return "pv_dot=fp8 reads an fp8 KV cache"
    if p["kv"] == "bf16" and "fp8" in (p["qk_dot"], p["pv_dot"]):
        return "a bf16 cache is not requantized to fp8"
    if p["reduce"] not in _FU_REDUCE:
        return f"reduce must be one of {_FU_REDUCE}"
    if p["load"] not in _FU_LOAD or p["grid"] not in _FU_GRID or p["waves"] not in (1, 2):
        return f"load must be one of {_FU_LOAD}, grid one of {_FU_GRID}, waves 1 or 2"
    if p["kv"] == "mxfp4" and (p["qk_dot"] != p["pv_dot"] or p["qk_dot"] == "fp8"):
        return "kv=mxfp4 dequantizes into one dot dtype: qk_dot = pv_dot, fp16 or bf16"
    if p["grid"] == "persistent":
        if p["num_splits"] != 1 or p["reduce"] != "last":
            return "grid=persistent goes with num_splits=1 and reduce=last (its own reduction)"
    elif p["waves"] != 1:
        return "waves applies to grid=persistent only (use waves=1)"
    elif (p["num_splits"] == 1) != (p["reduce"] == "none"):
        return "reduce=none goes with num_splits=1 and only with it"
    if p["block_n"] not in _FU_BLOCK_N:
        return "block_n must be 16, 32, 64 or 128"
    return None


def _fu_valid(p: dict, shape: Shape, sm_count: int) -> str | None:
    """Why this parameter set cannot run at `shape` (None: it can)."""
    reason = _fu_combo_reason(p)
    if reason is not None:
        return reason
    if p["num_splits"] > max(1, math.ceil(shape.kv_len / p["block_n"])):
        return "more splits than tiles"
    if p["reduce"] == "spin" and shape.batch * p["num_splits"] > sm_count:
        return f"reduce=spin needs batch x num_splits <= {sm_count} SMs (all programs resident)"
    return None


def _fu_is_serving(variant: Variant) -> bool:
    """A serving variant (build_serving) carries max_splits / tokens_per_split."""
    return "max_splits" in variant.p or "tokens_per_split" in variant.p


def _fu_validate_serving(variant: Variant) -> None:
    check_variant_rules(variant, PARAM_RULES[NAME])  # the serving form: backends/params.py
    p = variant.p
    if (p["qk_dot"] == "fp8") != (p["q"] == "fp8_dynamic"):
        raise ValueError(f"{NAME}: {variant} is not allowed: q=fp8_dynamic goes with qk_dot=fp8 and only with it")
    if "fp8" in (p["qk_dot"], p["pv_dot"]) and p["kv"] != "fp8":
        raise ValueError(f"{NAME}: {variant} is not allowed: fp8 dots read an fp8 KV cache (a bf16 "
                         "cache is not requantized)")


def validate(variant: Variant) -> None:
    """Refuse a missing, unknown or ill-valued parameter, or a combination no shape can
    run (names and values only; build() adds the checks that depend on the shape and GPU).
    load, grid and waves may be absent: they then have their FU_LATER_DEFAULTS values.
    Serving variants (max_splits, tokens_per_split) have their own set (module docstring);
    which heads and q_len their block_h suits is build_serving's business."""
    if _fu_is_serving(variant):
        _fu_validate_serving(variant)
        return
    check_variant_rules(variant, PARAM_RULES[NAME])  # names, choices, bounds: backends/params.py
    full = Variant.make(variant.backend, **{**FU_LATER_DEFAULTS, **variant.p})
    reason = _fu_combo_reason(full.p)
    if reason is not None:
        raise ValueError(f"{NAME}: {variant} is not allowed: {reason}")


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    space = {**FU_DEFAULT_SPACE, **(space or {})}
    unknown = set(space) - set(FU_DEFAULT_SPACE)
    require(not unknown, f"triton_fused: unknown search-space keys {sorted(unknown)}")
    # The planned GPU's SMs; a platform without any (the CPU) has no residency limit, as in build()
    sm_count = getattr(platform, "sm_count", 0) or _FU_NO_RESIDENCY_LIMIT
    keys = list(FU_DEFAULT_SPACE)
    out: list[Variant] = []

    def walk(i: int, chosen: dict) -> None:
        if i == len(keys):
            if chosen["grid"] == "persistent":  # one program count per SM: splits do not apply
                plans = [{"num_splits": 1, "reduce": "last"}]
            else:
                reds = space["reduce"] if chosen["num_splits"] > 1 else ["none"]
                plans = [{"reduce": red, "waves": 1} for red in reds]
            for plan in plans:
                p = {**chosen, **plan}
                if _fu_valid(p, shape, sm_count) is None:
                    later = {k: v for k, v in p.items() if k in FU_LATER_DEFAULTS and v == FU_LATER_DEFAULTS[k]}
                    out.append(Variant.make(NAME, **{k: v for k, v in p.items() if k not in later}))
            return
        if keys[i] == "reduce":
            walk(i + 1, chosen)
            return
        for value in space[keys[i]]:
            walk(i + 1, {**chosen, keys[i]: value})

    walk(0, {})
    return list(dict.fromkeys(out))


class _FuBuffers:
    """Partials and arrival counters for up to `batch` sequences, grown (once) on demand.

    Partial slots per sequence: num_splits (split grid, none for 1 split); the persistent
    grid with P programs needs batch + P slots in all.
    """

    def __init__(self, device, batch: int, num_splits: int, programs: int = 0):
        self.device = device
        self.num_splits = num_splits
        self.programs = programs
        self.batch = 0
        self.grow(batch)

    def grow(self, batch: int) -> None:
        if self.programs:
            slots = fu_persistent_slots(batch, self.programs)
        else:
            slots = batch * self.num_splits if self.num_splits > 1 else 0
        n = slots * NUM_HEADS
        dev = self.device
        self.part_o = torch.empty(max(n * V_DIM, 1), dtype=torch.float32, device=dev)
        self.part_lse = torch.empty(max(n, 1), dtype=torch.float32, device=dev)
        # Zero once: the kernel's last arriving program resets its counter itself.
        self.count = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.flag = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.out = torch.empty((batch, NUM_HEADS, V_DIM), dtype=torch.bfloat16, device=dev)
        self.batch = batch


def _fu_tma_ready(load: str, device) -> None:
    """Refuse a TMA load this Triton cannot do; for device descriptors, set the allocator
    their per-program scratch comes from (triton.set_allocator, Triton >= 3.4)."""
    import triton
    import triton.language as tl

    if load == "tma":
        require(hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator"),
                f"load=tma needs tl.make_tensor_descriptor and triton.set_allocator (triton {triton.__version__})")

        def _fu_alloc(size: int, alignment: int, stream):
            return torch.empty(size, dtype=torch.int8, device=device)

        triton.set_allocator(_fu_alloc)
    elif load == "tma_host":
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"load=tma_host needs triton.tools.tensor_descriptor ({exc})") from exc


def build(variant: Variant, shape: Shape, device, *, sm_scale: float = SM_SCALE):
    """A runner(q, kv_data, qo_indptr, kv_indptr) -> out at softmax scale `sm_scale` (a
    runtime argument of the kernel)."""
    validate(variant)
    if _fu_is_serving(variant):
        raise ValueError(f"{NAME}: {variant} is a serving variant (max_splits, tokens_per_split); "
                         "run it with build_serving, or give build a num_splits variant")
    p = {**FU_LATER_DEFAULTS, **variant.p}
    device = torch.device(device)
    if device.type == "cuda":
        sm_count = device_sm_count(device)
    else:
        sm_count = _FU_NO_RESIDENCY_LIMIT  # interpreter: no SMs (and spin is not tested there)
    reason = _fu_valid(p, shape, sm_count)
    require(reason is None, f"triton_fused cannot run {variant} at {shape}: {reason}")
    kv_fmt = p["kv"]
    num_splits = p["num_splits"]
    load = p["load"]
    if load != "ptr":
        _fu_tma_ready(load, device)
    # Persistent grid: at most this many programs (fewer when the batch has fewer tiles).
    max_programs = 0
    if p["grid"] == "persistent":
        max_programs = (sm_count if device.type == "cuda" else _FU_INTERPRET_SMS) * p["waves"]
    bufs = _FuBuffers(device, shape.batch, num_splits, max_programs)
    dummy = torch.zeros(1, dtype=torch.float32, device=device)
    options = dict(
        num_splits=num_splits, kv_fmt=kv_fmt, q_fp8=p["q"] == "fp8_dynamic",
        qk_dot=p["qk_dot"], pv_dot=p["pv_dot"], tok_m=bool(p["tok_m"]), block_n=p["block_n"],
        reduce=p["reduce"], num_warps=p["num_warps"], num_stages=p["num_stages"],
        sm_scale_log2=sm_scale * math.log2(math.e), load=load,
    )

    def run_triton_fused(q, kv_data, qo_indptr, kv_indptr):
        batch = q.shape[0]
        if batch > bufs.batch:
            bufs.grow(batch)  # a larger ragged batch than planned: one allocation, once
        if p["reduce"] == "spin":
            require(batch * num_splits <= sm_count, f"reduce=spin: {batch} x {num_splits} programs exceed {sm_count} SMs")
        entry = kv_data[kv_fmt]
        if kv_fmt == "bf16":
            kv, kv_scale, mx_scales = entry.view(-1, QK_DIM), dummy, dummy
        elif kv_fmt == "fp8":
            kv, kv_scale = entry
            kv, mx_scales = kv.view(-1, QK_DIM), dummy
        else:
            packed, mx_scales = entry
            kv, kv_scale = packed.view(torch.uint8).view(-1, QK_DIM // 2), dummy
            mx_scales = mx_scales.view(torch.uint8)
        if load != "ptr":
            require(kv.data_ptr() % 16 == 0, f"load={load}: the KV cache must start 16-byte aligned")
        # Host shapes only (no sync): the grid never has more programs than tiles.
        programs = min(max_programs, -(-kv.shape[0] // p["block_n"])) if max_programs else 0
        out = bufs.out[:batch]
        run_triton_fused.compiled = fused_decode(
            q, kv, kv_scale, mx_scales, kv_indptr, out, bufs.part_o, bufs.part_lse,
            bufs.count, bufs.flag, programs=max(programs, 1) if max_programs else 0, **options,
        )
        return out

    run_triton_fused.compiled = None
    return run_triton_fused


# ------------------------------------------------------------------------ the serving call
# Serving defaults, untuned (a serving table holds the tuned picks): block_n 64, 4 warps and 2
# stages (as the GPU serving tests run; three stages of a bf16 cache's 64-token tiles
# would take 221 KB of the H200's 227 KB of shared memory), 16 MMA columns per program, a
# split every 256 tokens. Scratch per new token is max_splits x heads x
# 2 KiB: max_splits (SMs / head tiles) makes that about sm_count x block_h x 2 KiB, and the
# cap bounds it where few head tiles would ask for more.
_FU_SERVING_TOKENS_PER_SPLIT = 256
_FU_SERVING_MAX_SPLITS = 64
_FU_MMA_COLUMNS = 16  # the smallest tl.dot N: block_h x next_pow2(max_q_len) columns
# A platform without SMs (the interpreter) stands in this many, so CPU tests still split.
_FU_SERVING_STANDIN_SMS = 4


def serving_q_reference(variant: Variant) -> str:
    """The q format (serving.inputs.reference's q_format) the serving gate's reference reads
    for `variant` under `reference_q: variant`: fp8_row for fp8 q (kernels/fused_decode.py
    quantizes q per (new token, head) row, amax / 448, e4m3fn: serving.inputs
    quantize_fp8_rows), bf16 for bf16 q."""
    return "fp8_row" if str(variant.get("q", "bf16")).startswith("fp8") else "bf16"


def _fu_next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def default_serving_variant(spec: CallSpec, platform) -> Variant:
    """A correct, untuned serving variant for `spec` on `platform` (mla_tune.gpu.Platform):
    the fewest heads per program that fill 16 MMA columns with next_pow2(max_q_len) new
    tokens, max_splits that let one sequence fill the platform's SMs (`sm_count`), a split
    every 256 tokens, bf16 q, and bf16 dots (fp16 where no GPU runs them: the
    interpreter's bf16 dot is wrong)."""
    reason = CAPABILITIES.refusal(spec)
    if reason is not None:
        raise ValueError(f"{NAME} cannot serve {spec}: {reason}")
    block_h = max(1, _FU_MMA_COLUMNS // _fu_next_pow2(spec.max_q_len))
    if spec.heads % block_h:
        raise ValueError(f"{NAME}: {spec.heads} heads do not split into tiles of {block_h} heads "
                         f"(the 16 MMA columns at max_q_len {spec.max_q_len}); use heads from "
                         f"{', '.join(map(str, CORE_HEADS))}")
    sm_count = platform.sm_count or _FU_SERVING_STANDIN_SMS
    max_splits = max(1, min(-(-sm_count // (spec.heads // block_h)), _FU_SERVING_MAX_SPLITS))
    dot = "bf16" if platform.has_gpu else "fp16"
    return Variant.make(
        NAME, kv=spec.kv_format, q="bf16", qk_dot=dot, pv_dot=dot, block_n=64, block_h=block_h,
        max_splits=max_splits, tokens_per_split=_FU_SERVING_TOKENS_PER_SPLIT, num_warps=4,
        num_stages=2,
    )


# The serving search space (configs/serving.yaml, one backend section or sub-grid), the keys
# serving_candidates takes: as triton's (backends/triton_splitk.py), with qk_dot / pv_dot
# for dot_dtype and mma_columns (block_h x next_pow2(max_q_len)) for mma_rows.
_FU_SERVING_SPACE_KEYS = ("kv", "q", "qk_dot", "pv_dot", "block_n", "mma_columns", "num_warps",
                      "num_stages", "tokens_per_split", "split_waves", "max_splits", "max_splits_cap")


def _fu_serving_lists(space: dict, spec: CallSpec) -> dict:
    unknown = sorted(set(space) - set(_FU_SERVING_SPACE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the {NAME} serving space; known: "
                         f"{', '.join(_FU_SERVING_SPACE_KEYS)}")

    def listed(key: str, default: list) -> list:
        value = space.get(key, default)
        return list(value) if isinstance(value, (list, tuple)) else [value]

    lists = {
        "kv": listed("kv", [spec.kv_format]), "q": listed("q", ["bf16"]),
        "qk_dot": listed("qk_dot", ["bf16"]), "pv_dot": listed("pv_dot", ["bf16"]),
        "block_n": listed("block_n", [64]), "mma_columns": listed("mma_columns", [_FU_MMA_COLUMNS]),
        "num_warps": listed("num_warps", [4]), "num_stages": listed("num_stages", [2]),
        "tokens_per_split": listed("tokens_per_split", [_FU_SERVING_TOKENS_PER_SPLIT]),
        "split_waves": listed("split_waves", [1]), "max_splits": listed("max_splits", []),
    }
    for key, known in (("kv", _FU_SERVING_KV), ("q", _FU_Q), ("qk_dot", _FU_DOTS), ("pv_dot", _FU_DOTS),
                       ("block_n", _FU_BLOCK_N)):
        bad = [v for v in lists[key] if v not in known]
        if bad:
            raise ValueError(f"{NAME} serving space: {key} {bad} not offered; known: {', '.join(map(str, known))}")
    for key in ("mma_columns", "split_waves", "max_splits", "tokens_per_split"):
        bad = [v for v in lists[key] if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
               or (key != "split_waves" and not isinstance(v, int))]
        if bad:
            raise ValueError(f"{NAME} serving space: {key} must hold positive "
                             f"{'numbers' if key == 'split_waves' else 'integers'}, got {bad}")
    bad_columns = [c for c in lists["mma_columns"] if c < _FU_MMA_COLUMNS or c & (c - 1)]
    if bad_columns:
        raise ValueError(f"{NAME} serving space: mma_columns must be powers of two >= {_FU_MMA_COLUMNS}, "
                         f"got {bad_columns}")
    cap = space.get("max_splits_cap", _FU_SERVING_MAX_SPLITS)
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= PARAM_MAX_SPLITS:
        raise ValueError(f"{NAME} serving space: max_splits_cap must be an integer 1..{PARAM_MAX_SPLITS}, got {cap!r}")
    lists["max_splits_cap"] = cap
    return lists


def serving_candidates(spec: CallSpec, space: dict, platform) -> list[Variant]:
    """The serving variants to sweep for the family `spec` on `platform`, from one search
    space (_FU_SERVING_SPACE_KEYS): the product of its lists where the family allows them,
    combinations validate() refuses left out (q=fp8_dynamic goes with qk_dot=fp8, fp8 dots
    read fp8 KV). A grid whose `kv` excludes spec.kv_format offers nothing; block_h =
    mma_columns / next_pow2(max_q_len) where that divides the heads; max_splits: for each
    split wave w, ceil(w x SMs / head tiles) capped at max_splits_cap, plus explicit
    max_splits; with max_splits 1, one tokens_per_split (the largest). Where no GPU runs
    them (platform.has_gpu False) bf16 dots become fp16 and fp8 dots are not offered (the
    interpreter's bf16 dot and fp8 casts are wrong). Nothing for a spec CAPABILITIES refuses."""
    if CAPABILITIES.refusal(spec) is not None:
        return []
    lists = _fu_serving_lists(dict(space or {}), spec)
    if spec.kv_format not in lists["kv"]:
        return []
    columns = _fu_next_pow2(spec.max_q_len)
    block_hs = sorted({c // columns for c in lists["mma_columns"]
                       if c // columns >= 1 and spec.heads % (c // columns) == 0})
    sm_count = platform.sm_count or _FU_SERVING_STANDIN_SMS

    def dot(d: str) -> str | None:
        if platform.has_gpu:
            return d
        return None if d == "fp8" else "fp16"

    out: list[Variant] = []
    for block_h in block_hs:
        tiles = spec.heads // block_h
        splits = {max(1, min(math.ceil(w * sm_count / tiles), lists["max_splits_cap"]))
                  for w in lists["split_waves"]}
        splits = sorted(splits | {min(m, PARAM_MAX_SPLITS) for m in lists["max_splits"]})
        for q, qk, pv, block_n, warps, stages, max_splits in itertools.product(
                lists["q"], lists["qk_dot"], lists["pv_dot"], lists["block_n"], lists["num_warps"],
                lists["num_stages"], splits):
            qk, pv = dot(qk), dot(pv)
            if qk is None or pv is None or (qk == "fp8") != (q == "fp8_dynamic"):
                continue
            if "fp8" in (qk, pv) and spec.kv_format != "fp8":
                continue
            rules = [max(lists["tokens_per_split"])] if max_splits == 1 else lists["tokens_per_split"]
            for tokens_per_split in rules:
                variant = Variant.make(
                    NAME, kv=spec.kv_format, q=q, qk_dot=qk, pv_dot=pv, block_n=block_n,
                    block_h=block_h, max_splits=max_splits, tokens_per_split=tokens_per_split,
                    num_warps=warps, num_stages=stages)
                validate(variant)  # a bad num_warps or num_stages fails here, naming it
                out.append(variant)
    return list(dict.fromkeys(out))


def build_serving(variant: Variant, spec: CallSpec, device):
    """The serving call's runner for calls of `spec` (docs/runtime.md's contract): an
    OwnServingRunner (kernels/serving_runner.py) over fused_decode_serving, returning out,
    or (out, lse) with spec.return_lse. The softmax scale is spec.sm_scale (a runtime
    argument of the kernel)."""
    validate(variant)
    check_serving_build(NAME, variant, spec, CAPABILITIES, _fu_is_serving(variant), _FU_MMA_COLUMNS,
                        "MMA columns")
    p = variant.p
    launch = dict(serving_launch_args(variant, spec), q_fp8=p["q"] == "fp8_dynamic", qk_dot=p["qk_dot"],
                  pv_dot=p["pv_dot"])
    return OwnServingRunner(NAME, spec, torch.device(device), fused_decode_serving, FusedServingWorkspace,
                            p["max_splits"], launch, LaunchReplay.build)



def compile_shape(variant: Variant, shape: Shape, sm_count: int | None) -> Shape:
    """The smallest shape whose launch specializes as `shape`'s and accepts the variant.

    Split grid: every constexpr comes from the variant (NS_P2 from num_splits), so one
    sequence with a tile per split does (_fu_valid: no more splits than tiles; spin: a grid
    of num_splits programs fits wherever batch x num_splits did). Persistent grid: the
    reduction chunk RCH depends on programs per sequence (fused_decode), so the stand-in
    has one sequence and the tile count giving the same RCH (needs sm_count)."""
    p = {**FU_LATER_DEFAULTS, **variant.p}
    if p["grid"] != "persistent":
        return Shape(1, p["num_splits"] * p["block_n"])
    if not sm_count:
        return shape

    def chunk(s: Shape) -> int:  # as fused_decode computes RCH, with build's program count
        programs = max(1, min(sm_count * p["waves"], -(-s.total_kv // p["block_n"])))
        per_seq = -(-programs // s.batch) + 1
        return min(32, max(2, 1 << (per_seq - 1).bit_length()))  # triton.next_power_of_2

    want = chunk(shape)
    for tiles in range(1, sm_count * p["waves"] + 1):
        if chunk(Shape(1, tiles * p["block_n"])) == want:
            return Shape(1, tiles * p["block_n"])
    return shape


# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = tuple(FU_DEFAULT_SPACE)
