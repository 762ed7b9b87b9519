"""The own kernel families' serving runner: what build_serving of the triton,
triton_fused and gluon_fused backends returns, and the checks their serving launchers share.

- `check_serving_build`: the checks both own build_serving functions start with;
- `serving_launch_args`: the launch arguments both families take from a variant and a spec;
- `OwnServingRunner` (and its `step`, `OwnServingStep`): owns out, the family's workspace
  and the LSE buffer, launches through the family's launcher, records a step's launches at
  its first layer and replays them for the others (kernels/launch.py);
- `SharedScratch`: one buffer for the partials (or the outputs) of several runners of which
  one runs at a time (a DecodePlan's), where each would hold its own;
- `check_serving_launch`, `serving_workspace`: the shape, dtype and scratch checks
  flash_decode_serving and fused_decode_serving make before a launch; `check_serving_q`
  and `check_serving_result`, the parts the Gluon serving launcher shares with them.

Exportable module: torch is imported inside the functions that use it, Triton not at all;
the facts come from core.py.
"""

from __future__ import annotations

import dataclasses
import math

from mla_tune.core import (
    QK_DIM,
    V_DIM,
    CallSpec,
    Capabilities,
    Variant,
    check_serving_layout,
    check_serving_spec,
    tensor_sig_and_ptr,
)


def check_serving_build(name: str, variant: Variant, spec: CallSpec, capabilities: Capabilities,
                        serving: bool, min_rows: int, what: str = "MMA rows") -> int:
    """The checks every own build_serving starts with, after validate(variant): a serving
    (not leaderboard) variant, a spec the backend's record serves, the variant's KV format
    equal to the spec's, and a head tile (block_h) that divides the heads and with
    next_pow2(max_q_len) new tokens fills `min_rows` of the MMA. Returns that pow2."""
    if not serving:
        raise ValueError(f"{name}: {variant} is a leaderboard variant (num_splits); the serving "
                         "call takes max_splits and tokens_per_split (default_serving_variant makes one)")
    check_serving_spec(name, spec, capabilities, variant)
    rows = 1 << (max(spec.max_q_len, 1) - 1).bit_length()
    block_h = variant.get("block_h")
    if spec.heads % block_h or block_h * rows < min_rows:
        raise ValueError(f"{name}: block_h={block_h} must divide {spec.heads} heads and give "
                         f"block_h x {rows} (next_pow2(max_q_len)) >= {min_rows} {what}; use "
                         f"block_h={max(1, min_rows // rows)}")
    return rows


def serving_launch_args(variant: Variant, spec: CallSpec) -> dict:
    """The keyword arguments both own serving launchers take from a serving variant and the
    spec: max_q_len, the split rule (max_splits, tokens_per_split), the tiles (block_n,
    block_h), num_warps, num_stages and the softmax scale. A family adds its own."""
    p = variant.p
    return dict(
        max_q_len=spec.max_q_len, max_splits=p["max_splits"], tokens_per_split=p["tokens_per_split"],
        block_n=p["block_n"], block_h=p["block_h"], num_warps=p["num_warps"],
        num_stages=p["num_stages"], sm_scale=spec.sm_scale,
    )


