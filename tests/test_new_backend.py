"""A new serving backend is its own file plus one registry line: the probe (PROBE_SOURCE, a
module in tmp_path; the fp32 reference rounded to bf16, at 8 heads, which no built-in serves),
registered by MLA_TUNE_EXTRA_BACKENDS (`plugin`) or one BACKEND_MODULES entry (`builtin`)."""

import sys
import textwrap

import pytest
import torch
import yaml

from mla_tune import backends, gpu, problem
from mla_tune.backends import EXTRA_BACKENDS_ENV, serving_backends
from mla_tune.core import CallSpec, Variant
from mla_tune.serving import inputs as serving
from mla_tune.serving.call import Decoder
from mla_tune.serving.cells import family_plan
from mla_tune.serving.config import load_serving_config
from mla_tune.serving.decode_plan import DecodePlan
from mla_tune.serving.sweep import run_serving_sweep
from mla_tune.serving.table import (
    Cell,
    Family,
    FamilyKey,
    ServingTable,
    load_serving_table,
    write_serving_table,
)
from mla_tune.tune.schedule import DEFAULT_COSTS, CostModel
from mla_tune.tune.timing import Timing
from tests.helpers import invoke

NAME = "probe_serving"
PROBE_SOURCE = '''
"""A serving backend for tests: the fp32 reference of the serving call, rounded to bf16."""

from __future__ import annotations

import torch

from mla_tune.core import CallSpec, Capabilities, Variant, check_serving_spec
from mla_tune.serving.inputs import reference

NAME = "probe_serving"
CAPABILITIES = Capabilities(kv_formats=("bf16",), q_modes=("bf16",), serving=True, serving_kv_formats=("bf16", "fp8"),
                            contiguous=True, page_sizes=(16,), heads=(8, 16), max_q_len=2, mixed_q_len=True,
                            platforms=(("cuda",), ("cpu",)))
TILES = (1, 2)  # a parameter that changes nothing but the variant
SPACE_KEYS = ("tile",)
RUNS: dict = {}  # str(variant) -> calls, for the tests

def unavailable_reason():
    return None

def validate(variant: Variant) -> None:
    p = dict(variant.params)
    if set(p) != {"kv", "q", "tile"} or p["q"] != "bf16" or p["kv"] not in ("bf16", "fp8") or p["tile"] not in TILES:
        raise ValueError(f"{NAME} takes kv=bf16 or fp8, q=bf16 and a tile of {TILES}, not {variant}")

def candidates(shape, space, platform) -> list[Variant]:
    return []  # the serving call only

def build(variant, shape, device):
    raise ValueError(f"{NAME} serves the serving call only")

def default_serving_variant(spec: CallSpec, platform) -> Variant:
    return Variant.make(NAME, kv=spec.kv_format, q="bf16", tile=1)

def serving_candidates(spec: CallSpec, space: dict, platform) -> list[Variant]:
    unknown = sorted(set(space) - set(SPACE_KEYS))
    if unknown:
        raise ValueError(f"{NAME}'s serving space takes {', '.join(SPACE_KEYS)}, not {unknown[0]}")
    return [Variant.make(NAME, kv=spec.kv_format, q="bf16", tile=t) for t in space.get("tile", [1])]

def build_serving(variant: Variant, spec: CallSpec, device):
    validate(variant)
    check_serving_spec(NAME, spec, CAPABILITIES, variant)

    def run(q, qo_indptr, kv, kv_scale, *, kv_indptr=None, block_table=None, seq_lens=None,
            q_lens_host=None, kv_lens_host=None):
        RUNS[str(variant)] = RUNS.get(str(variant), 0) + 1
        return reference(q, qo_indptr, kv, kv_scale, kv_indptr=kv_indptr, block_table=block_table,
                         seq_lens=seq_lens, sm_scale=spec.sm_scale).to(torch.bfloat16)

    return run
'''

