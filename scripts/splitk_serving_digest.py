"""Digests of the split-K serving kernels' code (kernels/flash_decode.py's
flash_decode_serving), compiled for sm_90 (PTX) and gfx950 (amdgcn) with this Triton.

    TRITON_DISABLE_LINE_INFO=1 PYTHONPATH=. python scripts/splitk_serving_digest.py [--lse]

Each case builds the triton backend's serving runner (build_serving) on the meta device,
calls it once at a small batch with its launches captured (mla_tune.xcompile.capture), and
compiles each launch for both targets (mla_tune.xcompile.targets.bind): one line per launch,
case, kernel, target and the sha1 (first 12 hex) of the PTX or amdgcn. Line info is off, so
a change that only moves source lines leaves the digests alone. Run it on two trees with one
Triton to see whether a source change changed the code of a launch; --lse builds the
runners with CallSpec(return_lse=True) instead (the WITH_LSE kernels).
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch

CASES = [  # (KV format, max_q_len, max_splits): one split only, several, q_len 2
    ("bf16", 1, 1),
    ("bf16", 1, 8),
    ("fp8", 1, 8),
    ("fp8", 2, 4),
]


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter's jit functions cannot be compiled", file=sys.stderr)
        return 2
    import triton

    from mla_tune import gpu
    from mla_tune.backends import get_backend
    from mla_tune.core import QK_DIM, CallSpec
    from mla_tune.xcompile import capture, targets

    lse = "--lse" in argv
    backend = get_backend("triton")
    meta = capture.META
    print(f"triton {triton.__version__}, line info {'off' if os.environ.get('TRITON_DISABLE_LINE_INFO') else 'ON'}"
          f", return_lse {lse}")
    for name in ("H200", "MI355X"):
        facts = gpu.KNOWN_GPUS[name]
        target = targets.target_for(facts)
        fp8 = capture.fp8_dtype(facts)
        with capture.recording(facts) as launches:
            for kv_format, q_len, max_splits in CASES:
                launches.clear()
                spec = CallSpec(kv_format, page_size=64, heads=16, max_q_len=q_len, return_lse=lse)
                variant = backend.default_serving_variant(spec, gpu.fake_platform("H200")).with_params(
                    max_splits=max_splits, dot_dtype="bf16")
                runner = backend.build_serving(variant, spec, meta)
                batch = 4
                q = torch.empty((batch * q_len, 16, QK_DIM), dtype=torch.bfloat16, device=meta)
                kv = torch.empty((64, 64, QK_DIM), dtype=torch.bfloat16 if kv_format == "bf16" else fp8, device=meta)
                scale = None if kv_format == "bf16" else torch.empty(1, dtype=torch.float32, device=meta)
                qo = torch.empty(batch + 1, dtype=torch.int32, device=meta)
                runner(q, qo, kv, scale, block_table=torch.empty((batch, 16), dtype=torch.int32, device=meta),
                       seq_lens=torch.empty(batch, dtype=torch.int32, device=meta))
                for launch in launches:
                    b = targets.bind(launch.kernel, launch.grid, launch.args, launch.kwargs, target)
                    compiled = triton.compile(b.src, target=b.target, options=b.options.__dict__)
                    text = compiled.asm["ptx" if target.backend == "cuda" else "amdgcn"]
                    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
                    print(f"{kv_format} q{q_len} s{max_splits} {b.name} {target.backend}:{target.arch} {digest}",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
