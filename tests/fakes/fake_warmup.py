"""A fake backend whose warm-up does what its variant's `act` says, for the compile pool's
tests: ok (writes a marker file named by `tag` into $MLA_TUNE_TEST_MARKERS), hang, exit
(the process exits), segv (the process segfaults), raise (a compile error)."""

import ctypes
import os
import time
from pathlib import Path

from mla_tune.core import KV_FORMATS, Q_MODES, Capabilities, Shape, Variant
from tests.fakes import unavailable_reason  # noqa: F401  (the backend's hook)

NAME = "fake_warmup"
CAPABILITIES = Capabilities(kv_formats=KV_FORMATS, q_modes=Q_MODES, precompile=True)
MARKERS_ENV = "MLA_TUNE_TEST_MARKERS"


def candidates(shape: Shape, space: dict, platform) -> list[Variant]:
    return [Variant.make(NAME, kv="bf16", q="bf16", act="ok", tag="c")]


def build(variant: Variant, shape: Shape, device):
    raise AssertionError("the pool calls this backend's warmup, never build")


def warmup(variant: Variant, shape: Shape, device, inputs) -> None:
    act = variant.get("act")
    if act == "hang":
        while True:
            time.sleep(1.0)
    if act == "exit":
        os._exit(7)
    if act == "segv":
        ctypes.string_at(0)
    if act == "raise":
        raise RuntimeError("fake_warmup: this variant does not compile (simulated)")
    time.sleep(float(variant.get("sleep_s") or 0))
    marker = Path(os.environ[MARKERS_ENV]) / f"{variant.get('tag')}-{shape}-{os.getpid()}"
    marker.write_text(f"{inputs[0].shape[0]}")  # the stand-in's q came along
