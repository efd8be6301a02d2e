"""End-to-end: the official ``openai`` client against real ``tetriinfer serve`` processes, every mode."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.serve_helpers import ServeProcess, pid_alive
from tetriinfer import LLM, SamplingParams

STATIC = ["--pd-controller", "static"]  # the paper's fixed split: every request prefilled at prefill-0 and transferred
MODES = {
    # the default P:D controller (adaptive): a request may be kept at the prefill instance or prefilled locally
    "tetriinfer": ["--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1", "--chunk-size", "64",
                   "--chunk-padding", "full"],
    "tetriinfer-chunkwise": ["--mode", "tetriinfer", *STATIC, "--chunk-size", "32", "--kv-transfer", "chunk"],
    "tetriinfer-shm": ["--mode", "tetriinfer", *STATIC, "--chunk-size", "64", "--kv-backend", "shm"],
    "tetriinfer-torchdist": ["--mode", "tetriinfer", *STATIC, "--chunk-size", "64", "--kv-backend", "torchdist"],
    "tetriinfer-local": ["--mode", "tetriinfer", "--chunk-size", "32", "--local-prefill", "--local-prefill-weight", "0",
                         "--no-keep-decode"],
    "tetriinfer-keep": ["--mode", "tetriinfer", "--chunk-size", "32", "--keep-decode", "--keep-decode-ratio", "1",
                        "--no-local-prefill"],
    "distserve": ["--mode", "distserve", "--chunk-size", "64"],
    "colocated": ["--mode", "colocated", "--instances", "2"],
    "sarathi": ["--mode", "sarathi", "--instances", "2", "--chunk-size", "64"],
}
DISAGGREGATED = ("tetriinfer", "tetriinfer-chunkwise", "tetriinfer-shm", "tetriinfer-torchdist", "tetriinfer-local",
                 "tetriinfer-keep", "distserve")
PROMPTS = ["Hello there", "The capital of France is", "Write a poem about the sea and the sky, please."]
SEEDED = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(model=str(tiny_llama))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    greedy = {p: o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}
    outs = llm.generate(PROMPTS, SamplingParams(**SEEDED, ignore_eos=True))
    return greedy | {("seeded", p): o.outputs[0].text for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module", params=list(MODES))
def server(request, tiny_llama):
    srv = ServeProcess(tiny_llama, *MODES[request.param])
    srv.mode = request.param
    yield srv
    pids = srv.child_pids()
    assert srv.stop() == 0
    time.sleep(0.5)
    assert not [p for p in pids if pid_alive(p)], "instance processes outlived the server"


def _client(srv: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completions_match_offline_engine(server, reference):
    client = _client(server)
    for prompt in PROMPTS:
        out = client.completions.create(
            model="llama", prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == reference[prompt], f"mode {server.mode}"
        assert out.usage.completion_tokens == 12
        stream = client.completions.create(
            model="llama", prompt=prompt, max_tokens=12, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == reference[prompt]


def test_seeded_sampling_matches_offline_engine_wherever_it_runs(server, reference):
    """Seeded random sampling gives the offline engine's tokens in every mode, alone and in a burst: the sampler
    state after the first token travels with the hand-off (per request and chunk-wise), and a request kept at its
    prefill instance or prefilled at a decode instance samples on from its own generator."""
    async def run() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        burst = PROMPTS * 4
        outs = await asyncio.gather(*(
            client.completions.create(model="llama", prompt=p, **SEEDED, extra_body={"ignore_eos": True})
            for p in burst
        ))
        return [(p, o.choices[0].text) for p, o in zip(burst, outs, strict=True)]

    alone = _client(server).completions.create(model="llama", prompt=PROMPTS[2], **SEEDED,
                                               extra_body={"ignore_eos": True})
    assert alone.choices[0].text == reference[("seeded", PROMPTS[2])], f"mode {server.mode}"
    for prompt, text in asyncio.run(run()):
        assert text == reference[("seeded", prompt)], f"mode {server.mode}"


CONCURRENT_PROMPTS = [f"Request {i}: " + "tell me more about the sea " * (i % 5 * 3) for i in range(10)]


@pytest.fixture(scope="module")
def concurrent_reference(tiny_llama):
    llm = LLM(model=str(tiny_llama))
    outs = llm.generate(CONCURRENT_PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def test_concurrent_greedy_requests_match_offline_engine(server, concurrent_reference):
    """A burst of greedy requests of different lengths, all in flight at once (batched prefills, KV transfers
    overlapping decodes, and in ``tetriinfer-local`` some prefilled at the decode instance): each output is
    exactly the offline engine's."""
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        outs = await asyncio.gather(*(
            client.completions.create(model="llama", prompt=p, max_tokens=10, temperature=0.0,
                                      extra_body={"ignore_eos": True})
            for p in CONCURRENT_PROMPTS
        ))
        return [o.choices[0].text for o in outs]

    assert asyncio.run(run()) == concurrent_reference, f"mode {server.mode}"


