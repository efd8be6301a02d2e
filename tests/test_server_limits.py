"""Request limits, chat validation and overload refusal of the HTTP server (tiny model, in-process engine)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.test_server_api import ENGINE_KW, ServerThread
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.runtime.inprocess import InProcessEngineClient
from tetriinfer.server.app import build_app
from tetriinfer.server.limits import Admission, ServerLimits

MODEL = "tiny-limits"
LIMITS = ServerLimits(max_prompts_per_request=4, max_prompt_tokens_per_request=200, max_tokens_default=5,
                      max_tokens_limit=50, max_pending_requests=2, max_pending_tokens=100_000)


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[tuple[ServerThread, object]]:
    client = InProcessEngineClient(EngineConfig(model=str(tiny_llama), **ENGINE_KW), model_name=MODEL)
    app = build_app(client, served_model_name=MODEL, limits=LIMITS)
    with ServerThread(app) as srv:
        yield srv, app


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_huge_prompt_list_is_400_before_any_work(served) -> None:
    srv, app = served
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ["x"] * 100_000, "max_tokens": 1}, timeout=60)
    err = _error(r, 400)
    assert "too many prompts" in err["message"] and err["param"] == "prompt"
    assert app.state.admission.held_requests == 0 and app.state.metrics is not None
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    many_ids = [[1, 2, 3]] * 5  # token-id prompts count too
    assert "too many prompts" in _error(httpx.post(f"{srv.url}/v1/completions",
                                                   json={"prompt": many_ids}, timeout=60), 400)["message"]
    long_ids = [[5] * 120, [6] * 120]  # 240 prompt tokens in one request > 200
    err = _error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": long_ids}, timeout=60), 400)
    assert "too many prompt tokens" in err["message"]
    for field, value in (("n", 100_000), ("best_of", 100_000)):
        _error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", field: value}, timeout=60), 400)
    err = _error(httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 51}, timeout=60), 400)
    assert err["param"] == "max_tokens"
    ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [[1, 2], [3, 4]], "max_tokens": 2,
                                                       "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


@pytest.mark.parametrize("message", [
    {"role": "user"},
    {"role": "user", "content": None},
    {"role": "system", "content": 5},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
    {"role": "tool", "content": "x"},
    {"role": "user", "content": [{"type": "text"}]},
])
def test_chat_message_without_valid_content_is_400(served, message: dict) -> None:
    srv, _ = served
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [message]}, timeout=60)
    assert "messages" in _error(r, 400)["message"]


def test_max_tokens_default_caps_chat(served) -> None:
    srv, _ = served
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}], "ignore_eos": True}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LIMITS.max_tokens_default
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_overload_is_429_with_retry_after_then_recovers(served) -> None:
    srv, app = served
    admission: Admission = app.state.admission
    body = {"prompt": "keep going", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", f"{srv.url}/v1/completions", json=body) as s1:
            next(s1.iter_lines())  # a stream closed early (client disconnect) releases its ticket too
        deadline = time.monotonic() + 30
        while admission.held_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert admission.held_requests == 0 and admission.held_tokens == 0
        assert admission.try_admit(LIMITS.max_pending_requests, 0)  # the bound is reached (held elsewhere)
        r = c.post(f"{srv.url}/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        err = _error(r, 429)
        assert err["type"] == "RateLimitError" and r.headers["Retry-After"] == "1"
        _error(c.post(f"{srv.url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}), 429)
        admission.release(LIMITS.max_pending_requests, 0)
        ok = c.post(f"{srv.url}/v1/completions", json={"prompt": "after", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
    assert admission.held_requests == 0 and admission.held_tokens == 0 and admission.num_refused == 2


def test_admission_bounds_tokens_and_never_starves_a_lone_request() -> None:
    a = Admission(max_requests=10, max_tokens=100)
    assert a.try_admit(1, 500)  # idle: a single request that passed the per-request limits always gets in
    assert not a.try_admit(1, 1)
    a.release(1, 500)
    assert a.try_admit(3, 60) and not a.try_admit(1, 41) and a.try_admit(1, 40)
    a.release(3, 60)
    a.release(1, 40)
    assert (a.held_requests, a.held_tokens, a.num_refused) == (0, 0, 2)
    with pytest.raises(ValueError, match="max_pending_requests"):
        ServerLimits(max_pending_requests=0)
