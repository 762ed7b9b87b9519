"""On a GPU: what `mla-tune compile` reports for a sample of the plan beside what the driver
reports for the same kernels launched for real.

    PYTHONPATH=. python scripts/compile_vs_driver.py [--gpu H200] [--config F] [--per-backend 6]
        [--out DIR]

Takes `--per-backend` candidates of each own backend (triton, triton_fused, gluon_fused)
from the config's plan for this GPU, spread over its shapes, and:

1. compiles them the way `mla-tune compile` does (captured on the meta device, bound for the
   GpuFacts target, no launch: mla_tune.xcompile.check.check_plan, cache off);
2. builds and runs each once on this GPU on real inputs, then reads every compiled kernel out
   of the Triton JIT's caches: registers and spills as the driver loaded them, shared memory
   from the kernel's metadata, and the PTX.

Each binary of (1) is matched to the launched kernel of (2) with the same PTX instructions
(the SHA xcompile computes). Printed: per binary, registers / spills / shared from both, and a
verdict; a binary of (1) that no real launch produced means the capture or the binding differs
from the real launch path. Exit 1 on any mismatch or unmatched binary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

import mla_tune.kernels
from mla_tune import gpu as gpu_mod
from mla_tune.backends import get_backend
from mla_tune.problem import generate_input
from mla_tune.tune.config import load_config
from mla_tune.tune.sweep import plan_candidates
from mla_tune.xcompile.capture import STATIC_Q_AMAX
from mla_tune.xcompile.check import check_plan
from mla_tune.xcompile.resources import code_sha

OWN = ("triton", "triton_fused", "gluon_fused")


def sample_plan(config: Path, gpu: str, per_backend: int) -> dict:
    """Up to `per_backend` candidates of each own backend, dealt round-robin over the shapes."""
    plan = plan_candidates(load_config(config), gpu_mod.fake_platform(gpu), planning_only=True).plan
    picked: dict = {}
    for backend in OWN:
        pools = [(shape, [v for v in vs if v.backend == backend]) for shape, vs in sorted(plan.items())]
        taken, k = 0, 0
        while taken < per_backend and any(len(p) > k for _, p in pools):
            for shape, pool in pools:
                if taken < per_backend and len(pool) > k:
                    v = pool[(taken * 7919 + k) % len(pool)]  # spread over the pool
                    if v not in picked.setdefault(shape, []):
                        picked[shape].append(v)
                        taken += 1
            k += 1
    return picked


def jit_functions() -> list[JITFunction]:
    found = []
    for info in pkgutil.iter_modules(mla_tune.kernels.__path__):
        try:
            module = importlib.import_module(f"mla_tune.kernels.{info.name}")
        except ImportError:
            continue
        found += [obj for obj in vars(module).values() if isinstance(obj, JITFunction)]
    return found


def launched_kernels() -> list[dict]:
    """Every kernel the JIT compiled in this process, as the driver loaded it."""
    rows = []
    for jf in jit_functions():
        for entry in getattr(jf, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for ck in list(cache.values()):
                try:
                    ck._init_handles()
                except Exception:  # already loaded, or a kernel this GPU cannot load
                    pass
                ptx = ck.asm.get("ptx", "")
                rows.append({"kernel": jf.__name__, "registers": int(getattr(ck, "n_regs", -1)),
                             "spills": int(getattr(ck, "n_spills", -1)),
                             "shared": int(ck.metadata.shared), "sha": code_sha(ptx, "//")})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--per-backend", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    config = args.config or Path("configs") / gpu_mod.KNOWN_GPUS[args.gpu].config
    plan = sample_plan(config, args.gpu, args.per_backend)
    report = check_plan(plan, args.gpu, use_cache=False, q_quant=False,
                        log=lambda text: print(text, file=sys.stderr, flush=True))
    device = torch.device("cuda")
    run_errors = []
    for shape, variants in plan.items():
        data = generate_input(shape.batch, shape.kv_len, 7, device="cuda")
        for v in variants:
            if v.get("q") == "fp8_static" and v.get("q_amax") is None:
                v = v.with_params(q_amax=STATIC_Q_AMAX)  # as the capture does
            backend = get_backend(v.backend)
            if backend.unavailable_reason():
                run_errors.append(f"{v}: {backend.unavailable_reason()}")
                continue
            try:
                runner = backend.build(v, shape, device)
                runner(*data[:4])
                torch.cuda.synchronize()
            except Exception as exc:  # reported per candidate; the comparison goes on
                run_errors.append(f"{shape} {v}: {type(exc).__name__}: {exc}")
        del data
    real = {}
    for row in launched_kernels():
        real.setdefault(row["sha"], row)
    rows, bad = [], 0
    for b in report["binaries"]:
        if not b.get("ok"):
            rows.append((b["kernel"], "compile error", b.get("error", "")))
            bad += 1
            continue
        r = real.get(b.get("sha"))
        if r is None:
            rows.append((b["kernel"], "NO REAL LAUNCH with this PTX", ""))
            bad += 1
            continue
        cpu = (b.get("registers"), b.get("scratch"), b.get("lds"))
        drv = (r["registers"], r["spills"], r["shared"])
        same = cpu[0] == drv[0] and (cpu[1] == 0) == (drv[1] == 0) and cpu[2] == drv[2]
        bad += not same
        rows.append((b["kernel"], "same" if same else "DIFFERENT",
                     f"regs {cpu[0]}/{drv[0]} spill {cpu[1]}/{drv[1]} shared {cpu[2]}/{drv[2]}"))
    print(f"\n{len(report['binaries'])} binaries of {sum(map(len, plan.values()))} sampled candidates "
          f"(Triton {report['triton']}, {torch.cuda.get_device_name()}); cpu/driver:")
    for kernel, verdict, detail in rows:
        print(f"  {kernel[:28]:28} {verdict:10} {detail}")
    for err in run_errors:
        print(f"  run error: {err}")
    print(f"{bad} mismatched or unmatched, {len(run_errors)} run errors")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile_vs_driver.json").write_text(json.dumps(
            {"rows": rows, "run_errors": run_errors, "report": report}, indent=1, default=str))
    return 1 if bad or run_errors else 0


if __name__ == "__main__":
    sys.exit(main())
