"""End-to-end tests of the OpenAI-compatible server: real uvicorn on 127.0.0.1, the official ``openai``
client, an ``InProcessEngineClient`` over a tiny random llama made with ``make_model``."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from tetriinfer import LLM, SamplingParams
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.make_model import make_model
from tetriinfer.runtime.engine_client import TokenEvent
from tetriinfer.runtime.inprocess import InProcessEngineClient
from tetriinfer.server.app import build_app

MODEL = "tiny-test"
ENGINE_KW: dict[str, Any] = dict(chunk_size=64, num_kv_blocks=128, max_model_len=256, num_threads=1)


class ServerThread:
    """uvicorn serving ``app`` on a free 127.0.0.1 port in a background thread."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("llama", "tiny", tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)


@pytest.fixture(scope="module")
def engine_client(model_dir: Path) -> InProcessEngineClient:
    return InProcessEngineClient(EngineConfig(model=str(model_dir), **ENGINE_KW), model_name=MODEL)


@pytest.fixture(scope="module")
def server(engine_client: InProcessEngineClient) -> Iterator[ServerThread]:
    with ServerThread(build_app(engine_client, served_model_name=MODEL, api_key=None)) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), **ENGINE_KW)


@pytest.fixture
def oai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def reference(llm: LLM, prompt: str | list[int], max_tokens: int, **kw: Any) -> Any:
    p: Any = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0].outputs[0]


