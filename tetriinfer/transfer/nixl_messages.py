"""Wire values of the NIXL backend: notification structs (msgspec/msgpack, never pickles), region targets and
`nixl://name/metadata` addresses. Pure data; no nixl import."""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence

import msgspec
import numpy as np

ADDRESS_PREFIX = "nixl://"
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class NixlTarget(msgspec.Struct, frozen=True, array_like=True):
    """Where a region lives: owner agent, its partial metadata (connection + registrations), slot addresses
    (0 for empty slots, which move no bytes)."""

    agent: str
    md: bytes
    addrs: list[int]


class Hello(msgspec.Struct, tag="hello", frozen=True, array_like=True):
    tid: str
    region_id: str
    attempt: int
    final: bool
    md: bytes  # the sender's connection metadata, so the owner can answer
    want_target: bool  # the sender only knew the owner's address: send sizes + NixlTarget in the Grant


class Grant(msgspec.Struct, tag="grant", frozen=True, array_like=True):
    tid: str
    attempt: int
    ok: bool
    reason: str = ""
    slot_nbytes: list[int] = []
    target: bytes = b""


class Data(msgspec.Struct, tag="data", frozen=True, array_like=True):
    """Delivered by NIXL after the WRITE it rides on completed. `close_ndata >= 0`: the sender closed and sent
    that many Data notifications in this attempt."""

    tid: str
    attempt: int
    slots: list[int]
    nbytes: list[int]
    close_ndata: int = -1


class Close(msgspec.Struct, tag="close", frozen=True, array_like=True):
    tid: str
    attempt: int
    ndata: int


class Abort(msgspec.Struct, tag="abort", frozen=True, array_like=True):
    tid: str
    attempt: int
    final: bool
    reason: str


class Ack(msgspec.Struct, tag="ack", frozen=True, array_like=True):
    tid: str
    attempt: int
    ok: bool
    reason: str = ""


class ReadReq(msgspec.Struct, tag="readreq", frozen=True, array_like=True):
    tid: str
    region_id: str
    slots: list[int]
    md: bytes


class ReadGrant(msgspec.Struct, tag="readgrant", frozen=True, array_like=True):
    tid: str
    ok: bool
    reason: str = ""


class ReadDone(msgspec.Struct, tag="readdone", frozen=True, array_like=True):
    tid: str


class Hi(msgspec.Struct, tag="hi", frozen=True, array_like=True):
    """connect(): load my metadata (`md`) and, if `reply`, answer so both directions are wired up."""

    md: bytes
    reply: bool


Notif = Hello | Grant | Data | Close | Abort | Ack | ReadReq | ReadGrant | ReadDone | Hi
ENCODER = msgspec.msgpack.Encoder()
NOTIF_DECODER = msgspec.msgpack.Decoder(Notif)
TARGET_DECODER = msgspec.msgpack.Decoder(NixlTarget)


def parse_address(address: str) -> tuple[str, bytes]:
    """(agent name, connection metadata) of a `nixl://name/b64md` address; ValueError if malformed."""
    if not isinstance(address, str) or not address.startswith(ADDRESS_PREFIX):
        raise ValueError(f"not a nixl address: {address!r}")
    name, sep, b64 = address[len(ADDRESS_PREFIX):].partition("/")
    if not sep or not NAME_RE.match(name) or not b64:
        raise ValueError(f"malformed nixl address {address!r}; expected nixl://<name>/<metadata>")
    try:
        md = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
    except (ValueError, TypeError) as e:
        raise ValueError(f"malformed nixl address metadata: {e}") from e
    return name, md


def merged_ranges(views: Sequence[np.ndarray]) -> list[tuple[int, int]]:
    """Merged (address, nbytes) intervals covering the non-empty views (NIXL rejects empty descriptors)."""
    spans = sorted((int(v.ctypes.data), int(v.ctypes.data) + v.nbytes) for v in views if v.nbytes)
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b - a) for a, b in merged]
