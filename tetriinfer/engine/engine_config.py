"""Configuration of one inference engine (one instance's model + KV cache + scheduler knobs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    chunk_size: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None  # default: 2 GiB on CPU, 85% of free memory on CUDA
    max_num_seqs: int = 256
    max_model_len: int | None = None
    pad_last_chunk: bool = True
    load_format: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    cpu_cores: tuple[int, ...] | None = None
    enable_prefix_caching: bool = False  # reuse the K/V of full blocks of earlier prompts (core.prefix_cache)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError("kv_cache_memory_gb must be > 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
