"""The split-K replay over a numpy array (what the eager lookup runs) equals the per-sequence
replay of kernels/split_rule.py on random ragged batches across every branch."""

import heapq
import random

import numpy as np

from mla_tune.backends.makespan import greedy_makespan
from mla_tune.backends.triton_splitk_schedule import lengths, splitk_schedule
from tests.test_native_replays import _batches


def _params(rng):
    return {"max_splits": rng.choice([1, 2, 4, 8, 16, 32, 64]), "tokens_per_split": rng.choice([256, 512, 1024, 4096]),
            "block_n": rng.choice([16, 32, 64]), "block_h": rng.choice([16, 32, 64]),
            "split_budget": rng.choice([0, 0, 66, 132, 264])}


def test_array_replay_matches_the_loop():
    branches = set()
    for rng, _batch, array, heads in _batches(7, 600, empty=0.1):
        lens, q_len = array.tolist(), rng.randint(1, 4)
        params, occupancy, sm = _params(rng), rng.randint(1, 4), rng.choice([78, 132])
        item = rng.choice([0, 32, 256, 0.0])
        want = splitk_schedule(lens, heads, q_len, params, occupancy, sm, item)
        got = splitk_schedule(lengths(lens), heads, q_len, params, occupancy, sm, item)
        assert got == want, (lens, heads, q_len, params, occupancy, sm, item)
        assert type(got[1]) is int
        slots = sm * occupancy
        branches.add("one" if want[0] == max(lens) + item else "more")
        branches.add(slots)
    assert "one" in branches and "more" in branches
    params = {"max_splits": 8, "tokens_per_split": 512, "block_n": 32, "block_h": 64}  # all lengths 0
    assert splitk_schedule(lengths([0, 0]), 128, 1, params, 2, 132) == splitk_schedule([0, 0], 128, 1, params, 2, 132)


def test_greedy_makespan_is_the_heaps():
    rng = random.Random(3)
    for _ in range(300):
        slots = rng.randint(1, 300)
        n = rng.randint(1, 4 * slots)
        kind = rng.random()
        if kind < 0.3:  # a few long items among short rests
            work = [rng.choice([512, 512, 512, rng.randint(1, 64)]) for _ in range(n)]
        elif kind < 0.6:
            work = [rng.randint(1, 10 ** 5) for _ in range(n)]
        else:
            work = [64 + 32 * rng.randint(0, 3) for _ in range(n)]
        if rng.random() < 0.3:
            work = [w + 0.5 for w in work]
        loads = [0.0] * slots
        for w in work:
            heapq.heapreplace(loads, loads[0] + w)
        assert greedy_makespan(np.asarray(work), slots) == max(loads), (slots, work)
