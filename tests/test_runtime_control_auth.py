"""Control frames are authenticated with the cluster's key: an unknown peer's frames are refused before parsing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tetriinfer.runtime import messages as m
from tetriinfer.runtime.recovery import continuation, engine_id


@pytest.fixture
def keyed() -> Iterator[bytes]:
    before = m._control_key
    key = bytes(range(32))
    m.set_control_key(key)
    yield key
    m.set_control_key(before)


def test_signed_frames_round_trip_and_forged_ones_are_refused(keyed: bytes) -> None:
    frame = m.encode(m.Abort("req-1"))
    assert m.decode(frame) == m.Abort("req-1")
    with pytest.raises(m.ControlAuthError):
        m.decode(frame[:-m.MAC_BYTES])  # unsigned: what a peer without the key sends
    forged = bytearray(frame)
    forged[2] ^= 0x01  # one bit changed in the body
    with pytest.raises(m.ControlAuthError):
        m.decode(bytes(forged))
    m.set_control_key(bytes(32))  # another cluster's key
    with pytest.raises(m.ControlAuthError):
        m.decode(frame)
    with pytest.raises(ValueError, match="16 bytes"):
        m.set_control_key(b"short")


def test_continuation_carries_streamed_tokens_and_what_is_left() -> None:
    params = m.WireParams(10, 0.0, 1.0, -1, 3, 4, False, [7], None)
    first = m.NewRequest("r", [1, 2, 3], params, 5.0, eos_token_id=2, oracle_output_tokens=10)
    nxt = continuation(first, 2, [9, 8, 7])
    assert nxt.request_id == engine_id("r", 2) == "r~r2" and engine_id("r", 0) == "r"
    assert nxt.prompt_token_ids == [1, 2, 3, 9, 8, 7] and nxt.arrival_time == 5.0 and nxt.eos_token_id == 2
    assert (nxt.params.max_tokens, nxt.params.min_tokens, nxt.oracle_output_tokens) == (7, 1, 7)
    assert nxt.params.stop_token_ids == [7] and nxt.params.seed == 3
    with pytest.raises(ValueError, match="no output budget"):
        continuation(first, 1, list(range(10)))


def test_kv_region_names_cannot_be_guessed_from_the_request_id() -> None:
    from tetriinfer.runtime.prefill_worker import _region_id

    a, b = _region_id("cmpl-1"), _region_id("cmpl-1")
    assert a != b and a.startswith("cmpl-1#kv.") and len(a) - len("cmpl-1#kv.") == 16