def test_chat_streaming_and_not(server):
    client = _client(server)
    msgs = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="llama", messages=msgs, max_tokens=10, temperature=0.0)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="llama", messages=msgs, max_tokens=10, temperature=0.0, stream=True)
    text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
    assert text == full.choices[0].message.content


def test_64_concurrent_streams_complete_and_free_every_block(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model="llama", prompt=f"Request number {i}: " + "tell me more " * (i % 7),
            max_tokens=8 + i % 9, temperature=0.0, stream=True, extra_body={"ignore_eos": True},
        )
        n = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                n += 1
        return n

    async def run() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    counts = asyncio.run(run())
    assert all(c >= 1 for c in counts)
    info = server.wait_idle()
    for inst in info["instances"]:
        assert inst["kv_blocks_used"] == 0, inst
    assert info["requests_in_flight"] == 0
    by_role = info["ttft_by_prefill_role"]  # every request so far on this server, by where it was prefilled
    assert all(v["count"] > 0 and v["mean_s"] > 0 for v in by_role.values())
    if server.mode == "tetriinfer-local":  # a burst backs up the prefill instance: some prefill at the decode one
        assert 0 < info["local_prefills"] < 64
        assert info["transfers"]["count"] + info["local_prefills"] >= 64
        assert set(by_role) == {"prefill", "decode"} and by_role["decode"]["count"] == info["local_prefills"]
    elif server.mode == "tetriinfer-keep":  # the burst's tail, with the decode instance busy, decodes at prefill-0
        assert 0 < info["kept_decodes"] < 64
        assert info["transfers"]["count"] + info["kept_decodes"] >= 64
    elif server.mode == "tetriinfer":  # adaptive: each request transferred, kept at prefill-0 or prefilled locally
        assert set(by_role) <= {"prefill", "decode"}
        assert by_role.get("decode", {"count": 0})["count"] == info["local_prefills"]
        assert info["transfers"]["count"] + info["kept_decodes"] + info["local_prefills"] >= 64
    elif server.mode in DISAGGREGATED:
        assert set(by_role) == {"prefill"} and by_role["prefill"]["count"] >= 64
        assert info["transfers"]["count"] >= 64
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert "tetriinfer_kv_transfer_seconds_count" in metrics
    else:
        assert set(by_role) == {"colocated"} and by_role["colocated"]["count"] >= 64


def test_cluster_endpoint_shape(server):
    info = server.cluster()
    roles = sorted(i["role"] for i in info["instances"])
    if server.mode in DISAGGREGATED:
        assert roles == ["decode", "prefill"]
    else:
        assert roles == ["colocated", "colocated"]
    for inst in info["instances"]:
        assert {"id", "role", "pid", "host", "state", "kv_blocks_used", "kv_blocks_total", "queued", "running"} <= set(inst)
        assert inst["kv_blocks_total"] > 0


def test_keep_decode_waves_match_offline_engine(tiny_llama):
    """``--keep-decode``: a first wave leaves the decode instance busy, so the prefill instance keeps some of
    its requests; a second wave's prompts are then prefilled while those kept decodes run, which rides them
    along in the prefill chunks (one merged forward). Every output is exactly the offline engine's, every
    block is freed, and the front end counted the kept requests."""
    waves = [[f"Wave {w} request {i}: " + "tell me more about the sea " * (1 + (i * 3 + w) % 6) for i in range(8)]
             for w in range(2)]
    llm = LLM(model=str(tiny_llama))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reference = [[o.outputs[0].text for o in llm.generate(prompts, params)] for prompts in waves]
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--chunk-size", "64", "--keep-decode",
                       "--keep-decode-ratio", "4")
    try:
        async def run() -> list[list[str]]:
            client = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=300)

            async def wave(prompts: list[str], delay: float) -> list[str]:
                await asyncio.sleep(delay)
                outs = await asyncio.gather(*(
                    client.completions.create(model="llama", prompt=p, max_tokens=40, temperature=0.0,
                                              extra_body={"ignore_eos": True})
                    for p in prompts
                ))
                return [o.choices[0].text for o in outs]

            return list(await asyncio.gather(wave(waves[0], 0.0), wave(waves[1], 0.6)))

        assert asyncio.run(run()) == reference
        info = srv.wait_idle()
        assert info["kept_decodes"] > 0
        assert all(i["kv_blocks_used"] == 0 for i in info["instances"]) and info["requests_in_flight"] == 0
    finally:
        assert srv.stop() == 0
