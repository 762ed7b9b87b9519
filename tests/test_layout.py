"""The package's layout (docs/architecture.md): imports run one way between its folders.

Read with `ast`, lazy imports inside functions included.
"""

import ast
from pathlib import Path

import pytest

from mla_tune import core

PACKAGE = Path(__file__).resolve().parent.parent / "mla_tune"
REEXPORTS = {"runtime/decode.py", "runtime/plan.py"}


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize(("folders", "forbidden"), [
    (("tune", "tables", "runtime", "export"), "mla_tune.serving"),
    (("tables",), "mla_tune.tune"),
], ids=["leaderboard-side-not-serving", "tables-not-tune"])
def test_imports_run_one_way_between_folders(folders, forbidden):
    bad = []
    for path in (path for folder in folders for path in sorted((PACKAGE / folder).rglob("*.py"))):
        rel = str(path.relative_to(PACKAGE))
        if rel not in REEXPORTS:
            bad += [f"{rel}: {m}" for m in _imports(path) if m.startswith(forbidden)]
    assert not bad, bad


def test_the_old_serving_paths_are_only_re_exports():
    for rel in sorted(REEXPORTS):
        tree = ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))
        body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert body and all(isinstance(n, ast.ImportFrom) and n.module.startswith("mla_tune.serving.")
                            for n in body), rel


def test_core_imports_no_mla_tune_and_the_serving_runner_sits_beside_the_kernels():
    assert not [m for m in _imports(PACKAGE / "core.py") if m.startswith("mla_tune")]
    runner = [m for m in _imports(PACKAGE / "kernels" / "serving_runner.py") if m.startswith("mla_tune")]
    assert "mla_tune.core" in runner and all(m == "mla_tune.core" or m.startswith("mla_tune.core.") for m in runner)
    for name in ("OwnServingRunner", "OwnServingStep", "own_serving_runner", "check_serving_launch",
                 "check_serving_build", "serving_workspace"):
        assert not hasattr(core, name), name
