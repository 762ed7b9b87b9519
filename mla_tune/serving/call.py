"""The serving call: one decode call for every KV layout, over a backend that serves it.

An engine describes its calls once, as a `CallSpec` (KV format, page size with 0 for the
contiguous layout, heads, max_q_len, mixed_q_len, graph, host_lengths, and the call's own
sm_scale, return_lse and cache_dtype), builds a
`Decoder` for it and calls it every step:

    decoder = Decoder(CallSpec("fp8", page_size=64, heads=128, max_q_len=2, mixed_q_len=True))
    out = decoder(q, qo_indptr, kv_cache, kv_scale, block_table=block_table, seq_lens=seq_lens)

`decode(...)` does both from the tensors, with one Decoder per (spec, backend, device).
The Decoder picks the first backend in the registry's order (backends.serving_backends():
BACKEND_MODULES, then plugins) whose capability record serves the spec, that runs on this
platform and is available, builds its runner once (the backend's
`default_serving_variant`, untuned: a Decoder consults no table; serving/decode_plan.py's
DecodePlan picks from the serving table), and checks every call against the spec from
shapes and dtypes only, so a call never reads a device tensor on the host. See docs/runtime.md, "The serving call".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from mla_tune.backends import capabilities, get_backend, platform_refusal, serving_backends
from mla_tune.core import CORE_FP8_DTYPE_NAMES, QK_DIM, SM_SCALE, CallSpec, Variant, fp8_dtype_for
from mla_tune.gpu import Platform, detect


def __getattr__(name: str):
    # PREFERENCE, the old name of the order a Decoder tries backends in, for old imports:
    # the registry's serving backends now (mla-tune's own kernels come first there: split-K,
    # then the fused one-launch kernels, every layout, graph-safe, no host plan; then the
    # vendors'), read per access so that plugins registered later count.
    if name == "PREFERENCE":
        return tuple(serving_backends())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _device(device) -> torch.device:
    """`device` (None: the current GPU, else the CPU) with a CUDA index, so that it
    compares equal to a tensor's device."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _platform(device: torch.device) -> Platform:
    if device.type == "cuda":
        return detect(device.index)
    if torch.cuda.is_available():  # a CPU device beside a GPU
        return Platform("cpu", "cpu", "cpu", False, 0)
    return detect()  # the CPU (or, in tests, the simulated platform detect() reports)


def spec_text(spec: CallSpec) -> str:
    """`spec` in words, for messages: 'fp8 KV, paged 64, 128 heads, q_len up to 2 (mixed)'."""
    text = f"{spec.kv_format} KV, {spec.layout}, {spec.heads} heads, q_len up to {spec.max_q_len}"
    text += " (mixed)" if spec.mixed_q_len else ""
    text += ", in a CUDA graph" if spec.graph else ""
    return text + (", lengths on the host" if spec.host_lengths else "")


def why_not(name: str, spec: CallSpec, platform: Platform) -> str | None:
    """Why backend `name` cannot serve `spec` on `platform` (None: it can), in words."""
    try:
        module = get_backend(name)
    except ModuleNotFoundError as exc:
        return f"its module cannot be imported ({exc})"
    reason = capabilities(name).refusal(spec) or platform_refusal(name, platform)
    if reason is not None:
        return reason
    if not (hasattr(module, "build_serving") and hasattr(module, "default_serving_variant")):
        return "it has no build_serving / default_serving_variant"
    return module.unavailable_reason()


def _fp8(dtype: torch.dtype) -> bool:
    return str(dtype).removeprefix("torch.") in CORE_FP8_DTYPE_NAMES


def kv_format_of(kv) -> str:
    """The spec's kv_format for a cache tensor: bf16, or fp8 for a 1-byte float8 dtype."""
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype == torch.bfloat16:
        return "bf16"
    if _fp8(kv.dtype):
        return "fp8"
    raise ValueError(f"kv must be bfloat16 or an fp8 dtype (float8_e4m3fn, float8_e4m3fnuz on MI300), "
                     f"got {kv.dtype}; a cache of fp8 bytes kept as {kv.dtype}: pass "
                     "kv.view(torch.float8_e4m3fn)")


