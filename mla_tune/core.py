"""The fixed facts of MLA decode and the small values every other module shares.

This module is *exportable*: `mla-tune export` copies it verbatim into a single-file
submission, so it imports only the standard library and torch, and every top-level name
is unique across the exportable modules (see mla_tune/export/__init__.py). torch is imported inside
the functions that use it, so reading a table (Shape, Variant) never imports torch. The own
kernels' serving runner is beside them (mla_tune/kernels/serving_runner.py).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

# DeepSeek-R1 forward_absorb MLA, as the amd-mixed-mla leaderboard poses it.
NUM_HEADS = 16
NUM_KV_HEADS = 1
KV_LORA_RANK = 512
QK_ROPE_DIM = 64
QK_DIM = KV_LORA_RANK + QK_ROPE_DIM  # 576: keys use all of it
V_DIM = KV_LORA_RANK  # 512: values are the first 512 dims of the same latent
SM_SCALE = 1.0 / math.sqrt(QK_DIM)
# The seeds torch.Generator.manual_seed takes; an input drawn from one outside overflows.
SEED_RANGE = (-(2**63), 2**64 - 1)
MXFP4_BLOCK = 32
MXFP4_SCALES = QK_DIM // MXFP4_BLOCK  # 18 E8M0 scales per token

KV_FORMATS = ("bf16", "fp8", "mxfp4")
Q_MODES = ("bf16", "fp8_dynamic", "fp8_static")
# The fp8 formats a KV cache may come in: e4m3fn (NVIDIA, gfx950), e4m3fnuz (gfx942), by
# name so that this module imports without torch (`mla-tune show` reads tables torch-free).
CORE_FP8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e4m3fnuz")


def fp8_dtype_for(device=None):
    """The fp8 torch dtype the leaderboard uses on `device` (a torch.device, a name, or None
    for the current CUDA device): e4m3fnuz on gfx942, else e4m3fn."""
    import torch

    if torch.version.hip and torch.cuda.is_available():
        dev = torch.device(device) if device is not None else torch.device("cuda")
        arch = getattr(torch.cuda.get_device_properties(dev), "gcnArchName", "")
        if arch.startswith("gfx942"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


@functools.cache
def _core_sm_count(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def device_sm_count(device=None) -> int:
    """The SM (CU) count of a CUDA or ROCm device (a torch.device, a name, an index, or None
    for the current one), asked of the device once and cached; 0 where there is none (the
    CPU, Triton's interpreter)."""
    import torch

    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = torch.device(device) if device is not None else None
    if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
        return 0
    index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
    return _core_sm_count(index)


@dataclass(frozen=True, order=True)
class Shape:
    """A uniform decode batch: `batch` sequences of `kv_len` cached tokens, one query each."""

    batch: int
    kv_len: int

    def __post_init__(self) -> None:
        for field, value in (("batch", self.batch), ("kv_len", self.kv_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Shape.{field} must be a positive int, got {value!r}")

    @property
    def total_kv(self) -> int:
        return self.batch * self.kv_len

    def __str__(self) -> str:
        return f"{self.batch}x{self.kv_len}"


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VARIANT_TEXT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\((.*)\)$")


def _param_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    raise TypeError(f"variant parameters are int, float, bool or str; got {value!r}")


def _param_value(text: str) -> Any:
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?|-?inf|nan", text):
        return float(text)
    if _IDENT.match(text):
        return text
    raise ValueError(f"cannot read variant parameter value {text!r}")


@dataclass(frozen=True)
class Variant:
    """One runnable configuration: a backend name and its named parameters.

    Frozen and hashable, with a stable text form, `triton(block_n=32,num_splits=4)`, that
    `Variant.parse` reads back exactly (parameters sorted by name; values are int, float,
    bool or a bare word, never code).
    """

    backend: str
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def make(cls, backend: str, **params: Any) -> Variant:
        if not _IDENT.match(backend):
            raise ValueError(f"backend name {backend!r} is not an identifier")
        for name, value in params.items():
            _param_text(value)  # type check
            if isinstance(value, str) and not _IDENT.match(value):
                raise ValueError(f"string parameter {name}={value!r} must be a bare word")
        return cls(backend, tuple(sorted(params.items())))

    @classmethod
    def parse(cls, text: str) -> Variant:
        match = _VARIANT_TEXT.match(text.strip())
        if not match:
            raise ValueError(f"variant text {text!r} is not of the form backend(name=value,...)")
        params = {}
        body = match.group(2).strip()
        for item in body.split(",") if body else []:
            name, sep, value = item.partition("=")
            if not sep or not _IDENT.match(name.strip()):
                raise ValueError(f"variant text {text!r}: {item!r} is not name=value")
            params[name.strip()] = _param_value(value.strip())
        return cls.make(match.group(1), **params)

    def __hash__(self) -> int:
        # Computed once per object (the serving lookup keys its dicts by variants); the
        # cache is per process, so pickling leaves it out (a str's hash is per process).
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = self.__dict__["_hash"] = hash((self.backend, self.params))
            return h

    def __getstate__(self) -> dict[str, Any]:
        return {"backend": self.backend, "params": self.params}

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)

    def get(self, name: str, default: Any = None) -> Any:
        return self.p.get(name, default)

    def with_params(self, **params: Any) -> Variant:
        return Variant.make(self.backend, **{**self.p, **params})

    def __str__(self) -> str:
        inner = ",".join(f"{k}={_param_text(v)}" for k, v in self.params)
        return f"{self.backend}({inner})"


# ------------------------------------------------------------------ what a backend can do
# One record per backend (its module's CAPABILITIES), read by the registry, the sweep, the
# dispatcher, the runtime and the export instead of facts spread over files.
CORE_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # every power of two up to 128
CORE_HEADS = (16, 32, 64, 128)  # DeepSeek-V3's heads per GPU at tensor parallelism 8, 4, 2, 1
# CallSpec.cache_dtype: "" (the KV format's own dtype) or "uint8" (fp8 bytes, vLLM's cache).
CORE_CACHE_DTYPES = ("", "uint8")
# DeepSeek-V3 / R1's softmax scale: the un-absorbed head's 1/sqrt(128 + 64) times YaRN's
# mscale**2, mscale = 0.1 * mscale_all_dim (1.0) * ln(factor 40) + 1 (about 0.1352).
CORE_DEEPSEEK_V3_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)


@dataclass(frozen=True)
class CallSpec:
    """The facts of a decode call that pick (and may rule out) a kernel: fixed for a whole
    deployment or CUDA graph, never read from the data.

    page_size 0 is the contiguous layout (kv_indptr); max_q_len bounds each sequence's new
    tokens (1 without speculative decoding); mixed_q_len: sequences of one call may bring
    different numbers of new tokens (their KV lengths always may differ); graph: the call is
    captured in a CUDA graph (no host read of a device tensor, no allocation per call);
    host_lengths: the caller hands the lengths over on the host each step (engines keep
    them there), which backends that plan on the host need."""

    kv_format: str
    page_size: int = 0
    heads: int = NUM_HEADS
    max_q_len: int = 1
    mixed_q_len: bool = False
    graph: bool = False
    host_lengths: bool = False
    # The call's own facts, which pick no kernel (a serving table's keys leave them out):
    # the model's softmax scale (DeepSeek-V3's is mscale**2 / sqrt(192), CORE_DEEPSEEK_V3_SCALE);
    # return_lse: run returns (out, lse), lse the natural-log log-sum-exp of each (new
    # token, head)'s scores, (total_q, heads) float32; cache_dtype "" is the format's own
    # dtype, "uint8" an fp8 cache kept as bytes (as vLLM keeps it), viewed as fp8 by the call.
    sm_scale: float = SM_SCALE
    return_lse: bool = False
    cache_dtype: str = ""

    def __post_init__(self) -> None:
        require(self.kv_format in KV_FORMATS, f"kv_format must be one of {', '.join(KV_FORMATS)}, "
                f"got {self.kv_format!r}")
        require(isinstance(self.sm_scale, (int, float)) and not isinstance(self.sm_scale, bool)
                and math.isfinite(self.sm_scale) and self.sm_scale > 0,
                f"sm_scale must be a positive finite float (the model's softmax scale), got {self.sm_scale!r}")
        require(isinstance(self.return_lse, bool), f"return_lse must be a bool, got {self.return_lse!r}")
        require(self.cache_dtype in CORE_CACHE_DTYPES,
                f"cache_dtype must be one of {', '.join(map(repr, CORE_CACHE_DTYPES))}, got {self.cache_dtype!r}")
        require(self.cache_dtype != "uint8" or self.kv_format == "fp8",
                f"cache_dtype 'uint8' is an fp8 cache kept as bytes; kv_format is {self.kv_format!r}: "
                "use kv_format='fp8'")
        require(self.page_size == 0 or self.page_size in CORE_PAGE_SIZES,
                f"page_size must be 0 (contiguous KV) or a power of two up to 128, got {self.page_size}")
        require(isinstance(self.heads, int) and self.heads >= 1, f"heads must be >= 1, got {self.heads!r}")
        require(isinstance(self.max_q_len, int) and 1 <= self.max_q_len <= 16,
                f"max_q_len must be 1 to 16, got {self.max_q_len!r}")

    @property
    def layout(self) -> str:
        return "contiguous" if self.page_size == 0 else f"paged {self.page_size}"


@dataclass(frozen=True)
class Capabilities:
    """What one backend can serve and needs, declared in its module as CAPABILITIES.

    Leaderboard call (build): `ragged` says its runners read kv_indptr per sequence, so a
    ragged batch may be sent to them. Serving call (build_serving, when `serving`; every
    serving call reads each sequence's length from the device): the layouts (contiguous and/or the page
    sizes), head counts, q_len range and KV formats it reads; `graph_safe`: a built runner
    neither synchronizes nor allocates per call; `host_lengths`: it plans on the host from
    the lengths each step (a graph can hold its run, not its plan); `lse`: its serving call
    returns (out, lse) for a spec with return_lse (natural log, (total_q, heads) float32).
    `platforms`: where it
    runs, as tags a Platform has ("cuda", "hip", "cpu", an arch such as "sm_90" or "gfx950");
    each inner tuple is one alternative whose tags must all hold. `vendor`: the
    distribution whose version a table records; `precompile`: its kernels compile on first
    use into an on-disk cache (the sweep warms them first); `baseline`: the reference
    implementation every sweep times."""

    kv_formats: tuple[str, ...]
    q_modes: tuple[str, ...] = ("bf16",)
    serving_kv_formats: tuple[str, ...] | None = None  # None: kv_formats
    ragged: bool = False
    serving: bool = False
    contiguous: bool = True
    page_sizes: tuple[int, ...] = ()
    heads: tuple[int, ...] = (NUM_HEADS,)
    max_q_len: int = 1
    mixed_q_len: bool = False
    graph_safe: bool = False
    host_lengths: bool = False
    platforms: tuple[tuple[str, ...], ...] = (("cuda",), ("hip",), ("cpu",))
    vendor: str | None = None
    precompile: bool = False
    baseline: bool = False
    lse: bool = False  # its serving call can return the LSE (spec.return_lse)

    def runs_on(self, tags) -> bool:
        """Whether one of `platforms` has all its tags in `tags` (a Platform's tags)."""
        return any(all(t in tags for t in option) for option in self.platforms)

    def refusal(self, spec: CallSpec) -> str | None:
        """None when this backend's serving call serves `spec`; else one sentence why not."""
        if not self.serving:
            return "it serves the leaderboard's call only (no build_serving)"
        kv_formats = self.kv_formats if self.serving_kv_formats is None else self.serving_kv_formats
        if spec.kv_format not in kv_formats:
            return f"it reads {', '.join(kv_formats)} KV, not {spec.kv_format}"
        if spec.page_size == 0 and not self.contiguous:
            return f"it reads paged KV ({_core_pages(self.page_sizes)}), not the contiguous layout"
        if spec.page_size and spec.page_size not in self.page_sizes:
            return (f"it reads {_core_pages(self.page_sizes)}" + (" or contiguous KV" if self.contiguous else "")
                    + f", not pages of {spec.page_size}")
        if spec.heads not in self.heads:
            return f"it serves {', '.join(map(str, self.heads))} heads, not {spec.heads}"
        if spec.max_q_len > self.max_q_len:
            return f"it serves q_len up to {self.max_q_len}, not {spec.max_q_len}"
        if spec.mixed_q_len and not self.mixed_q_len:
            return "it needs every sequence of a call to bring the same number of new tokens"
        if spec.graph and not self.graph_safe:
            return "its call synchronizes or allocates, so it cannot be captured in a CUDA graph"
        if self.host_lengths and not spec.host_lengths:
            return "it plans from the lengths on the host each step; pass them (host_lengths)"
        if spec.return_lse and not self.lse:
            return "it does not return the LSE (return_lse)"
        return None


def _core_pages(sizes: tuple[int, ...]) -> str:
    return ("pages of " + ", ".join(map(str, sizes)) + " tokens") if sizes else "no paged layout"


def vendor_is_cpu_fake(module) -> bool:
    """True for the CPU fakes of vendor libraries under tests/fakes, which say so; the real
    packages never set MLA_TUNE_CPU_FAKE, so a backend never mistakes a fake for a GPU."""
    return bool(getattr(module, "MLA_TUNE_CPU_FAKE", False))


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds (for checks before any launch)."""
    if not condition:
        raise ValueError(message)


# ------------------------------------------------ variant parameter checks (backends' validate)
# Pure checks of names and values, no device and no vendor library: each backend's
# validate(variant) is built from these, and its build() calls validate() first. Every
# message is one sentence naming the backend, the parameter, the bad value and what is allowed.
def _shown_param(value: Any) -> str:
    if value is None:
        return "(missing)"
    try:
        return _param_text(value)
    except TypeError:
        return repr(value)


# Bounds of the launch parameters any GPU can run, for validate(): a table row beyond them
# (num_splits=1000000000) fails at load instead of at its first call's allocation.
PARAM_MAX_WARPS = 32  # 1024 threads per block (CUDA's and HIP's limit) / 32
PARAM_MAX_STAGES = 8  # software-pipelining depth; each stage holds a tile in shared memory
# Splits per sequence: a reduction reads every split's partial row at once, and no GPU
# has more than a few hundred SMs to spread them over.
PARAM_MAX_SPLITS = 256
PARAM_MAX_BLOCK_N = 256  # tokens per tile: a 256 x 576 bf16 tile alone fills shared memory


def check_param_names(variant: Variant, known: tuple | list, required: tuple | list = ()) -> None:
    """Refuse a parameter not in `known` and a missing one of `required`."""
    unknown = sorted(set(variant.p) - set(known))
    if unknown:
        raise ValueError(f"{variant.backend}: unknown parameter {', '.join(unknown)}; "
                         f"known: {', '.join(known)}")
    missing = [name for name in required if name not in variant.p]
    if missing:
        raise ValueError(f"{variant.backend}: missing parameter {', '.join(missing)}; "
                         f"{variant.backend} variants need {', '.join(required)}")


def check_param_choice(variant: Variant, name: str, allowed: tuple | list) -> Any:
    """The value of `name`, which must be one of `allowed` and of the same type (so
    true is not 1 and 1 is not 1.0); returns it."""
    value = variant.get(name)
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise ValueError(f"{variant.backend}: {name}={_shown_param(value)} is not allowed; "
                         f"allowed: {', '.join(_param_text(a) for a in allowed)}")
    return value


def check_param_int(variant: Variant, name: str, minimum: int = 1, maximum: int | None = None,
                    power_of_two: bool = False, allowed_too: tuple = ()) -> int:
    """The value of `name`, which must be an int (not a bool) in minimum..maximum (and a
    power of two if asked), or one of `allowed_too`; returns it."""
    value = variant.get(name)
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= minimum
          and (maximum is None or value <= maximum)
          and (not power_of_two or value & (value - 1) == 0))
    if not ok and not (isinstance(value, int) and not isinstance(value, bool) and value in allowed_too):
        kind = "a power of two" if power_of_two else "an int"
        bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        extra = "".join(f" or {a}" for a in allowed_too)
        raise ValueError(f"{variant.backend}: {name}={_shown_param(value)} is not allowed; "
                         f"{name} must be {kind} {bound}{extra}")
    return value


def check_q_amax(variant: Variant) -> None:
    """An fp8_static variant carries a calibrated q_amax, a finite number > 0; the
    parameter belongs to fp8_static variants only."""
    value = variant.get("q_amax")
    if variant.get("q") != "fp8_static":
        if value is not None:
            raise ValueError(f"{variant.backend}: q_amax={_shown_param(value)} is not allowed with "
                             f"q={_shown_param(variant.get('q'))}; only q=fp8_static carries a q_amax")
        return
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
            or not math.isfinite(value)):
        raise ValueError(f"{variant.backend}: q_amax={_shown_param(value)} is not allowed; "
                         "q=fp8_static needs a calibrated q_amax, a finite number > 0 (the sweep "
                         "calibrates it and adds it with variant.with_params(q_amax=...))")


def _core_inputs_fine(q, kv_data, qo_indptr, kv_indptr, kv_format: str) -> bool:
    """True when one decode call's inputs pass every check of check_decode_inputs: the
    common case, tested without building a single message (that costs tens of us a call)."""
    import torch

    try:
        batch = q.shape[0]
        if not (type(q) is torch.Tensor and q.dim() == 3 and q.shape[1] == NUM_HEADS
                and q.shape[2] == QK_DIM and q.dtype == torch.bfloat16 and batch >= 1
                and q.is_contiguous() and type(kv_data) is dict):
            return False
        entry = kv_data.get(kv_format)
        dev = q.device
        if kv_format == "bf16":
            kv = entry
            if not (type(kv) is torch.Tensor and kv.dtype == torch.bfloat16):
                return False
        elif kv_format == "fp8":
            if not (type(entry) in (tuple, list) and len(entry) == 2):
                return False
            kv, scale = entry
            if not (type(kv) is torch.Tensor and type(scale) is torch.Tensor
                    and kv.dtype in _core_fp8_dtypes() and scale.numel() == 1
                    and scale.dtype == torch.float32 and scale.device == dev):
                return False
        else:
            return False  # MXFP4 and anything else: the detailed path
        if not (kv.dim() == 3 and kv.shape[1] == NUM_KV_HEADS and kv.shape[2] == QK_DIM
                and kv.shape[0] >= 1 and kv.is_contiguous() and kv.device == dev):
            return False
        return all(type(ptr) is torch.Tensor and ptr.dtype == torch.int32 and ptr.dim() == 1
                   and ptr.shape[0] == batch + 1 and ptr.device == dev for ptr in (qo_indptr, kv_indptr))
    except (AttributeError, TypeError, IndexError, ValueError):
        return False


@functools.cache
def _core_fp8_dtypes() -> tuple:
    import torch

    return tuple(getattr(torch, name) for name in CORE_FP8_DTYPE_NAMES if hasattr(torch, name))


def check_decode_inputs(q, kv_data, qo_indptr, kv_indptr, kv_format: str) -> int:
    """Check shapes, dtypes, devices and layouts of one decode call; return batch size.

    Everything here reads tensor metadata only (no device sync), so it is cheap enough to
    run on every call; it raises ValueError naming what was expected before any kernel
    starts. Index *contents* are checked by `check_indptr_values`, which syncs. The common
    case (every check passes) is one predicate; the messages are built only on a failure.
    """
    if _core_inputs_fine(q, kv_data, qo_indptr, kv_indptr, kv_format):
        return q.shape[0]
    import torch

    require(isinstance(q, torch.Tensor), f"q must be a torch.Tensor, got {type(q).__name__}")
    require(
        q.dim() == 3 and q.shape[1] == NUM_HEADS and q.shape[2] == QK_DIM,
        f"q must have shape (batch, {NUM_HEADS}, {QK_DIM}), got {tuple(q.shape)}",
    )
    require(q.dtype == torch.bfloat16, f"q must be bfloat16, got {q.dtype}")
    require(q.is_contiguous(), "q must be contiguous; call q.contiguous() first")
    batch = q.shape[0]
    require(batch >= 1, "q holds no query (batch 0)")
    require(isinstance(kv_data, dict), "kv_data must be a dict keyed by KV format")
    require(kv_format in kv_data, f"kv_data lacks the {kv_format!r} entry this kernel reads")
    entry = kv_data[kv_format]
    if kv_format == "bf16":
        kv = entry
        require(isinstance(kv, torch.Tensor), 'kv_data["bf16"] must be a tensor')
        require(kv.dtype == torch.bfloat16, f'kv_data["bf16"] must be bfloat16, got {kv.dtype}')
        kv_dim = QK_DIM
    else:
        require(
            isinstance(entry, (tuple, list)) and len(entry) == 2,
            f'kv_data["{kv_format}"] must be a (tensor, scale) pair',
        )
        kv, scale = entry
        require(isinstance(kv, torch.Tensor),
                f'kv_data["{kv_format}"][0] must be a tensor, got {type(kv).__name__}')
        if kv_format == "fp8":
            # Bytes in another dtype (vLLM keeps fp8 caches as uint8) would be read as
            # numbers, not as fp8 codes: every output element wrong. So only a float8 dtype.
            require(str(kv.dtype).removeprefix("torch.") in CORE_FP8_DTYPE_NAMES,
                    f"fp8 KV must have an fp8 dtype (torch.float8_e4m3fn, or float8_e4m3fnuz on "
                    f"MI300), got {kv.dtype}; pass fp8 bytes held as {kv.dtype} as "
                    f"kv.view(torch.float8_e4m3fn)")
            require(isinstance(scale, torch.Tensor),
                    f"fp8 KV scale must be a (1,) float32 tensor on q's device, got "
                    f"{type(scale).__name__}; make it once with torch.tensor([scale], "
                    f"dtype=torch.float32, device=q.device)")
            require(
                scale.numel() == 1 and scale.dtype == torch.float32,
                f"fp8 KV scale must be one float32 value, got {scale.dtype} x {scale.numel()}",
            )
            kv_dim = QK_DIM
        else:
            require(kv.element_size() == 1, f"mxfp4 KV must be packed bytes, got {kv.dtype}")
            require(isinstance(scale, torch.Tensor),
                    f"mxfp4 scales must be a (total_kv, >= {MXFP4_SCALES}) tensor of E8M0 bytes, "
                    f"got {type(scale).__name__}")
            require(
                scale.dim() == 2 and scale.shape[0] >= kv.shape[0] and scale.shape[1] >= MXFP4_SCALES,
                f"mxfp4 scales must be (total_kv, >= {MXFP4_SCALES}), got {tuple(scale.shape)}",
            )
            require(scale.element_size() == 1, f"mxfp4 scales must be 1-byte E8M0, got {scale.dtype}")
            kv_dim = QK_DIM // 2
        require(scale.device == q.device, f"KV scale is on {scale.device}, q on {q.device}")
    require(
        kv.dim() == 3 and kv.shape[1] == NUM_KV_HEADS and kv.shape[2] == kv_dim,
        f'kv_data["{kv_format}"] must have shape (total_kv, 1, {kv_dim}), got {tuple(kv.shape)}',
    )
    require(kv.is_contiguous(), f'kv_data["{kv_format}"] must be contiguous')
    require(kv.device == q.device, f"KV is on {kv.device} but q is on {q.device}")
    require(kv.shape[0] >= 1, "the KV cache is empty: every sequence needs kv_len >= 1")
    for name, ptr in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
        require(isinstance(ptr, torch.Tensor), f"{name} must be a tensor")
        require(ptr.dtype == torch.int32, f"{name} must be int32, got {ptr.dtype}")
        require(
            ptr.dim() == 1 and ptr.shape[0] == batch + 1,
            f"{name} must have shape ({batch + 1},) for {batch} queries, got {tuple(ptr.shape)}",
        )
        require(ptr.device == q.device, f"{name} is on {ptr.device} but q is on {q.device}")
    return batch


def check_serving_spec(name: str, spec: CallSpec, capabilities: Capabilities,
                       variant: Variant | None = None) -> None:
    """Every backend's serving build and default: a spec its record serves and, given a
    variant, one of the spec's KV format (a ValueError naming the fix otherwise)."""
    reason = capabilities.refusal(spec)
    if reason is not None:
        raise ValueError(f"{name} cannot serve {spec}: {reason}; pick a backend that serves it")
    if variant is not None and variant.get("kv") != spec.kv_format:
        raise ValueError(f"{name}: {variant} reads {variant.get('kv')} KV but the call's cache is "
                         f"{spec.kv_format}; make the variant with kv={spec.kv_format}")


def tensor_sig_and_ptr(t) -> tuple:
    """(tensor_sig(t), t.data_ptr()) of a tensor, reading its address once."""
    ptr = t.data_ptr()
    return (t.dtype, t.shape, t.stride(), ptr % 16 == 0, t.get_device()), ptr


def tensor_sig(t):
    """What a compiled Triton launch saw of tensor t (None for None): dtype, shape, strides,
    whether its data_ptr is 16-byte aligned (Triton specializes pointers on it), device index."""
    return None if t is None else tensor_sig_and_ptr(t)[0]


def check_serving_layout(qo_indptr, kv, kv_indptr, block_table, seq_lens) -> int:
    """Shapes, dtypes and strides of the serving call's KV layout, for every kernel family
    that takes it (never values: that would read the device; the kernels read the index
    tensors element by element, so those must be contiguous); returns the page size, 0 for
    contiguous KV."""
    import torch

    batch = qo_indptr.shape[0] - 1
    if qo_indptr.dim() != 1 or batch < 1 or qo_indptr.dtype != torch.int32:
        raise ValueError(f"qo_indptr must be int32 (batch + 1,), got {qo_indptr.dtype} {tuple(qo_indptr.shape)}")
    for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("seq_lens", seq_lens)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (a strided view is read as if it were not): "
                             f"pass {name}.contiguous()")
    if not kv.is_contiguous() or kv.shape[-1] != QK_DIM:
        raise ValueError(f"kv must be contiguous with last dim {QK_DIM}, got {tuple(kv.shape)}")
    if (block_table is None) == (kv_indptr is None) or (block_table is None) != (seq_lens is None):
        raise ValueError("give kv_indptr (contiguous KV) or block_table and seq_lens (paged KV), not both")
    if kv_indptr is not None:
        if kv_indptr.shape != (batch + 1,) or kv_indptr.dtype != torch.int32:
            raise ValueError(f"kv_indptr must be int32 ({batch + 1},), got {kv_indptr.dtype} {tuple(kv_indptr.shape)}")
        return 0
    if kv.dim() != 3:
        raise ValueError(f"paged kv must be (num_pages, page_size, {QK_DIM}), got {tuple(kv.shape)}")
    page_size = kv.shape[1]
    if page_size > 128 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two up to 128, got {page_size}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 ({batch}, max_pages), got {block_table.dtype} {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table rows must be contiguous (stride 1 along max_pages)")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 ({batch},), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    return page_size


def check_indptr_values(qo_indptr, kv_indptr, total_kv: int) -> list[int]:
    """Read kv_indptr on the host and check it; return the per-sequence kv lengths.

    This copies two small tensors to the host (a device sync); callers that must not sync
    (the leaderboard entry point) skip it and trust the config's uniform kv_seq_len.
    """
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    require(qo == list(range(len(qo))), f"qo_indptr must be 0,1,2,... (one query each), got {qo[:8]}")
    require(kv[0] == 0, f"kv_indptr must start at 0, got {kv[0]}")
    lengths = [b - a for a, b in zip(kv, kv[1:], strict=False)]
    require(min(lengths) >= 1, f"every sequence needs kv_len >= 1; kv_indptr gives {min(lengths)}")
    require(
        kv[-1] == total_kv,
        f"kv_indptr ends at {kv[-1]} but the KV cache holds {total_kv} tokens",
    )
    return lengths
