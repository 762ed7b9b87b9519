"""Page-1 addressing (mla_tune/integrations/indices.py): SGLang's kv_indptr + kv_indices as a
block table, entry by entry and through the serving call (Triton's interpreter on the CPU)."""

import itertools

import pytest
import torch

from mla_tune import problem
from mla_tune.core import CallSpec
from mla_tune.integrations.indices import PageOneTable, indices_to_block_table
from mla_tune.serving import inputs as serving
from mla_tune.serving.decode_plan import DecodePlan

LENS = [1, 17, 63, 65, 130]  # odd lengths, one past a 128-column program


def _as_indices(inp: serving.ServingInput, dtype=torch.int64):
    """A page-1 input's block table as SGLang's kv_indptr + kv_indices."""
    rows = [inp.block_table[b, :n] for b, n in enumerate(inp.kv_lens)]
    indptr = torch.tensor([0, *itertools.accumulate(inp.kv_lens)], dtype=torch.int32, device=inp.q.device)
    return indptr, torch.cat(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_table_holds_each_sequences_slots_and_leaves_the_rest(dtype, device):
    inp = serving.make_input([1] * len(LENS), LENS, 16, 1, "bf16", seed=3, device=device)
    indptr, indices = _as_indices(inp, dtype)
    table = torch.full((8, 160), -7, dtype=torch.int32, device=device)
    lens = torch.full((8,), -7, dtype=torch.int32, device=device)
    indices_to_block_table(indptr, indices, table, lens)
    assert lens[: len(LENS)].tolist() == LENS and lens[len(LENS):].tolist() == [-7] * 3
    for b, n in enumerate(LENS):
        assert torch.equal(table[b, :n], inp.block_table[b, :n])
        assert (table[b, n:] == -7).all()  # past the length: untouched
    assert (table[len(LENS):] == -7).all()


def test_bad_buffers_are_refused_with_what_was_expected(device):
    indptr = torch.tensor([0, 2], dtype=torch.int32, device=device)
    indices = torch.tensor([4, 5], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"block_table must be a \(>= 1, width\) int32"):
        indices_to_block_table(indptr, indices, torch.zeros((1, 4), dtype=torch.int64), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_indices must be int32 or int64"):
        indices_to_block_table(indptr, indices.float(), torch.zeros((1, 4), dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32))
    pages = PageOneTable(2, 4, device=device)
    with pytest.raises(ValueError, match="a sequence of 5 tokens, but the page-1 table holds 4"):
        pages.update(indptr, indices, kv_lens_host=[5])
    # without host lengths a longer sequence is cut to the row, its length too: no kernel reads
    # the next row's slots as its own
    indptr = torch.tensor([0, 6, 8], dtype=torch.int32, device=device)
    indices = torch.tensor([10, 11, 12, 13, 14, 15, 20, 21], dtype=torch.int32, device=device)
    table, lens = pages.update(indptr, indices)
    assert lens.tolist() == [4, 2] and table[0].tolist() == [10, 11, 12, 13] and table[1, :2].tolist() == [20, 21]


def test_a_page_one_fp8_cache_through_the_plan_matches_the_block_table_path(device):
    spec = CallSpec("fp8", page_size=1, heads=16, max_q_len=2, mixed_q_len=True)
    plan = DecodePlan(spec, max_batch=4, device=device)
    pages = PageOneTable(4, 64, device=device)
    lens = [1, 17, 40]
    inp = serving.make_input([1, 2, 2], lens, 16, 1, "fp8", seed=11, device=device)
    indptr, indices = _as_indices(inp)
    block_table, seq_lens = pages.update(indptr, indices, kv_lens_host=lens)
    assert block_table.data_ptr() == pages.block_table.data_ptr()  # the table's own storage
    plan.update(inp.qo_indptr, block_table=block_table, seq_lens=seq_lens)
    out = plan.run(inp.q, inp.kv, inp.kv_scale).clone()
    plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens)
    assert torch.equal(out, plan.run(inp.q, inp.kv, inp.kv_scale))
    result = problem.check(out, inp.reference(), problem.RULES["strict"])
    assert result.passed, str(result)


@pytest.mark.parametrize("page", [1, 4])
def test_sglangs_request_map_becomes_the_block_table_of_its_page_size(page, device):
    from mla_tune.integrations.indices import req_to_block_table

    gen = torch.Generator().manual_seed(5)
    context, lens = 300, [1, 4, 5, 131, 300]
    pages = torch.randperm(len(lens) * context // page + 3, generator=gen)[: len(lens) * (context // page)]
    rows = (pages.view(len(lens), context // page, 1) * page + torch.arange(page)).view(len(lens), context)
    req_to_token = torch.zeros((7, context), dtype=torch.int32)
    order = [6, 0, 3, 2, 5]  # the requests' rows in the pool
    req_to_token[order] = rows.to(torch.int32)
    table = torch.full((5, context // page), -7, dtype=torch.int32, device=device)
    out_lens = torch.zeros(5, dtype=torch.int32, device=device)
    request = (req_to_token.to(device), torch.tensor(order, device=device),
               torch.tensor(lens, device=device), page)
    req_to_block_table(*request, table, out_lens)
    assert out_lens.tolist() == lens
    table = table.cpu()
    for b, n in enumerate(lens):
        used = -(-n // page)
        assert torch.equal(table[b, :used], pages.view(len(lens), -1)[b, :used].to(torch.int32))
        assert (table[b, used:] == -7).all()
    narrow = torch.full((5, 2), -7, dtype=torch.int32, device=device)  # 2 pages: the longer are cut
    req_to_block_table(*request, narrow, out_lens)
    assert out_lens.tolist() == [min(n, 2 * page) for n in lens]
