"""FlashInfer's MLA decode (`BatchMLAPagedAttentionWrapper`, NVIDIA) as sweep candidates.

Written against flashinfer-python 0.6.18.post1 (flashinfer/mla/_core.py). The contiguous
cache (total_kv, 1, 576) is read as 1-token pages with no copy: `ckv = kv[..., :512]` and
`kpe = kv[..., 512:]` are strided views, which the kernels accept since they read
stride(0) and stride(1) of each cache and of q_nope / q_pe (csrc/batch_mla_*run.cu).

`plan()` copies the index arrays to the host (a sync) and JIT-compiles the kernel, so it runs
once in `build`; the runner calls only `run()`, into an output buffer it owns.

fp8 KV: FlashInfer takes its per-tensor KV scales as Python floats, and reading the
leaderboard's device-side scale on every call would sync. So the runner plans with scales
of 1.0 and folds the KV scale in on the device instead: q is multiplied by it (scores are
q . (s k)) and so is the output (values are s v); two tiny elementwise kernels, no sync.
FlashInfer's fp8-KV path needs bf16 q (no fp8 q x fp8 KV kernel) and an SM90 GPU.

Serving call (`build_serving`), as read in flashinfer-python 0.6.18.post1's wheel
(flashinfer/mla/_core.py; data/include/flashinfer/attention/{scheduler.cuh,mla_hopper.cuh}):
- plan() reads qo_indptr, kv_indptr and kv_len_arr on the host (`.to("cpu")`, then the
  MLAPlan work lists), so the runner plans from the caller's q_lens_host / kv_lens_host
  (CAPABILITIES.host_lengths) and refuses a call without them; it replans only when they
  (or the KV index array it planned with) change. plan() keeps `kv_indices` by reference
  and reads, per request, only its start kv_indptr[b] and kv_len[b] (tokens), so:
  contiguous KV is 1-token pages with kv_indices = arange(rows of the cache) and kv_indptr
  = the running sum of kv_lens_host (the call's kv_indptr must be that: starting at 0,
  sequences back to back); paged KV passes the block table itself (row-major) as
  kv_indices with kv_indptr[b] = b * width, so nothing is gathered per call. The q rows
  likewise follow the running sum of q_lens_host. Any page size, head count and q_len per
  sequence (rows are q_len x heads packed per request);
- `causal` masks kv_idx + q_len > kv_len + i (logits_mask_ in mla_hopper.cuh, mla.cuh):
  new token i sees the first seq_len - (q_len - 1 - i) tokens, our reference's alignment;
- run() writes into `out=` and reads the plan from the workspace, so a CUDA graph can hold
  it when the plan runs outside the graph before each replay (`runner.plan(...)`, same
  arguments as the call) and keeps the grid of the captured plan: MLAPlan picks 2-CTA
  clusters when the mean of q_len x heads over the batch exceeds 64, and the runner refuses
  a replan that changes the grid in a graph spec;
- fp8 KV (fa2/fa3, SM90 only, bf16 q): the KV scale folded into q and out on the device.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from mla_tune.backends.params import PARAM_RULES, check_variant_rules
from mla_tune.core import (
    CORE_HEADS,
    CORE_PAGE_SIZES,
    KV_LORA_RANK,
    NUM_HEADS,
    QK_DIM,
    QK_ROPE_DIM,
    SM_SCALE,
    V_DIM,
    CallSpec,
    Capabilities,
    Shape,
    Variant,
    check_serving_layout,
    check_serving_spec,
    tensor_sig,
    vendor_is_cpu_fake,
)

NAME = "flashinfer"

CAPABILITIES = Capabilities(
    kv_formats=("bf16", "fp8"),
    serving=True,
    contiguous=True,  # read as 1-token pages
    page_sizes=CORE_PAGE_SIZES,  # any page size (a fastdiv in the kernel)
    heads=CORE_HEADS,
    max_q_len=4,  # the range tested here; the kernel packs any q_len x heads
    mixed_q_len=True,
    graph_safe=True,  # its run; its plan() reads the lengths on the host, outside the graph
    host_lengths=True,
    lse=True,  # run(return_lse=True, return_lse_base_on_e=True): natural log, (total_q, heads)
    # fa3 and the fp8-KV path are SM90-only (plan() refuses fp8 KV elsewhere); fa2 bf16 would
    # run on other NVIDIA GPUs, untested here, so only SM90 is declared
    platforms=(("cuda", "sm_90"),),
    vendor="flashinfer-python",
    precompile=True,
)

_FI_BACKENDS = ("fa3", "fa2")
# flashinfer's recommended float workspace for split-k partial results
_FI_WORKSPACE_BYTES = 128 << 20


def unavailable_reason() -> str | None:
    try:
        import flashinfer
        import flashinfer.mla  # noqa: F401
    except (ImportError, RuntimeError, OSError) as exc:
        return f"FlashInfer cannot be imported ({type(exc).__name__}: {exc}); install flashinfer-python (mla-tune[nvidia])."
    if vendor_is_cpu_fake(flashinfer):
        return None
    if torch.version.hip or not torch.cuda.is_available():
        return "FlashInfer needs an NVIDIA GPU, and this process sees none."
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    """{backend: [fa3, fa2], kv: [bf16, fp8]} from the `flashinfer:` config section.

    The variant names FlashInfer's backend `kernel` (Variant.make's first argument is
    already called `backend`). fa3 and the fp8-KV path exist for SM90 only; q is always
    bf16 (q_nope/q_pe views).
    """
    if platform.is_hip or not platform.has_gpu:
        return []
    backends = space.get("backend", list(_FI_BACKENDS))
    kvs = space.get("kv", ["bf16", "fp8"])
    for key, values, known in (("backend", backends, _FI_BACKENDS), ("kv", kvs, ("bf16", "fp8"))):
        if not isinstance(values, list) or any(v not in known for v in values):
            raise ValueError(f"flashinfer search space: {key} must be a list of {', '.join(known)}, got {values!r}")
    sm90 = platform.arch == "sm_90"
    out = []
    for backend in backends:
        for kv in kvs:
            if (backend == "fa3" or kv == "fp8") and not sm90:
                continue
            out.append(Variant.make(NAME, kernel=backend, kv=kv, q="bf16"))
    return out


def validate(variant: Variant) -> None:
    """kernel (FlashInfer's backend) fa3 or fa2; FlashInfer MLA reads bf16 q with bf16 or
    fp8 KV. Which GPU runs fa3 and fp8 KV is candidates()' business."""
    check_variant_rules(variant, PARAM_RULES[NAME])  # backends/params.py


def build(variant: Variant, shape: Shape, device, *, sm_scale: float = SM_SCALE):
    """A runner(q, kv_data, qo_indptr, kv_indptr) -> out at softmax scale `sm_scale`
    (FlashInfer's plan(sm_scale=...))."""
    validate(variant)
    backend, kv_format = variant.get("kernel"), variant.get("kv")
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    device = torch.device(device)
    batch, total_kv = shape.batch, shape.total_kv
    kv_dtype = torch.bfloat16 if kv_format == "bf16" else torch.float8_e4m3fn

    def i32(values):
        return values.to(device=device, dtype=torch.int32)

    workspace = torch.empty(_FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=backend)
    wrapper.plan(
        qo_indptr=i32(torch.arange(batch + 1)),
        kv_indptr=i32(torch.arange(batch + 1) * shape.kv_len),  # in pages = tokens
        kv_indices=i32(torch.arange(total_kv)),
        kv_len_arr=i32(torch.full((batch,), shape.kv_len)),
        num_heads=NUM_HEADS, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=QK_ROPE_DIM,
        page_size=1, causal=False, sm_scale=float(sm_scale),
        q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
    )
    out = torch.empty((batch, NUM_HEADS, V_DIM), dtype=torch.bfloat16, device=device)
    fp8 = kv_format == "fp8"
    q_scaled = torch.empty((batch, NUM_HEADS, QK_DIM), dtype=torch.bfloat16, device=device) if fp8 else None
    scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if fp8 else {}

    def run_flashinfer_mla(q, kv_data, qo_indptr, kv_indptr):
        kv, kv_scale = (kv_data["fp8"] if fp8 else (kv_data["bf16"], None))
        if q.shape[0] != batch or kv.shape[0] != total_kv:
            raise ValueError(
                f"this FlashInfer runner was planned for {shape} (batch {batch}, {total_kv} KV "
                f"tokens); got batch {q.shape[0]} with {kv.shape[0]} tokens: build one for that shape"
            )
        if fp8:
            q = torch.mul(q, kv_scale, out=q_scaled)  # fold the KV scale into the scores
        wrapper.run(
            q[:, :, :KV_LORA_RANK], q[:, :, KV_LORA_RANK:],
            kv[:, :, :KV_LORA_RANK], kv[:, :, KV_LORA_RANK:],
            out=out, **scales,
        )
        if fp8:
            out.mul_(kv_scale)  # ... and into the values
        return out

    return run_flashinfer_mla




def compile_shape(variant: Variant, shape: Shape, sm_count: int | None) -> Shape:
    """One small shape for all: the module FlashInfer builds is named by its kernel backend,
    dtypes and head dims (flashinfer/jit/attention), never by batch or length, and the
    runner launches no Triton kernel."""
    return Shape(1, 64)

# The keys of its search-space section in a config (config.py refuses any other).
SPACE_KEYS = ("backend", "kv")


# ------------------------------------------------------------------------ serving call
def default_serving_variant(spec: CallSpec, platform) -> Variant:
    """fa3 on SM90 (its Hopper kernels), else fa2; bf16 q (FlashInfer reads no fp8 q)."""
    _fi_serving_check(spec)
    return Variant.make(NAME, kernel="fa3" if platform.arch == "sm_90" else "fa2", kv=spec.kv_format, q="bf16")


def _fi_serving_check(spec: CallSpec, variant: Variant | None = None) -> None:
    check_serving_spec(NAME, spec, CAPABILITIES, variant)


def _fi_running_sum(lengths) -> list[int]:
    """0 and the running sums of `lengths` (ints)."""
    return [0, *accumulate(lengths)]


# Most arrays a runner keeps of the form 0, step, ..., n x step (its plans' indptrs)
_FI_STRIDED_KEPT = 1024


def _fi_plan_grid(wrapper) -> tuple[int, ...]:
    """The launch grid of the wrapper's last plan: MLAPlanInfo's first two entries (a tvm-ffi
    Array in 0.6.18.post1, indexable by int), or () where it cannot be read."""
    info = getattr(wrapper, "_plan_info", None)
    try:
        return (int(info[0]), int(info[1]))
    except (TypeError, IndexError, ValueError):
        return ()


def build_serving(variant: Variant, spec: CallSpec, device):
    """A runner(q, qo_indptr, kv, kv_scale, *, kv_indptr | block_table + seq_lens,
    q_lens_host, kv_lens_host) -> out[:total_q] for calls of `spec`. It plans on the host
    from q_lens_host / kv_lens_host (lists of ints, refused when missing), again only when
    they or the KV index array change; run() writes into a buffer the runner owns (grown,
    at least doubling, when a call brings more new tokens than any before).
    `runner.plan(...)` (the call's arguments) plans without running: before replaying a CUDA
    graph that holds the call, with the new lengths. The softmax scale is spec.sm_scale (the
    plan's); with spec.return_lse a call returns (out, lse): FlashInfer's LSE asked in
    natural log (return_lse_base_on_e; its default is base 2), (total_q, heads) float32, a
    buffer the runner owns beside out."""
    validate(variant)
    _fi_serving_check(spec, variant)
    from flashinfer.mla import BatchMLAPagedAttentionWrapper


    device = torch.device(device)
    heads, fp8 = spec.heads, spec.kv_format == "fp8"
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    workspace = torch.empty(_FI_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=variant.get("kernel"))
    scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if fp8 else {}
    state = {"key": None, "grid": None, "capacity": 0, "out": None, "q_scaled": None, "arange": None,
             "plans": 0, "lse": None}
    with_lse = spec.return_lse
    strided: dict[tuple[int, int], torch.Tensor] = {}

    def strided_indptr(step: int, n: int) -> torch.Tensor:
        """0, step, ..., n x step as an int32 host tensor, made once per (step, n) and never
        written after (the wrapper may keep it): a uniform q_len's qo_indptr, a block table's
        row starts."""
        t = strided.get((step, n))
        if t is None:
            t = torch.arange(0, (n + 1) * step, step, dtype=torch.int32) if step else torch.zeros(n + 1,
                                                                                                 dtype=torch.int32)
            if len(strided) < _FI_STRIDED_KEPT:
                strided[(step, n)] = t
        return t

    def plan(q, qo_indptr, kv, kv_scale, *, kv_indptr=None, block_table=None, seq_lens=None,
             q_lens_host=None, kv_lens_host=None):
        """Check the call (shapes, dtypes, host lengths) and plan it unless the last plan
        was for the same lengths and KV index array."""
        page_size = check_serving_layout(qo_indptr, kv, kv_indptr, block_table, seq_lens)
        total_q = q.shape[0]
        if q.dim() != 3 or q.shape[1] != heads or q.shape[2] != QK_DIM or q.dtype != torch.bfloat16:
            raise ValueError(f"flashinfer: this runner serves bf16 q of {heads} heads, (total_q, {heads}, "
                             f"{QK_DIM}); got {q.dtype} {tuple(q.shape)}")
        if kv.dtype != kv_dtype:
            raise ValueError(f"flashinfer: this runner reads {spec.kv_format} KV ({kv_dtype}), got {kv.dtype}")
        if page_size != spec.page_size:
            raise ValueError(f"flashinfer: this runner was built for {spec.layout} KV, got "
                             f"{'contiguous KV' if page_size == 0 else f'pages of {page_size}'}")
        plan_lengths(qo_indptr, page_size, block_table, q_lens_host, kv_lens_host, total_q, kv.shape[0])

    def plan_lengths(qo_indptr, page_size, block_table, q_lens_host, kv_lens_host, total_q=None,
                     kv_rows=None):
        """The host part of plan(): the lengths' checks and wrapper.plan, unless the last plan
        was for the same lengths and KV index array. Needs no q or kv for paged KV (a
        step plans here, before its layers: outside the CUDA graph that holds them)."""
        batch = qo_indptr.shape[0] - 1
        if q_lens_host is None or kv_lens_host is None:
            raise ValueError("flashinfer plans on the host: pass q_lens_host and kv_lens_host (each "
                             "sequence's new tokens and cached tokens, Python lists of ints)")
        q_lens, kv_lens = tuple(map(int, q_lens_host)), tuple(map(int, kv_lens_host))
        # q may hold more rows than this step's new tokens (a CUDA graph's padding)
        if len(q_lens) != batch or len(kv_lens) != batch or sum(q_lens) > (total_q or sum(q_lens)):
            raise ValueError(f"flashinfer: q_lens_host and kv_lens_host need one entry per sequence ({batch}) "
                             f"and q_lens_host may sum to at most the rows of q ({total_q}); got "
                             f"{len(q_lens)} q_lens summing to {sum(q_lens)} and {len(kv_lens)} kv_lens")
        if min(q_lens) < 1 or max(q_lens) > spec.max_q_len or (not spec.mixed_q_len and len(set(q_lens)) > 1):
            raise ValueError(f"flashinfer: this runner serves q_len 1..{spec.max_q_len}"
                             f"{'' if spec.mixed_q_len else ', the same for every sequence'}; got {list(q_lens)}")
        if page_size == 0:
            if state["arange"] is None or state["arange"].shape[0] < kv_rows:
                state["arange"] = torch.arange(kv_rows, dtype=torch.int32, device=device)
            kv_indices = state["arange"]
            kv_starts = _fi_running_sum(kv_lens)  # 1-token pages: tokens back to back
            if kv_starts[-1] > kv_rows:
                raise ValueError(f"flashinfer: kv_lens_host sum to {kv_starts[-1]} tokens but the cache "
                                 f"holds {kv_rows}")
        else:
            if not block_table.is_contiguous():
                raise ValueError("flashinfer reads the block table as its page index array: pass a "
                                 "contiguous block_table")
            width = block_table.shape[1]
            if max(kv_lens) > width * page_size:  # more pages than the table's columns
                raise ValueError(f"flashinfer: a kv_len of {max(kv_lens)} needs more pages than the block "
                                 f"table's {width} columns")
            kv_indices = block_table.view(-1)
            kv_starts = None  # row b of the table: b x width
        key = (q_lens, kv_lens, kv_indices.data_ptr(), tuple(kv_indices.shape))
        if key == state["key"]:
            return
        uniform = q_lens.count(q_lens[0]) == batch
        wrapper.plan(
            qo_indptr=(strided_indptr(q_lens[0], batch) if uniform
                       else torch.tensor(_fi_running_sum(q_lens), dtype=torch.int32)),
            kv_indptr=(strided_indptr(width, batch) if kv_starts is None
                       else torch.tensor(kv_starts, dtype=torch.int32)),
            kv_indices=kv_indices,
            kv_len_arr=torch.tensor(kv_lens, dtype=torch.int32),
            num_heads=heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=QK_ROPE_DIM,
            page_size=max(page_size, 1), causal=spec.max_q_len > 1, sm_scale=float(spec.sm_scale),
            q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
        )
        state["key"] = key
        state["plans"] += 1  # a step that planned before runs on a plan no longer there
        # MLAPlanInfo's first two entries are the launch grid (cluster size, clusters): a
        # graph captured with one grid replays it, so a graph runner's replan must keep it
        # (read only there: indexing the plan info took 19-22 us of a step on an H100's host,
        # docs/perf.md 3.2)
        if spec.graph:
            grid = _fi_plan_grid(wrapper)
            if state["grid"] is not None and grid != state["grid"]:
                state["key"] = None
                raise ValueError(f"flashinfer: this plan's launch grid {grid} differs from the first one "
                                 f"{state['grid']} (2-CTA clusters when the mean q_len x heads exceeds 64), "
                                 "so a captured graph cannot replay it; capture one graph per grid")
            state["grid"] = state["grid"] or grid

    def buffers(total_q: int):
        """out, fp8's scaled q and the LSE (or None) for total_q new tokens: views of buffers
        grown, at least doubling, when a call brings more new tokens than any before."""
        if total_q > state["capacity"]:
            capacity = max(total_q, 2 * state["capacity"])
            state["out"] = torch.empty((capacity, heads, V_DIM), dtype=torch.bfloat16, device=device)
            if fp8:
                state["q_scaled"] = torch.empty((capacity, heads, QK_DIM), dtype=torch.bfloat16, device=device)
            if with_lse:
                state["lse"] = torch.empty((capacity, heads), dtype=torch.float32, device=device)
            state["capacity"] = capacity
        return (state["out"][:total_q], state["q_scaled"][:total_q] if fp8 else None,
                state["lse"][:total_q] if with_lse else None)

    def attend(q, kv, kv_scale, out, q_scaled, lse):
        """wrapper.run over the last plan, into out (and lse)."""
        if fp8:
            q = torch.mul(q, kv_scale, out=q_scaled)  # the KV scale in the scores
        q_nope, q_pe = q.split_with_sizes((KV_LORA_RANK, QK_ROPE_DIM), -1)
        ckv, kpe = kv.split_with_sizes((KV_LORA_RANK, QK_ROPE_DIM), -1)
        if with_lse:
            wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, return_lse=True,
                        return_lse_base_on_e=True, **scales)
        else:
            wrapper.run(q_nope, q_pe, ckv, kpe, out=out, **scales)
        if fp8:
            out.mul_(kv_scale)  # ... and in the values
        return (out, lse) if with_lse else out

    def run_flashinfer_serving(q, qo_indptr, kv, kv_scale, **layout):
        plan(q, qo_indptr, kv, kv_scale, **layout)
        return attend(q, kv, kv_scale, *buffers(q.shape[0]))

    def step(qo_indptr, **layout):
        block_table = layout.get("block_table")
        if (spec.page_size and isinstance(block_table, torch.Tensor) and block_table.dim() == 2
                and layout.get("q_lens_host") is not None and layout.get("kv_lens_host") is not None):
            # Paged KV: plan now, on the host, so that an engine calling update before each
            # replay of a graph of the layers has the step's plan in the workspace.
            plan_lengths(qo_indptr, spec.page_size, block_table, layout["q_lens_host"],
                         layout["kv_lens_host"])
        return _FiStep(plan, buffers, attend, state, qo_indptr, layout)

    run_flashinfer_serving.plan = plan
    run_flashinfer_serving.step = step
    return run_flashinfer_serving


class _FiStep:
    """The per-layer call of one FlashInfer step (build_serving's runner.step): the first
    layer is checked in full and plans when the lengths changed (on the host, from
    q_lens_host / kv_lens_host); later layers whose q, kv and kv_scale look as the first's
    did (core.tensor_sig: the plan's KV index array and buffers still fit), with no plan
    made since by another call of the runner, only run."""

    def __init__(self, plan, buffers, attend, state, qo_indptr, layout):
        self.plan, self.buffers, self.attend, self.state = plan, buffers, attend, state
        self.qo_indptr, self.layout = qo_indptr, layout
        self.sigs, self.bufs, self.plans = None, None, -1

    def __call__(self, q, kv, kv_scale=None):
        sigs = (tensor_sig(q), tensor_sig(kv), tensor_sig(kv_scale))
        if sigs != self.sigs or self.state["plans"] != self.plans:
            self.sigs = None
            self.plan(q, self.qo_indptr, kv, kv_scale, **self.layout)
            self.sigs, self.bufs, self.plans = sigs, self.buffers(q.shape[0]), self.state["plans"]
        return self.attend(q, kv, kv_scale, *self.bufs)
