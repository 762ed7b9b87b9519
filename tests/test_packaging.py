"""Tables that ship: one lookup order (mla_tune/locate.py), and a wheel that finds them."""

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mla_tune import locate, runtime
from mla_tune.tables.table import TableError
from tests.helpers import REPO


def _tables(folder: Path, *names: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text("schema: 1\n")


def test_a_path_is_a_path_a_gpu_name_is_looked_up_env_then_cwd_then_packaged_and_so_is_a_config(monkeypatch, tmp_path):
    assert locate.table_path("x.yaml") == Path("x.yaml")
    assert locate.table_path(tmp_path / "H200") == tmp_path / "H200"  # a Path is never a name
    assert locate.table_path("some/H200") == Path("some/H200")
    # runtime.load takes a path as its first argument
    missing = tmp_path / "x.yaml"
    with pytest.raises(TableError, match=r"x\.yaml does not exist"):
        runtime.load(str(missing))  # a path, not a GPU named ".../x.yaml"
    env, cwd, pkg = tmp_path / "env", tmp_path / "cwd", tmp_path / "pkg"
    _tables(env, "A.yaml")
    _tables(cwd / "tables", "A.yaml", "B.yaml")
    _tables(pkg, "A.yaml", "B.yaml", "C.yaml", "C.serving.yaml")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv(locate.ENV_TABLES, str(env))
    assert locate.table_path("A", packaged=pkg) == env / "A.yaml"
    assert locate.table_path("B", packaged=pkg).resolve() == (cwd / "tables" / "B.yaml").resolve()
    assert locate.table_path("C", packaged=pkg) == pkg / "C.yaml"
    assert locate.table_path("C", serving=True, packaged=pkg) == pkg / "C.serving.yaml"
    assert locate.available(packaged=pkg) == ["A", "B", "C"]
    monkeypatch.delenv(locate.ENV_TABLES)
    assert locate.table_path("A", packaged=pkg).resolve() == (cwd / "tables" / "A.yaml").resolve()
    with pytest.raises(TableError) as info:
        locate.table_path("D", packaged=pkg)
    message = str(info.value)
    assert "D.yaml does not exist" in message and "./tables" in message and str(pkg) in message
    assert "tables there: A, B, C" in message
    # the same folder reached twice (./tables, given as the packaged one too) is searched once
    dirs = locate.table_dirs(packaged=Path("tables"))
    assert [label for label, _ in dirs].count("./tables") == 1 and len(dirs) == 1
    packaged = locate.packaged_dir("configs")
    assert locate.config_path("configs/leaderboard.yaml") == packaged / "leaderboard.yaml"
    assert locate.config_path("elsewhere/leaderboard.yaml") == Path("elsewhere/leaderboard.yaml")
    _tables(cwd / "configs", "leaderboard.yaml")
    assert locate.config_path("configs/leaderboard.yaml") == Path("configs/leaderboard.yaml")


def test_a_built_wheel_ships_the_tables_and_finds_them_outside_the_checkout(tmp_path):
    # no caller's PYTHONPATH: with the checkout on it, pip finds its mla_tune.egg-info and
    # takes the wheel as installed already
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", locate.ENV_TABLES)}
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), "."], cwd=REPO, env=clean, check=True)
    (wheel,) = wheels.glob("mla_tune-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], env=clean, check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], env=clean, check=True)
    # after pip (it must not see this mla_tune): this process's packages as plain paths, whose
    # .pth files (an editable mla_tune's finder) are not run, so mla_tune comes from the wheel
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             env=clean, check=True, capture_output=True, text=True).stdout.strip()
    outer = dict.fromkeys(d for d in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if Path(d).is_dir())
    Path(purelib, "_outer_site.pth").write_text("".join(f"{d}\n" for d in outer))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # the vendor fakes stand in for flash_mla / flashinfer, which the table's picks name
    env = dict(clean, TRITON_INTERPRET="1", PYTHONPATH=str(REPO / "tests" / "fakes"))

    def outside_run(*command):
        return subprocess.run([str(c) for c in command], cwd=outside, env=env, capture_output=True, text=True)

    # no MI355X table anywhere: export writes the packaged prior (configs/priors/ ships too)
    prior = outside_run(venv / "bin" / "mla-tune", "export", "--gpu", "MI355X", "-o", "sub.py")
    assert prior.returncode == 0, prior.stderr
    assert "PRIOR" in (outside / "sub.py").read_text()
    script = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import mla_tune\n"
        "from mla_tune import runtime\n"
        "from mla_tune.core import CallSpec\n"
        "from mla_tune.serving.decode_plan import DecodePlan\n"
        "print(mla_tune.__file__)\n"
        "rt = runtime.load(table='H200', allow_other_gpu=True)\n"
        "print(rt.table.path, len(rt.table.rows))\n"
        "spec = CallSpec('bf16', page_size=64, heads=16, max_q_len=1, graph=True, host_lengths=True)\n"
        "plan = DecodePlan(spec, max_batch=8, table='H200', warm=False)\n"
        "print(plan.table.path, len(plan.variants))\n")
    run = outside_run(python, "-c", script)
    assert run.returncode == 0, run.stderr[-3000:]
    module, table, serving = run.stdout.splitlines()[-3:]
    assert module == f"{purelib}/mla_tune/__init__.py"  # the installed copy, not the checkout
    assert table == f"{purelib}/mla_tune/data/tables/H200.yaml 8"
    path, variants = serving.split()
    assert path == f"{purelib}/mla_tune/data/tables/H200.serving.yaml" and int(variants) >= 2
    shutil.rmtree(venv)
