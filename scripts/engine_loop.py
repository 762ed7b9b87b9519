"""A decode loop like an engine's: mla-tune's DecodePlan beside FlashMLA called directly.

    PYTHONPATH=. python scripts/engine_loop.py [--layers 61] [--heads 128] [--kv bf16]
        [--q-len 1] [--buckets 8,32] [--steps 16] [--lens 500,4000] [--table tables/H200.serving.yaml]
        [--variants "V1;V2"] [--out DIR]

Per batch bucket: sequences of `--lens` tokens (each drawn uniformly, seeded by the bucket)
in 64-token pages (each layer its own KV cache), one CUDA graph per bucket holding every
layer's run (its output copied out as an engine's next op would read it), replayed while
every sequence grows by one token per step; before each replay the plan's update runs on
the host with the engine's host lengths (the protocol of docs/serving.md; the step's time
includes it). The same loop with FlashMLA's own call (its schedule made once per step
inside the graph) is timed beside it. `--variants` (with `--table`; `graph-picks` in the
list stands for every variant the family's graph picks name, `cell-picks` for its eager
cells' picks and runner-ups; a variant the sweep's gate refused is left out, said in a line)
times the loop again with each variant as the bucket's graph pick, on the same lengths: what
each candidate costs an engine's step. `--q-len N`: each sequence brings N new tokens a step (a spec of max_q_len
N). Before timing, the first and last layers' outputs of the first and last step are
checked against mla_tune.serving.inputs' fp32 reference (strict rule), its q quantized as
the pick's q mode does (gate.variant_q_format: per row for the fused kernels' fp8 q). Prints ms per step
and us per layer; `--out DIR` writes DIR/engine_loop.json (atomically), the report
`mla-tune verify --table T --engine-loop REPORT --repick-graph OUT` re-chooses graph picks
on (mla_tune/serving/repick.py: ENGINE_REPORT).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from mla_tune import gpu, problem
from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, CallSpec, Variant
from mla_tune.fileio import atomic_write_text
from mla_tune.serving import inputs as serving
from mla_tune.serving.decode_plan import DecodePlan
from mla_tune.serving.gate import variant_q_format
from mla_tune.serving.repick import ENGINE_REPORT
from mla_tune.serving.table import gate_refused, load_serving_table

PAGE = 64
GRAPH_PICKS = "graph-picks"  # in --variants: the family's graph picks, each a candidate at every bucket
CELL_PICKS = "cell-picks"  # in --variants: the family's eager cell picks and runner-ups likewise


def loop_candidates(text: str, table, spec: CallSpec) -> tuple[list[Variant], list[str]]:
    """The variants `--variants` names (;-separated; GRAPH_PICKS and CELL_PICKS expanded from
    the family's entries), each once, in order, and a line for each left out: one the sweep's
    gate refused for the family (table.gate_refused), which no re-choice takes, so its loop
    is not run. ValueError where the table has no family for the spec."""
    names = [v.strip() for v in text.split(";") if v.strip()]
    family = table.family(spec) if names else None
    if names and family is None:
        raise ValueError(f"{table.path} has no family for {spec.kv_format} KV, {spec.heads} heads, "
                         f"q_len {spec.max_q_len}")
    variants = []
    for name in names:
        if name == GRAPH_PICKS:
            variants += [g.variant for _, g in sorted(family.graph.items())]
        elif name == CELL_PICKS:
            for _, cell in sorted(family.cells.items()):
                variants += [cell.variant] + ([cell.runner_up_variant] if cell.runner_up_variant else [])
        else:
            variants.append(Variant.parse(name))
    refused = gate_refused(table, family.key) if family is not None else {}
    variants = list(dict.fromkeys(variants))
    return ([v for v in variants if str(v) not in refused],
            [f"{v}: refused by the sweep's gate ({refused[str(v)]}); not looped" for v in variants if str(v) in refused])


def _loop(args, bucket: int, layers: int):
    """Static tensors of one bucket's loop: caches, block table, lengths, q and outputs."""
    gen = torch.Generator().manual_seed(bucket)
    start = [int(x) for x in torch.randint(args.lens[0], args.lens[1], (bucket,), generator=gen)]
    grow = args.steps + 1
    base = serving.make_input([args.q_len] * bucket, [n + grow for n in start], args.heads, PAGE, args.kv,
                              seed=bucket, device="cuda")
    caches = [base.kv] + [torch.empty_like(base.kv) for _ in range(layers - 1)]
    for cache in caches[1:]:  # every layer its own cache: fresh random tokens, same pages
        cache.copy_(torch.randn(cache.shape, device="cuda").to(cache.dtype))
    seq_lens = torch.tensor(start, dtype=torch.int32, device="cuda")
    rows = bucket * args.q_len
    qs = [torch.randn((rows, args.heads, QK_DIM), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    outs = [torch.empty((rows, args.heads, V_DIM), dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    return base, caches, seq_lens, qs, outs, start


def _check(tag, base, caches, seq_lens, qs, outs, q_format):
    for layer in (0, len(caches) - 1):
        ref = serving.reference(qs[layer], base.qo_indptr, caches[layer], base.kv_scale,
                                block_table=base.block_table, seq_lens=seq_lens, q_format=q_format)
        result = problem.check(outs[layer], ref, problem.RULES["strict"])
        if not result.passed:
            raise SystemExit(f"{tag}, layer {layer}: wrong result ({result})")


def _time_steps(graph, seq_lens, steps: int, before_replay=None) -> tuple[list[float], list[float]]:
    """(ms per step, ms of the replay alone): the lengths grow by one token (written in
    place, outside the graph, as an engine does), `before_replay(step)` runs the host's
    per-step work (the plan's update: on the step's critical path here, while an engine
    would overlap it with the previous step's other work), then the replay."""
    steps_ms, replays_ms = [], []
    for i in range(steps):
        seq_lens.add_(1)  # every sequence grew by one token (outside the graph, as an engine)
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        if before_replay is not None:
            before_replay(i + 1)
        mid.record()
        graph.replay()
        end.record()
        end.synchronize()
        steps_ms.append(start.elapsed_time(end))
        replays_ms.append(mid.elapsed_time(end))
    return steps_ms, replays_ms


def run_plan(args, bucket, table, variant=None):
    """The engine's protocol (docs/serving.md): update once per step on the host, with the
    lengths the engine keeps there, then the graph of the layers' runs. `variant`: the
    bucket's graph pick for this run instead of the table's (the table is left as it was)."""
    base, caches, seq_lens, qs, outs, start = _loop(args, bucket, args.layers)
    spec = _spec(args)
    with _graph_pick(table, spec, bucket, variant):
        plan = DecodePlan(spec, max_batch=bucket, table=table, device="cuda")
        return _run(args, bucket, plan, base, caches, seq_lens, qs, outs, start)


def _spec(args) -> CallSpec:
    """The loop's call: a CUDA-graph plan with the engine's host lengths."""
    return CallSpec(args.kv, page_size=PAGE, heads=args.heads, max_q_len=args.q_len, graph=True, host_lengths=True)


@contextlib.contextmanager
def _graph_pick(table, spec, bucket, variant):
    """The table with `variant` as the bucket's graph pick while the plan is made and run."""
    if variant is None:
        yield
        return
    graph = table.family(spec).graph
    was = graph[bucket]
    graph[bucket] = dataclasses.replace(was, variant=variant)
    try:
        yield
    finally:
        graph[bucket] = was


def _run(args, bucket, plan, base, caches, seq_lens, qs, outs, start):
    def update(grown: int):
        plan.update(base.qo_indptr, block_table=base.block_table, seq_lens=seq_lens,
                    q_lens_host=[args.q_len] * bucket, kv_lens_host=[n + grown for n in start])

    def layers():
        for q, cache, out in zip(qs, caches, outs, strict=True):
            out.copy_(plan.run(q, cache, base.kv_scale))

    update(0)
    graph = serving.capture_without_sync(layers)  # runs the layers twice, then captures them
    seq_lens.copy_(torch.tensor(start, dtype=torch.int32, device="cuda"))
    update(0)
    graph.replay()
    q_format = variant_q_format(plan.pick(bucket))  # q as the pick quantizes it (the fused kernels: per row)
    _check(f"mla-tune bucket {bucket} first step", base, caches, seq_lens, qs, outs, q_format)
    times, replays = _time_steps(graph, seq_lens, args.steps, before_replay=update)
    _check(f"mla-tune bucket {bucket} last step", base, caches, seq_lens, qs, outs, q_format)
    return times, replays, str(plan.pick(bucket))


def run_flashmla(args, bucket):
    import flash_mla

    from mla_tune.kernels.q_quant import QQuantizer

    base, caches, seq_lens, qs, outs, start = _loop(args, bucket, args.layers)
    fp8 = args.kv == "fp8"
    pages = [c.view(c.shape[0], PAGE, 1, QK_DIM) for c in caches]
    sched = flash_mla.get_mla_metadata()[0]
    q_len = args.q_len
    quant = ([QQuantizer("fp8_dynamic", bucket * q_len * args.heads // 16, "cuda", torch.float8_e4m3fn) for _ in qs]
             if fp8 else None)

    def step():
        sched.tile_scheduler_metadata, sched.num_splits = flash_mla.get_mla_decoding_metadata(
            seq_lens, q_len * args.heads, 1, h_q=args.heads, is_fp8_kvcache=fp8, use_legacy=True)
        for i, (q, page, out) in enumerate(zip(qs, pages, outs, strict=True)):
            extra = {}
            q4 = q.view(bucket, q_len, args.heads, QK_DIM)
            if fp8:
                q8, q_scale = quant[i](q.view(-1, 16, QK_DIM))
                q4 = q8.view(bucket, q_len, args.heads, QK_DIM)
                extra = {"descale_q": q_scale, "descale_k": base.kv_scale}
            o, _ = flash_mla.flash_mla_with_kvcache(q4, page, base.block_table, seq_lens, V_DIM, sched,
                                                  softmax_scale=SM_SCALE, causal=q_len > 1, is_fp8_kvcache=fp8,
                                                  use_legacy=True, **extra)
            out.copy_(o.view(bucket * q_len, args.heads, V_DIM))

    graph = serving.capture_without_sync(step)
    seq_lens.copy_(torch.tensor(start, dtype=torch.int32, device="cuda"))
    graph.replay()
    q_format = "fp8" if fp8 else "bf16"
    _check(f"flashmla bucket {bucket} first step", base, caches, seq_lens, qs, outs, q_format)
    times, _ = _time_steps(graph, seq_lens, args.steps)
    _check(f"flashmla bucket {bucket} last step", base, caches, seq_lens, qs, outs, q_format)
    return times


def _median(values):
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--q-len", type=int, default=1, help="new tokens per sequence each step (1-4)")
    parser.add_argument("--kv", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--buckets", default="8,32")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--lens", default="500,4000", help="LO,HI: each sequence's first length, drawn in [LO, HI)")
    parser.add_argument("--table", type=Path, default=None, help="a serving table (default: none)")
    parser.add_argument("--variants", default="", help="with --table: ;-separated variants, each timed as "
                        "every bucket's graph pick beside the table's own")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lo, _, hi = args.lens.partition(",")
    args.lens = (int(lo), int(hi))
    if not 1 <= args.lens[0] < args.lens[1]:
        parser.error(f"--lens LO,HI needs 1 <= LO < HI, got {args.lens}")
    if args.variants and args.table is None:
        parser.error("--variants replaces the table's graph picks: give --table")
    table = load_serving_table(args.table) if args.table is not None else None
    spec = _spec(args)
    try:
        variants, left = loop_candidates(args.variants, table, spec) if table is not None else ([], [])
    except ValueError as exc:
        parser.error(str(exc))
    for line in left:
        print(line)
    rows = []
    for bucket in [int(b) for b in args.buckets.split(",")]:
        times, replays, variant = run_plan(args, bucket, table)
        row = {"bucket": bucket, "mla_tune_ms": _median(times), "mla_tune_replay_ms": _median(replays),
               "variant": variant, "steps_ms": {variant: _median(times)}}
        for other in variants:
            if str(other) != variant:
                other_times, _, ran = run_plan(args, bucket, table, other)
                if ran == str(other):
                    row["steps_ms"][str(other)] = _median(other_times)
                else:  # its backend cannot serve the family here: the plan ran a stand-in
                    print(f"bucket {bucket}: {other} cannot run here (the plan ran {ran}); not recorded")
            torch.cuda.empty_cache()
        try:
            fm = run_flashmla(args, bucket)
            row["flashmla_ms"] = _median(fm)
        except Exception as exc:  # noqa: BLE001 - FlashMLA missing: the row says so
            row["flashmla_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        torch.cuda.empty_cache()
    platform = gpu.detect()
    print(f"\n{platform.device_name}: {args.layers} layers, {args.heads} heads, q_len {args.q_len}, {args.kv} KV, {PAGE}-token "
          f"pages, lengths {args.lens[0]}-{args.lens[1]}, one CUDA graph per bucket, {args.steps} steps "
          "(median), all checked strict")
    for r in rows:
        fm = f"{r['flashmla_ms']:.3f} ms" if "flashmla_ms" in r else r["flashmla_error"][:60]
        print(f"bucket {r['bucket']:4}: mla-tune {r['mla_tune_ms']:.3f} ms/step "
              f"({1000 * r['mla_tune_ms'] / args.layers:.1f} us/layer; replay alone {r['mla_tune_replay_ms']:.3f} ms)"
              f"  FlashMLA {fm}  [{r['variant']}]")
        for other, ms in r["steps_ms"].items():
            if other != r["variant"]:
                print(f"    as the graph pick: {ms:.3f} ms/step ({ms / r['mla_tune_ms']:.2f}x)  {other}")
    if args.out:
        report = {"report": ENGINE_REPORT, "gpu": platform.name, "device": platform.device_name,
                  "table": str(args.table) if args.table else None, "kv_format": args.kv, "page_size": PAGE,
                  "heads": args.heads, "q_len": args.q_len, "layers": args.layers, "steps": args.steps,
                  "lens": list(args.lens), "buckets": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "engine_loop.json", json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
