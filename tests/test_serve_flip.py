"""Instance flip in a real cluster: an idle prefill instance becomes a decode instance under decode load,
in place (same pid, no reload), and no request is lost."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from tests.serve_helpers import ServeProcess, realtime_allowed, write_cpu_layout
from tetriinfer.runtime.priority import thread_policies


@pytest.fixture(scope="module")
def flip_server(tiny_llama, tmp_path_factory):
    srv = ServeProcess(
        tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "2", "--decode-instances", "1",
        "--chunk-size", "64", "--flip", "--flip-window", "0.5", "--flip-threshold", "0.2",
        "--cpu-layout", write_cpu_layout(tmp_path_factory.mktemp("layout"), prefill_rt_priority=5),
    )
    yield srv
    assert srv.stop() == 0


def test_prefill_instance_flips_to_decode_under_decode_load(flip_server):
    before = {i["id"]: i for i in flip_server.cluster()["instances"]}
    url = f"{flip_server.base_url}/v1/completions"

    async def one(client: httpx.AsyncClient, i: int) -> str:
        await asyncio.sleep(0.05 * i)
        body = {"model": "llama", "prompt": f"hi {i}", "max_tokens": 160, "temperature": 0, "ignore_eos": True}
        r = await client.post(url, json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["finish_reason"]

    async def run():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(48)))

    reasons = asyncio.run(run())
    assert reasons == ["length"] * 48
    info = flip_server.cluster()
    assert info["flips"], "no flip happened"
    flip = info["flips"][0]
    assert flip["from"] == "prefill" and flip["to"] == "decode"
    assert flip["switch_s"] < 1.0  # in place: no model reload
    after = {i["id"]: i for i in info["instances"]}
    assert after[flip["instance"]]["pid"] == before[flip["instance"]]["pid"]
    roles = sorted(i["role"] for i in info["instances"])
    assert roles.count("prefill") >= 1 and roles.count("decode") >= 1
    # prefill_rt_priority: the flipped instance gave SCHED_FIFO back; instances still prefilling hold it
    fifo = (os.SCHED_FIFO, 5) if realtime_allowed() else (os.SCHED_OTHER, 0)
    for inst in info["instances"]:
        want = fifo if inst["role"] == "prefill" else (os.SCHED_OTHER, 0)
        assert set(thread_policies(inst["pid"]).values()) == {want}, (inst["id"], inst["role"])
    metrics = httpx.get(f"{flip_server.base_url}/metrics").text
    assert "tetriinfer_instance_flips_total" in metrics
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(i["kv_blocks_used"] for i in info["instances"]):
        time.sleep(0.3)
        info = flip_server.cluster()
    assert all(i["kv_blocks_used"] == 0 for i in info["instances"])
