"""Our split-K serving kernel's schedule at a call's own lengths, for the eager lookup.

The kernel (kernels/flash_decode.py, `flash_decode_serving`) deals each sequence's KV into
splits by a rule of the batch's lengths (kernels/split_rule.py replays it), and runs one
program per split and head tile. Its time steps where the programs overflow a wave of the
SMs and, in a ragged batch, where rounding each sequence's share up leaves a few long
programs: steps that the interpolation between grid points cannot see (a uniform batch
between two points whose programs pass a wave of the slots takes a wave longer).

`splitk_schedule` deals the call's programs (each split item once per head tile), in
launch order, to the least-loaded of `slots` program slots (SMs x programs resident per
SM, the occupancy), and returns the most-loaded slot's load: its tokens plus, per
program, `item_tokens`, a program's fixed cost (loading q, writing its partial result for
the combine) in tokens. Without it a bigger split budget always looks faster, though a
few programs past a wave each cost a second program's fixed cost on their SM.

A serving table's `SplitKModel` takes a variant's time as overhead + rate x makespan: its
fixed overhead, occupancy and item cost are fitted when the table is built (serving_build:
leave-one-out over the variant's grid points; the occupancy capped by `occupancy_cap`),
the rate is interpolated between the points like the times are, and the makespan is the
call's own. A variant with max_splits 1 runs one program per sequence, so a ragged batch
waits for its longest: the same model covers it.

The reduction that follows adds up each sequence's splits in a loop of `reduce_steps`
steps, and a ragged batch's long sequence makes the longest loop: a cost the rate,
interpolated between uniform points, does not see. Where a table holds a family's
measured cost per reduction step (`reduce_step_us`, measured by
tune/serving_calibrate.py), the lookup adds it for each step the call's longest loop
takes beyond a uniform batch of its mean length.
Pure Python; nothing here imports torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from mla_tune.kernels.split_rule import (
    fill_splits,
    reduce_splits_per_step,
    serving_splits,
    split_items,
)

OCCUPANCIES = (1, 2, 3, 4)  # programs resident per SM that a fit may choose
OVERHEAD_FRACTIONS = (0.0, 0.25, 0.5, 0.75)  # fixed overhead, as a fraction of the fastest point's time
ITEM_TOKENS = (0, 32, 64, 128, 256)  # a program's fixed cost in tokens that a fit may choose
# Past this many waves of programs the makespan is taken as the mean load plus half the
# longest item (greedy dealing ends within one item of the mean): the exact dealing costs
# a heap operation per program, and a long batch on a per-sequence cap makes thousands.
EXACT_WAVES = 3


def splitk_schedule(kv_lens: Sequence[int], heads: int, q_len: int, params: Mapping, occupancy: int,
                    sm_count: int, item_tokens: float = 0.0) -> tuple[float, int]:
    """(makespan, reduce steps) of the call, from one replay of the split rule: the load
    (tokens, plus item_tokens per program) of the most-loaded of sm_count x occupancy
    program slots when the call's split items, each run by heads // block_h programs (one
    per head tile, neighbours in launch order), are dealt program by program to the
    least-loaded slot, as the hardware's block scheduler runs them (programs beyond the
    slots wait for the first to finish; past EXACT_WAVES waves, the mean load plus half the
    longest item), and the steps of the reduction's longest loop (`reduce_steps`).
    kv_lens may be a numpy int64 array (`lengths`), which a caller replaying several
    variants for one call makes once: the replay is then vectorized (`_schedule_array`),
    with the same result as the per-sequence replay of split_rule.serving_splits."""
    if isinstance(kv_lens, np.ndarray):
        return _schedule_array(kv_lens, heads, q_len, params, occupancy, sm_count, item_tokens)
    splits = serving_splits(kv_lens, q_len, heads, **_rule(params, sm_count))
    items = split_items(kv_lens, splits)
    return (_deal(items, max(heads // int(params["block_h"]), 1), occupancy, sm_count, item_tokens),
            _steps(kv_lens, splits, q_len, heads))


def lengths(kv_lens: Sequence[int]) -> np.ndarray:
    """The call's lengths as the int64 array `splitk_schedule` replays without a Python loop."""
    return np.asarray(kv_lens, dtype=np.int64)


