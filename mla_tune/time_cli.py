"""`mla-tune time`: check and time chosen kernels on this GPU, for a quick look.

    mla-tune time variants VARIANT... [--shapes 4x1024,...]      leaderboard variants, side by side
    mla-tune time mix --table T --kv fp8 --heads 16 --lens ...   a serving table's picks at one batch
    mla-tune time scan --kv fp8 --heads 16 --batch 30 --bucket 512   a family's candidates over a bucket
    mla-tune time points --table T [--points 24]                 a serving table's own points again

Each call is checked against the fp32 reference before it is timed under the leaderboard
protocol (mla_tune.tune.timing.time_call). The sweep and `mla-tune verify` decide; these
commands look. The work is in mla_tune/tune/time_variants.py (leaderboard) and
mla_tune/serving/time_picks.py (serving); this module is their command line, mounted on
the main app by `register(app)`. It imports neither torch nor a backend until a command runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from mla_tune.errors import MlaTuneError

time_app = typer.Typer(rich_markup_mode="rich", no_args_is_help=True,
                       context_settings={"help_option_names": ["-h", "--help"]},
                       help="Check and time chosen kernels on this GPU (variants, a serving mix, a "
                            "bucket's lengths, a table's points); the sweep and verify decide, these "
                            "look.")


class Device(str, Enum):
    """Where the kernels run: the GPU, or Triton's CPU interpreter (for tests)."""

    cuda = "cuda"
    cpu = "cpu"


class KvFormat(str, Enum):
    """The serving family's KV cache format."""

    bf16 = "bf16"
    fp8 = "fp8"


def register(app: typer.Typer) -> None:
    """Mount `mla-tune time` on the main command line."""
    app.add_typer(time_app, name="time")


@contextmanager
def _errors() -> Iterator[None]:
    """mla-tune's own errors as one red line and exit 1; anything else keeps its traceback."""
    try:
        yield
    except MlaTuneError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None


def check_device(device: Device) -> str:
    """The device name, once it is usable here: a GPU torch sees for cuda, Triton's
    interpreter (TRITON_INTERPRET=1) for cpu; else an MlaTuneError saying what to do."""
    if device is Device.cpu:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise MlaTuneError("--device cpu runs the kernels on Triton's interpreter: start mla-tune "
                               "with TRITON_INTERPRET=1 (its times mean nothing; it is for tests)")
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise MlaTuneError("mla-tune time needs a CUDA GPU, and torch sees none here; run it on the "
                           "GPU machine (--device cpu runs Triton's interpreter instead, for tests)")
    return "cuda"


def _floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MlaTuneError(f"{what}: {text!r} is not a comma-separated list of numbers") from None
    if any(not x > 0 for x in out):
        raise MlaTuneError(f"{what}: every value must be > 0, got {text!r}")
    return out


_DeviceOption = Annotated[Device, typer.Option(
    case_sensitive=False, help="Where to run: cuda (the GPU), or cpu (Triton's interpreter, "
    "TRITON_INTERPRET=1; for tests, its times mean nothing).")]
_KvOption = Annotated[KvFormat, typer.Option("--kv", case_sensitive=False, help="The family's KV format.")]
_HeadsOption = Annotated[int, typer.Option(min=1, help="The family's query heads (16 or 128 in the table).")]
_QLenOption = Annotated[int, typer.Option(min=1, help="The family's new tokens per sequence (q_len).")]
_PageOption = Annotated[int, typer.Option(min=1, help="The family's page size in tokens.")]


@time_app.command("variants")
def variants_command(
    variants: Annotated[list[str], typer.Argument(
        help="Variants as `mla-tune show` prints them, e.g. 'triton(block_n=32,...)'.", show_default=False)],
    shapes: Annotated[str, typer.Option(
        help="Comma-separated BATCHxKV_LEN shapes.")] = "4x1024,4x8192,32x1024,32x8192,64x1024,64x8192,"
                                                     "256x1024,256x8192",
    reps: Annotated[int, typer.Option(min=1, help="Timed calls per measurement (the median is shown).")] = 30,
    device: _DeviceOption = Device.cuda,
    floor: Annotated[bool, typer.Option(
        "--floor", help="First, per shape, time one launch that writes one element: the protocol's own "
                        "fixed cost, part of every figure.")] = False,
) -> None:
    """Check and time leaderboard variants at chosen shapes, side by side.

    Per shape, on one fresh input: each variant checked against the fp32 reference under the
    leaderboard and strict rules, then timed under the leaderboard protocol (us, p10, p90).
    fp8_static variants get q_amax from 8 seeds; a variant that fails is a row with its error."""
    with _errors():
        from mla_tune.tune.time_variants import parse_shapes, parse_variants, time_variants

        chosen, where = parse_variants(variants), parse_shapes(shapes)
        time_variants(chosen, where, reps=reps, device=check_device(device), log=typer.echo, floor=floor)


