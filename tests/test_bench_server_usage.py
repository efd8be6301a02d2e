"""bench.server_usage: parsing our /metrics (as ServerMetrics writes it) and vLLM's, and the run's share."""

from __future__ import annotations

import pytest

from tetriinfer.bench.server_usage import UsageSnapshot, parse_usage, usage_between
from tetriinfer.server.metrics import ServerMetrics


def ours(instances: list[dict], in_flight: int = 0) -> str:
    m = ServerMetrics()
    m.update_cluster({"instances": instances})
    for _ in range(in_flight):
        m.in_flight.inc()
    return m.render()[0].decode()


def test_our_exposition_round_trips_and_the_share_is_the_growth() -> None:
    before = parse_usage(ours([{"id": "prefill-0", "role": "prefill", "busy_s": 2.0, "steps": 5,
                                "prefix_cache_hit_tokens": 32, "prefix_cache_queried_tokens": 100},
                               {"id": "decode-0", "role": "decode", "busy_s": 1.0}], in_flight=2))
    assert before is not None and before.server == "tetriinfer" and before.requests_in_flight == 2
    assert before.busy_s == {"prefill-0": 2.0, "decode-0": 1.0}
    # a flip renamed nothing, decode-1 appeared (scale-out), decode-0 left (its share is lost and named)
    after = parse_usage(ours([{"id": "prefill-0", "role": "decode", "busy_s": 5.5,
                               "prefix_cache_hit_tokens": 96, "prefix_cache_queried_tokens": 300},
                              {"id": "decode-1", "role": "decode", "busy_s": 0.75}]))
    usage = usage_between(before, after)
    assert usage is not None
    assert usage["resource_s"] == pytest.approx(3.5 + 0.75)
    assert usage["busy_per_instance_s"] == {"decode-1": 0.75, "prefill-0": 3.5}
    assert (usage["prefix_cache_hit_tokens"], usage["prefix_cache_queried_tokens"]) == (64, 200)
    assert usage["prefix_cache_hit_rate"] == pytest.approx(0.32) and usage["instances_lost"] == ["decode-0"]


def test_vllm_prefix_counters_are_read_and_other_servers_give_nothing() -> None:
    vllm = ('# HELP vllm:prefix_cache_queries_total q\n# TYPE vllm:prefix_cache_queries_total counter\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0\n'
            '# HELP vllm:prefix_cache_hits_total h\n# TYPE vllm:prefix_cache_hits_total counter\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0\n')
    before = parse_usage(vllm)
    after = parse_usage(vllm.replace("1000.0", "1600.0").replace("400.0", "700.0"))
    usage = usage_between(before, after)
    assert usage is not None and usage["server"] == "vllm" and usage["resource_s"] is None
    assert (usage["prefix_cache_hit_tokens"], usage["prefix_cache_queried_tokens"]) == (300, 600)
    assert parse_usage("# TYPE x counter\nx_total 1\n") is None
    assert parse_usage("not prometheus {{{") is None
    assert usage_between(None, after) is None and usage_between(before, parse_usage(ours([{"id": "a",
                                                                                       "busy_s": 1}]))) is None
    with pytest.raises(ValueError, match="server"):
        UsageSnapshot("sglang")
