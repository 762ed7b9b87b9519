"""The Gluon serving kernel beside FlashMLA and the own Triton serving kernel (GPU).

    PYTHONPATH=. python scripts/bench_gluon_serving.py [--batches 8,32] [--heads 128] [--kv fp8,bf16]
        [--variant TEXT ...] [--reps 40]

At each (KV format, batch): one call of 64-token pages, q_len 1, sequence lengths drawn from
1000 to 4000 (seeded by the batch), at DeepSeek-V3's softmax scale. Each backend's serving
runner (build_serving of its default serving variant; for gluon_fused also that variant with
a batch budget of one wave of the SMs, its serving_candidates' batch_waves 1; `--variant`
adds gluon_fused serving variants) is checked once against the fp32 reference under the strict rule (fp8 KV: q
quantized in the reference as each kernel's q mode reads it, per (token, head) for
gluon_fused, per tensor for the others), then timed by mla_tune.tune.timing.time_call (the
leaderboard's protocol: a cache flush before each call, median of --reps). FlashMLA runs
through mla-tune's flashmla backend (fp8: q quantized on the device per call, inside the
timing). Each case runs inside try/except and prints its first error line, so one failure
hides nothing else. Prints one line per (KV, batch, backend): median us, spread, its ratio
to FlashMLA's, and the check.
"""

from __future__ import annotations

import argparse

import torch

from mla_tune import problem
from mla_tune.backends import get_backend
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, CallSpec, Variant
from mla_tune.gpu import detect
from mla_tune.serving.gate import reference_q_format
from mla_tune.serving.inputs import make_input, reference, reference_q
from mla_tune.tune.timing import time_call

PAGE = 64


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


class _VariantQGate:  # the gate's option, alone: the reference reads q as the variant does
    reference_q = "variant"


def _reference_q(q: torch.Tensor, variant: Variant) -> torch.Tensor:
    """q as the serving gate's reference reads it for `variant` (gate.reference_q_format
    under `reference_q: variant`: bf16; fp8 per row where the backend says so, gluon_fused;
    else fp8 per tensor)."""
    return reference_q(q, reference_q_format(variant, _VariantQGate))


def _case(variant: Variant, spec: CallSpec, inp, reps: int) -> tuple[float | None, str]:
    """(median us, note) of one backend's runner at one input; None and the error line on failure."""
    runner = get_backend(variant.backend).build_serving(variant, spec, "cuda")

    def call():
        return runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)

    out = call()
    torch.cuda.synchronize()
    ref = reference(_reference_q(inp.q, variant), inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout,
                    sm_scale=spec.sm_scale)
    verdict = problem.check(out.float(), ref, problem.RULES["strict"])
    timing = time_call(call, reps=reps)
    note = "strict ok" if verdict.passed else f"STRICT FAIL ({verdict.reason})"
    return timing.median_us, f"spread {timing.spread:.2f}, {note}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32", help="batch sizes, comma-separated (default 8,32)")
    parser.add_argument("--heads", type=int, default=128, help="query heads (default 128)")
    parser.add_argument("--kv", default="fp8,bf16", help="KV formats, comma-separated (default fp8,bf16)")
    parser.add_argument("--variant", action="append", default=[],
                        help="a gluon_fused serving variant to time besides the default (repeatable)")
    parser.add_argument("--reps", type=int, default=40, help="timed calls per case (default 40)")
    args = parser.parse_args(argv)
    platform = detect()
    print(f"{'kv':5} {'batch':>5} {'backend':12} {'us':>8} {'vs fmla':>8}  variant; check")
    for kv in args.kv.split(","):
        spec = CallSpec(kv, PAGE, args.heads, graph=True, sm_scale=CORE_DEEPSEEK_V3_SCALE)
        for batch in (int(b) for b in args.batches.split(",")):
            gen = torch.Generator().manual_seed(batch)
            kv_lens = [int(n) for n in torch.randint(1000, 4001, (batch,), generator=gen)]
            inp = make_input([1] * batch, kv_lens, args.heads, PAGE, kv, seed=batch, device="cuda")
            variants = []
            for name in ("flashmla", "gluon_fused", "triton"):
                try:
                    variants.append(get_backend(name).default_serving_variant(spec, platform))
                except Exception as exc:
                    print(f"{kv:5} {batch:>5} {name:12} {'-':>8} {'-':>8}  default variant: {_first_line(exc)}")
            try:  # gluon_fused's default tile with a one-wave batch budget (split_budget)
                default = get_backend("gluon_fused").default_serving_variant(spec, platform)
                space = {"rows": [default.get("block_h")], "v_halves": [default.get("v_halves")],
                         "split_waves": [], "batch_waves": [1]}
                variants += get_backend("gluon_fused").serving_candidates(spec, space, platform)
            except Exception as exc:
                print(f"{kv:5} {batch:>5} {'gluon_fused':12} {'-':>8} {'-':>8}  budget variant: {_first_line(exc)}")
            variants += [Variant.parse(text) for text in args.variant]
            flashmla_us = None
            for variant in variants:
                try:
                    us, note = _case(variant, spec, inp, args.reps)
                except Exception as exc:  # one bug must not hide the other cases
                    us, note = None, _first_line(exc)
                if variant.backend == "flashmla":
                    flashmla_us = us
                ratio = f"{us / flashmla_us:.2f}" if us and flashmla_us else "-"
                shown = f"{us:8.1f}" if us else f"{'-':>8}"
                print(f"{kv:5} {batch:>5} {variant.backend:12} {shown} {ratio:>8}  {variant}; {note}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
