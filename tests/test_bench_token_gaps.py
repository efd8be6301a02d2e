"""benchmarks/token_gaps.py: the JCT breakdown it prints is computed from the token arrival times as defined."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "token_gaps.py"


def load_script():  # noqa: ANN201 - the script as a module
    spec = importlib.util.spec_from_file_location("token_gaps", SCRIPT)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def request(arrival: float, times: list[float], ok: bool = True) -> dict:
    return {"arrival_s": arrival, "first_token_s": times[0], "chunk_times_s": times, "finish_s": times[-1],
            "success": ok}


def test_gaps_follow_their_definitions(tmp_path: Path) -> None:
    tg = load_script()
    run = {"label": "x", "requests": [
        request(0.0, [0.050, 0.070, 0.0705, 0.1305]),  # 2nd gap 20 ms; later gaps 0.5 ms (bunched), 60 ms (stall)
        request(1.0, [1.030, 1.040, 1.050]),  # 2nd gap 10 ms; later gap 10 ms
        request(2.0, [2.5], ok=False),  # failed: not counted
    ]}
    g = tg.column_gaps(run)
    assert g["requests"] == 2
    assert g["ttft_ms"] == pytest.approx(40.0)
    assert g["second_gap_ms"] == pytest.approx(15.0)
    assert g["later_gap_ms"] == pytest.approx((0.5 + 60 + 10) / 3)
    assert g["jct_ms"] == pytest.approx((130.5 + 50) / 2)
    assert g["bunched_share"] == pytest.approx(1 / 3) and g["stalls"] == 1
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"lphd": {"tetriinfer": run}}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(raw), "--md", str(tmp_path / "t.md")], check=True,
                         capture_output=True, text=True).stdout
    assert "| lphd | tetriinfer | 2 | 40.0 | 15.0 / 15.0 |" in out and (tmp_path / "t.md").read_text() == out
    with pytest.raises(ValueError, match="no successful request"):
        tg.column_gaps({"label": "empty", "requests": [request(0.0, [0.1], ok=False)]})
