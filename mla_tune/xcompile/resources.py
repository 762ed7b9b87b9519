"""What a compiled kernel uses, read from the compiler's own output without a GPU.

AMD (`asm["amdgcn"]`): `.vgpr_count` (arch VGPRs + AGPRs, gfx90a+'s unified 512-entry
file), `; NumVgprs`, `; NumAgprs`, `.sgpr_count`, `.private_segment_fixed_size` (scratch
per lane: spills), LLVM's `; Occupancy`, the `v_mfma` / `v_smfmac` lines. CUDA: the
`ptxas -v` log (registers, spill stores and loads, stack) and the `mma.sync` / `wgmma`
lines of the PTX. Shared memory (LDS) comes from the kernel's metadata (`shared`): the
static `.group_segment_fixed_size` is 0 for Triton's kernels, whose LDS is dynamic.

Occupancy:
- AMD: waves per SIMD = min(8, 512 // roundup8(vgpr_count)), and no more than the LDS of a
  CU holds (workgroups of `num_warps` waves over 4 SIMDs).
- CUDA: CTAs per SM = the fewest of what the registers (65536 per SM, 256-register
  allocation per warp), shared memory (plus 1 KiB reserved per CTA), 64 warps and 32 CTAs
  allow; warps per SM = CTAs x num_warps.
"""

from __future__ import annotations

import hashlib
import re

AMD_VGPR_FILE = 512  # per SIMD lane, arch VGPRs and AGPRs together (gfx90a and later)
AMD_MAX_WAVES = 8  # per SIMD
AMD_SIMDS_PER_CU = 4
CUDA_REGS_PER_SM = 65536
CUDA_MAX_WARPS_PER_SM = 64
CUDA_MAX_CTAS_PER_SM = 32
CUDA_SMEM_RESERVED_PER_CTA = 1024
# Shared memory one SM holds, by arch (the per-kernel limit is GpuFacts.lds_bytes).
SMEM_PER_SM = {"sm_90": 233472, "gfx950": 163840, "gfx942": 65536}

_AMD_FIELDS = {
    "vgprs": re.compile(r"^\s*\.vgpr_count:\s*(\d+)", re.M),
    "arch_vgprs": re.compile(r";\s*NumVgprs:\s*(\d+)"),
    "agprs": re.compile(r";\s*NumAgprs:\s*(\d+)"),
    "sgprs": re.compile(r"^\s*\.sgpr_count:\s*(\d+)", re.M),
    "scratch": re.compile(r"^\s*\.private_segment_fixed_size:\s*(\d+)", re.M),
    "llvm_occupancy": re.compile(r";\s*Occupancy:\s*(\d+)"),
}
_AMD_MMA = re.compile(r"^\s*(v_mfma\w*|v_smfmac\w*)", re.M)
_PTX_MMA = re.compile(r"^\s*((?:mma\.sync|wgmma\.mma_async)[\w.]*)", re.M)
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _first_int(pattern: re.Pattern, text: str) -> int | None:
    match = pattern.search(text)
    return int(match.group(1)) if match else None


def instruction_lines(text: str, comment: str) -> list[str]:
    """The instruction lines of an assembly listing: no comments, directives, labels or
    blank lines, so two listings of the same code compare equal whatever their metadata."""
    out = []
    for raw in text.splitlines():
        line = raw.split(comment, 1)[0].strip()
        if not line or line.startswith(".") or line.endswith(":") or line in ("{", "}"):
            continue
        out.append(line)
    return out


def code_sha(text: str, comment: str) -> str:
    """A SHA-256 of the listing's instruction lines (`instruction_lines`)."""
    return hashlib.sha256("\n".join(instruction_lines(text, comment)).encode()).hexdigest()


def _counts(pattern: re.Pattern, text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in pattern.findall(text):
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def amd_resources(amdgcn: str, shared: int, num_warps: int, arch: str) -> dict:
    """Registers, scratch, LDS, MMA count and waves per SIMD of an AMD kernel's listing."""
    found = {name: _first_int(pattern, amdgcn) for name, pattern in _AMD_FIELDS.items()}
    vgprs = found["vgprs"] or 0
    waves = min(AMD_MAX_WAVES, AMD_VGPR_FILE // max(8, -(-vgprs // 8) * 8))
    lds_per_cu = SMEM_PER_SM.get(arch, 0)
    if shared and lds_per_cu:  # workgroups the CU's LDS holds, their waves shared by 4 SIMDs
        waves = min(waves, (lds_per_cu // shared) * num_warps // AMD_SIMDS_PER_CU)
    mma = _counts(_AMD_MMA, amdgcn)
    return {
        "vgprs": vgprs, "arch_vgprs": found["arch_vgprs"], "agprs": found["agprs"],
        "sgprs": found["sgprs"], "scratch": found["scratch"] or 0, "lds": shared,
        "mma": sum(mma.values()), "mma_ops": mma, "waves_per_simd": waves,
        "llvm_occupancy": found["llvm_occupancy"], "num_warps": num_warps,
        "sha": code_sha(amdgcn, ";"),
    }


def cuda_ctas_per_sm(regs: int, shared: int, num_warps: int, arch: str) -> int:
    """CTAs of a CUDA kernel one SM holds: the fewest of what its registers per thread
    (allocated 256 a warp), its shared memory (plus 1 KiB reserved a CTA), 64 warps and 32
    CTAs allow."""
    warp_regs = -(-regs * 32 // 256) * 256
    ctas = min(CUDA_MAX_CTAS_PER_SM, CUDA_MAX_WARPS_PER_SM // num_warps)
    if warp_regs:
        ctas = min(ctas, (CUDA_REGS_PER_SM // warp_regs) // num_warps)
    smem = SMEM_PER_SM.get(arch, 0)
    if shared and smem:
        ctas = min(ctas, smem // (shared + CUDA_SMEM_RESERVED_PER_CTA))
    return ctas


def cuda_resources(ptxas_log: str, ptx: str, shared: int, num_warps: int, arch: str) -> dict:
    """Registers, spills, shared memory, MMA count and CTAs / warps per SM of a CUDA kernel."""
    regs = _first_int(_PTXAS_REGS, ptxas_log) or 0
    spill = _PTXAS_SPILL.search(ptxas_log)
    stack, stores, loads = (int(g) for g in spill.groups()) if spill else (0, 0, 0)
    ctas = cuda_ctas_per_sm(regs, shared, num_warps, arch)
    mma = _counts(_PTX_MMA, ptx)
    return {
        "registers": regs, "scratch": stores, "spill_loads": loads, "stack": stack, "lds": shared,
        "mma": sum(mma.values()), "mma_ops": mma, "ctas_per_sm": ctas,
        "warps_per_sm": ctas * num_warps, "num_warps": num_warps, "sha": code_sha(ptx, "//"),
    }
