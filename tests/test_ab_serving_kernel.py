"""scripts/ab_serving_kernel.py on the CPU: two copies of the serving kernel imported side
by side, each checked against the reference (--smoke), and bad arguments refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ab_serving_kernel.py"
KERNEL = REPO / "mla_tune" / "kernels" / "flash_decode.py"


def _run(*args, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_two_copies_run_side_by_side_and_are_checked(tmp_path):
    copy = tmp_path / "fd_copy.py"
    copy.write_text(KERNEL.read_text())
    proc = _run(f"a={KERNEL}", f"b={copy}", "--smoke", "--cases", "2", "--out", str(tmp_path / "o"),
                tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "o" / "ab_serving_kernel.json").read_text())
    assert [name for name, _ in rows] == ["16h fp8 q1 4501/2796/56221"]
    assert set(rows[0][1]) == {"a", "b"} and all(e["ok"] and e["rel_err"] < 1e-2 for e in rows[0][1].values())


def test_a_missing_file_or_case_is_refused_by_name(tmp_path):
    proc = _run(f"a={tmp_path / 'nope.py'}", "--smoke", tmp_path=tmp_path)
    assert proc.returncode != 0 and "NAME=PATH" in proc.stderr
    proc = _run(f"a={KERNEL}", "--smoke", "--cases", "99", tmp_path=tmp_path)
    assert proc.returncode != 0 and "--cases" in proc.stderr
