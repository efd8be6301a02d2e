"""CPU priority and placement (the knobs of a ``--cpu-layout`` FILE): instance processes run at the asked CPU
priority, every thread of them, and a priority the process may not take is reported, never fatal."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import ServeProcess, realtime_allowed, write_cpu_layout
from tetriinfer.runtime import priority
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.runtime.instance_spec import InstanceSpec
from tetriinfer.server.cli import add_cluster_args, cluster_config_from_args


def _assert_streams_a_completion(srv: ServeProcess) -> None:
    model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", timeout=120,
                      json={"model": model, "prompt": "Hello there", "max_tokens": 5, "ignore_eos": True,
                            "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 6


linux_only = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread nice values need Linux /proc")


@linux_only
def test_every_thread_gets_the_nice_value_and_later_threads_inherit_it() -> None:
    """In a child process (the test process keeps its priority): threads made before the call are reniced with the
    calling one, a thread made after inherits; a raise (+nice) needs no privilege."""
    code = textwrap.dedent("""
        import os, threading, json
        from tetriinfer.runtime.priority import set_process_nice, thread_nice_values
        stop = threading.Event()
        before = [threading.Thread(target=stop.wait) for _ in range(2)]
        for t in before: t.start()
        why_not = set_process_nice(7)
        after = threading.Thread(target=stop.wait); after.start()
        print(json.dumps({"why_not": why_not, "nice": thread_nice_values(os.getpid())}))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    import json

    res = json.loads(out.stdout)
    assert res["why_not"] is None
    assert len(res["nice"]) == 4 and set(res["nice"].values()) == {7}, res["nice"]


