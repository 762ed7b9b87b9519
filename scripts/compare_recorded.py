"""Two serving variants side by side at every cell of a recorded serving sweep where both were timed.

    PYTHONPATH=. python scripts/compare_recorded.py [--results R] --defaults
    PYTHONPATH=. python scripts/compare_recorded.py [--results R] --family fp8/h128/q1 --pair A B

Reads a serving sweep's results (`*.serving.results.jsonl.gz` under docs/data/sweep: each
step's median time of one variant at one (batch, kv_len) cell, timed as the sweep times).
`--pair A B` compares variant B to variant A in one family; `--defaults` compares, in every
family where both were timed, split-K's default serving variant of today's code for the
results' GPU (`default_serving_variant` with the results' platform) against the one the sweep
timed as its unbudgeted default (a `triton` variant without split_budget and with more than
one split, of the same tiles and warps), and each one's split partials at max_batch 256
(allocated on the meta device, on the results' GPU's SMs). Per pair: the cells both were
timed at, and the median, p10, p90 and max of B's time over A's at each cell (each variant's
least time there: the sweep times a cell's survivors again in later rungs), then the cells
where B is more than 8% slower. No GPU.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mla_tune import gpu
from mla_tune.backends import get_backend
from mla_tune.backends.triton_splitk import serving_workspace_args
from mla_tune.core import CallSpec, Variant
from mla_tune.kernels.flash_decode import FlashDecodeServingWorkspace
from mla_tune.kernels.serving_runner import SharedScratch
from mla_tune.serving.results import read_records

RESULTS = Path("docs/data/sweep/h200-2026-12-02-gluon/H200.serving.results.jsonl.gz")
MAX_BATCH = 256


def _partials_gib(variant: Variant, spec: CallSpec, sm_count: int) -> float:
    """A split-K serving variant's split partials at MAX_BATCH sequences of max_q_len new
    tokens, as its runner allocates them on a GPU of sm_count SMs."""
    workspace = FlashDecodeServingWorkspace.allocate(
        MAX_BATCH * spec.max_q_len, spec.heads, variant.p["max_splits"], "meta", max_q_len=spec.max_q_len,
        **(serving_workspace_args(variant, sm_count) or {}))
    return SharedScratch.shared_bytes(workspace) / 2**30


def _read(path: Path) -> tuple[dict, dict]:
    """(the header, {family tag: {(batch, kv_len): {variant text: least median us}}}), read by
    the sweep's own reader (serving/results.read_records)."""
    header, records, _warnings = read_records(path)
    times = {}
    for row in records:
        if row.get("kind") != "step" or row.get("status") != "ok":
            continue
        f = row["family"]
        tag = f"{f['kv_format']}/h{f['heads']}/q{f['q_len']}/p{f['page_size']}"
        cell = times.setdefault(tag, {}).setdefault((row["batch"], row["kv_len"]), {})
        cell[row["variant"]] = min(cell.get(row["variant"], float("inf")), row["time"]["median_us"])
    return header or {}, times


def _compare(tag: str, cells: dict, a: str, b: str) -> None:
    pairs = sorted((at, t[a], t[b]) for at, t in cells.items() if a in t and b in t)
    if not pairs:
        print(f"{tag}: no cell timed both\n  A {a}\n  B {b}")
        return
    ratios = sorted(tb / ta for _at, ta, tb in pairs)
    n = len(ratios)
    print(f"{tag}: {n} cells, B / A median {statistics.median(ratios):.3f}, p10 {ratios[n // 10]:.3f}, "
          f"p90 {ratios[9 * n // 10]:.3f}, max {ratios[-1]:.3f}\n  A {a}\n  B {b}")
    slower = [f"{batch}x{kv} {ta:.1f}->{tb:.1f}" for (batch, kv), ta, tb in pairs if tb > 1.08 * ta]
    if slower:
        print(f"  B more than 8% slower at {len(slower)}: {', '.join(slower)}")


def _old_default(variants, new: Variant) -> str | None:
    """The unbudgeted default the sweep timed beside `new`: its tiles and warps, no budget."""
    same = ("block_h", "block_n", "num_warps", "dot_dtype", "num_stages", "q")
    for text in sorted(variants):
        v = Variant.parse(text)
        if (v.backend == "triton" and "split_budget" not in v.p and v.get("max_splits") > 1
                and all(v.get(k) == new.get(k) for k in same)):
            return text
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--defaults", action="store_true", help="today's split-K default against the sweep's unbudgeted one")
    ap.add_argument("--family", help="a family's tag as printed, e.g. fp8/h128/q1/p64 (with --pair)")
    ap.add_argument("--pair", nargs=2, metavar=("A", "B"), help="two variants of --family")
    args = ap.parse_args()
    if args.defaults == bool(args.pair):
        ap.error("give --defaults, or --pair A B with --family")
    header, times = _read(args.results)
    if args.pair:
        if args.family not in times:
            ap.error(f"no family {args.family!r} in {args.results}; it has {', '.join(sorted(times))}")
        _compare(args.family, times[args.family], *args.pair)
        return
    platform = gpu.fake_platform(header["platform"]["name"])
    triton = get_backend("triton")
    for tag, cells in sorted(times.items()):
        kv, heads, q_len, page = tag.split("/")
        spec = CallSpec(kv, page_size=int(page[1:]), heads=int(heads[1:]), max_q_len=int(q_len[1:]))
        new = triton.default_serving_variant(spec, platform)
        old = _old_default({v for t in cells.values() for v in t}, new)
        if old is None or old == str(new):
            print(f"{tag}: the default {new} is the one the sweep timed" if old else
                  f"{tag}: no unbudgeted default of the same tiles was timed")
            continue
        _compare(tag, cells, old, str(new))
        sms = header["platform"]["sm_count"]
        print(f"  split partials at max_batch {MAX_BATCH}: A {_partials_gib(Variant.parse(old), spec, sms):.3f} GiB, "
              f"B {_partials_gib(new, spec, sms):.3f} GiB")


if __name__ == "__main__":
    main()
