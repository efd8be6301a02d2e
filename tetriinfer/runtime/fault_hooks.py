"""Test-only fault injection: hold a prefill instance in the middle of a KV send, so a test can kill the sender (or
its receiver) exactly while the transfer is in flight.

Off by default: nothing here runs unless ``$TETRIINFER_TEST_HOLD_KV_SEND`` names a folder in the instance's
environment (instances inherit the front end's). Protocol, all through files in that folder (never the network):

- the test *arms* instance ``I`` by creating ``I.arm``: empty (the next KV send of ``I``, whatever its receiver) or
  holding a decode instance id (the next send of ``I`` to that instance);
- at its next matching push send (``PrefillWorker._on_kv_ready``, per-request path) ``I`` removes ``I.arm``, opens
  the transfer, queues the first half of the payload (the receiver has reserved its blocks, posted its memory and
  gets those bytes), writes ``I.held`` (JSON: request id, transfer id, decode id, bytes queued and total; written
  to a temporary name and renamed, so a reader never sees half a file), and holds its loop;
- it holds until ``I.held`` is removed (the test releases it) or ``max_hold_s`` passed, then queues the rest and
  closes the transfer as an ordinary send would. A sender killed while holding never finishes.

Invariants: with the variable unset ``hold_config_from_env()`` is None and the send path is the ordinary one; one
``arm`` file holds at most one transfer (it is consumed before the hold starts); a hold never lasts more than
``max_hold_s``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOLD_KV_SEND_ENV = "TETRIINFER_TEST_HOLD_KV_SEND"


@dataclass(frozen=True)
class HoldConfig:
    """Where the arm/held files live, how long a hold may last, how often a holding instance looks for release."""

    folder: str
    max_hold_s: float = 120.0
    poll_s: float = 0.01

    def __post_init__(self) -> None:
        if not self.folder or not os.path.isabs(self.folder):
            raise ValueError(f"{HOLD_KV_SEND_ENV} must name an absolute folder, got {self.folder!r}")
        if not self.max_hold_s > 0:
            raise ValueError(f"max_hold_s must be > 0, got {self.max_hold_s}")
        if not 0 < self.poll_s <= 1:
            raise ValueError(f"poll_s must be in (0, 1], got {self.poll_s}")


def hold_config_from_env(env: Mapping[str, str] | None = None) -> HoldConfig | None:
    """The hold configuration ``$TETRIINFER_TEST_HOLD_KV_SEND`` asks for (None when unset or empty: off)."""
    folder = (os.environ if env is None else env).get(HOLD_KV_SEND_ENV, "")
    return HoldConfig(folder) if folder else None


def arm_file(folder: str | Path, instance_id: str) -> Path:
    """The file a test creates to arm ``instance_id``'s next KV send."""
    return Path(folder) / f"{instance_id}.arm"


def held_file(folder: str | Path, instance_id: str) -> Path:
    """The file ``instance_id`` writes while it holds a send (the test removes it to release the hold)."""
    return Path(folder) / f"{instance_id}.held"


class SendHold:
    """One instance's side of the protocol (see the module docstring)."""

    def __init__(self, config: HoldConfig, instance_id: str) -> None:
        self.config = config
        self.instance_id = instance_id
        self.num_held = 0

    def take(self, decode_id: str) -> bool:
        """Whether this send (to ``decode_id``) is to be held; consumes the arm file when it is."""
        arm = arm_file(self.config.folder, self.instance_id)
        try:
            wanted = arm.read_text().strip()
        except FileNotFoundError:
            return False
        if wanted and wanted != decode_id:
            return False
        try:
            arm.unlink()
        except FileNotFoundError:  # disarmed meanwhile
            return False
        return True

    def hold(self, request_id: str, transfer_id: str, decode_id: str, queued_bytes: int, total_bytes: int) -> float:
        """Announce the held transfer and wait for release (or ``max_hold_s``); the seconds held."""
        held = held_file(self.config.folder, self.instance_id)
        tmp = held.with_suffix(".tmp")
        tmp.write_text(json.dumps({"request_id": request_id, "transfer_id": transfer_id, "decode_id": decode_id,
                                   "queued_bytes": queued_bytes, "total_bytes": total_bytes, "pid": os.getpid()}))
        os.replace(tmp, held)
        self.num_held += 1
        t0 = time.monotonic()
        while held.exists() and time.monotonic() - t0 < self.config.max_hold_s:
            time.sleep(self.config.poll_s)
        held.unlink(missing_ok=True)
        return time.monotonic() - t0
