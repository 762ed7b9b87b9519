"""A fake whose Triton kernel stores far out of bounds: on a GPU the store faults ("an
illegal memory access was encountered"), which poisons the worker's CUDA context, so the
sweep must record the candidate and go on with a fresh worker (tests/test_crash_resume.py).

The store lands FAR_BYTES past the output buffer. Every CUDA address of this process lies
in the user half of the 47-bit address space, so pointer + 2**47 bytes lies in
[2**47, 2**48), mapped by nothing (device or, through HMM, host): the fault is certain and
writes nothing. Never on the CPU, where TRITON_INTERPRET=1's store would hit a wild host
address (a segfault or silent memory corruption): unavailable_reason() and build() refuse.

Space: `batches` (optional list of batch sizes): offer the variant at these batches only.
"""

import os

import torch
import triton
import triton.language as tl

from mla_tune.core import NUM_HEADS, V_DIM, Shape, Variant

NAME = "fake_oob"
FAR_BYTES = 1 << 47
_OOB_BLOCK = 16


@triton.jit
def _oob_store_kernel(Out, far_index, BLOCK: tl.constexpr):
    offs = far_index + tl.arange(0, BLOCK)
    tl.store(Out + offs, tl.zeros([BLOCK], dtype=tl.float32).to(Out.dtype.element_ty))


def oob_store(out: torch.Tensor, element_offset: int) -> None:
    """Store BLOCK zeros at out[element_offset:...]. In bounds (element_offset 0) this is a
    harmless kernel that tests may run under the interpreter; the runner passes FAR_BYTES."""
    _oob_store_kernel[(1,)](out, element_offset, BLOCK=_OOB_BLOCK)


def unavailable_reason() -> str | None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available():
        return (
            "fake_oob needs a CUDA GPU: its kernel stores 2**47 bytes out of bounds on purpose, "
            "which on the CPU (Triton's interpreter) would segfault or corrupt memory; "
            "run it on a GPU machine without TRITON_INTERPRET"
        )
    return None


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    batches = (space or {}).get("batches")
    return [Variant.make(NAME, kv="bf16", q="bf16")] if batches is None or shape.batch in batches else []


def build(variant: Variant, shape: Shape, device):
    device = torch.device(device)
    reason = unavailable_reason()
    if device.type != "cuda" or reason:
        raise RuntimeError(reason or f"fake_oob runs on a CUDA device only, not {device}")
    out = torch.zeros((shape.batch, NUM_HEADS, V_DIM), dtype=torch.bfloat16, device=device)
    far_elements = FAR_BYTES // out.element_size()

    def run_fake_oob(q, kv_data, qo_indptr, kv_indptr):
        oob_store(out, far_elements)
        torch.cuda.synchronize(device)  # the fault surfaces here, as an error naming itself
        return out

    return run_fake_oob
