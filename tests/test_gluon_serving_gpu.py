"""The Gluon serving kernel against the fp32 reference on an H200 at DeepSeek-V3's scale,
strict rule, eager and replayed from a CUDA graph; for fp8 KV the reference's q is quantized
per (new token, head) as the kernel does. Each family runs in its own spawned process."""

import concurrent.futures
import multiprocessing
import os

import pytest
import torch

from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, CallSpec, Variant

pytestmark = pytest.mark.gpu

FAMILIES = [(kv, heads, q_len, 64) for kv in ("fp8", "bf16") for heads in (16, 64, 128) for q_len in (1, 2, 4)]
FAMILIES += [(kv, 16, 2, 0) for kv in ("fp8", "bf16")]
LENGTHS = {
    "one": [1],
    "seventeen": [17, 17],
    "long": [3000],
    "ragged": [1, 17, 3000, 64, 65, 129, 2, 4133],
    "batch8": [3000, 1, 1024, 4096, 17, 2500, 64, 3999],
}


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _variants(spec: CallSpec, platform) -> list[Variant]:
    """The default serving variant and one more binary per family: no splits at q_len 1, two
    V halves (4 splits of 256 tokens, a batch budget of 24: a runtime int) at q_len 2 and 4."""
    from mla_tune.backends import gluon_fused

    default = gluon_fused.default_serving_variant(spec, platform)
    if spec.max_q_len == 1:
        return [default, default.with_params(max_splits=1)]
    halves = default.with_params(v_halves=2, max_splits=4, tokens_per_split=256, split_budget=24)
    gluon_fused.validate(halves)
    return [default, halves]


def _verdict(out: torch.Tensor, inp, kv_format: str, sm_scale: float) -> tuple[dict, torch.Tensor]:
    """out against the fp32 reference under the strict rule, on q as the kernel reads it (for fp8
    KV its q8 x scale per (new token, head) row); and the reference's LSE."""
    from mla_tune import problem
    from mla_tune.serving.inputs import reference, reference_q

    q = inp.q if kv_format == "bf16" else reference_q(inp.q, "fp8_row")
    ref, ref_lse = reference(q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout, sm_scale=sm_scale,
                             return_lse=True)
    verdict = problem.check(out.float(), ref, problem.RULES["strict"])
    return dict(ok=verdict.passed, mismatch=verdict.mismatch, max_abs_err=verdict.max_abs_err,
                reason=verdict.reason), ref_lse


def run_family(family: tuple) -> list[dict]:
    """Every (variant, lengths) case of one family, each a dict with its verdict."""
    from mla_tune.backends import gluon_fused
    from mla_tune.gpu import detect
    from mla_tune.serving.inputs import make_input

    kv_format, heads, q_len, page = family
    spec = CallSpec(kv_format, page, heads, max_q_len=q_len, mixed_q_len=True, graph=True,
                    sm_scale=CORE_DEEPSEEK_V3_SCALE, return_lse=q_len == 2)
    results = []
    try:
        variants = _variants(spec, detect())
    except Exception as exc:
        return [{"family": family, "case": "variants", "ok": False, "error": _first_line(exc)}]
    for variant in variants:
        for seed, (name, kv_lens) in enumerate(LENGTHS.items()):
            case = {"family": family, "case": name, "variant": str(variant), "ok": False, "error": None}
            try:
                q_lens = [min(q_len, n) for n in kv_lens]
                inp = make_input(q_lens, kv_lens, heads, page, kv_format, seed=100 + seed, device="cuda")
                runner = gluon_fused.build_serving(variant, spec, "cuda")
                result = runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
                out, lse = result if spec.return_lse else (result, None)
                torch.cuda.synchronize()
                verdict, ref_lse = _verdict(out, inp, kv_format, spec.sm_scale)
                case.update(verdict)
                if lse is not None:
                    case["lse_err"] = float((lse - ref_lse).abs().max())
                    case["ok"] = case["ok"] and case["lse_err"] < 2e-2
            except Exception as exc:  # one bug must not hide the other cases
                case["error"] = _first_line(exc)
            results.append(case)
    return results


