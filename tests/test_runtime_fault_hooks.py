"""The test-only KV send hold (``runtime.fault_hooks``): off unless asked for, one arm file holds one send, a hold
ends on release or after ``max_hold_s``."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tetriinfer.runtime.fault_hooks import (
    HOLD_KV_SEND_ENV,
    HoldConfig,
    SendHold,
    arm_file,
    held_file,
    hold_config_from_env,
)


def test_off_unless_the_variable_names_an_absolute_folder(tmp_path: Path) -> None:
    assert hold_config_from_env({}) is None
    assert hold_config_from_env({HOLD_KV_SEND_ENV: ""}) is None
    assert hold_config_from_env({HOLD_KV_SEND_ENV: str(tmp_path)}) == HoldConfig(str(tmp_path))
    with pytest.raises(ValueError):
        hold_config_from_env({HOLD_KV_SEND_ENV: "relative/folder"})
    with pytest.raises(ValueError):
        HoldConfig(str(tmp_path), max_hold_s=0)
    with pytest.raises(ValueError):
        HoldConfig(str(tmp_path), poll_s=2.0)


def test_one_arm_file_holds_one_matching_send_until_released(tmp_path: Path) -> None:
    hold = SendHold(HoldConfig(str(tmp_path), poll_s=0.005), "prefill-0")
    assert not hold.take("decode-0")  # not armed
    arm_file(tmp_path, "prefill-0").write_text("decode-1")
    assert not hold.take("decode-0")  # armed for another receiver
    assert hold.take("decode-1") and not arm_file(tmp_path, "prefill-0").exists()
    assert not hold.take("decode-1")  # consumed

    def release() -> None:
        deadline = time.monotonic() + 10
        while not held_file(tmp_path, "prefill-0").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        info = json.loads(held_file(tmp_path, "prefill-0").read_text())
        assert info["request_id"] == "r" and info["queued_bytes"] == 1 and info["total_bytes"] == 2
        held_file(tmp_path, "prefill-0").unlink()

    t = threading.Thread(target=release)
    t.start()
    assert hold.hold("r", "t", "decode-1", 1, 2) < 10
    t.join()
    assert hold.num_held == 1


def test_a_hold_nobody_releases_ends_after_max_hold_s(tmp_path: Path) -> None:
    hold = SendHold(HoldConfig(str(tmp_path), max_hold_s=0.05, poll_s=0.005), "prefill-0")
    assert hold.hold("r", "t", "", 1, 2) >= 0.05
    assert not held_file(tmp_path, "prefill-0").exists()
