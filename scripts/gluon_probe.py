"""Issue 11's probe: how does Gluon (Triton 3.6) load the MLA V operand?

The PV product of MLA decode with tokens on the MMA's M dimension is O^T[512 x 16] +=
V^T[512 x BN] @ P^T[BN x 16], and V is the first 512 columns of the same fp8 [BN x 576] KV
tile the QK product reads as K. The tile sits in shared memory as TMA wrote it (row-major,
NVMMA swizzle), so V^T is that tile read transposed. This script compiles one kernel per way
of feeding that operand to wgmma, offline for sm_90a (no GPU needed), and counts what the
SASS does: ldmatrix (LDSM), byte/word shared loads (LDS.U8 ...), byte permutes (PRMT),
conversions (F2FP / I2F), wgmma (HGMMA/QGMMA), plus ptxas's register report.

Paths (one kernel each; the tile is [BN=64 tokens x 128 dims], one TMA box, 4 warps):
  rs8_k2      fp8 smem --permute--> load straight into the fp16 A-operand layout (k_width 2), cvt
  rs8_k4      fp8 smem --permute--> load into the fp8 A layout (k_width 4), cvt, convert_layout
  rs8_blk     fp8 smem row load (blocked), cvt, convert_layout to the A layout
  rs16        fp8 smem row load, cvt, store fp16 [BN x 128] smem, permute, load A (ldmatrix.trans?)
  ss16        as rs16 but wgmma reads A from the fp16 smem copy (no A registers)
  ss8t        fp8 smem row load, register transpose, store fp8 V^T [128 x BN] K-major, fp8 wgmma
              with P in fp8 (FlashMLA's fp8 path)
  rs8_k2_swN  rs8_k2 with the fp8 tile's NVMMA swizzle N in (0, 32, 64) instead of 128

Run here (Triton 3.6 venv, no GPU):  /work/wt/gluon-venv/bin/python scripts/gluon_probe.py
On the H200 (Triton 3.6): PYTHONPATH=. python3 scripts/gluon_probe.py --run  (also launches
each kernel and checks O^T against torch, so a wrong layout shows as a mismatch).
--decode also compiles mla_tune/kernels/gluon_decode.py's kernel (needs PYTHONPATH=.) and
prints its register report, shared memory and SASS counts per configuration; --time (H200)
times it beside triton_fused at the 8 leaderboard shapes and checks each under `strict`
(--variants picks the v_path/num_stages, --budget stops starting shapes; --paths '' skips
the probe's compiles).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
except ImportError as exc:  # pragma: no cover - depends on the Triton build
    sys.exit(f"gluon_probe: this Triton ({triton.__version__}) has no Gluon ({exc}); use Triton 3.6")

BN = 64  # tokens per tile (the MMA's K for PV)
BD = 128  # V dims per probe tile (the MMA's M; one 128-byte TMA box of the fp8 tile)
HEADS = 16  # the MMA's N
NUM_WARPS = 4


@gluon.jit
def _probe_kernel(V, P, OUT, PATH: gl.constexpr, SWIZZLE: gl.constexpr,
                  BN: gl.constexpr, BD: gl.constexpr, HEADS: gl.constexpr):
    # Global -> registers -> the fp8 tile in shared memory, laid out as TMA would write it.
    rows_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    tok = gl.arange(0, BN, layout=gl.SliceLayout(1, rows_l))
    dim = gl.arange(0, BD, layout=gl.SliceLayout(0, rows_l))
    v8 = gl.load(V + tok[:, None] * BD + dim[None, :])
    kv_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=SWIZZLE, element_bitwidth=8, rank=2)
    kv_s = gl.allocate_shared_memory(gl.float8e4nv, [BN, BD], kv_l, v8)

    # P^T [BN x 16] fp16 (or fp8 for ss8t) as the B operand, in shared memory.
    p_l: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
    pt_tok = gl.arange(0, BN, layout=gl.SliceLayout(1, p_l))
    pt_h = gl.arange(0, HEADS, layout=gl.SliceLayout(0, p_l))
    pt = gl.load(P + pt_tok[:, None] * HEADS + pt_h[None, :])

    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEADS, 16])
    acc = gl.zeros([BD, HEADS], gl.float32, acc_l)
    a16_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    if PATH == 5:  # ss8t: fp8 V^T transposed in smem (K-major), fp8 P, fp8 wgmma
        acc8_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEADS, 32])
        acc = gl.zeros([BD, HEADS], gl.float32, acc8_l)
        vt = gl.permute(kv_s.load(rows_l), (1, 0))
        vt_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        vt_s = gl.allocate_shared_memory(gl.float8e4nv, [BD, BN], vt_l, vt)
        p8_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        p_s = gl.allocate_shared_memory(gl.float8e4nv, [HEADS, BN], p8_l,
                                        gl.permute(pt.to(gl.float8e4nv), (1, 0)))
        fence_async_shared()
        acc = warpgroup_mma(vt_s, p_s.permute((1, 0)), acc)
    else:
        p16_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2)
        p_s = gl.allocate_shared_memory(gl.float16, [BN, HEADS], p16_l, pt)
        if PATH == 0:  # rs8_k2
            a = kv_s.permute((1, 0)).load(gl.DotOperandLayout(0, acc_l, 2)).to(gl.float16)
        elif PATH == 1:  # rs8_k4
            a8 = kv_s.permute((1, 0)).load(gl.DotOperandLayout(0, acc_l, 4))
            a = gl.convert_layout(a8.to(gl.float16), a16_l)
        elif PATH == 2:  # rs8_blk
            a = gl.convert_layout(gl.permute(kv_s.load(rows_l).to(gl.float16), (1, 0)), a16_l)
        else:  # rs16 (3) and ss16 (4): convert in shared memory, fp16 copy
            v16_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            v16_s = gl.allocate_shared_memory(gl.float16, [BN, BD], v16_l, kv_s.load(rows_l).to(gl.float16))
            if PATH == 3:
                a = v16_s.permute((1, 0)).load(a16_l)
        fence_async_shared()
        if PATH == 4:
            acc = warpgroup_mma(v16_s.permute((1, 0)), p_s, acc)
        else:
            acc = warpgroup_mma(a, p_s, acc)

    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    acc = gl.convert_layout(acc, out_l)
    od = gl.arange(0, BD, layout=gl.SliceLayout(1, out_l))
    oh = gl.arange(0, HEADS, layout=gl.SliceLayout(0, out_l))
    gl.store(OUT + od[:, None] * HEADS + oh[None, :], acc)


PATHS = {"rs8_k2": (0, 128), "rs8_k4": (1, 128), "rs8_blk": (2, 128), "rs16": (3, 128),
         "ss16": (4, 128), "ss8t": (5, 128),
         "rs8_k2_sw64": (0, 64), "rs8_k2_sw32": (0, 32), "rs8_k2_sw0": (0, 0)}

# SASS opcodes worth counting (prefix match on the mnemonic, modifiers kept apart).
_WATCH = ("LDSM", "LDS", "STS", "STSM", "PRMT", "SHFL", "F2FP", "F2F", "I2F", "HGMMA", "QGMMA",
          "WARPGROUP", "BAR")


def _tool(name: str) -> str:
    here = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return here if os.path.exists(here) else name


def compile_path(name: str, path: int, swizzle: int):
    """Compile one probe kernel for sm_90a without a GPU; return Triton's compiled kernel."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"V": "*fp8e4nv", "P": "*fp16", "OUT": "*fp32", "PATH": "constexpr", "SWIZZLE": "constexpr",
           "BN": "constexpr", "BD": "constexpr", "HEADS": "constexpr"}
    consts = {"PATH": path, "SWIZZLE": swizzle, "BN": BN, "BD": BD, "HEADS": HEADS}
    src = GluonASTSource(_probe_kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


def sass_summary(cubin: bytes) -> tuple[Counter, str]:
    """Opcode counts (mnemonic with its first modifier, e.g. LDS.U8) and the SASS text."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    counts: Counter = Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)((?:\.[A-Z0-9_]+)*)", line)
        if m and m.group(1).startswith(_WATCH):
            mods = m.group(2).split(".")[1:]
            key = m.group(1) + ("." + ".".join(mods[:2]) if mods and m.group(1) in ("LDS", "STS", "LDSM", "STSM") else "")
            counts[key] += 1
    return counts, sass


def ptx_summary(ptx: str) -> Counter:
    counts: Counter = Counter()
    for m in re.finditer(r"^\s*(?:@%p\d+\s+)?(ldmatrix[\w.]*|stmatrix[\w.]*|ld\.shared[\w.]*|st\.shared[\w.]*|"
                         r"prmt[\w.]*|cvt[\w.]*|shfl[\w.]*|wgmma\.mma_async[\w.]*)", ptx, re.M):
        counts[m.group(1)] += 1
    return counts


def registers(ptx: str) -> str:
    """ptxas -v's report (registers, spills) for the kernel, compiled here for sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        done = subprocess.run([_tool("ptxas"), "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    used = re.search(r"Used (\d+) registers", done.stderr)
    spill = re.search(r"(\d+) bytes spill stores", done.stderr)
    return f"{used.group(1) if used else '?'} regs, {spill.group(1) if spill else '?'} B spill"


def run_check(name: str, path: int, swizzle: int) -> str:
    """On a GPU: launch the kernel and compare O^T with torch (fp8 V dequantized, fp32 math)."""
    import torch

    torch.manual_seed(0)
    v = (torch.randn(BN, BD, device="cuda") * 2).to(torch.float8_e4m3fn)
    p = torch.rand(BN, HEADS, device="cuda").to(torch.float16)
    out = torch.empty(BD, HEADS, device="cuda", dtype=torch.float32)
    _probe_kernel[(1,)](v, p, out, path, swizzle, BN, BD, HEADS, num_warps=NUM_WARPS)
    pf = p.float().to(torch.float8_e4m3fn).float() if path == 5 else p.float()
    ref = v.float().t() @ pf
    err = (out - ref).abs().max().item()
    return f"max|err| {err:.2e} {'ok' if err < 1e-2 * max(1.0, ref.abs().max().item()) else 'WRONG'}"


def compile_decode(block_n: int, stages: int, v_path: str, split: bool, reduce: str = "launch",
                   v_halves: int = 1, num_splits: int = 4):
    """Compile mla_tune.kernels.gluon_decode's kernel for sm_90a without a GPU (reduce and
    v_halves as gluon_decode takes them; num_splits sizes the in-kernel reduction's tile)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from mla_tune.kernels.gluon_decode import (
        GD_REDUCE_CODES,
        GD_V_PATHS,
        _gd_decode_kernel,
        gd_kv_descriptor,
    )

    desc = gd_kv_descriptor(torch.empty(256, 576, dtype=torch.float8_e4m3fn), block_n)
    sig = {"kv_desc": mangle_type(desc), "Q": "*bf16", "KV_SCALE": "*fp32", "KV_INDPTR": "*i32",
           "OUT": "*bf16", "PART_O": "*fp32", "PART_LSE": "*fp32", "sm_scale_log2": "fp32",
           "num_splits": "i32", "COUNT": "*i32", "FLAG": "*i32", "BN": "constexpr", "STAGES": "constexpr",
           "V_PATH": "constexpr", "SPLIT": "constexpr", "REDUCE": "constexpr", "V_HALVES": "constexpr",
           "NS": "constexpr"}
    red = GD_REDUCE_CODES[reduce] if split else 0
    consts = {"BN": block_n, "STAGES": stages, "V_PATH": GD_V_PATHS[v_path], "SPLIT": split, "REDUCE": red,
              "V_HALVES": v_halves, "NS": max(2, triton.next_power_of_2(num_splits)) if red else 2}
    src = GluonASTSource(_gd_decode_kernel, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def decode_report(configs: list[str], sass_dir: str) -> None:
    """One line per decode configuration block_n/stages/v_path/one|split[/launch|last|spin]
    [/h2][/sN] (reduction, two V halves, N splits for the reduction tile): registers, smem, SASS."""
    print(f"{'decode config':<24} {'regs':<18} {'smem':>7}  LDSM  LDS.U8  LDS.128  STS  HGMMA  QGMMA  BAR")
    for text in configs:
        bn, stages, v_path, split, *more = text.split("/")
        reduce = next((m for m in more if m in ("launch", "last", "spin")), "launch")
        halves = 2 if "h2" in more else 1
        splits = next((int(m[1:]) for m in more if m.startswith("s") and m[1:].isdigit()), 4)
        try:
            k = compile_decode(int(bn), int(stages), v_path, split == "split", reduce, halves, splits)
        except Exception as exc:
            msg = " | ".join(line for line in str(exc).splitlines() if line.strip())[:400]
            print(f"{text:<24} compile failed: {msg}")
            continue
        counts, sass = sass_summary(k.asm["cubin"])
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
            with open(os.path.join(sass_dir, f"decode_{text.replace('/', '_')}.sass"), "w") as f:
                f.write(sass)

        def total(prefix, c=counts):
            return sum(v for key, v in c.items() if key.split(".")[0] == prefix)

        print(f"{text:<24} {registers(k.asm['ptx']):<18} {k.metadata.shared:>7}  {total('LDSM'):>4}  "
              f"{counts.get('LDS.U8', 0):>6}  {counts.get('LDS.128', 0):>7}  {total('STS'):>3}  "
              f"{total('HGMMA'):>5}  {total('QGMMA'):>5}  {total('BAR'):>3}")


DECODE_CONFIGS = ("64/3/ss16/one", "64/3/rs16/one", "64/3/rs8/one", "64/3/ss16a/one", "64/4/ss16/split",
                  "64/2/ss16/split", "64/2/ss16a/split", "128/2/ss16/split", "64/3/rs16/split")


LEADERBOARD = ((4, 1024), (4, 8192), (32, 1024), (32, 8192), (64, 1024), (64, 8192), (256, 1024), (256, 8192))


GLUON_TIMED = ("ss16/3", "ss16/2", "ss16a/3", "ss16a/2", "rs16/3", "rs8/3")


def time_report(reps: int, gluon_variants: list[str], budget_s: float) -> None:
    """On the H200: gluon_fused (block_n 64, its split plan, the given v_path/stages) beside
    triton_fused's run-3 pick (scripts/bench_peers.py FU_PICKS) at the 8 leaderboard shapes,
    strict rule. No new shape starts once budget_s has passed; the table comes last."""
    import time

    import torch

    from mla_tune import problem
    from mla_tune.backends import gluon_fused, triton_fused
    from mla_tune.core import Shape, Variant
    from mla_tune.tune.timing import time_call
    from scripts.bench_peers import fused_pick

    t0 = time.monotonic()
    gluon = [(v, int(st)) for v, st in (text.split("/") for text in gluon_variants)]
    rows = []
    for batch, kv_len in LEADERBOARD:
        if time.monotonic() - t0 > budget_s:
            rows.append(f"{f'{batch}x{kv_len}':>9} not timed: the {budget_s:.0f} s budget was spent")
            continue
        shape = Shape(batch, kv_len)
        try:
            data = problem.generate_input(batch, kv_len, seed=batch * 7 + kv_len, device="cuda")
            ref = problem.reference(data)
        except Exception as exc:  # the inputs of one shape failing still leaves the table
            rows.append(f"{f'{batch}x{kv_len}':>9} inputs failed: {str(exc).splitlines()[0][:120]}")
            continue
        splits = max(1, min(32, 128 // batch, kv_len // 64))
        variants = [(triton_fused, fused_pick(shape))] + [
            (gluon_fused, Variant.make("gluon_fused", kv="fp8", q="fp8_dynamic", block_n=64, num_stages=st,
                                       num_splits=splits, v_path=v)) for v, st in gluon]
        cells = []
        for backend, variant in variants:
            try:
                run = backend.build(variant, shape, "cuda")
                inputs = data[:4]
                ok = problem.check(run(*inputs), ref, problem.RULES["strict"]).passed
                us = time_call(lambda run=run, inputs=inputs: run(*inputs), reps=reps).median_us
                cells.append(f"{us:.1f}{'' if ok else '!'}")
            except Exception as exc:  # a failing variant is a table entry, not the end of the table
                cells.append("err:" + type(exc).__name__)
                print(f"  {variant}: {str(exc).splitlines()[0][:200]}")
        torch.cuda.synchronize()
        rows.append(f"{f'{batch}x{kv_len}':>9} {cells[0]:>12} " + " ".join(f"{c:>10}" for c in cells[1:]))
        print(f"{rows[-1]}   (done at {time.monotonic() - t0:.0f} s)", flush=True)
    print(f"gluon_fused vs triton_fused, median us over {reps} reps ('!' = failed strict vs problem.reference; "
          "gluon splits = min(32, 128 // batch, tiles))")
    print(f"{'shape':>9} {'triton_fused':>12} " + " ".join(f"{f'{v}/{st}':>10}" for v, st in gluon))
    for row in rows:
        print(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode", nargs="?", const=",".join(DECODE_CONFIGS), default="",
                    help="also compile mla_tune's Gluon decode kernel: block_n/stages/v_path/one|split, "
                         "comma-separated (default: a sample)")
    ap.add_argument("--time", action="store_true", help="on the H200: time gluon_fused beside triton_fused "
                                                        "at the 8 leaderboard shapes (needs PYTHONPATH=.)")
    ap.add_argument("--reps", type=int, default=20, help="timing repetitions per variant (--time)")
    ap.add_argument("--variants", default=",".join(GLUON_TIMED),
                    help="gluon_fused v_path/num_stages to time (--time), comma-separated")
    ap.add_argument("--budget", type=float, default=600.0,
                    help="seconds after which --time starts no new shape (the table still prints)")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ", ".join(PATHS))
    ap.add_argument("--run", action="store_true", help="also launch each kernel on the GPU and check it")
    ap.add_argument("--sass", default="", help="write each path's SASS into this folder")
    args = ap.parse_args()
    paths = [n.strip() for n in args.paths.split(",") if n.strip()]  # --paths '': none (e.g. with --time)
    print(f"Gluon V-path probe: triton {triton.__version__}, sm_90a, fp8 tile [{BN} x {BD}], {NUM_WARPS} warps; "
          "counts are whole-kernel SASS instructions (the tile stores and the epilogue included)")
    cols = ("LDSM", "LDS", "STS", "STSM", "PRMT", "SHFL", "cvt", "MMA")
    if paths:
        print(f"{'path':<12} {'regs':<18} " + " ".join(f"{c:>5}" for c in cols) + "  shared-load forms")
    for name in paths:
        path, swizzle = PATHS[name]
        try:
            k = compile_path(name, path, swizzle)
        except Exception as exc:  # one path failing to compile is itself a probe result
            print(f"{name:<12} compile failed: {str(exc).splitlines()[0][:150]}")
            continue
        counts, sass = sass_summary(k.asm["cubin"])
        if args.sass:
            os.makedirs(args.sass, exist_ok=True)
            with open(os.path.join(args.sass, f"{name}.sass"), "w") as f:
                f.write(sass)
            with open(os.path.join(args.sass, f"{name}.ptx"), "w") as f:
                f.write(k.asm["ptx"])

        def total(prefix, c=counts):
            return sum(v for key, v in c.items() if key.split(".")[0] == prefix)

        row = [total("LDSM"), total("LDS"), total("STS"), total("STSM"), total("PRMT"), total("SHFL"),
               total("F2FP") + total("F2F") + total("I2F"), total("HGMMA") + total("QGMMA")]
        forms = " ".join(f"{key}:{v}" for key, v in sorted(counts.items()) if key.startswith(("LDS", "LDSM")))
        line = f"{name:<12} {registers(k.asm['ptx']):<18} " + " ".join(f"{v:>5}" for v in row) + f"  {forms}"
        if args.run:
            line += "  " + run_check(name, path, swizzle)
        print(line)
    if args.decode:
        decode_report([c.strip() for c in args.decode.split(",") if c.strip()], args.sass)
    if args.time:
        time_report(args.reps, [v.strip() for v in args.variants.split(",") if v.strip()], args.budget)


if __name__ == "__main__":
    main()
