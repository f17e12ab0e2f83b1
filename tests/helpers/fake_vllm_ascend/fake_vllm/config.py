"""Fake of ``vllm.config``: the config classes and fields graphbuf reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CompilationConfig:
    cudagraph_mode: Any = None
    cudagraph_capture_sizes: Any = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0


@dataclass
class ModelConfig:
    max_model_len: int = 0


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int = 0


@dataclass
class VllmConfig:
    compilation_config: Any = None
    scheduler_config: Any = None
    model_config: Any = None
    parallel_config: Any = None
    speculative_config: Any = None
    quant_config: Any = None