GRAPH_CASES = [("graph", "fp8", 64), ("graph", "bf16", 64), ("graph", "fp8", 0)]


def run_graph(case: tuple) -> list[dict]:
    """Each replay of one captured Decoder call (128 heads, q_len up to 2), output poisoned."""
    from mla_tune.serving import inputs as serving
    from mla_tune.serving.call import Decoder
    from tests.helpers import GRAPH_KV_LENS, GRAPH_Q_LENS, refill_for_replays

    _, kv_format, page = case
    results = []
    try:
        spec = CallSpec(kv_format, page, 128, max_q_len=2, mixed_q_len=True, graph=True,
                        sm_scale=CORE_DEEPSEEK_V3_SCALE)
        decoder = Decoder(spec, backend="gluon_fused", device="cuda")
        static = serving.make_input(GRAPH_Q_LENS, GRAPH_KV_LENS, 128, page, kv_format, seed=41,
                                    device="cuda")
        held = {}

        def call():
            held["out"] = decoder(static.q, static.qo_indptr, static.kv, static.kv_scale, **static.layout)

        graph = serving.capture_without_sync(call)
        out = held["out"]
        for seed, new in refill_for_replays(static, 2, 128, kv_format, "cuda"):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            verdict, _ = _verdict(out[:new.q.shape[0]], new, kv_format, spec.sm_scale)
            results.append({"family": case, "case": f"replay {seed}", "variant": str(decoder.variant),
                            **verdict, "error": None})
    except Exception as exc:
        results.append({"family": case, "case": "graph", "ok": False, "error": _first_line(exc)})
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[tuple, list[dict]]:
    if not torch.cuda.is_available():
        pytest.skip("needs an sm_90 GPU")
    from mla_tune.backends import gluon_fused
    from tests.helpers import unavailable

    if gluon_fused.unavailable_reason() is not None:
        unavailable(gluon_fused.unavailable_reason())
    found: dict[tuple, list[dict]] = {}
    context = multiprocessing.get_context("spawn")
    workers = min(8, os.cpu_count() or 1)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {pool.submit(run_graph if task[0] == "graph" else run_family, task): task
                   for task in FAMILIES + GRAPH_CASES}
        for future in concurrent.futures.as_completed(futures):
            family = futures[future]
            try:
                found[family] = future.result()
            except Exception as exc:  # the worker died (a crash, not a Python error)
                found[family] = [{"family": family, "case": "worker", "ok": False, "error": _first_line(exc)}]
    for task in FAMILIES + GRAPH_CASES:
        for case in found[task]:
            print(task, case.get("variant", ""), case["case"], "ok" if case["ok"] else "FAIL",
                  case.get("error") or f"mismatch {case.get('mismatch', 0):.4f} max_abs_err "
                  f"{case.get('max_abs_err', 0):.4f} lse_err {case.get('lse_err', '-')}")
    return found


@pytest.mark.parametrize("family", FAMILIES, ids=[f"{kv}-h{h}-q{q}-p{p}" for kv, h, q, p in FAMILIES])
def test_the_gluon_serving_kernel_matches_the_fp32_reference(outcomes, family):
    cases = outcomes[family]
    failed = [c for c in cases if not c["ok"]]
    assert cases and not failed, "\n".join(
        f"{c.get('variant', '')} {c['case']}: {c.get('error') or c.get('reason')}" for c in failed)


@pytest.mark.parametrize("case", GRAPH_CASES, ids=[f"{kv}-p{p}" for _, kv, p in GRAPH_CASES])
def test_a_captured_gluon_serving_call_replays_new_lengths_and_block_tables(outcomes, case):
    replays = outcomes[case]
    failed = [c for c in replays if not c["ok"]]
    assert len(replays) == 2 and not failed, "\n".join(f"{c['case']}: {c.get('error') or c.get('reason')}"
                                                          for c in failed)
