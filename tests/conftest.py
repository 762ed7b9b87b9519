"""Test set-up: without a GPU, Triton kernels run under Triton's CPU interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set
here, before pytest imports the test modules.

MLA_TUNE_REQUIRE_BACKENDS=1 (set by scripts/gpu_acceptance.sh) is the require mode: on a CUDA
GPU, a GPU test whose backend, vendor wheel or Gluon cannot run fails instead of skipping
(tests/helpers.py `unavailable` says the rule). Without a CUDA GPU the GPU tests still skip.
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


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each GPU test, hand its cached blocks back to the driver, so that several pytest
    workers on one GPU (`pytest -m gpu -n 8`) do not run out of memory on each other's cache."""
    yield
    if DEVICE == "cuda" and request.node.get_closest_marker("gpu") is not None:
        torch.cuda.empty_cache()
