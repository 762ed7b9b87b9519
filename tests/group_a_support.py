"""Set-up shared by tests/test_lse.py and tests/test_softmax_scale.py: a backend's serving
call at DeepSeek-V3's softmax scale on the CPU, the vendors through their fakes."""

from __future__ import annotations

from mla_tune import gpu
from mla_tune.backends import get_backend
from mla_tune.core import CORE_DEEPSEEK_V3_SCALE, CallSpec
from mla_tune.serving import inputs as serving
from tests.helpers import vendor_fakes

DSV3 = CORE_DEEPSEEK_V3_SCALE
H200 = gpu.fake_platform("H200")
VENDOR_MODULES = {"flashmla": "flash_mla", "flashinfer": "flashinfer"}


def serving_call(monkeypatch, name: str, kv: str, q_lens, kv_lens, seed: int, params=None,
                 host: bool = True, **spec):
    """(output, variant, input, runner): backend `name`'s default serving variant (changed by
    `params`) at DeepSeek-V3's scale, built for the CPU (a vendor through its fake, on a fake
    H200; FlashMLA with 64-token pages, the others 16) and called once on a new input, with
    the lengths on the host too where `host`. `spec`: more CallSpec fields."""
    platform = gpu.detect()
    if name in VENDOR_MODULES:
        vendor_fakes.install(monkeypatch, VENDOR_MODULES[name])
        platform = H200
    page = 64 if name == "flashmla" else 16
    spec = CallSpec(kv, page_size=page, heads=16, max_q_len=max(q_lens), sm_scale=DSV3,
                    host_lengths=name == "flashinfer", **spec)
    backend = get_backend(name)
    variant = backend.default_serving_variant(spec, platform).with_params(**(params or {}))
    inp = serving.make_input(q_lens, kv_lens, 16, page, kv, seed=seed)
    runner = backend.build_serving(variant, spec, "cpu")
    lengths = dict(q_lens_host=inp.q_lens, kv_lens_host=inp.kv_lens) if host else {}
    return runner(inp.q, inp.qo_indptr, inp.kv, inp.kv_scale, **inp.layout, **lengths), variant, inp, runner
