"""The PTX digest of gluon_fused's captured launches, compiled for sm_90 with this Triton.

    TRITON_DISABLE_LINE_INFO=1 PYTHONPATH=. python scripts/gluon_ptx_digest.py [VARIANT ...]

Prints one line per launch: variant, kernel, shared bytes, sha1 of the PTX (first 12 hex).
Line info is off so that a change that only moves source lines leaves the digest alone.
Run it on two trees with the same Triton to see whether a source change changed the code
(docs/perf.md, "Gluon on Triton 3.9"); the cubin is no digest: ptxas output differs between
runs of the same PTX. Shapes: 4 x 1024 (a leaderboard shape every default variant fits).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is no package of the install

from mla_tune.core import Shape, Variant  # noqa: E402
from tests.test_gluon_compile import capture_launches, compile_sm90  # noqa: E402

DEFAULT_VARIANTS = [
    "gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=2,q=fp8_dynamic,v_path=rs8)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=1,num_stages=3,q=fp8_dynamic,v_path=ss16)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=2,q=fp8_dynamic,v_path=ss16a,reduce=spin)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=2,num_stages=3,q=fp8_dynamic,v_path=rs16,ws=1)",
    "gluon_fused(block_n=64,kv=fp8,num_splits=2,num_stages=3,q=fp8_dynamic,v_path=ss16,ws=2)",
    "gluon_fused(block_n=128,kv=fp8,num_splits=1,num_stages=2,q=fp8_dynamic,v_path=ss16)",
]


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter's jit functions cannot be compiled", file=sys.stderr)
        return 2
    import triton

    print(f"triton {triton.__version__}, line info {'off' if os.environ.get('TRITON_DISABLE_LINE_INFO') else 'ON'}")
    for text in argv or DEFAULT_VARIANTS:
        for kernel, _grid, args, kwargs in capture_launches(Variant.parse(text), Shape(4, 1024)):
            compiled = compile_sm90(kernel, args, kwargs)
            digest = hashlib.sha1(compiled.asm["ptx"].encode()).hexdigest()[:12]
            print(f"{text} {kernel.fn.__name__} shared={compiled.metadata.shared} ptx={digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
