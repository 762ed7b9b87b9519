"""A CPU fake of the parts of SGLang 0.5.23 that mla_tune.integrations.sglang subclasses.

`AttentionBackend` keeps 0.5.23's hook names, argument names and order (the out_graph /
in_graph metadata contract of python/sglang/srt/layers/attention/base_attn_backend.py) and
refuses a subclass whose override differs or that overrides the removed capture/replay pair.
`attention_registry` is SGLang's. Load with tests/fakes/engine_fakes.py.
"""

__version__ = "0.5.23"
