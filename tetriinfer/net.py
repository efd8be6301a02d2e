"""Small loopback networking helpers shared by the runtime, the benchmark tool and tests."""

from __future__ import annotations

import socket


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (a later bind can still race another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
