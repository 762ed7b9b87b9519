"""FlashInfer's MLA schedule replayed on the host, and a linear model of its time over it.

FlashInfer's MLA `plan` (its C++ scheduler, `MLAPlan` in include/flashinfer/attention/
scheduler.cuh; the same algorithm in the 0.6 releases the H200 runs) splits each
sequence's KV into chunks of one length for the whole batch, kv_len_limit, about
total / clusters rounded up to 256 tokens, and deals the chunks in sequence order to
the least-loaded of the SMs' clusters. So its time steps where the chunks just overflow
the clusters: a few SMs run a second chunk, and the call takes about a chunk longer.

`flashinfer_mla_features` replays that dealing and returns what the time depends on; a
serving table fits `FLASHINFER_FEATURES` to FlashInfer's times over its grid
(`fit_linear`, weighted by 1 / time) and the eager lookup predicts FlashInfer's time at
the call's own lengths (`predict`): between grid points FlashInfer's time steps where
interpolating its grid times cannot see it. Pure Python; nothing here imports torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

FLASHINFER_FEATURES = ("one", "makespan", "max_works", "merge_ctas", "batch", "max_merge")
_CTA_TILE_Q = 64
_SLOTS = 1 << 12  # clusters per GPU, at most (the heap's key packs the cluster's index)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _chunk_limit(per_cluster: int) -> int:
    """FlashInfer's kv_len_limit from ceil(total kv / clusters)."""
    if per_cluster <= 8:
        return 32
    if per_cluster <= 16:
        return 64
    if per_cluster <= 32:
        return 128
    if per_cluster <= 64:
        return 192
    return _ceil_div(per_cluster, 256) * 256


