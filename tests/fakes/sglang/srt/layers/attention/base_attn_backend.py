"""sglang.srt.layers.attention.base_attn_backend: 0.5.23's AttentionBackend hooks."""

from abc import ABC

from tests.fakes import check_overrides

_HOOKS = ("init_forward_metadata", "init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
          "init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value", "forward", "forward_decode",
          "forward_extend")
_REMOVED = ("init_forward_metadata_capture_cuda_graph", "init_forward_metadata_replay_cuda_graph")


class AttentionBackend(ABC):  # noqa: B024 (as SGLang 0.5.23: no abstract hook left)
    """The base class of attention backends."""

    forward_metadata = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_overrides(cls, AttentionBackend, _HOOKS)
        for hook in _REMOVED:
            if hook in cls.__dict__:
                raise TypeError(f"{cls.__name__}.{hook}: removed from the 0.5.23 base class; "
                                "use init_forward_metadata_out_graph(forward_batch, in_capture)")

    def init_forward_metadata(self, forward_batch):
        self.init_forward_metadata_out_graph(forward_batch)
        self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):  # noqa: B027
        """Per-iteration metadata prep outside the graph (capture: in_capture=True)."""

    def init_forward_metadata_in_graph(self, forward_batch):  # noqa: B027
        """Graph-recordable static-shape GPU work."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        raise NotImplementedError()

    def get_cuda_graph_seq_len_fill_value(self):
        raise NotImplementedError()

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise NotImplementedError()

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        raise NotImplementedError()
