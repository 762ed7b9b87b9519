"""Config loading: what a valid config gives, and that every error names file and field."""

from pathlib import Path

import pytest
import yaml

from mla_tune.config import ConfigError, load_config
from mla_tune.core import Shape

REPO = Path(__file__).resolve().parents[1]
LEADERBOARD = REPO / "configs" / "leaderboard.yaml"

VALID = {
    "name": "t",
    "rule": "strict",
    "check_seeds": [1, 2],
    "calibration_seeds": [3],
    "timing": {"reps": 5, "prune_reps": 2, "prune_factor": 2.0},
    "budget_s": 60,
    "shapes": [{"batch": 2, "kv_len": 9}, {"batch": 4, "kv_len": 9}],
    "backends": {"torch": {}, "triton": {"num_splits": [1, 2]}},
}


def write(tmp_path: Path, raw, name="c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def with_change(**changes):
    raw = yaml.safe_load(yaml.safe_dump(VALID))
    for key, value in changes.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


def test_leaderboard_config_loads_with_its_eight_shapes_and_rule():
    config = load_config(LEADERBOARD)
    assert config.name == "leaderboard"
    assert config.path == LEADERBOARD
    assert config.rule.name == "leaderboard" and config.rule.rtol == 0.1
    assert len(config.shapes) == 8 and Shape(256, 8192) in config.shapes
    assert config.check_seeds == [1001, 2002]
    assert not set(config.check_seeds) & set(config.calibration_seeds)
    assert config.timing.reps >= config.timing.prune_reps >= 1 and config.timing.prune_factor >= 1
    assert config.budget_s is not None and config.budget_s > 0
    assert {"torch", "triton"} <= set(config.backends)
    assert config.precompile["triton"] is True and config.precompile["torch"] is False
    assert config.raw["name"] == "leaderboard"
    assert len(config.hash) == 64


def test_hash_ignores_key_order_and_comments_but_not_values(tmp_path):
    a = write(tmp_path, VALID, "a.yaml")
    reordered = "# a comment\n" + yaml.safe_dump(dict(reversed(list(VALID.items()))), sort_keys=False)
    b = write(tmp_path, reordered, "b.yaml")
    c = write(tmp_path, with_change(budget_s=61), "c.yaml")
    assert load_config(a).hash == load_config(b).hash
    assert load_config(a).hash != load_config(c).hash


def test_precompile_flag_is_taken_out_of_the_search_space(tmp_path):
    raw = with_change(backends={"torch": {"precompile": True}, "triton": {"precompile": False, "block_n": [32]}})
    config = load_config(write(tmp_path, raw))
    assert config.precompile == {"torch": True, "triton": False}
    assert config.backends["triton"] == {"block_n": [32]}
    assert config.backends["torch"] == {}


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"name": None}, "name", "missing"),
        ({"rule": "loose"}, "rule", "unknown correctness rule"),
        ({"check_seeds": [1]}, "check_seeds", "at least 2"),
        ({"check_seeds": [1, 1]}, "check_seeds", "distinct"),
        ({"check_seeds": [1, "2"]}, "check_seeds", "integers"),
        ({"calibration_seeds": [2, 3]}, "calibration_seeds", "also check_seeds"),
        ({"timing": {"reps": 0, "prune_reps": 1, "prune_factor": 2}}, "timing.reps", ">= 1"),
        ({"timing": {"prune_reps": 1, "prune_factor": 2}}, "timing.reps", "missing"),
        ({"timing": {"reps": 3, "prune_reps": 1, "prune_factor": 0.5}}, "timing.prune_factor", ">= 1"),
        ({"timing": {"reps": 3, "prune_reps": 1, "prune_factor": 2, "rep": 1}}, "timing.rep", "unknown"),
        ({"budget_s": -1}, "budget_s", "positive"),
        ({"shapes": []}, "shapes", "non-empty"),
        ({"shapes": [{"batch": 2, "kv_len": 9}, {"batch": 2, "kv_len": 9}]}, "shapes[1]", "duplicate"),
        ({"shapes": [{"batch": 2, "kv_len": 0}]}, "shapes[0]", "positive"),
        ({"shapes": [{"batch": 2, "kv": 9}]}, "shapes[0]", "batch and kv_len"),
        ({"backends": {"tritn": {}}}, "backends.tritn", "known backends: triton"),
        ({"backends": {"torch": {"precompile": "yes"}}}, "backends.torch.precompile", "true or false"),
        ({"backends": {"torch": [1]}}, "backends.torch", "mapping"),
        ({"shape": []}, "shape", "unknown field"),
    ],
)
def test_each_config_error_names_the_file_and_the_field(tmp_path, changes, field, words):
    path = write(tmp_path, with_change(**changes), "bad_config.yaml")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message
    assert f"'{field}'" in message
    assert words in message


def test_a_file_that_is_not_a_mapping_or_not_yaml_names_the_file(tmp_path):
    for text in ("- 1\n- 2\n", "name: [unclosed\n"):
        path = write(tmp_path, text, "odd.yaml")
        with pytest.raises(ConfigError, match="odd.yaml"):
            load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