@time_app.command("mix")
def mix_command(
    table: Annotated[Path, typer.Option(help="The serving table, e.g. tables/H200.serving.yaml.")],
    kv: _KvOption,
    heads: _HeadsOption,
    lens: Annotated[str, typer.Option(
        help="Comma-separated KV lengths, one per sequence; LEN*N for N sequences of LEN.")],
    q_len: _QLenOption = 1,
    page: _PageOption = 64,
    config: Annotated[Path | None, typer.Option(
        help="The serving config (its rule and gate); the default is the one the table names.")] = None,
    variant: Annotated[list[str] | None, typer.Option(
        help="Another variant to time beside the picks (repeat the option for more).")] = None,
    reps: Annotated[int, typer.Option(min=1, help="Timed calls per measurement (the median is shown).")] = 30,
    seed: Annotated[int, typer.Option(help="The seed of the one input every role runs on.")] = 1,
    layers: Annotated[int, typer.Option(
        min=0, help="Also time each role as this many back-to-back layers of one decode step (each its own "
                    "copy of the KV cache, in a CUDA graph, the L2 flushed before the step): us per layer, "
                    "as an engine's step runs them, beside the leaderboard protocol's one flushed call.")] = 0,
    device: _DeviceOption = Device.cuda,
) -> None:
    """Check and time a serving table's picks at one batch of given lengths, beside the vendors.

    Prints the table's cell for the batch and mean length as swept, then the eager pick, the
    graph pick, each vendor's default variant that runs here and any --variant: us, ratio to
    the fastest that passes the config's rule, and the check; with --layers, each one's us
    per layer in an engine-like step too."""
    with _errors():
        from mla_tune.serving.table import FamilyKey
        from mla_tune.serving.time_picks import parse_lens, time_mix
        from mla_tune.tune.time_variants import parse_variants

        kv_lens, extra = parse_lens(lens), parse_variants(variant or [])
        time_mix(table, FamilyKey(kv.value, page, heads, q_len), kv_lens, config=config, variants=extra,
                 reps=reps, seed=seed, device=check_device(device), layers=layers, log=typer.echo)


@time_app.command("scan")
def scan_command(
    kv: _KvOption,
    heads: _HeadsOption,
    q_len: _QLenOption = 1,
    page: _PageOption = 64,
    config: Annotated[Path, typer.Option(
        help="The serving config whose candidates for the family are timed.")] = Path("configs/serving.yaml"),
    batch: Annotated[str | None, typer.Option(
        help="Batch size, or comma-separated sizes (with --bucket or --lengths).")] = None,
    bucket: Annotated[int | None, typer.Option(
        min=1, help="The kv bucket (its power of two) whose lengths to scan.")] = None,
    lengths: Annotated[str | None, typer.Option(
        help="Comma-separated kv lengths to scan instead of a bucket's.")] = None,
    mix: Annotated[str | None, typer.Option(
        help="Comma-separated kv lengths of one ragged batch, instead of --batch with --bucket or "
             "--lengths.")] = None,
    points: Annotated[int, typer.Option(min=1, help="How many lengths of the bucket to scan.")] = 8,
    budget_waves: Annotated[str, typer.Option(
        help="Comma-separated waves, e.g. 1,2: each split-K candidate again under a batch split "
             "budget of that many waves of the SMs.")] = "",
    budget_tokens: Annotated[str, typer.Option(
        help="Comma-separated tokens_per_split of the budget variants (the shortest split).")] = "128",
    backends: Annotated[str | None, typer.Option(
        help="Comma-separated backends to time; the default is all the config offers.")] = None,
    reps: Annotated[int, typer.Option(min=1, help="Timed calls per measurement (the median is kept).")] = 20,
    layers: Annotated[int | None, typer.Option(
        min=0, help="Time each candidate as this many back-to-back layers of one decode step (each its "
                    "own copy of the KV cache, in a CUDA graph, the L2 flushed before the step; us per "
                    "layer, the last layer checked); 0: one flushed call. Default: the config's "
                    "search.step_layers.")] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Write every time here (family, batches, lengths, shapes, protocol, times).")] = None,
    device: _DeviceOption = Device.cuda,
) -> None:
    """Time a family's serving candidates across one kv bucket's lengths: where a pick holds up.

    Every candidate the config offers the family (each call checked against the fp32
    reference under its rule), on uniform batches at --points lengths spread log-evenly over
    the bucket (the lengths an eager call looks it up for), at --lengths, or on one ragged
    --mix; prints each candidate's regret to the fastest per shape and its worst. With
    --layers, as an engine's step runs them."""
    with _errors():
        from mla_tune.locate import config_path
        from mla_tune.serving.table import FamilyKey
        from mla_tune.serving.time_picks import check_scan_args, parse_ints, scan_lengths

        where = dict(batches=parse_ints(batch, "--batch") if batch is not None else None, bucket=bucket,
                     lengths=parse_ints(lengths, "--lengths") if lengths is not None else None,
                     mix=parse_ints(mix, "--mix") if mix is not None else None, points=points)
        check_scan_args(**where)
        waves, tokens = _floats(budget_waves, "--budget-waves"), parse_ints(budget_tokens, "--budget-tokens")
        names = [b.strip() for b in backends.split(",") if b.strip()] if backends else None
        scan_lengths(config_path(config), FamilyKey(kv.value, page, heads, q_len), **where,
                     budget_waves=waves, budget_tokens=tokens, backends=names, reps=reps,
                     device=check_device(device), layers=layers, json_path=json_path, log=typer.echo)