SPEC8 = CallSpec("bf16", page_size=16, heads=8, max_q_len=2, mixed_q_len=True)  # only the probe's
TILE1, TILE2 = (Variant.make(NAME, kv="bf16", q="bf16", tile=t) for t in (1, 2))
CONFIG = {
    "name": "probe", "rule": "strict", "check_seeds": [1, 2],
    "families": {"kv_format": ["bf16"], "page_size": [16], "heads": [8, 16], "q_len": [2]},
    "call": {"mixed_q_len": True, "graph": False, "host_lengths": False},
    "batch_buckets": [2, 4], "kv_buckets": [32, 256],
    "gate": {"ragged_kv_lens": [1, 17, 63], "tail_kv_len": 77, "tail_batch": 2, "margin": 0.5, "reference_q": "exact"},
    "search": {"rungs": [1, 2], "keep": 0.5, "min_keep": 1, "cross_top": 2},
}


@pytest.fixture(params=["plugin", "builtin"])
def probe(request, tmp_path, monkeypatch):
    """The probe backend's module in tmp_path and its one registry line; the module."""
    module = f"h9probe_{request.param}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PROBE_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    if request.param == "plugin":
        monkeypatch.setenv(EXTRA_BACKENDS_ENV, f"{NAME}={module}")
    else:
        monkeypatch.setitem(backends.BACKEND_MODULES, NAME, module)
    yield backends.get_backend(NAME)
    sys.modules.pop(module, None)


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    result = problem.check(out, ref, problem.RULES["strict"])
    assert result.passed, f"{what}: {result}"
    assert float((out.float() - ref).abs().max()) <= 1e-2 * float(ref.abs().max()) + 1e-6, what


def _config(tmp_path, listed: dict, **changes) -> str:
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, **changes, "backends": listed}, sort_keys=False))
    return str(path)


def test_the_decoder_takes_it_by_the_registrys_order_and_it_answers_as_the_reference(probe, monkeypatch):
    assert serving_backends()[-1] == NAME  # its registry line is its place in the order
    assert serving_backends()[:2] == ["triton", "triton_fused"]  # the own kernels first
    decoder = Decoder(SPEC8, device="cpu")  # no backend named: the first that serves 8 heads
    assert decoder.backend == NAME and decoder.variant == TILE1
    inp = serving.make_input([1, 2, 2], [1, 17, 40], 8, 16, "bf16", seed=3)
    _close(decoder(inp.q, inp.qo_indptr, inp.kv, **inp.layout), inp.reference(), "8 heads")
    # named, at a spec the own kernels serve too, and at fp8 KV
    inp = serving.make_input([2, 1], [33, 5], 16, 16, "fp8", seed=4)
    spec = CallSpec("fp8", page_size=16, heads=16, max_q_len=2, mixed_q_len=True)
    out = Decoder(spec, backend=NAME, device="cpu")(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout)
    _close(out, inp.reference(), "fp8 KV, 16 heads")
    with pytest.raises(ValueError, match=rf"backend {NAME} cannot serve .*32 heads"):
        Decoder(CallSpec("bf16", 16, 32), backend=NAME, device="cpu")
    if NAME in backends.BACKEND_MODULES:  # built in (plugins follow the built-in lines): where its
        # line sits is its preference; moved to the front, it serves what the own kernels would have
        monkeypatch.setattr(backends, "BACKEND_MODULES",
                            {NAME: backends.BACKEND_MODULES[NAME], **backends.BACKEND_MODULES})
        assert serving_backends()[0] == NAME
        assert Decoder(CallSpec("bf16", 16, 16), device="cpu").backend == NAME


