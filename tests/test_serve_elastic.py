"""Elastic membership on a real server: add and remove instances while serving, and replace dead ones.

Every request sent during the changes must complete with its exact length (scale-in drains, it never drops);
the membership each instance sees follows (/cluster, and dispatches reach an added decode instance).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import ServeProcess, pid_alive


def _model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def _complete(base_url: str, model: str, i: int, max_tokens: int) -> tuple[int, int]:
    body = {"model": model, "prompt": "scale me " * (4 + 9 * (i % 5)), "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=180)
    return r.status_code, (r.json()["usage"]["completion_tokens"] if r.status_code == 200 else -1)


def _instances(server: ServeProcess) -> dict[str, dict]:
    return {i["id"]: i for i in server.cluster()["instances"]}


@pytest.fixture
def disagg_server(tiny_llama: Path):
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1",
                       "--kv-backend", "tcp")
    yield srv
    srv.stop()


def test_scale_out_then_in_while_serving_loses_nothing(disagg_server: ServeProcess) -> None:
    srv = disagg_server
    model = _model(srv.base_url)
    with ThreadPoolExecutor(max_workers=8) as pool:
        first = [pool.submit(_complete, srv.base_url, model, i, 40 + i) for i in range(8)]
        added = httpx.post(f"{srv.base_url}/cluster/instances", json={"role": "decode"}, timeout=300)
        assert added.status_code == 200, added.text
        entry = added.json()
        assert entry["action"] == "add" and entry["role"] == "decode" and entry["instance"] == "decode-1"
        assert entry["startup_s"] > 0
        # enough concurrent work after the addition that the dispatcher uses the new instance
        second = [pool.submit(_complete, srv.base_url, model, i, 30) for i in range(16)]
        assert [f.result() for f in first] == [(200, 40 + i) for i in range(8)]
        assert [f.result() for f in second] == [(200, 30)] * 16
        info = _instances(srv)
        assert set(info) == {"prefill-0", "decode-0", "decode-1"}
        assert info["decode-1"]["steps"] > 0, "the added decode instance never received a dispatch"

        old_pid = info["decode-0"]["pid"]
        third = [pool.submit(_complete, srv.base_url, model, i, 60) for i in range(6)]
        time.sleep(0.5)  # some of them are decoding on decode-0 now
        removed = httpx.delete(f"{srv.base_url}/cluster/instances/decode-0", timeout=300)
        assert removed.status_code == 200, removed.text
        gone = removed.json()
        assert gone["action"] == "remove" and gone["was_dead"] is False and gone["drain_s"] is not None
        assert [f.result() for f in third] == [(200, 60)] * 6  # drained, not dropped
    info = _instances(srv)
    assert set(info) == {"prefill-0", "decode-1"}
    assert not pid_alive(old_pid)
    assert _complete(srv.base_url, model, 0, 12) == (200, 12)  # still serving on what is left
    events = [e["action"] for e in srv.cluster()["scaling"]]
    assert events == ["add", "remove"]


def test_membership_changes_are_validated(disagg_server: ServeProcess) -> None:
    srv = disagg_server
    r = httpx.delete(f"{srv.base_url}/cluster/instances/decode-0", timeout=60)
    assert r.status_code == 409 and "last live decode instance" in r.text
    r = httpx.delete(f"{srv.base_url}/cluster/instances/prefill-0", timeout=60)
    assert r.status_code == 409 and "last live prefill instance" in r.text
    assert httpx.delete(f"{srv.base_url}/cluster/instances/decode-7", timeout=60).status_code == 404
    r = httpx.post(f"{srv.base_url}/cluster/instances", json={"role": "colocated"}, timeout=60)
    assert r.status_code == 400 and "prefill and decode" in r.text
    assert httpx.post(f"{srv.base_url}/cluster/instances", json={}, timeout=60).status_code == 400
    assert set(_instances(srv)) == {"prefill-0", "decode-0"}  # nothing changed
    assert _complete(srv.base_url, _model(srv.base_url), 1, 8) == (200, 8)


def test_a_dead_instance_is_replaced(tiny_llama: Path) -> None:
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1",
                       "--kv-backend", "tcp", "--replace-dead")
    try:
        model = _model(srv.base_url)
        victim = _instances(srv)["decode-0"]["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            info = _instances(srv)
            if "decode-1" in info and info["decode-1"]["state"] == "active":
                break
            time.sleep(0.3)
        info = _instances(srv)
        assert set(info) == {"prefill-0", "decode-1"}, info
        actions = [(e["action"], e.get("instance")) for e in srv.cluster()["scaling"]]
        assert actions == [("died", "decode-0"), ("replace", "decode-1")]
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200
        assert _complete(srv.base_url, model, 2, 20) == (200, 20)
    finally:
        srv.stop()


def test_colocated_scale_out_and_in(tiny_llama: Path) -> None:
    srv = ServeProcess(tiny_llama, "--mode", "colocated", "--instances", "1")
    try:
        model = _model(srv.base_url)
        r = httpx.post(f"{srv.base_url}/cluster/instances", json={"role": "colocated"}, timeout=300)
        assert r.status_code == 200 and r.json()["instance"] == "instance-1"
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = [pool.submit(_complete, srv.base_url, model, i, 25) for i in range(12)]
            assert [f.result() for f in results] == [(200, 25)] * 12
        info = _instances(srv)
        assert info["instance-1"]["steps"] > 0 and info["instance-0"]["steps"] > 0
        r = httpx.delete(f"{srv.base_url}/cluster/instances/instance-0", timeout=300)
        assert r.status_code == 200
        assert set(_instances(srv)) == {"instance-1"}
        assert _complete(srv.base_url, model, 3, 9) == (200, 9)
    finally:
        srv.stop()


def test_autoscale_adds_under_load_and_removes_when_idle(tiny_llama: Path) -> None:
    """--autoscale on one colocated instance running at most 4 requests: sustained load (12 requests a second)
    queues, which adds a second instance;
    when the load stops, the pool shrinks back to one (drained); every request completes exactly."""
    srv = ServeProcess(tiny_llama, "--mode", "colocated", "--instances", "1", "--autoscale", "--autoscale-high",
                       "0.6", "--autoscale-low", "0.05", "--autoscale-window", "1", "--autoscale-cooldown", "1",
                       "--autoscale-max-instances", "2", "--max-num-seqs", "4")
    try:
        model = _model(srv.base_url)

        def actions() -> list[str]:
            return [e["action"] for e in srv.cluster()["scaling"]]

        results = []
        with ThreadPoolExecutor(max_workers=12) as pool:
            deadline = time.monotonic() + 240
            while "autoscale-add" not in actions() and time.monotonic() < deadline:
                results += [pool.submit(_complete, srv.base_url, model, i, 48) for i in range(12)]
                time.sleep(1.0)
            assert [f.result() for f in results] == [(200, 48)] * len(results)
        assert "autoscale-add" in actions(), srv.cluster()["scaling"]
        assert set(_instances(srv)) == {"instance-0", "instance-1"}
        deadline = time.monotonic() + 120
        while "autoscale-remove" not in actions() and time.monotonic() < deadline:
            time.sleep(0.5)
        scaling = srv.cluster()["scaling"]
        assert [e["action"] for e in scaling] == ["autoscale-add", "autoscale-remove"], scaling
        assert scaling[0]["mean_load"] >= 0.6 and scaling[1]["mean_load"] <= 0.05
        assert len(_instances(srv)) == 1
        assert _complete(srv.base_url, model, 5, 10) == (200, 10)
    finally:
        srv.stop()
