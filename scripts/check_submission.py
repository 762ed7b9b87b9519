"""Check and time an exported submission file the way the leaderboard does.

    PYTHONPATH=. python scripts/check_submission.py submission.py [--shapes bench,test,2x17]
        [--require leaderboard|strict] [--out DIR]

Writes a task.py beside a copy of the file, imports it in this process with nothing of
mla_tune's on the import path of the submission itself, then per shape: runs
`custom_kernel` on fresh inputs, checks it against the fp32 reference under the
`leaderboard` and `strict` rules, and times it under the leaderboard protocol
(mla_tune.tune.timing.time_call). Prints one table with the geomean over the benchmark shapes.
`--shapes` takes `bench`, `test` and explicit `BATCHxKV_LEN` shapes (those the table lacks
run the submission's fallback); the exit status is 0 when every shape passes the
`--require` rule. An export under `strict`, at short lengths:

    PYTHONPATH=. python scripts/check_submission.py sub.py --shapes 2x1,2x2,2x17,2x63 --require strict

Side by side: `--against OLD.py` times a second file at the same inputs in the same process,
alternating the two over `--rounds` rounds, and prints new/old per shape as the paired
ratio (figures at the same position in a round; see paired_ratio); `--table T.yaml` adds each shape's time recorded in a table and
the ratio to it. `--max-ratio 1.03` then makes the exit status 1 for a shape slower than
that against the other file.

Ranked mode, `--ranked`: the contest's `leaderboard` mode as its eval.py runs it. Per shape,
one checked warm-up call, then up to `--ranked-reps` timed calls, each on FRESH inputs (the
seed steps by 13 every call, as eval.py's recheck does), L2 flushed and the GPU held busy
ahead of each call, every output checked under the `leaderboard` rule against the fp32
reference of a copy of its inputs taken before the call. It stops early as eval.py does (the
mean's relative error under 0.1%, or 30 s of kernel time). The figure is the mean, as the
contest ranks; a shape passes only if every call passed. With `--against`, both files run
the same seeds, alternating per call; the ratio `--max-ratio` judges is the median of the
per-call ratios (a mean moves with a few slow calls: at 4x1024 on the H200 the means' ratio
read 1.040 where the per-call median read 0.998, docs/perf.md), the means' ratio printed beside.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from mla_tune.problem import RULES, check, generate_input, reference
from mla_tune.tune.timing import FLUSH_BYTES, hold_gpu, time_call, wall_time

BENCH_SHAPES = [(b, kv) for b in (4, 32, 64, 256) for kv in (1024, 8192)]
TEST_SHAPES = [(4, 1024), (32, 1024), (64, 8192), (256, 8192)]
TASK_PY = "from typing import Any\ninput_t = Any\noutput_t = Any\n"


def import_submission(path: Path):
    workdir = Path(tempfile.mkdtemp(prefix="mla_submission_"))
    (workdir / "task.py").write_text(TASK_PY)
    target = workdir / "submission.py"
    shutil.copy(path, target)
    sys.path.insert(0, str(workdir))
    spec = importlib.util.spec_from_file_location("submission", target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as `import submission` would (dataclasses need it)
    spec.loader.exec_module(module)
    return module


def paired_ratio(mine: list[float], theirs: list[float]) -> float:
    """new/old compared at the same position in a round. On the H200 the second of two
    back-to-back time_call figures differs from the first by up to 10% at some shapes
    (either way, for both files alike: docs/perf.md), so only same-position figures are
    compared: the geometric mean of the first-position and second-position median ratios.
    mine[0] is the initial figure (first position); round k puts `theirs` first when k is
    even and `mine` first when k is odd."""
    def med(values):
        values = sorted(values)
        return values[len(values) // 2]

    rounds = len(theirs)
    mine_first = [mine[0]] + [mine[1 + k] for k in range(rounds) if k % 2 == 1]
    mine_second = [mine[1 + k] for k in range(rounds) if k % 2 == 0]
    theirs_first = [theirs[k] for k in range(rounds) if k % 2 == 0]
    theirs_second = [theirs[k] for k in range(rounds) if k % 2 == 1]
    ratios = [med(mine_first) / med(theirs_first)]
    if mine_second and theirs_second:
        ratios.append(med(mine_second) / med(theirs_second))
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def ranked_run(subs: list, batch: int, kv_len: int, seed: int, reps: int) -> list[dict]:
    """The contest's ranked protocol for each of `subs` at one shape, the submissions
    alternating per call on the same fresh inputs: per submission, its call times (us), how
    many of its checked calls passed, and the first failure's message."""
    first = generate_input(batch, kv_len, seed, device="cuda")
    ref = reference(first)
    stats = []
    for sub in subs:  # eval.py's obligatory first check, which also compiles and warms
        result = check(sub.custom_kernel(first), ref, RULES["leaderboard"])
        stats.append({"durations_us": [], "passed": int(result.passed), "checked": 1,
                      "first_failure": None if result.passed else "warm-up call: " + result.reason})
    ahead_us = max(200.0, 3.0 * max(wall_time(lambda s=s, d=first: s.custom_kernel(d), reps=3).median_us
                                    for s in subs))
    del first, ref
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(reps):
        seed += 13
        data = generate_input(batch, kv_len, seed, device="cuda")
        copy = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in data)
        order = range(len(subs)) if i % 2 == 0 else reversed(range(len(subs)))
        for k in order:
            torch.cuda.synchronize()
            flush.fill_(1.0)
            hold_gpu(ahead_us)
            start.record()
            out = subs[k].custom_kernel(data)
            end.record()
            torch.cuda.synchronize()
            result = check(out, reference(copy), RULES["leaderboard"])
            st = stats[k]
            st["durations_us"].append(start.elapsed_time(end) * 1000.0)
            st["checked"] += 1
            st["passed"] += int(result.passed)
            if not result.passed and st["first_failure"] is None:
                st["first_failure"] = f"call {i + 1} (seed {seed}): {result.reason}"
            del out
        durations = stats[0]["durations_us"]
        if i > 1:
            n = len(durations)
            mean = sum(durations) / n
            std = math.sqrt(sum((d - mean) ** 2 for d in durations) / (n - 1))
            if std / math.sqrt(n) / mean < 0.001 or mean * n > 30e6:
                break
    del flush
    for st in stats:
        d = st["durations_us"]
        st["mean_us"] = sum(d) / len(d)
        st["median_us"] = sorted(d)[len(d) // 2]
        st["pass"] = st["passed"] == st["checked"]
    return stats


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """(kind, batch, kv_len) for `bench`, `test` and `BxN` items; exits with one line on a bad item."""
    shapes: list[tuple[str, int, int]] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item == "bench":
            shapes += [("bench", b, kv) for b, kv in BENCH_SHAPES]
        elif item == "test":
            shapes += [("test", b, kv) for b, kv in TEST_SHAPES]
        elif re.fullmatch(r"[1-9]\d*x[1-9]\d*", item):
            batch, kv_len = map(int, item.split("x"))
            shapes.append(("extra", batch, kv_len))
        else:
            raise SystemExit(f"--shapes: {item!r} is not bench, test or BATCHxKV_LEN (e.g. 2x17)")
    if not shapes:
        raise SystemExit("--shapes names no shape")
    return shapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("submission", type=Path)
    parser.add_argument("--shapes", default="bench,test",
                        help="comma-separated: bench, test and BATCHxKV_LEN shapes (e.g. 2x17)")
    parser.add_argument("--require", default="leaderboard", choices=sorted(RULES),
                        help="the rule every shape must pass for exit status 0")
    parser.add_argument("--seed", type=int, default=4242)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    parser.add_argument("--against", type=Path, default=None,
                        help="a second submission timed beside this one at the same inputs")
    parser.add_argument("--rounds", type=int, default=3, help="alternations with --against")
    parser.add_argument("--table", type=Path, default=None,
                        help="a table whose recorded winner times are printed beside")
    parser.add_argument("--max-ratio", type=float, default=None,
                        help="with --against: fail a shape slower than this ratio (e.g. 1.03)")
    parser.add_argument("--ranked", action="store_true",
                        help="the contest's ranked mode: fresh inputs for every timed call, each checked")
    parser.add_argument("--ranked-reps", type=int, default=100,
                        help="with --ranked: at most this many timed calls per shape (eval.py: 100)")
    args = parser.parse_args()
    if args.ranked:
        return main_ranked(args)

    shapes = parse_shapes(args.shapes)
    module = import_submission(args.submission)
    other = import_submission(args.against) if args.against else None
    recorded = {}
    if args.table:
        from mla_tune.tables.table import load_table

        recorded = {(s.batch, s.kv_len): r.time_us
                    for s, r in load_table(args.table).rows.items() if r.time_us}

    rows = []
    for i, (kind, batch, kv_len) in enumerate(shapes):
        data = generate_input(batch, kv_len, args.seed + i, device="cuda")
        out = module.custom_kernel(data).clone()
        ref = reference(data)
        lb = check(out, ref, RULES["leaderboard"])
        strict = check(out, ref, RULES["strict"])
        timing = time_call(lambda data=data: module.custom_kernel(data), reps=args.reps)
        row = {
            "kind": kind, "batch": batch, "kv_len": kv_len,
            "leaderboard_pass": lb.passed, "leaderboard_mismatch": lb.mismatch,
            "strict_pass": strict.passed, "strict_mismatch": strict.mismatch,
            **timing.as_dict(),
        }
        if other is not None:
            other.custom_kernel(data)  # compile and warm outside the timing
            mine, theirs = [timing.median_us], []
            for k in range(args.rounds):  # alternating which goes first, so order cannot favour one
                pair = [(theirs, other), (mine, module)]
                for into, sub in (pair if k % 2 == 0 else pair[::-1]):
                    into.append(time_call(lambda data=data, sub=sub: sub.custom_kernel(data), reps=args.reps).median_us)
            row["median_us"] = sorted(mine)[len(mine) // 2]
            row["rounds_us"] = mine
            row["against_us"] = sorted(theirs)[len(theirs) // 2]
            row["against_rounds_us"] = theirs
            row["paired_ratio"] = paired_ratio(mine, theirs)
        if (batch, kv_len) in recorded:
            row["table_us"] = recorded[(batch, kv_len)]
        rows.append(row)
        del data, out, ref
        torch.cuda.empty_cache()

    bench = [r["median_us"] for r in rows if r["kind"] == "bench"]
    geomean = math.exp(sum(math.log(t) for t in bench) / len(bench)) if bench else float("nan")
    print(f"\nsubmission {args.submission} on {torch.cuda.get_device_name()}")
    print(f"{'kind':5} {'shape':>10} {'lb':>4} {'strict':>6} {'mism%':>6} {'median_us':>10} {'p10':>8} {'p90':>8}")
    for r in rows:
        print(
            f"{r['kind']:5} {r['batch']:>4}x{r['kv_len']:<5} {'ok' if r['leaderboard_pass'] else 'FAIL':>4} "
            f"{'ok' if r['strict_pass'] else 'FAIL':>6} {100 * r['strict_mismatch']:6.2f} "
            f"{r['median_us']:10.1f} {r['p10_us']:8.1f} {r['p90_us']:8.1f}"
            + (f"  vs {r['against_us']:8.1f}, paired {r['paired_ratio']:5.3f}" if "against_us" in r else "")
            + (f"  table {r['table_us']:8.1f} = {r['median_us'] / r['table_us']:5.3f}" if "table_us" in r else "")
        )
    print(f"geomean over the benchmark shapes: {geomean:.1f} us")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "check_submission.json").write_text(
            json.dumps({"rows": rows, "geomean_us": geomean}, indent=1)
        )
    return verdict(args, rows, f"{args.require}_pass", f"FAIL under the {args.require} rule", "paired_ratio")


def verdict(args, rows: list[dict], pass_key: str, fail_text: str, ratio_key: str) -> int:
    """Print the shapes that failed (`pass_key` false) and those slower than --max-ratio by
    `ratio_key`; the exit status: 1 if any."""
    failed = [f"{r['batch']}x{r['kv_len']}" for r in rows if not r[pass_key]]
    if failed:
        print(f"{fail_text}: {', '.join(failed)}")
    slower = [f"{r['batch']}x{r['kv_len']} ({r[ratio_key]:.3f})" for r in rows
              if args.max_ratio and ratio_key in r and r[ratio_key] > args.max_ratio]
    if slower:
        print(f"SLOWER than {args.against} by more than {args.max_ratio}x: {', '.join(slower)}")
    return 1 if failed or slower else 0


def main_ranked(args) -> int:
    """--ranked: every shape under the contest's ranked protocol; exit 1 if any call failed
    its check (or, with --max-ratio, a shape's mean is slower than --against's by more)."""
    shapes = parse_shapes(args.shapes)
    subs = [import_submission(args.submission)] + ([import_submission(args.against)] if args.against else [])
    rows = []
    for i, (kind, batch, kv_len) in enumerate(shapes):
        stats = ranked_run(subs, batch, kv_len, args.seed + 1000 * i, args.ranked_reps)
        row = {"kind": kind, "batch": batch, "kv_len": kv_len, **{k: v for k, v in stats[0].items()}}
        if len(stats) > 1:
            row["against"] = stats[1]
            row["mean_ratio"] = stats[0]["mean_us"] / stats[1]["mean_us"]
            calls = sorted(a / b for a, b in zip(stats[0]["durations_us"], stats[1]["durations_us"],
                                                 strict=True))
            row["ratio"] = calls[len(calls) // 2]  # the median of per-call ratios (same inputs)
        rows.append(row)
        torch.cuda.empty_cache()
    bench = [r["mean_us"] for r in rows if r["kind"] == "bench"]
    geomean = math.exp(sum(math.log(t) for t in bench) / len(bench)) if bench else float("nan")
    print(f"\nranked mode: {args.submission} on {torch.cuda.get_device_name()}")
    print(f"{'kind':5} {'shape':>10} {'checked':>8} {'mean_us':>9} {'median':>8}")
    for r in rows:
        print(f"{r['kind']:5} {r['batch']:>4}x{r['kv_len']:<5} {r['passed']:>3}/{r['checked']:<4} "
              f"{r['mean_us']:9.1f} {r['median_us']:8.1f}"
              + (f"  vs {r['against']['mean_us']:8.1f} ({r['against']['passed']}/{r['against']['checked']}),"
                 f" paired {r['ratio']:5.3f} (means {r['mean_ratio']:5.3f})" if "against" in r else ""))
        if r["first_failure"]:
            print(f"      first failure: {r['first_failure']}")
    print(f"geomean of means over the benchmark shapes: {geomean:.1f} us")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "check_submission_ranked.json").write_text(
            json.dumps({"rows": rows, "geomean_us": geomean}, indent=1))
    return verdict(args, rows, "pass", "FAIL: a ranked call's check failed at", "ratio")


if __name__ == "__main__":
    sys.exit(main())
