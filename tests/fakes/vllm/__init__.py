"""A CPU fake of the parts of vLLM 0.33.0 that mla_tune.integrations.vllm subclasses.

The base classes keep the real ones' method names, argument names and order (read from
vllm-project/vllm: model_executor/layers/attention/mla_attention.py, v1/attention/backend.py,
v1/attention/backends/registry.py and utils.py) and refuse a subclass whose override differs.
The builder's `build` and the impl's `forward_decode_step` call the subclass hooks as vLLM's
MLA common code does, by keyword where vLLM passes keywords. Load with engine_fakes.py.
"""

__version__ = "0.33.0"
