"""The vLLM and SGLang backends against fakes of vLLM 0.33.0 and SGLang 0.5.23 that enforce
the real hooks: engine loops (2 layers, 3 steps, graph and eager plans) at DeepSeek-V3's scale
(and SGLang's at V2-Lite's, whose model config and layers compute it one bit apart)."""

import itertools
import math

import pytest
import torch

from mla_tune import problem
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE as SCALE
from mla_tune.core import QK_DIM, SM_SCALE, V_DIM
from mla_tune.serving import inputs as serving
from tests import engine_helpers
from tests.engine_helpers import HEADS, Cache, close_to_reference, vllm_layers
from tests.fakes import engine_fakes


@pytest.fixture(autouse=True)
def _no_table(monkeypatch):
    monkeypatch.setenv("MLA_TUNE_SERVING_TABLE", "none")  # the default variant, no table lookups


def _ignored_scale_would_fail(out, cache, layer, q, rows):
    at_leaderboard = cache.reference(layer, q, rows, SM_SCALE)[0]
    assert not problem.check(out, at_leaderboard, problem.RULES["strict"]).passed


# ---------------------------------------------------------------------------------- vLLM
def test_vllm_backend_registers_as_custom_and_the_fake_refuses_wrong_hooks(monkeypatch):
    engine_fakes.install(monkeypatch, "vllm")
    from vllm.model_executor.layers.attention.mla_attention import MLACommonImpl
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_tune.integrations import vllm as backend

    backend.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is backend.MlaTuneMLABackend
    assert backend.MlaTuneMLABackend.get_builder_cls() is backend.MlaTuneMLAMetadataBuilder
    assert backend.MlaTuneMLABackend.get_impl_cls() is backend.MlaTuneMLAImpl
    with pytest.raises(TypeError, match=r"forward_mqa takes .*'kv_cache'"):
        class Wrong(MLACommonImpl):  # noqa: F841
            def forward_mqa(self, q, kv_cache, attn_metadata, layer):
                pass


