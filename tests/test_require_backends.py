"""The require mode of tests/helpers.py `unavailable`: a skip, but a failure with
MLA_TUNE_REQUIRE_BACKENDS=1 on a CUDA GPU; without a CUDA GPU a skip whatever the mode.
`runnable_backends` filters out what cannot run, except in that mode."""

import pytest
import torch

from mla_tune.backends import get_backend
from tests.helpers import REQUIRE_BACKENDS, runnable_backends, unavailable


@pytest.mark.parametrize("cuda,require,outcome", [  # (a CUDA GPU, the variable, what unavailable raises)
    (True, None, pytest.skip.Exception),
    (True, "0", pytest.skip.Exception),
    (True, "1", pytest.fail.Exception),
    (False, "1", pytest.skip.Exception),
])
def test_an_unavailable_backend_fails_and_is_kept_in_a_sample_only_in_require_mode_on_a_cuda_gpu(
        cuda, require, outcome, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    if require is None:
        monkeypatch.delenv(REQUIRE_BACKENDS, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_BACKENDS, require)
    with pytest.raises(outcome, match="flashmla: FlashMLA cannot be imported"):
        unavailable("flashmla: FlashMLA cannot be imported")
    # a sample over the runnable backends leaves the unavailable one out only outside require mode
    monkeypatch.setattr(get_backend("flashmla"), "unavailable_reason", lambda: "no FlashMLA wheel")
    monkeypatch.setattr(get_backend("triton"), "unavailable_reason", lambda: None)
    if outcome is pytest.fail.Exception:
        with pytest.raises(outcome, match="flashmla: no FlashMLA wheel"):
            runnable_backends(("triton", "flashmla"))
    else:
        assert runnable_backends(("triton", "flashmla")) == ["triton"]
