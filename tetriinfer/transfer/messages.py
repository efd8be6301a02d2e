"""Wire messages (msgspec/msgpack). Only these headers are decoded from sockets; KV bytes travel as separate raw
frames or in shared memory, never inside a header. Nothing here is ever pickled.

Sender -> receiver: Data, Close, Abort, ReadReq, Consumed (reader -> region owner).
Receiver -> sender: Ack, Consumed (shm staging may be reused), ReadResp.
"""

from __future__ import annotations

import msgspec


class RemoteRegion(msgspec.Struct, frozen=True):
    """Descriptor of memory a receiver has reserved and registered; safe to ship to a peer (msgspec-encodable).

    `slot_nbytes[i]` is the exact size of buffer i; a write must fill slots with exactly these sizes.
    `backend` names the backend kind that produced it; `extra` holds backend-specific metadata (e.g. NIXL).
    """

    address: str
    region_id: str
    slot_nbytes: list[int]
    backend: str = ""
    extra: bytes = b""

    @property
    def nbytes(self) -> int:
        return sum(self.slot_nbytes)


class ShmRef(msgspec.Struct, frozen=True, array_like=True):
    name: str
    offset: int
    nbytes: int


class DirectTarget(msgspec.Struct, frozen=True, array_like=True):
    """shm backend, in `RemoteRegion.extra`: where a region's arena-backed slots lie (None: not in the arena),
    and the fence word (`fence_name`, `fence_index`) that holds `token` while the region is open."""

    fence_name: str
    fence_index: int
    token: int
    slots: list[ShmRef | None]


class Data(msgspec.Struct, tag="data", frozen=True):
    """Payload for `slots`: raw frames, `shm` refs (to staging, or to the sender's arena when `consumed` is False:
    no Consumed reply needed), or, with `inplace`, nothing: the sender already wrote the receiver's arena slots.
    `close_nslots >= 0` means a Close follows in the same message (one control message per send())."""

    tid: str
    region_id: str
    attempt: int
    final: bool
    seq: int
    slots: list[int]
    nbytes: list[int]
    shm: list[ShmRef] | None = None
    consumed: bool = True
    inplace: bool = False
    close_nslots: int = -1


class Close(msgspec.Struct, tag="close", frozen=True):
    tid: str
    region_id: str
    attempt: int
    final: bool
    nslots: int


class Abort(msgspec.Struct, tag="abort", frozen=True):
    tid: str
    region_id: str
    attempt: int
    final: bool
    reason: str


class ReadReq(msgspec.Struct, tag="readreq", frozen=True):
    tid: str
    region_id: str
    slots: list[int]


class Ack(msgspec.Struct, tag="ack", frozen=True):
    tid: str
    attempt: int
    ok: bool
    reason: str = ""


class Consumed(msgspec.Struct, tag="consumed", frozen=True):
    tid: str
    seq: int


class ReadResp(msgspec.Struct, tag="readresp", frozen=True):
    tid: str
    ok: bool
    reason: str
    nbytes: list[int]
    seq: int = 0
    shm: list[ShmRef] | None = None


Message = Data | Close | Abort | ReadReq | Ack | Consumed | ReadResp

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(raw: bytes | memoryview) -> Message:
    """Decode one header; raises msgspec.DecodeError on anything that is not a known message."""
    return _decoder.decode(raw)
