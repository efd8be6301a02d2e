"""`tetriinfer profile`: sweeps run, the saturation point follows the 5% rule, the JSON is written."""

from __future__ import annotations

import json

from tetriinfer.engine.profiler import saturation_point


def test_saturation_point_rule():
    sizes = [16, 32, 64, 128, 256]
    assert saturation_point(sizes, [100, 190, 300, 310, 312], 0.05) == 64  # 300 -> 310 is +3.3%
    assert saturation_point(sizes, [100, 200, 400, 800, 1600], 0.05) == 256  # never saturates: largest
    assert saturation_point(sizes, [100, 104, 300, 310, 312], 0.05) == 16  # first flat step wins


def test_profile_command_writes_json(tiny_llama, tmp_path, capsys):
    from tetriinfer.cli import main

    out = tmp_path / "prof.json"
    rc = main(["profile", "--model", str(tiny_llama), "--prefill-tokens", "16,64", "--decode-batches", "1,4",
               "--repeats", "1", "--decode-context", "32", "--out", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert [r["tokens"] for r in prof["prefill"]] == [16, 64]
    assert [r["batch"] for r in prof["decode"]] == [1, 4]
    assert prof["chunk_size"] in (16, 64)
    assert all(r["seconds"] > 0 for r in prof["prefill"] + prof["decode"])
    assert "ChunkSize" in capsys.readouterr().out
