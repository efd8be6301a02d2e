"""The load generator's lean HTTP/1.1 streaming transport (``tetriinfer.bench.sse_transport``).

The parser is fed crafted responses split at arbitrary byte boundaries (a socket may cut anywhere), and the whole
exchange runs against real asyncio servers on loopback: framing by chunks, Content-Length and connection close,
error statuses, broken framing, and a callback that raises or ends the stream early.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.bench.sse_transport import (
    ConnectTimeout,
    Endpoint,
    RemoteProtocolError,
    _Response,
    post_stream,
)

EVENTS = [b'{"n": 1}', b'{"n": 2, "text": "a\\u00e9"}', b"[DONE]"]


def _sse_body(events: list[bytes], crlf: bool = False) -> bytes:
    nl = b"\r\n" if crlf else b"\n"
    return b"".join(b"event: token" + nl + b"data: " + e + nl + nl for e in events)


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, i = b"", 0
    for size in sizes:
        part, i = body[i : i + size], i + size
        if part:
            out += b"%x;ext=1\r\n%s\r\n" % (len(part), part)
    if i < len(body):
        out += b"%x\r\n%s\r\n" % (len(body) - i, body[i:])
    return out + b"0\r\n\r\n"


def _feed(wire: bytes, cuts: list[int], stop_at_done: bool = False) -> tuple[Any, list[bytes]]:
    """Run the parser over ``wire`` delivered in pieces cut at ``cuts``; returns (outcome, payloads seen)."""
    seen: list[bytes] = []

    async def main() -> Any:
        proto = _Response(lambda payload, _now: seen.append(payload) or (stop_at_done and payload == b"[DONE]"), 64)
        points = sorted({c for c in cuts if 0 < c < len(wire)})
        for a, b in zip([0, *points], [*points, len(wire)], strict=True):
            proto.data_received(wire[a:b])
        proto.connection_lost(None)
        try:
            return await proto.done
        except RemoteProtocolError as exc:
            return exc

    return asyncio.run(main()), seen


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), max_size=8),
    cuts=st.lists(st.integers(0, 400), max_size=12),
    crlf=st.booleans(),
)
def test_chunked_event_stream_parses_the_same_however_the_socket_cuts_it(sizes: list[int], cuts: list[int],
                                                                          crlf: bool) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    outcome, seen = _feed(head + _chunked(_sse_body(EVENTS, crlf), sizes), cuts)
    assert outcome == 200
    assert seen == EVENTS


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 300), max_size=8))
def test_content_length_and_read_until_close_bodies(cuts: list[int]) -> None:
    body = _sse_body(EVENTS)[:-1]  # the last line without its final newline still counts once the body ends
    by_length = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    assert _feed(by_length, cuts) == (200, EVENTS)
    until_close = b"HTTP/1.0 200 OK\r\n\r\n" + body
    assert _feed(until_close, cuts) == (200, EVENTS)


def test_interim_response_then_the_real_one_and_an_early_stop() -> None:
    wire = (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + _chunked(_sse_body([*EVENTS, b'{"after": "done"}']), [7]))
    outcome, seen = _feed(wire, [30, 90], stop_at_done=True)
    assert outcome == 200 and seen == EVENTS  # nothing after the callback said stop


def test_error_status_keeps_the_start_of_its_body_and_never_calls_back() -> None:
    body = b'{"error": {"message": "' + b"x" * 200 + b'"}}'
    wire = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    async def main() -> tuple[int, bytes]:
        proto = _Response(lambda *_: pytest.fail("on_data called for an error status"), 64)
        proto.data_received(wire)
        return await proto.done, bytes(proto.error_body)

    status, kept = asyncio.run(main())
    assert status == 429 and kept == body[:64]


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\ndata: {}\n", "complete response body"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\ndata: {}\n", "complete response body"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY", "not followed by CRLF"),
        (b"SMTP ready\r\n\r\n", "bad status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "complete response headers"),
    ],
)
def test_broken_framing_is_a_protocol_error(wire: bytes, match: str) -> None:
    outcome, _ = _feed(wire, [])
    assert isinstance(outcome, RemoteProtocolError) and match in str(outcome)


def test_endpoint_from_url() -> None:
    e = Endpoint.from_url("http://127.0.0.1:8000/v1/completions?x=1")
    assert (e.host, e.port, e.path, e.tls, e.host_header) == ("127.0.0.1", 8000, "/v1/completions?x=1", False,
                                                             "127.0.0.1:8000")
    assert Endpoint.from_url("https://example.org/v1").port == 443
    assert Endpoint.from_url("https://example.org/v1").host_header == "example.org"
    assert Endpoint.from_url("http://[::1]:9/").host_header == "[::1]:9"
    with pytest.raises(ValueError, match="http"):
        Endpoint.from_url("ftp://example.org/")


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _with_server(handler: Handler, client: Callable[[Endpoint], Awaitable[Any]]) -> Any:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await client(Endpoint.from_url(f"http://127.0.0.1:{port}/v1/completions"))
    finally:
        server.close()
        await server.wait_closed()


def test_post_stream_against_a_real_server_sends_the_request_and_times_each_event() -> None:
    requests: list[tuple[bytes, dict[str, Any]]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        requests.append((head, json.loads(await reader.readexactly(length))))
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in EVENTS:
            await asyncio.sleep(0.05)
            data = b"data: " + event + b"\n\n"
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def client(endpoint: Endpoint) -> tuple[int, bytes, list[tuple[bytes, float]]]:
        seen: list[tuple[bytes, float]] = []
        status, err = await post_stream(endpoint, b'{"prompt": "hi"}', lambda p, now: seen.append((p, now)) or False,
                                        headers={"Authorization": "Bearer k"})
        return status, err, seen

    status, err, seen = asyncio.run(_with_server(handler, client))
    assert status == 200 and err == b""
    assert [p for p, _ in seen] == EVENTS
    gaps = [b - a for (_, a), (_, b) in zip(seen, seen[1:], strict=False)]
    assert all(g >= 0.04 for g in gaps), gaps  # one timestamp per event as it arrived, not all at the end
    head, body = requests[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and body == {"prompt": "hi"}
    assert b"\r\nAuthorization: Bearer k\r\n" in head and b"\r\nConnection: close\r\n" in head


def test_post_stream_raises_what_the_callback_raises_and_closes_the_connection() -> None:
    async def run() -> tuple[BaseException | None, bool]:
        peer_closed = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunked(_sse_body(EVENTS), []))
            await writer.drain()
            await reader.read()  # returns b"" once the client has closed its end
            peer_closed.set()
            writer.close()

        def boom(_p: bytes, _now: float) -> bool:
            raise KeyError("bad event")

        async def client(endpoint: Endpoint) -> BaseException | None:
            try:
                await post_stream(endpoint, b"{}", boom)
            except KeyError as exc:
                return exc
            return None

        exc = await _with_server(handler, client)
        await asyncio.wait_for(peer_closed.wait(), 5)
        return exc, peer_closed.is_set()

    exc, peer_closed = asyncio.run(run())
    assert isinstance(exc, KeyError) and peer_closed


def test_connection_refused_and_connect_timeout_are_connection_errors() -> None:
    async def refused() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        await post_stream(Endpoint.from_url(f"http://127.0.0.1:{port}/"), b"{}", lambda *_: False)

    with pytest.raises(ConnectionRefusedError):
        asyncio.run(refused())

    # a listener that never accepts, its accept queue full: the kernel drops further SYNs and connect() hangs
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)

        async def hangs() -> None:
            await post_stream(Endpoint.from_url(f"http://127.0.0.1:{port}/"), b"{}", lambda *_: False,
                              connect_timeout_s=0.3)

        with pytest.raises(ConnectTimeout, match="within 0.3 s"):
            asyncio.run(hangs())
    finally:
        for s in fillers:
            s.close()
        listener.close()
    assert issubclass(ConnectTimeout, ConnectionError) and not issubclass(ConnectTimeout, TimeoutError)
