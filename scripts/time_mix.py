"""Check and time a serving table's picks at one batch of chosen lengths, beside the vendors.

    PYTHONPATH=. python scripts/time_mix.py --table tables/H200.serving.yaml --kv fp8 \
        --heads 16 --q-len 1 --lens 4501,2796,56221 [--variant "triton(...)" ...]

For a look at one mix (a verify miss, an engine's batch); `mla-tune verify` is the tool
that judges a table. Prints the table's cell for the batch and mean length as swept (at
a grid point with equal lengths, the same shape timed at sweep time), then runs the table's
eager pick (the cell of the batch bucket and the mean length) and graph pick, each
vendor's default serving variant and any --variant, on one input; each is checked against
the fp32 reference under the config's rule and timed with timing.time_call (the
leaderboard protocol: L2 flushed, CUDA events, median of --reps). Prints us, the ratio to
the fastest that passes, and the check.
"""

from __future__ import annotations

import argparse

import torch

from mla_tune import gpu, problem
from mla_tune.backends import capabilities, get_backend, platform_refusal
from mla_tune.core import Variant
from mla_tune.serving.gate import reference_q_format, run_call
from mla_tune.serving.inputs import make_input
from mla_tune.serving.table import FamilyKey, batch_bucket, kv_bucket, load_serving_table
from mla_tune.serving.verify import resolve_config
from mla_tune.tune import timing

VENDORS = ("flashmla", "flashinfer")


def parse_lens(text: str) -> list[int]:
    """"4501,2796,56221" or "1024*128" (128 sequences of 1024 tokens), mixed freely."""
    out = []
    for item in text.split(","):
        length, _, count = item.partition("*")
        try:
            out += [int(length)] * (int(count) if count else 1)
        except ValueError:
            raise SystemExit(f"--lens: {item!r} is not LEN or LEN*N (positive integers)") from None
    if not out or min(out) < 1:
        raise SystemExit(f"--lens: every length must be >= 1, got {text!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", required=True)
    parser.add_argument("--config", help="The serving config (default: the one the table names).")
    parser.add_argument("--kv", choices=("bf16", "fp8"), required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--lens", required=True,
                        help="Comma-separated KV lengths, one per sequence; LEN*N for N sequences of LEN.")
    parser.add_argument("--variant", action="append", default=[], help="Another variant to time.")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    table = load_serving_table(args.table)
    cfg = resolve_config(table, args.config)
    key = FamilyKey(args.kv, args.page, args.heads, args.q_len)
    spec = cfg.spec(key)
    kv_lens = parse_lens(args.lens)
    q_lens = [min(args.q_len, n) for n in kv_lens]
    mean = sum(kv_lens) / len(kv_lens)
    roles: dict[str, Variant] = {}
    for role, v in (("eager", table.lookup(spec, len(kv_lens), mean, kv_lens=kv_lens)),
                    ("graph", table.lookup(spec, len(kv_lens), graph=True))):
        if v is not None:
            roles[role] = v
    platform = gpu.detect()
    for name in VENDORS:
        if capabilities(name).refusal(spec) is None and platform_refusal(name, platform) is None:
            roles[name] = get_backend(name).default_serving_variant(spec, platform)
    for i, text in enumerate(args.variant):
        roles[f"extra{i + 1}"] = Variant.parse(text)

    inp = make_input(q_lens, kv_lens, args.heads, args.page, args.kv, seed=args.seed, device="cuda")
    refs: dict[str, torch.Tensor] = {}
    rows = []
    for role, v in roles.items():
        runner = get_backend(v.backend).build_serving(v, spec, "cuda")
        q_format = reference_q_format(v, cfg.gate)
        if q_format not in refs:
            refs[q_format] = inp.reference(q_format)
        result = problem.check(run_call(runner, inp), refs[q_format], cfg.rule)
        us = timing.time_call(lambda r=runner: run_call(r, inp), reps=args.reps).median_us
        rows.append((role, v, us, result))
        del runner
        torch.cuda.empty_cache()
    best = min((us for _, _, us, res in rows if res.passed), default=float("nan"))
    def shown(lens: list[int]) -> str:  # 256 sequences print as their first 8
        return str(lens) if len(lens) <= 8 else f"{lens[:8]}... ({len(lens)})"

    print(f"{key}: {len(kv_lens)} sequences, kv_lens {shown(kv_lens)} (mean {mean:.0f}), q_lens {shown(q_lens)}")
    family = table.family(spec)
    cell = family.cells.get((batch_bucket(table.batch_buckets, len(kv_lens)), kv_bucket(table.kv_buckets, mean))) \
        if family is not None else None
    if cell is not None:  # at a grid point with equal lengths: the same shape, timed by the sweep
        print(f"the table's cell {cell.batch} x {cell.kv_len}: {cell.variant}, {cell.time_us:.1f} us as swept")
    print(f"{'role':>8} {'us':>9} {'x best':>7} {'check':>6}  variant")
    for role, v, us, res in rows:
        print(f"{role:>8} {us:9.1f} {us / best:7.3f} {'ok' if res.passed else 'FAIL':>6}  {v}")


if __name__ == "__main__":
    main()
