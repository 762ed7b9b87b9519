"""What GPU and software this process runs on: the platform and the table's provenance."""

from __future__ import annotations

import dataclasses
import os
import platform as _pyplatform
import re
import subprocess
from dataclasses import dataclass, field

import torch
import triton

_NAME_RE = re.compile(r"\b(H\d{3}|B\d{3}|A\d{2,3}|L\d{2}S?|MI\d{3}[A-Z]*)\b")
_ARCH_NAMES = {"gfx950": "MI355X", "gfx942": "MI300X"}

# FOR TESTS ONLY. MLA_TUNE_FAKE_PLATFORM=NAME makes detect() report a simulated NAME
# platform (see simulated_platform), so that a CPU-only test can run the sweep, the
# runtime and the export for that GPU end to end, e.g. the AITER path through
# tests/fakes/aiter as an MI355X. Sweep workers are spawned processes and inherit it.
# A simulated platform can never pass for the real one: its device_name ends with
# SIMULATED_SUFFIX (which the sweep prints and the table's provenance records), its
# driver says "simulated", and has_gpu is False, so the sweep keeps the CPU timer and
# says so in its header. Never set it outside tests.
FAKE_PLATFORM_ENV = "MLA_TUNE_FAKE_PLATFORM"
SIMULATED_SUFFIX = " (simulated)"


def canonical_gpu_name(device_name: str, arch: str = "") -> str:
    """'NVIDIA H200' -> 'H200', 'AMD Instinct MI355X' -> 'MI355X'; unknown names are
    returned with spaces replaced, so a table file name never holds a '/' or a space."""
    match = _NAME_RE.search(device_name.upper())
    if match:
        return match.group(1)
    if arch.split(":")[0] in _ARCH_NAMES:
        return _ARCH_NAMES[arch.split(":")[0]]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip()) or "unknown"


def canonical_name_known(device_name: str) -> bool:
    """Whether canonical_gpu_name recognizes this name (rather than passing it through)."""
    return _NAME_RE.search(device_name.upper()) is not None


@dataclass(frozen=True)
class Platform:
    """The device a sweep or runtime sees. `name` is canonical ('H200'); CPU gives 'cpu'."""

    name: str
    device_name: str
    arch: str
    is_hip: bool
    sm_count: int
    driver: str = ""
    versions: dict = field(default_factory=dict, compare=False, hash=False)
    simulated: bool = False  # set only by the FAKE_PLATFORM_ENV testing hook
    smem_per_sm: int = 0  # shared memory per SM in bytes, as the device reports it (0: unknown)
    lds_bytes: int = 0  # one kernel's shared memory / LDS limit, from KNOWN_GPUS (0: unknown)

    @property
    def tags(self) -> frozenset[str]:
        """What a backend's Capabilities.platforms are matched against: "cpu", or "cuda" /
        "hip" with the arch ("sm_90", "gfx950"); a simulated platform has its GPU's tags."""
        if self.name == "cpu":
            return frozenset({"cpu"})
        return frozenset({"hip" if self.is_hip else "cuda", self.arch})

    @property
    def has_gpu(self) -> bool:
        """Whether kernels run on a GPU here; False on the CPU and on a simulated platform."""
        return self.name != "cpu" and not self.simulated


def software_versions() -> dict:
    """The versions a table's provenance records: python, torch, triton, CUDA or HIP, and
    each backend's vendor distribution (its CAPABILITIES.vendor) that is installed."""
    from mla_tune.backends import vendor_distributions

    versions = {
        "python": _pyplatform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda or "",
        "hip": torch.version.hip or "",
    }
    from importlib import metadata

    for dist in vendor_distributions():
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    # the aiter this process would import (a source tree's or a dev build's version, which
    # its distribution may not carry) and, where found, its git commit, without importing it
    from mla_tune.backends.aiter_mla import aiter_provenance

    versions.update(aiter_provenance())
    return versions


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return torch.version.hip or ""


def detect(device: int | None = None) -> Platform:
    """The platform of `device` (default: the current one), or a CPU platform; with
    MLA_TUNE_FAKE_PLATFORM set (tests only), the simulated platform it names."""
    fake = os.environ.get(FAKE_PLATFORM_ENV, "").strip()
    if fake:
        return simulated_platform(fake)
    if not torch.cuda.is_available():
        return Platform("cpu", "cpu", "cpu", False, 0, "", software_versions())
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    is_hip = bool(torch.version.hip)
    arch = getattr(props, "gcnArchName", "") if is_hip else f"sm_{props.major}{props.minor}"
    return Platform(
        name=canonical_gpu_name(props.name, arch),
        device_name=props.name,
        arch=arch,
        is_hip=is_hip,
        sm_count=props.multi_processor_count,
        driver=_driver_version(),
        versions=software_versions(),
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0),  # torch >= 2.7
        lds_bytes=_known_lds(canonical_gpu_name(props.name, arch)),
    )


