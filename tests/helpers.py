"""What several test files share: reference math and serving inputs for the backend tests,
a backend's serving call at DeepSeek-V3's softmax scale, a captured CUDA graph's buffers refilled
with a new call (`refill`), the CLI in 80 columns, the exported file run in a fresh process that
refuses mla_tune, test backends registered for one test, the vendor libraries' CPU fakes, and
`unavailable`: the GPU tests' skip for a backend that cannot run, a failure in require mode.

`vendor_fakes` is tests/fakes/vendor_fakes.py: `vendor_fakes.install(monkeypatch,
"flashinfer")` puts the fake in sys.modules for one test.
"""

import ast
import builtins
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NoReturn

import pytest
import torch
import yaml

from mla_tune import gpu, problem
from mla_tune.backends import EXTRA_BACKENDS_ENV, get_backend
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, SM_SCALE, V_DIM, CallSpec
from mla_tune.serving import inputs as serving
from tests.fakes import vendor_fakes  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]
CPU_TABLE = REPO / "tests" / "data" / "table_cpu.yaml"
NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
WIDE = {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}  # rich wraps at 80 columns otherwise
REQUIRE_BACKENDS = "MLA_TUNE_REQUIRE_BACKENDS"


def unavailable(reason: str) -> NoReturn:
    """A GPU test's way out when a backend, a vendor wheel (FlashMLA, FlashInfer) or Gluon
    cannot run on this GPU: pytest.skip(reason), or pytest.fail(reason) where the environment
    sets MLA_TUNE_REQUIRE_BACKENDS=1, as scripts/gpu_acceptance.sh does, so that on the
    acceptance machine a missing wheel or a broken backend fails instead of passing as a skip.

    The rule: without a CUDA GPU this always skips (there every GPU test skips, with or
    without the variable: the require mode is for the GPU machine). A declared non-case (a
    backend whose capabilities declare no LSE, or that it does not serve a spec) is no
    unavailability: such a test calls pytest.skip itself, as it does for "needs a CUDA GPU"."""
    if torch.cuda.is_available() and os.environ.get(REQUIRE_BACKENDS) == "1":
        pytest.fail(f"{reason} ({REQUIRE_BACKENDS}=1: every backend must run here)", pytrace=False)
    pytest.skip(reason)


def runnable_backends(names) -> list[str]:
    """The backends of `names` that run here, for a GPU test that samples over whichever do;
    in the require mode (see unavailable) one that does not fails the test, naming why."""
    reasons = {name: get_backend(name).unavailable_reason() for name in names}
    missing = "; ".join(f"{name}: {reason}" for name, reason in reasons.items() if reason is not None)
    if missing and torch.cuda.is_available() and os.environ.get(REQUIRE_BACKENDS) == "1":
        unavailable(missing)
    return [name for name, reason in reasons.items() if reason is None]


def cpu_table(tmp_path: Path, name: str = "table.yaml", edit=None, versions: dict | None = None, **top) -> Path:
    """tests/data/table_cpu.yaml written to tmp_path/name with this process's versions (so it
    loads without a drift warning) updated by `versions`, top-level fields replaced by `top`,
    then edit(data) where given."""
    data = yaml.safe_load(CPU_TABLE.read_text())
    data["provenance"]["versions"] = {**{k: str(v) for k, v in gpu.detect().versions.items()}, **(versions or {})}
    data.update(top)
    if edit:
        edit(data)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def invoke(*args, env=None):
    """`mla-tune ARGS` through typer's test runner, in 80 columns unless env is given."""
    from typer.testing import CliRunner

    from mla_tune.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env or NARROW)


