"""Config loading: what a valid config gives, and that every error names file and field."""

from pathlib import Path

import pytest
import yaml

from mla_tune.core import Shape
from mla_tune.tune.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
LEADERBOARD = REPO / "configs" / "leaderboard.yaml"

VALID = {"name": "t", "rule": "strict", "check_seeds": [1, 2], "calibration_seeds": [3], "budget_s": 60,
         "timing": {"reps": 5, "prune_reps": 2, "prune_factor": 2.0},
         "shapes": [{"batch": 2, "kv_len": 9}, {"batch": 4, "kv_len": 9}],
         "backends": {"torch": {}, "triton": {"num_splits": [1, 2]}}}


def write(tmp_path: Path, raw, name="c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def with_change(**changes):
    """VALID with `changes`, a key changed to None left out."""
    raw = {**yaml.safe_load(yaml.safe_dump(VALID)), **changes}
    return {key: value for key, value in raw.items() if value is not None}


def test_leaderboard_config_loads_with_its_eight_shapes_and_rule():
    config = load_config(LEADERBOARD)
    assert config.name == "leaderboard" and config.path == LEADERBOARD
    assert config.rule.name == "leaderboard" and config.rule.rtol == 0.1
    assert len(config.shapes) == 8 and Shape(256, 8192) in config.shapes
    assert config.check_seeds == [1001, 2002]
    assert config.timing.reps >= config.timing.prune_reps >= 1 and config.timing.prune_factor >= 1
    assert config.budget_s is not None and config.budget_s > 0
    assert {"torch", "triton"} <= set(config.backends) and len(config.hash) == 64


def test_hash_ignores_key_order_and_comments_but_not_values(tmp_path):
    a = load_config(write(tmp_path, VALID, "a.yaml")).hash
    reordered = "# a comment\n" + yaml.safe_dump(dict(reversed(list(VALID.items()))), sort_keys=False)
    assert load_config(write(tmp_path, reordered, "b.yaml")).hash == a
    assert load_config(write(tmp_path, with_change(budget_s=61), "c.yaml")).hash != a


def test_precompile_is_taken_out_of_the_space_and_the_configs_word_wins(tmp_path):
    raw = with_change(backends={"torch": {"precompile": True}, "triton": {"precompile": False, "block_n": [32]}})
    config = load_config(write(tmp_path, raw))
    assert config.precompile == {"torch": True, "triton": False}
    assert config.backends == {"torch": {}, "triton": {"block_n": [32]}}


TIMING = {"reps": 3, "prune_reps": 1, "prune_factor": 2}
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("changes, field, words", [
    ({"name": None}, "name", "missing"),
    ({"rule": "loose"}, "rule", "unknown correctness rule"),
    ({"check_seeds": [1]}, "check_seeds", "at least 2"),
    ({"check_seeds": [1, 1]}, "check_seeds", "distinct"),
    ({"check_seeds": [1, "2"]}, "check_seeds", "integers"),
    ({"check_seeds": [1, 2**64]}, "check_seeds", "seeds must lie in -9223372036854775808 to"),
    ({"calibration_seeds": [2, 3]}, "calibration_seeds", "also check_seeds"),
    ({"timing": {"prune_reps": 1, "prune_factor": 2}}, "timing.reps", "missing"),
    ({"timing": {**TIMING, "rep": 1}}, "timing.rep", "unknown"),
    ({"shapes": []}, "shapes", "non-empty"),
    ({"shapes": [{"batch": 2, "kv_len": 9}, {"batch": 2, "kv_len": 9}]}, "shapes[1]", "duplicate"),
    ({"shapes": [{"batch": 2, "kv_len": 0}]}, "shapes[0]", "positive"),
    ({"shapes": [{"batch": 2, "kv": 9}]}, "shapes[0]", "batch and kv_len"),
    ({"backends": {"tritn": {}}}, "backends.tritn", "known backends: triton"),
    ({"backends": {"torch": {"precompile": "yes"}}}, "backends.torch.precompile", "true or false"),
    ({"backends": {"torch": [1]}}, "backends.torch", "mapping"),
    ({"shape": []}, "shape", "unknown field"),
    # an unknown search space key: its place and the allowed keys
    ({"backends": {"triton": {"num_splitz": [1, 2]}}}, "backends.triton.num_splitz", ("unknown key", "num_splits")),
    ({"backends": {"triton": {"grids": [{"kv": ["fp8"], "blok_n": [32]}]}}},
     "backends.triton.grids[0].blok_n", ("unknown key", "block_n")),
    ({"backends": {"torch": {"kv": ["bf16"]}}}, "backends.torch.kv", ("unknown key", "allowed: precompile, grids")),
    ({"backends": {"flashinfer": {"kernel": ["fa3"]}}}, "backends.flashinfer.kernel", ("unknown key", "backend, kv")),
    ({"backends": {"flashmla": {"q_amax": [1.0]}}}, "backends.flashmla.q_amax", ("unknown key", "kv, q")),
    ({"backends": {"triton_fused": {"reduce_mode": ["spin"]}}}, "backends.triton_fused.reduce_mode",
     ("unknown key", "reduce")),
    ({"backends": {"aiter": {"num_splits": [2]}}}, "backends.aiter.num_splits", ("unknown key", "num_kv_splits")),
    # a KV format or q mode outside the backend's CAPABILITIES, checked before its own word
    ({"backends": {"triton": {"kv": ["fp9"]}}}, "backends.triton.kv",
     "'backends.triton.kv': backend triton does not offer kv=fp9; its KV formats (its CAPABILITIES): bf16, fp8"),
    # nested: the backend's own check, on a ROCm probe
    ({"backends": {"triton": {"hip": {"kpak": [1]}}}}, "backends.triton", "kpak"),
    ({"backends": {"triton_fused": {"grids": [{"kv": ["bf16"]}, {"q": ["fp8_static"]}]}}},
     "backends.triton_fused.grids[1].q", "'backends.triton_fused.grids[1].q': backend triton_fused does not offer "
     "q=fp8_static; its q modes (its CAPABILITIES): bf16, fp8_dynamic"),
    # seconds: positive finite numbers; prune_factor at least one; reps positive integers
    *(({field: v}, field, f"'{field}': must be a positive, finite number")
      for field in ("budget_s", "candidate_timeout_s") for v in (NAN, INF, -INF, -1, 0, "60", True, [60])),
    *(({"timing": {**TIMING, "prune_factor": v}}, "timing.prune_factor", "must be a finite number >= 1")
      for v in (NAN, INF, 0, 0.5, -2, "2", False)),
    *(({"timing": {**TIMING, "reps": v}}, "timing.reps", "'timing.reps': must be an integer >= 1")
      for v in (NAN, INF, 2.5, "3", True, 0)),
])
def test_each_config_error_is_one_line_naming_the_file_and_the_field(tmp_path, changes, field, words):
    path = write(tmp_path, with_change(**changes), "bad_config.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and f"'{field}'" in message and "\n" not in message, message
    assert all(w in message for w in ((words,) if isinstance(words, str) else words)), message

