"""A graph-safe serving call: planned once, updated once per step, run once per layer.

An engine's decode step calls attention once per layer (61 in DeepSeek-V3) with the same
lengths and block table, and replays a CUDA graph of the layers per batch size. So:

    plan = DecodePlan(CallSpec("fp8", page_size=64, heads=128, max_q_len=2, mixed_q_len=True,
                               graph=True, host_lengths=True), max_batch=256,
                      table="tables/H200.serving.yaml")
    # each step, on the host, before the layers (before replaying their graph):
    plan.update(qo_indptr, block_table=block_table, seq_lens=seq_lens,
                q_lens_host=q_lens, kv_lens_host=kv_lens)
    for layer in layers:  # eagerly, or captured once per batch bucket and replayed
        out = plan.run(q[layer], kv_cache[layer], kv_scale[layer])

- The plan builds and warms (compiles, allocates) every runner it may pick for batches up
  to `max_batch`, once: afterwards nothing allocates. The own runners' split partials are
  views of one buffer, `plan.scratch` (kernels/serving_runner.SharedScratch), sized for
  the largest of them at max_batch, and their outputs (and LSE buffers) views of another,
  `plan.outputs`: a step runs one variant, so they need not have their own. A plan's calls
  are therefore in stream order, as an engine's layers are, and a call's output is read
  before the plan's next call (an own runner's output is its reused buffer in any case).
- `update` picks the variant from the serving table (serving/table.py) without
  timing anything: in a graph (spec.graph) the graph pick of the batch's bucket, which
  does not depend on the lengths; eagerly the table's estimated fastest for the batch and
  the mean length (`mean_kv_len`, or the mean of `kv_lens_host`, which engines keep on the
  host; the schedule models replay their backends' schedules for `kv_lens_host`),
  else the graph pick. A table tuned on another GPU than this process's is used, with a
  warning at the plan (the leaderboard runtime refuses one). A family or cell the table
  lacks runs the preferred backend's default variant (serving/call.py), counted in
  `misses`; so does a pick whose backend
  cannot serve the spec here (warned once at the plan: the estimates' next runnable
  variant, else the cell's runner-up, else the default). `update` checks the call's
  layout arguments against the spec once per step (shapes and dtypes only).
- `update` also starts the picked runner's step (`runner.step(...)`, serving/call.py's
  `runner_step`), which does the step's shared work once, into buffers the runner keeps:
  FlashInfer plans on the host from the host lengths (paged KV; contiguous KV at the
  step's first run); FlashMLA computes its split schedule from seq_lens on the device and,
  for a graph plan (spec.graph), copies it into fixed buffers. So an engine may call
  `update` outside a graph that holds only the runs, before each replay (the protocol
  above, docs/serving.md), or capture
  `update` with the runs when no pick plans on the host (a FlashInfer pick must be
  updated outside the graph: a replay cannot run host code).
- `run` calls only the step's per-layer function, behind one check of the cache's dtype
  (a uint8 cache declared by spec.cache_dtype is viewed as fp8, an undeclared one
  refused; a float kv_scale becomes a kept (1,) tensor). With spec.return_lse it returns
  (out, lse). The own Triton runners launch the
  first layer of a step through Triton's JIT with every check and record it; later
  layers whose q, kv and kv_scale have the recorded dtype, shape, strides, 16-byte
  alignment and device replay the launches directly (kernels/launch.py), anything else
  takes the JIT path again. Split counts are the variant's rule, applied per sequence on
  the device. `run_checked` checks q, kv and kv_scale against the spec first.

Each own runner (and FlashInfer's) owns one output buffer, which every `run` through it
returns: consume or copy it before the next layer's run (as an engine's attention output
projection does). FlashMLA returns a tensor of its own per call.
"""

from __future__ import annotations

import bisect
import math
import warnings

import torch

from mla_tune.core import QK_DIM, CallSpec, Variant
from mla_tune.kernels.serving_runner import SharedScratch
from mla_tune.locate import table_path
from mla_tune.serving.call import Decoder, runner_step, spec_text, why_not
from mla_tune.serving.table import (
    ServingTable,
    batch_bucket,
    kv_bucket,
    kv_bucket_edges,
    load_serving_table,
)


def _no_step(*_args):
    raise ValueError("call update(...) with the step's lengths before run")