class OwnServingRunner:
    """The runner of an own kernel family's serving call (build_serving's result).

    It owns `out` and the family's workspace (`workspace_type.allocate(capacity, heads,
    max_splits, device, max_q_len=spec.max_q_len, **workspace_args)`), and with spec.return_lse a (capacity,
    heads) float32 LSE buffer, allocated on the first call and again only when a call brings
    more new tokens than any before (at least doubling), never from the data; it reads no
    device tensor on the host, so a CUDA graph can hold it. `decode(q, qo_indptr, kv,
    kv_scale, out, *, layout, workspace, record, **launch)` is the family's launch function
    (with spec.return_lse also `lse=`). A call, `runner(q, qo_indptr, kv, kv_scale, *,
    layout...)`, checks and launches, and returns out[:total_q], or (out[:total_q],
    lse[:total_q]) with spec.return_lse. `runner.step(qo_indptr, *, layout...)` returns the
    step's per-layer call, which launches through Triton's JIT at its first layer
    (recording) and replays those launches directly for later layers. `replay_from(record,
    (q, kv, kv_scale))` (kernels/launch.LaunchReplay.build) turns the launches one call
    recorded into a replay, or None (then every layer takes `decode`). `share_scratch(scratch,
    capacity)`, before the first call, takes the workspace's partials from a SharedScratch,
    and `share_outputs(outputs, capacity)` out and the LSE buffer from another."""

    def __init__(self, name: str, spec: CallSpec, device, decode, workspace_type, max_splits: int,
                 launch: dict, replay_from=None, workspace_args: dict | None = None):
        import torch

        self.name, self.spec, self.device = name, spec, device
        self._decode, self._workspace_type, self._launch = decode, workspace_type, launch
        self._workspace_args = dict(workspace_args or {})
        self._max_splits, self.replay_from = max_splits, replay_from
        self._bf16 = torch.bfloat16
        self.capacity, self.out, self.workspace, self.lse = 0, None, None, None
        self._scratch = self._outputs = None
        # The last step's tensors and its (replay, out), for the next step with the same
        # ones (OwnServingStep reads and sets it).
        self.kept = None

    def __call__(self, q, qo_indptr, kv, kv_scale, *, kv_indptr=None, block_table=None,
                 seq_lens=None, q_lens_host=None, kv_lens_host=None, record: list | None = None):
        spec, total_q = self.spec, q.shape[0]
        # Shapes and dtypes only: the kernel would take a cache of the other format or
        # another head count as given and answer wrong.
        if q.dim() != 3 or q.shape[1] != spec.heads or (kv.dtype != self._bf16) != (spec.kv_format != "bf16"):
            raise ValueError(f"{self.name}: this runner serves {spec.heads} heads over {spec.kv_format} KV; "
                             f"got q {tuple(q.shape)} and kv {kv.dtype}")
        if total_q > self.capacity:
            import torch

            capacity = max(total_q, 2 * self.capacity)
            shapes = self._output_shapes(capacity)
            made = (self._outputs.views(shapes) if self._outputs is not None
                    else [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes])
            self.out, self.lse = made[0], (made[1] if spec.return_lse else None)
            self.workspace = (self._workspace(capacity, self.device) if self._scratch is None
                              else self._scratch.place(self._workspace(capacity, "meta")))
            self.capacity = capacity
            self.kept = None  # its launches wrote the old buffers
        out = self.out[:total_q]
        if spec.return_lse:
            lse = self.lse[:total_q]
            self._decode(q, qo_indptr, kv, kv_scale, out, kv_indptr=kv_indptr, block_table=block_table,
                         seq_lens=seq_lens, workspace=self.workspace, record=record, lse=lse, **self._launch)
            return out, lse
        self._decode(q, qo_indptr, kv, kv_scale, out, kv_indptr=kv_indptr, block_table=block_table,
                     seq_lens=seq_lens, workspace=self.workspace, record=record, **self._launch)
        return out

    def _workspace(self, capacity: int, device):
        return self._workspace_type.allocate(capacity, self.spec.heads, self._max_splits, device,
                                             max_q_len=self.spec.max_q_len, **self._workspace_args)

    def _output_shapes(self, capacity: int) -> list:
        """(shape, dtype) of out and, with spec.return_lse, the LSE buffer at `capacity`."""
        import torch

        shapes = [((capacity, self.spec.heads, V_DIM), torch.bfloat16)]
        if self.spec.return_lse:
            shapes.append(((capacity, self.spec.heads), torch.float32))
        return shapes

    def share_outputs(self, outputs: SharedScratch, capacity: int) -> None:
        """Take out (and the LSE buffer) from `outputs` for calls of up to `capacity` new
        tokens (their bytes reserved now; a larger call's are the runner's own), as
        share_scratch does the partials: a call's out is read before the plan's next call
        (stream order), whichever runner that call runs. Before the first call."""
        if self.capacity:
            raise ValueError(f"{self.name}: share_outputs goes before the runner's first call")
        outputs.reserve(SharedScratch.views_bytes(self._output_shapes(capacity)))
        self._outputs = outputs

    def scratch_bytes(self, capacity: int) -> int:
        """The bytes its workspace's shared fields (the split partials) take at `capacity` new
        tokens: what it holds alone, and what it reserves in a SharedScratch."""
        return SharedScratch.shared_bytes(self._workspace(capacity, "meta"))

    def share_scratch(self, scratch: SharedScratch, capacity: int) -> None:
        """Take the workspace's shared fields from `scratch` for calls of up to `capacity`
        new tokens (their bytes reserved now; a larger call's workspace is the runner's own).
        Before the first call: a workspace already allocated would stay where it is."""
        if self.capacity:
            raise ValueError(f"{self.name}: share_scratch goes before the runner's first call")
        scratch.reserve(self.scratch_bytes(capacity))
        self._scratch = scratch

    def step(self, qo_indptr, *, kv_indptr=None, block_table=None, seq_lens=None, q_lens_host=None,
             kv_lens_host=None) -> OwnServingStep:
        """The per-layer call of one step: `layer(q, kv, kv_scale) -> out`. Enqueues nothing
        (the split counts are computed by the kernels); the layout is checked at the first
        layer's launch, with everything else."""
        return OwnServingStep(self, qo_indptr, dict(kv_indptr=kv_indptr, block_table=block_table,
                                                     seq_lens=seq_lens))


