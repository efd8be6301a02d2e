"""How a cluster is laid out: mode, instance counts, policies, transfer settings, placement."""

from __future__ import annotations

import os
from dataclasses import dataclass

MODES = ("tetriinfer", "distserve", "colocated", "sarathi")


@dataclass(frozen=True)
class ClusterConfig:
    """Validated in ``__post_init__``. Disaggregated modes use ``prefill_instances``/``decode_instances``;
    colocated modes use ``instances``. On CPU each instance is pinned to its own core(s)."""

    model: str
    mode: str = "tetriinfer"
    dtype: str = "float32"
    device: str = "cpu"
    load_format: str = "auto"
    prefill_instances: int = 1
    decode_instances: int = 1
    instances: int = 2
    chunk_size: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = 1.0
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    prefill_policy: str = "fcfs"
    prefill_sched_batch: int = 16
    dispatch_policy: str = "length-aware"
    decode_policy: str = "greedy"
    heavy_decode_tokens: int = 128
    predictor: str = "none"
    predictor_mode: str = "parallel"
    kv_backend: str = "tcp"
    kv_transfer: str = "request"
    link_bandwidth: str | None = None
    transfer_timeout_s: float = 10.0
    transfer_attempts: int = 3
    fault_drop_p: float = 0.0
    fault_delay_p: float = 0.0
    fault_corrupt_p: float = 0.0
    flip: bool = False
    flip_threshold: float = 0.1
    flip_window_s: float = 2.0
    report_interval_s: float = 0.1
    cores_per_instance: int = 1
    pin_cores: bool = True
    seed: int = 0
    startup_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.disaggregated:
            if self.prefill_instances < 1 or self.decode_instances < 1:
                raise ValueError("disaggregated modes need >= 1 prefill and >= 1 decode instance")
        elif self.instances < 1:
            raise ValueError("colocated modes need >= 1 instance")
        if self.cores_per_instance < 1:
            raise ValueError("cores_per_instance must be >= 1")
        if not 0 < self.flip_threshold < 1:
            raise ValueError("flip_threshold must be in (0, 1)")
        if self.report_interval_s <= 0:
            raise ValueError("report_interval_s must be > 0")

    @property
    def disaggregated(self) -> bool:
        return self.mode in ("tetriinfer", "distserve")

    def roles(self) -> list[str]:
        if self.disaggregated:
            return ["prefill"] * self.prefill_instances + ["decode"] * self.decode_instances
        return ["colocated"] * self.instances

    def cores_for(self, index: int) -> list[int] | None:
        if not self.pin_cores or not self.device == "cpu":
            return None
        ncpu = os.cpu_count() or 1
        start = (index * self.cores_per_instance) % ncpu
        return [(start + i) % ncpu for i in range(self.cores_per_instance)]
