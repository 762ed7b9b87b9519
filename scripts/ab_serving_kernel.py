"""Versions of the serving split-K kernel (`flash_decode_serving`) side by side on one GPU.

    git show f6dc9ae:mla_tune/kernels/flash_decode.py > scratch/fd_old.py   # before the run
    PYTHONPATH=. python scripts/ab_serving_kernel.py old=scratch/fd_old.py \
        new=mla_tune/kernels/flash_decode.py [--cases 0,2] [--out DIR]

Each NAME=PATH is a copy of kernels/flash_decode.py, imported as its own module (the device
machine gets the working tree without git history: write old versions into files first).
Per case, each version's answer is checked against mla_tune.serving.inputs' fp32 reference
(relative L2 error under 1e-2), then timed: CUDA events around 30 back-to-back calls
(stage 1 and stage 2, warm L2), 5 rounds, the median and the spread. A kernel A/B, not
the leaderboard protocol: ratios between versions, in one process, are what it is for.
`--smoke` runs tiny cases under TRITON_INTERPRET=1 on the CPU (checks only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

from mla_tune.serving import inputs as serving

# name, heads, q_len, KV format, kv_lens, launch options
CASES = [
    ("128h bf16 q1 32 x ~4000, 64 rows", 128, 1, "bf16", [3980 + i for i in range(32)],
     dict(block_h=64, block_n=64, num_warps=8, num_stages=2, max_splits=64, tokens_per_split=512)),
    ("128h fp8 q4 256 x 512, 64 rows", 128, 4, "fp8", [512] * 256,
     dict(block_h=16, block_n=64, num_warps=8, num_stages=2, max_splits=17, tokens_per_split=512)),
    ("16h fp8 q1 4501/2796/56221", 16, 1, "fp8", [4501, 2796, 56221],
     dict(block_h=16, block_n=32, num_warps=4, num_stages=2, max_splits=64, tokens_per_split=256)),
    ("16h fp8 q4 256 x 512", 16, 4, "fp8", [512] * 256,
     dict(block_h=16, block_n=64, num_warps=8, num_stages=2, max_splits=64, tokens_per_split=512)),
    ("16h bf16 q1 32 x ~4000", 16, 1, "bf16", [3980 + i for i in range(32)],
     dict(block_h=16, block_n=64, num_warps=4, num_stages=2, max_splits=64, tokens_per_split=512)),
    ("16h fp8 q4 9 ragged", 16, 4, "fp8", [1141, 34932, 2000, 5000, 8000, 12000, 20000, 3000, 20000],
     dict(block_h=16, block_n=64, num_warps=8, num_stages=2, max_splits=64, tokens_per_split=512)),
]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(f"ab_{name}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}: is it a copy of mla_tune/kernels/flash_decode.py?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    if not hasattr(module, "flash_decode_serving"):
        raise SystemExit(f"{path} has no flash_decode_serving: not a copy of kernels/flash_decode.py")
    return module


def _smoke(case):
    name, heads, q_len, kv, lens, opts = case
    return (name, heads, q_len, kv, [min(n, 40) for n in lens[:3]],
            dict(opts, block_h=16, block_n=16, num_warps=4, num_stages=1, tokens_per_split=16))


def run_case(case, versions: dict, device: str, smoke: bool) -> dict:
    name, heads, q_len, kv, lens, opts = case
    inp = serving.make_input([q_len] * len(lens), lens, heads, 16 if smoke else 64, kv, seed=5, device=device)
    ref = inp.reference()
    result = {}
    for vname, module in versions.items():
        ws = module.FlashDecodeServingWorkspace.allocate(inp.q.shape[0], heads, opts["max_splits"], device,
                                                         max_q_len=q_len)
        out = torch.empty((inp.q.shape[0], heads, 512), dtype=torch.bfloat16, device=device)

        def call(module=module, ws=ws, out=out):
            module.flash_decode_serving(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, out, **inp.layout,
                                        max_q_len=q_len, dot_dtype="fp16" if smoke else "bf16",
                                        workspace=ws, **opts)

        call()
        if not smoke:
            torch.cuda.synchronize()
        err = float((out.float() - ref).norm() / ref.norm())
        entry = {"rel_err": err, "ok": err < 1e-2}
        if not smoke and entry["ok"]:
            rounds = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(30):
                    call()
                end.record()
                end.synchronize()
                rounds.append(start.elapsed_time(end) * 1000 / 30)
            entry.update(us=statistics.median(rounds), spread=(max(rounds) - min(rounds)) / statistics.median(rounds))
        result[vname] = entry
        print(f"{name}: {vname} {entry}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="+", metavar="NAME=PATH", help="a copy of kernels/flash_decode.py")
    parser.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                        help=f"indices into the case list (0-{len(CASES) - 1})")
    parser.add_argument("--smoke", action="store_true", help="tiny cases on the CPU interpreter, checks only")
    parser.add_argument("--out", type=Path, default=None, help="write ab_serving_kernel.json here")
    args = parser.parse_args()
    versions = {}
    for spec in args.versions:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_file():
            parser.error(f"{spec!r}: want NAME=PATH to an existing copy of kernels/flash_decode.py")
        versions[name] = _load(name, Path(path))
    try:
        cases = [CASES[int(i)] for i in args.cases.split(",")]
    except (ValueError, IndexError):
        parser.error(f"--cases {args.cases!r}: want comma-separated indices 0-{len(CASES) - 1}")
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for case in cases:
        rows.append((case[0], run_case(_smoke(case) if args.smoke else case, versions, device, args.smoke)))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "ab_serving_kernel.json").write_text(json.dumps(rows, indent=1))
    first = next(iter(versions))
    print(f"\n{'case':34s}" + "".join(f"{v:>18s}" for v in versions) + f"   (us, x {first}; median of 5 rounds)")
    for name, res in rows:
        cells = []
        for v in versions:
            e, base = res[v], res[first].get("us")
            if not e["ok"]:
                cells.append(f"WRONG {e['rel_err']:.3f}")
            elif "us" not in e:
                cells.append(f"ok {e['rel_err']:.4f}")
            else:
                cells.append(f"{e['us']:.1f} x{e['us'] / base:.3f}" if base else f"{e['us']:.1f}")
        print(f"{name:34s}" + "".join(f"{c:>18s}" for c in cells))
    if any(not e["ok"] for _, res in rows for e in res.values()):
        raise SystemExit("a version's answer is wrong (rel L2 error >= 1e-2)")


if __name__ == "__main__":
    main()
