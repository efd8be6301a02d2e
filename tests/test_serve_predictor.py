"""Length prediction at prefill instances (oracle hook, parallel and sequential modes) feeding the
length-aware dispatcher and reserve-dynamic admission, with latency in /metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.serve_helpers import ServeProcess


@pytest.fixture(scope="module", params=["parallel", "sequential"])
def predicted_server(request, tiny_llama):
    srv = ServeProcess(
        # the fixed split: every prompt is prefilled (and predicted) at prefill-0 and dispatched
        tiny_llama, "--mode", "tetriinfer", "--pd-controller", "static", "--prefill-instances", "1",
        "--decode-instances", "2", "--chunk-size", "64", "--predictor", "oracle", "--predictor-mode", request.param,
        "--decode-policy", "reserve-dynamic",
    )
    yield srv
    assert srv.stop() == 0


def test_oracle_predictions_flow_to_dispatch_and_metrics(predicted_server):
    url = f"{predicted_server.base_url}/v1/completions"

    async def one(client: httpx.AsyncClient, i: int) -> int:
        n = 220 if i % 2 else 10  # heavy (> 128) and light decodes, alternating
        body = {"model": "llama", "prompt": f"p {i}", "max_tokens": n, "temperature": 0, "ignore_eos": True}
        r = await client.post(url, json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    async def run():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    counts = asyncio.run(run())
    assert counts == [220 if i % 2 else 10 for i in range(12)]
    assert predicted_server.predictions(at_least=12) >= 12
    info = predicted_server.cluster()
    metrics = httpx.get(f"{predicted_server.base_url}/metrics").text
    assert "tetriinfer_length_predictor_seconds_count" in metrics
    assert all(i["kv_blocks_used"] == 0 for i in info["instances"] if i["role"] == "prefill")
