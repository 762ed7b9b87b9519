"""The split-K replay over a numpy array (splitk_cost._schedule_array, what the eager lookup
runs) gives what the per-sequence replay of kernels/split_rule.py gives, on random ragged
batches across every branch (one wave, the exact dealing, many waves; zero lengths)."""

import random

from mla_tune.serving.splitk_cost import lengths, splitk_schedule


def _params(rng):
    return {"max_splits": rng.choice([1, 2, 4, 8, 16, 32, 64]), "tokens_per_split": rng.choice([256, 512, 1024, 4096]),
            "block_n": rng.choice([16, 32, 64]), "block_h": rng.choice([16, 32, 64]),
            "split_budget": rng.choice([0, 0, 66, 132, 264])}


def test_array_replay_matches_the_loop():
    rng = random.Random(7)
    branches = set()
    for _ in range(600):
        batch = rng.randint(1, 256)
        lens = [int(2 ** rng.uniform(0, 16.5)) for _ in range(batch)]
        if rng.random() < 0.1:
            lens[rng.randrange(batch)] = 0
        heads, q_len = rng.choice([16, 64, 128]), rng.randint(1, 4)
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


def test_all_zero_lengths():
    params = {"max_splits": 8, "tokens_per_split": 512, "block_n": 32, "block_h": 64}
    assert splitk_schedule(lengths([0, 0]), 128, 1, params, 2, 132) == splitk_schedule([0, 0], 128, 1, params, 2, 132)
