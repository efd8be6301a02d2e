"""What one instance process needs to start: its role, engine, policies and addresses.

Passed to the child process as msgpack bytes on its command line (never pickled).
"""

from __future__ import annotations

import msgspec

from tetriinfer.runtime.predictor_hook import PREDICTOR_MODES
from tetriinfer.runtime.priority import check_nice, check_rt_priority

ROLES = ("prefill", "decode", "colocated")
KV_HANDOFFS = ("auto", "push", "pull")
"""How a prefilled request's KV reaches its decode instance on the per-request path: ``push`` (the decode instance
posts memory, KVReady, the prefill instance sends into it), ``pull`` (the prefill instance registers the staged
KV and names it in the Handoff; the decode instance reads it one-sided, with no step of the prefill instance in
between), ``auto`` (pull where the link reads without its owner: shm; push elsewhere)."""


class InstanceSpec(msgspec.Struct, frozen=True):
    instance_id: str
    role: str  # prefill | decode | colocated
    frontend_address: str
    model: str
    host: str = "127.0.0.1"  # the address this instance binds (control socket, KV data) and peers dial
    dtype: str = "float32"
    device: str = "cpu"
    load_format: str = "auto"
    chunk_size: int = 512
    pad_last_chunk: bool = True
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    cpu_cores: list[int] | None = None
    num_threads: int | None = None
    nice: int | None = None  # CPU scheduling priority of this process (runtime.priority); None: as inherited
    prefill_rt_priority: int | None = None  # SCHED_FIFO priority while in the prefill role; None: never real-time
    seed: int = 0
    enable_prefix_caching: bool = False
    # policies
    prefill_policy: str = "fcfs"
    prefill_sched_batch: int = 16
    cache_aware_prefill_order: bool = True  # PrefillSchedulerConfig.cache_aware_order
    prefill_merge_limit: int | None = None  # PrefillSchedulerConfig.merge_limit
    prefill_tail_tokens: int = 0  # PrefillSchedulerConfig.tail_tokens
    dispatch_policy: str = "length-aware"
    decode_policy: str = "greedy"
    colocated_policy: str = "vllm"  # vllm | sarathi
    max_num_batched_tokens: int = 2048
    heavy_decode_tokens: int = 128
    keep_decode: bool = False  # prefill role: decode some requests here when the decode tier is busier
    keep_decode_ratio: float = 0.5  # core.keep_decode.KeepDecodeConfig.ratio
    keep_decode_rule: str = "ratio"  # core.keep_decode.KeepDecodeConfig.rule
    prompt_only_prefill: bool | None = None  # core.keep_decode.KeepDecodeConfig.prompt_instance
    dispatch_when_full: str = "least-loaded"  # core.dispatcher.DispatcherConfig.alpha_empty
    # transfer
    kv_backend: str = "tcp"
    kv_rank: int = 0  # torchdist: this instance's rank in the cluster's process group
    kv_world_size: int = 1
    kv_init_method: str = ""  # torchdist: tcp://127.0.0.1:PORT chosen by the front end
    kv_transfer: str = "request"  # request (after prefill, the paper) | chunk (block-wise while prefilling)
    kv_handoff: str = "auto"  # per-request path: push | pull | auto (KV_HANDOFFS)
    link_bandwidth: str | None = None
    link_latency_s: float = 0.0
    transfer_timeout_s: float = 10.0
    transfer_attempts: int = 3
    max_dispatch_attempts: int = 3
    fault_drop_p: float = 0.0
    fault_delay_p: float = 0.0
    fault_corrupt_p: float = 0.0
    fault_delay_s: float = 0.2
    # predictor: "none" | "oracle" | a predictor folder
    predictor: str = "none"
    # auto | in-band (from the serving prefill's own hidden states) | parallel (overlaps prefill) | sequential
    predictor_mode: str = "auto"
    report_interval_s: float = 0.1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.predictor_mode not in PREDICTOR_MODES:
            raise ValueError(f"predictor_mode must be one of {', '.join(PREDICTOR_MODES)}, got {self.predictor_mode!r}")
        if self.kv_transfer not in ("request", "chunk"):
            raise ValueError(f"kv_transfer must be 'request' or 'chunk', got {self.kv_transfer!r}")
        if self.kv_handoff not in KV_HANDOFFS:
            raise ValueError(f"kv_handoff must be one of {KV_HANDOFFS}, got {self.kv_handoff!r}")
        if self.nice is not None:
            check_nice(self.nice)
        if self.prefill_rt_priority is not None:
            check_rt_priority(self.prefill_rt_priority)
        if self.report_interval_s <= 0:
            raise ValueError("report_interval_s must be > 0")
        if self.transfer_attempts < 1 or self.max_dispatch_attempts < 1:
            raise ValueError("transfer_attempts and max_dispatch_attempts must be >= 1")


def encode_spec(spec: InstanceSpec) -> bytes:
    return msgspec.msgpack.encode(spec)


def decode_spec(data: bytes) -> InstanceSpec:
    return msgspec.msgpack.decode(data, type=InstanceSpec)
