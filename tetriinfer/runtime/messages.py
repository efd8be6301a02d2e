"""Control-plane messages between the front end and instance processes (msgspec, never pickle).

Every message is a tagged ``msgspec.Struct``; ``encode``/``decode`` turn them into bytes and back, and
decoding rejects anything that is not one of these types. KV bytes never travel here: they move over the
transfer stack (``tetriinfer.transfer``) as raw buffers.

Authentication: once a control key is set (``set_control_key``; the front end makes a random one per start and
hands it to its instances in their environment, ``CONTROL_KEY_ENV``, never on a command line), every frame ``encode``
makes carries an HMAC-SHA256 tag (16 bytes) over its bytes, and ``decode`` rejects (``ControlAuthError``) a frame
whose tag does not verify, before parsing it: a peer that does not hold the key cannot make an instance or the front
end act. Frames are not encrypted (keep control ports on a private network) and not replay-protected.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import msgspec

from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.transfer.messages import RemoteRegion


class WireParams(msgspec.Struct, frozen=True):
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    logprobs: int | None

    @classmethod
    def from_params(cls, p: SamplingParams) -> WireParams:
        return cls(
            p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.min_tokens, p.ignore_eos,
            list(p.stop_token_ids), p.logprobs,
        )

    def to_params(self) -> SamplingParams:
        # Stop *strings* are matched by the front end's detokenizer, never by instances.
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids), logprobs=self.logprobs,
        )


class Prediction(msgspec.Struct, frozen=True):
    bucket: int
    lower: int
    upper: int


# ---- front end -> instance ---------------------------------------------------------------------
class NewRequest(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    params: WireParams
    arrival_time: float
    eos_token_id: int | None = None
    oracle_output_tokens: int | None = None  # known true length (ablations with --predictor oracle)

    def to_request(self) -> Request:
        """A fresh scheduler ``Request`` (raises ValueError on invalid sampling parameters)."""
        return Request(
            request_id=self.request_id, prompt_token_ids=list(self.prompt_token_ids),
            sampling_params=self.params.to_params(), arrival_time=self.arrival_time, eos_token_id=self.eos_token_id,
        )


class Abort(msgspec.Struct, tag=True, frozen=True):
    request_id: str


class PeerTable(msgspec.Struct, tag=True, frozen=True):
    """Control addresses of every instance (sent whenever membership changes)."""

    addresses: dict[str, str]


class DecodeLoads(msgspec.Struct, tag=True, frozen=True):
    """The monitor's aggregated decode load, broadcast to prefill instances, with the ACTIVE prefill instances' ids
    (``core.keep_decode.prompt_only_instance`` picks the one that keeps no decodes from them)."""

    reports: list[bytes]  # encoded WireLoad values
    prefill_ids: list[str] = []


class SetRole(msgspec.Struct, tag=True, frozen=True):
    """Flip, in two commands from the monitor: ``switch=False`` = start draining towards ``role``;
    ``switch=True`` = (drained) switch to ``role`` in place, with no model reload."""

    role: str
    switch: bool = False


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    pass


class Retire(msgspec.Struct, tag=True, frozen=True):
    """Scale-in: stop accepting work (state DRAINING: not routed to, not dispatched to), finish everything held,
    and once empty for ``grace_s`` (a dispatch decided before peers saw the drain may still land) report
    ``Retired`` and exit."""

    grace_s: float = 0.3


class Yield(msgspec.Struct, tag=True, frozen=True):
    """Queue rebalancing (``core.rebalance``): hand back up to ``count`` queued requests that made no progress
    here (newest first); answered by ``Yielded``."""

    count: int


class Migrate(msgspec.Struct, tag=True, frozen=True):
    """Live migration (``core.migration``): move ``count`` running decodes to each ``(target, count)``; answered
    by ``Migrating`` at once and ``MigrationDone`` when every picked request moved, came back or ended."""

    targets: list[tuple[str, int]]
    reason: str = ""


# ---- instance -> instance ----------------------------------------------------------------------
class Handoff(msgspec.Struct, tag=True, frozen=True):
    """Prefill -> decode: a prefilled request (first token sampled); its KV waits at ``prefill_id``."""

    request_id: str
    prefill_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: WireParams
    arrival_time: float
    eos_token_id: int | None
    num_kv_blocks: int  # blocks the KV payload covers (positions [0, num_tokens - 1))
    prediction: Prediction | None = None
    # Chunk-wise transfer: sent after the first chunk, before the prompt is fully prefilled. The KV then
    # arrives block by block (one slot per layer, K/V and block) and ``PrefillDone`` brings the first token.
    early: bool = False
    # Live migration: a running decode moving from instance ``prefill_id`` (the source). The target admits it at
    # once or answers KVDone(failed) (the source decodes it on).
    # ``rng_state``: a seeded request's sampler state where its source stopped (after the first token for a
    # prefilled request, empty for an unseeded one or an early chunk-wise hand-off: PrefillDone brings it then).
    migrated: bool = False
    rng_state: bytes = b""
    # Pull hand-off (per-request path): the staged KV lies in this region the prefill instance registered; the
    # decode instance reads it one-sided (no KVReady) and answers KVDone, after which the region is dropped.
    kv_region: RemoteRegion | None = None


class PrefillDone(msgspec.Struct, tag=True, frozen=True):
    """Prefill -> decode (chunk-wise mode): the prompt is prefilled; its sampled first token(s)."""

    request_id: str
    output_token_ids: list[int]
    rng_state: bytes = b""  # a seeded request's sampler state after those tokens (empty: unseeded)


class KVReady(msgspec.Struct, tag=True, frozen=True):
    """Decode -> prefill: blocks reserved, memory posted: send the KV into ``region``."""

    request_id: str
    transfer_id: str
    region: RemoteRegion


class KVDone(msgspec.Struct, tag=True, frozen=True):
    """Decode -> prefill: KV received (free the staging copy), or given up (``failed``)."""

    request_id: str
    failed: bool = False
    reason: str = ""


# ---- instance -> front end ---------------------------------------------------------------------
class Hello(msgspec.Struct, tag=True, frozen=True):
    instance_id: str
    role: str
    address: str
    pid: int
    host: str
    kv_blocks_total: int
    max_model_len: int


class TokenItem(msgspec.Struct, frozen=True):
    request_id: str
    index: int  # output position of token_ids[0]
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None


class Tokens(msgspec.Struct, tag=True, frozen=True):
    instance_id: str
    items: list[TokenItem]


class Dispatched(msgspec.Struct, tag=True, frozen=True):
    request_id: str
    decode_id: str


class TransferStat(msgspec.Struct, tag=True, frozen=True):
    instance_id: str
    num_bytes: int
    seconds: float
    outcome: str
    backend: str


class WireLoad(msgspec.Struct, tag=True, frozen=True):
    instance_id: str
    role: str
    state: str
    time: float
    num_queued: int
    num_running: int
    num_free_blocks: int
    num_used_blocks: int
    block_size: int
    tokens_in_flight: int
    num_heavy_decodes: int
    num_light_decodes: int
    utilization: float
    busy_s: float  # cumulative busy seconds (resource usage time)
    steps: int
    num_prefill_tokens: int = 0
    step_inflation: float = 0.0
    prefix_hit_tokens: int = 0  # cumulative prompt tokens found in the prefix cache (--enable-prefix-caching)
    prefix_queried_tokens: int = 0  # cumulative prompt tokens looked up there
    prefix_cached_blocks: int = 0  # blocks holding a named (reusable) prefix now
    num_waiting_blocks: int = 0  # decode: blocks its requests waiting for admission need


class PredictorStat(msgspec.Struct, tag=True, frozen=True):
    instance_id: str
    latencies_s: list[float]


class Retired(msgspec.Struct, tag=True, frozen=True):
    """Instance -> front end: drained after ``Retire`` (``drain_s`` from Retire to empty); the process exits."""

    instance_id: str
    drain_s: float


class Yielded(msgspec.Struct, tag=True, frozen=True):
    """Instance -> front end, answering ``Yield``: these requests left this instance unstarted (no token, no KV);
    the front end routes each again (possibly none: everything had started)."""

    instance_id: str
    request_ids: list[str]


class Migrating(msgspec.Struct, tag=True, frozen=True):
    """Live migration started: these requests are moving from ``instance_id`` to ``target``."""

    instance_id: str
    target: str
    request_ids: list[str]


class MigrationDone(msgspec.Struct, tag=True, frozen=True):
    """A ``Migrate`` finished: ``moved`` decode at their targets now, ``returned`` stayed (refused or failed);
    ``seconds``: from the ``Migrate`` to the last answer; ``bytes``: KV copied."""

    instance_id: str
    moved: list[str]
    returned: list[str]
    seconds: float
    num_bytes: int
    reason: str = ""


class RoleSwitched(msgspec.Struct, tag=True, frozen=True):
    instance_id: str
    role: str
    drain_s: float
    switch_s: float


Message = (
    NewRequest | Abort | PeerTable | DecodeLoads | SetRole | Shutdown | Retire | Yield | Migrate | Handoff
    | PrefillDone | KVReady | KVDone | Hello
    | Tokens | Dispatched | TransferStat | WireLoad | RoleSwitched | Retired | Yielded | Migrating | MigrationDone
    | PredictorStat
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_load_decoder = msgspec.msgpack.Decoder(WireLoad)

CONTROL_KEY_ENV = "TETRIINFER_CONTROL_KEY"
MAC_BYTES = 16
_control_key: bytes | None = None


class ControlAuthError(ValueError):
    """A control frame without a valid tag for this cluster's key (an unknown peer, or a corrupted frame)."""