def test_the_serving_sweep_and_its_dry_run_plan_it_where_a_config_lists_it(probe, tmp_path):
    platform = gpu.detect()
    config = _config(tmp_path, {"triton": {}, NAME: {"tile": [1, 2]}})
    listed = load_serving_config(config)
    for key in listed.families:
        plan = family_plan(listed, key, platform)
        assert [v for v in plan.candidates if v.backend == NAME] == [TILE1, TILE2], key
    eight = family_plan(listed, FamilyKey("bf16", 16, 8, 2), platform)
    assert [v.backend for v in eight.candidates] == [NAME, NAME] and "8" in eight.skipped["triton"]
    # the command line's dry run plans it
    result = invoke("sweep", "--gpu", "H200", "--config", config, "--dry-run")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("8 heads" in line and f"2 candidates ({NAME} 2)" in line for line in lines), result.output
    assert any("16 heads" in line and f"{NAME} 2)" in line and "triton" in line for line in lines), result.output
    # an empty section: its serving_candidates over an empty space (its default tile)
    bare = load_serving_config(_config(tmp_path, {NAME: None}))
    assert family_plan(bare, FamilyKey("bf16", 16, 8, 2), platform).candidates == [TILE1]
    # a config that does not list it does not sweep it
    unlisted = load_serving_config(_config(tmp_path, {"triton": {}}))
    sixteen = family_plan(unlisted, FamilyKey("bf16", 16, 16, 2), platform)
    assert sixteen.candidates and all(v.backend == "triton" for v in sixteen.candidates)
    # the sweeps' cost prior has no line for it either: it takes the default
    assert CostModel(dict(DEFAULT_COSTS), "defaults").cost(NAME) == DEFAULT_COSTS["*"]


@pytest.mark.parametrize("probe", ["plugin"], indirect=True)  # gate workers inherit the environment
def test_a_serving_sweep_gates_and_times_it_into_a_table_of_its_picks(probe, tmp_path):
    """With made-up times (tile 2 twice as fast) the gate passes the probe's variants and every
    cell picks tile 2 (a DecodePlan on such a table: the next test)."""
    def timer(call, reps: int) -> Timing:
        t = call.batch * (5.0 if call.variant.get("tile") == 2 else 10.0)
        return Timing(t, t, t, reps)

    path = _config(tmp_path, {NAME: {"tile": [1, 2]}}, families={**CONFIG["families"], "heads": [8]})
    out = tmp_path / "CPU.serving.yaml"
    run_serving_sweep(path, "CPU", out=out, platform=gpu.detect(), timer=timer, log=lambda line: None)
    family = load_serving_table(out).families[FamilyKey.of(SPEC8)]
    assert {cell: c.variant for cell, c in family.cells.items()} == {
        (b, kv): TILE2 for b in CONFIG["batch_buckets"] for kv in CONFIG["kv_buckets"]}


def test_a_serving_table_that_picks_it_loads_and_a_decode_plan_runs_it(probe, tmp_path):
    family = Family(FamilyKey.of(SPEC8))
    family.cells[(4, 256)] = Cell(4, 256, TILE2, 10.0)
    path = write_serving_table(tmp_path / "CPU.serving.yaml",
                               ServingTable("CPU", {}, [2, 4], [32, 256], {family.key: family}))
    table = load_serving_table(path)  # every variant checked by its backend's validate
    assert table.lookup(SPEC8, 3, 200.0) == TILE2
    plan = DecodePlan(SPEC8, max_batch=4, table=table, device="cpu")
    assert set(plan.variants) == {TILE2, TILE1}
    runs = dict(probe.RUNS)
    inp = serving.make_input([2, 1, 2], [190, 200, 210], 8, 16, "bf16", seed=5)
    assert plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens, mean_kv_len=200) == TILE2
    _close(plan.run(inp.q, inp.kv), inp.reference(), "the table's pick")
    assert probe.RUNS[str(TILE2)] == runs.get(str(TILE2), 0) + 1
    # a cell the table lacks: the preferred backend's default, which for 8 heads is the probe's
    inp = serving.make_input([1, 1], [9, 20], 8, 16, "bf16", seed=6)
    picked = plan.update(inp.qo_indptr, block_table=inp.block_table, seq_lens=inp.seq_lens, mean_kv_len=15)
    assert picked == plan.pick(2, 15.0) and picked.backend == NAME
    _close(plan.run(inp.q, inp.kv), inp.reference(), "the default")
