"""Host time and GPU time per serving call, mla-tune's one call beside the vendors' own calls.

    PYTHONPATH=. python scripts/bench_serving_host.py [--batch 32] [--heads 128] [--out DIR]
        [--no-leaderboard]

A ragged batch (kv_len 3980-4019, one new token each) in 64-token pages, as an engine's
decode step calls it, bf16 and fp8 KV. Rows per backend that serves the call (triton,
triton_fused, flashmla, flashinfer): `mla_tune.serving.call.Decoder` (its __call__,
checks included), its runner alone, and a DecodePlan's run (serving/decode_plan.py: one update,
then the step's per-layer fast path: replayed Triton launches for the own kernels,
FlashMLA's op called directly, FlashInfer's run); beside them FlashMLA's
`flash_mla_with_kvcache` called directly (its schedule made once) and FlashInfer's
`BatchMLAPagedAttentionWrapper.run` after one `plan`. Then DecodePlan.run and the vendors'
direct calls again at 16 heads (bf16), FlashInfer's `plan` alone (_flashinfer_plan_rows:
whether it waits for the GPU), and the leaderboard entry beside its bare runner.
Host time: timing.host_time (calls back to back, GPU busy ahead); GPU time:
timing.time_call (the leaderboard protocol). Each result is checked against
mla_tune.serving.inputs' fp32 reference first (strict rule). A vendor whose wheel is missing is
a row with its reason. The last table: host us per DecodePlan.run beside the vendors'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, CallSpec
from mla_tune.problem import RULES, check
from mla_tune.serving import inputs as serving
from mla_tune.tune.timing import hold_gpu, host_round, host_time, time_call

PAGE = 64
DEVICE = "cuda"
BACKENDS = ("triton", "triton_fused", "flashmla", "flashinfer")
FI_DIRECT, FM_DIRECT = "flashinfer run direct", "flash_mla direct"


def _q_format(variant) -> str:
    return "fp8" if str(variant.get("q") if hasattr(variant, "get") else variant).startswith("fp8") else "bf16"


def _calls(inp, kv_format: str, heads: int, batch: int, full: bool):
    """{name: (fn, variant or q format)} and error rows, for one input."""
    from mla_tune.serving.call import Decoder
    from mla_tune.serving.decode_plan import DecodePlan

    calls, errors = {}, []
    layout = {"block_table": inp.block_table, "seq_lens": inp.seq_lens}
    kw = {**layout, "q_lens_host": inp.q_lens, "kv_lens_host": inp.kv_lens}
    pos = (inp.q, inp.qo_indptr, inp.kv, inp.kv_scale)
    for backend in BACKENDS:
        spec = CallSpec(kv_format, page_size=PAGE, heads=heads, max_q_len=1, host_lengths=backend == "flashinfer")
        try:
            dec = Decoder(spec, backend=backend, device=DEVICE)
            plan = DecodePlan(spec, max_batch=batch, backend=backend, device=DEVICE)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot serve (or is not installed) is a row
            errors.append({"call": f"DecodePlan.run {backend}", "error": f"{type(exc).__name__}: {exc}"})
            continue
        if full:
            calls[f"Decoder {backend}"] = (lambda dec=dec: dec(*pos, **kw), dec.variant)
            calls[f"runner {backend}"] = (lambda r=dec.runner: r(*pos, **kw), dec.variant)
        plan.update(inp.qo_indptr, **kw)
        calls[f"DecodePlan.run {backend}"] = (lambda plan=plan: plan.run(inp.q, inp.kv, inp.kv_scale),
                                              plan.pick(batch))
    for name, make in ((FM_DIRECT, _direct_flashmla), (FI_DIRECT, _direct_flashinfer)):
        try:
            calls[name] = make(inp, kv_format, heads)
        except Exception as exc:  # noqa: BLE001 - a missing wheel or kernel is a row
            errors.append({"call": name, "error": f"{type(exc).__name__}: {exc}"})
    return calls, errors


def _kv_lens(batch: int) -> list[int]:
    """The benchmark's lengths: 3980-4019 tokens, ragged."""
    return [3980 + (i * 7) % 40 for i in range(batch)]


