"""Reference math and serving inputs shared by the backend tests, and the vendor libraries'
CPU fakes.

`vendor_fakes` is tests/fakes/vendor_fakes.py: `vendor_fakes.install(monkeypatch,
"flashinfer")` puts the fake in sys.modules for one test.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from mla_tune import problem
from mla_tune.core import CallSpec
from mla_tune.serving import inputs as serving
from tests.fakes import vendor_fakes  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parents[1]
NARROW = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}


def cpu_table(tmp_path: Path, name: str = "table.yaml", edit=None, versions: dict | None = None, **top) -> Path:
    """tests/data/table_cpu.yaml written to tmp_path/name with this process's versions (so it
    loads without a drift warning) updated by `versions`, top-level fields replaced by `top`,
    then edit(data) where given."""
    import yaml

    from mla_tune.gpu import detect

    data = yaml.safe_load((REPO / "tests" / "data" / "table_cpu.yaml").read_text())
    data["provenance"]["versions"] = {**{k: str(v) for k, v in detect().versions.items()}, **(versions or {})}
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
    import json
    import os

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


# The serving kernels that quantize q=fp8_dynamic per (new token, head) row; split-K and the
# vendors quantize it per tensor, as the reference's fp8 q does.
ROW_QUANTIZED_Q = ("triton_fused", "gluon_fused")


def row_quantized_q(q: torch.Tensor) -> torch.Tensor:
    """q as the fused kernels quantize it under q=fp8_dynamic: e4m3 per (new token, head)
    row, scale amax / 448, returned in fp32."""
    q = q.float()
    scale = q.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (q / scale).to(torch.float8_e4m3fn).float() * scale


def serving_expected(variant, q, qo_indptr, kv, kv_scale, *, sm_scale: float | None = None, **layout):
    """The serving call's fp32 reference (mla_tune.serving.inputs.reference) on q as the
    serving variant's q mode sees it; layout: kv_indptr, or block_table and seq_lens."""
    from mla_tune.core import SM_SCALE
    from mla_tune.serving import inputs

    sm_scale = SM_SCALE if sm_scale is None else sm_scale
    q_mode = variant.get("q")
    if variant.backend in ROW_QUANTIZED_Q and q_mode == "fp8_dynamic":
        return inputs.reference(row_quantized_q(q), qo_indptr, kv, kv_scale, **layout, sm_scale=sm_scale)
    q_format = {"bf16": "bf16", "fp8_dynamic": "fp8", "fp8_static": "fp8_static"}[q_mode]
    return inputs.reference(q, qo_indptr, kv, kv_scale, **layout, q_format=q_format, q_amax=variant.get("q_amax"),
                            sm_scale=sm_scale)


def cell_spec(name: str, layout: int, heads: int, q_len: int, kv: str, **extra) -> CallSpec:
    """The call of a cell (layout 0: contiguous, else the page size) as an engine would declare
    it to this backend: ragged q_len where the backend takes it, host lengths where it needs
    them; extra: CallSpec's other fields (graph, sm_scale)."""
    from mla_tune.backends import get_backend

    caps = get_backend(name).CAPABILITIES
    return CallSpec(kv_format=kv, page_size=layout, heads=heads, max_q_len=q_len,
                    mixed_q_len=caps.mixed_q_len and q_len > 1, host_lengths=caps.host_lengths, **extra)


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


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative L2 error of out against the fp32 reference."""
    return float((out.float() - ref).norm() / ref.norm())


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
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