class SharedScratch:
    """One buffer for the partials (or the outputs) of several runners of which one runs at
    a time, in stream order (a DecodePlan's: one variant a step): where each runner would
    hold its own, they hold views of this, so a plan's scratch is its largest runner's, not
    their sum.

    A workspace type names in `SHARED` the fields that every call writes before it reads
    them (the split partials); those alone are shared. Each runner reserves first
    (`reserve`: the shared_bytes of its workspace allocated on the meta device); the first `place`
    allocates the buffer at the largest reservation, and it never moves, so recorded
    launches and captured CUDA graphs keep valid addresses. `place` turns a meta workspace
    into a real one: its SHARED fields views of the buffer (their own tensors where they
    exceed it), its other tensors its own, zeroed. `views` does the same for plain (shape,
    dtype) tensors (a runner's out and LSE buffers, `OwnServingRunner.share_outputs`)."""

    ALIGN = 256  # bytes: each view starts aligned for any load the kernels make

    def __init__(self, device):
        self.device, self.nbytes, self.buffer = device, 0, None

    @classmethod
    def shared_bytes(cls, workspace) -> int:
        """The bytes `workspace`'s SHARED fields take in the buffer, each aligned."""
        return sum(cls._span(getattr(workspace, name).nbytes) for name in type(workspace).SHARED)

    @classmethod
    def _span(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def reserve(self, need: int) -> None:
        """Make room for `need` bytes (a workspace's shared_bytes)."""
        if self.buffer is not None and need > self.nbytes:
            raise ValueError(f"SharedScratch: a reservation of {need} bytes after the buffer was allocated "
                             f"at {self.nbytes}; reserve every runner's before the first call")
        self.nbytes = max(self.nbytes, need)

    def place(self, workspace):
        """`workspace` (allocated on the meta device) on the buffer's device, its SHARED
        fields in the buffer where they fit."""
        import torch

        shared = type(workspace).SHARED
        metas = [getattr(workspace, name) for name in shared]
        for name, real in zip(shared, self.views([(m.shape, m.dtype) for m in metas]), strict=True):
            setattr(workspace, name, real)
        for field in dataclasses.fields(workspace):
            meta = getattr(workspace, field.name)
            if field.name not in shared and isinstance(meta, torch.Tensor):
                setattr(workspace, field.name, torch.zeros(meta.shape, dtype=meta.dtype, device=self.device))
        return workspace

    @classmethod
    def views_bytes(cls, shapes) -> int:
        """The bytes tensors of these (shape, dtype) take in the buffer, each aligned."""
        return sum(cls._span(math.prod(shape) * dtype.itemsize) for shape, dtype in shapes)

    def views(self, shapes) -> list:
        """Tensors of these (shape, dtype), uninitialized: views of the buffer one after the
        other where they fit in it (allocated at the largest reservation the first time),
        else each its own."""
        import torch

        if self.buffer is None:
            self.buffer = torch.empty((self.nbytes,), dtype=torch.uint8, device=self.device)
        if self.views_bytes(shapes) > self.nbytes:
            return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes]
        out, offset = [], 0
        for shape, dtype in shapes:
            nbytes = math.prod(shape) * dtype.itemsize
            out.append(self.buffer[offset:offset + nbytes].view(dtype).view(shape))
            offset += self._span(nbytes)
        return out