def _pages(kv_lens) -> list[int]:
    return [-(-n // PAGE) for n in kv_lens]


def _rows(batch: int, heads: int, kv_formats, full: bool):
    kv_lens = _kv_lens(batch)
    for kv_format in kv_formats:
        inp = serving.make_input([1] * batch, kv_lens, heads, PAGE, kv_format, seed=7, device=DEVICE)
        ref = {q: inp.reference(q_format=q) for q in ("bf16", "fp8")}
        calls, errors = _calls(inp, kv_format, heads, batch, full)
        base = {"heads": heads, "kv": kv_format}
        for row in errors:
            yield {**base, **row}
        for name, (fn, variant) in calls.items():
            try:
                out = fn().clone()
                got = check(out.float(), ref[_q_format(variant)], RULES["strict"])
                host = host_time(fn)
                gpu = time_call(fn, reps=30)
                yield {**base, "call": name, "variant": str(variant), "strict": got.passed,
                       "host_us": round(host.median_us, 2), "host_p90_us": round(host.p90_us, 2),
                       "gpu_us": round(gpu.median_us, 2), "gpu_spread": round(gpu.spread, 3)}
            except Exception:  # noqa: BLE001
                yield {**base, "call": name, "error": traceback.format_exc(limit=3)}


def _direct_flashmla(inp, kv_format: str, heads: int):
    import flash_mla

    from mla_tune.kernels.q_quant import QQuantizer

    batch = inp.seq_lens.shape[0]
    fp8 = kv_format == "fp8"
    sched = flash_mla.get_mla_metadata()[0]
    sched.tile_scheduler_metadata, sched.num_splits = flash_mla.get_mla_decoding_metadata(
        inp.seq_lens, heads, 1, h_q=heads, is_fp8_kvcache=fp8, use_legacy=True)
    pages = inp.kv.view(inp.kv.shape[0], PAGE, 1, QK_DIM)
    if fp8:
        # QQuantizer reads rows of 16 heads; one per-tensor scale over all of q either way
        quant = QQuantizer("fp8_dynamic", batch * heads // 16, inp.q.device, torch.float8_e4m3fn, None)
        q8, q_scale = quant(inp.q.view(batch * heads // 16, 16, QK_DIM))  # quantized once, outside
        q8 = q8.view(batch, 1, heads, QK_DIM)

        def call():
            return flash_mla.flash_mla_with_kvcache(
                q8, pages, inp.block_table, inp.seq_lens, V_DIM, sched, softmax_scale=SM_SCALE,
                causal=False, is_fp8_kvcache=True, use_legacy=True, descale_q=q_scale,
                descale_k=inp.kv_scale)[0].view(batch, heads, V_DIM)
        return call, "fp8 q (made outside)"
    q4 = inp.q.view(batch, 1, heads, QK_DIM)

    def call_bf16():
        return flash_mla.flash_mla_with_kvcache(
            q4, pages, inp.block_table, inp.seq_lens, V_DIM, sched, softmax_scale=SM_SCALE,
            causal=False, is_fp8_kvcache=False, use_legacy=True)[0].view(batch, heads, V_DIM)
    return call_bf16, "bf16 q"


def _direct_flashinfer(inp, kv_format: str, heads: int):
    """fa3, planned once; fp8 KV with FlashInfer's own float scales (the scale read once,
    here, outside the timing), bf16 q."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    batch = inp.seq_lens.shape[0]
    dev = inp.q.device
    pages = _pages(inp.kv_lens)
    kv_indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    kv_indices = torch.cat([inp.block_table[b, :p] for b, p in enumerate(pages)]).to(torch.int32)
    wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), backend="fa3")
    wrapper.plan(inp.qo_indptr, kv_indptr, kv_indices, inp.seq_lens, heads, 512, 64, PAGE, False,
                 SM_SCALE, torch.bfloat16, inp.kv.dtype)
    scales = {} if kv_format == "bf16" else {"ckv_scale": float(inp.kv_scale), "kpe_scale": float(inp.kv_scale)}
    out = torch.empty((batch, heads, V_DIM), dtype=torch.bfloat16, device=dev)
    ckv, kpe = inp.kv[..., :512], inp.kv[..., 512:]
    q_nope, q_pe = inp.q[..., :512], inp.q[..., 512:]

    def call():
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out, **scales)
        return out
    return call, "bf16 q"


def _flashinfer_plan_rows(heads_list=(16, 128), batches=(1, 32, 256), held_us: float = 3000.0, reps: int = 21):
    """FlashInfer's `plan` alone (fa3, bf16, 64-token pages, one new token a sequence, lengths
    3980-4019), called as the flashinfer backend calls it: the lengths as new int32 CPU
    tensors each call. Host us per call, medians over `reps`: with the GPU idle, with
    `held_us` of GPU work queued ahead (a plan that waits for the stream takes about that
    much longer), and the same with the CPU tensors pinned (made outside the timing)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    for heads in heads_list:
        wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=DEVICE),
                                                backend="fa3")
        for batch in batches:
            times = {name: _plan_us(wrapper, heads, batch, held, pin, reps)
                     for name, held, pin in (("idle_us", 0.0, False), ("busy_us", held_us, False),
                                             ("busy_pinned_us", held_us, True))}
            yield {"heads": heads, "batch": batch, "reps": reps, "held_us": held_us, **times}


def _plan_us(wrapper, heads: int, batch: int, held_us: float, pin: bool, reps: int) -> float:
    """Median host us of one wrapper.plan at `batch` sequences (see _flashinfer_plan_rows)."""
    kv_lens = _kv_lens(batch)
    pages = _pages(kv_lens)
    indices = torch.arange(sum(pages), dtype=torch.int32, device=DEVICE)
    lists = ([0, *range(1, batch + 1)], [0, *torch.tensor(pages).cumsum(0).tolist()], kv_lens)
    out = []
    for rep in range(reps + 1):  # the first plans once untimed (JIT module, buffers)
        pinned = [torch.tensor(x, dtype=torch.int32).pin_memory() for x in lists] if pin else None
        torch.cuda.synchronize()
        if held_us:
            hold_gpu(held_us)
        t0 = time.perf_counter()
        qo, kv, lens = pinned or [torch.tensor(x, dtype=torch.int32) for x in lists]
        wrapper.plan(qo, kv, indices, lens, heads, 512, 64, PAGE, False, SM_SCALE, torch.bfloat16, torch.bfloat16)
        if rep:
            out.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(out), 1)


def _paired_dispatch_us(entry, bare, calls: int = 50, rounds: int = 41) -> dict:
    """Host us per call of `entry` and `bare` in alternating rounds (each round: `calls`
    calls back to back, timing.host_round), and the median of the per-pair differences: the
    dispatch's cost with the machine's drift cancelled, which a difference of two separately
    taken medians (~60-90 us each) does not do."""
    entry(), bare()
    torch.cuda.synchronize()
    pairs = []
    for i in range(rounds):
        first, second = (entry, bare) if i % 2 == 0 else (bare, entry)
        a, b = host_round(first, calls), host_round(second, calls)
        pairs.append((a, b) if i % 2 == 0 else (b, a))
    diffs = sorted(a - b for a, b in pairs)
    med = statistics.median
    return {"entry_host_us": round(med(a for a, _ in pairs), 2), "runner_host_us": round(med(b for _, b in pairs), 2),
            "dispatch_us": round(med(diffs), 2), "dispatch_p10_us": round(diffs[len(diffs) // 10], 2),
            "dispatch_p90_us": round(diffs[(len(diffs) * 9) // 10], 2), "rounds": rounds}


def _leaderboard_rows():
    """The leaderboard entry (runtime.custom_kernel over tables/H200.yaml) beside its bare
    runner: host time per call at each of the 8 shapes, paired rounds (the dispatch's limit:
    5 us)."""
    from mla_tune import problem, runtime

    rt = runtime.load(table="tables/H200.yaml", allow_other_gpu=True)
    for batch in (4, 32, 64, 256):
        for kv_len in (1024, 8192):
            data = problem.generate_input(batch, kv_len, 11, device=DEVICE)
            rt.custom_kernel(data)
            runner = next(r for (v, s, _d), r in rt.dispatcher._runners.items()
                          if (s.batch, s.kv_len) == (batch, kv_len))
            q, kv_data, qo_indptr, kv_indptr, _config = data
            paired = _paired_dispatch_us(lambda data=data: rt.custom_kernel(data),
                                         lambda r=runner, a=(q, kv_data, qo_indptr, kv_indptr): r(*a))
            yield {"shape": f"{batch}x{kv_len}", **paired}


def _summary(rows, batch: int) -> list[str]:
    """Host us per DecodePlan.run per backend beside the vendors' direct calls, a line per
    (heads, KV); '-' where the call did not run (its error row says why)."""
    cols = {**{f"DecodePlan.run {b}": b for b in BACKENDS}, FI_DIRECT: "fi run*", FM_DIRECT: "fmla call*"}
    lines = [f"host us per call, batch {batch}, kv_len ~4000, q_len 1, {PAGE}-token pages: "
             "DecodePlan.run per backend | the vendors' own calls*",
             f"{'heads':>5} {'kv':5} " + " ".join(f"{label:>12}" for label in cols.values())]
    for heads, kv in dict.fromkeys((r["heads"], r["kv"]) for r in rows):
        got = {r["call"]: r for r in rows if (r["heads"], r["kv"]) == (heads, kv) and "error" not in r}
        cells = [f"{got[c]['host_us']:12.1f}" if c in got else f"{'-':>12}" for c in cols]
        lines.append(f"{heads:>5} {kv:5} " + " ".join(cells))
    lines.append("* FlashInfer's run after one plan; flash_mla_with_kvcache with its schedule made once "
                 "(fp8: q quantized outside)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-leaderboard", action="store_true", help="Skip the leaderboard entry's rows.")
    args = parser.parse_args()
    rows = list(_rows(args.batch, args.heads, ("bf16", "fp8"), full=True))
    if args.heads != 16:
        rows += list(_rows(args.batch, 16, ("bf16",), full=False))
    print(f"\n{torch.cuda.get_device_name()}: batch {args.batch}, q_len 1, kv_len 3980-4019, {PAGE}-token pages")
    print(f"{'heads':>5} {'kv':5} {'call':32} {'strict':>6} {'host_us':>8} {'p90':>7} {'gpu_us':>8} {'spread':>6}  variant")
    for r in rows:
        if "error" in r:
            print(f"{r['heads']:>5} {r['kv']:5} {r['call']:32} ERROR {r['error'].strip().splitlines()[-1][:110]}")
        else:
            print(f"{r['heads']:>5} {r['kv']:5} {r['call']:32} {'ok' if r['strict'] else 'FAIL':>6} "
                  f"{r['host_us']:8.1f} {r['host_p90_us']:7.1f} {r['gpu_us']:8.1f} {r['gpu_spread']:6.3f}  "
                  f"{r['variant']}")
    try:
        fi_plan = list(_flashinfer_plan_rows())
    except Exception:  # noqa: BLE001 - a missing wheel is a line
        fi_plan = []
        print("flashinfer plan rows:", traceback.format_exc(limit=3))
    if fi_plan:
        print(f"\nFlashInfer's plan alone (host us per call, median of {fi_plan[0]['reps']}; busy: "
              f"{fi_plan[0]['held_us']:.0f} us of GPU work queued ahead)")
        print(f"{'heads':>5} {'batch':>5} {'idle':>8} {'busy':>8} {'busy, pinned':>13}")
        for r in fi_plan:
            print(f"{r['heads']:>5} {r['batch']:>5} {r['idle_us']:8.1f} {r['busy_us']:8.1f} {r['busy_pinned_us']:13.1f}")
    board = []
    if not args.no_leaderboard:
        try:
            board = list(_leaderboard_rows())
        except Exception:  # noqa: BLE001
            print("leaderboard entry rows:", traceback.format_exc(limit=3))
    if board:
        print("\nleaderboard entry (runtime.custom_kernel, tables/H200.yaml) vs its bare runner, host us/call")
        for r in board:
            print(f"{r['shape']:>9} entry {r['entry_host_us']:7.1f} runner {r['runner_host_us']:7.1f} "
                  f"dispatch {r['dispatch_us']:6.2f} (p10 {r['dispatch_p10_us']:.2f}, p90 {r['dispatch_p90_us']:.2f}, "
                  f"{r['rounds']} paired rounds)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving_host.json").write_text(json.dumps({"serving": rows, "flashinfer_plan": fi_plan,
                                                                "leaderboard": board}, indent=1))
    print()
    print("\n".join(_summary(rows, args.batch)))


if __name__ == "__main__":
    main()
