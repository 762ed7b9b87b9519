"""The configuration fields the MLA builder reads (VllmConfig and its parts)."""

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    num_attention_heads: int = 128
    dtype: object = None

    def get_num_attention_heads(self, parallel_config) -> int:
        return self.num_attention_heads // parallel_config.tensor_parallel_size


@dataclass
class CacheConfig:
    cache_dtype: str = "auto"
    block_size: int = 64


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256


class CUDAGraphMode:
    def __init__(self, full: bool):
        self.full = full

    def has_full_cudagraphs(self) -> bool:
        return self.full


@dataclass
class CompilationConfig:
    cudagraph_mode: CUDAGraphMode = field(default_factory=lambda: CUDAGraphMode(False))
    cudagraph_capture_sizes: list = field(default_factory=list)
    static_forward_context: dict = field(default_factory=dict)  # layer name -> layer


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int = 0


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
