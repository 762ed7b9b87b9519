"""The require mode of tests/helpers.py `unavailable`: a skip, but a failure with
MLA_TUNE_REQUIRE_BACKENDS=1 on a CUDA GPU; without a CUDA GPU a skip whatever the mode.
`runnable_backends` filters out what cannot run, except in that mode."""

import pytest
import torch

from mla_tune.backends import get_backend
from tests.helpers import REQUIRE_BACKENDS, runnable_backends, unavailable

OUTCOMES = [  # (a CUDA GPU, the variable, what unavailable raises)
    (True, None, pytest.skip.Exception),
    (True, "0", pytest.skip.Exception),
    (True, "1", pytest.fail.Exception),
    (False, "1", pytest.skip.Exception),
]


@pytest.mark.parametrize("cuda,require,outcome", OUTCOMES)
def test_an_unavailable_backend_fails_only_in_require_mode_on_a_cuda_gpu(cuda, require, outcome, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if require is None:
        monkeypatch.delenv(REQUIRE_BACKENDS, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_BACKENDS, require)
    with pytest.raises(outcome, match="flashmla: FlashMLA cannot be imported"):
        unavailable("flashmla: FlashMLA cannot be imported")


@pytest.mark.parametrize("cuda,require,outcome", OUTCOMES)
def test_a_sample_over_the_runnable_backends_leaves_one_out_only_outside_require_mode(
        cuda, require, outcome, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv(REQUIRE_BACKENDS, require or "0")
    monkeypatch.setattr(get_backend("flashmla"), "unavailable_reason", lambda: "no FlashMLA wheel")
    monkeypatch.setattr(get_backend("triton"), "unavailable_reason", lambda: None)
    if outcome is pytest.fail.Exception:
        with pytest.raises(outcome, match="flashmla: no FlashMLA wheel"):
            runnable_backends(("triton", "flashmla"))
    else:
        assert runnable_backends(("triton", "flashmla")) == ["triton"]