def _schedule_array(lens: np.ndarray, heads: int, q_len: int, params: Mapping, occupancy: int,
                    sm_count: int, item_tokens: float) -> tuple[float, int]:
    """splitk_schedule over an int64 array: split_rule.serving_splits' rule in numpy (the
    same float64 share, n * budget / total, exact below 2**53), its items as a repeat, the
    first wave of programs placed without the heap (each takes an empty slot), the rest
    dealt as `_deal` does. tests/test_splitk_fast.py checks it against the loop."""
    rule = _rule(params, sm_count)
    max_splits, block_n, batch = rule["max_splits"], rule["block_n"], int(lens.shape[0])
    tiles = max(heads // rule["block_h"], 1)
    q_len_max = 1 << max(q_len - 1, 0).bit_length()
    budget = max((batch * q_len * max_splits) // q_len_max, 1)
    share_round = 0.5
    if rule["split_budget"] > 0 and max_splits > 1:
        launched = batch * fill_splits(rule["split_budget"], batch, tiles, max_splits, sm_count)
        budget = min(budget, max(launched, batch))
        share_round = 1.0 - 2e-4
    total = max(int(lens.sum()), 1)
    if max_splits > 1:
        want = np.floor(lens * budget / total + share_round + 1e-4).astype(np.int64)
        want = np.maximum(np.minimum(want, -(-lens // rule["tokens_per_split"])), 1)
        per = -(-lens // want)  # cdiv(n, want)
        split = np.maximum(-(-per // block_n), 1) * block_n
    else:
        split = np.maximum(-(-lens // block_n), 1) * block_n
    live = lens > 0
    if not live.all():
        lens, split = lens[live], split[live]
    if lens.shape[0] == 0:
        return 0.0, 0
    full, rest = np.divmod(lens, split)
    counts = full + (rest > 0)
    most = int(counts.max())
    per_step = reduce_splits_per_step(batch, q_len, heads)
    steps = -(-most // per_step) if most > 1 else 0
    n_items = int(counts.sum())
    longest = int(np.where(full > 0, split, rest).max())
    slots = max(sm_count * occupancy, 1)
    programs = n_items * tiles
    if programs <= slots:
        return longest + item_tokens, steps
    if programs > EXACT_WAVES * slots:
        return (int(lens.sum()) + item_tokens * n_items) * tiles / slots + (longest + item_tokens) / 2, steps
    items = np.repeat(split, counts)
    ends = np.cumsum(counts) - 1
    cut = rest > 0
    items[ends[cut]] = rest[cut]
    work = np.repeat(items + item_tokens, tiles) if tiles > 1 else items + item_tokens
    return float(greedy_makespan(work, slots)), steps


def greedy_makespan(work: np.ndarray, slots: int):
    """The most-loaded slot's load when `work` (positive, in launch order) is dealt one by
    one to the least-loaded of `slots` slots: what `_deal`'s heap gives, a block of
    programs at a time. The first `slots` take an empty slot each; then a block of up to
    `slots` programs takes the smallest loads in order, which is the dealing's own choice
    while no program of the block ends before the load the next one takes (checked: a
    prefix minimum); past the first program that would, the block is cut there and the
    next block starts from the loads so far. A block cut short (few programs) is followed
    by a few programs dealt through the heap, so a batch of many short programs does not
    take a block per program."""
    n = int(work.shape[0])
    if n <= slots:
        return work.max()
    loads = np.sort(work[:slots])
    i = slots
    while i < n:
        m = min(slots, n - i)
        taken = loads[:m]
        ends = taken + work[i:i + m]
        ok = taken[1:] <= np.minimum.accumulate(ends)[:-1]
        k = m if ok.all() else int(np.argmin(ok)) + 1  # the programs dealt as the block says
        loads = np.sort(np.concatenate((loads[k:], ends[:k])))
        i += k
        if k < 16 and i < n:  # a block cut short: the next programs through the heap
            heap = loads.tolist()
            heapq.heapify(heap)
            replace = heapq.heapreplace
            for w in work[i:i + 64].tolist():
                replace(heap, heap[0] + w)
            i += min(64, n - i)
            loads = np.sort(np.asarray(heap, dtype=loads.dtype))
    return loads[-1]


def reduce_steps(kv_lens: Sequence[int], heads: int, q_len: int, params: Mapping, sm_count: int) -> int:
    """The steps of the reduction's longest loop: the most splits of one sequence over the
    splits the reduction adds per step (split_rule.reduce_splits_per_step: 16, or 64 in
    the wide grid of small batches). 0 for one split per sequence (max_splits 1: no
    reduction). A ragged batch's long sequence takes most of its splits, and the
    reduction waits for it: it takes more steps than a uniform batch of the same tokens."""
    return _steps(kv_lens, serving_splits(kv_lens, q_len, heads, **_rule(params, sm_count)), q_len, heads)


def uniform_reduce_steps(batch: int, kv_len: int, heads: int, q_len: int, params: Mapping, sm_count: int) -> int:
    """`reduce_steps` of `batch` sequences of kv_len tokens each, without a pass over them."""
    if batch < 1:
        return 0
    split = serving_splits([kv_len], q_len, heads, **_rule(params, sm_count), batch=batch, total=batch * kv_len)[0]
    return _steps([kv_len], [split], q_len, heads, batch)


def _rule(params: Mapping, sm_count: int) -> dict:
    """A variant's split rule, as serving_splits takes it."""
    return {"max_splits": int(params["max_splits"]), "tokens_per_split": int(params["tokens_per_split"]),
            "block_n": int(params["block_n"]), "block_h": int(params["block_h"]),
            "split_budget": int(params.get("split_budget", 0)), "sm_count": sm_count}


def _steps(kv_lens: Sequence[int], splits: Sequence[int], q_len: int, heads: int, batch: int | None = None) -> int:
    """Steps of the longest reduction loop; 0 where every sequence runs one split (max_splits
    1 always does: its one split writes the output)."""
    most = max((-(-int(n) // s) for n, s in zip(kv_lens, splits, strict=True) if s), default=0)
    per_step = reduce_splits_per_step(len(kv_lens) if batch is None else batch, q_len, heads)
    return -(-most // per_step) if most > 1 else 0


def _deal(items: list[int], tiles: int, occupancy: int, sm_count: int, item_tokens: float) -> float:
    if not items:
        return 0.0
    slots = max(sm_count * occupancy, 1)
    programs = len(items) * tiles
    if programs <= slots:
        return max(items) + item_tokens
    if programs > EXACT_WAVES * slots:  # many waves: the slots even out, within one item
        return (sum(items) + item_tokens * len(items)) * tiles / slots + (max(items) + item_tokens) / 2
    loads = [0.0] * slots
    replace = heapq.heapreplace
    for w in items:
        w += item_tokens
        for _ in range(tiles):
            replace(loads, loads[0] + w)
    return max(loads)


def is_splitk(variant) -> bool:
    """A variant of our serving split-K kernel (with max_splits 1, one split per sequence:
    a ragged batch waits for its longest)."""
    return variant.backend == "triton"


# A fit may choose an occupancy only up to what the variant's KV tiles leave room for in an
# SM's shared memory: the grid cells alone cannot tell occupancies apart for a batch budget
# that fills one wave at every cell, and an occupancy the SM cannot hold makes a ragged
# batch look fast. The sweep records the device's shared memory per SM in its results
# header (smem_per_sm); results without it get Hopper's, 228 KiB (H100, H200).
DEFAULT_SMEM_PER_SM = 228 * 1024


def occupancy_cap(variant, smem_per_sm: int = 0) -> int:
    """The most programs of this split-K variant one SM can hold by its KV stages alone
    (num_stages x block_n tokens x 576 columns x 2 bytes) in smem_per_sm bytes
    (0: DEFAULT_SMEM_PER_SM), at least 1."""
    kv_stages = int(variant.get("num_stages") or 1) * int(variant.get("block_n")) * 576 * 2
    return max(1, (smem_per_sm or DEFAULT_SMEM_PER_SM) // kv_stages)
