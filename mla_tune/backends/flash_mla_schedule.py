"""FlashMLA's schedule model: its split schedule replayed on the host, and a linear model of
its time over it (the serving lookup's estimate for a FlashMLA variant).

FlashMLA's decode schedule (`get_mla_metadata`'s kernel, csrc/smxx/get_mla_metadata.cu in
FlashMLA and sgl-flash-mla 1.0.0) cuts the batch into one contiguous run of work per SM
partition: num_sm_parts = SMs / ceil(q_len x heads / 64) partitions (one KV head), each
sequence costing its 64-token blocks plus 5 blocks of fixed overhead, every partition
filled up to payload = ceil(total / parts) + 5 blocks in sequence order, a sequence that
does not fit split where the partition fills. A split sequence's partial results are then
merged by the combine kernel. So its time steps with the fullest partition's blocks and
with whether sequences split: 32 sequences of 1024 tokens over 16 partitions fill each with
exactly two and split none; 33 split (docs/perf.md 2.3, the FlashMLA model).

`flash_mla_features` replays that filling and returns FLASHMLA_FEATURES; `fit` fits them
to FlashMLA's times over the family's grid (linear_schedule.fit_model), and
`FlashMLAModel.estimate` predicts FlashMLA's time at the call's own lengths. The
schedule-model protocol is the backends' (backends/__init__.py). Python, with the replay and
the model's estimate also in C (mla_tune/native.py; the same numbers); nothing here imports
torch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mla_tune import native
from mla_tune.backends.linear_schedule import WINDOW_C, LinearModel, fit_model, load_model

FLASHMLA_FEATURES = ("one", "makespan", "split_seqs", "batch")
BLOCK_N = 64  # tokens per block (FlashMLA's block_size_n, its page size)
FIXED_BLOCKS = 5  # a sequence's fixed overhead in blocks (fixed_overhead_num_blocks)
BLOCK_M = 64  # q rows per tile (block_size_m)


def sm_parts(heads: int, q_len: int, sm_count: int) -> int:
    """FlashMLA's num_sm_parts for one KV head (MLA's)."""
    return max(sm_count // -(-(q_len * heads) // BLOCK_M), 1)


def flash_mla_features(kv_lens: Sequence[int], heads: int, q_len: int, sm_count: int) -> list[float]:
    """[1, makespan, split sequences, batch] of FlashMLA's schedule for these lengths: the
    fullest partition's blocks (each sequence's part of its 64-token blocks, plus the fixed
    overhead once per piece) and how many sequences split over two or more partitions. In C
    where a C compiler is found (the same integers)."""
    lib = _native()
    if lib is not None:
        lens = np.ascontiguousarray(kv_lens, dtype=np.int64)
        out = (ctypes.c_int64 * 2)()
        lib.fm_features(native.address(lens), lens.shape[0], heads, q_len, sm_count, out)
        return [1.0, float(out[0]), float(out[1]), float(len(kv_lens))]
    blocks = [max(int(n) - 1, 0) // BLOCK_N + 1 for n in kv_lens]
    parts = sm_parts(heads, q_len, sm_count)
    payload = -(-(sum(blocks) + FIXED_BLOCKS * len(blocks)) // parts) + FIXED_BLOCKS
    seq = done = pieces = makespan = split = 0  # done: the blocks of `seq` in earlier partitions
    for _ in range(parts):
        room, load = payload, 0
        while seq < len(blocks):
            rest = blocks[seq] - done
            if room >= rest + FIXED_BLOCKS:  # the rest of the sequence fits: it ends here
                split += pieces > 0
                room -= rest + FIXED_BLOCKS
                load += rest + FIXED_BLOCKS
                seq, done, pieces = seq + 1, 0, 0
            else:  # it splits where the partition fills
                if room > FIXED_BLOCKS:
                    done += room - FIXED_BLOCKS
                    pieces += 1
                    load += room
                break
        makespan = max(makespan, load)
    return [1.0, float(makespan), float(split), float(len(kv_lens))]


# flash_mla_features' filling in C (mla_tune/native.py), and the model's estimate.
_NATIVE_SOURCE = native.ESTIMATE_H + WINDOW_C + r"""
#define BLOCK_N 64
#define FIXED_BLOCKS 5