def infer_spec(q, qo_indptr, kv, *, block_table=None, max_q_len: int | None = None,
               mixed_q_len: bool | None = None, graph: bool = False,
               host_lengths: bool = False) -> CallSpec:
    """The CallSpec of a call, from its tensors' shapes and dtypes: heads from q, the page
    size from a paged kv (block_table given; else contiguous), the KV format from kv's
    dtype. max_q_len is 1 when q holds one new token per sequence and must be given
    otherwise (the lengths are on the device); mixed_q_len defaults to max_q_len > 1."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 3):
        raise ValueError(f"q must be a (total_q, heads, {QK_DIM}) tensor, got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if not (isinstance(qo_indptr, torch.Tensor) and qo_indptr.dim() == 1 and qo_indptr.shape[0] >= 2):
        raise ValueError("qo_indptr must be a (batch + 1,) int32 tensor with batch >= 1")
    kv_format = kv_format_of(kv)
    if block_table is not None and kv.dim() != 3:
        raise ValueError(f"paged kv must be (num_pages, page_size, {QK_DIM}), got {tuple(kv.shape)}")
    page_size = kv.shape[1] if block_table is not None else 0
    batch = qo_indptr.shape[0] - 1
    if max_q_len is None:
        if q.shape[0] != batch:
            raise ValueError(f"q holds {q.shape[0]} new tokens for {batch} sequences: pass max_q_len, "
                             "the most new tokens one sequence brings (lengths are not read from the device)")
        max_q_len = 1
    if mixed_q_len is None:
        mixed_q_len = max_q_len > 1
    return CallSpec(kv_format, page_size, q.shape[1], max_q_len, mixed_q_len, graph, host_lengths)


_DC_MAX_VIEWS = 1024  # cache tensors whose fp8 view CallInputs keeps (layers of a model)


class CallInputs:
    """How a call's cache and kv_scale reach a runner, for one spec on one device.

    `cache(kv)`: the cache as the kernels read it: a cache of spec.cache_dtype "uint8" (fp8
    bytes, as vLLM keeps it) viewed as fp8 (`fp8_dtype`: e4m3fn, e4m3fnuz on gfx942), the
    view made once per cache tensor (an engine's layer caches: the first _DC_MAX_VIEWS
    tensors seen are kept with their views, later ones are viewed per call); a
    cache of the spec's own format as it is; anything else refused with a ValueError that
    names the fix (a uint8 cache read as fp8 without being declared would be silent
    garbage). `scale(value)`: a Python float kv_scale as a (1,) float32 device tensor, made
    the first time that value is seen and kept per value (so a call in a CUDA graph reads
    a tensor made before its capture, once each layer has run eagerly, as a warm-up does).
    `fast_dtype`: the dtype a cache that needs nothing done has (None: every cache is
    viewed), for DecodePlan.run's one-attribute guard."""

    def __init__(self, spec: CallSpec, device: torch.device):
        self.spec, self.device = spec, device
        self.fp8_dtype = fp8_dtype_for(device) if spec.kv_format == "fp8" else None
        if spec.cache_dtype == "uint8":
            self.fast_dtype = None
        else:
            self.fast_dtype = torch.bfloat16 if spec.kv_format == "bf16" else self.fp8_dtype
        self._scales: dict[float, torch.Tensor] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(cache) -> (cache, fp8 view)

    def cache(self, kv) -> torch.Tensor:
        kept = self._views.get(id(kv))
        if kept is not None and kept[0] is kv:  # the tensor is held here, so its id is not reused
            return kept[1]
        dtype = getattr(kv, "dtype", None)
        if self.spec.cache_dtype == "uint8":
            if dtype == torch.uint8:
                view = kv.view(self.fp8_dtype)
                if len(self._views) < _DC_MAX_VIEWS:
                    self._views[id(kv)] = (kv, view)
                return view
            raise ValueError(f"kv must be a uint8 tensor of fp8 bytes (the spec's cache_dtype 'uint8'), got "
                             f"{_tensor_text(kv)}; a cache of fp8 dtype needs CallSpec(..., cache_dtype='')")
        if dtype == self.fast_dtype or (self.spec.kv_format == "fp8" and _fp8(dtype)):
            return kv
        if dtype == torch.uint8 and self.spec.kv_format == "fp8":
            raise ValueError("kv is uint8 but the spec's cache_dtype is '' (an fp8 dtype): declare a cache of "
                             "fp8 bytes with CallSpec(..., cache_dtype='uint8'), or pass kv.view(torch.float8_e4m3fn)")
        raise ValueError(f"kv must be {self.spec.kv_format} (the spec's KV format), got {_tensor_text(kv)}")

    def scale(self, value: float) -> torch.Tensor:
        tensor = self._scales.get(value)
        if tensor is None:
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"kv_scale must be positive and finite, got {value!r}")
            tensor = torch.full((1,), value, dtype=torch.float32, device=self.device)
            self._scales[value] = tensor
        return tensor


def _tensor_text(x) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{str(x.dtype).removeprefix('torch.')} {tuple(x.shape)} on {x.device}"


