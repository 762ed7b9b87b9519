"""`mla-tune time variants`: chosen leaderboard variants checked and timed side by side.

For a quick look at a few variants; the sweep is what decides. At each shape, on one fresh
input (seed batch * 7 + kv_len), every variant is built by its backend, checked against the
fp32 reference under the `leaderboard` and `strict` rules, and timed under the leaderboard
protocol (timing.time_call: L2 flushed, CUDA events, median of `reps`). An fp8_static
variant gets its q_amax from 8 seeds' q (1.1 x their largest |q|), as calibration does. A
variant that fails to build or run is a row with its error; the others go on. With
`floor`, each shape first gets a row FLOOR_ROW: one launch that writes one element, timed the
same way, the protocol's own fixed cost that every figure at that shape includes. On the CPU
(Triton's interpreter, for tests) the times are wall clock and mean nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from mla_tune.core import Shape, Variant
from mla_tune.errors import MlaTuneError

DEFAULT_SHAPES = "4x1024,4x8192,32x1024,32x8192,64x1024,64x8192,256x1024,256x8192"
FLOOR_ROW = "floor: one launch writing one element"


def parse_shapes(text: str, what: str = "--shapes") -> list[Shape]:
    """'4x1024,32x8192' -> [Shape(4, 1024), Shape(32, 8192)]; refused by name otherwise."""
    shapes = []
    for item in text.split(","):
        batch, sep, kv_len = item.strip().partition("x")
        try:
            shape = Shape(int(batch), int(kv_len)) if sep else None
        except ValueError:
            shape = None
        if shape is None:
            raise MlaTuneError(f"{what}: {item!r} is not BATCHxKV_LEN (positive integers, e.g. 4x1024)")
        shapes.append(shape)
    return shapes


def timer_for(device: str) -> Callable[..., object]:
    """The timer of these commands: timing.time_call on a GPU; on the CPU wall clock with no
    warm-up call (every call is checked, so run once, just before it is timed)."""
    import functools

    from mla_tune.tune import timing

    return timing.time_call if device != "cpu" else functools.partial(timing.cpu_time, warmup=0)


def first_line(exc: BaseException) -> str:
    """'TypeName: the message's first line', for a row that failed."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def parse_variants(texts: list[str]) -> list[Variant]:
    """Variant texts as `mla-tune show` prints them; a bad one is refused by name."""
    out = []
    for text in texts:
        try:
            out.append(Variant.parse(text))
        except ValueError as exc:
            raise MlaTuneError(f"{text!r} is not a variant (like triton(block_n=32,...)): {exc}") from None
    return out


def time_variants(variants: list[Variant], shapes: list[Shape], *, reps: int = 30, device: str = "cuda",
                  log: Callable[[str], None] = print, floor: bool = False) -> list[dict]:
    """Check and time each variant at each shape (see the module); prints a row per pair as
    it goes and returns them: shape, variant, us/p10/p90 (None when it failed), leaderboard
    and strict (the checks' verdicts), error (None, or the exception's first line). floor:
    a FLOOR_ROW row first at each shape (its checks are None: it computes nothing)."""
    import torch

    from mla_tune.backends import get_backend
    from mla_tune.problem import RULES, check, generate_input, reference

    timer = timer_for(device)
    log(f"{'shape':>10} {'us':>8} {'p10':>7} {'p90':>7} {'lb':>4} {'strict':>6}  variant")
    rows = []
    for shape in shapes:
        data = generate_input(shape.batch, shape.kv_len, seed=shape.batch * 7 + shape.kv_len, device=device)
        inputs, ref = data[:4], reference(data)
        if floor:
            one = torch.empty(1, device=device)
            t = timer(one.zero_, reps=reps)
            rows.append(dict(shape=str(shape), variant=FLOOR_ROW, us=t.median_us, p10=t.p10_us, p90=t.p90_us,
                             leaderboard=None, strict=None, error=None))
            log(f"{str(shape):>10} {t.median_us:8.1f} {t.p10_us:7.1f} {t.p90_us:7.1f} {'-':>4} {'-':>6}  {FLOOR_ROW}")
        q_amax = 1.1 * max(float(generate_input(shape.batch, 1, seed=s, device=device)[0].abs().amax())
                           for s in range(8))
        for variant in variants:
            if variant.get("q") == "fp8_static":
                variant = variant.with_params(q_amax=round(q_amax, 3))
            row = dict(shape=str(shape), variant=str(variant), us=None, p10=None, p90=None,
                       leaderboard=False, strict=False, error=None)
            try:
                runner = get_backend(variant.backend).build(variant, shape, device)
                out = runner(*inputs).clone()
                row["leaderboard"] = check(out, ref, RULES["leaderboard"]).passed
                row["strict"] = check(out, ref, RULES["strict"]).passed
                t = timer(lambda runner=runner, inputs=inputs: runner(*inputs), reps=reps)
                row.update(us=t.median_us, p10=t.p10_us, p90=t.p90_us)
                log(f"{str(shape):>10} {t.median_us:8.1f} {t.p10_us:7.1f} {t.p90_us:7.1f} "
                    f"{'ok' if row['leaderboard'] else 'FAIL':>4} {'ok' if row['strict'] else 'FAIL':>6}  {variant}")
            except Exception as exc:  # noqa: BLE001 - a look at several variants: show each failure, go on
                row["error"] = first_line(exc)
                log(f"{str(shape):>10} {'error':>8}  {variant}: {row['error']}")
            rows.append(row)
        del data, inputs, ref
        if device != "cpu":
            torch.cuda.empty_cache()
    return rows