def set_control_key(key: bytes | None) -> None:
    """Sign every frame from now on with ``key`` and accept only frames signed with it (None: no authentication)."""
    global _control_key
    if key is not None and len(key) < 16:
        raise ValueError("the control key must be at least 16 bytes")
    _control_key = key


def front_end_control_key() -> bytes:
    """This process's control key, made (random, 32 bytes) and set on first use: one per front-end start."""
    if _control_key is None:
        set_control_key(secrets.token_bytes(32))
    assert _control_key is not None
    return _control_key


def control_key_from_env() -> bool:
    """An instance takes its front end's key from ``CONTROL_KEY_ENV`` (hex); returns whether one was there."""
    value = os.environ.get(CONTROL_KEY_ENV)
    if not value:
        return False
    set_control_key(bytes.fromhex(value))
    return True


def _tag(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()[:MAC_BYTES]


def encode(msg: Message) -> bytes:
    data = _encoder.encode(msg)
    return data if _control_key is None else data + _tag(_control_key, data)


def decode(data: bytes) -> Message:
    """Raises ``ControlAuthError`` for a frame whose tag does not verify (when a key is set), and
    ``msgspec.ValidationError``/``DecodeError`` for anything that is not a known message."""
    key = _control_key
    if key is not None:
        if len(data) <= MAC_BYTES or not hmac.compare_digest(data[-MAC_BYTES:], _tag(key, data[:-MAC_BYTES])):
            raise ControlAuthError("control frame with a missing or invalid authentication tag")
        data = data[:-MAC_BYTES]
    return _decoder.decode(data)


def encode_load(load: WireLoad) -> bytes:
    """A load report inside ``DecodeLoads`` (covered by the outer frame's tag, so not signed itself)."""
    return _encoder.encode(load)


def decode_load(data: bytes) -> WireLoad:
    return _load_decoder.decode(data)