class OwnServingStep:
    """`OwnServingRunner.step(...)`'s result. The first layer call launches through the
    runner (every check, Triton's JIT) and records; a later call whose q, kv and kv_scale
    look as the recorded ones did (dtype, shape, strides, 16-byte alignment, device: what
    the compile and the recorded arguments depend on) replays the launches directly, and
    any other call takes the runner again and records anew. The recording is kept on the
    runner for the next step made of the same tensor objects with the same shapes (an
    engine's static buffers), so such steps replay from their first layer."""

    __slots__ = ("runner", "qo_indptr", "layout", "tensors", "_sigs", "fast")

    def __init__(self, runner: OwnServingRunner, qo_indptr, layout: dict):
        self.runner, self.qo_indptr, self.layout = runner, qo_indptr, layout
        self.tensors = (qo_indptr, layout["kv_indptr"], layout["block_table"], layout["seq_lens"])
        self._sigs = None
        kept = runner.kept
        self.fast = None
        # The replay holds these tensors' addresses: the same objects (checked first: a step
        # of new tensor objects reads no signature here), shapes and addresses.
        if kept is not None and all(a is b for a, b in zip(kept[0][0], self.tensors, strict=True)) \
                and kept[0][1] == self.key[1]:
            self.fast = kept[1]

    @property
    def key(self) -> tuple:
        """(the step's tensors, their signatures and addresses), read once."""
        if self._sigs is None:
            self._sigs = tuple(None if t is None else tensor_sig_and_ptr(t) for t in self.tensors)
        return self.tensors, self._sigs

    def __call__(self, q, kv, kv_scale=None):
        fast = self.fast
        if fast is not None and fast[0].try_launch((q, kv, kv_scale)):
            return fast[1]
        return self._record(q, kv, kv_scale)

    def _record(self, q, kv, kv_scale):
        runner = self.runner
        record = [] if runner.replay_from is not None else None
        out = runner(q, self.qo_indptr, kv, kv_scale, **self.layout, record=record)
        replay = runner.replay_from(record, (q, kv, kv_scale)) if record else None
        self.fast = None if replay is None else (replay, out)
        runner.kept = None if replay is None else (self.key, self.fast)
        return out


