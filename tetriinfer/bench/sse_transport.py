"""A lean HTTP/1.1 client for one streamed POST: the response's Server-Sent-Event data lines go to a callback as
the bytes carrying them arrive.

Why not httpx for the load generator: on a small testbed the client shares the CPU with the server it measures, so
what the client spends per streamed token is taken from the system under test, and a client that waits for a core
records its tokens late (several tokens then "arrive" in the same millisecond). httpx streams through h11, anyio
and two line iterators per token; this module is one ``asyncio.Protocol`` whose ``data_received`` parses the
framing and calls back synchronously, with no coroutine resumed per token (`benchmarks/bench_client_overhead.py`
measures both against the same server in one run).

What it speaks: ``POST`` over HTTP/1.1 (or HTTPS), one connection per request (``Connection: close``; no pool, so no
stale-connection retries), a response framed by ``Transfer-Encoding: chunked``, ``Content-Length`` or the end of the
connection. For a 200 response every ``data:`` line of the event stream goes to ``on_data(payload, now)`` in
order, ``payload`` stripped, ``now`` = ``time.perf_counter()`` when the socket read that completed the line
returned (one timestamp per read, as any client sees them); ``on_data`` returns True to end the stream there (the
caller saw ``[DONE]``). Other statuses return with the first ``max_error_body`` bytes of their body and never call
``on_data``.

Invariants: the connection is closed when ``post_stream`` returns, raises or is cancelled; a body whose framing ends
early (the peer closes mid-chunk or short of its Content-Length) raises ``RemoteProtocolError``; an exception
raised by ``on_data`` ends the stream and propagates to the caller unchanged.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

OnData = Callable[[bytes, float], bool]
MAX_HEAD_BYTES = 64 * 1024


class RemoteProtocolError(Exception):
    """The server broke HTTP/1.1 framing or closed the connection before the response ended."""


class ConnectTimeout(ConnectionError):
    """No connection within the connect timeout (not a ``TimeoutError``: the caller's own deadline is that)."""


@dataclass(frozen=True)
class Endpoint:
    """Where to POST: parsed once from a URL (``http://host:port/path`` or ``https://...``)."""

    host: str
    port: int
    path: str
    tls: bool

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"need an http:// or https:// URL with a host, got {url!r}")
        tls = parts.scheme == "https"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.hostname, parts.port or (443 if tls else 80), path, tls)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"