def _check_lengths(batch: int, mean_kv_len, kv_lens) -> None:
    """A step's host lengths, where given, hold one length per sequence, and its mean is
    finite: the lookup's estimates (and their C replays) take both as they are."""
    if kv_lens is not None and len(kv_lens) != batch:
        raise ValueError(f"kv_lens_host holds {len(kv_lens)} lengths for a step of {batch} sequences; "
                         "pass one length per sequence, or None where the lengths are not on the host")
    if mean_kv_len is not None and not math.isfinite(mean_kv_len):
        raise ValueError(f"mean_kv_len must be a finite number of tokens, got {mean_kv_len!r}; pass None "
                         "where it is not known")


def _table(table) -> ServingTable | None:
    if table is None or isinstance(table, ServingTable):
        return table
    return load_serving_table(table_path(table, serving=True))  # a path or a GPU name (locate.py)


class DecodePlan:
    """The serving call for one CallSpec and batches up to max_batch (see the module)."""

    def __init__(self, spec: CallSpec, max_batch: int, *, table=None, backend: str | None = None,
                 device=None, warm: bool = True):
        if not isinstance(spec, CallSpec):
            raise ValueError(f"spec must be a mla_tune.core.CallSpec, got {type(spec).__name__}")
        if not (isinstance(max_batch, int) and max_batch >= 1):
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        self.spec = spec
        self.max_batch = max_batch
        # the largest call's new tokens: what the shared partials and warm() are sized for
        self.max_total_q = max_batch * spec.max_q_len
        self.table = _table(table)
        self.misses: dict[str, int] = {}
        # The default: the preferred backend's untuned variant, for what the table lacks.
        self._default = Decoder(spec, backend=backend, device=device)
        self.device = self._default.device
        self._decoders: dict[Variant, Decoder] = {self._default.variant: self._default}
        here = self._default.platform
        if self.table is not None and here.has_gpu and self.table.gpu != here.name:
            warnings.warn(f"serving table {self.table.path} was tuned on {self.table.gpu} but this process runs "
                          f"on {here.name}: its picks run right here, but the fastest on {self.table.gpu} need "
                          f"not be the fastest here; tune this GPU with `mla-tune sweep --config "
                          f"configs/serving.yaml --gpu {here.name}`", stacklevel=2)
        family = self.table.family(spec) if self.table is not None else None
        if self.table is not None and family is None:
            families = " ".join(sorted(key.tag for key in self.table.families)) or "none"
            warnings.warn(f"serving table {self.table.path}: no family for {spec_text(spec)}; "
                          f"every call runs the default {self._default.variant}. The table has: "
                          f"{families}; sweep the call's family (configs/serving.yaml) to tune it",
                          stacklevel=2)
        self._family = family
        if family is not None and not spec.graph:
            # The lookup's one-off work (its interpolation grids, each split-K variant's rates
            # over the points, the replays' first call) here, not in the engine's first step.
            self.table.prepare(spec)
        # Picks whose backend cannot serve the spec here (a vendor library missing, another
        # GPU, no LSE) are replaced per step by the cell's best runnable variant (pick()).
        self._unrunnable: dict[Variant, str] = {}
        reasons: dict[str, str | None] = {}
        for variant in self._candidates():
            if variant in self._decoders:
                continue
            if variant.backend not in reasons:
                reasons[variant.backend] = why_not(variant.backend, spec, self._default.platform)
            if reasons[variant.backend] is not None:
                self._unrunnable[variant] = reasons[variant.backend]
                continue
            self._decoders[variant] = Decoder(spec, variant=variant, device=self.device)
        for variant in self._stand_ins():
            if variant not in self._decoders and variant.backend not in reasons:
                reasons[variant.backend] = why_not(variant.backend, spec, self._default.platform)
            if variant not in self._decoders and reasons[variant.backend] is None:
                self._decoders[variant] = Decoder(spec, variant=variant, device=self.device)
        # the own runners' partials in one buffer, their outputs in another (one runner runs a
        # step); reserved before warm
        self.scratch, self.outputs = SharedScratch(self.device), SharedScratch(self.device)
        for decoder in self._decoders.values():
            if hasattr(decoder.runner, "share_scratch"):
                decoder.runner.share_scratch(self.scratch, self.max_total_q)
                decoder.runner.share_outputs(self.outputs, self.max_total_q)
        if self._unrunnable:
            why = "; ".join(f"{n}: {r}" for n, r in sorted(reasons.items()) if r is not None)
            warnings.warn(f"serving table {self.table.path}: {len(self._unrunnable)} pick(s) for "
                          f"{spec_text(spec)} use backends that cannot serve it here ({why}); those steps "
                          "run the cell's best runnable variant (the estimates' next, the runner-up, or "
                          f"the default {self._default.variant}), counted in misses", stacklevel=2)
        # each cell's runner-up that runs here, by (batch bucket, kv bucket): _runner_up's,
        # made here so that no step parses one; each the object the plan keys its runner by
        self._runner_ups: dict[tuple[int, int], Variant] = {}
        if self._unrunnable and family is not None and not spec.graph:
            keys = {v: v for v in self._decoders}
            for at, cell in family.cells.items():
                runner_up = keys.get(cell.runner_up_variant)
                if runner_up is not None:
                    self._runner_ups[at] = runner_up
        # a step with its lengths on the host picks in one C call where the family's estimate
        # is compiled (the mean and its steps included: _Compiled.pick_lengths); the plan's
        # own, so that plans of one table stepped on different threads share no buffer
        self._compiled = (self.table.estimator.compiled(family, own=True)
                          if family is not None and family.points and not spec.graph else None)
        if self._compiled is not None:
            # keyed by the compiled lookup's own objects, the variants its picks return: a
            # step's dict lookups then match by identity, not by comparing the variants' fields
            same = {v: v for v in self._compiled.variants}
            self._decoders = {same.get(v, v): d for v, d in self._decoders.items()}
            self._unrunnable = {same.get(v, v): r for v, r in self._unrunnable.items()}
            self._runner_ups = {at: same.get(v, v) for at, v in self._runner_ups.items()}
        # the runner-ups by batch (up to max_batch), a row over the kv buckets each, and
        # where a mean moves from one kv bucket to the next: a step's two lookups, one list
        # index and one bisect
        self._runner_up_rows: list[list[Variant | None]] = []
        self._kv_edges = kv_bucket_edges(self.table.kv_buckets) if self._runner_ups else []
        if self._runner_ups:
            rows = {b: [self._runner_ups.get((b, kv)) for kv in self.table.kv_buckets]
                    for b in self.table.batch_buckets}
            self._runner_up_rows = [rows[batch_bucket(self.table.batch_buckets, b)] for b in range(max_batch + 1)]
        # the runnable variants as the family's compiled estimate reads them: a step whose
        # pick cannot run here takes the fastest of them from the same C call
        self._allowed = (self.table.estimator.allowed(family, self._decoders.__contains__)
                         if self._unrunnable and family.points and not spec.graph else None)
        self._mask = self._allowed.address if self._allowed is not None else None
        self._miss_keys = {v: f"{v.backend} cannot run here" for v in self._unrunnable}
        self._inputs = self._default.inputs
        self._kv_dtype = self._inputs.fast_dtype
        self._decoder = self._default
        self._qo = None
        self._layer = _no_step
        if warm:
            self.warm()

    def _candidates(self) -> list[Variant]:
        """Every variant update() may pick for a batch up to max_batch."""
        if self._family is None:
            return []
        top = batch_bucket(self.table.batch_buckets, self.max_batch)
        picks = [g.variant for b, g in sorted(self._family.graph.items()) if b <= top]
        if not self.spec.graph:
            picks += [c.variant for (b, _kv), c in sorted(self._family.cells.items()) if b <= top]
            picks += sorted({v for (b, _kv), times in self._family.points.items() if b <= top for v in times}, key=str)
        return list(dict.fromkeys(picks))

    def _stand_ins(self) -> list[Variant]:
        """The runner-ups of the cells whose pick cannot run here (pick() runs them instead)."""
        if self._family is None or self.spec.graph or not self._unrunnable:
            return []
        out = [cell.runner_up_variant for cell in self._family.cells.values() if cell.variant in self._unrunnable]
        return list(dict.fromkeys(v for v in out if v is not None))

    @property
    def variants(self) -> list[Variant]:
        return list(self._decoders)

    @property
    def runners(self) -> dict:
        """Each variant's runner, the backend's (serving/call.py's Decoder.runner)."""
        return {variant: decoder.runner for variant, decoder in self._decoders.items()}

    # ------------------------------------------------------------------ warm
    def warm(self) -> None:
        """Run every runner once at the plan's largest call (max_batch sequences of
        max_q_len new tokens over a tiny cache), so that each compiles its kernels and
        allocates its buffers now, not in a step or inside a graph capture."""
        spec, dev = self.spec, self.device
        batch, q_len = self.max_batch, spec.max_q_len
        q = torch.zeros((batch * q_len, spec.heads, QK_DIM), dtype=torch.bfloat16, device=dev)
        qo_indptr = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=dev)
        kv_dtype = torch.bfloat16 if spec.kv_format == "bf16" else torch.float8_e4m3fn
        if spec.cache_dtype == "uint8":
            kv_dtype = torch.uint8  # as the caller keeps it (the Decoder views it)
        kv_scale = None if spec.kv_format == "bf16" else torch.ones((1,), dtype=torch.float32, device=dev)
        host = {"q_lens_host": [q_len] * batch, "kv_lens_host": [q_len] * batch}
        if spec.page_size == 0:
            kv = torch.zeros((batch * q_len, 1, QK_DIM), dtype=kv_dtype, device=dev)
            layout = {"kv_indptr": qo_indptr.clone()}
        else:
            pages = math.ceil(q_len / spec.page_size)
            kv = torch.zeros((pages, spec.page_size, QK_DIM), dtype=kv_dtype, device=dev)
            layout = {"block_table": torch.arange(pages, dtype=torch.int32, device=dev).repeat(batch, 1),
                      "seq_lens": torch.full((batch,), q_len, dtype=torch.int32, device=dev)}
        for decoder in self._decoders.values():
            decoder(q, qo_indptr, kv, kv_scale, **layout, **host)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # ------------------------------------------------------------------ per step
    def pick(self, batch: int, mean_kv_len: float | None = None, kv_lens=None) -> Variant:
        """The variant a step of `batch` sequences runs (no timing): see the module.
        kv_lens: the step's lengths on the host, where the engine has them (a table's
        schedule models replay their backends' schedules for them)."""
        _check_lengths(batch, mean_kv_len, kv_lens)
        variant = None
        if self.table is not None and self._family is not None:
            mean = None if self.spec.graph else mean_kv_len
            # the table's lookup, its estimates made once for this step (in one C call where
            # the family's estimate is compiled), with the fastest runnable of them
            estimator = self.table.estimator
            variant, runnable = (estimator.pick(self._family, batch, mean, kv_lens, self._allowed, self._compiled)
                                 if mean is not None and self._family.points else (None, None))
            if variant is None:
                variant = self.table.lookup(self.spec, batch, mean, graph=self.spec.graph, kv_lens=kv_lens)
            if variant is None:
                key = f"batch {batch_bucket(self.table.batch_buckets, batch)}" + (
                    "" if mean is None else f", kv_len ~{mean:.0f}")
                self.misses[key] = self.misses.get(key, 0) + 1
            return self._runnable(variant, runnable, batch, mean)
        return self._default.variant

    def _pick_lengths(self, batch: int, kv_lens) -> Variant:
        """`pick(batch, sum(kv_lens) / len(kv_lens), kv_lens)` where the family's estimate is
        compiled and kv_lens holds one or more lengths: the same variant, in one C call."""
        compiled = self._compiled
        variant, runnable = compiled.pick_lengths(batch, kv_lens, self._mask)
        if variant is None:  # no variant is estimated around the call: the cells decide
            return self.pick(batch, sum(kv_lens) / len(kv_lens), kv_lens)
        if variant in self._unrunnable:  # else runnable, or the cell's runner-up at the mean
            return self._runnable(variant, runnable, batch, compiled.last_mean)
        return variant if variant in self._decoders else self._default.variant

    def _runnable(self, variant: Variant | None, runnable: Variant | None, batch: int, mean: float | None
                  ) -> Variant:
        """The variant the step runs for the table's pick: a pick that cannot run here is
        counted in misses and replaced by `runnable` (the fastest runnable estimate), else by
        the cell's runner-up at `mean`; anything the plan did not build runs the default."""
        if variant in self._unrunnable:
            key = self._miss_keys[variant]
            self.misses[key] = self.misses.get(key, 0) + 1
            variant = runnable if runnable is not None else self._runner_up(batch, mean)
        return variant if variant is not None and variant in self._decoders else self._default.variant

    def last_estimates(self) -> dict[Variant, float]:
        """The estimated times (us) behind the plan's last eager pick where its lookup is
        compiled (a variant with none left out): why a step ran what it ran. {} where the
        lookup is not compiled (a graph plan, no points, no C compiler)."""
        return self._compiled.estimates_left() if self._compiled is not None else {}

    def _runner_up(self, batch: int, mean: float | None) -> Variant | None:
        """Where the table's pick cannot run and no runnable variant is estimated (pick's
        `runnable`): the cell's runner-up where it runs here, else None (the default)."""
        if mean is None or not self._runner_ups:
            return None
        if batch >= len(self._runner_up_rows):  # pick() of more sequences than max_batch
            table = self.table
            return self._runner_ups.get((batch_bucket(table.batch_buckets, batch), kv_bucket(table.kv_buckets, mean)))
        return self._runner_up_rows[batch][bisect.bisect_right(self._kv_edges, mean)]

    def update(self, qo_indptr, *, kv_indptr=None, block_table=None, seq_lens=None,
               q_lens_host=None, kv_lens_host=None, mean_kv_len: float | None = None) -> Variant:
        """Once per step: pick the variant for this batch and keep the step's tensors (the
        engine keeps them in place across the step, as a CUDA graph needs). Returns the
        variant picked. Nothing here reads a device tensor on the host. A step refused here
        leaves no step to run: `run` raises until an update succeeds."""
        self._layer, self._qo = _no_step, None  # until the new step exists
        if not (isinstance(qo_indptr, torch.Tensor) and qo_indptr.dim() == 1):
            raise ValueError("qo_indptr must be a (batch + 1,) int32 tensor")
        batch = qo_indptr.shape[0] - 1
        if batch < 1:
            raise ValueError("a step of no sequences (qo_indptr holds one entry); a step needs at least "
                             "one sequence: skip attention for an empty step")
        if batch > self.max_batch:
            raise ValueError(f"a step of {batch} sequences, but the plan was made for up to "
                             f"{self.max_batch}; make a plan with a larger max_batch")
        _check_lengths(batch, mean_kv_len, kv_lens_host)
        if mean_kv_len is None and kv_lens_host is not None:
            if self._compiled is not None:
                variant = self._pick_lengths(batch, kv_lens_host)
            else:
                variant = self.pick(batch, sum(kv_lens_host) / len(kv_lens_host), kv_lens_host)
        else:
            variant = self.pick(batch, mean_kv_len, kv_lens_host)
        decoder = self._decoders[variant]
        # the layers' q and caches are not checked
        decoder.check_step(qo_indptr, kv_indptr=kv_indptr, block_table=block_table, seq_lens=seq_lens,
                           q_lens_host=q_lens_host, kv_lens_host=kv_lens_host)
        self._layer = runner_step(decoder.runner, qo_indptr, kv_indptr=kv_indptr, block_table=block_table,
                                  seq_lens=seq_lens, q_lens_host=q_lens_host, kv_lens_host=kv_lens_host)
        self._decoder, self._qo = decoder, qo_indptr
        return variant

    def run(self, q, kv, kv_scale=None):
        """Per layer: (total_q, heads, 512) bf16, the picked runner's output (for the own
        runners their reused buffer), or (out, lse) with spec.return_lse (lse (total_q,
        heads) float32, natural log). Only the step's layer call runs (update checked the
        step) behind one guard: a cache whose dtype is not the spec's own is viewed as
        fp8 where the spec declares uint8 bytes (cache_dtype 'uint8') and refused otherwise
        (CallInputs.cache), and a float kv_scale becomes its kept (1,) device tensor.
        `run_checked` checks q and kv too."""
        if kv.dtype is not self._kv_dtype:
            kv = self._inputs.cache(kv)
        if isinstance(kv_scale, float):  # numpy's float64 too
            kv_scale = self._inputs.scale(float(kv_scale))
        return self._layer(q, kv, kv_scale)

    def run_checked(self, q, kv, kv_scale=None) -> torch.Tensor:
        """`run`, after checking q, kv and kv_scale against the spec (shapes and dtypes)."""
        if self._qo is None:
            _no_step()
        self._decoder.check_layer(q, self._qo, kv, kv_scale)
        return self.run(q, kv, kv_scale)

    def __repr__(self) -> str:
        return (f"DecodePlan({spec_text(self.spec)}, up to {self.max_batch} sequences, "
                f"{len(self._decoders)} variant(s), default {self._default.variant}, "
                f"{self.scratch.nbytes / 2**20:.1f} MiB of shared split partials, "
                f"{self.outputs.nbytes / 2**20:.1f} MiB of shared outputs)")
