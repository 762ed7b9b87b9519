"""Adapters from serving engines to mla-tune's serving call (serving/decode_plan.py's DecodePlan).

- `indices.py`: the engines' cache addressing turned into the block table the kernels
  read, on the device and graph-safe: SGLang's page-1 kv_indptr + kv_indices
  (`PageOneTable`), and SGLang's request-to-token map (`req_to_block_table`).
- `plans.py`: `EnginePlans`, the two DecodePlans an engine backend owns (one for the batch
  sizes it captures in CUDA graphs, one for the rest), and the serving table it plans with.
- `vllm.py`: a vLLM MLA attention backend (backend class, metadata builder, impl) that an
  engine registers as CUSTOM (written against vLLM 0.33.0).
- `sglang.py`: an SGLang MLA AttentionBackend with the CUDA-graph hooks (SGLang 0.5.23).

The engine modules import their engine when imported; nothing else here does.
"""
