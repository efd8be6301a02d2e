"""Start and stop a real ``tetriinfer serve`` process for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tetriinfer.net import announced_base_url


class ServeProcess:
    def __init__(self, model: Path, *args: str, startup_s: float = 240.0, env: dict[str, str] | None = None) -> None:
        """``tetriinfer serve`` on a port it picks itself (``--port 0``, read back from its start-up line: no port
        can be taken between choosing and binding it); returns once ``/health`` answers. Its output is read all
        along by a thread (a full pipe would stall the server); ``output()`` returns it."""
        cmd = [sys.executable, "-m", "tetriinfer.cli", "serve", "--model", str(model), "--port", "0",
               "--kv-cache-memory-gb", "0.25", *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + startup_s
        base_url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(timeout=10)
                raise RuntimeError(f"serve exited early:\n{self.output()}")
            base_url = base_url or announced_base_url(self.output())
            if base_url is not None:
                try:
                    if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                        self.base_url = base_url
                        self.port = int(base_url.rsplit(":", 1)[1])
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"serve did not become healthy in time:\n{self.output()}")

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line)

    def output(self) -> str:
        """Everything the server printed so far (all of it once ``stop()`` returned)."""
        return "".join(self._lines)

    def cluster(self) -> dict:
        return httpx.get(f"{self.base_url}/cluster", timeout=10).json()

    def predictions(self, at_least: int, timeout: float = 15.0) -> int:
        """The cluster's count of length predictions, polled until it reaches ``at_least`` or ``timeout`` passes:
        instances report their prediction latencies with their periodic load reports, so the count trails the
        responses by up to one report interval."""
        deadline = time.monotonic() + timeout
        count = self.cluster()["predictor"]["count"]
        while count < at_least and time.monotonic() < deadline:
            time.sleep(0.1)
            count = self.cluster()["predictor"]["count"]
        return count

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """``/cluster`` once no instance holds a block, queues or runs anything (or the last one seen at timeout)."""
        deadline = time.monotonic() + timeout
        info = self.cluster()
        while time.monotonic() < deadline:
            info = self.cluster()
            if all(i["kv_blocks_used"] == 0 and i["queued"] == 0 and i["running"] == 0 for i in info["instances"]):
                break
            time.sleep(0.3)
        return info

    def child_pids(self) -> list[int]:
        return [i["pid"] for i in self.cluster()["instances"]]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    return True


def realtime_allowed() -> bool:
    """Whether a process here may take SCHED_FIFO (root or CAP_SYS_NICE), asked of a child process."""
    code = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def write_cpu_layout(folder: Path, **knobs: int | str | list[str]) -> str:
    """A ``--cpu-layout`` TOML file in ``folder`` setting ``knobs`` (e.g. ``prefill_rt_priority=7``); its path."""
    lines = []
    for key, value in knobs.items():
        if isinstance(value, list):
            lines.append(f"{key} = [{', '.join(repr(v).replace(chr(39), chr(34)) for v in value)}]")
        elif isinstance(value, str):
            lines.append(f'{key} = "{value}"')
        else:
            lines.append(f"{key} = {value}")
    path = Path(folder) / "cpu_layout.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


StreamResult = tuple[str, str | None, int]  # text, the last finish_reason, completion tokens (-1: no usage chunk)


async def stream_completion(client: httpx.AsyncClient, base_url: str, body: dict) -> StreamResult:
    """POST ``body`` to ``/v1/completions`` as a stream (usage included) and gather it; asserts HTTP 200 and that
    no event carries an error."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, used = "", None, -1
    async with client.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for ch in ev["choices"]:
                text += ch["text"]
                finish = ch["finish_reason"] or finish
            if ev.get("usage"):
                used = ev["usage"]["completion_tokens"]
    return text, finish, used
