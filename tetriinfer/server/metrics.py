"""Prometheus metrics of one TetriInfer front end (served at ``GET /metrics``).

``ServerMetrics`` owns its own ``CollectorRegistry`` (never the global one), so several servers or
tests in one process do not collide. The HTTP layer observes request latencies; the runtime observes
KV transfers and role flips through the same object (``observe_transfer``, ``observe_flip``), which it
gets from ``build_app(..., metrics=...)`` or ``app.state.metrics``. All methods are thread-safe
(prometheus-client's metric objects are; the per-instance refresh holds a lock).

Metric names (prefix ``tetriinfer_``):
- ``time_to_first_token_seconds``, ``time_per_output_token_seconds``, ``e2e_request_latency_seconds``
  (histograms; TPOT = (E2E - TTFT) / (output tokens - 1), observed only when a request has >= 2 tokens);
- ``requests_finished_total{finish_reason}``, ``prompt_tokens_total``, ``generation_tokens_total``,
  ``requests_in_flight`` (gauge), ``request_errors_total{code}`` (HTTP errors returned);
- per instance, refreshed from ``cluster_info()`` on every scrape (stale instances disappear):
  ``instance_kv_blocks_used``, ``instance_kv_blocks_total``, ``instance_queued_requests``,
  ``instance_running_requests``, ``instance_prefix_cache_hit_tokens`` / ``..._queried_tokens`` (cumulative prompt
  tokens found in / looked up in the prefix cache), ``instance_prefix_cache_blocks``, ``instance_busy_seconds`` /
  ``instance_steps`` (cumulative seconds spent in model steps / steps run, as of the instance's last load
  report: ``tetriinfer bench`` takes their growth over a run as its resource usage), ``instance_up`` — labels
  ``instance``, ``role``;
- ``kv_transfer_bytes`` and ``kv_transfer_seconds`` (histograms; ``kv_transfer_bytes_sum`` is the total
  moved), ``kv_transfers_total{backend,outcome}``;
- ``instance_flips_total{from_role,to_role}``, ``instance_flip_seconds`` (histogram).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0,
               480.0, 960.0)
TRANSFER_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(13))  # 1 KiB .. 16 GiB
TRANSFER_SECONDS_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                            2.5, 5.0, 10.0, 30.0)
FLIP_SECONDS_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)

_INSTANCE_FIELDS = {
    "kv_blocks_used": "instance_kv_blocks_used",
    "kv_blocks_total": "instance_kv_blocks_total",
    "queued": "instance_queued_requests",
    "running": "instance_running_requests",
    "prefix_cache_hit_tokens": "instance_prefix_cache_hit_tokens",
    "prefix_cache_queried_tokens": "instance_prefix_cache_queried_tokens",
    "prefix_cache_blocks": "instance_prefix_cache_blocks",
    "busy_s": "instance_busy_seconds",
    "steps": "instance_steps",
}


class ServerMetrics:
    """One registry with the front end's metrics; see the module docstring for names and meaning."""

    def __init__(self, namespace: str = "tetriinfer", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, ns = self.registry, namespace
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token (request arrival at the "
                              "HTTP server to its first output token).", namespace=ns, registry=r,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per request.", namespace=ns, registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Request arrival to its last token.",
                             namespace=ns, registry=r, buckets=E2E_BUCKETS)
        self.finished = Counter("requests_finished", "Finished requests by finish reason "
                                "(stop, length, abort, error).", ["finish_reason"], namespace=ns, registry=r)
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of finished requests.", namespace=ns,
                                     registry=r)
        self.generation_tokens = Counter("generation_tokens", "Output tokens of finished requests.",
                                         namespace=ns, registry=r)
        self.in_flight = Gauge("requests_in_flight", "Generation requests being served now.", namespace=ns,
                               registry=r)
        self.errors = Counter("request_errors", "HTTP error responses by status code.", ["code"],
                              namespace=ns, registry=r)
        labels = ["instance", "role"]
        self._instance_gauges = {
            key: Gauge(name, f"Per-instance {key.replace('_', ' ')} (from cluster_info()).", labels,
                       namespace=ns, registry=r)
            for key, name in _INSTANCE_FIELDS.items()
        }
        self.instance_up = Gauge("instance_up", "1 when the instance reports a healthy state.", labels,
                                 namespace=ns, registry=r)
        self.transfer_bytes = Histogram("kv_transfer_bytes", "Bytes of KV cache moved per transfer.",
                                        namespace=ns, registry=r, buckets=TRANSFER_BYTES_BUCKETS)
        self.transfer_seconds = Histogram("kv_transfer_seconds", "Latency of one KV transfer.", namespace=ns,
                                          registry=r, buckets=TRANSFER_SECONDS_BUCKETS)
        self.transfers = Counter("kv_transfers", "KV transfers by backend and outcome (done, failed, "
                                 "timeout, retried).", ["backend", "outcome"], namespace=ns, registry=r)
        self.flips = Counter("instance_flips", "Instance role flips.", ["from_role", "to_role"], namespace=ns,
                             registry=r)
        self.flip_seconds = Histogram("instance_flip_seconds", "Time an instance took to flip its role.",
                                      namespace=ns, registry=r, buckets=FLIP_SECONDS_BUCKETS)
        self.scaling_events = Gauge("scaling_events", "Membership changes since start by action (add, remove, "
                                    "autoscale-add, autoscale-remove, died, replace, ...; from /cluster).",
                                    ["action"], namespace=ns, registry=r)
        self.pool_size = Gauge("instances", "Instances in the pool by role (live or not; from /cluster).",
                               ["role"], namespace=ns, registry=r)
        self.migrated = Gauge("requests_migrated", "Requests moved unstarted to another instance since start "
                              "(--rebalance).", namespace=ns, registry=r)
        self.live_migrated = Gauge("requests_live_migrated", "Running decodes moved with their KV to another "
                                   "decode instance since start, by reason (evacuate, balance; --migrate).",
                                   ["reason"], namespace=ns, registry=r)
        self.predictor_seconds = Histogram(
            "length_predictor_seconds", "Latency of one output-length prediction at a prefill instance.",
            namespace=ns, registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self._lock = threading.Lock()

    # ---- requests (HTTP layer) -----------------------------------------------------------
    def observe_request(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        """Record one finished request. ``ttft_s`` is None when no token was produced."""
        self.finished.labels(finish_reason=finish_reason or "unknown").inc()
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generation_tokens.inc(max(0, completion_tokens))
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))
            if completion_tokens >= 2:
                self.tpot.observe(max(0.0, e2e_s - ttft_s) / (completion_tokens - 1))
        if completion_tokens >= 1:
            self.e2e.observe(max(0.0, e2e_s))

    def observe_error(self, status_code: int) -> None:
        self.errors.labels(code=str(status_code)).inc()

    # ---- runtime hooks -------------------------------------------------------------------
    def observe_transfer(
        self, num_bytes: int, seconds: float, *, backend: str = "unknown", outcome: str = "done"
    ) -> None:
        """Record one KV transfer; sizes and latencies only count for ``outcome == "done"``."""
        if num_bytes < 0 or seconds < 0:
            raise ValueError(f"transfer bytes and seconds must be >= 0, got {num_bytes}, {seconds}")
        self.transfers.labels(backend=backend, outcome=outcome).inc()
        if outcome == "done":
            self.transfer_bytes.observe(num_bytes)
            self.transfer_seconds.observe(seconds)

    def observe_flip(self, from_role: str, to_role: str, seconds: float | None = None) -> None:
        """Record one instance flipping from ``from_role`` to ``to_role`` (taking ``seconds``)."""
        self.flips.labels(from_role=from_role, to_role=to_role).inc()
        if seconds is not None:
            self.flip_seconds.observe(max(0.0, seconds))

    def observe_predictor(self, seconds: float) -> None:
        self.predictor_seconds.observe(max(0.0, seconds))

    def update_cluster(self, info: Mapping[str, Any]) -> None:
        """Replace the per-instance gauges with the values in ``cluster_info()``'s ``instances``, and the pool
        gauges (size by role, scaling events by action, migrated requests) with its totals."""
        instances = info.get("instances") or []
        with self._lock:
            for gauge in (*self._instance_gauges.values(), self.instance_up, self.scaling_events, self.pool_size):
                gauge.clear()
            for action, count in collections.Counter(str(e.get("action", "?")) for e in info.get("scaling") or []).items():
                self.scaling_events.labels(action=action).set(count)
            for role, count in collections.Counter(str(i.get("role", "unknown")) for i in instances).items():
                self.pool_size.labels(role=role).set(count)
            self.migrated.set(float((info.get("rebalance") or {}).get("migrated", 0)))
            self.live_migrated.clear()
            for reason, count in ((info.get("migration") or {}).get("moved_by_reason") or {}).items():
                self.live_migrated.labels(reason=str(reason)).set(float(count))
            for inst in instances:
                labels = {"instance": str(inst.get("id", "?")), "role": str(inst.get("role", "unknown"))}
                for key, gauge in self._instance_gauges.items():
                    value = inst.get(key)
                    if isinstance(value, int | float):
                        gauge.labels(**labels).set(value)
                state = str(inst.get("state", "")).lower()
                self.instance_up.labels(**labels).set(1.0 if state in ("running", "ok", "healthy", "idle")
                                                      else 0.0)

    # ---- exposition ----------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
