"""What a server spent on one benchmark run, read from its Prometheus ``GET /metrics`` before and after.

- Our server (``tetriinfer_instance_busy_seconds{instance}``): per-instance busy seconds during the run and
  their sum (the paper's *resource usage*), and the prompt tokens its prefix caches looked up and found
  (``tetriinfer_instance_prefix_cache_{queried,hit}_tokens``).
- vLLM (``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``, tokens): the prefix-cache part;
  vLLM exports no busy time, so ``resource_s`` is None.
- Anything else (no ``/metrics``, other names, a scrape error): no usage, never a failed benchmark.

Counters are cumulative, so a run's share is ``after - before`` per instance; an instance that appears during
the run (scale-out) counts from 0; one that leaves before the last scrape is missing from ``after`` and its
share is lost (the result says which). The text is parsed with ``prometheus_client``'s parser (text only,
nothing is unpickled).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_OURS_BUSY = "tetriinfer_instance_busy_seconds"
_OURS_HIT = "tetriinfer_instance_prefix_cache_hit_tokens"
_OURS_QUERIED = "tetriinfer_instance_prefix_cache_queried_tokens"
_OURS_IN_FLIGHT = "tetriinfer_requests_in_flight"
_VLLM_HIT = "vllm:prefix_cache_hits"
_VLLM_QUERIED = "vllm:prefix_cache_queries"


@dataclass(frozen=True)
class UsageSnapshot:
    """Cumulative counters at one scrape. ``server``: ``tetriinfer`` or ``vllm``. Per-instance maps are keyed
    by instance id (vLLM: one entry, ``engine``)."""

    server: str
    busy_s: Mapping[str, float] = field(default_factory=dict)
    prefix_hit_tokens: Mapping[str, float] = field(default_factory=dict)
    prefix_queried_tokens: Mapping[str, float] = field(default_factory=dict)
    requests_in_flight: float = 0.0

    def __post_init__(self) -> None:
        if self.server not in ("tetriinfer", "vllm"):
            raise ValueError(f"server must be 'tetriinfer' or 'vllm', got {self.server!r}")


def parse_usage(text: str) -> UsageSnapshot | None:
    """The usage counters in a Prometheus text exposition; None when it has neither ours nor vLLM's."""
    busy: dict[str, float] = {}
    hit: dict[str, float] = {}
    queried: dict[str, float] = {}
    vllm_hit = vllm_queried = None
    in_flight = 0.0
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for fam in families:
        for s in fam.samples:
            inst = s.labels.get("instance", "")
            if s.name == _OURS_BUSY:  # cumulative: the largest if an instance shows under two roles
                busy[inst] = max(s.value, busy.get(inst, 0.0))
            elif s.name == _OURS_HIT:
                hit[inst] = max(s.value, hit.get(inst, 0.0))
            elif s.name == _OURS_QUERIED:
                queried[inst] = max(s.value, queried.get(inst, 0.0))
            elif s.name == _OURS_IN_FLIGHT:
                in_flight = s.value
            elif s.name in (_VLLM_HIT, _VLLM_HIT + "_total"):
                vllm_hit = (vllm_hit or 0.0) + s.value  # summed over label sets (engines)
            elif s.name in (_VLLM_QUERIED, _VLLM_QUERIED + "_total"):
                vllm_queried = (vllm_queried or 0.0) + s.value
    if busy:
        return UsageSnapshot("tetriinfer", busy, hit, queried, in_flight)
    if vllm_hit is not None or vllm_queried is not None:
        return UsageSnapshot("vllm", {}, {"engine": vllm_hit or 0.0}, {"engine": vllm_queried or 0.0})
    return None


def scrape_usage(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> UsageSnapshot | None:
    """``GET {base_url}/metrics`` parsed by ``parse_usage``; None on any HTTP or network error."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return parse_usage(resp.text)
    except httpx.HTTPError:
        return None


def scrape_settled(base_url: str, api_key: str | None = None, timeout_s: float = 5.0,
                   interval_s: float = 0.3) -> UsageSnapshot | None:
    """Scrape until our server has nothing in flight and two scrapes ``interval_s`` apart agree (its
    instances report busy time periodically, so the last steps show up a report later); at most
    ``timeout_s``. A vLLM snapshot is returned at once."""
    deadline = time.monotonic() + timeout_s
    last = scrape_usage(base_url, api_key)
    while last is not None and last.server == "tetriinfer" and time.monotonic() < deadline:
        time.sleep(interval_s)
        now = scrape_usage(base_url, api_key)
        if now is None:
            return last
        if now.requests_in_flight == 0 and now == last:
            return now
        last = now
    return last


def _delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: max(0.0, v - before.get(k, 0.0)) for k, v in after.items()}


def usage_between(before: UsageSnapshot | None, after: UsageSnapshot | None) -> dict[str, Any] | None:
    """The run's share of the counters: ``server``, ``resource_s`` (sum of busy seconds; None for vLLM),
    ``busy_per_instance_s``, ``prefix_cache_hit_tokens``, ``prefix_cache_queried_tokens``,
    ``prefix_cache_hit_rate`` (None when nothing was looked up), ``instances_lost`` (instances in ``before``
    missing from ``after``). None when either scrape found nothing or the server changed in between."""
    if before is None or after is None or before.server != after.server:
        return None
    busy = _delta(before.busy_s, after.busy_s)
    hit = sum(_delta(before.prefix_hit_tokens, after.prefix_hit_tokens).values())
    queried = sum(_delta(before.prefix_queried_tokens, after.prefix_queried_tokens).values())
    return {
        "server": after.server,
        "resource_s": sum(busy.values()) if after.server == "tetriinfer" else None,
        "busy_per_instance_s": dict(sorted(busy.items())),
        "prefix_cache_hit_tokens": int(hit),
        "prefix_cache_queried_tokens": int(queried),
        "prefix_cache_hit_rate": hit / queried if queried else None,
        "instances_lost": sorted(set(before.busy_s) - set(after.busy_s)),
    }