@time_app.command("points")
def points_command(
    table: Annotated[Path, typer.Option(help="The serving table, e.g. tables/H200.serving.yaml.")],
    families: Annotated[str | None, typer.Option(
        help="Only the families matching these field=value terms, e.g. kv_format=fp8,heads=16.")] = None,
    points: Annotated[int, typer.Option(min=1, help="How many of the table's points to time (drawn by --seed).")] = 24,
    seed: Annotated[int, typer.Option(help="The seed the points and their inputs are drawn from.")] = 0,
    samples: Annotated[int, typer.Option(min=1, help="Samples per variant in each pass.")] = 5,
    passes: Annotated[int, typer.Option(min=1, help="Alternating passes per round (verify's final round: 4).")] = 4,
    config: Annotated[Path | None, typer.Option(
        help="The serving config (its rule and gate); the default is the one the table names.")] = None,
    budget: Annotated[float | None, typer.Option(
        min=0, help="Seconds the run may take; it stops between points and reports what it timed.")] = None,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Write every time here (each point's variants: table, fresh, passes, again).")] = None,
    workers: Annotated[int | None, typer.Option(
        min=0, help="Processes that gate (and so compile) the variants first; the default is the "
                    "config's gate_workers on a GPU, 0 (none) without one.")] = None,
    write: Annotated[Path | None, typer.Option(
        help="Time every point of the chosen families in one round of alternating passes (--points "
             "is ignored; with the gate run, no check per point, as the sweep) and write the table "
             "here with those times as its points' (review it with mla-tune diff; split a long run "
             "with --families).")] = None,
    layers: Annotated[int | None, typer.Option(
        min=0, help="Time every variant as this many back-to-back layers of one decode step (each its own "
                    "copy of the point's KV cache, in a CUDA graph): us per layer, as an engine's step "
                    "runs it; 0: one flushed call; with --write the table's points then hold those times. "
                    "Default: the table's config's search.step_layers (the protocol its points were "
                    "timed under).")] = None,
    device: _DeviceOption = Device.cuda,
) -> None:
    """Re-time a serving table's own points on this GPU: do its swept times hold here?

    At each drawn point (a family's batch and kv bucket with two or more swept variants), on
    one uniform input: every variant checked against the fp32 reference, timed as a sweep step
    (built just before, its samples in one block), then all in alternating passes, twice (as
    verify's final round). Prints the four times per variant, then how far each pair of them
    disagrees on how the variants compare (median and p90 of |log ratio| differences), the
    measure rescore's agreement line uses, and each backend's median ratio to the table.
    With --write, the table's points are timed again on this GPU as verify times and written
    to a new table: the cells keep their swept times, the schedule models their fitted
    shapes, and the provenance says what was timed again."""
    with _errors():
        from mla_tune.serving.time_picks import time_points

        time_points(table, families=families, points=points, seed=seed, samples=samples, passes=passes,
                    config=config, budget=budget, workers=workers, write=write, device=check_device(device),
                    layers=layers, json_path=json_path, log=typer.echo)
