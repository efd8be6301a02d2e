"""Elastic membership on a real server: add and remove instances while serving, and replace dead ones.

Every request sent during the changes must complete with its exact length (scale-in drains, it never drops);
the membership each instance sees follows (/cluster, and dispatches reach an added decode instance).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import ServeProcess, pid_alive


def _model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def _complete(base_url: str, model: str, i: int, max_tokens: int,
              prompt: Callable[[int], str] | None = None) -> tuple[int, int]:
    text = prompt(i) if prompt is not None else "scale me " * (4 + 9 * (i % 5))
    body = {"model": model, "prompt": text, "max_tokens": max_tokens,
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
    """--autoscale on one colocated instance running at most 2 requests: sustained load (16 requests a second, about
    twice what it serves even on a quiet machine) queues, which adds a second instance;
    when the load stops, the pool shrinks back to one (drained); every request completes exactly."""
    srv = ServeProcess(tiny_llama, "--mode", "colocated", "--instances", "1", "--autoscale", "--autoscale-high",
                       "0.6", "--autoscale-low", "0.05", "--autoscale-window", "1", "--autoscale-cooldown", "1",
                       "--autoscale-max-instances", "2", "--max-num-seqs", "2")
    try:
        model = _model(srv.base_url)

        def actions() -> list[str]:
            return [e["action"] for e in srv.cluster()["scaling"]]

        results = []
        with ThreadPoolExecutor(max_workers=64) as pool:
            deadline = time.monotonic() + 240
            while "autoscale-add" not in actions() and time.monotonic() < deadline:
                results += [pool.submit(_complete, srv.base_url, model, i, 64) for i in range(16)]
                time.sleep(1.0)
            assert [f.result() for f in results] == [(200, 64)] * len(results)
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


REBALANCE_CASES = {  # tier -> serve args, donor, role to add, the id it gets, requests, tokens each, prompt
    "colocated": (["--mode", "colocated", "--instances", "1", "--max-num-seqs", "2"], "instance-0", "colocated",
                  "instance-1", 16, 256, None),  # long enough that the queue outlives the added instance's start
    "prefill": (["--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1", "--kv-backend", "tcp",
                 "--chunk-size", "64"], "prefill-0", "prefill", "prefill-1", 64, 8, "rebalance the prefill queue "),
}


@pytest.mark.parametrize("tier", list(REBALANCE_CASES))
def test_rebalance_moves_queued_requests_to_an_added_instance(tiny_llama: Path, tier: str) -> None:
    """--rebalance: requests queue on the tier's one instance (colocated: 2 running at most; prefill: 64 long
    prompts behind 64-token chunks), then an instance of the tier is added (from a warm spare). It was not there when they were routed, so
    only rebalancing can give it work: it takes unstarted requests from the backed-up one; every request
    completes with its exact length and every block is free after."""
    args, donor, role, added_id, n, tokens, words = REBALANCE_CASES[tier]
    # a warm spare: the added instance is up in well under a second, while the queue it should relieve exists
    srv = ServeProcess(tiny_llama, *args, "--rebalance", "--report-interval", "0.2", "--warm-spares", "1")
    try:
        model = _model(srv.base_url)
        prompt = (lambda i: words * (120 + i)) if words else None
        with ThreadPoolExecutor(max_workers=n) as pool:
            results = [pool.submit(_complete, srv.base_url, model, i, tokens, prompt) for i in range(n)]
            deadline = time.monotonic() + 60
            while _instances(srv)[donor]["queued"] < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            added = httpx.post(f"{srv.base_url}/cluster/instances", json={"role": role}, timeout=300)
            assert added.status_code == 200 and added.json()["instance"] == added_id, added.text
            assert [f.result() for f in results] == [(200, tokens)] * n
        cluster = srv.cluster()
        assert cluster["rebalance"]["migrated"] >= 1 and cluster["rebalance"]["moves"] >= 1, cluster["rebalance"]
        info = _instances(srv)
        assert info[added_id]["steps"] > 0, "the added instance never got a request"
        assert cluster["requests_in_flight"] == 0
        deadline = time.monotonic() + 10  # the next load reports show every block free again
        while any(i["kv_blocks_used"] for i in info.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            info = _instances(srv)
        assert all(i["kv_blocks_used"] == 0 and i["queued"] == 0 for i in info.values()), info
        assert _complete(srv.base_url, model, 1, 5) == (200, 5)
    finally:
        srv.stop()


def test_warm_spare_starts_the_added_instance_and_is_replaced(tiny_llama: Path) -> None:
    """--warm-spares 1: a pre-started process (modules imported, waiting for its spec) becomes the added instance
    (the scaling entry says warm), serves, and a new spare takes its place; stopping the server leaves no spare
    behind."""
    srv = ServeProcess(tiny_llama, "--mode", "colocated", "--instances", "1", "--warm-spares", "1")
    try:
        model = _model(srv.base_url)
        first = srv.cluster()["warm_spares"]
        assert len(first["pids"]) == 1 and first["used"] == 0 and pid_alive(first["pids"][0])
        time.sleep(4.0)  # let the spare finish its imports (it would be used either way)
        r = httpx.post(f"{srv.base_url}/cluster/instances", json={"role": "colocated"}, timeout=300)
        assert r.status_code == 200 and r.json()["warm"] is True, r.text
        info = _instances(srv)
        assert info["instance-1"]["pid"] == first["pids"][0]  # the spare became instance-1
        with ThreadPoolExecutor(max_workers=6) as pool:
            assert [f.result() for f in [pool.submit(_complete, srv.base_url, model, i, 12)
                                         for i in range(12)]] == [(200, 12)] * 12
        assert _instances(srv)["instance-1"]["steps"] > 0
        now = srv.cluster()["warm_spares"]
        assert now["used"] == 1 and len(now["pids"]) == 1 and now["pids"] != first["pids"]
        spare = now["pids"][0]
        assert pid_alive(spare)
    finally:
        srv.stop()
    deadline = time.monotonic() + 10
    while pid_alive(spare) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(spare), "a warm spare outlived the server"


def test_an_instance_that_dies_while_draining_has_its_requests_recovered(tiny_llama: Path) -> None:
    """A crash during a drain (no --migrate: decode-0 drains by finishing its decodes) must not lose its requests:
    they are prefilled again on the survivors and complete, and the removal reports the instance as dead."""
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "2",
                       "--kv-backend", "tcp")
    try:
        model = _model(srv.base_url)
        with ThreadPoolExecutor(max_workers=9) as pool:
            futures = [pool.submit(_complete, srv.base_url, model, i, 400) for i in range(8)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _instances(srv)["decode-0"]["running"] < 2:
                time.sleep(0.05)
            victim = _instances(srv)["decode-0"]["pid"]
            removal = pool.submit(httpx.delete, f"{srv.base_url}/cluster/instances/decode-0", timeout=300)
            while time.monotonic() < deadline and not _instances(srv)["decode-0"]["retiring"]:
                time.sleep(0.02)
            assert _instances(srv)["decode-0"]["membership"] == "draining"
            os.kill(victim, signal.SIGKILL)
            gone = removal.result()
            results = [f.result() for f in futures]
        assert gone.status_code == 200 and gone.json()["was_dead"] is True, gone.text
        assert results == [(200, 400)] * 8, results
        assert srv.cluster()["recovered"] >= 2
        assert set(_instances(srv)) == {"prefill-0", "decode-1"}
        assert _complete(srv.base_url, model, 3, 16) == (200, 16)  # still serving
        assert srv.cluster()["requests_in_flight"] == 0
    finally:
        srv.stop()
