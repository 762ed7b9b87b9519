"""The DecodePlans an engine backend owns: one for the batch sizes the engine captures in
CUDA graphs, one for every other step, updated once per step and run once per layer.

    plans = EnginePlans(spec, max_batch=256, graph_batch=160)   # spec: the model's CallSpec
    plans.update(graph, qo_indptr, block_table=..., seq_lens=..., q_lens_host=...)  # per step
    out = plans.run(q, kv_cache, kv_scale)                      # per layer

`graph` says whether this step's layers are captured or replayed in a graph: then the
graph plan (spec.graph=True: the table's graph pick of the batch's bucket, which does not
depend on the lengths, and nothing allocated per call) runs it, else the eager plan (the
table's estimated fastest for the step's lengths). A plan is built for at most the batch
its mode can bring. The serving table comes from `serving_table()`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from mla_tune.core import CallSpec
from mla_tune.locate import find_table, is_gpu_name, table_path
from mla_tune.serving.decode_plan import DecodePlan

ENV_SERVING_TABLE = "MLA_TUNE_SERVING_TABLE"  # a path, a GPU name, or "none"


def serving_table(gpu: str | None = None):
    """The serving table an engine backend plans with: $MLA_TUNE_SERVING_TABLE (a path or a
    GPU name; "none": no table, every step runs the preferred backend's default variant),
    else `gpu`'s NAME.serving.yaml where the lookup order finds one (mla_tune/locate.py),
    else None (with a warning naming what to set)."""
    chosen = os.environ.get(ENV_SERVING_TABLE)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "none") else table_path(chosen, serving=True)
    if gpu is not None and is_gpu_name(gpu):
        found = find_table(gpu, serving=True)
        if found is not None:
            return found
    warnings.warn(f"no serving table for GPU {gpu!r}; every step runs the preferred backend's untuned "
                  f"default. Set {ENV_SERVING_TABLE} to a serving table's path or GPU name", stacklevel=2)
    return None


def gpu_name(device) -> str | None:
    """The canonical name of a CUDA device's GPU (mla_tune.gpu.detect), None off CUDA."""
    import torch

    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return None
    from mla_tune.gpu import detect

    return detect(device.index).name


class EnginePlans:
    """An eager DecodePlan for up to max_batch sequences and, when graph_batch > 0, a graph
    DecodePlan (spec.graph=True) for up to graph_batch: see the module."""

    def __init__(self, spec: CallSpec, max_batch: int, graph_batch: int = 0, *, table=None,
                 device=None, backend: str | None = None, warm: bool = True):
        if not isinstance(spec, CallSpec):
            raise ValueError(f"spec must be a mla_tune.core.CallSpec, got {type(spec).__name__}")
        self.spec = spec
        self.eager = DecodePlan(dataclasses.replace(spec, graph=False), max_batch, table=table,
                                backend=backend, device=device, warm=warm)
        self.graph: DecodePlan | None = None
        self.graph_batch = 0
        self._table, self._backend, self._device, self._warm = table, backend, device, warm
        if graph_batch:
            self.make_graph_plan(graph_batch)
        self.active: DecodePlan | None = None

    def make_graph_plan(self, graph_batch: int) -> DecodePlan:
        """The graph plan for batches up to graph_batch (made again only for a larger one)."""
        if self.graph is None or graph_batch > self.graph_batch:
            self.graph = DecodePlan(dataclasses.replace(self.spec, graph=True), graph_batch,
                                    table=self._table, backend=self._backend,
                                    device=self._device or self.eager.device, warm=self._warm)
            self.graph_batch = graph_batch
        return self.graph

    def update(self, graph: bool, qo_indptr, **layout):
        """Once per step: the plan of this step's mode takes the step (DecodePlan.update's
        arguments); returns the variant picked."""
        if graph and self.graph is None:
            raise ValueError("a graph step, but no graph plan: call make_graph_plan(max_bs) "
                             "when the engine sets up its CUDA graphs")
        plan = self.graph if graph else self.eager
        variant = plan.update(qo_indptr, **layout)
        self.active = plan
        return variant

    def run(self, q, kv, kv_scale=None):
        """Once per layer: the active plan's run (out, or (out, lse) with spec.return_lse)."""
        if self.active is None:
            raise ValueError("call update(...) with the step's lengths before run")
        return self.active.run(q, kv, kv_scale)