def _known_lds(name: str) -> int:
    facts = KNOWN_GPUS.get(name)
    return facts.lds_bytes if facts is not None else 0


@dataclass(frozen=True)
class GpuFacts:
    """What a sweep, a dry run or a cross-compile needs to know of a GPU it does not have.

    `arch` is Triton's target ("sm_90", "gfx950"); `sm_count` the SMs (CUDA) or CUs (HIP);
    `warp_size` the threads of a warp or wavefront; `lds_bytes` the most shared memory (LDS)
    one kernel may use, the limit Triton's driver checks at load; `config` the default search
    space, a file name under configs/; `image_triton` the Triton version of the image that GPU
    runs mla-tune in where it is known (the contest's MI355X runner, the lent H200), else "".
    """

    device_name: str
    arch: str
    is_hip: bool
    sm_count: int
    warp_size: int
    lds_bytes: int
    config: str
    image_triton: str = ""


# The GPUs a sweep can be planned for without them. The one place the package states a
# GPU's SM count; everything else asks the device (core.device_sm_count) or a Platform.
KNOWN_GPUS = {
    "H200": GpuFacts("NVIDIA H200", "sm_90", False, 132, 32, 232448, "leaderboard.yaml", "3.6.0"),
    "H100": GpuFacts("NVIDIA H100", "sm_90", False, 132, 32, 232448, "leaderboard.yaml"),
    "MI355X": GpuFacts("AMD Instinct MI355X", "gfx950", True, 256, 64, 163840, "mi355x.yaml", "3.6.0"),
    "MI300X": GpuFacts("AMD Instinct MI300X", "gfx942", True, 304, 64, 65536, "mi355x.yaml"),
}
# An unknown name is planned as a CUDA GPU of unknown arch with an H200's SM count.
_UNKNOWN_GPU_SMS = KNOWN_GPUS["H200"].sm_count
DEFAULT_CONFIG = "leaderboard.yaml"


def default_config(name: str) -> str:
    """The default search space of GPU `name`: its KNOWN_GPUS config, a path under configs/
    ("configs/mi355x.yaml"); configs/leaderboard.yaml for a GPU mla-tune does not know."""
    facts = KNOWN_GPUS.get(name)
    return f"configs/{facts.config if facts else DEFAULT_CONFIG}"


def fake_platform(name: str = "H200") -> Platform:
    """A platform for planning without that GPU (--dry-run, tests)."""
    facts = KNOWN_GPUS.get(name)
    if facts is None:
        return Platform(name, name, "unknown", False, _UNKNOWN_GPU_SMS, "", software_versions())
    return Platform(name, facts.device_name, facts.arch, facts.is_hip, facts.sm_count, "",
                    software_versions(), lds_bytes=facts.lds_bytes)


def simulated_platform(name: str) -> Platform:
    """FOR TESTS ONLY (what detect() returns under MLA_TUNE_FAKE_PLATFORM=NAME): NAME's
    planning platform, marked so that nothing made with it passes for the real GPU."""
    base = fake_platform(name)
    return dataclasses.replace(base, device_name=base.device_name + SIMULATED_SUFFIX,
                               driver="simulated", simulated=True)


def quick_device_name() -> str | None:
    """This machine's first GPU's name without starting CUDA (nvidia-smi, amd-smi/rocm-smi,
    /proc/driver/nvidia), "cpu" when it plainly has none (no /dev/nvidia0, no /dev/kfd),
    None when it cannot tell. For refusing a sweep for another GPU before any worker
    starts; the worker's full detect() stays the authority."""
    fake = os.environ.get(FAKE_PLATFORM_ENV, "").strip()
    if fake:
        return simulated_platform(fake).device_name
    commands = (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                ["amd-smi", "static", "--asic", "--csv"], ["rocm-smi", "--showproductname", "--csv"])
    for command in commands:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            for line in out.stdout.splitlines():
                if _NAME_RE.search(line.upper()) or any(a in line for a in _ARCH_NAMES):
                    return line.strip()
    try:
        for info in sorted(os.listdir("/proc/driver/nvidia/gpus")):
            with open(f"/proc/driver/nvidia/gpus/{info}/information") as f:
                for line in f:
                    if line.startswith("Model:"):
                        return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if not os.path.exists("/dev/nvidia0") and not os.path.exists("/dev/kfd"):
        return "cpu"
    return None
