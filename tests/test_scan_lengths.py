"""scripts/scan_lengths.py's pieces on the CPU: the lengths it times cover one kv bucket,
and the batch-budget variants it adds are split-K ones with the budget of W waves."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from mla_tune.core import Variant
from mla_tune.serving.table import kv_bucket

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "scan_lengths.py"
_spec = importlib.util.spec_from_file_location("scan_lengths", SCRIPT)
scan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scan)


def test_the_scanned_lengths_all_look_up_their_bucket_and_span_it():
    buckets = [512, 1024, 2048, 4096]
    for bucket in buckets:
        lens = scan.bucket_lengths(bucket, 8)
        assert len(lens) == 8 and lens == sorted(lens)
        assert {kv_bucket(buckets, n) for n in lens} == {bucket}
        assert lens[0] < bucket * 0.75 and lens[-1] > bucket * 1.25  # both halves of the octave


def test_budget_variants_are_made_from_split_k_ones_only():
    split = Variant.make("triton", kv="fp8", q="bf16", block_n=64, block_h=16, max_splits=17,
                         tokens_per_split=512, num_warps=8, num_stages=2, dot_dtype="bf16")
    budget = scan.with_budget(split, 2, 128, sm_count=132, heads=128)
    assert budget.p == {**split.p, "split_budget": math.ceil(2 * 132 / 8), "tokens_per_split": 128}
    unsplit = Variant.make("triton", **{**split.p, "max_splits": 1})
    assert scan.with_budget(unsplit, 1, 128, 132, 128) is None
    assert scan.with_budget(Variant.make("flashmla", kv="fp8", q="fp8_dynamic"), 1, 128, 132, 128) is None


def test_lists_of_batches_and_lengths_are_parsed_or_refused_by_name():
    assert scan.parse_ints("25,28,32", "--batch") == [25, 28, 32]
    for bad in ("25,x", "0", ""):
        try:
            scan.parse_ints(bad, "--lengths")
        except SystemExit as exc:
            assert "--lengths" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_the_script_runs_end_to_end_on_the_interpreter(tmp_path):
    """Two batches at one length, the config's split-K candidates and their budget copies:
    every one checked and timed (wall clock, meaningless), the worst regrets printed and
    the times written."""
    out = tmp_path / "scan.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(SCRIPT.parents[1]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kv", "fp8", "--heads", "16", "--batch", "1,2",
                           "--lengths", "40", "--budget-waves", "1", "--backends", "triton", "--reps", "1",
                           "--device", "cpu", "--json", str(out)],
                          cwd=SCRIPT.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["shapes"] == ["1x40", "2x40"]
    budgeted = [v for v in data["times"] if "split_budget=" in v]
    assert budgeted and all(set(t) == {"1x40", "2x40"} for t in data["times"].values())
    assert "worst" in proc.stdout and "fails the check" not in proc.stdout


def test_a_ragged_mix_runs_as_one_shape_and_is_not_mixed_with_a_grid(tmp_path):
    """--mix times one ragged batch (each sequence its own length, checked against the
    reference); with --batch, --bucket or --lengths beside it the script refuses by name."""
    out = tmp_path / "mix.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(SCRIPT.parents[1]))
    base = [sys.executable, str(SCRIPT), "--kv", "bf16", "--heads", "16"]
    proc = subprocess.run(base + ["--mix", "90,7,33", "--budget-waves", "1", "--backends", "triton",
                                  "--reps", "1", "--device", "cpu", "--json", str(out)],
                          cwd=SCRIPT.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["shapes"] == ["mix3~43"] and data["batches"] == [3]
    assert all(set(t) == {"mix3~43"} for t in data["times"].values()) and "fails the check" not in proc.stdout
    bad = subprocess.run(base + ["--mix", "90,7", "--batch", "2"], cwd=SCRIPT.parents[1], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--mix" in bad.stderr
