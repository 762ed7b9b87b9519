"""Small C helpers for host-time-critical loops, compiled on first use with the system's C
compiler and loaded with ctypes (as Triton builds its launchers).

`Library(name, source, signatures)` is one such helper: calling it returns the library
(its functions typed by `signatures`), loaded once per process, or None. `load(name,
source)` compiles `source` once per machine into
$MLA_TUNE_CACHE/native/NAME-HASH.so (default ~/.cache/mla-tune/native; the hash is the
source's and the compiler's), written atomically, and returns the ctypes library, or
None where it cannot: no C compiler (`$CC`, else cc or gcc on PATH), a compile error (one
warning), or $MLA_TUNE_NO_NATIVE set. A caller then runs its Python path, which must give
the same results: the C code is compiled without fast-math and without floating-point
contraction, so its double arithmetic is IEEE's, operation by operation, as numpy's is.
Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

CACHE_ENV = "MLA_TUNE_CACHE"
DISABLE_ENV = "MLA_TUNE_NO_NATIVE"
FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math", "-std=c99")

_loaded: dict[str, ctypes.CDLL | None] = {}

# `HEAP_OPS(P, T, KEY)` defines, for a binary min-heap of T ordered by KEY(x) (a macro of
# one element), `P_sift_down(T *h, int64_t n)`: the root moved down to its place after its
# key grew (Python's heapq.heapreplace), and `P_push(T *h, int64_t n, T x)`: x added to a
# heap of n (room for n + 1; heapq.heappush).
HEAP_C = r"""
#include <stdint.h>
#define HEAP_OPS(P, T, KEY) \
static void P##_sift_down(T *h, int64_t n) { \
    T x = h[0]; \
    int64_t i = 0; \
    for (;;) { \
        int64_t c = 2 * i + 1; \
        if (c >= n) break; \
        if (c + 1 < n && KEY(h[c + 1]) < KEY(h[c])) c++; \
        if (KEY(h[c]) >= KEY(x)) break; \
        h[i] = h[c]; \
        i = c; \
    } \
    h[i] = x; \
} \
static void P##_push(T *h, int64_t n, T x) { \
    int64_t i = n; \
    while (i > 0) { \
        int64_t p = (i - 1) / 2; \
        if (KEY(h[p]) <= KEY(x)) break; \
        h[i] = h[p]; \
        i = p; \
    } \
    h[i] = x; \
}
"""

# makespan.deal in C, for the makespan replays (backends/*_schedule.py; HEAP_C included).
# `deal_short`: its two cases without a dealing: n_items split items (tokens in all, the
# longest `longest`), each run by `programs` programs of `item` tokens' fixed cost, over
# `slots` slots. Returns 1 with *span set where they fit one wave (the longest program) or
# pass exact_waves waves (the mean load plus half the longest program), 0 where the caller
# deals them: it lays out the programs (in launch order) as runs of equal work (`add_run`)
# and calls `greedy_runs`. That deals each program to a least-loaded slot, as
# makespan.greedy_makespan's blocks and heap do; it differs from them only in which of
# equally loaded slots a program takes, so the slots' loads are the same sums (each slot's
# programs added in launch order) and the most-loaded slot's load is the same double.
DEAL_C = HEAP_C + r"""
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* `count` programs (or slots) of `work` tokens each */
typedef struct { double work; int64_t count; } run_t;
#define RUN_WORK(r) ((r).work)
HEAP_OPS(runs, run_t, RUN_WORK)  /* runs_sift_down, runs_push: a heap of runs by their work */

static int deal_short(int64_t n_items, int64_t programs, int64_t slots, int64_t exact_waves, int64_t tokens,
                      int64_t longest, double item, double *span) {
    int64_t count = n_items * programs;
    if (count <= slots) { *span = (double)longest + item; return 1; }
    if (count > exact_waves * slots) {
        *span = ((double)tokens + item * (double)n_items) * (double)programs / (double)slots
                + ((double)longest + item) / 2.0;
        return 1;
    }
    return 0;
}

/* runs[0..nr) with `count` more programs of `work` after them (none for count 0, one run
   with the last where its work is the same); returns the new nr */
static int64_t add_run(run_t *runs, int64_t nr, double work, int64_t count) {
    if (count <= 0) return nr;
    if (nr > 0 && runs[nr - 1].work == work) { runs[nr - 1].count += count; return nr; }
    runs[nr].work = work;
    runs[nr].count = count;
    return nr + 1;
}

