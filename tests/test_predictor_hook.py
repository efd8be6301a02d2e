"""The prefill instance's prediction service: batches queued prompts, returns each request exactly once."""

from __future__ import annotations

import time

from tetriinfer.runtime.predictor_hook import OracleHook, PredictionService


def test_service_returns_every_request_once_and_honours_cancel():
    svc = PredictionService(OracleHook(granularity=200), max_batch=8)
    for i in range(40):
        svc.submit(f"r{i}", [1, 2, 3], i * 10)
    svc.cancel("r3")
    out: list = []
    deadline = time.monotonic() + 5
    while len(out) < 39 and time.monotonic() < deadline:
        out += svc.drain()
        time.sleep(0.01)
    svc.close()
    ids = [o[0] for o in out]
    assert sorted(ids) == sorted(f"r{i}" for i in range(40) if i != 3)
    preds = {rid: pred for rid, pred, _ in out}
    assert preds["r25"] == (1, 200, 400)  # 250 tokens -> bucket 1 of width 200
    assert preds["r0"] == (0, 0, 200)


def test_unknown_length_gives_none():
    svc = PredictionService(OracleHook())
    svc.submit("x", [5], None)
    deadline = time.monotonic() + 5
    out: list = []
    while not out and time.monotonic() < deadline:
        out = svc.drain()
        time.sleep(0.01)
    svc.close()
    assert out[0][:2] == ("x", None)
