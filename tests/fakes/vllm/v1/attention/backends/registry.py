"""vllm.v1.attention.backends.registry: the backend enum and register_backend, as vLLM's."""

import enum
import importlib

_ATTN_OVERRIDES: dict = {}


class AttentionBackendEnum(enum.Enum):
    FLASHMLA = "vllm.v1.attention.backends.mla.flashmla.FlashMLABackend"
    TRITON_MLA = "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend"
    CUSTOM = None

    def get_path(self, include_classname: bool = True) -> str:
        path = _ATTN_OVERRIDES.get(self, self.value)
        if not path:
            raise ValueError(f"Backend {self.name} must be registered before use. "
                             f"Use register_backend(Backend.{self.name}, 'your.module.YourClass')")
        return path if include_classname else path.rsplit(".", 1)[0]

    def get_class(self):
        module, name = self.get_path().rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    def clear_override(self) -> None:
        _ATTN_OVERRIDES.pop(self, None)


def register_backend(backend, class_path: str | None = None, is_mamba: bool = False):
    def decorator(cls):
        _ATTN_OVERRIDES[backend] = f"{cls.__module__}.{cls.__qualname__}"
        return cls

    if class_path is not None:
        _ATTN_OVERRIDES[backend] = class_path
        return lambda x: x
    return decorator
