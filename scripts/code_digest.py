"""Digests of the code Triton compiles for mla-tune's own kernels, with this Triton: has a
source change changed the code of a launch?

    TRITON_DISABLE_LINE_INFO=1 PYTHONPATH=. python scripts/code_digest.py gluon [VARIANT ...]
    TRITON_DISABLE_LINE_INFO=1 PYTHONPATH=. python scripts/code_digest.py splitk-serving [--lse]

- `gluon`: gluon_fused's leaderboard launches at 4 x 1024 (a shape every default variant
  fits), for the variants below or those named, compiled for sm_90 (PTX).
- `splitk-serving`: the split-K serving runner (the triton backend's build_serving, pages
  of 64, 16 heads, a batch of 4) at four cases: one split, several, fp8 KV, q_len 2;
  compiled for sm_90 (PTX) and gfx950 (amdgcn). `--lse`: CallSpec(return_lse=True), the
  WITH_LSE kernels.

Each launch is built through its backend on the meta device and captured, as `mla-tune
compile` captures it (mla_tune.xcompile.capture), then bound and compiled for the target
(mla_tune.xcompile.targets). One line per launch: the case, the kernel, the target, the
shared bytes and the sha1 of the PTX or amdgcn (first 12 hex). Line info is off, so a change
that only moves source lines leaves the digests alone. Run it on two trees with the same
Triton and compare; the cubin is no digest (ptxas output differs between runs of the same
PTX). Needs a process without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

GLUON_VARIANTS = [
    "gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=2,q=fp8_dynamic,v_path=rs8)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=1,num_stages=3,q=fp8_dynamic,v_path=ss16)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=2,q=fp8_dynamic,v_path=ss16a,reduce=spin)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=2,num_stages=3,q=fp8_dynamic,v_path=rs16,ws=1)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=2,num_stages=3,q=fp8_dynamic,v_path=ss16,ws=2)",
    "gluon_fused(block_n=128,kv=fp8,num_splits=1,num_stages=2,q=fp8_dynamic,v_path=ss16)",
]
SPLITK_CASES = [  # (KV format, max_q_len, max_splits): one split only, several, q_len 2
    ("bf16", 1, 1),
    ("bf16", 1, 8),
    ("fp8", 1, 8),
    ("fp8", 2, 4),
]


def _print_digests(case: str, launches: list, target) -> None:
    """Bind, compile and print one line per captured launch."""
    from mla_tune.xcompile import targets

    for launch in launches:
        b = targets.bind(launch.kernel, launch.grid, launch.args, launch.kwargs, target)
        compiled = targets.compile_binary(b)
        text = compiled.asm["ptx" if target.backend == "cuda" else "amdgcn"]
        digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        print(f"{case} {b.name} {target.backend}:{target.arch} shared={compiled.metadata.shared} {digest}",
              flush=True)


def gluon(variants: list[str]) -> int:
    from mla_tune import gpu
    from mla_tune.core import Shape, Variant
    from mla_tune.xcompile import capture, targets

    facts = gpu.KNOWN_GPUS["H200"]
    target = targets.target_for(facts)
    failed = 0
    with capture.recording(facts) as launches:
        for text in variants or GLUON_VARIANTS:
            item = capture.capture_candidate(Variant.parse(text), Shape(4, 1024), facts, launches)
            if item.error:
                print(f"{text} {item.error}", flush=True)
                failed += 1
                continue
            _print_digests(text, item.launches, target)
    return 1 if failed else 0


def splitk_serving(lse: bool) -> int:
    import torch

    from mla_tune import gpu
    from mla_tune.backends import get_backend
    from mla_tune.core import QK_DIM, CallSpec
    from mla_tune.xcompile import capture, targets

    backend, meta, batch = get_backend("triton"), capture.META, 4
    for name in ("H200", "MI355X"):
        facts = gpu.KNOWN_GPUS[name]
        fp8 = capture.fp8_dtype(facts)
        with capture.recording(facts) as launches:
            for kv_format, q_len, max_splits in SPLITK_CASES:
                launches.clear()
                spec = CallSpec(kv_format, page_size=64, heads=16, max_q_len=q_len, return_lse=lse)
                variant = backend.default_serving_variant(spec, gpu.fake_platform("H200")).with_params(
                    max_splits=max_splits, dot_dtype="bf16")
                runner = backend.build_serving(variant, spec, meta)
                q = torch.empty((batch * q_len, 16, QK_DIM), dtype=torch.bfloat16, device=meta)
                kv = torch.empty((64, 64, QK_DIM), dtype=torch.bfloat16 if kv_format == "bf16" else fp8, device=meta)
                scale = None if kv_format == "bf16" else torch.empty(1, dtype=torch.float32, device=meta)
                qo = torch.empty(batch + 1, dtype=torch.int32, device=meta)
                runner(q, qo, kv, scale, block_table=torch.empty((batch, 16), dtype=torch.int32, device=meta),
                       seq_lens=torch.empty(batch, dtype=torch.int32, device=meta))
                _print_digests(f"{kv_format} q{q_len} s{max_splits}", list(launches), targets.target_for(facts))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="family", required=True)
    g = sub.add_parser("gluon", help="gluon_fused's leaderboard launches, sm_90 PTX")
    g.add_argument("variants", nargs="*", help="gluon_fused variants (default: the six in the script)")
    s = sub.add_parser("splitk-serving", help="the split-K serving kernels, sm_90 PTX and gfx950 amdgcn")
    s.add_argument("--lse", action="store_true", help="the runners with CallSpec(return_lse=True)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter's jit functions cannot be compiled", file=sys.stderr)
        return 2
    import triton

    print(f"triton {triton.__version__}, line info {'off' if os.environ.get('TRITON_DISABLE_LINE_INFO') else 'ON'}"
          + (f", return_lse {args.lse}" if args.family == "splitk-serving" else ""))
    return gluon(args.variants) if args.family == "gluon" else splitk_serving(args.lse)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
