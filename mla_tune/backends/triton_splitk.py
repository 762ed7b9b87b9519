"""The `triton` backend: split-K flash-decode (mla_tune/kernels/flash_decode.py).

Reads bf16 or fp8 KV with bf16, dynamically quantized or statically quantized fp8 q.
Handles ragged batches (bounds are read on the device) and any batch size: a runner
built for one batch reallocates its buffers when a call brings another. Exportable module.

Two parameter sets: the leaderboard's (`build`: kv, q, num_splits, block_n, num_warps,
num_stages, dot_dtype) and the serving call's (`build_serving`, flash_decode_serving: kv,
q, block_n, block_h, max_splits, tokens_per_split, num_warps, num_stages, dot_dtype),
told apart by max_splits / tokens_per_split. Both take q_amax (q=fp8_static) and the ROCm
compiler options.
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
    SM_SCALE,
    V_DIM,
    CallSpec,
    Capabilities,
    Shape,
    Variant,
    device_sm_count,
    fp8_dtype_for,
)
from mla_tune.kernels.flash_decode import (
    FlashDecodeServingWorkspace,
    FlashDecodeWorkspace,
    flash_decode,
    flash_decode_num_splits,
    flash_decode_serving,
)
from mla_tune.kernels.launch import LaunchReplay
from mla_tune.kernels.serving_runner import (
    OwnServingRunner,
    check_serving_build,
    serving_launch_args,
)

NAME = "triton"

CAPABILITIES = Capabilities(
    kv_formats=("bf16", "fp8"),
    q_modes=("bf16", "fp8_dynamic", "fp8_static"),
    ragged=True,  # its leaderboard runner reads kv_indptr per sequence
    serving=True,  # kernels/flash_decode.py's flash_decode_serving
    contiguous=True,
    page_sizes=CORE_PAGE_SIZES,
    heads=CORE_HEADS,
    max_q_len=4,
    mixed_q_len=True,
    graph_safe=True,  # split counts computed on the device, buffers sized from maxima
    precompile=True,
    lse=True,  # flash_decode_serving writes it (lse=): stage 1 for one split, else stage 2
)

_tsk_KV_FORMATS = ("bf16", "fp8")
_tsk_Q_MODES = ("bf16", "fp8_dynamic", "fp8_static")
_tsk_DOT_DTYPES = ("fp16", "bf16")
_tsk_LAUNCH = ("num_splits", "block_n", "num_warps", "num_stages")
# Stage 1's register-file options (flash_decode's v_split and qk_split): optional, absent = 1,
# and a variant carries one only where it is not 1, so a variant's name says which kernel runs.
_tsk_REGISTER_KEYS = ("v_split", "qk_split")
_tsk_SPACE_KEYS = ("kv", "q", *_tsk_LAUNCH, "dot_dtype", *_tsk_REGISTER_KEYS)
_tsk_HIP_KEYS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# The serving call's parameters (max_splits / tokens_per_split mark the set, split_budget
# optional: 0 or absent gives max_splits per sequence) are in backends/params.py.
# A grid of more than this many waves of SMs gains nothing from splitting further and
# pays for the larger stage-2 reduction.
_tsk_MAX_WAVES = 4
# The interpreter has no SMs; the default variant pretends this many, so CPU tests still
# take the split path.
_tsk_INTERPRETER_SMS = 4


def _tsk_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed; pip install triton (or use the torch backend)."
    if torch.cuda.is_available() or _tsk_interpreted():
        return None
    return "no CUDA or ROCm GPU is visible; set TRITON_INTERPRET=1 to run the kernels on the CPU."


def _tsk_list(space: dict, key: str, default: list) -> list:
    value = space.get(key, default)
    return list(value) if isinstance(value, (list, tuple)) else [value]


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    """The product of the lists in `space`, pruned: no split shorter than a tile (unless
    num_splits is 1), no grid over 4 waves of SMs (unless it is the smallest offered) and
    none over the platform's shared memory (lds_refusal). v_split and qk_split of 1 are
    left out of the variant (the kernel's default). fp8_static variants come without
    q_amax: the sweep calibrates and adds it."""
    space = dict(space or {})
    unknown = sorted(set(space) - {*_tsk_SPACE_KEYS, "hip"})
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in the triton search space; known: {', '.join(_tsk_SPACE_KEYS)}, hip"
        )
    dot_default = "fp16" if _tsk_interpreted() else "bf16"
    lists = {
        "kv": _tsk_list(space, "kv", ["fp8"]),
        "q": _tsk_list(space, "q", ["bf16"]),
        "num_splits": _tsk_list(space, "num_splits", [1]),
        "block_n": _tsk_list(space, "block_n", [32]),
        "num_warps": _tsk_list(space, "num_warps", [4]),
        "num_stages": _tsk_list(space, "num_stages", [1]),
        "dot_dtype": _tsk_list(space, "dot_dtype", [dot_default]),
        "v_split": _tsk_list(space, "v_split", [1]),
        "qk_split": _tsk_list(space, "qk_split", [1]),
    }
    for key, known in (("kv", _tsk_KV_FORMATS), ("q", _tsk_Q_MODES), ("dot_dtype", _tsk_DOT_DTYPES),
                       ("v_split", (1, 2)), ("qk_split", (1, 2, 4, 8))):
        bad = [v for v in lists[key] if v not in known]
        if bad:
            raise ValueError(f"triton search space: {key} {bad} not supported; known: "
                             f"{', '.join(map(str, known))}")
    hip = space.get("hip") or {}
    if not isinstance(hip, dict):
        raise ValueError(f"triton search space: hip must be a mapping of lists, got {hip!r}")
    bad_hip = sorted(set(hip) - set(_tsk_HIP_KEYS))
    if bad_hip:
        raise ValueError(f"unknown key(s) {bad_hip} in triton hip space; known: {', '.join(_tsk_HIP_KEYS)}")
    hip_lists = {k: _tsk_list(hip, k, []) for k in hip} if platform.is_hip else {}

    smallest_splits = min(lists["num_splits"])
    max_grid = _tsk_MAX_WAVES * platform.sm_count
    keys = list(lists) + list(hip_lists)
    out: list[Variant] = []
    for values in itertools.product(*lists.values(), *hip_lists.values()):
        params = dict(zip(keys, values, strict=True))
        splits, block_n = params["num_splits"], params["block_n"]
        if splits > 1 and shape.kv_len / splits < block_n:
            continue
        if max_grid > 0 and shape.batch * splits > max_grid and splits != smallest_splits:
            continue
        for name in _tsk_REGISTER_KEYS:
            if params[name] == 1:
                del params[name]
        variant = Variant.make(NAME, **params)
        if lds_refusal(variant, platform) is None:
            out.append(variant)
    return list(dict.fromkeys(out))


def stage1_lds_floor(variant: Variant) -> int:
    """A lower bound on the shared memory (LDS) stage 1 of leaderboard `variant` needs, in
    bytes: the software pipeline keeps num_stages - 1 tiles of [block_n, 576] KV elements
    in it (num_stages >= 2), and without one the value operand passes through it ([block_n,
    512 / v_split] KV elements). It held for every stage-1 binary measured (xcompile.md's
    sizes for gfx950, gfx942 and sm_90, and configs/mi355x.yaml's 716 candidates compiled
    for gfx950 under Triton 3.6 and 3.9), often with equality, the largest 2.4x over it: a
    variant over a limit by it cannot load there; one under it may still not (the compile
    check, mla-tune compile, measures)."""
    p = variant.p
    elem = 1 if p["kv"] == "fp8" else 2
    if p["num_stages"] >= 2:
        return (p["num_stages"] - 1) * p["block_n"] * 576 * elem
    return p["block_n"] * (V_DIM // (p.get("v_split") or 1)) * elem


def lds_refusal(variant: Variant, platform) -> str | None:
    """Why `variant` cannot run on `platform` for its shared memory (LDS), or None: its
    stage-1 floor (stage1_lds_floor) over the platform's per-kernel limit. The limit is
    `platform.lds_bytes` where the platform carries it, else the shared memory per SM the
    device reported (`smem_per_sm`); with neither (0), nothing is refused."""
    limit = platform.lds_bytes or platform.smem_per_sm
    if not limit or _tsk_is_serving(variant):
        return None
    need = stage1_lds_floor(variant)
    if need <= limit:
        return None
    return (f"{variant} needs at least {need} bytes of shared memory (LDS) for its KV tiles, over "
            f"{platform.name}'s {limit}; use a smaller block_n or fewer num_stages")


def default_variant(shape: Shape, sm_count: int | None = None, kv: str = "fp8",
                    q: str = "bf16") -> Variant:
    """A config correct for every shape (ragged too) reading `kv` KV with `q` q (bf16 or
    fp8_dynamic: a static scale needs a calibration), with enough splits to fill about one
    wave of `sm_count` SMs (None: the current device's, asked once; the interpreter, which
    has none, stands in a few). The fallback for shapes a table lacks (dispatch.py's policy
    picks kv and q per correctness rule)."""
    if q not in ("bf16", "fp8_dynamic"):
        raise ValueError(f"triton: the default variant reads q as bf16 or fp8_dynamic, not {q!r}")
    if sm_count is None:
        sm_count = device_sm_count() or _tsk_INTERPRETER_SMS
    block_n = 32
    return Variant.make(
        NAME,
        kv=kv,
        q=q,
        num_splits=flash_decode_num_splits(shape.batch, shape.kv_len, sm_count, block_n),
        block_n=block_n,
        num_warps=4,
        num_stages=2,
        # The interpreter computes bf16 dots wrongly; fp16 holds every operand here as well.
        dot_dtype="fp16" if _tsk_interpreted() else "bf16",
    )


def _tsk_is_serving(variant: Variant) -> bool:
    """A serving variant (build_serving) carries max_splits / tokens_per_split; a
    leaderboard one (build) carries num_splits."""
    return "max_splits" in variant.p or "tokens_per_split" in variant.p


def validate(variant: Variant) -> None:
    """Refuse a missing, unknown or ill-valued parameter (names and values only; which
    num_splits suit a shape is candidates()' business, and any fits the kernel). Takes
    leaderboard variants (num_splits) and serving variants (max_splits, tokens_per_split,
    block_h); which heads and q_len a block_h suits is build_serving's business."""
    if variant.backend != NAME:
        raise ValueError(f"triton: {variant} is a {variant.backend} variant, not a triton one")
    # names, choices and bounds (the serving form when max_splits/tokens_per_split is
    # there, the ROCm options waves_per_eu, matrix_instr_nonkdim, kpack): backends/params.py
    check_variant_rules(variant, PARAM_RULES[NAME])


def build(variant: Variant, shape: Shape, device, *, sm_scale: float = SM_SCALE):
    """A runner(q, kv_data, qo_indptr, kv_indptr) -> out that launches without a host sync,
    at softmax scale `sm_scale` (a runtime argument of the kernels: no recompile per value)."""
    validate(variant)
    if _tsk_is_serving(variant):
        raise ValueError(f"triton: {variant} is a serving variant (max_splits, tokens_per_split); "
                         "run it with build_serving, or give build a num_splits variant")
    kv_format, q_mode, dot_dtype = variant.get("kv"), variant.get("q"), variant.get("dot_dtype")
    launch = {name: variant.get(name) for name in _tsk_LAUNCH}
    launch.update({name: variant.get(name) or 1 for name in _tsk_REGISTER_KEYS})
    hip_options = {k: variant.get(k) for k in _tsk_HIP_KEYS if variant.get(k) is not None}
    device = torch.device(device)
    q_fp8_dtype = fp8_dtype_for(device) if q_mode != "bf16" else torch.float8_e4m3fn
    q_scale = None
    if q_mode == "fp8_static":
        q_scale = float(variant.get("q_amax")) / torch.finfo(q_fp8_dtype).max

    state: dict = {}

    def allocate(batch: int) -> None:
        state["batch"] = batch
        state["out"] = torch.empty((batch, NUM_HEADS, V_DIM), dtype=torch.bfloat16, device=device)
        state["workspace"] = FlashDecodeWorkspace.allocate(batch, launch["num_splits"], device)

    allocate(shape.batch)

    def run_triton_splitk(q, kv_data, qo_indptr, kv_indptr):
        if q.shape[0] != state["batch"]:
            allocate(q.shape[0])
        if kv_format == "fp8":
            kv, kv_scale = kv_data["fp8"]
        else:
            kv, kv_scale = kv_data["bf16"], None
        return flash_decode(
            q, kv, kv_scale, kv_indptr, state["out"], **launch, dot_dtype=dot_dtype,
            q_mode=q_mode, q_scale=q_scale, q_fp8_dtype=q_fp8_dtype,
            workspace=state["workspace"], hip_options=hip_options, sm_scale=sm_scale,
        )

    return run_triton_splitk


# ------------------------------------------------------------------------ the serving call
# Serving defaults, untuned (issue 10 adds a serving table): tiles as the H200 table's
# leaderboard winners (block_n 64, 4 warps, 2 stages), 16 MMA rows per program, and a
# split every 256 tokens, so a long sequence spreads over the SMs and a short one runs
# in one program per head tile without a reduction.
_tsk_SERVING_TOKENS_PER_SPLIT = 256
# Scratch per new token is max_splits x heads x 2 KiB of fp32 partials: the default's
# max_splits (SMs / head tiles) makes that about sm_count x block_h x 2 KiB (4.3 MiB on an
# H200); the cap bounds it where few head tiles would ask for more (16 heads: 2 MiB).
_tsk_SERVING_MAX_SPLITS = 64
_tsk_MMA_ROWS = 16  # the smallest tl.dot M: block_h x next_pow2(max_q_len) rows per program
_tsk_GPU_ROWS = 64  # rows per program of the GPU default (head tile x new tokens)
_tsk_GPU_TOKENS_PER_SPLIT = 512
_tsk_GPU_BUDGET_TOKENS_PER_SPLIT = 128  # the 64-row GPU default's, with its batch budget


def _tsk_next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def default_serving_variant(spec: CallSpec, platform) -> Variant:
    """A correct, untuned serving variant for `spec` on `platform` (mla_tune.gpu.Platform):
    on a GPU, heads per program for 64 MMA rows (head tile x next_pow2(max_q_len), at most
    all the heads); where they make 64 rows, 8 warps, a split every 128 tokens and a batch
    budget of one wave of splits (split_budget ceil(sm_count / head tiles), shared by the
    sequences by length), else 4 warps, a split every 512 tokens and no budget; without one
    (the interpreter), the fewest heads that fill 16 rows, 4 warps, a split every 256 tokens
    and no budget. max_splits lets one sequence fill the platform's SMs
    (`sm_count`; a platform without any stands in a few); bf16 q, and bf16 dots (fp16 where
    no GPU runs them: the interpreter's bf16 dot is wrong)."""
    reason = CAPABILITIES.refusal(spec)
    if reason is not None:
        raise ValueError(f"triton cannot serve {spec}: {reason}")
    rows = _tsk_next_pow2(spec.max_q_len)
    block_h = max(1, _tsk_MMA_ROWS // rows)
    warps, tokens, full = 4, _tsk_SERVING_TOKENS_PER_SPLIT, False
    if platform.has_gpu:
        # On the H200 (docs/perf.md, "head tiles"), 128 heads at ~4k tokens: 64 rows per
        # program with 8 warps and a split per 512 tokens ran 1.7x faster than 16 rows (the
        # KV is read once per head tile); the interpreter keeps the small tile (test time).
        block_h = min(spec.heads, max(block_h, _tsk_GPU_ROWS // rows))
        full = block_h * rows >= _tsk_GPU_ROWS  # the 64-row tile: 8 warps and a batch budget
        warps = 8 if full else 4
        tokens = _tsk_GPU_BUDGET_TOKENS_PER_SPLIT if full else _tsk_GPU_TOKENS_PER_SPLIT
    if spec.heads % block_h:
        raise ValueError(f"triton: {spec.heads} heads do not split into tiles of {block_h} heads "
                         f"(the 16 MMA rows at max_q_len {spec.max_q_len}); use heads from "
                         f"{', '.join(map(str, CORE_HEADS))}")
    sm_count = platform.sm_count or _tsk_INTERPRETER_SMS
    head_tiles = spec.heads // block_h
    max_splits = max(1, min(-(-sm_count // head_tiles), _tsk_SERVING_MAX_SPLITS))
    # The 64-row GPU default's batch shares one wave of splits (docs/perf.md 7, "Split-K's GPU
    # default of 64 MMA rows shares one wave of splits": faster than max_splits per sequence
    # at most recorded cells, and its scratch is what the budget launches)
    budget = batch_split_budget(1, sm_count, head_tiles) if full and max_splits > 1 else 0
    return Variant.make(
        NAME, kv=spec.kv_format, q="bf16", block_n=64, block_h=block_h, max_splits=max_splits,
        tokens_per_split=tokens, num_warps=warps, num_stages=2,
        dot_dtype="bf16" if platform.has_gpu else "fp16", **({"split_budget": budget} if budget else {}),
    )


# The serving search space (configs/serving.yaml, one backend section or sub-grid), the keys
# serving_candidates takes. block_h and max_splits are derived per family: block_h from the
# MMA rows wanted (block_h x next_pow2(max_q_len)), max_splits from waves of the platform's
# SMs over the family's head tiles, capped (scratch is max_splits x heads x 2 KiB per token).
# batch_waves: variants whose whole batch shares a split budget of that many waves of the
# SMs over the head tiles (split_budget; flash_decode_serving).
_tsk_SERVING_SPACE_KEYS = ("kv", "q", "block_n", "mma_rows", "num_warps", "num_stages", "dot_dtype",
                      "tokens_per_split", "split_waves", "batch_waves", "max_splits", "max_splits_cap")


def _tsk_serving_lists(space: dict, spec: CallSpec, platform) -> dict:
    """The space's lists with defaults (the default serving variant's values), refusing an
    unknown key or a value no serving variant takes."""
    unknown = sorted(set(space) - set(_tsk_SERVING_SPACE_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the triton serving space; known: "
                         f"{', '.join(_tsk_SERVING_SPACE_KEYS)}")
    lists = {
        "kv": _tsk_list(space, "kv", [spec.kv_format]),
        "q": _tsk_list(space, "q", ["bf16"]),
        "block_n": _tsk_list(space, "block_n", [64]),
        "mma_rows": _tsk_list(space, "mma_rows", [_tsk_MMA_ROWS]),
        "num_warps": _tsk_list(space, "num_warps", [4]),
        "num_stages": _tsk_list(space, "num_stages", [2]),
        "dot_dtype": _tsk_list(space, "dot_dtype", ["bf16"]),
        "tokens_per_split": _tsk_list(space, "tokens_per_split", [_tsk_SERVING_TOKENS_PER_SPLIT]),
        "split_waves": _tsk_list(space, "split_waves", [1]),
        "batch_waves": _tsk_list(space, "batch_waves", []),
        "max_splits": _tsk_list(space, "max_splits", []),
    }
    for key, known in (("kv", _tsk_KV_FORMATS), ("q", ("bf16", "fp8_dynamic")),
                       ("dot_dtype", _tsk_DOT_DTYPES)):
        bad = [v for v in lists[key] if v not in known]
        if bad:
            raise ValueError(f"triton serving space: {key} {bad} not offered; known: {', '.join(known)}"
                             + (" (fp8_static needs a calibration the serving sweep does not make)"
                                if key == "q" else ""))
    waves = ("split_waves", "batch_waves")
    for key in ("mma_rows", *waves, "max_splits", "tokens_per_split"):
        bad = [v for v in lists[key] if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
               or (key not in waves and not isinstance(v, int))]
        if bad:
            raise ValueError(f"triton serving space: {key} must hold positive "
                             f"{'numbers' if key in waves else 'integers'}, got {bad}")
    bad_rows = [r for r in lists["mma_rows"] if r < _tsk_MMA_ROWS or r & (r - 1)]
    if bad_rows:
        raise ValueError(f"triton serving space: mma_rows must be powers of two >= {_tsk_MMA_ROWS}, got {bad_rows}")
    cap = space.get("max_splits_cap", _tsk_SERVING_MAX_SPLITS)
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= PARAM_MAX_SPLITS:
        raise ValueError(f"triton serving space: max_splits_cap must be an integer 1..{PARAM_MAX_SPLITS}, got {cap!r}")
    lists["max_splits_cap"] = cap
    if not platform.has_gpu:  # the interpreter's bf16 dot is wrong: fp16 stands in
        lists["dot_dtype"] = list(dict.fromkeys("fp16" for _ in lists["dot_dtype"]))
    return lists


def _tsk_serving_split_counts(spec: CallSpec, block_h: int, split_waves, max_splits, cap: int,
                         sm_count: int) -> list[int]:
    """The max_splits values offered for a family: for each w in split_waves, enough splits
    for one sequence to fill w waves of the SMs with the family's head tiles (ceil(w x SMs
    / (heads / block_h))), capped; plus the explicit max_splits values; sorted."""
    tiles = spec.heads // block_h
    counts = {max(1, min(math.ceil(w * sm_count / tiles), cap)) for w in split_waves}
    counts |= {min(m, PARAM_MAX_SPLITS) for m in max_splits}
    return sorted(counts)


def batch_split_budget(waves: float, sm_count: int, head_tiles: int) -> int:
    """The split_budget of `waves` waves of `sm_count` SMs over `head_tiles` head tiles (each
    split runs one program per head tile)."""
    return math.ceil(waves * sm_count / head_tiles)


def serving_candidates(spec: CallSpec, space: dict, platform) -> list[Variant]:
    """The serving variants to sweep for the family `spec` on `platform`, from one search
    space (_tsk_SERVING_SPACE_KEYS): the product of its lists where the family allows them. A
    grid whose `kv` excludes spec.kv_format offers nothing (sub-grids are per format);
    block_h = mma_rows / next_pow2(max_q_len) where that divides the heads; max_splits from
    _tsk_serving_split_counts (platform.sm_count, or a stand-in of a few on the interpreter);
    with max_splits 1 the split rule is moot, so one tokens_per_split (the largest) is
    offered; each of batch_waves W adds variants with a batch split budget of ceil(W x SMs /
    head tiles) (split_budget, and max_splits as much, capped), one per tokens_per_split, and
    a space with batch_waves but no split_waves offers no per-sequence caps beside them
    (the default split_waves [1] is dropped; explicit max_splits stay); dot dtypes become
    fp16 where no GPU runs them (platform.has_gpu False).
    Nothing is offered for a spec CAPABILITIES refuses."""
    if CAPABILITIES.refusal(spec) is not None:
        return []
    lists = _tsk_serving_lists(dict(space or {}), spec, platform)
    if spec.kv_format not in lists["kv"]:
        return []
    rows = _tsk_next_pow2(spec.max_q_len)
    block_hs = sorted({r // rows for r in lists["mma_rows"]
                       if r // rows >= 1 and spec.heads % (r // rows) == 0})
    sm_count = platform.sm_count or _tsk_INTERPRETER_SMS
    out: list[Variant] = []
    for block_h in block_hs:
        # (max_splits, split_budget): per-sequence caps (budget 0), then the batch budgets
        tiles = spec.heads // block_h
        budgets = sorted({batch_split_budget(w, sm_count, tiles) for w in lists["batch_waves"]})
        rules_of = [(m, 0) for m in _tsk_serving_split_counts(
            spec, block_h, lists["split_waves"] if not budgets or "split_waves" in space else [],
            lists["max_splits"], lists["max_splits_cap"], sm_count)]
        # a budget that allows one split per sequence is max_splits 1's (no scratch, no stage 2)
        capped = [(min(b, lists["max_splits_cap"]), b) for b in budgets]
        rules_of += [(m, b) for m, b in capped if m > 1]
        for q, block_n, warps, stages, dot, (max_splits, budget) in itertools.product(
                lists["q"], lists["block_n"], lists["num_warps"], lists["num_stages"],
                lists["dot_dtype"], rules_of):
            rules = [max(lists["tokens_per_split"])] if max_splits == 1 else lists["tokens_per_split"]
            for tokens_per_split in rules:
                variant = Variant.make(
                    NAME, kv=spec.kv_format, q=q, block_n=block_n, block_h=block_h,
                    max_splits=max_splits, tokens_per_split=tokens_per_split, num_warps=warps,
                    num_stages=stages, dot_dtype=dot, **({"split_budget": budget} if budget else {}))
                validate(variant)  # a bad block_n or num_warps fails here, naming it
                out.append(variant)
    return list(dict.fromkeys(out))


def build_serving(variant: Variant, spec: CallSpec, device):
    """The serving call's runner for calls of `spec` (docs/runtime.md's contract): an
    OwnServingRunner (kernels/serving_runner.py) over flash_decode_serving, returning out,
    or (out, lse) with spec.return_lse. The softmax scale is spec.sm_scale (a runtime
    argument of the kernels)."""
    validate(variant)
    check_serving_build(NAME, variant, spec, CAPABILITIES, _tsk_is_serving(variant), _tsk_MMA_ROWS)
    p = variant.p
    device = torch.device(device)
    q_mode = p["q"]
    q_fp8_dtype = fp8_dtype_for(device) if q_mode != "bf16" else torch.float8_e4m3fn
    q_scale = None
    if q_mode == "fp8_static":
        q_scale = float(p["q_amax"]) / torch.finfo(q_fp8_dtype).max
    launch = dict(
        serving_launch_args(variant, spec), dot_dtype=p["dot_dtype"], q_mode=q_mode, q_scale=q_scale,
        q_fp8_dtype=q_fp8_dtype, hip_options={k: p[k] for k in _tsk_HIP_KEYS if k in p},
        split_budget=p.get("split_budget", 0),
    )
    return OwnServingRunner(NAME, spec, device, flash_decode_serving, FlashDecodeServingWorkspace,
                            p["max_splits"], launch, LaunchReplay.build,
                            workspace_args=serving_workspace_args(variant, device_sm_count(device)))


def serving_workspace_args(variant: Variant, sm_count: int) -> dict | None:
    """How a serving variant's runner sizes its workspace on a GPU of `sm_count` SMs
    (FlashDecodeServingWorkspace.allocate's keywords): with a batch budget, for what that
    budget launches (the SMs as the launch takes them); None without one (max_splits per
    sequence)."""
    budget = variant.get("split_budget", 0)
    return dict(split_budget=budget, block_h=variant.p["block_h"], sm_count=sm_count) if budget > 0 else None



def compile_shape(variant: Variant, shape: Shape, sm_count: int | None) -> Shape:
    """The stand-in that compiles the kernels `shape` uses: none of its launch arguments
    specializes on the shape (batch is do_not_specialize, kv_len is read on the device,
    every split count runs at any length), so one token of one sequence does."""
    return Shape(1, 1)


# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = (*_tsk_SPACE_KEYS, "hip")