class Decoder:
    """The serving call for one CallSpec: a backend's runner, built once, behind a check
    of every call against the spec (shapes and dtypes, never values).

    backend: a name to insist on (refused, with the backends that would serve the spec,
    when its capabilities do not cover it or it cannot run here); None picks the first of
    the registry's serving backends (backends.serving_backends()) that serves the spec.
    variant: a serving variant of that backend (None: its default_serving_variant for
    this platform). The output is the runner's own buffer,
    reused by the next call: copy it to keep it.
    """

    def __init__(self, spec: CallSpec, backend: str | None = None, variant: Variant | str | None = None,
                 device=None):
        if not isinstance(spec, CallSpec):
            raise ValueError(f"spec must be a mla_tune.core.CallSpec, got {type(spec).__name__}")
        if isinstance(variant, str):
            variant = Variant.parse(variant)
        if variant is not None:
            if backend is not None and backend != variant.backend:
                raise ValueError(f"variant {variant} belongs to backend {variant.backend}, not {backend}")
            backend = variant.backend
        self.spec = spec
        self.device = _device(device)
        self.platform = _platform(self.device)
        self.inputs = CallInputs(spec, self.device)
        if backend is None:
            reasons = {}
            for name in serving_backends():
                reasons[name] = why_not(name, spec, self.platform)
                if reasons[name] is None:
                    backend = name
                    break
            else:
                raise ValueError(f"no backend serves {spec_text(spec)} on {self.platform.name}: "
                                 + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
        else:
            reason = why_not(backend, spec, self.platform)
            if reason is not None:
                others = [n for n in serving_backends()
                          if n != backend and why_not(n, spec, self.platform) is None]
                served = (f"backends that would: {', '.join(others)}" if others
                          else "no backend here would (Decoder(spec) without a backend names each one's reason)")
                raise ValueError(f"backend {backend} cannot serve {spec_text(spec)}: {reason}; {served}")
        module = get_backend(backend)
        self.backend = backend
        self.variant = variant if variant is not None else module.default_serving_variant(spec, self.platform)
        self._runner = module.build_serving(self.variant, spec, self.device)

    def __repr__(self) -> str:
        return f"Decoder({spec_text(self.spec)}: {self.variant} on {self.device})"

    @property
    def runner(self):
        """The backend's runner behind the checks: runner(q, qo_indptr, kv, kv_scale, *,
        kv_indptr / block_table + seq_lens, q_lens_host, kv_lens_host). A caller that has
        checked its call once (a DecodePlan's update) may run it directly."""
        return self._runner

    def check(self, q, qo_indptr, kv, kv_scale=None, *, kv_indptr=None, block_table=None,
              seq_lens=None, q_lens_host=None, kv_lens_host=None) -> None:
        """Refuse (ValueError naming what was expected) a call that does not match the
        spec: shapes, dtypes, devices and the layout's arguments only, no device read.
        Each message is built only when its check fails (this runs every step)."""
        self.check_step(qo_indptr, kv_indptr=kv_indptr, block_table=block_table,
                        seq_lens=seq_lens, q_lens_host=q_lens_host, kv_lens_host=kv_lens_host)
        self.check_layer(q, qo_indptr, kv, kv_scale, paged=kv_indptr is None)

    def check_step(self, qo_indptr, *, kv_indptr=None, block_table=None, seq_lens=None,
                   q_lens_host=None, kv_lens_host=None) -> None:
        """The part of `check` that a step's layers share: qo_indptr and the KV layout's
        arguments (a DecodePlan checks these once per step, in update)."""
        spec, dev = self.spec, self.device
        if not (isinstance(qo_indptr, torch.Tensor) and qo_indptr.dim() == 1 and qo_indptr.shape[0] >= 2
                and qo_indptr.dtype == torch.int32 and qo_indptr.device == dev and qo_indptr.is_contiguous()):
            self._refuse(f"qo_indptr must be a contiguous int32 (batch + 1,) tensor on {dev}, got "
                         f"{_tensor_text(qo_indptr)}")
        batch = qo_indptr.shape[0] - 1
        if spec.page_size == 0:
            if kv_indptr is None or block_table is not None or seq_lens is not None:
                self._refuse("the spec's KV is contiguous: pass kv_indptr, not block_table / seq_lens")
            if not (isinstance(kv_indptr, torch.Tensor) and kv_indptr.shape == (batch + 1,)
                    and kv_indptr.dtype == torch.int32 and kv_indptr.device == dev and kv_indptr.is_contiguous()):
                self._refuse(f"kv_indptr must be a contiguous int32 ({batch + 1},) tensor on {dev}, got "
                             f"{_tensor_text(kv_indptr)}")
        else:
            if kv_indptr is not None or block_table is None or seq_lens is None:
                self._refuse(f"the spec's KV is paged ({spec.page_size}-token pages): pass "
                             "block_table and seq_lens, not kv_indptr")
            if not (isinstance(block_table, torch.Tensor) and block_table.dim() == 2
                    and block_table.shape[0] == batch and block_table.dtype == torch.int32
                    and block_table.stride(1) == 1 and block_table.device == dev):
                self._refuse(f"block_table must be an int32 ({batch}, max_pages) tensor on {dev} "
                             f"with contiguous rows, got {_tensor_text(block_table)}")
            if not (isinstance(seq_lens, torch.Tensor) and seq_lens.shape == (batch,)
                    and seq_lens.dtype == torch.int32 and seq_lens.device == dev and seq_lens.is_contiguous()):
                self._refuse(f"seq_lens must be a contiguous int32 ({batch},) tensor on {dev}, got "
                             f"{_tensor_text(seq_lens)}")
        # (a list passes before the ABC's isinstance, which costs several times more)
        if spec.host_lengths and not (
                (type(q_lens_host) is list or isinstance(q_lens_host, Sequence))
                and (type(kv_lens_host) is list or isinstance(kv_lens_host, Sequence))
                and len(q_lens_host) == batch and len(kv_lens_host) == batch):
            self._refuse(f"{self.backend} plans from the lengths on the host: pass q_lens_host and "
                         f"kv_lens_host, lists of {batch} ints")

    def check_layer(self, q, qo_indptr, kv, kv_scale=None, paged: bool | None = None) -> None:
        """The part of `check` that differs per layer: q, the cache and its scale."""
        spec, dev = self.spec, self.device
        if not (isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[1:] == (spec.heads, QK_DIM)
                and q.dtype == torch.bfloat16 and q.is_contiguous()):
            self._refuse(f"q must be a contiguous bfloat16 (total_q, {spec.heads}, {QK_DIM}) tensor, "
                         f"got {_tensor_text(q)}")
        batch, total_q = qo_indptr.shape[0] - 1, q.shape[0]
        if spec.max_q_len == 1 and total_q != batch:
            self._refuse(f"q holds {total_q} new tokens for {batch} sequences, but the spec says one "
                         "each (max_q_len 1)")
        if not batch <= total_q <= batch * spec.max_q_len:
            self._refuse(f"q holds {total_q} new tokens for {batch} sequences: each brings 1 to "
                         f"{spec.max_q_len} (the spec's max_q_len)")
        if not (isinstance(kv, torch.Tensor) and kv.dim() == 3 and kv.shape[2] == QK_DIM
                and kv.is_contiguous()):
            self._refuse(f"kv must be a contiguous (total_kv, 1, {QK_DIM}) or (num_pages, page_size, "
                         f"{QK_DIM}) tensor, got {_tensor_text(kv)}")
        if spec.kv_format == "bf16":
            if kv.dtype != torch.bfloat16:
                self._refuse(f"kv must be bfloat16 (the spec's KV format), got {kv.dtype}")
            if kv_scale is not None:
                self._refuse("a bf16 KV cache takes no kv_scale; pass None")
        else:
            if spec.cache_dtype == "uint8" and kv.dtype != torch.uint8:
                self._refuse(f"kv must be uint8 (fp8 bytes: the spec's cache_dtype 'uint8'), got {kv.dtype}")
            if spec.cache_dtype != "uint8" and not _fp8(kv.dtype):
                fix = (" (fp8 bytes kept as uint8: declare them with CallSpec(..., cache_dtype='uint8'))"
                       if kv.dtype == torch.uint8 else "")
                self._refuse(f"kv must have an fp8 dtype (the spec's KV format), got {kv.dtype}{fix}")
            if not (isinstance(kv_scale, float) or (isinstance(kv_scale, torch.Tensor) and kv_scale.numel() == 1
                    and kv_scale.dtype == torch.float32 and kv_scale.device == dev)):
                self._refuse(f"fp8 KV needs kv_scale, a Python float or a (1,) float32 tensor on {dev}, "
                             f"got {_tensor_text(kv_scale)}")
        if spec.page_size == 0 and kv.shape[1] != 1:
            self._refuse(f"contiguous kv must be (total_kv, 1, {QK_DIM}), got {tuple(kv.shape)}")
        if spec.page_size and kv.shape[1] != spec.page_size:
            self._refuse(f"kv must be (num_pages, {spec.page_size}, {QK_DIM}) (the spec's page "
                         f"size), got {tuple(kv.shape)}")
        if not (q.device == dev and kv.device == dev):
            self._refuse(f"q and kv must be on {dev}, got {q.device}, {kv.device}")

    def _refuse(self, message: str):
        raise ValueError(f"{message} ({self!r})")

    def __call__(self, q, qo_indptr, kv, kv_scale=None, *, kv_indptr=None, block_table=None,
                 seq_lens=None, q_lens_host=None, kv_lens_host=None):
        """(total_q, heads, 512) bf16, or (out, lse) with spec.return_lse (lse (total_q,
        heads) float32, natural log): new token i of a sequence of q_len over the first
        seq_len - (q_len - 1 - i) tokens of its KV (which holds the new tokens), scores
        scaled by spec.sm_scale. A uint8 cache is viewed as fp8 when the spec says so
        (cache_dtype 'uint8'); a float kv_scale becomes a kept (1,) device tensor."""
        layout = dict(kv_indptr=kv_indptr, block_table=block_table, seq_lens=seq_lens,
                      q_lens_host=q_lens_host, kv_lens_host=kv_lens_host)
        self.check(q, qo_indptr, kv, kv_scale, **layout)
        kv = self.inputs.cache(kv)
        if isinstance(kv_scale, float):  # numpy's float64 too
            kv_scale = self.inputs.scale(float(kv_scale))
        return self._runner(q, qo_indptr, kv, kv_scale, **layout)


def runner_step(runner, qo_indptr, *, kv_indptr=None, block_table=None, seq_lens=None,
                q_lens_host=None, kv_lens_host=None):
    """The per-layer call of one step, `layer(q, kv, kv_scale=None) -> out`: the runner's
    own `step(...)` where it has one (the own runners, flashmla, flashinfer: the step's
    shared work done once, later layers on a short path), else a call of the runner with
    the step's arguments (any runner of the serving contract)."""
    step = getattr(runner, "step", None)
    if step is not None:
        return step(qo_indptr, kv_indptr=kv_indptr, block_table=block_table, seq_lens=seq_lens,
                    q_lens_host=q_lens_host, kv_lens_host=kv_lens_host)
    layout = dict(kv_indptr=kv_indptr, block_table=block_table, seq_lens=seq_lens,
                  q_lens_host=q_lens_host, kv_lens_host=kv_lens_host)

    def layer(q, kv, kv_scale=None):
        return runner(q, qo_indptr, kv, kv_scale, **layout)

    return layer


@functools.lru_cache(maxsize=64)
def _decoder(spec: CallSpec, backend: str | None, device: torch.device) -> Decoder:
    return Decoder(spec, backend=backend, device=device)


def clear_decoders() -> None:
    """Forget the Decoders `decode` built (their buffers go with them)."""
    _decoder.cache_clear()


def decode(q, qo_indptr, kv, kv_scale=None, *, kv_indptr=None, block_table=None, seq_lens=None,
           max_q_len: int | None = None, mixed_q_len: bool | None = None, graph: bool = False,
           q_lens_host=None, kv_lens_host=None, backend: str | None = None,
           sm_scale: float = SM_SCALE, return_lse: bool = False):
    """MLA decode for the serving call, any layout: (total_q, heads, 512) bf16.

    q (total_q, heads, 576) bf16 with qo_indptr (batch + 1,) int32; KV bf16, or fp8 with a
    (1,) float32 kv_scale; contiguous kv (total_kv, 1, 576) with kv_indptr, or paged kv
    (num_pages, page_size, 576) with block_table (batch, max_pages) and seq_lens (batch,),
    all int32. The spec is read from the tensors (infer_spec: max_q_len must be given when
    a sequence brings more than one new token) and its Decoder is built on first use and
    kept per (spec, backend, q's device). q_lens_host / kv_lens_host: the lengths as
    Python lists, for backends that plan on the host. The result is the Decoder's reused
    buffer: copy it to keep it past the next call of the same spec. sm_scale: the model's
    softmax scale; return_lse: return (out, lse) (CallSpec's fields of those names)."""
    spec = infer_spec(q, qo_indptr, kv, block_table=block_table, max_q_len=max_q_len,
                      mixed_q_len=mixed_q_len, graph=graph,
                      host_lengths=q_lens_host is not None or kv_lens_host is not None)
    if sm_scale != SM_SCALE or return_lse:
        spec = dataclasses.replace(spec, sm_scale=sm_scale, return_lse=return_lse)
    decoder = _decoder(spec, backend, _device(q.device))
    return decoder(q, qo_indptr, kv, kv_scale, kv_indptr=kv_indptr, block_table=block_table,
                   seq_lens=seq_lens, q_lens_host=q_lens_host, kv_lens_host=kv_lens_host)
