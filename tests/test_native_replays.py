"""The schedule replays in C (mla_tune/native.py) equal their numpy paths on random ragged batches,
and those equal plain replays (a list loop, a heap, MLAPlan chunk by chunk); else numpy runs."""

import heapq
import itertools
import random
import subprocess
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mla_tune import native
from mla_tune.backends import flashinfer_mla_schedule as fi
from mla_tune.backends import gluon_fused_schedule as gl
from mla_tune.backends import makespan
from mla_tune.backends import triton_splitk_schedule as sk
from mla_tune.core import CallSpec, Variant
from mla_tune.serving import estimate
from mla_tune.serving.decode_plan import DecodePlan
from mla_tune.serving.table import load_serving_table

COMMITTED = "tables/H200.serving.yaml"
needs_c = pytest.mark.skipif(native.compiler() is None,
                             reason="no C compiler here: the Python path runs (checked elsewhere)")


@pytest.fixture(autouse=True)
def _c_path_allowed(monkeypatch):
    """$MLA_TUNE_NO_NATIVE (the C path off) does not apply to tests that compare the two paths."""
    monkeypatch.delenv(native.DISABLE_ENV, raising=False)


@pytest.fixture()
def numpy_path(monkeypatch):
    """fn(*args) with the numpy path of the replays (their C libraries unset)."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            for module in (sk, gl, fi):
                m.setattr(module, "_native", lambda: None)
            return fn(*args)
    return run


def _on_every_path(numpy_path, fn, lens, *args):
    """fn(lens, *args) over an int64 array (C where built), the same as a list, and the array
    on the numpy path: asserted equal, returned."""
    got = fn(lens, *args)
    assert got == fn(lens.tolist(), *args) == numpy_path(fn, lens, *args), (lens.tolist(), *args)
    return got


def _batches(seed: int, n: int = 400, max_batch: int = 256, empty: float = 0.15):
    """n random ragged batches (`empty` of them with a 0 length): (rng, batch, lens, heads)."""
    rng = random.Random(seed)
    for _ in range(n):
        batch = rng.randint(1, max_batch)
        lens = [int(2 ** rng.uniform(0, 16.5)) for _ in range(batch)]
        if rng.random() < empty:
            lens[rng.randrange(batch)] = 0
        yield rng, batch, np.asarray(lens, dtype=np.int64), rng.choice([16, 64, 128])


def _splitk_params(rng) -> dict:
    """Random split-K parameters: every split rule, with and without a batch budget."""
    return {"max_splits": rng.choice([1, 2, 4, 8, 16, 32, 33, 64]),
            "tokens_per_split": rng.choice([16, 128, 256, 512, 1024, 4096]),
            "block_n": rng.choice([16, 32, 64]), "block_h": rng.choice([16, 32, 64]),
            "split_budget": rng.choice([0, 0, 33, 66, 132, 264])}


def test_the_split_k_replay_in_c_is_the_numpy_one_and_the_loop_over_a_list(numpy_path, monkeypatch):
    """Over an int64 array (the eager lookup's) in C and numpy, and over a list (split_rule's)."""
    dealt = []  # the numpy path's exact dealings (the other steps are one wave or many waves)
    real = makespan.greedy_makespan  # the dealing split-K's replay shares (makespan.deal)
    monkeypatch.setattr(makespan, "greedy_makespan", lambda work, slots: dealt.append(1) or real(work, slots))
    branches = set()
    for rng, _batch, lens, heads in _batches(3, 1000):
        q_len, params = rng.randint(1, 4), _splitk_params(rng)
        # a few SMs too: fewer slots than a dealing block (16) cuts every block short
        occupancy, sm = rng.randint(1, 4), rng.choice([2, 7, 78, 132, 132])
        item = rng.choice([0, 32, 128, 256, 0.5])
        case = (heads, q_len, params, occupancy, sm, item)
        got = _on_every_path(numpy_path, sk.splitk_schedule, lens, *case)
        assert type(got[1]) is int, (lens.tolist(), *case)
        branches.add("one wave" if got[0] == max(lens) + item else "more")
    assert 100 < len(dealt) < 900  # of 1000: both the exact dealing and the others, often
    assert branches == {"one wave", "more"}
    no_budget = {"max_splits": 8, "tokens_per_split": 512, "block_n": 32, "block_h": 64}
    for zeros in (np.zeros(3, dtype=np.int64), [0, 0, 0]):  # all lengths 0
        assert sk.splitk_schedule(zeros, 128, 1, params, 1, 132) == (0.0, 0)
        assert sk.splitk_schedule(zeros, 128, 1, no_budget, 2, 132) == (0.0, 0)
    # a strided or int32 array is read as the numbers it holds
    lens = np.arange(1, 400, dtype=np.int32)[::2] * 37
    want = numpy_path(sk.splitk_schedule, lens.astype(np.int64), 16, 1, params, 2, 132, 64)
    assert sk.splitk_schedule(lens, 16, 1, params, 2, 132, 64) == want


def _dealings(seed: int, n: int):
    """n random dealings (work in launch order, slots): runs of equal programs, equal loads,
    rising (past the ascending queue's buffer), falling, mixed, long among short, fractional."""
    rng = random.Random(seed)
    draw = {"alphabet": lambda: float(rng.choice([1, 2, 3, 5])),  # one program's work, by shape
            "rising": lambda: float(rng.randint(1, 50)),
            "falling": lambda: float(rng.randint(1, 5000)),
            "random": lambda: float(rng.randint(1, 100000)),
            "long among short": lambda: float(rng.choice([512, 512, 512, rng.randint(1, 64)])),
            "fractional": lambda: rng.randint(1, 300) + rng.choice([0.5, 0.1, 0.25, 1 / 3])}
    for _ in range(n):
        slots = rng.choice([1, 2, 3, 7, 16, 17, 64, 132, 264, rng.randint(1, 300)])
        count = rng.randint(1, 10 * slots + 20)
        shape = rng.choice(["runs", *draw])
        work = [draw[shape]() for _ in range(count)] if shape != "runs" else []
        while len(work) < count:  # runs
            run = rng.choice([16, 32, 64, 96, 128]) * rng.randint(1, 8) + rng.choice([0, 32, 256])
            work += [float(run)] * rng.choice([1, 1, 2, 4, 8, rng.randint(1, 2 * slots)])
        if shape in ("rising", "falling"):
            work.sort(reverse=shape == "falling")
        yield np.asarray(work[:count], dtype=np.float64), slots


def test_the_runs_dealing_in_numpy_and_in_c_is_a_plain_heaps_makespan():
    """The numpy dealing the replays share (makespan.greedy_makespan) and, where a C compiler
    is found, the C one (greedy_runs, through sk_deal) give a plain heap's makespan exactly."""
    lib = sk._native()
    for work, slots in _dealings(17, 3000):
        heap = [0.0] * slots
        for w in work.tolist():
            heapq.heapreplace(heap, heap[0] + w)
        want = float(makespan.greedy_makespan(work, slots))
        assert want == max(heap), (work.tolist(), slots)
        if (work == work.round()).all():  # whole numbers: an int64 array deals the same
            assert makespan.greedy_makespan(work.astype(np.int64), slots) == want
        if lib is not None:
            got = lib.sk_deal(native.address(work), work.shape[0], slots)
            assert got == want, (work.tolist(), slots)


def _chunk_replay(kv_lens: list[int], heads: int, q_len: int, sm_count: int) -> list[float]:
    """flashinfer_mla_features by a chunk-by-chunk replay of MLAPlan's dealing: a heap of
    (cost << 12) | cluster."""
    slots = 1 << 12
    packed = q_len * heads
    cluster = 2 if packed > 64 else 1
    clusters = max(sm_count // cluster, 1)
    tile = 64 * cluster
    q_tiles = -(-packed // tile)
    per_cluster = max(-(-sum(kv_lens) * q_tiles // clusters), 1)
    small = ((8, 32), (16, 64), (32, 128), (64, 192))  # (tokens per cluster up to, limit)
    limit = next((lim for top, lim in small if per_cluster <= top), -(-per_cluster // 256) * 256)
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
        last = (2 * tile + rest) * slots if rest or not full else 0
        for _ in range(q_tiles):
            for cost in [(2 * tile + limit) * slots] * full + ([last] if last else []):
                top = heap[0]
                works[top % slots] += 1
                heapq.heapreplace(heap, top + cost)
    return [1.0, float(max(heap) // slots), float(max(works)), float(merge_ctas),
            float(len(kv_lens)), float(max_merge)]


def test_flashinfer_replay_and_dealing_in_c_are_the_numpy_paths_and_built_wherever_a_c_compiler_is(numpy_path):
    """The replay (C, numpy; array, list) equals `_chunk_replay`; its C dealing (clusters not dealt
    to, an ascending queue, a heap) deals as numpy's heap does on equal, few distinct (ties to the
    lower index), one long and random lengths, over 1 to 66 clusters and 132."""
    have = native.compiler() is not None
    assert (sk._native() is not None, fi._native() is not None) == (have, have)
    merged = several_tiles = 0
    for rng, _batch, lens, heads in itertools.chain(_batches(5), _batches(11, 400, max_batch=160)):
        q_len, sm = rng.randint(1, 4), rng.choice([78, 132])
        want = _chunk_replay(lens.tolist(), heads, q_len, sm)
        got = _on_every_path(numpy_path, fi.flashinfer_mla_features, lens, heads, q_len, sm)
        assert got == want, (lens.tolist(), heads, q_len, sm)
        _on_every_path(numpy_path, fi.flashinfer_mla_works_per_cluster, lens, heads, q_len, sm)
        merged += want[3] > 0
        several_tiles += q_len * heads > 128
    assert merged > 100 and several_tiles > 100  # of 800 batches
    for heads in (16, 128):  # no sequences
        got = _on_every_path(numpy_path, fi.flashinfer_mla_features, np.zeros(0, dtype=np.int64), heads, 1, 132)
        assert got == _chunk_replay([], heads, 1, 132)
    if not have:
        pytest.skip("no C compiler here: the numpy dealing is the only one")
    rng = random.Random(23)
    for _ in range(1500):
        batch = rng.randint(1, 256)
        shape = rng.choice(["equal", "few", "one long", "random"])
        if shape == "equal":
            lens = [rng.choice([1, 64, 100, 256, 1000, 4096, 20000])] * batch
        elif shape == "few":
            pool = [rng.randint(1, 70000) for _ in range(rng.randint(2, 4))]
            lens = [rng.choice(pool) for _ in range(batch)]
        elif shape == "one long":
            lens = [rng.randint(1, 200) for _ in range(batch)]
            lens[rng.randrange(batch)] = rng.randint(10000, 300000)
        else:
            lens = [int(2 ** rng.uniform(0, 17)) for _ in range(batch)]
        lens = np.asarray(lens, dtype=np.int64)
        heads, q_len, sm = rng.choice([16, 64, 128]), rng.randint(1, 4), rng.choice([2, 3, 7, 16, 78, 132, 133])
        _on_every_path(numpy_path, fi.flashinfer_mla_features, lens, heads, q_len, sm)


def test_without_a_compiler_or_with_a_broken_one_the_python_path_runs(monkeypatch, tmp_path):
    source = "int one(void) { return 1; }\n"
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))

    def load(name, text=source):  # in a fresh process (none loaded yet)
        monkeypatch.setattr(native, "_loaded", {})
        return native.load(name, text)

    assert load("probe").one() == 1
    (built,) = (tmp_path / "native").glob("probe-*.so")
    calls = []
    real = subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert load("probe").one() == 1 and calls == []  # the cached library, not built again
    assert list((tmp_path / "native").glob("probe-*.so")) == [built]
    monkeypatch.setenv(native.DISABLE_ENV, "1")
    assert load("probe") is None
    monkeypatch.delenv(native.DISABLE_ENV)
    with pytest.warns(UserWarning, match="cannot build broken"):
        assert load("broken", "this is not C\n") is None
    # the estimator's pick without its C library: the Python estimates
    monkeypatch.setattr(estimate, "_native", lambda: None)
    table = load_serving_table(COMMITTED)
    family = next(iter(table.families.values()))
    table.estimator.prepare(family)
    assert table.estimator.compiled(family) is None
    allowed = table.estimator.allowed(family, lambda v: v.backend == "triton")
    variant, ok = table.estimator.pick(family, 8, 3000.0, [3000] * 8, allowed)
    want = table.estimator.estimates(family, 8, 3000.0, [3000] * 8)
    assert variant == estimate.fastest(want) and want
    assert ok == estimate.fastest(want, allowed.accepts) and allowed.mask is None
    # last: the schedules' C libraries load once per process, so none may first load without a compiler
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert load("other", source + "\n") is None


def test_a_split_k_and_a_gluon_models_one_call_replay_in_c_is_its_numpy_replay(numpy_path):
    """SplitKModel.replay (makespan, reduction steps, a uniform batch's steps: one C call);
    GluonModel.replay (gluon_fused's makespan, one C call) over one wave, many, the heap."""
    for rng, batch, lens, heads in _batches(5):
        q_len = rng.randint(1, 4)
        variant = Variant.make("triton", **_splitk_params(rng))
        model = sk.SplitKModel(variant, rng.randint(1, 4), 3.0, rng.choice([78, 132]), 0.0,
                               rng.choice([0, 32, 128]))
        uniform = max(int(lens.sum()) // batch, 1) if rng.random() < 0.9 else rng.randint(1, 70000)
        call = SimpleNamespace(key=SimpleNamespace(heads=heads, q_len=q_len), batch=batch,
                               lengths=lambda lens=lens: lens, uniform_length=lambda u=uniform: u)
        got = model.replay(call)
        want = numpy_path(model.replay, call)
        assert got == want and all(type(x) is t for x, t in zip(got[1:], (int, int), strict=True)), (
            lens.tolist(), heads, q_len, variant, uniform)
    assert gl._native() is not None
    for rng, batch, lens, heads in _batches(8):
        budget = rng.choice([0, 0, 66, 264])
        variant = Variant.make("gluon_fused", kv="fp8", q="fp8_dynamic", block_h=rng.choice([4, 8, 16, 32]),
                               max_splits=rng.choice([1, 2, 16, 33, 64]), num_stages=2,
                               tokens_per_split=rng.choice([64, 512, 2048]), v_halves=rng.choice([1, 2]),
                               **({"split_budget": budget} if budget else {}))
        model = gl.GluonModel(variant, rng.randint(1, 2), 3.0, rng.choice([2, 7, 78, 132, 132]), 0.0,
                              rng.choice([0, 32, 128]))
        call = SimpleNamespace(key=SimpleNamespace(heads=heads, q_len=1), batch=batch, lengths=lambda lens=lens: lens)
        assert model.replay(call) == numpy_path(model.replay, call), (lens.tolist(), heads, variant)


@needs_c
def test_a_familys_compiled_interpolation_and_estimate_pick_and_estimate_as_the_python_ones_do():
    """On the committed table: its grids interpolated in C agree with the Python steps to rounding,
    with the same variants left out, at random batches and lengths, on grid points and past both
    ends; Estimator.pick's one C call against Estimator.estimates and fastest: the same pick and
    estimates, float for float, for ragged, uniform and length-less calls."""
    table = load_serving_table(COMMITTED)
    rng = random.Random(11)
    compared = left_out = 0
    for family in table.families.values():
        kvs = sorted({k for _, k in family.points})
        for kind in ("times", "rates", "buckets"):
            grid = table.estimator.grid(kind, family)
            if not grid.batches:
                continue
            assert grid.dense is not None
            for _ in range(400):
                batch = rng.choice([rng.randint(1, 400), rng.choice(grid.batches)])
                kv = rng.choice([2 ** rng.uniform(4, 18), float(rng.choice(kvs))])
                got = grid.interpolate(batch, kv)
                want = estimate._blend([(w, grid.at_batch(b, kv)) for b, w in estimate._bracket(grid.batches, batch)])
                assert got.keys() == want.keys(), (kind, family.key, batch, kv)
                for v, t in got.items():
                    assert t == pytest.approx(want[v], rel=1e-12), (kind, family.key, batch, kv, v)
                compared += len(got)
                left_out += len({v for p in family.points.values() for v in p} - got.keys())
    assert compared > 10000 and left_out > 0  # the imputing and leaving-out branches ran
    families = list(table.families.values())
    allowed = {}  # per family: every other variant, and none
    for family in families:
        table.estimator.prepare(family)
        assert table.estimator.compiled(family) is not None
        names = sorted({v for times in family.points.values() for v in times}, key=str)[::2]
        allowed[family.key] = [table.estimator.allowed(family, set(names).__contains__),
                               table.estimator.allowed(family, lambda v: False)]
    rng = random.Random(2)
    picks = set()
    for _ in range(3000):
        family = rng.choice(families)
        batch = rng.randint(1, 300)
        mode = rng.random()
        lens = ([int(2 ** rng.uniform(5, 16.5)) for _ in range(batch)] if mode < 0.5
                else [int(2 ** rng.uniform(5, 16.5))] * batch if mode < 0.8 else None)
        mean = sum(lens) / batch if lens else 2 ** rng.uniform(5, 16.5)
        some, none = allowed[family.key]
        variant, ok = table.estimator.pick(family, batch, mean, lens, some)
        got = table.estimator.compiled(family).estimates_left()
        want = table.estimator.estimates(family, batch, mean, lens)
        assert variant == estimate.fastest(want) and got == want, (family.key, batch, mean, lens)
        # the fastest allowed variant, from the same C call
        assert ok == estimate.fastest(want, some.accepts), (family.key, batch, mean, lens)
        assert table.estimator.pick(family, batch, mean, lens, none)[1] is None
        assert table.estimator.pick(family, batch, mean, lens)[1] is None
        if variant is not None:  # None: no variant is estimated around the call (the lookup's cells decide)
            picks.add(variant.backend)
    assert {"flashinfer", "gluon_fused", "triton"} <= picks  # every kind of model decided some


@needs_c
def test_a_plans_step_with_host_lengths_picks_in_one_c_call_what_its_lookup_picks_from_the_mean():
    """DecodePlan.update with host lengths (_Compiled.pick_lengths) picks and counts misses as
    `pick(batch, mean, lengths)` on every committed family: ragged and uniform, batch 1 to 256 and
    600 (past the lookup's buffer: it grows first), lengths 1 to 2^17, lists and tuples."""
    table = load_serving_table(COMMITTED)
    plans = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the vendors' picks cannot run here: said once per plan
        for key in table.families:
            spec = CallSpec(key.kv_format, page_size=key.page_size, heads=key.heads, max_q_len=key.q_len,
                            host_lengths=True)
            plans[key] = DecodePlan(spec, 600, table=table, device="cpu", warm=False)
    assert all(table.estimator.compiled(table.families[key]) is not None for key in plans)
    rng = random.Random(5)
    seen = set()
    for i in range(1500):
        key = rng.choice(sorted(plans))
        plan = plans[key]
        batch = {0: 1, 1: 256, 2: 600}.get(i % 50, rng.randint(1, 256))  # the random draw made either way
        lens = ([int(2 ** rng.uniform(0, 17))] * batch if rng.random() < 0.3
                else [int(2 ** rng.uniform(0, 17)) for _ in range(batch)])
        pages = max(-(-n // key.page_size) for n in lens)
        qo = torch.arange(0, batch * key.q_len + 1, key.q_len, dtype=torch.int32)
        before = dict(plan.misses)
        got = plan.update(qo, block_table=torch.zeros((batch, pages), dtype=torch.int32),
                          seq_lens=torch.tensor(lens, dtype=torch.int32), q_lens_host=[key.q_len] * batch,
                          kv_lens_host=lens if i % 7 else tuple(lens))  # a tuple: copied in by IntBuffer.fill
        after = dict(plan.misses)
        # the estimates the step's C call left, float for float the Python estimate's at the mean
        want_est = table.estimator.estimates(table.families[key], batch, sum(lens) / batch, lens)
        assert plan.last_estimates() == want_est, (key, batch, lens)
        assert got == plan.pick(batch, sum(lens) / batch, lens), (key, batch, lens)
        assert {k: n - before.get(k, 0) for k, n in after.items()} == {
            k: n - after.get(k, 0) for k, n in plan.misses.items()}, (key, batch, lens)
        seen.add(got.backend)
    # the own Triton kernels ran, and stood in for picks that cannot run here (counted in misses)
    assert {"triton", "triton_fused"} <= seen
    assert sum(n for plan in plans.values() for k, n in plan.misses.items() if "cannot run here" in k) > 0


def test_a_list_of_ints_is_copied_into_the_int_buffer_exactly():
    """native.IntBuffer.fill (C where a compiler is found, else numpy): lists of every size, a
    tuple, numpy ints; an int past 64 bits is refused as numpy refuses it."""
    buffer = native.IntBuffer(4)
    assert (buffer.fn is not None) == (native.compiler() is not None)
    rng = random.Random(9)
    for n in (0, 1, 4, 5, 300, 1000):
        values = [rng.randint(-2 ** 62, 2 ** 62) for _ in range(n)]
        assert buffer.fill(values) == n and buffer.array[:n].tolist() == values
    assert buffer.fill((7, 8, 9)) == 3 and buffer.array[:3].tolist() == [7, 8, 9]
    assert buffer.fill([np.int32(5), 6]) == 2 and buffer.array[:2].tolist() == [5, 6]
    with pytest.raises(OverflowError):
        buffer.fill([1, 2 ** 70])
