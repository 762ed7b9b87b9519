"""vllm.v1.attention.backends.utils: the per-layer hyperparameters a builder may read."""

from dataclasses import dataclass


@dataclass
class PerLayerParameters:
    window_left: int
    logits_soft_cap: float | None
    sm_scale: float


def get_per_layer_parameters(vllm_config, layer_names: list[str], cls_) -> dict[str, PerLayerParameters]:
    layers = vllm_config.compilation_config.static_forward_context
    params = {}
    for key in layer_names:
        impl = layers[key].impl
        assert isinstance(impl, cls_)
        window = getattr(impl, "sliding_window", None)
        params[key] = PerLayerParameters(window[0] if window is not None else -1,
                                         getattr(impl, "logits_soft_cap", None), impl.scale)
    return params
