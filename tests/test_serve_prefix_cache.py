"""End-to-end: ``tetriinfer serve --enable-prefix-caching`` in the single, disaggregated (whole-request and
chunk-wise KV transfer) and colocated modes: requests that share a long prefix give exactly the outputs of an
engine without caching, the hits show in ``/cluster`` and ``/metrics``, and every block comes back."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.serve_helpers import ServeProcess
from tetriinfer import LLM, SamplingParams

SYSTEM = ("You are a careful assistant for a shipping company. Answer in short sentences, cite the order number, "
          "never promise a delivery date, and hand billing questions to a human agent. ") * 3
PROMPTS = [SYSTEM + q for q in ("Where is order 1187?", "Cancel order 42.", "Why was I charged twice?",
                                "Where is order 1187?")]
MODES = {
    "single": ["--mode", "single"],
    "tetriinfer": ["--mode", "tetriinfer", "--chunk-size", "64"],
    "tetriinfer-chunkwise": ["--mode", "tetriinfer", "--chunk-size", "32", "--kv-transfer", "chunk"],
    "colocated": ["--mode", "colocated", "--instances", "2"],
}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(model=str(tiny_llama))  # no prefix caching: the ground truth
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module", params=list(MODES))
def server(request, tiny_llama):
    srv = ServeProcess(tiny_llama, *MODES[request.param], "--enable-prefix-caching")
    srv.mode = request.param
    yield srv
    assert srv.stop() == 0
    # the start-up lines name the length predictor where one can serve (the disaggregated modes): none here,
    # since the shipped predictor fits only the model it was trained with
    startup = srv.output()
    assert ("length predictor: none" in startup) == request.param.startswith("tetriinfer"), startup


def test_shared_prefix_requests_match_uncached_engine_and_hits_are_reported(server, reference):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt, want in zip(PROMPTS, reference, strict=True):  # one at a time: each finds the previous one's blocks
        out = client.completions.create(model="llama", prompt=prompt, max_tokens=10, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want, f"mode {server.mode}"
    stream = client.completions.create(model="llama", prompt=PROMPTS[1], max_tokens=10, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == reference[1]

    info = server.wait_idle()
    for inst in info["instances"]:
        assert inst["kv_blocks_used"] == 0, inst  # cached blocks are free blocks: nothing is held
    hits = sum(i["prefix_cache_hit_tokens"] for i in info["instances"])
    queried = sum(i["prefix_cache_queried_tokens"] for i in info["instances"])
    # 5 requests over at most 2 prefilling instances: at least 3 find the ~90-token system prompt cached
    assert hits >= 3 * 64, info["instances"]
    assert queried >= sum(len(p) for p in PROMPTS) // 8  # every prompt was looked up (tokens, not characters)
    assert hits < queried
    assert sum(i["prefix_cache_blocks"] for i in info["instances"]) > 0

    deadline = time.monotonic() + 10
    while True:  # the load reports reach /metrics on their own schedule
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("tetriinfer_instance_prefix_cache_hit_tokens{")]
        total = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
        if total >= hits or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert total >= hits, lines


def test_bench_reads_busy_time_and_prefix_hits_from_the_real_metrics(server):
    """``tetriinfer bench`` against the real server: its ``server_usage`` (from ``/metrics``, before and after)
    names every instance, counts busy seconds, and sees the cache hits of three requests sharing 64 tokens."""
    from tetriinfer.bench.client import ClientConfig, run_benchmark
    from tetriinfer.bench.workloads import Workload, WorkloadRequest

    reqs = tuple(WorkloadRequest(f"s{i}", 0.6 * i, 80, 4, prefix_blocks=(7, 8, 100 + i), prefix_block_tokens=32)
                 for i in range(3))
    wl = Workload("shared", reqs, "test", "trace", None, 0)
    res = run_benchmark(ClientConfig(server.base_url, "llama", progress=False), wl)
    usage = res["server_usage"]
    assert res["summary"]["completed"] == 3 and usage is not None and usage["server"] == "tetriinfer"
    ids = {i["id"] for i in server.wait_idle()["instances"]}
    assert set(usage["busy_per_instance_s"]) == ids and usage["resource_s"] > 0
    assert usage["prefix_cache_queried_tokens"] >= 3 * 80 and usage["prefix_cache_hit_tokens"] >= 32
