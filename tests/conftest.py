"""Test set-up: without a GPU, Triton kernels run under Triton's CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set
here, before pytest imports the test modules.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE
