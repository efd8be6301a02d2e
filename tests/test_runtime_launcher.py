"""Launchers: instance processes on this machine or on a Ray cluster (runtime.launcher).

The Ray tests start a private single-node Ray (``--ray-address local``, on loopback) inside the server process;
``test_two_node_ray_cluster`` runs a real two-node Ray cluster in two network namespaces when this machine lets
us make them (root + iproute2), with the prefill and decode instances on different nodes and the KV cache crossing
the veth link over our TCP transfer.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import ServeProcess, pid_alive
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.runtime.launcher import LOOPBACK, LocalLauncher, make_launcher

ROOT = Path(__file__).resolve().parents[1]


def test_local_launcher_places_every_instance_on_loopback_with_its_own_core_index() -> None:
    slots = LocalLauncher().place(3)
    assert [s.index for s in slots] == [0, 1, 2]
    assert [s.local_index for s in slots] == [0, 1, 2]
    assert {s.host for s in slots} == {LOOPBACK} and len({s.node for s in slots}) == 1


def test_launcher_and_backend_choices_are_validated() -> None:
    with pytest.raises(ValueError, match="launcher must be one of"):
        make_launcher("slurm")
    with pytest.raises(ValueError, match="launcher must be local or ray"):
        ClusterConfig(model="m", launcher="k8s")
    for backend in ("torchdist", "inproc", "faulty:torchdist"):
        with pytest.raises(ValueError, match="cannot cross hosts"):
            ClusterConfig(model="m", launcher="ray", kv_backend=backend)
    with pytest.raises(ValueError, match="startup_timeout_s"):
        ClusterConfig(model="m", startup_timeout_s=0)
    ClusterConfig(model="m", launcher="ray", kv_backend="tcp")  # fine
    with pytest.raises(ValueError, match="warm_spares"):
        ClusterConfig(model="m", warm_spares=-1)


def test_local_launcher_spares_wait_for_a_spec_and_exit_on_close() -> None:
    """A spare is only handed an instance spec (other commands start fresh processes); closing the launcher ends
    the idle spares; one that reads EOF instead of a spec exits 0 without starting anything."""
    launcher = LocalLauncher(warm_spares=2)
    env = {"HF_HUB_OFFLINE": "1"}
    launcher.prime(env)
    spares = launcher.spare_pids
    assert len(spares) == 2 and all(pid_alive(p) for p in spares)
    other = launcher.start(launcher.place(1)[0], ["-c", "pass"], env)  # not an instance: no spare used
    assert other.wait(timeout=30) == 0 and launcher.spares_used == 0 and launcher.spare_pids == spares
    procs = list(launcher._spares)
    launcher.close()
    assert all(p.poll() is not None for p in procs) and launcher.spare_pids == []
    eof = subprocess.run([sys.executable, "-m", "tetriinfer.runtime.instance", "--spare"], input=b"", timeout=120)
    assert eof.returncode == 0


def _ray_processes(marker: str) -> list[int]:
    """pids of processes whose command line mentions `marker` (a Ray temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes() and pid_alive(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _short_tmp() -> str:
    return tempfile.mkdtemp(prefix="tiray-", dir="/tmp")


@contextlib.contextmanager
def _ray_tmpdir(path: str) -> Iterator[None]:
    """RAY_TMPDIR set to ``path`` while a server (and its private Ray) starts, then as it was."""
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before


def _complete(base_url: str, max_tokens: int, stream: bool = False) -> dict:
    model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": "the quick brown fox " * 20, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": stream}
    if not stream:
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        return {"status": r.status_code, **r.json()}
    body["stream_options"] = {"include_usage": True}
    usage, reasons = None, []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                usage = chunk.get("usage") or usage
                reasons += [c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")]
    return {"status": r.status_code, "completion_tokens": usage and usage["completion_tokens"], "finish": reasons}


def test_serve_on_ray_answers_reports_placement_and_cleans_up(tiny_llama: Path, tmp_path: Path) -> None:
    """A disaggregated 1P+1D server whose instances are Ray actors' processes: requests complete with their exact
    lengths (KV crosses from the prefill to the decode instance), /cluster shows where each runs, scaling out past
    Ray's free CPUs fails cleanly (503, nothing changed, still serving), a killed
    instance is seen as dead (/health and /cluster say so, a new request is refused with 503, not routed to it), and stopping the server leaves no instance and
    no Ray process behind."""
    ray_tmp = _short_tmp()  # Ray's socket paths under it must fit AF_UNIX's 107 bytes
    with _ray_tmpdir(ray_tmp):
        # the fixed split (no decode kept at the prefill instance): a dead decode instance leaves none to decode
        server = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--pd-controller", "static", "--prefill-instances",
                              "1", "--decode-instances", "1", "--kv-backend", "tcp", "--launcher", "ray",
                              "--ray-address", "local", "--startup-timeout", "30")
    try:
        assert _ray_processes(ray_tmp), "Ray's own processes should run under the temp dir we gave it"
        info = server.cluster()["instances"]
        assert sorted(i["role"] for i in info) == ["decode", "prefill"]
        for i in info:
            assert i["node"] and i["address"].startswith(f"tcp://{LOOPBACK}:") and pid_alive(i["pid"])
        out = _complete(server.base_url, 12)
        assert out["status"] == 200 and out["usage"]["completion_tokens"] == 12
        assert _complete(server.base_url, 9, stream=True) == {"status": 200, "completion_tokens": 9,
                                                               "finish": ["length"]}
        # scale out with no room left (the private Ray has one CPU per core, both held): a clear 503 in
        # --startup-timeout, the actor released, membership unchanged, still serving
        added = httpx.post(f"{server.base_url}/cluster/instances", json={"role": "decode"}, timeout=300)
        assert added.status_code == 503 and "Ray placed 0 of 1 instances" in added.text
        assert sorted(i["id"] for i in server.cluster()["instances"]) == ["decode-0", "prefill-0"]
        assert _complete(server.base_url, 7)["usage"]["completion_tokens"] == 7
        pids = server.child_pids()
        decode_pid = next(i["pid"] for i in info if i["role"] == "decode")
        os.kill(decode_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
            time.sleep(0.2)
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code != 200
        states = {i["role"]: i["state"] for i in server.cluster()["instances"]}
        assert states["decode"] == "dead"
        refused = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                             json={"model": httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"],
                                   "prompt": "hello there", "max_tokens": 8})
        assert refused.status_code == 503 and "no live decode instance" in refused.text
    finally:
        code = server.stop()
    assert code == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (any(pid_alive(p) for p in pids) or _ray_processes(ray_tmp)):
        time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids)
    assert not _ray_processes(ray_tmp), "the private Ray cluster must stop with the server"
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_ray_warm_spare_becomes_the_added_instance(tiny_llama: Path) -> None:
    """--launcher ray --warm-spares 1: the spare is an actor (holding its CPU) whose process waits for a spec; a
    scale-out takes it (warm) and it serves; the replacement spare stays pending while Ray has no free CPU; stopping
    the server leaves no instance, spare or Ray process behind."""
    ray_tmp = _short_tmp()
    with _ray_tmpdir(ray_tmp):
        server = ServeProcess(tiny_llama, "--mode", "colocated", "--instances", "1", "--launcher", "ray",
                              "--ray-address", "local", "--startup-timeout", "60", "--warm-spares", "1")
    try:
        deadline = time.monotonic() + 60
        while not server.cluster()["warm_spares"]["pids"] and time.monotonic() < deadline:
            time.sleep(0.2)
        spare = server.cluster()["warm_spares"]["pids"]
        assert len(spare) == 1 and pid_alive(spare[0])
        time.sleep(3.0)  # its imports
        added = httpx.post(f"{server.base_url}/cluster/instances", json={"role": "colocated"}, timeout=300)
        assert added.status_code == 200 and added.json()["warm"] is True, added.text
        info = {i["id"]: i for i in server.cluster()["instances"]}
        assert info["instance-1"]["pid"] == spare[0]
        for _ in range(3):
            assert _complete(server.base_url, 6)["usage"]["completion_tokens"] == 6
        assert server.cluster()["warm_spares"] == {"pids": [], "used": 1}  # no CPU left for the next one
        pids = server.child_pids()
    finally:
        code = server.stop()
    assert code == 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (any(pid_alive(p) for p in pids) or _ray_processes(ray_tmp)):
        time.sleep(0.5)
    assert not any(pid_alive(p) for p in pids) and not pid_alive(spare[0])
    assert not _ray_processes(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_ray_placement_that_cannot_fit_fails_clearly(tiny_llama: Path, tmp_path: Path) -> None:
    """Two instances of more CPUs each than this machine has: Ray cannot place them; the server exits with a
    message that says so within --startup-timeout instead of hanging."""
    cores = (os.cpu_count() or 1) + 1
    cmd = [sys.executable, "-m", "tetriinfer.cli", "serve", "--model", str(tiny_llama), "--port", "0",
           "--mode", "colocated", "--instances", "2", "--cores-per-instance", str(cores), "--launcher", "ray",
           "--ray-address", "local", "--startup-timeout", "15", "--kv-cache-memory-gb", "0.25"]
    ray_tmp = _short_tmp()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_TMPDIR": ray_tmp}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert "Ray placed 0 of 2 instances" in done.stdout + done.stderr
    assert not _ray_processes(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)


# ---- two nodes ------------------------------------------------------------------------------------------------

ADDR = ("10.231.7.1", "10.231.7.2")


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = subprocess.run(["ip", "netns", "add", "tiray-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "tiray-probe"], capture_output=True)
    return None


def test_ray_cluster_across_hosts_and_scale_out_onto_a_new_host(tiny_llama: Path, tmp_path: Path) -> None:
    """Ray head on host A (its own network namespace, 10.231.7.1), a Ray worker on host B (10.231.7.2), one CPU
    each; `tetriinfer serve --launcher ray` on A places the prefill instance on one host and the decode instance on
    the other: requests complete with exact lengths, so the KV cache crossed between the hosts. Then host C
    (10.231.7.3) joins the Ray cluster while serving; a decode instance added through the API can only land there;
    decode-0 (on B) is removed with requests in flight; every request of every phase completes exactly, and the
    cluster ends with prefill on A and decode on C."""
    why = _netns_unavailable()
    if why is not None:
        pytest.skip(f"the multi-node Ray test makes hosts from network namespaces: {why}")
    script = ROOT / "benchmarks" / "ray_two_nodes.py"
    done = subprocess.run(
        [sys.executable, str(script), "--model", str(tiny_llama), "--workdir", str(tmp_path), "--requests", "4",
         "--scale-out", "--json"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    serve, moved = json.loads(done.stdout.strip().splitlines()[-1])["phases"]

    def hosts(phase: dict) -> dict[str, str]:
        return {i["id"]: i["address"].split("//")[1].split(":")[0] for i in phase["instances"]}

    assert hosts(serve) == {"prefill-0": ADDR[0], "decode-0": ADDR[1]} or \
        hosts(serve) == {"prefill-0": ADDR[1], "decode-0": ADDR[0]}
    assert serve["completed"] == 4 and serve["failed"] == 0 and serve["kv_transfers"] >= 4
    assert moved["add"]["status"] == 200 and moved["add"]["instance"] == "decode-1"
    assert moved["remove"]["status"] == 200 and moved["remove"]["was_dead"] is False
    assert hosts(moved)["decode-1"] == "10.231.7.3"  # the only free CPU was on the new host
    assert set(hosts(moved)) == {"prefill-0", "decode-1"}
    assert moved["completed"] == 12 and moved["failed"] == 0
    assert moved["completion_tokens"] == moved["expected_tokens"]


def test_ipv6_instance_addresses(tiny_llama: Path) -> None:
    """--instance-host ::1: the front end's control socket, every instance's control socket and the TCP KV
    backend bind the IPv6 loopback (addresses written tcp://[::1]:PORT), and requests cross from prefill to decode
    over it with their exact lengths. The static P:D controller keeps every request on the transfer path (the adaptive
    default may keep a request on its prefill instance to decode, which moves no KV)."""
    server = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--pd-controller", "static", "--prefill-instances", "1",
                          "--decode-instances", "1", "--kv-backend", "tcp", "--instance-host", "::1")
    try:
        info = server.cluster()
        assert all(i["address"].startswith("tcp://[::1]:") for i in info["instances"]), info["instances"]
        for n in (12, 5):
            out = _complete(server.base_url, n)
            assert out["status"] == 200 and out["usage"]["completion_tokens"] == n
        # transfer statistics reach the front end on the instances' own channel, a moment after the tokens
        deadline = time.monotonic() + 30
        while server.cluster()["transfers"]["count"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        info = server.cluster()
        assert info["kept_decodes"] == 0 and info["transfers"]["count"] >= 2, info
    finally:
        assert server.stop() == 0
    with pytest.raises(ValueError, match="instance_host"):
        ClusterConfig(model="m", instance_host="localhost")
