"""Benchmark reports: ratio tables, plots, markdown, and the workload sub-command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tetriinfer.bench.metrics import RequestRecord, summarize
from tetriinfer.bench.report import (
    compare_table,
    inflight_timeline,
    jct_values,
    load_results,
    markdown_report,
    plot_cdfs,
    ttft_values,
)


def _result(label: str, ttft: float, n: int = 4) -> dict[str, Any]:
    recs = []
    for i in range(n):
        send = float(i)
        recs.append(
            RequestRecord(
                f"r{i}",
                10,
                3,
                arrival_s=send,
                send_s=send,
                first_token_s=send + ttft,
                chunk_times_s=[send + ttft, send + ttft + 0.1, send + ttft + 0.2],
                chunk_tokens=[1, 1, 1],
                finish_s=send + ttft + 0.2,
                output_tokens=3,
                success=True,
            )
        )
    return {
        "label": label,
        "summary": summarize(recs, duration_s=float(n)),
        "requests": [r.to_dict() for r in recs],
        "workload": {"name": "w"},
        "config": {},
    }


def _write(tmp_path: Path, res: dict[str, Any], name: str) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(res))
    return p


def test_compare_table_ratios(tmp_path: Path) -> None:
    a = _write(tmp_path, _result("base", 0.4), "a.json")
    b = _write(tmp_path, _result("fast", 0.1), "b.json")
    results = load_results([a, b])
    table = compare_table(results)
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in table.splitlines()[2:]
    }
    assert rows["TTFT mean (ms)"] == ["400.0", "100.0", "0.25x"]
    # JCT = TTFT + 0.2 s: 600 ms vs 300 ms
    assert rows["JCT mean (ms)"] == ["600.0", "300.0", "0.50x"]
    assert rows["request throughput (req/s)"] == ["1", "1", "1.00x"]
    assert rows["goodput (req/s)"][1] == "-"


def test_label_collisions_use_file_stems(tmp_path: Path) -> None:
    a = _write(tmp_path, _result("same", 0.4), "x.json")
    b = _write(tmp_path, _result("same", 0.2), "y.json")
    assert [label for label, _ in load_results([a, b])] == ["x", "y"]


def test_values_timeline_plots_and_markdown(tmp_path: Path) -> None:
    res = _result("r", 0.5, n=3)
    assert ttft_values(res) == pytest.approx([0.5] * 3)
    assert jct_values(res) == pytest.approx([0.7] * 3)
    times, counts = inflight_timeline(res)
    assert max(counts) == 1 and counts[-1] == 0 and len(times) == 7
    paths = plot_cdfs([("r", res)], tmp_path / "p")
    assert [p.name for p in paths] == ["ttft_cdf.png", "jct_cdf.png", "inflight.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    md = markdown_report([("r", res)], "T", paths, tmp_path)
    assert md.startswith("# T") and "![inflight](p/inflight.png)" in md


def test_load_result_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": 1}')
    with pytest.raises(ValueError, match="not a tetriinfer bench results"):
        load_results([bad])
    with pytest.raises(FileNotFoundError):
        load_results([tmp_path / "nope.json"])


def test_workload_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tetriinfer.cli import main

    out = tmp_path / "w.json"
    assert (
        main(
            [
                "bench",
                "workload",
                "-w",
                "hpld",
                "-n",
                "50",
                "--rate",
                "2",
                "--seed",
                "4",
                "--max-context",
                "2048",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert len(data["requests"]) == 50
    assert all(r["prompt_tokens"] > 512 and r["output_tokens"] <= 128 for r in data["requests"])
    assert data["workload"]["num_rejected"] == sum(r["rejected"] for r in data["requests"])
    assert "hpld: 50 requests" in capsys.readouterr().out
    assert main(["bench", "workload", "-w", "nope"]) == 2
    assert main(["bench"]) == 2  # no --base-url: help, not a crash