class _Response(asyncio.Protocol):
    """Parses one HTTP/1.1 response as it arrives (states below); resolves ``done`` with the status."""

    _HEAD, _SIZE, _DATA, _DATA_END, _UNTIL_CLOSE, _LENGTH, _FINISHED = range(7)

    def __init__(self, on_data: OnData, max_error_body: int) -> None:
        self.on_data = on_data
        self.max_error_body = max_error_body
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.error_body = bytearray()
        self._buf = bytearray()  # bytes not yet consumed by the framing parser
        self._line = bytearray()  # body bytes after the last newline (a partial event-stream line)
        self._state = self._HEAD
        self._left = 0  # bytes left in the current chunk / of the Content-Length body
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        try:
            self._buf += data
            self._parse(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 -- handed to the awaiting caller, never swallowed
            self._finish(exc)

    def eof_received(self) -> bool | None:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self._state == self._UNTIL_CLOSE:
            self._finish(None)
        else:
            where = "headers" if self._state == self._HEAD else "body"
            self._finish(RemoteProtocolError(f"peer closed connection without sending the complete response {where}"
                                             + (f" ({exc})" if exc else "")))

    def _finish(self, exc: BaseException | None) -> None:
        self._state = self._FINISHED
        if not self.done.done():
            if exc is None:
                self.done.set_result(self.status)
            else:
                self.done.set_exception(exc)
        if self._transport is not None:
            self._transport.close()

    def _parse(self, now: float) -> None:
        buf = self._buf
        while buf and not self.done.done():
            state = self._state
            if state == self._HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise RemoteProtocolError("response headers too long")
                    return
                head = bytes(buf[:end]).decode("latin-1")
                del buf[: end + 4]
                self._start_body(head)
            elif state == self._SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 1024:
                        raise RemoteProtocolError("chunk size line too long")
                    return
                try:
                    size = int(bytes(buf[:end]).split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise RemoteProtocolError(f"bad chunk size line {bytes(buf[:end])[:40]!r}") from None
                del buf[: end + 2]
                if size == 0:
                    self._end_body(now)  # trailers, if any, are not read: the connection closes anyway
                    return
                self._left = size
                self._state = self._DATA
            elif state in (self._DATA, self._LENGTH):
                take = min(self._left, len(buf))
                self._body(bytes(buf[:take]), now)
                del buf[:take]
                self._left -= take
                if self._left == 0:
                    if state == self._LENGTH:
                        self._end_body(now)
                        return
                    self._state = self._DATA_END
            elif state == self._DATA_END:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise RemoteProtocolError("chunk data not followed by CRLF")
                del buf[:2]
                self._state = self._SIZE
            elif state == self._UNTIL_CLOSE:
                self._body(bytes(buf), now)
                buf.clear()
            else:  # finished: ignore anything after the response
                buf.clear()

    def _start_body(self, head: str) -> None:
        status_line, _, rest = head.partition("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise RemoteProtocolError(f"bad status line {status_line[:80]!r}")
        self.status = int(parts[1])
        headers: dict[str, str] = {}
        for line in rest.split("\r\n"):
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if 100 <= self.status < 200:  # an interim response (100 Continue): the real one follows
            return
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = self._SIZE
        elif "content-length" in headers:
            try:
                self._left = int(headers["content-length"])
            except ValueError:
                raise RemoteProtocolError(f"bad Content-Length {headers['content-length']!r}") from None
            self._state = self._LENGTH
            if self._left == 0:
                self._end_body(time.perf_counter())
        else:
            self._state = self._UNTIL_CLOSE

    def _body(self, data: bytes, now: float) -> None:
        if self.status != 200:
            room = self.max_error_body - len(self.error_body)
            if room > 0:
                self.error_body += data[:room]
            return
        line = self._line
        line += data
        start = 0
        while (nl := line.find(b"\n", start)) >= 0:
            text = line[start:nl]
            start = nl + 1
            if text.startswith(b"data:") and self.on_data(bytes(text[5:]).strip(), now):
                line.clear()
                self._finish(None)
                return
        del line[:start]

    def _end_body(self, now: float) -> None:
        if self.status == 200 and self._line:  # a last line without its newline
            tail = bytes(self._line)
            self._line.clear()
            if tail.startswith(b"data:"):
                self.on_data(tail[5:].strip(), now)
        self._finish(None)


async def post_stream(
    endpoint: Endpoint,
    body: bytes,
    on_data: OnData,
    *,
    headers: dict[str, str] | None = None,
    connect_timeout_s: float = 10.0,
    max_error_body: int = 4096,
) -> tuple[int, bytes]:
    """POST ``body`` (JSON) to ``endpoint`` and stream the response (see the module docstring).

    Returns (status, the first ``max_error_body`` bytes of the body when the status is not 200, else b"").
    Raises ``RemoteProtocolError`` on broken framing, ``OSError``/``TimeoutError`` when the connection fails, and
    whatever ``on_data`` raises. The caller bounds the whole exchange (``asyncio.timeout``); cancelling closes the
    connection.
    """
    loop = asyncio.get_running_loop()
    protocol = _Response(on_data, max_error_body)
    tls = ssl.create_default_context() if endpoint.tls else None
    try:
        async with asyncio.timeout(connect_timeout_s):
            transport, _ = await loop.create_connection(
                lambda: protocol, endpoint.host, endpoint.port, ssl=tls,
                server_hostname=endpoint.host if tls is not None else None,
            )
    except TimeoutError:
        raise ConnectTimeout(f"no connection to {endpoint.host_header} within {connect_timeout_s} s") from None
    try:
        lines = [f"POST {endpoint.path} HTTP/1.1", f"Host: {endpoint.host_header}",
                 "Content-Type: application/json", "Accept: text/event-stream", f"Content-Length: {len(body)}",
                 "Connection: close"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        status = await protocol.done
        return status, bytes(protocol.error_body)
    finally:
        transport.close()
