"""Live migration of running decodes on a real server (--migrate): a decode instance being removed hands its
running requests to its peer with their KV, and an overloaded one sheds some to an idle peer.

What a client gets must not change: every request completes with its exact length and the same tokens it gets
without any migration (greedy, and seeded sampling: the sampler's state moves with the request).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import ServeProcess

MAX_TOKENS = 160


def _body(model: str, i: int, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": model, "prompt": "move me along " * (3 + 4 * (i % 4)), "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}
    if i % 3 == 2:  # seeded sampling: its generator state must travel with it
        body.update(temperature=1.0, top_p=0.9, seed=100 + i)
    return body


def _complete(base_url: str, body: dict) -> tuple[int, int, str]:
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        return r.status_code, -1, r.text
    return 200, r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["text"]


def _wait_decoding(srv: ServeProcess, instance: str, at_least: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = {i["id"]: i for i in srv.cluster()["instances"]}
        if info[instance]["running"] >= at_least:
            return
        time.sleep(0.05)
    raise AssertionError(f"{instance} never ran {at_least} requests at once")


def _assert_blocks_freed(srv: ServeProcess) -> dict:
    """Every instance reports no KV block in use within a few report intervals; returns the last /cluster."""
    deadline = time.monotonic() + 20
    info = srv.cluster()
    while time.monotonic() < deadline and any(i["kv_blocks_used"] for i in info["instances"]):
        time.sleep(0.3)
        info = srv.cluster()
    assert all(i["kv_blocks_used"] == 0 for i in info["instances"]), info
    return info


SCALE_IN = {  # serve arguments, the instance removed, the instances left
    "disaggregated": (["--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "2"], "decode-0",
                      {"prefill-0", "decode-1"}),
    "colocated": (["--mode", "colocated", "--instances", "2"], "instance-1", {"instance-0"}),
}


@pytest.mark.parametrize("layout", list(SCALE_IN))
def test_removing_an_instance_migrates_its_running_requests(tiny_llama: Path, layout: str) -> None:
    args, victim, left = SCALE_IN[layout]
    srv = ServeProcess(tiny_llama, *args, "--kv-backend", "tcp", "--migrate")
    try:
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        bodies = [_body(model, i) for i in range(8)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(_complete, srv.base_url, b) for b in bodies]
            _wait_decoding(srv, victim, 2)
            removed = httpx.delete(f"{srv.base_url}/cluster/instances/{victim}", timeout=300)
            assert removed.status_code == 200, removed.text
            results = [f.result() for f in futures]
        assert [(c, n) for c, n, _ in results] == [(200, MAX_TOKENS)] * 8, results
        mig = srv.cluster()["migration"]
        assert mig["moved_by_reason"].get("evacuate", 0) >= 2 and mig["bytes"] > 0, mig
        assert {i["id"] for i in srv.cluster()["instances"]} == left
        # the same requests again, nothing migrates now (one instance decodes): the same tokens
        with ThreadPoolExecutor(max_workers=8) as pool:
            again = list(pool.map(lambda b: _complete(srv.base_url, b), bodies))
        assert [t for _, _, t in again] == [t for _, _, t in results]
        assert srv.cluster()["migration"]["moved"] == mig["moved"]
        _assert_blocks_freed(srv)
    finally:
        srv.stop()


@pytest.mark.parametrize("kv_backend", ["tcp", "shm", "torchdist"])
def test_an_overloaded_decode_instance_sheds_running_requests_to_an_idle_peer(tiny_llama: Path,
                                                                              kv_backend: str) -> None:
    # `imbalanced` dispatch without a predictor sends every (light) decode to decode-1: only migration helps
    # decode-0; every KV backend carries decode -> decode transfers as it carries prefill -> decode ones
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "2",
                       "--kv-backend", kv_backend, "--dispatch-policy", "imbalanced", "--migrate",
                       "--migrate-signal", "running", "--migrate-min-gap", "2")
    try:
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        # a planned move reads load reports a moment old: on a loaded host its requests can have ended by the
        # time the source is asked (a move that carries nothing). Waves of requests until one has moved, each
        # wave held to the same promises
        for wave in range(3):
            bodies = [_body(model, i, 240) for i in range(8 * wave, 8 * wave + 8)]
            with ThreadPoolExecutor(max_workers=8) as pool:
                results = list(pool.map(lambda b: _complete(srv.base_url, b), bodies))
            assert [(c, n) for c, n, _ in results] == [(200, 240)] * 8, results
            cluster = srv.cluster()
            mig = cluster["migration"]
            if mig["moved_by_reason"].get("balance", 0) >= 1:
                break
        assert mig["moved_by_reason"].get("balance", 0) >= 1, mig
        steps = {i["id"]: i["steps"] for i in cluster["instances"]}
        assert steps["decode-0"] > 0, steps
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=10).text
        assert 'tetriinfer_requests_live_migrated{reason="balance"}' in metrics
        assert mig["pending"] == [] and cluster["requests_in_flight"] == 0
    finally:
        srv.stop()


def test_migrations_over_a_faulty_link_lose_nothing_and_free_every_block(tiny_llama: Path) -> None:
    # failed or corrupted migrant transfers are retried by the target, then the request goes back into its
    # source's batch; prefill -> decode transfers fail too (re-dispatched, or a clean error after the last try)
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "2",
                       "--dispatch-policy", "imbalanced", "--migrate", "--migrate-signal", "running",
                       "--migrate-min-gap", "2", "--kv-backend", "faulty:tcp", "--fault-drop-p", "0.3",
                       "--fault-corrupt-p", "0.2", "--transfer-timeout", "1.0")
    try:
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        # a planned move can find its requests already ended (nothing to carry): send waves of requests until
        # at least one migrant has crossed the faulty link or come back, every wave held to the same promises
        for wave in range(3):
            with ThreadPoolExecutor(max_workers=12) as pool:
                results = list(pool.map(lambda i: _complete(srv.base_url, _body(model, i, 200)),
                                        range(12 * wave, 12 * wave + 12)))
            completed = [n for code, n, _ in results if code == 200]
            failed = [text for code, _, text in results if code != 200]
            assert completed and all(n == 200 for n in completed), results
            assert all("KV transfer failed" in text for text in failed), failed
            info = _assert_blocks_freed(srv)
            mig = info["migration"]
            assert mig["pending"] == [], mig
            if mig["moved"] + mig["returned"] >= 1:
                break
        assert mig["moves"] >= 1 and mig["moved"] + mig["returned"] >= 1, mig
        assert info["transfers"]["failed"] > 0 and info["requests_in_flight"] == 0
    finally:
        srv.stop()


def test_a_decode_instance_flipping_to_prefill_hands_its_running_decodes_over(tiny_llama: Path) -> None:
    # decode load by KV usage (low while a few requests decode), prefill load by busy time: heavy prompts keep the
    # prefill instance busy, so an idle-looking decode instance flips to prefill -- with its decodes migrated
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "2",
                       "--kv-backend", "tcp", "--chunk-size", "64", "--flip", "--flip-window", "0.5",
                       "--flip-threshold", "0.2", "--flip-decode-load", "kv", "--migrate")
    try:
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        long_bodies = [_body(model, 4 * i, 600) for i in range(4)]  # greedy
        heavy = [{"model": model, "prompt": f"prefill heavy {i} " + "word " * 500, "max_tokens": 2,
                  "ignore_eos": True, "temperature": 0.0} for i in range(40)]
        with ThreadPoolExecutor(max_workers=44) as pool:
            longs = [pool.submit(_complete, srv.base_url, b) for b in long_bodies]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and sum(
                    i["running"] for i in srv.cluster()["instances"] if i["role"] == "decode") < 4:
                time.sleep(0.05)
            shorts = [pool.submit(_complete, srv.base_url, b) for b in heavy]
            assert [f.result()[:2] for f in longs] == [(200, 600)] * 4
            assert [f.result()[:2] for f in shorts] == [(200, 2)] * 40
        info = srv.cluster()
        flips = [f for f in info["flips"] if f["from"] == "decode" and f["to"] == "prefill"]
        assert flips, info["flips"]
        assert info["migration"]["moved_by_reason"].get("evacuate", 0) >= 1, info["migration"]
        _assert_blocks_freed(srv)
    finally:
        srv.stop()
