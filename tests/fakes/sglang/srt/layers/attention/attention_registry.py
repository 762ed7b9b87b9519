"""sglang.srt.layers.attention.attention_registry, as SGLang's: name -> factory(runner)."""

ATTENTION_BACKENDS = {}


def register_attention_backend(name):
    def decorator(fn):
        ATTENTION_BACKENDS[name] = fn
        return fn

    return decorator