def _geometry(kv_lens: Sequence[int], heads: int, q_len: int, sm_count: int) -> tuple[int, int, int, int, int]:
    """(cluster size, clusters, q tile rows, q tiles per sequence, kv_len_limit)."""
    packed = q_len * heads
    cluster = 2 if packed > _CTA_TILE_Q else 1
    clusters = max(sm_count // cluster, 1)
    tile = _CTA_TILE_Q * cluster
    q_tiles = _ceil_div(packed, tile)
    limit = _chunk_limit(max(_ceil_div(sum(int(n) for n in kv_lens) * q_tiles, clusters), 1))
    return cluster, clusters, tile, q_tiles, limit


def flashinfer_mla_works_per_cluster(kv_lens: Sequence[int], heads: int, q_len: int, sm_count: int) -> float:
    """How many chunks FlashInfer deals per cluster, on average (O(batch), no dealing);
    kv_lens may be a numpy int64 array."""
    if isinstance(kv_lens, np.ndarray):  # the same integers, without a Python loop
        total = int(kv_lens.sum())
        _, clusters, _, q_tiles, limit = _geometry((total,), heads, q_len, sm_count)
        return int(np.maximum(-(-kv_lens // limit), 1).sum()) * q_tiles / clusters
    _, clusters, _, q_tiles, limit = _geometry(kv_lens, heads, q_len, sm_count)
    return sum(max(_ceil_div(int(n), limit), 1) for n in kv_lens) * q_tiles / clusters


def flashinfer_mla_features(kv_lens: Sequence[int], heads: int, q_len: int, sm_count: int) -> list[float]:
    """[1, makespan, most works on one cluster, merge CTAs, batch, largest merge] of
    FlashInfer's MLA schedule for these lengths (every sequence with q_len new tokens):
    - makespan: the most-loaded cluster's cost, each chunk costing 2 x its q tile plus
      its tokens (FlashInfer's own cost function);
    - merge CTAs: the CTAs that merge split chunks; largest merge: the most partial rows
      one merge CTA reads (partial chunks x rows per CTA)."""
    lens = np.asarray(kv_lens, dtype=np.int64)
    packed = q_len * heads
    cluster, clusters, tile, q_tiles, limit = _geometry((int(lens.sum()),), heads, q_len, sm_count)
    full, rest = np.divmod(lens, limit)
    merge_ctas = max_merge = 0
    split = lens > limit
    if split.any():  # the merge CTAs of each split sequence, once per q tile
        ctas = np.maximum(lens[split] * cluster // limit, 1)
        chunks = full[split] + (rest[split] > 0)
        merge_ctas = q_tiles * int(ctas.sum())
        for t in range(q_tiles):
            rows = min(tile, packed - t * tile)
            max_merge = max(max_merge, int((chunks * -(-rows // ctas)).max()))
    # Each sequence's chunks in launch order, once per q tile: `full` of kv_len_limit
    # tokens, then the rest (an empty sequence deals one chunk of no tokens); each costs
    # 2 x its q tile plus its tokens, in units of _SLOTS (the heap's key packs the
    # cluster's index below them).
    has_last = (rest > 0) | (full == 0)
    counts = full + has_last
    cost = np.repeat(np.full(lens.shape[0], (2 * tile + limit) * _SLOTS, dtype=np.int64), counts)
    ends = np.cumsum(counts) - 1
    cost[ends[has_last]] = (2 * tile + rest[has_last]) * _SLOTS
    if q_tiles > 1:
        starts = ends + 1 - counts
        seq = np.repeat(np.arange(lens.shape[0]), counts * q_tiles)
        at = np.arange(seq.shape[0]) - np.repeat(np.cumsum(counts * q_tiles) - counts * q_tiles, counts * q_tiles)
        cost = cost[starts[seq] + at % counts[seq]]
    cost = cost.tolist()
    # The clusters' loads as one heap of ints, load * _SLOTS + cluster: the least loaded,
    # ties to the lower index, as FlashInfer's MinHeap. The first `clusters` chunks take
    # clusters 0, 1, ... in turn (each finds an empty one, the lowest index first).
    first = min(clusters, len(cost))
    heap = [c + i for i, c in enumerate(cost[:first])] + list(range(first, clusters))
    works = [1] * first + [0] * (clusters - first)
    heapq.heapify(heap)
    replace = heapq.heapreplace
    for c in cost[first:]:
        top = heap[0]
        works[top % _SLOTS] += 1
        replace(heap, top + c)
    makespan = max(heap) // _SLOTS
    return [1.0, float(makespan), float(max(works)), float(merge_ctas), float(len(kv_lens)), float(max_merge)]


def predict(coef: Sequence[float], features: Sequence[float]) -> float:
    return sum(c * f for c, f in zip(coef, features, strict=True))


def fit_linear(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    """Least squares of times on rows, each row weighted by 1 / its time (relative error),
    columns scaled to unit size and a tiny ridge, so a column that never varies (no merges
    at any cell) gets 0 instead of breaking the solve. Needs len(rows) >= 2 x columns."""
    n, m = len(rows), len(rows[0]) if rows else 0
    if n < 2 * m or m == 0:
        raise ValueError(f"fit_linear needs at least {2 * max(m, 1)} rows, got {n}")
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(m)]
    a = [[r[j] / scale[j] / t for j in range(m)] for r, t in zip(rows, times, strict=True)]
    ata = [[sum(a[k][i] * a[k][j] for k in range(n)) for j in range(m)] for i in range(m)]
    atb = [sum(a[k][i] for k in range(n)) for i in range(m)]  # the weighted targets t / t are all 1
    ridge = 1e-9 * max(sum(ata[i][i] for i in range(m)), 1e-30)
    for i in range(m):
        ata[i][i] += ridge
    x = _solve(ata, atb)
    return [x[j] / scale[j] for j in range(m)]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a small symmetric system)."""
    m = len(b)
    a = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(col + 1, m):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, m + 1):
                    a[r][c] -= f * a[col][c]
    x = [0.0] * m
    for r in range(m - 1, -1, -1):
        if abs(a[r][r]) < 1e-300:
            continue
        x[r] = (a[r][m] - sum(a[r][c] * x[c] for c in range(r + 1, m))) / a[r][r]
    return x


def relative_errors(coef: Sequence[float], rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    return sorted(abs(predict(coef, r) / t - 1.0) for r, t in zip(rows, times, strict=True) if t > 0)

