"""How a cluster is laid out: mode, instance counts, policies, transfer settings, placement."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

from tetriinfer.core.flip_policy import FlipConfig
from tetriinfer.core.migration import MigrationConfig
from tetriinfer.core.pd_controller import PDControllerConfig
from tetriinfer.core.prefix_affinity import PrefixAffinity
from tetriinfer.core.rebalance import RebalanceConfig
from tetriinfer.core.scale_policy import ScaleConfig
from tetriinfer.runtime.instance_spec import KV_HANDOFFS
from tetriinfer.runtime.priority import check_nice, check_rt_priority

MODES = ("tetriinfer", "distserve", "colocated", "sarathi")
CHUNK_PADDINGS = ("auto", "full", "none")


def pads_last_chunk(chunk_padding: str, device: str) -> bool:
    """``--chunk-padding`` resolved for a device: full -> True, none -> False, auto -> pad unless on CPU."""
    if chunk_padding not in CHUNK_PADDINGS:
        raise ValueError(f"chunk_padding must be one of {', '.join(CHUNK_PADDINGS)}, got {chunk_padding!r}")
    if chunk_padding == "auto":
        return device != "cpu"
    return chunk_padding == "full"


@dataclass(frozen=True)
class RolePolicies:
    """The policies each instance of a cluster runs, resolved from its mode (one copy, read by the runtime's
    instance specs and by the simulator's instances)."""

    prefill_policy: str
    dispatch_policy: str
    decode_policy: str
    predictor: str
    colocated_policy: str  # vllm | sarathi (colocated modes)
    max_num_batched_tokens: int  # colocated token budget per step (sarathi: the chunk size)
    keep_decode: bool


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
    chunk_padding: str = "auto"  # auto | full | none (see pad_last_chunk)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = 1.0
    enable_prefix_caching: bool = False  # prefill and colocated instances reuse cached prompt blocks
    prefix_routing: bool = True  # with prefix caching: route to where a prompt's blocks are cached (affinity)
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    prefill_policy: str = "fcfs"
    prefill_sched_batch: int = 16
    cache_aware_prefill_order: bool = True  # with prefix caching: shortest-first counts uncached tokens only
    prefill_merge_limit: int | None = None  # later prompts join a chunk only below this many tokens (None: fill)
    prefill_tail_tokens: int = 0  # a chunk takes all queued prompt tokens when they exceed it by at most this (0: never)
    dispatch_policy: str = "length-aware"
    decode_policy: str = "greedy"
    heavy_decode_tokens: int = 128
    predictor: str = "none"
    predictor_mode: str = "auto"
    kv_backend: str = "tcp"
    kv_transfer: str = "request"
    kv_handoff: str = "auto"  # per-request path: "push" (decode posts memory, prefill sends) | "pull" | "auto"
    link_bandwidth: str | None = None
    transfer_timeout_s: float = 10.0
    transfer_attempts: int = 3
    fault_drop_p: float = 0.0
    fault_delay_p: float = 0.0
    fault_corrupt_p: float = 0.0
    local_prefill: bool = False  # conditional disaggregation: decode instances may prefill when the prefill tier is backed up
    local_prefill_weight: float = 0.25  # LocalPrefillConfig.interference_weight
    keep_decode: bool = False  # the reverse: a prefill instance decodes some requests itself (core.keep_decode)
    keep_decode_ratio: float = 0.5
    flip: bool = False
    flip_threshold: float = 0.1
    flip_window_s: float = 2.0
    flip_busy_threshold: float = 0.5  # the other role counts as loaded at this mean load (FlipConfig.busy_threshold)
    flip_idle_by: str = "every"  # FlipConfig.idle_by: every report of the window below threshold, or its mean
    flip_decode_load: str = "busy"  # core.flip_policy.FlipConfig.decode_load: busy | kv | inflation
    pd_controller: str = "paper"  # core.pd_controller policy choosing flips (with flip on): adaptive | paper | static
    keep_decode_rule: str = "ratio"  # core.keep_decode.KeepDecodeConfig.rule: ratio | cost
    # one of 2+ prefill instances keeps no decodes (KeepDecodeConfig.prompt_instance); None: on under the cost rule
    prompt_only_prefill: bool | None = None
    # the prompt-only prefill instance offers its prefilled requests to the keeping ones (KeepDecodeConfig.
    # offer_to_keepers); simulated only (the runtime refuses it)
    keep_offer: bool = False
    dispatch_when_full: str = "least-loaded"  # core.dispatcher.DispatcherConfig.alpha_empty: wait | least-loaded
    report_interval_s: float = 0.1
    cores_per_instance: int = 1
    instance_nice: int | None = None  # nice value of instance processes (runtime.priority); None: the front end's
    prefill_rt_priority: int | None = None  # SCHED_FIFO priority of instances while they prefill; None: normal
    pin_cores: bool = True
    seed: int = 0
    startup_timeout_s: float = 180.0
    launcher: str = "local"  # local | ray (runtime.launcher): where instance processes run
    ray_address: str = "auto"  # --launcher ray: auto | local | HOST:PORT of the Ray head
    replace_dead: bool = False  # start a new instance of a dead one's role (its requests still end with an error)
    autoscale: bool = False  # core.scale_policy: add / remove instances from load (ScaleConfig's fields below)
    autoscale_high: float = 0.8
    autoscale_low: float = 0.2
    autoscale_window_s: float = 5.0
    autoscale_cooldown_s: float = 10.0
    autoscale_max_instances: int = 8
    autoscale_decode_load: str = "inflation"
    autoscale_max_step: int = 4
    instance_host: str = "127.0.0.1"  # local launcher: the address instances bind (::1 for IPv6 loopback)
    warm_spares: int = 0  # pre-started instance processes for scale-out and replacements (launcher.py)
    rebalance: bool = False  # core.rebalance: idle instances take unstarted queued requests from backed-up peers
    rebalance_min_queued: int = 2
    rebalance_max_move: int = 16
    migrate: bool = False  # core.migration: live-migrate running decodes (evacuate leaving instances, balance)
    # between decode instances, or between colocated ones
    migrate_signal: str = "kv"
    migrate_high: float = 0.85
    migrate_low: float = 0.6
    migrate_min_gap: int = 4
    migrate_max_per_move: int = 8

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.disaggregated:
            if self.prefill_instances < 1 or self.decode_instances < 1:
                raise ValueError("disaggregated modes need >= 1 prefill and >= 1 decode instance")
        elif self.instances < 1:
            raise ValueError("colocated modes need >= 1 instance")
        pads_last_chunk(self.chunk_padding, self.device)  # validates chunk_padding
        if self.prefill_merge_limit is not None and self.prefill_merge_limit < 1:
            raise ValueError(f"prefill_merge_limit must be >= 1 (or unset), got {self.prefill_merge_limit}")
        if self.prefill_tail_tokens < 0:
            raise ValueError(f"prefill_tail_tokens must be >= 0, got {self.prefill_tail_tokens}")
        if self.instance_nice is not None:
            check_nice(self.instance_nice)
        if self.prefill_rt_priority is not None:
            check_rt_priority(self.prefill_rt_priority)
            if self.keep_decode:
                raise ValueError("prefill_rt_priority with keep_decode: a prefill instance that keeps decodes runs "
                                 "steps back to back, and under SCHED_FIFO it would starve everything else on its "
                                 "core; use one or the other")
        if self.cores_per_instance < 1:
            raise ValueError("cores_per_instance must be >= 1")
        if not 0 < self.flip_threshold < 1:
            raise ValueError("flip_threshold must be in (0, 1)")
        if not 0 <= self.flip_busy_threshold <= 1:
            raise ValueError(f"flip_busy_threshold must be in [0, 1], got {self.flip_busy_threshold}")
        if self.flip_idle_by not in ("every", "mean"):
            raise ValueError(f"flip_idle_by must be 'every' or 'mean', got {self.flip_idle_by!r}")
        if self.pd_controller not in ("adaptive", "paper", "static"):
            raise ValueError(f"pd_controller must be adaptive, paper or static, got {self.pd_controller!r}")
        if self.keep_decode_rule not in ("ratio", "cost"):
            raise ValueError(f"keep_decode_rule must be ratio or cost, got {self.keep_decode_rule!r}")
        if self.dispatch_when_full not in ("wait", "least-loaded"):
            raise ValueError(f"dispatch_when_full must be wait or least-loaded, got {self.dispatch_when_full!r}")
        if self.flip_decode_load not in ("busy", "kv", "inflation"):
            raise ValueError(f"flip_decode_load must be busy, kv or inflation, got {self.flip_decode_load!r}")
        if self.report_interval_s <= 0:
            raise ValueError("report_interval_s must be > 0")
        if self.local_prefill_weight < 0:
            raise ValueError("local_prefill_weight must be >= 0")
        if self.kv_handoff not in KV_HANDOFFS:
            raise ValueError(f"kv_handoff must be one of {', '.join(KV_HANDOFFS)}, got {self.kv_handoff!r}")
        self.scale_config()  # validates the autoscale fields
        self.rebalance_config()
        self.migration_config()
        try:
            ipaddress.ip_address(self.instance_host)
        except ValueError:
            raise ValueError(f"instance_host must be an IP address (127.0.0.1, ::1, ...), got "
                             f"{self.instance_host!r}") from None
        if self.warm_spares < 0:
            raise ValueError(f"warm_spares must be >= 0, got {self.warm_spares}")
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.launcher not in ("local", "ray"):
            raise ValueError(f"launcher must be local or ray, got {self.launcher!r}")
        if self.launcher == "ray" and self.kv_backend.split(":")[-1] in ("torchdist", "inproc"):
            raise ValueError(f"--launcher ray places instances on several hosts: kv backend {self.kv_backend!r} "
                             "cannot cross hosts (use tcp or nixl; shm works only when all land on one host)")
        if not self.keep_decode_ratio > 0:
            raise ValueError(f"keep_decode_ratio must be > 0, got {self.keep_decode_ratio}")

    def rebalance_config(self) -> RebalanceConfig:
        return RebalanceConfig(enabled=self.rebalance, min_queued=self.rebalance_min_queued,
                               max_move=self.rebalance_max_move)

    def migration_config(self) -> MigrationConfig:
        return MigrationConfig(enabled=self.migrate, signal=self.migrate_signal, high=self.migrate_high,
                               low=self.migrate_low, min_gap=self.migrate_min_gap,
                               max_per_move=self.migrate_max_per_move)

    def prefix_affinity(self) -> PrefixAffinity | None:
        """The global scheduler's cache model for prefix-aware routing (None: plain least-loaded routing)."""
        return PrefixAffinity(self.block_size) if self.enable_prefix_caching and self.prefix_routing else None

    def pd_controller_config(self) -> PDControllerConfig:
        """The monitor's P:D controller: ``pd_controller`` picks the flips when ``flip`` is on (no flips when off);
        the ``flip_*`` fields are the ``paper`` policy's rule."""
        paper = FlipConfig(threshold=self.flip_threshold, window_s=self.flip_window_s,
                           decode_load=self.flip_decode_load, busy_threshold=self.flip_busy_threshold,
                           idle_by=self.flip_idle_by)
        policy = self.pd_controller if self.flip and self.disaggregated else "static"
        return PDControllerConfig(policy=policy, paper=paper)

    def scale_config(self) -> ScaleConfig:
        return ScaleConfig(enabled=self.autoscale, high=self.autoscale_high, low=self.autoscale_low,
                           window_s=self.autoscale_window_s, cooldown_s=self.autoscale_cooldown_s,
                           max_instances=self.autoscale_max_instances, decode_load=self.autoscale_decode_load,
                           max_step=self.autoscale_max_step)

    @property
    def disaggregated(self) -> bool:
        return self.mode in ("tetriinfer", "distserve")

    @property
    def pad_last_chunk(self) -> bool:
        """Whether a prefill chunk short of ``chunk_size`` tokens is padded up to it (the paper's rule).

        ``auto`` pads on accelerators, where a forward below the saturate threshold costs the same as a full
        one (fixed shapes then cost nothing), and not on CPU, where forward time grows with every token
        (measured here: a 16-token prompt padded to a 512-token chunk took 360 ms instead of 30 ms).
        Full chunks are identical either way; only the last, partly filled chunk differs.
        """
        return pads_last_chunk(self.chunk_padding, self.device)

    def role_policies(self) -> RolePolicies:
        """``distserve`` is disaggregation without TetriInfer's scheduling: FCFS prefill, least-loaded dispatch,
        greedy decode admission, no length prediction; ``sarathi`` budgets each hybrid step to one chunk."""
        prefill, dispatch, decode, predictor = self.prefill_policy, self.dispatch_policy, self.decode_policy, self.predictor
        if self.mode == "distserve":
            prefill, dispatch, decode, predictor = "fcfs", "least-loaded", "greedy", "none"
        return RolePolicies(
            prefill_policy=prefill, dispatch_policy=dispatch, decode_policy=decode, predictor=predictor,
            colocated_policy="sarathi" if self.mode == "sarathi" else "vllm",
            max_num_batched_tokens=self.chunk_size if self.mode == "sarathi" else self.max_num_batched_tokens,
            keep_decode=self.keep_decode and self.disaggregated,
        )

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
