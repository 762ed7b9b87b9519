"""Time a family's serving candidates across one kv bucket's lengths: where a pick holds up.

    PYTHONPATH=. python scripts/scan_lengths.py --kv fp8 --heads 16 --q-len 4 --batch 30 \
        --bucket 512 [--points 8] [--budget-waves 1,2] [--budget-tokens 128] [--json out.json]
    ... --batch 25,28,32 --lengths 609       # across a batch bucket's batches instead
    ... --mix 771,912,63472                  # one ragged batch of these lengths

A cell of the serving table is timed at one set of lengths, but an eager call looks it up
for any mean length within half an octave of its bucket. This script times every candidate
the config offers the family (configs/serving.yaml; the same gate is not run: each call is
checked against the fp32 reference under the config's rule instead), plus, with
--budget-waves, each split-K candidate again under a batch split budget of W waves of the
SMs (flash_decode_serving's split_budget), on uniform batches at --points lengths spread
log-evenly over the bucket (K x 2^u, u from -1/2 to 1/2), or at --lengths, for each of
--batch's batch sizes. It prints, per candidate, the regret to the fastest at each shape and
the worst, so a split rule that steps inside a bucket shows up as a large worst regret.
Timing: timing.time_call (L2 flushed, CUDA events, median of --reps); --device cpu (the
interpreter, for tests) times wall clock and means nothing.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from mla_tune import gpu, problem
from mla_tune.backends import get_backend, triton_splitk
from mla_tune.core import Variant
from mla_tune.serving.cells import family_plan
from mla_tune.serving.config import load_serving_config
from mla_tune.serving.gate import reference_q_format, run_call
from mla_tune.serving.inputs import make_input
from mla_tune.serving.table import FamilyKey
from mla_tune.tune import timing


def bucket_lengths(bucket: int, points: int) -> list[int]:
    """`points` lengths log-evenly over the lengths that look up `bucket` (x 2^-1/2 to 2^1/2),
    rounded up: the first sits on the bucket's lower edge (its geometric midpoint with the
    bucket below), inside it."""
    return sorted({max(1, math.ceil(bucket * 2.0 ** (-0.5 + i / points))) for i in range(points)})


def parse_ints(text: str, what: str) -> list[int]:
    """'25,28,32' -> [25, 28, 32]; positive integers only."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{what}: {text!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise SystemExit(f"{what}: every value must be >= 1, got {text!r}")
    return out


def with_budget(variant: Variant, waves: float, tokens: int, sm_count: int, heads: int) -> Variant | None:
    """The split-K variant under a batch budget of `waves` waves of the SMs over its head
    tiles, with a split per at least `tokens` tokens; None for a variant that does not split."""
    p = variant.p
    if variant.backend != "triton" or p.get("max_splits", 1) <= 1:
        return None
    budget = triton_splitk.batch_split_budget(waves, sm_count, heads // p["block_h"])
    return Variant.make("triton", **{**p, "split_budget": budget, "tokens_per_split": tokens})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/serving.yaml")
    parser.add_argument("--kv", choices=("bf16", "fp8"), required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--batch", help="Batch size, or comma-separated sizes.")
    parser.add_argument("--bucket", type=int, help="The kv bucket (its power of two) whose lengths to scan.")
    parser.add_argument("--lengths", help="Comma-separated kv lengths instead of a bucket's.")
    parser.add_argument("--mix", help="Comma-separated kv lengths of one ragged batch, instead of --batch with "
                        "--bucket or --lengths.")
    parser.add_argument("--points", type=int, default=8)
    parser.add_argument("--budget-waves", default="", help="Comma-separated waves, e.g. 1,2.")
    parser.add_argument("--budget-tokens", default="128",
                        help="Comma-separated tokens_per_split of the budget variants (the shortest split).")
    parser.add_argument("--backends", help="Comma-separated backends to time (default: all the config's).")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="Write every time here.")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels on Triton's interpreter "
                        "(TRITON_INTERPRET=1), for tests: its times mean nothing.")
    args = parser.parse_args()
    if args.mix is None and ((args.bucket is None) == (args.lengths is None) or args.batch is None):
        raise SystemExit("give --batch with --bucket (its lengths are scanned) or --lengths (not both), "
                         "or --mix alone")
    if args.mix is not None and (args.bucket or args.lengths or args.batch):
        raise SystemExit("--mix is one ragged batch: give it without --batch, --bucket or --lengths")

    cfg = load_serving_config(args.config)
    key = FamilyKey(args.kv, args.page, args.heads, args.q_len)
    platform = gpu.detect()
    plan = family_plan(cfg, key, platform)
    wanted = set(args.backends.split(",")) if args.backends else None
    variants = [v for v in plan.candidates if wanted is None or v.backend in wanted]
    for w in (float(x) for x in args.budget_waves.split(",") if x):
        for tokens in (int(x) for x in args.budget_tokens.split(",")):
            variants += [v for v in (with_budget(c, w, tokens, platform.sm_count or 4, args.heads)
                                     for c in list(variants)) if v is not None and v not in variants]
    if args.mix:  # one ragged batch
        mix = parse_ints(args.mix, "--mix")
        batches, lengths = [len(mix)], []
        shapes = [f"mix{len(mix)}~{sum(mix) // len(mix)}"]
        shape_lens = {shapes[0]: mix}
    else:
        batches = parse_ints(args.batch, "--batch")
        lengths = parse_ints(args.lengths, "--lengths") if args.lengths else bucket_lengths(args.bucket, args.points)
        shapes = [f"{b}x{n}" for b in batches for n in lengths]
        shape_lens = {f"{b}x{n}": [n] * b for b in batches for n in lengths}
    times: dict[str, dict[str, float]] = {str(v): {} for v in variants}
    runners = {}
    timer = timing.timers(args.device != "cpu")[0]
    for shape in shapes:
        lens = shape_lens[shape]
        inp = make_input([min(args.q_len, n) for n in lens], lens, args.heads, args.page,
                         args.kv, seed=sum(lens), device=args.device)
        refs = {}
        for v in variants:
            if v not in runners:
                runners[v] = get_backend(v.backend).build_serving(v, plan.spec, args.device)
            q_format = reference_q_format(v, cfg.gate)
            if q_format not in refs:
                refs[q_format] = inp.reference(q_format)
            try:
                ok = problem.check(run_call(runners[v], inp), refs[q_format], cfg.rule).passed
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is reported, not fatal
                print(f"  {v}: {type(exc).__name__}: {exc}")
                continue
            if ok:
                times[str(v)][shape] = timer(lambda r=runners[v], x=inp: run_call(r, x), reps=args.reps).median_us
            else:
                print(f"  {v}: fails the check at {shape}")
        del inp, refs
        if args.device != "cpu":
            torch.cuda.empty_cache()
    best = {n: min((t[n] for t in times.values() if n in t), default=math.nan) for n in shapes}
    print(f"{key}: batches {batches}, lengths {lengths}")
    print("best us: " + " ".join(f"{best[n]:.1f}" for n in shapes))
    rows = []
    for name, t in times.items():
        if len(t) < len(shapes):
            continue
        regrets = [t[n] / best[n] - 1 for n in shapes]
        rows.append((max(regrets), name, regrets))
    for worst, name, regrets in sorted(rows)[:12]:
        print(f"worst {100 * worst:5.1f}%  " + " ".join(f"{100 * r:5.1f}" for r in regrets) + f"  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"family": str(key), "batches": batches, "lengths": lengths, "shapes": shapes,
                       "times": times}, f, indent=1)


if __name__ == "__main__":
    main()