/* out: the fullest partition's blocks, the sequences split over partitions */
void fm_features(const int64_t *lens, int64_t n, int64_t heads, int64_t q_len, int64_t sm_count,
                 int64_t *out) {
    int64_t tiles = (q_len * heads + 63) / 64, parts = sm_count / tiles, total = 0;
    if (parts < 1) parts = 1;
    for (int64_t s = 0; s < n; s++) total += (lens[s] > 1 ? lens[s] - 1 : 0) / BLOCK_N + 1 + FIXED_BLOCKS;
    int64_t payload = (total + parts - 1) / parts + FIXED_BLOCKS;
    int64_t seq = 0, done = 0, pieces = 0, makespan = 0, split = 0;
    for (int64_t p = 0; p < parts; p++) {
        int64_t room = payload, load = 0;
        while (seq < n) {
            int64_t rest = (lens[seq] > 1 ? lens[seq] - 1 : 0) / BLOCK_N + 1 - done;
            if (room >= rest + FIXED_BLOCKS) {
                if (pieces > 0) split++;
                room -= rest + FIXED_BLOCKS;
                load += rest + FIXED_BLOCKS;
                seq++;
                done = 0;
                pieces = 0;
            } else {
                if (room > FIXED_BLOCKS) {
                    done += room - FIXED_BLOCKS;
                    pieces++;
                    load += room;
                }
                break;
            }
        }
        if (load > makespan) makespan = load;
    }
    out[0] = makespan;
    out[1] = split;
}

/* FlashMLAModel.estimate (not raw) as an est_model_fn; p: sm_count, heads, q_len, then the
   coefficients of FLASHMLA_FEATURES (one, makespan, split_seqs, batch) */
double fm_model_estimate(const double *p, int64_t v, const est_call_t *c) {
    double mine;
    int in = linear_window(v, c, &mine);
    if (in <= 0) return in < 0 ? NAN : mine;
    int64_t f[2];
    fm_features(c->lens, c->n, (int64_t)p[1], (int64_t)p[2], (int64_t)p[0], f);
    double feats[4] = {1.0, (double)f[0], (double)f[1], (double)c->n};
    double t = 0.0;
    for (int i = 0; i < 4; i++) t = t + p[3 + i] * feats[i];
    return t;
}
"""
_I64 = ctypes.c_int64
_native = native.Library("flash_mla_schedule", _NATIVE_SOURCE, {
    "fm_features": (None, (ctypes.c_void_p, _I64, _I64, _I64, _I64, ctypes.POINTER(_I64)))})


@dataclass(frozen=True)
class FlashMLAModel(LinearModel):
    """FlashMLA's time as a linear model over its replayed schedule (FLASHMLA_FEATURES),
    fitted to its times over the family's grid. The replay is O(batch + partitions), so it
    runs wherever the window lets it."""

    FEATURES = FLASHMLA_FEATURES
    WHAT = "FlashMLA"

    def features(self, key, kv_lens: Sequence[int]) -> list[float]:
        return flash_mla_features(kv_lens, key.heads, key.q_len, self.sm_count)

    def native_estimate(self, key, calibration) -> tuple[int, np.ndarray] | None:
        """(the address of `estimate`'s C function, its params) for the family's compiled
        estimate (serving/estimate.py), or None without a C compiler. calibration: unused."""
        lib = _native()
        if lib is None:
            return None
        params = np.asarray([self.sm_count, key.heads, key.q_len, *self.coef], dtype=np.float64)
        return ctypes.cast(lib.fm_model_estimate, ctypes.c_void_p).value, params


def fit(key, variants: Sequence, points: Mapping, cells: Mapping, platform: Mapping,
        interpolate: Callable) -> list[FlashMLAModel]:
    """FlashMLA's model (linear_schedule.fit_model: its last-rung times at the family's
    aligned cells, where exactly one FlashMLA variant is among the eager picks). `points` and
    `interpolate` are not used."""
    return fit_model(FlashMLAModel, key, variants, cells, platform)


def load(entry: Mapping, variant, key, check) -> FlashMLAModel:
    """A model from its table entry (as_dict's fields; `check`: the table's field checks)."""
    return load_model(FlashMLAModel, entry, variant, check)
