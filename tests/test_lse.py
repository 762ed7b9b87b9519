"""The optional LSE of the serving call (issue 29): CallSpec(return_lse=True) makes every
run return (out, lse), lse the natural-log log-sum-exp of each (new token, head)'s scaled
scores, (total_q, heads) float32, as vLLM's MLA backends merge it (`lse_base_on_e`).

Backends declare it in CAPABILITIES.lse: triton_fused (its reduction keeps the running
max and sum), the split-K family (stage 1 writes it for a one-split sequence, stage 2 from
the splits' merge), FlashMLA (softmax_lse: natural log, (batch, h_q, s_q)), FlashInfer
(asked for natural log: its default is base 2). Checked here through the interpreter and
the vendors' fakes against the fp32 reference's LSE, at DeepSeek-V3's scale.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mla_tune.backends import capabilities
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE as DSV3
from mla_tune.core import CallSpec
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import Decoder
from mla_tune.serving.decode_plan import DecodePlan
from tests.helpers import serving_call


def _assert_lse(lse: torch.Tensor, ref_lse: torch.Tensor, what: str) -> None:
    assert lse.dtype == torch.float32 and tuple(lse.shape) == tuple(ref_lse.shape), \
        f"{what}: lse {lse.dtype} {tuple(lse.shape)}, expected float32 {tuple(ref_lse.shape)}"
    err = float((lse - ref_lse).abs().max())
    # scores of bf16 operands: about 1e-2 absolute at these sizes; a base-2 LSE would be
    # off by a factor 1.44 (several units), one at the leaderboard's scale by 3x
    assert err < 5e-2, f"{what}: max |lse - reference| = {err:.4f}"


def test_the_capability_record_says_who_returns_it():
    assert {name: capabilities(name).lse for name in ("triton", "triton_fused", "flashmla", "flashinfer")} == {
        "triton": True, "triton_fused": True, "flashmla": True, "flashinfer": True}
    spec = CallSpec("bf16", page_size=16, return_lse=True)
    assert capabilities("triton").refusal(spec) is None
    assert Decoder(spec).backend == "triton"  # the first of the preference order


# Split-K (backend triton): kv_len 1 and 17 run in one split (stage 1 writes out and LSE),
# the few hundred in several (stage 2 merges them); max_splits 1 runs every sequence in one.
SPLITK = [("bf16", 1, 4), ("fp8", 1, 4), ("bf16", 2, 4), ("fp8", 2, 4), ("bf16", 2, 1)]


@pytest.mark.parametrize("kv,q_len,max_splits", SPLITK, ids=[f"{k}-q{q}-s{s}" for k, q, s in SPLITK])
def test_split_k_returns_the_references_lse(kv, q_len, max_splits, monkeypatch):
    splits = dict(max_splits=max_splits, tokens_per_split=64)
    (out, lse), _, inp, runner = serving_call(monkeypatch, "triton", kv, [1, q_len, q_len], [1, 17, 300], 13,
                                              splits, host=False, mixed_q_len=q_len > 1, return_lse=True)
    counts = runner.workspace.split_count[:3].tolist()
    assert counts[:2] == [1, 1] and (counts[2] > 1) == (max_splits > 1), counts  # both branches ran
    ref, ref_lse = inp.reference(sm_scale=DSV3, return_lse=True)
    _assert_lse(lse, ref_lse, f"triton {kv} q_len {q_len} max_splits {max_splits}")
    assert float((out.float() - ref).abs().max()) < 0.05
    # at the leaderboard's scale the LSE is another: the scale reaches it
    assert float((lse - inp.reference(return_lse=True)[1]).abs().max()) > 0.5


CASES = [("triton_fused", "bf16", 2), ("triton_fused", "fp8", 1), ("flashmla", "bf16", 2), ("flashmla", "fp8", 1),
         ("flashinfer", "bf16", 2), ("flashinfer", "fp8", 1)]


@pytest.mark.parametrize("name,kv,q_len", CASES, ids=[f"{n}-{k}-q{q}" for n, k, q in CASES])
def test_each_declared_backend_returns_the_references_lse(name, kv, q_len, monkeypatch):
    mixed = name != "flashmla" and q_len > 1
    # triton_fused: several splits for the long sequences, so the reduction's LSE too
    params = dict(max_splits=4, tokens_per_split=32) if name == "triton_fused" else None
    q_lens, kv_lens = [q_len, 1 if mixed else q_len, q_len], [70, 5 if mixed else 9, 130]
    (out, lse), variant, inp, _ = serving_call(monkeypatch, name, kv, q_lens, kv_lens, 11, params,
                                               mixed_q_len=mixed, return_lse=True)
    q_format = {"bf16": "bf16", "fp8_dynamic": "fp8"}[variant.get("q")]
    ref, ref_lse = inp.reference(q_format, sm_scale=DSV3, return_lse=True)
    _assert_lse(lse, ref_lse, f"{name} {kv} q_len {q_len}")
    assert float((out.float() - ref).abs().max()) < 0.05
    if name == "flashinfer":
        assert sys.modules["flashinfer.mla"].last_run["return_lse_base_on_e"] is True


def test_a_plan_with_return_lse_returns_out_and_lse_per_layer():
    spec = CallSpec("bf16", page_size=16, heads=16, max_q_len=2, mixed_q_len=True, sm_scale=DSV3, return_lse=True)
    plan = DecodePlan(spec, max_batch=4)
    inp = serving.make_input([2, 1, 2], [40, 3, 90], 16, 16, "bf16", seed=12)
    plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    ref, ref_lse = inp.reference(sm_scale=DSV3, return_lse=True)
    for _layer in range(2):  # the second layer replays what the first recorded (on a GPU)
        out, lse = plan.run(inp.q, inp.kv)
        _assert_lse(lse, ref_lse, "plan.run")
        assert float((out.float() - ref).abs().max()) < 0.05