def _common(qsl, lens, table, slots, tokens=None, max_seq_len=None):
    """vLLM's CommonAttentionMetadata of a step: query_start_loc qsl, seq_lens (and their host
    copy) lens; tokens and max_seq_len default to qsl's last and lens' largest."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=lens.clone(), num_reqs=len(lens),
        num_actual_tokens=int(qsl[-1]) if tokens is None else tokens, max_query_len=int((qsl[1:] - qsl[:-1]).max()),
        max_seq_len=int(lens.max()) if max_seq_len is None else max_seq_len, block_table_tensor=table.clone(),
        slot_mapping=slots, seq_lens_cpu_upper_bound=lens)


def _vllm_step(cache, rows, seed, builder, impls, layers):
    gen = torch.Generator().manual_seed(seed)
    for b in rows:
        cache.lens[b] += 1  # this step's new token, written by the layer below
    n = len(rows)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    slots = torch.tensor([cache.slot(b, cache.lens[b] - 1) for b in rows], dtype=torch.int64)
    lens = torch.tensor([cache.lens[b] for b in rows], dtype=torch.int32)
    metadata = builder.build(0, _common(qsl, lens, cache.table[rows], slots))
    for layer, (impl, layer_obj) in enumerate(zip(impls, layers, strict=True)):
        q = torch.randn((n, HEADS, QK_DIM), generator=gen).to(torch.bfloat16)
        latent = torch.randn((n, QK_DIM), generator=gen)
        out, lse = impl.forward_decode_step(layer_obj, q, latent[:, :V_DIM], latent[:, V_DIM:],
                                            cache.engine_view(layer), metadata)
        ref, ref_lse = cache.reference(layer, q, rows, SCALE)
        close_to_reference(out, ref, f"vLLM layer {layer}")
        if builder.plans.spec.return_lse:  # decode context parallelism asks for it
            torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=0)
        else:
            assert lse is None
        _ignored_scale_would_fail(out, cache, layer, q, rows)
    return metadata


@pytest.mark.parametrize("cache_dtype", ["fp8"])  # uint8 bytes, as vLLM keeps fp8 (bf16: the SGLang loop)
def test_vllm_decode_loop_at_deepseek_v3_scale_with_lse(monkeypatch, cache_dtype):
    engine_fakes.install(monkeypatch, "vllm")
    fp8 = cache_dtype == "fp8"
    cache = Cache([5, 30, 47, 70], 16, 3, fp8=fp8, seed=1, as_bytes=True)
    builder, impls, layers = vllm_layers(cache, cache_dtype, 16, dcp=2, max_seqs=4)
    assert builder.plans.spec.sm_scale == SCALE
    assert builder.plans.spec.cache_dtype == ""  # vLLM views its uint8 bytes as fp8 before forward_mqa
    assert builder.plans.spec.heads == 2 * HEADS  # q's heads gathered over the DCP group of 2
    assert builder.plans.spec.return_lse and builder.plans.graph is not None
    for step, rows in enumerate(([0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3])):  # 4: captured, 3: eager
        metadata = _vllm_step(cache, rows, 10 + step, builder, impls, layers)
        assert metadata.decode.plans.active is (builder.plans.graph if len(rows) == 4 else builder.plans.eager)


@pytest.mark.parametrize(("dcp", "speculative", "takes"), [(1, 0, "lengths"), (2, 0, None), (1, 1, "mean")])
def test_vllm_eager_steps_take_vllms_host_lengths(monkeypatch, dcp, speculative, takes):
    """vLLM's host copy of the lengths (seq_lens_cpu_upper_bound) reaches an eager step's
    plan, whose lookup estimates at them; with speculative decoding (an upper bound then)
    their mean; with decode context parallelism (each rank's share differs) nothing. A graph
    step takes none."""
    engine_fakes.install(monkeypatch, "vllm")
    cache = Cache([5, 30, 47, 70], 16, 3, seed=2)
    builder, impls, layers = vllm_layers(cache, "auto", 16, dcp=dcp, max_seqs=4, speculative=speculative)
    calls = []
    update = builder.plans.update
    monkeypatch.setattr(builder.plans, "update",
                        lambda graph, qo, **layout: calls.append((graph, layout["kv_lens_host"],
                                                                  layout["mean_kv_len"],
                                                                  layout["seq_lens"].tolist())) or
                        update(graph, qo, **layout))
    for step, rows in enumerate(([0, 1, 2, 3], [0, 2, 3])):  # 4: captured (unless q_len 2), 3: eager
        _vllm_step(cache, rows, 20 + step, builder, impls, layers)
    assert [graph for graph, *_ in calls] == [not speculative, False]
    for graph, kv_lens, mean, lens in calls:
        assert kv_lens == (lens if takes == "lengths" and not graph else None)
        assert mean == (sum(lens) / len(lens) if takes == "mean" and not graph else None)


@pytest.mark.parametrize("speculative", [0, 1])
def test_vllm_a_graph_step_padded_with_empty_requests_answers_its_real_rows(monkeypatch, speculative):
    """A full CUDA graph's step as vLLM pads it: requests of query length 0 and sequence
    length 0 up to the captured batch (query_start_loc repeats the real token count), q
    padded to the captured tokens. The graph plan takes it; the real rows match the
    reference, the padding stays finite."""
    engine_fakes.install(monkeypatch, "vllm")
    q_len, real, padded = 1 + speculative, 3, 4
    cache = Cache([5, 30, 47], 16, 3, seed=3)
    builder, impls, layers = vllm_layers(cache, "auto", 16, dcp=1, max_seqs=8, speculative=speculative)
    builder.graph_batches = frozenset({padded})  # a capture of `padded` requests at this q_len
    builder.plans.make_graph_plan(padded)
    qsl = torch.tensor([q_len * min(i, real) for i in range(padded + 1)], dtype=torch.int32)
    lens = torch.tensor(cache.lens + [0], dtype=torch.int32)
    table = torch.cat([cache.table[:real], torch.zeros((1, cache.table.shape[1]), dtype=torch.int32)])
    metadata = builder.build(0, _common(qsl, lens, table, torch.full((padded * q_len,), -1, dtype=torch.int64),
                                        tokens=padded * q_len))
    assert builder.plans.active is builder.plans.graph
    q = torch.randn((padded * q_len, HEADS, QK_DIM), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, _ = impls[0].forward_mqa((q[..., :V_DIM], q[..., V_DIM:]), cache.engine_view(0), metadata, layers[0])
    ref, _ = serving.reference(q[: real * q_len], qsl[: real + 1], cache.kv[0].view(cache.num_pages, 16, QK_DIM),
                               None, block_table=cache.table[:real], seq_lens=lens[:real], sm_scale=SCALE,
                               return_lse=True)
    close_to_reference(out[: real * q_len], ref, f"vLLM padded graph step, q_len {q_len}")
    assert torch.isfinite(out[real * q_len:].float()).all()


def test_vllm_more_speculative_tokens_than_the_kernels_take_are_refused_with_the_limit(monkeypatch):
    engine_fakes.install(monkeypatch, "vllm")
    cache = Cache([5, 30], 16, 3, seed=2)
    vllm_layers(cache, "auto", 16, dcp=1, max_seqs=4, speculative=3)  # q_len 4
    with pytest.raises(ValueError, match=r"up to 5 tokens per sequence .* take up to 4: use "
                                         r"num_speculative_tokens 3 or fewer"):
        vllm_layers(cache, "auto", 16, dcp=1, max_seqs=4, speculative=4)


def test_vllm_a_step_with_prefills_runs_its_decodes_on_the_eager_plan(monkeypatch):
    """A mixed step (chunked prefill) runs its attention outside any full CUDA graph, so its
    decodes take the eager plan and its lengths-aware pick even where their count is a
    capture size; a step of decodes only of that size takes the graph plan."""
    engine_fakes.install(monkeypatch, "vllm")
    cache = Cache([5, 30, 47, 70, 90], 16, 3, seed=4)
    builder, _impls, _layers = vllm_layers(cache, "auto", 16, dcp=1, max_seqs=8)
    lens = torch.tensor(cache.lens, dtype=torch.int32)
    for q_lens, graph in (([1, 1, 1, 1, 3], False), ([1, 1, 1, 1], True)):  # 4 decodes: a capture size
        n = len(q_lens)
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        slots = torch.zeros(int(qsl[-1]), dtype=torch.int64)
        metadata = builder.build(0, _common(qsl, lens[:n], cache.table[:n], slots, max_seq_len=int(lens.max())))
        assert metadata.num_decodes == 4 and metadata.num_prefills == n - 4
        assert metadata.decode.plans.active is (builder.plans.graph if graph else builder.plans.eager)


# -------------------------------------------------------------------------------- SGLang
def test_sglang_backend_registers_and_the_fake_refuses_the_removed_hooks(monkeypatch):
    engine_fakes.install(monkeypatch, "sglang")
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from mla_tune.integrations import sglang as backend

    backend.register()
    assert attention_registry.ATTENTION_BACKENDS["mla_tune"] is backend.create_mla_tune_backend
    with pytest.raises(TypeError, match="removed from the 0.5.23 base class"):
        class Old(AttentionBackend):  # noqa: F841
            def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens):
                pass
    with pytest.raises(TypeError, match=r"init_forward_metadata_out_graph takes"):
        class Wrong(AttentionBackend):  # noqa: F841
            def init_forward_metadata_out_graph(self, batch):
                pass


# DeepSeek-V2-Lite's yarn (factor 40, mscale_all_dim 0.707): SGLang's model config computes its
# scaling as 1 / sqrt(192) x m^2, its layers as 192 ** -0.5 x m^2, which differ in the last bit
_M = 0.1 * 0.707 * math.log(40) + 1.0
V2_LITE = (1 / math.sqrt(192) * _M * _M, 192 ** -0.5 * _M * _M)


@pytest.mark.parametrize(("config_scale", "layer_scale", "fp8"), [(SCALE, SCALE, False), (*V2_LITE, False),
                                                                 (SCALE, SCALE, True)], ids=["v3", "v2_lite", "v3_fp8"])
def test_sglang_page_one_decode_loop_at_the_models_scale_with_graph_hooks(monkeypatch, config_scale, layer_scale,
                                                                           fp8):
    """An fp8 cache is read at scale 1 whatever the layer's k_scale (0.37 here): the pool wrote
    it unscaled."""
    engine_fakes.install(monkeypatch, "sglang")
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from mla_tune.integrations import sglang as backend

    assert V2_LITE[0] != V2_LITE[1]
    cache = Cache([5, 30, 47], 1, 3, fp8=fp8, seed=2, as_bytes=False, unit_scales=True)  # page 1: token slots
    runner = engine_helpers.sglang_runner(cache, max_reqs=4, context=64)
    runner.model_config.scaling = config_scale
    attn = backend.create_mla_tune_backend(runner)
    assert attn.plans.spec.sm_scale == config_scale and attn.plans.spec.page_size == 1
    attn.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    layers = engine_helpers.sglang_layers(layer_scale, torch.tensor([0.37]) if fp8 else None)
    gen = torch.Generator().manual_seed(7)
    for step, rows in enumerate(([0, 1, 2], [0, 2], [1, 2])):  # 3 sequences eager; 2: the graph path
        for b in rows:
            cache.lens[b] += 1
        lens = torch.tensor([cache.lens[b] for b in rows])
        batch = ForwardBatch(ForwardMode.DECODE, len(rows), torch.tensor(rows), lens,
                             torch.tensor([cache.slot(b, cache.lens[b] - 1) for b in rows]),
                             int(lens.sum()), seq_lens_cpu=lens.clone())
        graph = len(rows) <= 2
        if graph:  # the graph runner: out_graph (capture or replay), then the captured forward
            attn.init_forward_metadata_out_graph(batch, in_capture=step == 1)
            attn.init_forward_metadata_in_graph(batch)
        else:
            attn.init_forward_metadata(batch)
        assert attn.plans.active is (attn.plans.graph if graph else attn.plans.eager)
        for layer in layers:
            q = torch.randn((len(rows), HEADS * QK_DIM), generator=gen).to(torch.bfloat16)
            latent = torch.randn((len(rows), 1, QK_DIM), generator=gen).to(torch.bfloat16)
            out = attn.forward(q, latent, latent[..., :V_DIM], layer, batch)
            assert out.shape == (len(rows), HEADS * V_DIM)
            q3 = q.view(-1, HEADS, QK_DIM)
            ref, _ = cache.reference(layer.layer_id, q3, rows, layer_scale)
            close_to_reference(out.view(-1, HEADS, V_DIM), ref, f"SGLang step {step} layer {layer.layer_id}")
            _ignored_scale_would_fail(out.view(-1, HEADS, V_DIM), cache, layer.layer_id, q3, rows)
    layers[0].scaling = layer_scale * 1.01  # a layer at another scale than the plans'
    with pytest.raises(ValueError, match="layer 0 scales scores by"):
        attn.forward(q, latent, latent[..., :V_DIM], layers[0], batch)