/* a[0..n) sorted by work, ascending; tmp: n runs (insertion runs of 16, then bottom-up merges) */
static void sort_runs(run_t *a, int64_t n, run_t *tmp) {
    int64_t i = 1;
    while (i < n && a[i].work >= a[i - 1].work) i++;
    if (i >= n) return;
    for (int64_t lo = 0; lo < n; lo += 16) {
        int64_t hi = lo + 16 < n ? lo + 16 : n;
        for (int64_t j = lo + 1; j < hi; j++) {
            run_t x = a[j];
            int64_t h = j;
            while (h > lo && a[h - 1].work > x.work) { a[h] = a[h - 1]; h--; }
            a[h] = x;
        }
    }
    run_t *src = a, *dst = tmp;
    for (int64_t width = 16; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t x = lo, y = mid, o = lo;
            while (x < mid && y < hi) {  /* without a branch on the comparison */
                int64_t t = src[y].work < src[x].work;
                dst[o++] = src[t ? y : x];
                y += t;
                x += 1 - t;
            }
            while (x < mid) dst[o++] = src[x++];
            while (y < hi) dst[o++] = src[y++];
        }
        run_t *t = src; src = dst; dst = t;
    }
    if (src != a) memcpy(a, src, (size_t)n * sizeof(run_t));
}

/* The most-loaded slot's load when the programs of runs[0..nr) (in launch order, each work
   positive) are dealt one by one to a least-loaded of `slots` slots (buf: 3 x slots runs).
   The slots' loads are kept as runs of equal load (a run of programs takes a run of equal
   least loads all at once, each ending at the same load), in three places whose least is
   the least load: `q` the first wave's loads sorted (taken from its front), `fifo` the loads
   dealt since that came in ascending order (appended at its back), `heap` those that did
   not. Every run holds at least one slot, so each place holds at most `slots` runs. */
static double greedy_runs(const run_t *runs, int64_t nr, int64_t slots, run_t *buf) {
    run_t *q = buf, *fifo = buf + slots, *heap = buf + 2 * slots;
    int64_t r = 0, c = nr > 0 ? runs[0].count : 0, left = slots, nq = 0;
    while (r < nr && left > 0) {  /* the first wave: an empty slot each */
        int64_t t = c < left ? c : left;
        q[nq].work = runs[r].work;
        q[nq++].count = t;
        left -= t;
        c -= t;
        if (c == 0 && ++r < nr) c = runs[r].count;
    }
    double top = 0.0;
    if (r >= nr) {
        for (int64_t j = 0; j < nq; j++) if (q[j].work > top) top = q[j].work;
        return top;
    }
    sort_runs(q, nq, heap);  /* the heap's room as scratch: it is empty yet */
    int64_t a = 0, b = 0, nf = 0, nh = 0;  /* q[a..nq), fifo[b..nf), heap[0..nh) */
    for (;;) {
        double w = runs[r].work;
        while (c > 0) {  /* c programs of work w: the next ones take the least loads */
            double x = a < nq ? q[a].work : HUGE_VAL, y = b < nf ? fifo[b].work : HUGE_VAL;
            run_t add;
            if (nh > 0 && heap[0].work < x && heap[0].work < y) {
                add.work = heap[0].work + w;
                if (c >= heap[0].count) {  /* all the heap's least take one each */
                    c -= heap[0].count;
                    heap[0].work = add.work;
                    runs_sift_down(heap, nh);
                    continue;
                }
                heap[0].count -= c;  /* it stays the least */
                add.count = c;
                c = 0;
            } else {
                run_t *from = x <= y ? &q[a] : &fifo[b];
                add.work = from->work + w;
                add.count = c < from->count ? c : from->count;
                c -= add.count;
                if ((from->count -= add.count) == 0) { if (x <= y) a++; else b++; }
                if (b == nf) b = nf = 0;
                if (nf > b && add.work == fifo[nf - 1].work) { fifo[nf - 1].count += add.count; continue; }
                if (nf == b || add.work > fifo[nf - 1].work) {
                    if (nf == slots) {  /* at the buffer's end: the queue moved to its front */
                        memmove(fifo, fifo + b, (size_t)(nf - b) * sizeof(run_t));
                        nf -= b;
                        b = 0;
                    }
                    fifo[nf++] = add;
                    continue;
                }
            }
            runs_push(heap, nh++, add);
        }
        if (++r >= nr) break;
        c = runs[r].count;
    }
    top = a < nq ? q[nq - 1].work : 0.0;
    if (nf > b && fifo[nf - 1].work > top) top = fifo[nf - 1].work;
    for (int64_t j = 0; j < nh; j++) if (heap[j].work > top) top = heap[j].work;
    return top;
}
"""


# One eager call as a schedule model's C estimate sees it (serving/estimate.py's compiled
# estimate; the Python `Call` there is the same call): its lengths, and per variant of the
# family (indices in the family's variant order) the interpolated times, rates and batch
# buckets' times (NAN where a variant has none) and the estimates so far. A model's C
# estimate is an `est_model_fn`: params (its own, laid out by its module), its variant's
# index, the call; NAN for no estimate.
ESTIMATE_H = r"""
#include <stdint.h>
#include <math.h>
typedef struct {
    const int64_t *lens;
    int64_t n, batch, uniform_len, calibrated, nv;
    double mean, window, interp_min;
    const double *interp, *rates, *buckets;
    double *est;
} est_call_t;
typedef double (*est_model_fn)(const double *params, int64_t variant, const est_call_t *call);
"""


class Library:
    """A C helper: `source` compiled on first use (`load`), its functions' (restype,
    argtypes) set from `signatures`; calling it returns the library, or None (the numpy
    path), the same object every time. python_api: the functions call Python's C API
    (declared by hand from its stable ABI, no Python.h needed) and are called holding the
    GIL (ctypes.PyDLL)."""

    def __init__(self, name: str, source: str, signatures: dict[str, tuple], python_api: bool = False):
        self.name, self.source, self.signatures, self.python_api = name, source, signatures, python_api
        self._lib: list = []

    def __call__(self) -> ctypes.CDLL | None:
        if not self._lib:
            lib = load(self.name, self.source, self.python_api)
            if lib is not None:
                for fn, (restype, argtypes) in self.signatures.items():
                    getattr(lib, fn).restype, getattr(lib, fn).argtypes = restype, list(argtypes)
            self._lib.append(lib)
        return self._lib[0]


# `ints_of_list`: a Python list of ints copied into an int64 buffer in one pass, without
# making each one a numpy scalar (np.asarray of a list costs ~40 ns an item). A library that
# includes it calls Python's C API: load it with python_api=True.
LIST_C = r"""
#include <stdint.h>
#include <stddef.h>
typedef struct _object PyObject;
extern ptrdiff_t PyList_Size(PyObject *);
extern PyObject *PyList_GetItem(PyObject *, ptrdiff_t);
extern long long PyLong_AsLongLong(PyObject *);
extern PyObject *PyErr_Occurred(void);
extern void PyErr_Clear(void);

