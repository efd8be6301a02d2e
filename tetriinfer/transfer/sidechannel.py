"""SideChannelAgent: the ZmqAgent control plane with payload bytes on a separate ordered data channel.

Used by the torchdist backend (gloo/NCCL point-to-point) and the tcp backend (raw TCP streams). All but the
payload is the ZmqAgent's (regions, slots, Close/Ack/Abort, attempts, timeouts, release). A Data or ReadResp header
lists payload sizes and, in `seq`, the tag of its first payload: payload i moves as one channel send/recv with tag
seq + i (mod TAG_SPACE), tags counted per destination peer.

A subclass supplies the channel: `_start` (post one send or recv; its completion callback runs on the I/O thread),
`_peer_of_address` / `_peer_of_identity` (who is at the other end), and where received bytes land: `_rx_buffer`
(backend-owned staging by default), `_deliver` (staging -> the caller's buffer), `_recycle`.

Invariants:
- Matching: for every payload header it gets, a peer posts one recv per listed payload, wanted or not (stale,
  rejected, unknown region: `dst` None, the bytes are dropped), so every send is matched.
- A received payload reaches the caller's buffer only while its transfer is live (default: copied out of staging
  on the I/O thread; a subclass that receives in place must stop writing once the transfer is not live).
- Held until a transfer's in-flight recvs complete: a receiver's Close judgement, its Acks (either way, "no
  region" included) and its rejection of a header; a reader's failure. A sender judges an Ack once its own
  sends completed (DONE lets the caller reuse its buffers). So a sender, reader or rejecting receiver is
  terminal with no op of its own in flight; only timeouts, cancels and shutdown end a transfer earlier. stats():
  in-flight sends count in `pinned_payloads`, in-flight recvs in `staging_segments`; they drain even after a
  failure (the channel always completes or fails every posted op).
- Completions from one peer are handled in header order: a slot written twice ends with the later append.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from tetriinfer.transfer import messages as m
from tetriinfer.transfer.agent import ZmqAgent, _In, _Out, _Read
from tetriinfer.transfer.base import TransferStats

log = logging.getLogger(__name__)

TAG_SPACE = (1 << 31) - 1  # gloo tags are non-negative int32
PUSH, READ = "push", "read"

Done = Callable[[str | None], None]  # completion callback, run on the I/O thread with an error or None
Live = Callable[[], bool]  # whether a posted recv's transfer still wants its bytes (checked by in-place receivers)


@dataclass
class _ReadRecv:
    rd: _Read | None  # None: draining a response nobody waits for
    remaining: int  # payloads not yet received
    reason: str = ""  # why the read fails once they are


class SideChannelAgent(ZmqAgent):
    """ZmqAgent whose payloads travel on a side channel (see the module docstring). Abstract: see the hooks."""

    def __init__(self, bind_url: str, **kw: Any) -> None:
        # state below is touched by the I/O thread only (the counters are read by stats())
        self._tags: dict[Hashable, int] = {}  # next tag per destination peer
        self._tx_pending: dict[str, int] = {}  # sender tid -> sends in flight
        self._tx_acks: dict[str, list[tuple[str, list[zmq.Frame]]]] = {}  # Acks held until those complete
        self._rx_pending: dict[str, int] = {}  # receiver tid -> recvs in flight
        self._rx_close: dict[str, tuple[bytes, str, str, int, bool]] = {}  # Closes held until those complete
        self._rx_acks: dict[str, list[tuple[bytes, m.Ack]]] = {}  # our Acks (either way) held likewise
        self._rx_reject: dict[str, tuple[_In, int, str]] = {}  # rejections of headers, held likewise
        self._n_tx = 0
        self._n_rx = 0
        super().__init__(bind_url, **kw)

    # ------------------------------------------------------------------ hooks
    def _peer_of_address(self, address: str) -> Hashable:
        """The channel peer behind an agent address (raises ValueError if it cannot be one)."""
        raise NotImplementedError

    def _peer_of_identity(self, identity: bytes) -> Hashable | None:
        """The channel peer behind a zmq routing identity, or None when it is not a peer of this channel."""
        raise NotImplementedError

    def _start(self, peer: Hashable, send: bool, buf: Any, tag: int, channel: str, done: Done) -> None:
        """Post one send (of byte view `buf`) or recv (into what `_rx_buffer` returned); `done` runs on the I/O
        thread once it completed or failed. Must never drop an op without calling `done`."""
        raise NotImplementedError

    def _before_sends(self) -> None:
        """Called on the I/O thread before a header's sends are posted (CUDA: order after the caller's stream)."""

    def _rx_buffer(self, n: int, dst: Any | None, live: Live, owner: str = "") -> Any:
        """Where one incoming payload of `n` bytes is received; `dst` is the caller's buffer it is meant for (None:
        nobody wants it), `owner` the receiving transfer. Default: backend staging, copied by `_deliver` on the
        I/O thread."""
        raise NotImplementedError

    def _deliver(self, dst: Any, buf: Any) -> None:
        """Copy a received payload into the caller's buffer (I/O thread, transfer live)."""
        raise NotImplementedError

    def _recycle(self, buf: Any, err: str | None) -> None:
        """A received-into buffer is no longer needed."""

    @property
    def _not_a_peer(self) -> str:
        return f"not a {self.kind} peer of this agent"

    # ------------------------------------------------------------------ common
    def stats(self) -> TransferStats:
        s = super().stats()
        return dataclasses.replace(s, pinned_payloads=s.pinned_payloads + self._n_tx,
                                   staging_segments=s.staging_segments + self._n_rx)

    def _take_tags(self, dst: Hashable, n: int) -> int:
        tag = self._tags.get(dst, 0)
        self._tags[dst] = (tag + n) % TAG_SPACE
        return tag

    # --- sender (push channel)
    def _emit(self, out: _Out, seq: int, slots: list[int], views: list[Any], frames: Sequence[Any], *,
              shm: list[m.ShmRef] | None = None, consumed: bool = True, inplace: bool = False,
              last: bool) -> bool:
        """One Data header (`seq` = first payload tag; the Close folded in when last), then a send per payload.
        False: failed."""
        tid = out.rec.transfer_id
        dst = self._peer_of_address(out.address)
        tag = self._take_tags(dst, len(views))
        nbytes = [v.nbytes for v in views]
        close_nslots = self._count_sent(out, sum(nbytes), last)
        msg = m.Data(tid, out.region_id, out.rec.attempt, out.final, tag, slots, nbytes,
                     close_nslots=close_nslots)
        try:
            self._to_peer(out.address, msg)
        except zmq.ZMQError as e:
            self._fail_out(out, f"send to {out.address} failed: {e}", tell_peer=False)
            return False
        self._before_sends()
        for i, v in enumerate(views):
            self._n_tx += 1
            self._tx_pending[tid] = self._tx_pending.get(tid, 0) + 1
            self._start(dst, True, v, (tag + i) % TAG_SPACE, PUSH, lambda err: self._sent(tid, out, dst, err))
        return True

    @staticmethod
    def _count_down(pending: dict[str, int], tid: str) -> int:
        """One op of `tid` completed: its in-flight count, dropped at zero. Returns what is left."""
        left = pending[tid] - 1
        if left:
            pending[tid] = left
        else:
            del pending[tid]
        return left

    def _sent(self, tid: str, out: _Out, dst: Hashable, err: str | None) -> None:
        self._n_tx -= 1
        left = self._count_down(self._tx_pending, tid)
        if err is not None and self._out.get(tid) is out:
            self._fail_out(out, f"send to {self._peer_name(dst)} failed: {err}", tell_peer=True)
        if not left:
            for address, parts in self._tx_acks.pop(tid, []):
                super()._on_dealer(address, parts)

    @staticmethod
    def _peer_name(peer: Hashable) -> str:
        if isinstance(peer, bytes):
            return peer.decode(errors="replace")
        return f"rank {peer}" if isinstance(peer, int) else str(peer)

    def _on_dealer(self, address: str, parts: list[zmq.Frame]) -> None:
        msg = m.decode(parts[0].buffer)
        if isinstance(msg, m.Ack) and self._tx_pending.get(msg.tid):
            self._tx_acks.setdefault(msg.tid, []).append((address, parts))  # judged once our sends completed
            return
        super()._on_dealer(address, parts)

    # --- receiver (push channel)
    def _on_data(self, identity: bytes, msg: m.Data, frames: Sequence[zmq.Frame]) -> None:
        src = self._peer_of_identity(identity)
        reason = ""
        if src is None:
            reason = self._not_a_peer
        elif frames:
            reason = f"payload frames on the control socket: {self.kind} carries payloads on its data channel"
        elif any(n < 0 for n in msg.nbytes):
            reason = f"malformed data: negative size in {msg.nbytes}"
        if reason:
            self._reply(identity, m.Ack(msg.tid, msg.attempt, False, reason))
            return
        tid = msg.tid
        if msg.nbytes:  # counted first: Acks for `tid` wait for these recvs (see _reply), "no region" included
            self._rx_pending[tid] = self._rx_pending.get(tid, 0) + len(msg.nbytes)
        inb = self._inbound(identity, tid, msg.region_id, msg.attempt, msg.final)
        reason = self._check_data(inb, msg) if inb is not None else ""
        if reason and msg.nbytes:
            self._rx_reject.setdefault(tid, (inb, msg.attempt, reason))  # judged once the payloads are drained
        elif reason:
            self._reject(inb, msg.attempt, reason)  # type: ignore[arg-type]
        elif inb is not None:
            with self._lock:
                inb.rec.start()
                inb.rec.touch(time.monotonic())
        target = None if reason else inb
        attempt = msg.attempt
        live: Live = lambda: self._live_in(target, attempt)  # noqa: E731
        for i, n in enumerate(msg.nbytes):  # every payload is received, wanted or not (see the invariants)
            slot = msg.slots[i] if target is not None else -1
            buf = self._rx_buffer(n, target.region.slots[slot] if target is not None else None, live, tid)
            self._n_rx += 1
            self._start(src, False, buf, (msg.seq + i) % TAG_SPACE, PUSH,
                        lambda err, s=slot, b=buf, n=n: self._received(tid, target, attempt, s, n, b, src, err))

    def _check_data(self, inb: _In, msg: m.Data) -> str:
        if msg.shm is not None or msg.inplace:
            return f"{self.kind} carries payloads on its data channel, not in shared memory"
        if len(msg.slots) != len(msg.nbytes):
            return f"malformed data: {len(msg.slots)} slots, {len(msg.nbytes)} sizes"
        region = inb.region.slots
        for slot, n in zip(msg.slots, msg.nbytes, strict=True):
            if not 0 <= slot < len(region):
                return f"slot {slot} out of range: region has {len(region)} slots"
            if n != region[slot].nbytes:
                return f"length mismatch in slot {slot}: receiver reserved {region[slot].nbytes} bytes, got {n}"
        return ""

    def _live_in(self, inb: _In | None, attempt: int) -> bool:
        return (inb is not None and self._in.get(inb.rec.transfer_id) is inb and not inb.rec.state.terminal
                and attempt == inb.rec.attempt and attempt != inb.rejected_attempt)

    def _received(self, tid: str, inb: _In | None, attempt: int, slot: int, n: int, buf: Any, src: Hashable,
                  err: str | None) -> None:
        self._n_rx -= 1
        left = self._count_down(self._rx_pending, tid)
        if self._live_in(inb, attempt):
            assert inb is not None
            if err is not None:
                self._reject(inb, attempt, f"recv from {self._peer_name(src)} failed: {err}")
            else:
                self._deliver(inb.region.slots[slot], buf)
                with self._lock:
                    if slot not in inb.filled:
                        inb.filled.add(slot)
                        inb.rec.bytes_done += n
                    inb.rec.touch(time.monotonic())
        self._recycle(buf, err)
        if left:
            return
        held = self._rx_reject.pop(tid, None)  # then, in arrival order: rejection, held Acks, Close
        if held is not None and self._live_in(held[0], held[1]):
            self._reject(*held)  # type: ignore[arg-type]
        for identity, ack in self._rx_acks.pop(tid, []):
            super()._reply(identity, ack)
        if tid in self._rx_close:
            super()._on_close(*self._rx_close.pop(tid))

    def _reply(self, identity: bytes, msg: m.Message, frames: Sequence[Any] = ()) -> None:
        if isinstance(msg, m.Ack) and self._rx_pending.get(msg.tid):
            self._rx_acks.setdefault(msg.tid, []).append((identity, msg))  # sent once its recvs are drained
            return
        super()._reply(identity, msg, frames)

    def _on_close(self, identity: bytes, tid: str, region_id: str, attempt: int, final: bool) -> None:
        if self._rx_pending.get(tid):
            self._rx_close[tid] = (identity, tid, region_id, attempt, final)  # judged once the data is in
            return
        super()._on_close(identity, tid, region_id, attempt, final)

    # --- one-sided read (read channel): the owner sends region slots, the reader receives them
    def _on_read_req(self, identity: bytes, msg: m.ReadReq) -> None:
        reader = self._peer_of_identity(identity)
        with self._lock:
            region = self._regions.get(msg.region_id)
        reason = ""
        if reader is None:
            reason = self._not_a_peer
        elif region is None:
            reason = f"no region {msg.region_id!r} at {self._address}"
        elif any(not 0 <= s < len(region.slots) for s in msg.slots):
            reason = f"slot out of range: region has {len(region.slots)} slots"
        if reason or region is None or reader is None:
            self._reply(identity, m.ReadResp(msg.tid, False, reason, []))
            return
        views = [region.slots[s] for s in msg.slots]
        tag = self._take_tags(reader, len(views))
        resp = m.ReadResp(msg.tid, True, "", [v.nbytes for v in views], seq=tag)
        try:
            self._router.send_multipart([identity, m.encode(resp)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return  # reader gone: send nothing it would never receive
        for i, v in enumerate(views):
            self._n_tx += 1
            self._start(reader, True, v, (tag + i) % TAG_SPACE, READ, self._served)

    def _served(self, err: str | None) -> None:
        self._n_tx -= 1
        if err is not None:
            log.warning("serving a read failed: %s", err)

    def _on_read_resp(self, address: str, msg: m.ReadResp, frames: Sequence[zmq.Frame]) -> None:
        rd = self._reads.get(msg.tid)
        if rd is not None and rd.rec.state.terminal:
            rd = None
        if not msg.ok:
            if rd is not None:
                self._end_read(rd, f"region owner rejected: {msg.reason}")
            return
        reason = ""
        if rd is not None and len(msg.nbytes) != len(rd.into):
            reason = f"expected {len(rd.into)} buffers, got {len(msg.nbytes)}"
        elif rd is not None:
            bad = [i for i, (d, n) in enumerate(zip(rd.into, msg.nbytes, strict=True)) if d.nbytes != n]
            if bad:
                reason = (f"length mismatch in buffer {bad[0]}: reader has {rd.into[bad[0]].nbytes} bytes, "
                          f"region slot has {msg.nbytes[bad[0]]}")
        if rd is not None and not msg.nbytes:
            self._end_read(rd, reason or None)
            return
        if rd is not None:
            with self._lock:
                rd.rec.start()
                rd.rec.touch(time.monotonic())
        src = self._peer_of_address(address)
        state = _ReadRecv(rd, len(msg.nbytes), reason)
        live: Live = lambda: (state.rd is not None and not state.reason  # noqa: E731
                              and self._reads.get(state.rd.rec.transfer_id) is state.rd
                              and not state.rd.rec.state.terminal)
        for i, n in enumerate(msg.nbytes):
            dst = rd.into[i] if rd is not None and not reason else None
            buf = self._rx_buffer(n, dst, live)
            self._n_rx += 1
            self._start(src, False, buf, (msg.seq + i) % TAG_SPACE, READ,
                        lambda err, i=i, b=buf: self._read_piece(state, i, b, src, err))

    def _read_piece(self, state: _ReadRecv, i: int, buf: Any, src: Hashable, err: str | None) -> None:
        """One read payload arrived: deliver it while the read is live and sound; the read ends (DONE, or FAILED
        with the first problem) once every payload of the response is in."""
        self._n_rx -= 1
        state.remaining -= 1
        if err is not None and not state.reason:
            state.reason = f"recv from {self._peer_name(src)} failed: {err}"
        rd = state.rd
        live = rd is not None and self._reads.get(rd.rec.transfer_id) is rd and not rd.rec.state.terminal
        if live and not state.reason:
            assert rd is not None
            self._deliver(rd.into[i], buf)
            with self._lock:
                rd.rec.touch(time.monotonic())
        self._recycle(buf, err)
        if live and state.remaining == 0:
            assert rd is not None
            if not state.reason:
                with self._lock:
                    rd.rec.bytes_done = rd.rec.bytes_total
            self._end_read(rd, state.reason or None)
