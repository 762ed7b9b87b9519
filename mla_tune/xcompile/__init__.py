"""Cross-compiling the sweep's plan for a GPU this machine does not have (`mla-tune compile`).

- `capture.py`: the Triton launches each candidate makes, captured from its backend's real
  launch path on the meta device (and kernels/q_quant.py's, which FlashMLA and the runtime use);
- `targets.py`: a launch bound for the target's Triton backend (GPUTarget from gpu.KNOWN_GPUS)
  as Triton's JIT would bind it, its binary key, and the compile;
- `resources.py`: registers, scratch (spills), LDS / shared memory, MMA count and occupancy
  read from the compiler's output (amdgcn listing; ptxas log and PTX);
- `check.py`: the whole check of a plan (parallel processes, a cache by binary key), the
  candidates the plan drops and why, and the same check under another Python (`--triton`);
- `report.py`: the check as 80-column text, Markdown (docs/compile.md) or JSON.
"""
