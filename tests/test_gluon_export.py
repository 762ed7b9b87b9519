"""gluon_fused in the registry, the leaderboard sweep space and the export (CPU side): Gluon has
no CPU interpreter, so an export with a gluon_fused winner must be self-contained, import
without mla_tune, and refuse the gluon row with the reason and the fix."""

import subprocess
import sys

import torch
import yaml

from mla_tune.backends import get_backend, known_backends
from mla_tune.core import Shape, Variant
from mla_tune.export import export_submission
from mla_tune.gpu import fake_platform
from mla_tune.kernels import gluon_decode
from mla_tune.problem import generate_input
from mla_tune.tune.config import expand_space, load_config
from tests.helpers import CPU_TABLE, assert_clean_export, exported_outputs

GLUON = "gluon_fused(block_n=64,kv=fp8,num_splits=1,num_stages=2,q=fp8_dynamic,v_path=rs8)"


def test_gluon_fused_is_registered_unavailable_here_and_its_space_is_small():
    assert "gluon_fused" in known_backends()
    backend = get_backend("gluon_fused")
    assert backend.unavailable_reason()  # no sm_90 GPU here
    assert backend.CAPABILITIES.precompile and "v_path" in backend.SPACE_KEYS
    config = load_config("configs/leaderboard.yaml")
    space = config.backends["gluon_fused"]
    per_shape = {s: list(dict.fromkeys(v for grid in expand_space(space)
                                       for v in backend.candidates(s, grid, fake_platform("H200"))))
                 for s in config.shapes}
    # today's space and the one-launch levers' sub-grid: the sweep's estimate stays near 2.5 min
    assert 0 < sum(map(len, per_shape.values())) <= 300
    for shape, variants in per_shape.items():
        for v in variants:
            backend.validate(v)
            assert backend.compile_shape(v, shape, 132).batch == 1
            # spin only where the whole grid is resident (2 CTAs per SM at 2 stages, 132 SMs)
            if v.p.get("reduce") == "spin":
                assert v.p["num_splits"] > 1 and shape.batch * v.p["num_splits"] <= 2 * 132
        assert {v.p["v_path"] for v in variants} == {"rs8", "ss16"}
        # the probe's best split count, min(32, 128 // batch, tiles), is offered at each shape
        best = max(1, min(32, 128 // shape.batch, shape.kv_len // 64))
        assert best in {v.p["num_splits"] for v in variants}, shape
    assert {v.p["num_splits"] for v in per_shape[Shape(256, 8192)]} == {1}


def test_export_with_a_gluon_winner_is_self_contained_and_says_why_it_cannot_run_here(tmp_path):
    table = yaml.safe_load(CPU_TABLE.read_text())
    row = next(r for r in table["rows"] if (r["batch"], r["kv_len"]) == (2, 40))
    params = dict(Variant.parse(GLUON).p)
    row["winner"] = {"variant": GLUON, "backend": "gluon_fused", "params": params}
    row["alternates"]["gluon_fused"] = {"variant": GLUON, "time_us": 5.0}
    (tmp_path / "table.yaml").write_text(yaml.safe_dump(table))
    path = export_submission(tmp_path / "table.yaml", tmp_path / "sub.py",
                             only_backends=["triton", "triton_fused", "gluon_fused"])
    text = assert_clean_export(path)
    assert "def _build_gluon_fused(" in text and "def _gd_decode_kernel(" in text
    # the (1, 8) row's triton alternate runs; the gluon row fails with the reason and the fix
    outs, _ = exported_outputs(tmp_path, "sub", [generate_input(1, 8, seed=3, device="cpu")])
    assert outs[0].shape == (1, 16, 512)
    torch.save([list(generate_input(2, 40, seed=4, device="cpu"))], tmp_path / "inputs_sub.pt")
    done = subprocess.run([sys.executable, "run_exported.py", "sub"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    # the reason is what this machine lacks: the GPU where this Triton's Gluon has the kernel's API
    fix = "needs an NVIDIA sm_90 GPU" if gluon_decode.GD_UNAVAILABLE is None else "install triton 3.6"
    assert "gluon_fused cannot run here" in done.stderr and fix in done.stderr
