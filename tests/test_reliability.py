"""Issue 30: what a reliability audit found, each case and its kin.

- show and diff check the backends' parameter rules (backends/params.py, data without torch)
  with the messages export and the runtime give;
- (more cases below, one section each).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mla_tune.backends import BACKEND_MODULES, get_backend
from mla_tune.backends.params import PARAM_RULES, check_space_value, check_variant_rules
from mla_tune.core import Variant

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
TABLE = DATA / "table_cpu.yaml"
GOOD = "triton(block_n=16,dot_dtype=fp16,kv=fp8,num_splits=2,num_stages=1,num_warps=4,q=bf16)"


# ----------------------------------------------------------- parameter rules as data
def _bad_table(tmp_path: Path, edit: str) -> Path:
    text = TABLE.read_text()
    assert GOOD in text
    path = tmp_path / f"bad_{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(text.replace(GOOD, GOOD.replace("num_splits=2", edit), 1))
    return path


@pytest.mark.parametrize("edit", ["num_splitz=4", "num_splits=two"])
def test_show_refuses_what_export_refuses_with_the_same_line_and_without_torch(tmp_path, edit):
    bad = _bad_table(tmp_path, edit)
    code = textwrap.dedent(f"""
        import json, sys
        from typer.testing import CliRunner
        from mla_tune import cli
        out = {{}}
        for name, args in (("show", ["show", "--table", {str(bad)!r}]),
                           ("show_json", ["show", "--table", {str(bad)!r}, "--json"]),
                           ("diff", ["diff", {str(TABLE)!r}, {str(bad)!r}])):
            result = CliRunner().invoke(cli.app, args)
            out[name] = [result.exit_code, result.output]
        out["torch"] = "torch" in sys.modules
        result = CliRunner().invoke(cli.app, ["export", "--table", {str(bad)!r}, "-o",
                                              {str(tmp_path / "sub.py")!r}])
        out["export"] = [result.exit_code, result.output]
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["torch"] is False, "show or diff imported torch"
    export_code, export_text = out["export"]
    assert export_code == 1
    lines = export_text.strip().splitlines()
    assert len(lines) == 1 and "winner.variant: triton: " in lines[0], export_text
    assert ("unknown parameter num_splitz" if "splitz" in edit else "num_splits=") in lines[0]
    for name in ("show", "show_json", "diff"):
        code_, text = out[name]
        assert code_ == 1, (name, text)
        assert text.strip().splitlines() == lines, name
    assert not (tmp_path / "sub.py").exists()


def test_every_built_in_backend_has_rules_and_its_validate_gives_their_message():
    assert set(PARAM_RULES) == set(BACKEND_MODULES)
    bad = Variant.parse(GOOD.replace("num_splits=2", "num_splits=two"))
    with pytest.raises(ValueError) as from_rules:
        check_variant_rules(bad, PARAM_RULES["triton"])
    with pytest.raises(ValueError) as from_backend:
        get_backend("triton").validate(bad)
    assert str(from_rules.value) == str(from_backend.value)
    assert "num_splits=two is not allowed" in str(from_rules.value)


@pytest.mark.parametrize("text, message", [
    ("aiter(kv=fp8,mode=persistent,num_kv_splits=4,q=fp8_dynamic)", "num_kv_splits is not a parameter of "
     "mode=persistent, which takes kv_granularity, max_split_per_batch, fast_mode, intra_batch, opus"),
    ("aiter(kv=fp8,mode=turbo,q=fp8_dynamic)", "mode=turbo is not allowed; allowed: nonpersistent, "
     "persistent, direct, gluon"),
    ("aiter(kv=fp8,mode=nonpersistent,num_kv_splits=0,q=fp8_dynamic)", "num_kv_splits=0 is not allowed"),
    ("triton_fused(block_n=64,kv=fp8,num_splits=1,num_stages=3,num_warps=4,pv_dot=fp16,q=bf16,qk_dot=fp16,"
     "reduce=none,tok_m=true,waves=3)", "waves=3 is not allowed; allowed: 1, 2"),
    ("gluon_fused(block_n=64,kv=fp8,num_splits=4,num_stages=5,q=fp8_dynamic,v_path=rs8)",
     "num_stages=5 is not allowed; num_stages must be an int from 2 to 4"),
    ("triton(block_h=16,block_n=32,dot_dtype=bf16,kv=fp8,max_splits=8,num_stages=1,num_warps=4,q=bf16,"
     "tokens_per_split=256,split_budget=-1)", "split_budget=-1 is not allowed"),
    ("triton(block_n=32,dot_dtype=bf16,kv=fp8,num_splits=8,num_stages=1,num_warps=4,q=bf16,waves_per_eu=17)",
     "waves_per_eu=17 is not allowed"),
    ("flashmla(kv=fp8,q=fp8_static)", "q=fp8_static needs a calibrated q_amax"),
])
def test_rules_refuse_with_the_backends_message(text, message):
    variant = Variant.parse(text)
    with pytest.raises(ValueError, match=None) as caught:
        check_variant_rules(variant, PARAM_RULES[variant.backend])
    assert message in str(caught.value)
    with pytest.raises(ValueError) as same:
        get_backend(variant.backend).validate(variant)
    assert str(same.value) == str(caught.value)


def test_space_values_are_checked_one_by_one():
    check_space_value(PARAM_RULES["triton"], "num_splits", 4)
    check_space_value(PARAM_RULES["triton"], "max_splits", 64)  # the serving form's key
    check_space_value(PARAM_RULES["triton"], "unknown_key", 0)  # left to candidates()
    check_space_value(PARAM_RULES["aiter"], "max_split_per_batch", -1)
    for backend, name, value, message in (
            ("triton", "num_splits", 0, "num_splits=0 is not allowed"),
            ("triton", "block_n", 48, "block_n=48 is not allowed"),
            ("aiter", "mode", "turbo", "mode=turbo is not allowed"),
            ("gluon_fused", "v_path", "rs4", "v_path=rs4 is not allowed")):
        with pytest.raises(ValueError, match=message):
            check_space_value(PARAM_RULES[backend], name, value)
