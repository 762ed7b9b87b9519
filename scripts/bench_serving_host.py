"""Host time and GPU time per serving call, mla-tune's one call beside the vendors' own calls.

    PYTHONPATH=. python scripts/bench_serving_host.py [--batch 32] [--heads 128] [--out DIR]

A ragged batch (kv_len 3980-4019, one new token each) in 64-token pages, as an engine's
decode step calls it. Rows: `mla_tune.runtime.decode.Decoder` per backend that serves the
call (its __call__, checks included, and its runner alone), FlashMLA's
`flash_mla_with_kvcache` called directly, a DecodePlan's run (runtime/plan.py), with its schedule made once, FlashInfer's
`BatchMLAPagedAttentionWrapper.run` after one `plan`. Host time: timing.host_time (calls
back to back, GPU busy ahead); GPU time: timing.time_call (the leaderboard protocol).
Each result is checked against mla_tune.serving's fp32 reference first (strict rule).
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch

from mla_tune import serving
from mla_tune.core import QK_DIM, SM_SCALE, V_DIM, CallSpec
from mla_tune.problem import RULES, check
from mla_tune.tune.timing import host_time, time_call

PAGE = 64


def _rows(args):
    kv_lens = [3980 + (i * 7) % 40 for i in range(args.batch)]
    for kv_format in ("bf16", "fp8"):
        inp = serving.make_input([1] * args.batch, kv_lens, args.heads, PAGE, kv_format, seed=7, device="cuda")
        spec = CallSpec(kv_format, page_size=PAGE, heads=args.heads, max_q_len=1)
        layout = {"block_table": inp.block_table, "seq_lens": inp.seq_lens}
        host_lens = {"q_lens_host": inp.q_lens, "kv_lens_host": inp.kv_lens}
        ref = {q: inp.reference(q_format=q) for q in ("bf16", "fp8")}
        calls = {}
        pos = (inp.q, inp.qo_indptr, inp.kv, inp.kv_scale)
        kw = {**layout, **host_lens}
        from mla_tune.runtime.decode import Decoder

        for backend in ("triton", "triton_fused", "flashmla", "flashinfer"):
            try:
                dec = Decoder(spec if backend != "flashinfer" else CallSpec(
                    kv_format, page_size=PAGE, heads=args.heads, max_q_len=1, host_lengths=True),
                    backend=backend, device="cuda")
            except Exception as exc:  # noqa: BLE001 - a backend that cannot serve is a row
                yield {"kv": kv_format, "call": f"Decoder {backend}", "error": f"{type(exc).__name__}: {exc}"}
                continue
            calls[f"Decoder {backend}"] = (
                lambda dec=dec, pos=pos, kw=kw: dec(*pos, **kw),
                dec.variant)
            calls[f"runner {backend}"] = (lambda runner=dec.runner, pos=pos, kw=kw: runner(*pos, **kw),
                                           dec.variant)
            try:
                from mla_tune.runtime.plan import DecodePlan

                plan = DecodePlan(dec.spec, max_batch=args.batch, backend=backend, device="cuda")
                plan.update(inp.qo_indptr, **kw)
                calls[f"DecodePlan.run {backend}"] = (
                    lambda plan=plan, inp=inp: plan.run(inp.q, inp.kv, inp.kv_scale), plan.pick(args.batch))
            except Exception as exc:  # noqa: BLE001
                yield {"kv": kv_format, "call": f"DecodePlan {backend}", "error": f"{type(exc).__name__}: {exc}"}
        try:
            calls.update(_direct_flashmla(inp, kv_format, args.heads))
        except Exception:  # noqa: BLE001
            yield {"kv": kv_format, "call": "flash_mla direct", "error": traceback.format_exc(limit=2)}
        if kv_format == "bf16":
            try:
                calls.update(_direct_flashinfer(inp, args.heads))
            except Exception:  # noqa: BLE001
                yield {"kv": kv_format, "call": "flashinfer direct", "error": traceback.format_exc(limit=2)}
        for name, (fn, variant) in calls.items():
            try:
                out = fn().clone()
                q_format = "fp8" if "fp8" in str(variant.get("q") if hasattr(variant, "get") else variant) else "bf16"
                got = check(out.float(), ref[q_format], RULES["strict"])
                host = host_time(fn)
                gpu = time_call(fn, reps=30)
                yield {"kv": kv_format, "call": name, "variant": str(variant), "strict": got.passed,
                       "host_us": round(host.median_us, 2), "host_p90_us": round(host.p90_us, 2),
                       "gpu_us": round(gpu.median_us, 2), "gpu_spread": round(gpu.spread, 3)}
            except Exception:  # noqa: BLE001
                yield {"kv": kv_format, "call": name, "error": traceback.format_exc(limit=3)}


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
        return {"flash_mla direct (q fp8 outside)": (call, "fp8 q")}
    q4 = inp.q.view(batch, 1, heads, QK_DIM)

    def call_bf16():
        return flash_mla.flash_mla_with_kvcache(
            q4, pages, inp.block_table, inp.seq_lens, V_DIM, sched, softmax_scale=SM_SCALE,
            causal=False, is_fp8_kvcache=False, use_legacy=True)[0].view(batch, heads, V_DIM)
    return {"flash_mla direct": (call_bf16, "bf16 q")}


def _direct_flashinfer(inp, heads: int):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    batch = inp.seq_lens.shape[0]
    dev = inp.q.device
    pages = [-(-n // PAGE) for n in inp.kv_lens]
    kv_indptr = torch.tensor([0] + list(torch.tensor(pages).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    kv_indices = torch.cat([inp.block_table[b, :p] for b, p in enumerate(pages)]).to(torch.int32)
    wrapper = BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), backend="fa3")
    wrapper.plan(inp.qo_indptr, kv_indptr, kv_indices, inp.seq_lens, heads, 512, 64, PAGE, False,
                 SM_SCALE, torch.bfloat16, torch.bfloat16)
    out = torch.empty((batch, heads, V_DIM), dtype=torch.bfloat16, device=dev)
    ckv, kpe = inp.kv[..., :512], inp.kv[..., 512:]
    q_nope, q_pe = inp.q[..., :512], inp.q[..., 512:]

    def call():
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
        return out
    return {"flashinfer run (fa3, planned once)": (call, "bf16 q")}


def _leaderboard_rows():
    """The leaderboard entry (runtime.custom_kernel over tables/H200.yaml) beside its bare
    runner: host time per call at each of the 8 shapes (issue 10: dispatch within 5 us)."""
    from mla_tune import problem, runtime

    rt = runtime.load(table="tables/H200.yaml", allow_other_gpu=True)
    for batch in (4, 32, 64, 256):
        for kv_len in (1024, 8192):
            data = problem.generate_input(batch, kv_len, 11, device="cuda")
            rt.custom_kernel(data)
            runner = next(r for (v, s, _d), r in rt.dispatcher._runners.items()
                          if (s.batch, s.kv_len) == (batch, kv_len))
            q, kv_data, qo_indptr, kv_indptr, _config = data
            entry = host_time(lambda data=data: rt.custom_kernel(data))
            bare = host_time(lambda r=runner, a=(q, kv_data, qo_indptr, kv_indptr): r(*a))
            yield {"shape": f"{batch}x{kv_len}", "entry_host_us": round(entry.median_us, 2),
                   "runner_host_us": round(bare.median_us, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for row in _rows(args):
        rows.append(row)
        if "error" in row:
            print(f"{row['kv']:5} {row['call']:38} ERROR {row['error'].strip().splitlines()[-1][:120]}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}: batch {args.batch}, {args.heads} heads, q_len 1, "
          f"kv_len 3980-4019, {PAGE}-token pages")
    print(f"{'kv':5} {'call':38} {'strict':>6} {'host_us':>8} {'p90':>7} {'gpu_us':>8} {'spread':>6}")
    for r in rows:
        if "error" not in r:
            print(f"{r['kv']:5} {r['call']:38} {'ok' if r['strict'] else 'FAIL':>6} {r['host_us']:8.1f} "
                  f"{r['host_p90_us']:7.1f} {r['gpu_us']:8.1f} {r['gpu_spread']:6.3f}")
    board = []
    try:
        board = list(_leaderboard_rows())
    except Exception:  # noqa: BLE001
        print("leaderboard entry rows:", traceback.format_exc(limit=3))
    if board:
        print("\nleaderboard entry (runtime.custom_kernel, tables/H200.yaml) vs its bare runner, host us/call")
        for r in board:
            print(f"{r['shape']:>9} entry {r['entry_host_us']:7.1f} runner {r['runner_host_us']:7.1f} "
                  f"dispatch {r['entry_host_us'] - r['runner_host_us']:6.1f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "serving_host.json").write_text(json.dumps({"serving": rows, "leaderboard": board}, indent=1))


if __name__ == "__main__":
    main()
