"""The API's listening socket: bound before any instance starts, ``--port 0`` for a free port, a busy port a clear
error before anything is loaded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_helpers import ServeProcess
from tetriinfer.net import announced_base_url, bind_listener


def test_bind_listener_takes_a_free_port_and_names_a_busy_one() -> None:
    first = bind_listener("127.0.0.1", 0)
    port = first.getsockname()[1]
    assert port > 0
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: .*--port 0"):
        bind_listener("127.0.0.1", port)
    assert not first.get_inheritable()  # instance processes never hold the API's port
    first.close()


def test_bind_listener_binds_ipv6_literals_with_or_without_brackets() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        sock = bind_listener("[::1]", 0)
    except OSError as exc:
        pytest.skip(f"::1 cannot be bound here: {exc}")
    assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"
    sock.close()


def test_announced_base_url_reads_the_start_up_line() -> None:
    text = ("cpu layout: none\nTetriInfer serving 'llama' in mode tetriinfer (1 prefill + 1 decode instances) "
            "at http://127.0.0.1:40123/v1\n  length predictor: none\n")
    assert announced_base_url(text) == "http://127.0.0.1:40123"
    assert announced_base_url("TetriInfer serving 'm' in mode single at http://[::1]:8000/v1") == "http://[::1]:8000"
    assert announced_base_url("cpu layout: none\n") is None


def test_a_busy_port_fails_before_any_instance_starts(tiny_llama: Path) -> None:
    """Four instances would take seconds to start; the bind comes first, so the server exits at once, saying which
    address is taken, without a traceback and without the 'serving' line."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "tetriinfer.cli", "serve", "--model", str(tiny_llama), "--port", str(port),
               "--mode", "tetriinfer", "--prefill-instances", "2", "--decode-instances", "2",
               "--kv-cache-memory-gb", "0.25"]
        started = time.monotonic()
        done = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                              timeout=120)
    assert done.returncode == 2  # the CLI's exit status for a usage error
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and "TetriInfer serving" not in done.stdout
    assert "instance" not in done.stderr.lower().replace("--port", "")  # no instance said anything: none started
    assert time.monotonic() - started < 60  # generous: the point is that it does not wait for instance start-up


def test_port_zero_serves_on_the_announced_port_and_cluster_names_the_front_end(tiny_llama: Path) -> None:
    srv = ServeProcess(tiny_llama, "--mode", "colocated", "--instances", "1")
    try:
        assert srv.port != 0 and f"at http://127.0.0.1:{srv.port}/v1" in srv.output()
        info = httpx.get(f"{srv.base_url}/cluster", timeout=10).json()
        assert info["frontend_pid"] == srv.proc.pid
        assert srv.proc.pid not in [i["pid"] for i in info["instances"]]
    finally:
        assert srv.stop() == 0