def wait_idle(server: ServerThread, timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        inst = httpx.get(server.url + "/cluster").json()["instances"][0]
        if inst["kv_blocks_used"] == 0 and inst["running"] == 0 and inst["queued"] == 0:
            return inst
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {inst}")
        time.sleep(0.05)


# ---- info routes ------------------------------------------------------------------------------
def test_models_health_cluster(server: ServerThread, oai: openai.OpenAI) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 256 and raw["owned_by"] == "tetriinfer"
    assert httpx.get(server.url + "/health").status_code == 200
    info = httpx.get(server.url + "/cluster").json()
    assert info["mode"] == "single"
    (inst,) = info["instances"]
    assert inst["role"] == "colocated" and inst["kv_blocks_total"] == 128
    for key in ("id", "pid", "host", "state", "kv_blocks_used", "queued", "running"):
        assert key in inst


# ---- completions ------------------------------------------------------------------------------
def test_completion_greedy_matches_llm_generate(oai: openai.OpenAI, llm: LLM) -> None:
    prompt = "The capital of France is"
    ref = reference(llm, prompt, 8)
    assert ref.text and len(ref.token_ids) == 8
    resp = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(llm.get_tokenizer().encode(prompt))
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    stream = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompts_and_batches(oai: openai.OpenAI, llm: LLM) -> None:
    ids_a = [0, 17, 250, 1000, 42]
    ids_b = [0, 5, 6, 7]
    refs = [reference(llm, ids, 5) for ids in (ids_a, ids_b)]
    resp = oai.completions.create(model=MODEL, prompt=[ids_a, ids_b], max_tokens=5, temperature=0)
    by_index = sorted(resp.choices, key=lambda c: c.index)
    assert [c.text for c in by_index] == [r.text for r in refs]
    assert resp.usage.prompt_tokens == len(ids_a) + len(ids_b)
    assert resp.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    single = oai.completions.create(model=MODEL, prompt=ids_a, max_tokens=5, temperature=0)
    assert single.choices[0].text == refs[0].text
    texts = ["", ""]
    finishes: list[str | None] = [None, None]
    for chunk in oai.completions.create(model=MODEL, prompt=[ids_a, ids_b], max_tokens=5, temperature=0,
                                        stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [r.text for r in refs]
    assert finishes == [r.finish_reason for r in refs]


def test_ignore_eos_min_tokens_and_continuous_usage(server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 7, "min_tokens": 7, "ignore_eos": True,
            "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    data = [json.loads(e) for e in events[:-1]]
    counts = [d["usage"]["completion_tokens"] for d in data]
    assert counts == sorted(counts) and counts[-1] == 7
    assert data[-1]["choices"] == []
    assert data[-2]["choices"][0]["finish_reason"] == "length"
    # One chunk per generated token: the benchmark client times tokens from these.
    assert len([d for d in data if d["choices"]]) == 7


def test_stop_strings(oai: openai.OpenAI, llm: LLM) -> None:
    prompt = "Once upon a time"
    full = reference(llm, prompt, 12).text
    words = full.split(" ")
    assert len(words) >= 4, f"need a longer reference text, got {full!r}"
    stop = words[2][:3] if len(words[2]) >= 3 else words[2] + " " + words[3][:1]
    cut = full.index(stop)
    resp = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert resp.choices[0].text == full[:cut]
    assert resp.choices[0].finish_reason == "stop"
    stream = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                    stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 12


# ---- chat -------------------------------------------------------------------------------------
def test_chat_greedy_matches_llm_generate(oai: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id  # the template writes BOS; it must not be doubled
    ref = reference(llm, ids, 6)
    assert ref.text.strip()
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref.token_ids)

    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        ref.finish_reason
    ]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == len(ids) + len(ref.token_ids)


# ---- load and aborts --------------------------------------------------------------------------
def test_concurrent_streams_complete_and_free_blocks(server: ServerThread) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request number {i} says", max_tokens=6, temperature=0.7, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, finish, used = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                used = chunk.usage.completion_tokens
        return text, finish, used

    async def main() -> list[tuple[str, str | None, int]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(16)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 16
    assert all(finish == "length" and used == 6 for _, finish, used in results), results
    wait_idle(server)


def test_client_disconnect_aborts_request(server: ServerThread) -> None:
    before = httpx.get(server.url + "/cluster").json()["instances"][0]["requests_finished"].get("abort", 0)
    body = {"model": MODEL, "prompt": "A very long story:", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 2:
                break
    inst = wait_idle(server)
    elapsed = time.monotonic() - t0
    assert inst["requests_finished"].get("abort", 0) == before + 1
    metrics = httpx.get(server.url + "/metrics").text
    assert 'tetriinfer_requests_finished_total{finish_reason="abort"}' in metrics
    assert elapsed < 20


def test_metrics_after_traffic(server: ServerThread, oai: openai.OpenAI) -> None:
    oai.completions.create(model=MODEL, prompt="metrics please", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text

    def value(prefix: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
        assert lines, f"{prefix} missing from /metrics"
        return float(lines[0].rsplit(" ", 1)[1])

    assert value("tetriinfer_time_to_first_token_seconds_count") >= 1
    assert value("tetriinfer_time_per_output_token_seconds_count") >= 1
    assert value("tetriinfer_e2e_request_latency_seconds_count") >= 1
    assert value('tetriinfer_requests_finished_total{finish_reason="length"}') >= 1
    assert value('tetriinfer_instance_kv_blocks_total{instance="engine-0",role="colocated"}') == 128
    assert value('tetriinfer_instance_kv_blocks_used{instance="engine-0",role="colocated"}') == 0
    assert "tetriinfer_kv_transfer_seconds_bucket" in text


# ---- errors -----------------------------------------------------------------------------------
def assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    return err


def test_error_shapes_and_codes(server: ServerThread, oai: openai.OpenAI) -> None:
    url = server.url + "/v1/completions"
    bad_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert "JSON" in assert_openai_error(bad_json, 400)["message"]
    assert_openai_error(httpx.post(url, json={"model": MODEL}), 400)  # missing prompt
    err = assert_openai_error(httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 0}), 400)
    assert "max_tokens" in err["message"]
    assert_openai_error(httpx.post(url, json={"model": MODEL, "prompt": "x", "n": 2}), 400)
    assert_openai_error(httpx.post(url, json={"model": MODEL, "prompt": "x", "echo": True}), 400)
    assert_openai_error(httpx.post(url, json={"model": MODEL, "prompt": [99999]}), 400)  # outside vocab
    # One bad prompt in a batch refuses the whole batch; the good one must not linger in the engine.
    assert_openai_error(httpx.post(url, json={"model": MODEL, "prompt": [[0, 5, 6], [99999]],
                                              "max_tokens": 50, "stream": True}), 400)
    assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}),
                        400)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert exc.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(model=MODEL, prompt="word " * 400, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(model=MODEL, prompt="short", max_tokens=300)
    with pytest.raises(openai.NotFoundError) as nf:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert nf.value.status_code == 404
    assert_openai_error(httpx.get(server.url + "/v1/nope"), 404)
    wait_idle(server)


def test_api_key(engine_client: InProcessEngineClient, server: ServerThread) -> None:
    app = build_app(engine_client, served_model_name=MODEL, api_key="sekret", manage_client=False)
    with ServerThread(app) as secured:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.post(secured.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                           headers=headers)
            assert_openai_error(r, 401)
            assert_openai_error(httpx.get(secured.url + "/v1/models", headers=headers), 401)
        assert httpx.get(secured.url + "/health").status_code == 200
        bad = openai.OpenAI(base_url=secured.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=secured.url + "/v1", api_key="sekret", max_retries=0)
        out = good.completions.create(model=MODEL, prompt="hello", max_tokens=2, temperature=0)
        assert out.usage.completion_tokens == 2


# ---- engine failures (fake client: the HTTP layer's handling of an error event) ----------------
class FailingClient:
    """EngineClient whose requests emit one token and then fail."""

    model_name = MODEL
    max_model_len = 64
    eos_token_id = None

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @property
    def tokenizer(self) -> Any:
        return self._tok

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenEvent]:
        yield TokenEvent(request_id, (300,), num_prompt_tokens=len(prompt_token_ids))
        yield TokenEvent(request_id, (), finished=True, finish_reason="error", error="KV transfer failed: boom")

    async def abort(self, request_id: str) -> None: ...

    def cluster_info(self) -> dict[str, Any]:
        return {"mode": "fake", "instances": [], "flips": []}

    def is_healthy(self) -> bool:
        return False


def test_engine_failure_is_500_or_error_event(llm: LLM) -> None:
    app = build_app(FailingClient(llm.get_tokenizer()), served_model_name=MODEL)
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert "boom" in assert_openai_error(r, 500)["message"]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as resp:
            events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == 500 and "boom" in err["message"]
        assert httpx.get(srv.url + "/health").status_code == 503


# ---- the in-process client on its own -----------------------------------------------------------
def test_inprocess_client_events_and_shutdown(model_dir: Path) -> None:
    async def main() -> None:
        client = InProcessEngineClient(EngineConfig(model=str(model_dir), **ENGINE_KW))
        params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
        with pytest.raises(RuntimeError, match="not running"):
            await anext(client.generate("early", [0, 5], params))
        await client.start()
        events = [e async for e in client.generate("a", [0, 5, 6], params)]
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
        assert sum(len(e.token_ids) for e in events) == 5
        assert events[-1].finish_reason == "length" and events[-1].num_prompt_tokens == 3
        with pytest.raises(ValueError, match="context"):
            await anext(client.generate("long", [5] * 300, params))

        long = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
        gen_b = client.generate("b", [0, 5], long)
        first = await anext(gen_b)
        assert not first.finished
        with pytest.raises(ValueError, match="duplicate"):
            await anext(client.generate("b", [0, 5], long))
        await client.shutdown()
        rest = [e async for e in gen_b]
        assert len([e for e in rest if e.finished]) == 1 and rest[-1].finish_reason == "abort"
        inst = client.cluster_info()["instances"][0]
        assert inst["state"] == "stopped" and inst["kv_blocks_used"] == 0 and inst["running"] == 0
        assert not client.is_healthy()

    asyncio.run(main())


def test_chat_fallback_template_without_tokenizer_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from tetriinfer.server.app import _Server
    from tetriinfer.server.metrics import ServerMetrics
    from tetriinfer.server.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    tok.chat_template = None
    srv = _Server(FailingClient(tok), MODEL, ServerMetrics())
    req = ChatCompletionRequest(messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    ids = srv.chat_prompt_ids(req)
    assert tok.decode(ids) == "<|bos|>system: Be brief.\nuser: hi\nassistant:"


def test_metrics_expose_pool_size_scaling_events_and_migrations() -> None:
    from tetriinfer.server.metrics import ServerMetrics

    m = ServerMetrics()
    info = {"instances": [{"id": "prefill-0", "role": "prefill", "state": "running", "queued": 3},
                          {"id": "decode-1", "role": "decode", "state": "running"}],
            "scaling": [{"action": "autoscale-add"}, {"action": "autoscale-add"}, {"action": "autoscale-remove"}],
            "rebalance": {"moves": 2, "migrated": 7, "pending": []}}
    m.update_cluster(info)
    text = m.render()[0].decode()
    assert 'tetriinfer_scaling_events{action="autoscale-add"} 2.0' in text
    assert 'tetriinfer_scaling_events{action="autoscale-remove"} 1.0' in text
    assert 'tetriinfer_instances{role="decode"} 1.0' in text and 'tetriinfer_instances{role="prefill"} 1.0' in text
    assert "tetriinfer_requests_migrated 7.0" in text
    m.update_cluster({"instances": [info["instances"][1]], "scaling": [], "rebalance": {"migrated": 7}})
    text = m.render()[0].decode()
    assert 'tetriinfer_instances{role="prefill"}' not in text and "tetriinfer_scaling_events{" not in text
