"""The require mode of tests/helpers.py `unavailable`: a skip, but a failure with
MLA_TUNE_REQUIRE_BACKENDS=1 on a CUDA GPU; without a CUDA GPU a skip whatever the mode."""

import pytest
import torch

from tests.helpers import REQUIRE_BACKENDS, unavailable

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