def test_a_priority_the_process_may_not_take_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(which: int, who: int, value: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    why_not = priority.set_process_nice(-10)
    assert why_not is not None and "CAP_SYS_NICE" in why_not


def test_nice_values_are_validated_and_reach_the_cluster_config_from_the_command_line(tmp_path: Path) -> None:
    for bad in (-21, 20):
        with pytest.raises(ValueError, match="nice"):
            ClusterConfig(model="m", instance_nice=bad)
        with pytest.raises(ValueError, match="nice"):
            InstanceSpec("i", "prefill", "ipc://x", "m", nice=bad)
    p = argparse.ArgumentParser()
    add_cluster_args(p)
    layout = write_cpu_layout(tmp_path, instance_nice=-10)
    assert cluster_config_from_args(p.parse_args(["--cpu-layout", layout]), "m").instance_nice == -10
    assert cluster_config_from_args(p.parse_args([]), "m").instance_nice is None  # default: the front end's
    assert InstanceSpec("i", "prefill", "ipc://x", "m").nice is None


@linux_only
@pytest.mark.parametrize(("args", "knobs", "frontend", "instances"), [
    (["--mode", "tetriinfer"], {"instance_nice": 5}, None, 5),
    (["--mode", "colocated", "--instances", "2"], {"frontend_nice": 3}, 3, 3),  # instances inherit it
], ids=["instance-nice", "frontend-nice"])
def test_served_processes_run_at_their_nice_values_and_answer(
    tiny_llama: Path, tmp_path: Path, args: list[str], knobs: dict[str, int], frontend: int | None, instances: int,
) -> None:
    """A real server with raised nice values (no privilege needed): every thread of every instance process is at
    ``instances``, every thread of the front end at ``frontend`` (None: the test process's), and a completion
    still comes back."""
    srv = ServeProcess(tiny_llama, *args, "--cpu-layout", write_cpu_layout(tmp_path, **knobs))
    try:
        pids = srv.child_pids()
        assert len(pids) == 2
        for pid in pids:
            values = priority.thread_nice_values(pid)
            assert len(values) >= 2 and set(values.values()) == {instances}, values
        want_frontend = os.getpriority(os.PRIO_PROCESS, 0) if frontend is None else frontend
        assert set(priority.thread_nice_values(srv.proc.pid).values()) == {want_frontend}
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert srv.stop() == 0


# ---- prefill_rt_priority: SCHED_FIFO while prefilling ---------------------------------------------------------
@linux_only
def test_real_time_policy_reaches_every_thread_and_is_given_back_keeping_the_nice_value() -> None:
    """In a child process: SCHED_FIFO reaches the threads made before the call and is inherited by one made after;
    going back to SCHED_OTHER keeps the nice value set before. Without the privilege, the refusal is returned and
    every thread stays under the normal scheduler."""
    code = textwrap.dedent("""
        import os, threading, json
        from tetriinfer.runtime.priority import set_process_nice, set_process_realtime, thread_policies, thread_nice_values
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        set_process_nice(3)
        why_not = set_process_realtime(6)
        after = threading.Thread(target=stop.wait); after.start()
        fifo = thread_policies(os.getpid())
        back = set_process_realtime(None)
        print(json.dumps({"why_not": why_not, "fifo": fifo, "back": back, "other": thread_policies(os.getpid()),
                          "nice": thread_nice_values(os.getpid())}))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    import json

    res = json.loads(out.stdout)
    other = [os.SCHED_OTHER, 0]
    assert len(res["fifo"]) == 3 and res["back"] is None
    if realtime_allowed():
        assert res["why_not"] is None
        assert all(v == [os.SCHED_FIFO, 6] for v in res["fifo"].values()), res["fifo"]
    else:
        assert "CAP_SYS_NICE" in res["why_not"]
        assert all(v == other for v in res["fifo"].values()), res["fifo"]
    assert all(v == other for v in res["other"].values()), res["other"]
    assert set(res["nice"].values()) == {3}


def test_a_real_time_policy_the_process_may_not_take_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    def refuse(pid: int, policy: int, param: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert priority.apply_realtime(5, "prefill-0") is False
    err = capsys.readouterr().err
    assert "prefill-0" in err and "CAP_SYS_NICE" in err and "normal scheduler" in err


def test_real_time_priorities_are_validated_and_reach_the_cluster_config_from_the_command_line(tmp_path: Path) -> None:
    for bad in (0, 100):
        with pytest.raises(ValueError, match="real-time priority"):
            ClusterConfig(model="m", prefill_rt_priority=bad)
        with pytest.raises(ValueError, match="real-time priority"):
            InstanceSpec("i", "prefill", "ipc://x", "m", prefill_rt_priority=bad)
        with pytest.raises(ValueError, match="real-time priority"):
            priority.set_process_realtime(bad)
    with pytest.raises(ValueError, match="keep_decode"):  # a prefill instance that decodes would hold its core
        ClusterConfig(model="m", prefill_rt_priority=10, keep_decode=True)
    p = argparse.ArgumentParser()
    add_cluster_args(p)
    layout = write_cpu_layout(tmp_path, prefill_rt_priority=10)
    assert cluster_config_from_args(p.parse_args(["--cpu-layout", layout]), "m").prefill_rt_priority == 10
    assert cluster_config_from_args(p.parse_args([]), "m").prefill_rt_priority is None  # off by default


@linux_only
def test_only_the_prefill_instance_runs_real_time_and_the_server_answers(tiny_llama: Path, tmp_path: Path) -> None:
    """A real 1 prefill + 1 decode server with prefill_rt_priority 7: every thread of the prefill instance is
    SCHED_FIFO 7 (or, without the privilege, the normal scheduler), the decode instance and the front end stay under
    the normal scheduler, and completions come back."""
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--cpu-layout",
                       write_cpu_layout(tmp_path, prefill_rt_priority=7))
    try:
        pids = {i["role"]: i["pid"] for i in srv.cluster()["instances"]}
        assert set(pids) == {"prefill", "decode"}
        want = (os.SCHED_FIFO, 7) if realtime_allowed() else (os.SCHED_OTHER, 0)
        prefill = priority.thread_policies(pids["prefill"])
        assert len(prefill) >= 2 and set(prefill.values()) == {want}, prefill
        assert set(priority.thread_policies(pids["decode"]).values()) == {(os.SCHED_OTHER, 0)}
        assert set(priority.thread_policies(srv.proc.pid).values()) == {(os.SCHED_OTHER, 0)}
        model = httpx.get(f"{srv.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        for prompt in ("Hello", "A longer prompt about the weather in the mountains today"):
            r = httpx.post(f"{srv.base_url}/v1/completions", timeout=120,
                           json={"model": model, "prompt": prompt, "max_tokens": 6, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    finally:
        assert srv.stop() == 0


@linux_only
def test_reset_on_fork_keeps_the_real_time_policy_from_threads_and_processes_started_later() -> None:
    """In a child process: SCHED_FIFO with reset-on-fork reaches the threads that exist, but a thread or a process
    started afterwards runs under the normal scheduler (what keeps instances spawned by a real-time front end off
    SCHED_FIFO)."""
    code = textwrap.dedent("""
        import os, subprocess, sys, threading, json
        from tetriinfer.runtime.priority import set_process_realtime, thread_policies, resets_on_fork
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        why_not = set_process_realtime(8, reset_on_fork=True)
        existing = thread_policies(os.getpid()); flags = resets_on_fork(os.getpid())
        after = threading.Thread(target=stop.wait); after.start()
        later = thread_policies(os.getpid())[after.native_id]
        child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        stop.set()
        print(json.dumps({"why_not": why_not, "existing": existing, "flags": flags, "later": later,
                          "child": int(child)}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    import json

    res = json.loads(out.stdout)
    assert len(res["existing"]) == 2
    assert res["later"] == [os.SCHED_OTHER, 0] and res["child"] == os.SCHED_OTHER
    if realtime_allowed():
        assert res["why_not"] is None
        assert all(v == [os.SCHED_FIFO, 8] for v in res["existing"].values()), res["existing"]
        assert all(res["flags"].values())
    else:
        assert "CAP_SYS_NICE" in res["why_not"]
        assert all(v == [os.SCHED_OTHER, 0] for v in res["existing"].values())


def test_front_end_priority_combinations_that_cannot_work_are_refused(tmp_path: Path) -> None:
    priority.check_frontend_priorities(None, -5, 10)  # off: anything goes
    priority.check_frontend_priorities(11, None, 10)
    priority.check_frontend_priorities(3, None, None)
    with pytest.raises(ValueError, match="exclude each other"):
        priority.check_frontend_priorities(11, -5, 10)
    with pytest.raises(ValueError, match="must be above prefill_rt_priority"):
        priority.check_frontend_priorities(10, None, 10)
    with pytest.raises(ValueError, match="real-time priority"):
        priority.check_frontend_priorities(100, None, None)
    layout = write_cpu_layout(tmp_path, frontend_rt_priority=5, prefill_rt_priority=9)
    out = subprocess.run([sys.executable, "-m", "tetriinfer.cli", "serve", "--cpu-layout", layout],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "must be above prefill_rt_priority" in out.stderr and layout in out.stderr


def test_a_real_time_front_end_and_prefill_instance_each_keep_their_own_policy_and_answer(
    tiny_llama: Path, tmp_path: Path,
) -> None:
    """A real 1 prefill + 1 decode server with prefill_rt_priority 7 and frontend_rt_priority 9: the front end's
    threads that exist once it has started (its event loop, ZeroMQ's I/O thread) are SCHED_FIFO 9 with reset-on-fork;
    the instances it spawned did not inherit that: the prefill instance is SCHED_FIFO 7 (its own flag), the decode
    instance the normal scheduler; streamed completions come back."""
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--cpu-layout",
                       write_cpu_layout(tmp_path, prefill_rt_priority=7, frontend_rt_priority=9))
    try:
        pids = {i["role"]: i["pid"] for i in srv.cluster()["instances"]}
        allowed = realtime_allowed()
        front = priority.thread_policies(srv.proc.pid)
        if allowed:
            assert front[srv.proc.pid] == (os.SCHED_FIFO, 9), front
            assert sum(v == (os.SCHED_FIFO, 9) for v in front.values()) >= 2, front  # the loop and ZeroMQ's I/O
            assert set(front.values()) <= {(os.SCHED_FIFO, 9), (os.SCHED_OTHER, 0)}, front
            assert priority.resets_on_fork(srv.proc.pid)[srv.proc.pid]
        else:
            assert set(front.values()) == {(os.SCHED_OTHER, 0)}
        want_prefill = (os.SCHED_FIFO, 7) if allowed else (os.SCHED_OTHER, 0)
        assert set(priority.thread_policies(pids["prefill"]).values()) == {want_prefill}
        assert set(priority.thread_policies(pids["decode"]).values()) == {(os.SCHED_OTHER, 0)}
        _assert_streams_a_completion(srv)
    finally:
        assert srv.stop() == 0


@linux_only
@pytest.mark.parametrize("yields", [True, False])
def test_a_real_time_loop_that_yields_lets_its_queued_message_leave_before_a_long_step(yields: bool) -> None:
    """A child pinned to one core under SCHED_FIFO queues a ZeroMQ message, then spins (a stand-in forward) until the
    receiver here has it, at most 3 s (0.5 s without the yield). ZeroMQ sends from its I/O thread, which has the
    loop's priority on the same core: with ``yield_if_realtime`` first the message arrives during the spin; without
    it, not until the spin ends (what kept a prefill instance's first tokens and Handoffs behind its next forward)."""
    import mmap
    import tempfile
    import threading

    import zmq

    flags = tempfile.NamedTemporaryFile(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)  # noqa: SIM115
    flags.write(b"\0" * 8)
    flags.flush()
    mm = mmap.mmap(flags.fileno(), 8)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def receive() -> None:  # flag 1: the warm-up arrived; flag 0: the message sent before the spin arrived
        while not stop.is_set():
            if pull.poll(50):
                mm[0 if pull.recv() == b"x" else 1] = 1

    receiver = threading.Thread(target=receive)
    receiver.start()
    code = textwrap.dedent(f"""
        import json, mmap, os, sys, time
        import zmq
        from tetriinfer.runtime.priority import set_process_realtime, yield_if_realtime
        os.sched_setaffinity(0, {{max(os.sched_getaffinity(0))}})  # before ZeroMQ starts its I/O thread
        mm = mmap.mmap(os.open({flags.name!r}, os.O_RDWR), 8)
        push = zmq.Context().socket(zmq.PUSH)
        push.connect("tcp://127.0.0.1:{port}")
        push.send(b"warm")
        deadline = time.monotonic() + 20
        while not mm[1] and time.monotonic() < deadline:
            time.sleep(0.001)
        why_not = set_process_realtime(5)
        push.send(b"x")
        if {yields}:
            yield_if_realtime()
        t0 = time.monotonic()
        seen = False
        while time.monotonic() - t0 < {3.0 if yields else 0.5}:
            if mm[0]:
                seen = True
                break
        set_process_realtime(None)
        print(json.dumps({{"why_not": why_not, "warm": bool(mm[1]), "seen_during_spin": seen}}))
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    finally:
        stop.set()
        receiver.join()
        pull.close(linger=0)
        ctx.term()
    import json

    res = json.loads(out.stdout)
    assert res["warm"]
    if not realtime_allowed():
        assert "CAP_SYS_NICE" in res["why_not"]
        return
    assert res["why_not"] is None
    assert res["seen_during_spin"] is yields


def test_core_lists_parse_and_bad_ones_are_refused(tmp_path: Path) -> None:
    assert priority.parse_cores("0") == (0,)
    assert priority.parse_cores("1,0,1") == (0, 1)
    ncpu = os.cpu_count() or 1
    assert priority.parse_cores(f"0-{ncpu - 1}") == tuple(range(ncpu))
    for bad in ("", "a", "0,", "1-0", "-1", "0-x"):
        with pytest.raises(ValueError):
            priority.parse_cores(bad)
    with pytest.raises(ValueError, match="do not exist"):
        priority.parse_cores(str(ncpu))
    out = subprocess.run([sys.executable, "-m", "tetriinfer.cli", "serve", "--cpu-layout",
                          write_cpu_layout(tmp_path, frontend_cores="0-")], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "cores must be a list" in out.stderr


@linux_only
def test_every_thread_is_pinned_and_later_threads_inherit_the_cores() -> None:
    """In a child process: threads made before the call move with the calling one, a thread made after inherits."""
    code = textwrap.dedent("""
        import os, threading, json
        from tetriinfer.runtime.priority import set_process_affinity, thread_affinities
        stop = threading.Event()
        before = [threading.Thread(target=stop.wait) for _ in range(2)]
        for t in before: t.start()
        why_not = set_process_affinity((0,))
        after = threading.Thread(target=stop.wait); after.start()
        print(json.dumps({"why_not": why_not,
                          "cores": {t: sorted(c) for t, c in thread_affinities(os.getpid()).items()}}))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    got = __import__("json").loads(out.stdout)
    assert got["why_not"] is None
    assert len(got["cores"]) >= 4 and all(c == [0] for c in got["cores"].values()), got


@linux_only
def test_the_load_client_runs_on_its_cores_and_gets_its_mask_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ClientConfig.cores``: the run happens on those cores (seen from inside the client's run) and the process
    has its previous mask again afterwards."""
    from tetriinfer.bench import client as bench_client
    from tetriinfer.bench.workloads import Workload

    seen: list[set[int]] = []

    async def fake_run(self: object, workload: Workload) -> tuple[list, float, None]:
        seen.append(os.sched_getaffinity(0))
        return [], 0.0, None

    monkeypatch.setattr(bench_client.BenchmarkClient, "run", fake_run)
    before = os.sched_getaffinity(0)
    cfg = bench_client.ClientConfig(base_url="http://127.0.0.1:9", model="m", cores=(0,), server_usage=False)
    bench_client.run_client(cfg, Workload(name="empty", requests=(), source="test", arrival_process="none",
                                          rate=None, seed=0))
    assert seen == [{0}] and os.sched_getaffinity(0) == before
    with pytest.raises(ValueError, match="cores"):
        bench_client.ClientConfig(base_url="http://127.0.0.1:9", model="m", cores=())


@linux_only
def test_a_pinned_front_end_keeps_its_cores_and_the_instances_keep_theirs(tiny_llama: Path, tmp_path: Path) -> None:
    """A real 1 prefill + 1 decode server with frontend_cores "0": every front-end thread runs on core 0 once it has
    started; the instances it spawned before that run on their own cores (prefill 0, decode 1 on a 2-core machine);
    streamed completions come back."""
    ncpu = os.cpu_count() or 1
    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--cpu-layout", write_cpu_layout(tmp_path, frontend_cores="0"))
    try:
        info = srv.cluster()["instances"]
        front = priority.thread_affinities(srv.proc.pid)
        assert set(front.values()) == {frozenset({0})}, front
        for i, inst in enumerate(sorted(info, key=lambda x: x["role"] != "prefill")):
            assert set(priority.thread_affinities(inst["pid"]).values()) == {frozenset({i % ncpu})}, inst
        _assert_streams_a_completion(srv)
    finally:
        assert srv.stop() == 0