/* the list's ints into out: their count, or -1 where it holds more than cap or an item is
   not an int that fits in 64 bits (the error cleared) */
int64_t ints_of_list(PyObject *list, int64_t *out, int64_t cap) {
    ptrdiff_t n = PyList_Size(list);
    if (n < 0) { PyErr_Clear(); return -1; }
    if (n > cap) return -1;
    for (ptrdiff_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyList_GetItem(list, i));
        if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
        out[i] = (int64_t)v;
    }
    return (int64_t)n;
}
"""
_list_reader = Library("list_reader", LIST_C, {"ints_of_list": (ctypes.c_int64, (
    ctypes.py_object, ctypes.c_void_p, ctypes.c_int64))}, python_api=True)


class IntBuffer:
    """A growing int64 buffer that a list of ints is copied into (`fill`): a C pass over the
    list where a C compiler is found, else numpy's."""

    __slots__ = ("array", "address", "capacity", "fn")

    def __init__(self, capacity: int = 256):
        self._grow(max(capacity, 1))
        lib = _list_reader()
        self.fn = lib.ints_of_list if lib is not None else None

    def _grow(self, capacity: int) -> None:
        import numpy as np

        self.array = np.empty(capacity, dtype=np.int64)
        self.address, self.capacity = self.array.ctypes.data, capacity

    def fill(self, values) -> int:
        """Copy `values` (a list or sequence of ints) in; returns their count. array[:count]
        (at `address`) holds them."""
        n = len(values)
        if n > self.capacity:
            self._grow(2 * n)
        if self.fn is not None and type(values) is list and self.fn(values, self.address, self.capacity) == n:
            return n
        self.array[:n] = values
        return n


def cache_dir() -> Path:
    """$MLA_TUNE_CACHE/native, else ~/.cache/mla-tune/native."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "mla-tune") / "native"


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH; None where there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def address(array) -> int:
    """The address of a C-contiguous numpy array's first element, for a C helper (the
    cheapest way ctypes offers; a read-only array takes numpy's own)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):
        return array.ctypes.data


def load(name: str, source: str, python_api: bool = False) -> ctypes.CDLL | None:
    """The compiled `source` (see the module), or None: the caller's Python path runs.
    python_api: loaded as a ctypes.PyDLL (see Library)."""
    if os.environ.get(DISABLE_ENV):
        return None
    cc = compiler()
    key = f"{name}\0{cc}\0{' '.join(FLAGS)}\0{python_api}\0{source}"
    if key in _loaded:
        return _loaded[key]
    lib = None
    if cc is not None:
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        path = cache_dir() / f"{name}-{digest}.so"
        try:
            if not path.exists():
                _build(cc, source, path)
            lib = (ctypes.PyDLL if python_api else ctypes.CDLL)(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            warnings.warn(f"mla_tune.native: cannot build {name} with {cc} ({' '.join(str(exc).split())[:200]}); "
                          "the Python path runs instead (same results, more host time)", stacklevel=3)
    _loaded[key] = lib
    return lib


def _build(cc: str, source: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "src.c", Path(tmp) / "lib.so"
        src.write_text(source, encoding="utf-8")
        done = subprocess.run([cc, *FLAGS, "-o", str(out), str(src)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"exit {done.returncode}: {(done.stderr or done.stdout).strip()}")
        os.replace(out, path)  # atomic: a concurrent builder of the same source writes the same bytes