def assert_commands_import_no_torch(*commands) -> None:
    """Each command (`mla-tune` arguments) exits 0 in one fresh process that never imports
    torch or triton."""
    code = textwrap.dedent(f"""
        import sys
        from typer.testing import CliRunner
        from mla_tune import cli
        for args in {[[str(a) for a in c] for c in commands]!r}:
            result = CliRunner().invoke(cli.app, args)
            assert result.exit_code == 0, result.output
        assert "torch" not in sys.modules, "imported torch"
        assert "triton" not in sys.modules, "imported triton"
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr


def run_outside_the_interpreter(module: str, function: str, timeout: float):
    """`module.function()`'s JSON result, run in a fresh Python without TRITON_INTERPRET
    (compiling for a GPU target needs Triton's real compiler; the tests run interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, {module} as t; print(json.dumps(t.{function}()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def expected_output(data, variant):
    """fp32 attention on the operands the variant reads: q as its q mode quantizes it."""
    q_mode, kv = variant.get("q"), variant.get("kv")
    if q_mode != "fp8_static":
        return problem.reference(data, "bf16" if q_mode == "bf16" else "fp8", kv)
    fp8 = torch.float8_e4m3fn
    fp8_max = torch.finfo(fp8).max
    scale = variant.get("q_amax") / fp8_max
    q = (data[0].float() / scale).clamp(-fp8_max, fp8_max).to(fp8).float() * scale
    return problem.reference((q, *data[1:]), "bf16", kv)


def serving_expected(variant, q, qo_indptr, kv, kv_scale, *, sm_scale: float | None = None,
                     return_lse: bool = False, **layout):
    """The serving call's fp32 reference (mla_tune.serving.inputs.reference) on q as the
    serving variant's q mode sees it (gate.variant_q_format: per row where its backend's
    serving_q_reference hook says so; fp8_static at the variant's q_amax); layout: kv_indptr,
    or block_table and seq_lens; return_lse: (out, lse)."""
    from mla_tune.serving.gate import variant_q_format

    q_format = "fp8_static" if variant.get("q") == "fp8_static" else variant_q_format(variant)
    return serving.reference(q, qo_indptr, kv, kv_scale, **layout, q_format=q_format, q_amax=variant.get("q_amax"),
                             sm_scale=SM_SCALE if sm_scale is None else sm_scale, return_lse=return_lse)


CELL_LAYOUTS = (0, 1, 16, 64)  # 0: contiguous; else the page size
CELL_Q_LENS = (1, 2, 4)
CELL_KV_FORMATS = ("bf16", "fp8")
CELL_GRID = list(itertools.product(CELL_LAYOUTS, (16, 128), CELL_Q_LENS, CELL_KV_FORMATS))  # (layout, heads, q_len, kv)


def cell_spec(name: str, layout: int, heads: int, q_len: int, kv: str, **extra) -> CallSpec:
    """The call of a cell (layout 0: contiguous, else the page size) as an engine would declare
    it to this backend: ragged q_len where the backend takes it, host lengths where it needs
    them; extra: CallSpec's other fields (graph, sm_scale)."""
    caps = get_backend(name).CAPABILITIES
    return CallSpec(kv_format=kv, page_size=layout, heads=heads, max_q_len=q_len,
                    mixed_q_len=caps.mixed_q_len and q_len > 1, host_lengths=caps.host_lengths, **extra)


def declared_cells(name: str, cells=CELL_GRID, served: bool = True) -> list[tuple]:
    """(name, *cell) for each of `cells` whose call (cell_spec) this backend's serving
    declares, or (served=False) refuses."""
    caps = get_backend(name).CAPABILITIES
    return [(name, *cell) for cell in cells if (caps.refusal(cell_spec(name, *cell)) is None) == served]


def cell_id(case) -> str:
    """(backend, layout, heads, q_len, kv, ...) as a test id."""
    name, layout, heads, q_len, kv = case[:5]
    return f"{name}-{'contiguous' if layout == 0 else f'page{layout}'}-h{heads}-q{q_len}-{kv}"


def call_with_host_lengths(runner, inp: serving.ServingInput) -> torch.Tensor:
    """The serving call of inp through a runner or Decoder, host lengths given."""
    return runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout,
                  q_lens_host=list(inp.q_lens), kv_lens_host=list(inp.kv_lens))


def serving_input(spec: CallSpec, kv_lens: list[int], seed: int, device) -> serving.ServingInput:
    """The serving call's input for `spec` at these KV lengths: ragged q_len (even sequences
    bring max_q_len new tokens, odd ones about half, never more than a sequence holds) where
    the spec allows it, else max_q_len for all (KV lengths raised to hold it)."""
    q_len = spec.max_q_len
    if spec.mixed_q_len:
        q_lens = [min(n, q_len if i % 2 == 0 else (q_len + 1) // 2) for i, n in enumerate(kv_lens)]
    else:
        kv_lens = [max(n, q_len) for n in kv_lens]
        q_lens = [q_len] * len(kv_lens)
    return serving.make_input(q_lens, kv_lens, spec.heads, spec.page_size, spec.kv_format, seed=seed,
                              device=device)


# The GPU tests' eight sequences of one new token each (test_fast_launch's replays,
# test_graph_replay's growing plan step): 1, either side of a 64-token page, 700, 3000, 129.
GPU_LENS = [1, 17, 63, 64, 65, 700, 3000, 129]


def refill(static: serving.ServingInput, new: serving.ServingInput, what: str = "the new call") -> None:
    """new's tensors copied into `static`'s buffers, as an engine's update step does before
    replaying a graph captured on `static` (q and the tables zero-filled past new's); a
    `new` that needs more cache rows than `static` holds is refused, naming `what`."""
    static.q.zero_()
    static.q[: new.q.shape[0]].copy_(new.q)
    static.qo_indptr.copy_(new.qo_indptr)
    if static.page_size == serving.LAYOUT_CONTIGUOUS:
        static.kv_indptr.copy_(new.kv_indptr)
    else:
        static.seq_lens.copy_(new.seq_lens)
        static.block_table.zero_()
        static.block_table[:, : new.block_table.shape[1]].copy_(new.block_table)
    if new.kv.shape[0] > static.kv.shape[0]:
        raise ValueError(f"{what} needs {new.kv.shape[0]} cache rows, the captured call has {static.kv.shape[0]}")
    static.kv.view(torch.uint8)[: new.kv.shape[0]].copy_(new.kv.view(torch.uint8))
    if new.kv_scale is not None:
        static.kv_scale.copy_(new.kv_scale)


VENDOR_MODULES = {"flashmla": "flash_mla", "flashinfer": "flashinfer"}  # a vendor backend's fake
FAKE_H200 = gpu.fake_platform("H200")


def serving_call(monkeypatch, name: str, kv: str, q_lens, kv_lens, seed: int, params=None,
                 host: bool = True, **spec):
    """(output, variant, input, runner): backend `name`'s default serving variant (changed by
    `params`) at DeepSeek-V3's scale, built for the CPU (a vendor through its fake, on a fake
    H200; FlashMLA with 64-token pages, the others 16) and called once on a new input, with
    the lengths on the host too where `host`. `spec`: more CallSpec fields."""
    platform = gpu.detect()
    if name in VENDOR_MODULES:
        vendor_fakes.install(monkeypatch, VENDOR_MODULES[name])
        platform = FAKE_H200
    page = 64 if name == "flashmla" else 16
    spec = CallSpec(kv, page_size=page, heads=16, max_q_len=max(q_lens), sm_scale=CORE_DEEPSEEK_V3_SCALE,
                    host_lengths=name == "flashinfer", **spec)
    backend = get_backend(name)
    variant = backend.default_serving_variant(spec, platform).with_params(**(params or {}))
    inp = serving.make_input(q_lens, kv_lens, 16, page, kv, seed=seed)
    runner = backend.build_serving(variant, spec, "cpu")
    out = (call_with_host_lengths(runner, inp) if host
           else runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout))
    return out, variant, inp, runner


def ragged_input(kv_lens: list[int], seed: int, device="cuda"):
    """problem.generate_input's tuple with one kv length per sequence (config's kv_seq_len is
    the longest): the leaderboard's kernels at ragged lengths."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = len(kv_lens)
    q = torch.randn((batch, problem.NUM_HEADS, problem.QK_DIM), dtype=torch.bfloat16, device=device, generator=gen)
    kv = torch.randn((sum(kv_lens), problem.NUM_KV_HEADS, problem.QK_DIM), dtype=torch.bfloat16, device=device,
                     generator=gen)
    qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=device)
    kv_indptr = torch.tensor([0, *itertools.accumulate(kv_lens)], dtype=torch.int32, device=device)
    return q, problem.kv_data(kv), qo_indptr, kv_indptr, problem.make_config(batch, max(kv_lens))


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative L2 error of out against the fp32 reference."""
    return float((out.float() - ref).norm() / ref.norm())


class DecodeBuffers:
    """fused_decode's and gluon_decode's scratch: batch x num_splits partials, 2 x batch counters."""

    def __init__(self, batch: int, num_splits: int, device):
        slots = batch * num_splits
        self.part_o = torch.empty(slots * 16 * V_DIM, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(slots * 16, dtype=torch.float32, device=device)
        self.count = torch.zeros(2 * batch, dtype=torch.int32, device=device)
        self.flag = torch.zeros(2 * batch, dtype=torch.int32, device=device)
        self.out = torch.empty((batch, 16, V_DIM), dtype=torch.bfloat16, device=device)


def max_error(variant, device) -> float:
    """Relative L2 error allowed: 1e-2, but 5e-2 for FlashMLA's fp8 kernel on the GPU, which
    rounds the softmax probabilities to fp8 before P.V
    (csrc/extension/sm90/dense_fp8/flash_fwd_mla_kernel.h) where the reference keeps fp32."""
    fp8_kernel = variant.backend == "flashmla" and variant.get("kv") == "fp8"
    return 5e-2 if fp8_kernel and torch.device(device).type == "cuda" else 1e-2


def assert_close(out: torch.Tensor, ref: torch.Tensor, max_error: float = 1e-2, what: str = "") -> None:
    """out has ref's shape, every element written, a relative L2 error under max_error, and
    passes the `strict` rule against the fp32 reference."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert bool(torch.isfinite(out).all()), f"{what}: an element is NaN or was never written"
    err = rel_l2(out, ref)
    assert err < max_error, f"{what}: relative L2 error {err:.4f} (allowed {max_error})"
    result = problem.check(out, ref, problem.RULES["strict"])
    assert result.passed, f"{what}: strict: {result.reason}"


def sigint_as_in_a_terminal() -> None:
    """A Popen preexec_fn: the child's SIGINT as a shell gives it (default action, not
    blocked), whatever the test process's own state is (pytest-xdist's workers run threads
    and other tests' children), so a test's Ctrl-C reaches the child's own handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def exported_env() -> dict[str, str]:
    """This process's environment without a fake platform or extra backends, interpreter on,
    80+ columns (WIDE), this tree's mla_tune first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", gpu.FAKE_PLATFORM_ENV, "MLA_TUNE_EXTRA_BACKENDS")}
    # this tree's mla_tune, not the one an editable install elsewhere points at (a worktree)
    env.update(WIDE, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return env


EXPORT_RUNNER = textwrap.dedent('''
    import importlib, json, sys, warnings

    class _NoMlaTune:
        """mla_tune is refused to everyone but the fake aiter (tests/fakes/aiter) and the
        mla_tune modules it pulls in; what was let through is listed."""
        let_through = []

        def find_spec(self, name, path=None, target=None):
            if name != "mla_tune" and not name.startswith("mla_tune."):
                return None
            frame = sys._getframe(1)
            while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                         or "importlib" in frame.f_code.co_filename):
                frame = frame.f_back
            importer = frame.f_globals.get("__name__", "?") if frame is not None else "?"
            if importer.split(".")[0] in ("aiter", "mla_tune"):
                self.let_through.append([name, importer])
                return None
            raise ImportError(f"the exported file must not import mla_tune ({name}, from {importer})")

    sys.meta_path.insert(0, _NoMlaTune())
    sys.path.insert(0, ".")
    import torch
    warnings.simplefilter("ignore")
    report = {}
    for name in sys.argv[1:]:
        sub = importlib.import_module(name)
        own = sorted(k for k, v in vars(sub).items()
                     if str(getattr(v, "__module__", "") or "").startswith("mla_tune")
                     or getattr(v, "__name__", "") == "mla_tune")
        cases = torch.load(f"inputs_{name}.pt")
        outs = [sub.custom_kernel(tuple(case)).clone() for case in cases]
        torch.save(outs, f"outputs_{name}.pt")
        fake = sys.modules.get("aiter")
        report[name] = {
            "misses": sorted([s.batch, s.kv_len] for s in sub._EXPORT_DISPATCHER.misses),
            "mla_tune_names": own,
            "aiter_calls": dict(fake._state.calls) if fake is not None else None,
        }
    report["mla_tune_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "mla_tune")
    report["let_through"] = _NoMlaTune.let_through
    print("REPORT " + json.dumps(report))
''')


def run_exported(folder: Path, cases: dict[str, list], env: dict[str, str]) -> tuple[dict, dict]:
    """Import each exported module (folder/NAME.py) in one fresh subprocess and run its
    custom_kernel on its cases; returns ({name: outputs}, report)."""
    (folder / "task.py").write_text("import typing\ninput_t = typing.Any\noutput_t = typing.Any\n")
    (folder / "run_exported.py").write_text(EXPORT_RUNNER)
    for name, module_cases in cases.items():
        torch.save([list(case) for case in module_cases], folder / f"inputs_{name}.pt")
    done = subprocess.run([sys.executable, "run_exported.py", *cases], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("REPORT "))[7:])
    for name in cases:
        assert report[name]["mla_tune_names"] == [], f"{name} holds objects from mla_tune"
    return {name: torch.load(folder / f"outputs_{name}.pt") for name in cases}, report


def exported_outputs(tmp_path: Path, module: str, cases: list) -> tuple[list, list]:
    """(outputs, misses) of the exported module's custom_kernel on cases, in a fresh process
    that refuses mla_tune."""
    outs, report = run_exported(tmp_path, {module: cases}, exported_env())
    assert report["mla_tune_modules"] == [] and report["let_through"] == []
    return outs[module], report[module]["misses"]


def undefined_names(text: str) -> set[str]:
    """A pyflakes-like check: every name read somewhere is bound somewhere or a builtin."""
    tree = ast.parse(text)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def assert_clean_export(path: Path) -> str:
    """The exported file's text, once it compiles, binds every name it reads, passes ruff's F
    rules, carries the leaderboard header and imports no mla_tune."""
    text = path.read_text()
    compile(text, str(path), "exec")
    assert undefined_names(text) == set()
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if Path(ruff).exists():
        lint = subprocess.run([ruff, "check", "--no-cache", "--isolated", "--select", "F", str(path)],
                              capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout
    lines = text.splitlines()
    assert lines[:2] == ["#!POPCORN leaderboard amd-mixed-mla", "#!POPCORN gpu cpu"]
    assert "import mla_tune" not in text and "from mla_tune" not in text
    assert "from task import input_t, output_t" in text
    assert text.count("from __future__ import annotations") == 1
    return text


_BACKEND_HEAD = '''
from mla_tune.core import Capabilities, Variant
NAME = {name!r}
def unavailable_reason():
    return None
def candidates(shape, space, platform):
    return [Variant.make(NAME, kv="bf16", q="bf16")]
def build(variant, shape, device):
    raise ValueError("a test backend builds nothing")
'''


def register_backends(tmp_path: Path, monkeypatch, bodies: dict[str, str]):
    """Each name of bodies a backend module in tmp_path (NAME and the protocol's minimum, then
    its body), registered by MLA_TUNE_EXTRA_BACKENDS (with those registered before) for this
    test only; the first one's module."""
    monkeypatch.syspath_prepend(str(tmp_path))
    entries = [e for e in os.environ.get(EXTRA_BACKENDS_ENV, "").split(",") if e]
    for name, body in bodies.items():
        module = f"extra_backend_{name}"
        source = _BACKEND_HEAD.format(name=name) + textwrap.dedent(body)
        (tmp_path / f"{module}.py").write_text(source)
        sys.modules.pop(module, None)
        entries.append(f"{name}={module}")
    monkeypatch.setenv(EXTRA_BACKENDS_ENV, ",".join(entries))
    return get_backend(next(iter(bodies)))
