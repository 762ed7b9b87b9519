"""The serving split-K kernel's split rule, in plain Python: what the host launches with
(`fill_splits`; the items stage 1 is launched for, `launch_items`, and the most of them a
workspace must hold, `most_items`) and what every stage-1 program computes on the device
from the lengths (`serving_splits`, a replay for cost models: backends/triton_splitk_schedule.py).

The rule lives in kernels/flash_decode.py's `_fd_split_len` and `flash_decode_serving`;
tests/test_serving_layouts.py checks this replay against the split counts the kernel writes.
Pure Python (no torch, no triton): a serving table's lookup runs it on the host.

Exportable module: see docs/architecture.md (imports, `_sr_` prefix, no import-time work).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

# A batch budget's splits per sequence, floor(split_budget / batch), keep a uniform batch
# within the budget but can leave much of its last wave idle: on the H200, 6 x 28440 at 128
# heads (fp8, q_len 4, 8 head tiles) under a one-wave budget of 17 ran 2 splits each (96
# programs: a wave 73% full) in 1370 us, where 5 each took 1110 (2026-12-01). Past
# that share, the fewest splits whose programs fill at least this fraction of their waves.
_sr_WAVE_FILL = 0.8
# The reduction (stage 2) runs a program per (sequence, new token, head) over all 512
# columns and 16 splits per step; while the 4x wider grid stays within this many programs,
# a quarter of the columns and 64 splits per step instead (kernels/flash_decode.py says
# what it measured).
_sr_WIDE_REDUCE = 2048
REDUCE_SPLITS_PER_STEP = (16, 64)  # the reduction's splits per step: its narrow grid, its wide one
SPLIT_WAVE_FILL = _sr_WAVE_FILL  # the rule's constants, for a replay of it in another language
WIDE_REDUCE_PROGRAMS = _sr_WIDE_REDUCE


def _sr_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)  # called per launch with a few distinct batches
def fill_splits(split_budget: int, batch: int, head_tiles: int, max_splits: int, sm_count: int) -> int:
    """Splits per sequence of a uniform batch under a batch budget: s = max(1, floor(split_budget
    / batch)), or, where batch x head_tiles x s programs fill less than _sr_WAVE_FILL of their
    waves of sm_count SMs, the smallest s' in (s, max_splits] that fills at least that much
    (else the s' that fills most, the smallest of equals). sm_count 0 (no device): s."""
    s = max(1, split_budget // batch)
    if sm_count <= 0 or s >= max_splits:
        return min(s, max(max_splits, 1))
    per = batch * head_tiles

    def fill(k: int) -> float:
        return per * k / (sm_count * -(-per * k // sm_count))

    best = s
    for k in range(s, max_splits + 1):
        if fill(k) >= _sr_WAVE_FILL:
            return k
        if fill(k) > fill(best) + 1e-12:
            best = k
    return best


def batch_share(batch: int, q_len: int, max_splits: int, split_budget: int, head_tiles: int,
                sm_count: int) -> tuple[int, float]:
    """(budget, share_round) of a batch: the splits its sequences share in proportion to their
    lengths, max_splits per sequence scaled by q_len over its next power of two, or with a
    batch budget (split_budget > 0) at most the splits `fill_splits` launches per sequence;
    and the rounding of each sequence's share (0.5, or just under 1 with a batch budget: a
    ragged batch's shares round up)."""
    q_len_max = 1 << max(q_len - 1, 0).bit_length()  # next power of two
    budget = max((batch * q_len * max_splits) // q_len_max, 1)
    if split_budget > 0 and max_splits > 1:
        launched = batch * fill_splits(split_budget, batch, head_tiles, max_splits, sm_count)
        return min(budget, max(launched, batch)), 1.0 - 2e-4
    return budget, 0.5


def launch_items(batch: int, total_q: int, max_splits: int, q_len_max: int, launched_budget: int = 0) -> int:
    """The split items stage 1 is launched for (a bound on what the device deals: its split
    counts add up to at most this): the budget, max_splits x total_q new tokens / q_len_max
    (rounded down), or with a batch budget at most max(launched_budget, batch) (the host's
    batch x fill_splits(...)), plus one per sequence (rounding); with max_splits 1, one per
    sequence. Nondecreasing in total_q."""
    if max_splits <= 1:
        return batch
    items = (max_splits * total_q) // q_len_max + batch
    if launched_budget > 0:
        items = min(items, max(launched_budget, batch) + batch)
    return items


def most_items(max_total_q: int, max_splits: int, q_len_max: int, split_budget: int = 0,
               head_tiles: int = 1, sm_count: int = 0) -> int:
    """The most split items (launch_items) any call of at most max_total_q new tokens is
    launched for, over every batch up to max_total_q (a sequence brings at least one new
    token); a batch budget (split_budget > 0) with the SMs the launch fills (sm_count, as
    fill_splits takes it). What a workspace sized for such calls must hold."""
    if max_splits <= 1 or split_budget <= 0:
        return launch_items(max_total_q, max_total_q, max_splits, q_len_max)
    return max(launch_items(b, max_total_q, max_splits, q_len_max,
                            b * fill_splits(split_budget, b, head_tiles, max_splits, sm_count))
               for b in range(1, max_total_q + 1))


def serving_splits(kv_lens: Sequence[int], q_len: int, heads: int, *, max_splits: int,
                   tokens_per_split: int, block_n: int, block_h: int, split_budget: int = 0,
                   sm_count: int = 0, batch: int | None = None, total: int | None = None) -> list[int]:
    """Each sequence's split length in tokens (0 for a length of 0, a padded graph slot) as
    flash_decode_serving deals a batch of these KV lengths, each with q_len new tokens: the
    kernel's rule (`_fd_split_len`) in float64 where the device rounds in float32, so a share
    within about 1e-6 of a whole number may round the other way. Sequence b runs
    cdiv(kv_lens[b], split) splits, each once per head tile. batch and total (default: the
    lengths' count and sum) say the lengths are some of a batch of `batch` sequences
    holding `total` tokens: serving_splits([n], ..., batch=b, total=b * n) is each
    sequence's split in a uniform batch of b, without a pass over b lengths."""
    batch = len(kv_lens) if batch is None else batch
    budget, share_round = batch_share(batch, q_len, max_splits, split_budget, max(heads // block_h, 1), sm_count)
    total = max(sum(int(n) for n in kv_lens) if total is None else total, 1)
    splits = []
    for n in kv_lens:
        n = int(n)
        want = 1
        if max_splits > 1:
            want = max(min(math.floor(n * budget / total + share_round + 1e-4), _sr_cdiv(n, tokens_per_split)), 1)
        splits.append(max(_sr_cdiv(_sr_cdiv(n, want), block_n), 1) * block_n if n > 0 else 0)
    return splits


def reduce_splits_per_step(batch: int, max_q_len: int, heads: int, wide_programs: int = _sr_WIDE_REDUCE) -> int:
    """Splits the reduction adds up per step of its loop: 64 in the wide grid (a quarter of
    the columns per program, while batch x max_q_len x heads x 4 programs stay within
    wide_programs), else 16. A sequence of s splits takes cdiv(s, this) steps, one after
    another: a long sequence in a ragged batch is the reduction's critical path."""
    narrow, wide = REDUCE_SPLITS_PER_STEP
    return wide if batch * max_q_len * heads * 4 <= wide_programs else narrow


def split_items(kv_lens: Sequence[int], splits: Sequence[int]) -> list[int]:
    """The tokens of each split item in launch order: sequence b's kv_lens[b] tokens cut
    into pieces of splits[b] (serving_splits; 0: no items)."""
    items: list[int] = []
    for n, split in zip(kv_lens, splits, strict=True):
        if split:
            full, rest = divmod(int(n), split)
            items += [split] * full
            if rest:
                items.append(rest)
    return items
