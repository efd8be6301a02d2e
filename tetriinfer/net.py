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


def bind_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (``port`` 0: a free port chosen by the kernel; read it back
    with ``getsockname()``). ``serve`` binds before it starts any instance, so that no port the instances or the KV
    transfer open can take the API's port, and a port in use fails at once, before any model is loaded.

    Raises ``OSError`` naming the address when the bind fails."""
    bare = bare_host(host)
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET  # as uvicorn does: a name resolves to IPv4
    infos = socket.getaddrinfo(bare or None, port, family=family, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    address = infos[0][4]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebinding after a restart (TIME_WAIT)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if bare in ("::", "") else 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {url_host(bare)}:{port}: {exc.strerror} "
                                 "(another server there? pick another --port, or --port 0 for a free one)") from exc
    sock.set_inheritable(False)
    return sock


def announced_base_url(startup_text: str) -> str | None:
    """The base URL (``http://HOST:PORT``, no ``/v1``) from ``tetriinfer serve``'s start-up line
    (``TetriInfer serving 'NAME' in mode ... at http://HOST:PORT/v1``), or None before that line is printed.
    A launcher that passes ``--port 0`` reads the chosen port here."""
    for line in startup_text.splitlines():
        if line.startswith("TetriInfer serving ") and " at http://" in line and line.endswith("/v1"):
            return line.rsplit(" at ", 1)[1][: -len("/v1")]
    return None
