"""Small loopback networking helpers shared by the runtime, the benchmark tool and tests."""

from __future__ import annotations

import socket


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (a later bind can still race another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def url_host(host: str) -> str:
    """``host`` as it goes into a ``tcp://HOST:PORT`` URL: IPv6 literals in brackets (``::1`` -> ``[::1]``)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def bare_host(host: str) -> str:
    """``host`` as sockets take it: an IPv6 literal without URL brackets (``[::1]`` -> ``::1``)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
