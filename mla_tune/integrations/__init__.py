"""Adapters from serving engines to mla-tune's serving call (runtime/plan.py's DecodePlan).

- `indices.py`: page-1 addressing (SGLang's kv_indptr + kv_indices) turned on the device
  into the block table the kernels read (`PageOneTable`), graph-safe.
"""
