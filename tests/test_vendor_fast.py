"""FlashInfer's replayed schedule (flashinfer_mla_features) equals a chunk-by-chunk replay of
its MLAPlan dealing on random ragged batches; works_per_cluster is the same on list and array."""

import heapq

import numpy as np

from mla_tune.backends.flashinfer_mla_schedule import (
    flashinfer_mla_features,
    flashinfer_mla_works_per_cluster,
)
from tests.test_native_replays import _batches

SLOTS = 1 << 12


def _limit(per_cluster):
    for bound, limit in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if per_cluster <= bound:
            return limit
    return -(-per_cluster // 256) * 256


def _reference(kv_lens, heads, q_len, sm_count):
    packed = q_len * heads
    cluster = 2 if packed > 64 else 1
    clusters = max(sm_count // cluster, 1)
    tile = 64 * cluster
    q_tiles = -(-packed // tile)
    limit = _limit(max(-(-sum(kv_lens) * q_tiles // clusters), 1))
    heap, works = list(range(clusters)), [0] * clusters
    merge_ctas = max_merge = 0
    for n in kv_lens:
        full, rest = divmod(n, limit)
        if n > limit:
            ctas = max(n * cluster // limit, 1)
            for t in range(q_tiles):
                rows = min(tile, packed - t * tile)
                merge_ctas += ctas
                max_merge = max(max_merge, (full + (rest > 0)) * -(-rows // ctas))
        last = (2 * tile + rest) * SLOTS if rest or not full else 0
        for _ in range(q_tiles):
            for _ in range(full):
                top = heap[0]
                works[top % SLOTS] += 1
                heapq.heapreplace(heap, top + (2 * tile + limit) * SLOTS)
            if last:
                top = heap[0]
                works[top % SLOTS] += 1
                heapq.heapreplace(heap, top + last)
    return [1.0, float(max(heap) // SLOTS), float(max(works)), float(merge_ctas), float(len(kv_lens)),
            float(max_merge)]


def test_features_match_the_chunk_by_chunk_replay():
    merged = several_tiles = 0
    for rng, _batch, array, heads in _batches(11, 400, max_batch=160):
        lens, q_len, sm = array.tolist(), rng.randint(1, 4), rng.choice([78, 132])
        want = _reference(lens, heads, q_len, sm)
        assert flashinfer_mla_features(lens, heads, q_len, sm) == want, (lens, heads, q_len, sm)
        assert flashinfer_mla_features(np.asarray(lens), heads, q_len, sm) == want
        assert flashinfer_mla_works_per_cluster(np.asarray(lens, dtype=np.int64), heads, q_len, sm) == \
            flashinfer_mla_works_per_cluster(lens, heads, q_len, sm)
        merged += want[3] > 0
        several_tiles += q_len * heads > 128
    assert merged > 50 and several_tiles > 50
    assert flashinfer_mla_features([], 128, 1, 132) == _reference([], 128, 1, 132)  # no sequences