def check_serving_launch(q, qo_indptr, kv, kv_scale, out, *, kv_indptr, block_table, seq_lens,
                         max_q_len: int, q_len_limit: int, block_h: int, max_splits: int,
                         tokens_per_split: int, block_n: int, lse=None) -> int:
    """The checks both own serving launchers (the split-K and the fused kernel families)
    make before a launch: the layout (check_serving_layout), q, the new tokens, max_q_len up
    to `q_len_limit`, the head tile, the KV format and its scale, out, the split and tile
    sizes, and lse when given. Shapes and dtypes only; returns the page size (0 for
    contiguous KV)."""
    import torch

    page_size = check_serving_layout(qo_indptr, kv, kv_indptr, block_table, seq_lens)
    total_q, heads = check_serving_q(q, qo_indptr, max_q_len, q_len_limit)
    q_len_max = 1 << (max_q_len - 1).bit_length()  # rows of the MMA come in powers of two
    if block_h < 1 or block_h & (block_h - 1) or heads % block_h or block_h * q_len_max < 16:
        raise ValueError(
            f"block_h must be a power of two dividing heads ({heads}) with block_h * "
            f"next_pow2(max_q_len) >= 16; got block_h {block_h}, max_q_len {max_q_len}"
        )
    if kv.dtype != torch.bfloat16 and (kv.element_size() != 1 or kv_scale is None):
        raise ValueError(f"kv must be bf16, or fp8 with a (1,) fp32 kv_scale; got {kv.dtype}, scale {kv_scale}")
    if kv.dtype == torch.uint8:  # the kernels would read the bytes as integers
        raise ValueError("kv is uint8: view a cache of fp8 bytes as fp8 first (kv.view(torch.float8_e4m3fn)), "
                         "or declare it with CallSpec(..., cache_dtype='uint8') and call through DecodePlan / Decoder")
    if max_splits < 1 or tokens_per_split < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(
            f"need max_splits >= 1, tokens_per_split >= 1 and block_n a power of two >= 16; "
            f"got {max_splits}, {tokens_per_split}, {block_n}"
        )
    check_serving_result(out, lse, total_q, heads)
    return page_size


def check_serving_q(q, qo_indptr, max_q_len: int, q_len_limit: int) -> tuple[int, int]:
    """q contiguous bf16 (total_q, heads, 576), at least one new token a sequence, and
    1 <= max_q_len <= q_len_limit; returns (total_q, heads)."""
    import torch

    batch = qo_indptr.shape[0] - 1
    total_q, heads = q.shape[0], q.shape[1]
    if q.dim() != 3 or q.shape[2] != QK_DIM or q.dtype != torch.bfloat16 or not q.is_contiguous():
        raise ValueError(f"q must be contiguous bf16 (total_q, heads, {QK_DIM}), got {q.dtype} {tuple(q.shape)}")
    if batch > total_q:
        raise ValueError(f"{batch} sequences but {total_q} new tokens in q: each sequence brings at least one")
    if not 1 <= max_q_len <= q_len_limit:
        raise ValueError(f"max_q_len must be 1 to {q_len_limit}, got {max_q_len}")
    return total_q, heads


def check_serving_result(out, lse, total_q: int, heads: int) -> None:
    """out contiguous bf16 (total_q, heads, 512), and lse None or contiguous float32
    (total_q, heads)."""
    import torch

    if tuple(out.shape) != (total_q, heads, V_DIM) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 ({total_q}, {heads}, {V_DIM}) tensor, got {tuple(out.shape)}")
    if lse is not None and (tuple(lse.shape) != (total_q, heads) or lse.dtype != torch.float32
                            or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous float32 ({total_q}, {heads}) tensor, got "
                         f"{lse.dtype} {tuple(lse.shape)}")


def serving_workspace(workspace, workspace_type, total_q: int, heads: int, max_splits: int, device,
                      max_q_len: int = 1):
    """`workspace` when it fits the call (a new one of `workspace_type` when None), else a
    ValueError saying how to allocate one: the own serving launchers' scratch rule."""
    if workspace is None:
        return workspace_type.allocate(total_q, heads, max_splits, device, max_q_len=max_q_len)
    if not workspace.fits(total_q, heads, max_splits, max_q_len):
        raise ValueError(
            f"workspace is for {workspace.max_total_q} new tokens x {workspace.heads} heads x "
            f"{workspace.max_splits} splits, not {total_q} x {heads} x {max_splits} at max_q_len "
            f"{max_q_len}; allocate one with {workspace_type.__name__}.allocate(..., "
            f"max_q_len={max_q_len})"
        )
    return workspace
