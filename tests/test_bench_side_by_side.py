"""``tetriinfer bench side-by-side``: perf/$ and tables on hand-made numbers, the runner against fake servers
(JSON shape, probe, resource accounting), and one tiny real run against ``tetriinfer serve`` (slow mark)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from tetriinfer.bench import side_by_side as sbs
from tetriinfer.bench.metrics import RequestRecord, summarize

# ------------------------------------------------------------------------------------ pure computations

PAPER = {  # workload: (JCT change, resource change, perf/$ reported by the paper)
    "lpld": (-0.40, 0.0, 1.4),
    "lphd": (-0.47, -0.38, 2.4),
    "hpld": (-0.23, 0.43, 0.86),
    "hphd": (-0.19, 0.07, 1.1),
    "mixed": (-0.50, -0.21, 1.9),
}


@pytest.mark.parametrize("workload", list(PAPER))
def test_perf_per_dollar_reproduces_the_papers_table(workload: str) -> None:
    jct_change, res_change, reported = PAPER[workload]
    value = sbs.perf_per_dollar(10.0 * (1 + jct_change), 10.0, 4.0 * (1 + res_change), 4.0)
    assert value == pytest.approx(reported, abs=0.051)


def test_perf_per_dollar_exact_and_undefined() -> None:
    # JCT halves (reduction 0.5) on 80% of the resources: 1.5 / 0.8
    assert sbs.perf_per_dollar(5.0, 10.0, 8.0, 10.0) == pytest.approx(1.875)
    # slower and costlier than the baseline: below 1 (speed = jct_base / jct once slower)
    assert sbs.perf_per_dollar(12.0, 10.0, 11.0, 10.0) == pytest.approx(10.0 / 12.0 / 1.1)
    # JCT 2.5x: the paper's form would be negative; this stays positive (0.4 on equal resources)
    assert sbs.perf_per_dollar(25.0, 10.0, 10.0, 10.0) == pytest.approx(0.4)
    assert sbs.perf_per_dollar(None, 10.0, 8.0, 10.0) is None
    assert sbs.perf_per_dollar(5.0, 10.0, None, 10.0) is None
    assert sbs.perf_per_dollar(5.0, 0.0, 8.0, 10.0) is None
    assert sbs.pct_change(15.0, 100.0) == pytest.approx(-0.85)
    assert sbs.pct_change(1.0, None) is None


def _cell(ttft: float, jct: float, resource: float | None) -> dict[str, Any]:
    return {
        "ttft_mean": ttft, "ttft_p99": 2 * ttft, "tpot_mean": 0.05, "jct_mean": jct, "jct_p99": 2 * jct,
        "throughput_rps": 1.0, "resource_s": resource, "perf_per_dollar": None, "completed": 10, "failed": 0,
    }


def _hand_made() -> dict[str, Any]:
    cells = {
        "mixed": {"tetriinfer": _cell(0.15, 5.0, 79.0), "colocated": _cell(1.0, 10.0, 100.0)},
        "hpld": {"tetriinfer": _cell(0.91, 7.7, 143.0), "colocated": _cell(1.0, 10.0, 100.0),
                 "vllm": _cell(1.2, 11.0, None)},
    }
    return {"workloads": sbs.finalize(cells), "meta": {}}


def test_finalize_and_relative_rows() -> None:
    result = _hand_made()
    wl = result["workloads"]
    assert wl["mixed"]["colocated"]["perf_per_dollar"] == pytest.approx(1.0)
    assert wl["mixed"]["tetriinfer"]["perf_per_dollar"] == pytest.approx(1.5 / 0.79)
    assert wl["hpld"]["tetriinfer"]["perf_per_dollar"] == pytest.approx(1.23 / 1.43)
    assert wl["hpld"]["vllm"]["perf_per_dollar"] is None  # an external server reports no resource time
    rows = {(r["workload"], r["column"]): r for r in sbs.relative_rows(wl)}
    assert set(rows) == {("mixed", "tetriinfer"), ("hpld", "tetriinfer"), ("hpld", "vllm")}
    assert rows["mixed", "tetriinfer"]["ttft"] == pytest.approx(-0.85)
    assert rows["mixed", "tetriinfer"]["jct"] == pytest.approx(-0.5)
    assert rows["mixed", "tetriinfer"]["resource"] == pytest.approx(-0.21)
    assert rows["hpld", "vllm"]["jct"] == pytest.approx(0.1)
    assert rows["hpld", "vllm"]["resource"] is None


def test_paper_table_and_markdown() -> None:
    result = _hand_made()
    table = sbs.paper_table(result)
    assert "| mixed | tetriinfer | -85% | -50% | -21% | 1.90x |" in table
    assert "| hpld | tetriinfer | -9% | -23% | +43% | 0.86x |" in table
    assert "| hpld | vllm | +20% | +10% | - | - |" in table
    md = sbs.markdown_report(result)
    assert "## mixed" in md and "## hpld" in md
    assert "5.00 (-50%)" in md  # the absolute JCT with its change vs colocated


def test_closed_loop_rate() -> None:
    # N=6 requests with C=2 in flight: the loop is full until the 4th completion, at t=4 s
    assert sbs.closed_loop_rate([1, 2, 3, 4, 9, 12], 6, 2) == pytest.approx(1.0)
    # two failures: only 4 completions; the window ends at the 4th = min(N - C, completed)
    assert sbs.closed_loop_rate([0.5, 1.0, 1.5, 2.0], 8, 2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="completed no request"):
        sbs.closed_loop_rate([], 6, 2)
    with pytest.raises(ValueError, match="num_requests"):
        sbs.closed_loop_rate([1.0], 2, 2)


def test_resource_seconds_and_cell_shape() -> None:
    total, per = sbs.resource_seconds({"a": 1.0, "b": 2.0}, {"a": 4.5, "b": 2.5, "c": 1.0})
    assert total == pytest.approx(5.0) and per == {"a": 3.5, "b": 0.5, "c": 1.0}
    rec = RequestRecord("r0", 10, 3, 0.0, send_s=0.1, first_token_s=0.3, chunk_times_s=[0.3, 0.4, 0.5],
                        chunk_tokens=[1, 1, 1], finish_s=0.5, output_tokens=3, success=True)
    bad = RequestRecord("r1", 10, 3, 0.2, send_s=0.2, finish_s=0.3, error="HTTP 500")
    cell = sbs.build_cell(summarize([rec, bad], 1.0), 2.5)
    assert tuple(cell) == sbs.CELL_KEYS
    assert cell["ttft_mean"] == pytest.approx(0.2) and cell["jct_mean"] == pytest.approx(0.5)
    assert cell["completed"] == 1 and cell["failed"] == 1 and cell["resource_s"] == 2.5


def test_parse_columns_and_layout() -> None:
    cols = sbs.parse_columns(
        "tetriinfer,colocated,tetri-sjf=tetriinfer",
        ["vllm=http://127.0.0.1:9000/"],
        ["--chunk-size 128", "tetri-sjf:--prefill-policy sjf"],
    )
    by = {c.label: c for c in cols}
    assert by["tetri-sjf"].mode == "tetriinfer"
    assert by["tetri-sjf"].serve_args == ("--chunk-size", "128", "--prefill-policy", "sjf")
    assert by["colocated"].serve_args == ("--chunk-size", "128")
    assert by["vllm"].external and by["vllm"].url == "http://127.0.0.1:9000"
    with pytest.raises(ValueError, match="no column named"):
        sbs.parse_columns("tetriinfer,colocated", [], ["sarathi:--chunk-size 64"])
    with pytest.raises(ValueError, match="NAME=URL"):
        sbs.parse_columns("colocated", ["vllm"], [])
    with pytest.raises(ValueError, match="unknown mode"):
        sbs.parse_columns("colocated,fast=warp", [], [])
    assert sbs.layout_args("tetriinfer", 2, 1)[:4] == ["--prefill-instances", "1", "--decode-instances", "1"]
    assert sbs.layout_args("sarathi", 2, 1)[:2] == ["--instances", "2"]


def test_config_validation() -> None:
    cols = sbs.parse_columns("tetriinfer,colocated")
    with pytest.raises(ValueError, match="needs the 'colocated' mode"):
        sbs.SideBySideConfig("m", ("lpld",), sbs.parse_columns("tetriinfer"))
    with pytest.raises(ValueError, match="probe_requests"):
        sbs.SideBySideConfig("m", ("lpld",), cols, probe_requests=4, probe_concurrency=4)
    with pytest.raises(ValueError, match="prefill_instances"):
        sbs.SideBySideConfig("m", ("lpld",), cols, instances=2, prefill_instances=2)
    with pytest.raises(ValueError, match="rate_fraction"):
        sbs.SideBySideConfig("m", ("lpld",), cols, rate_fractions=(0.0,))
    with pytest.raises(ValueError, match="rate_fraction"):
        sbs.SideBySideConfig("m", ("lpld",), cols, rate_fractions=(0.7, 5.0))
    with pytest.raises(ValueError, match="given twice"):
        sbs.SideBySideConfig("m", ("lpld",), cols, rate_fractions=(0.7, 0.7))
    with pytest.raises(ValueError, match="--rate auto"):
        sbs.SideBySideConfig("m", ("lpld",), cols, rate=1.0, rate_fractions=(0.7, 1.0))
    with pytest.raises(ValueError, match="length_scale"):
        sbs.SideBySideConfig("m", ("lpld",), cols, length_scale=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sbs.SideBySideConfig("m", ("lpld",), cols, temperature=-1.0)
    sampled = sbs.SideBySide(sbs.SideBySideConfig("m", ("lpld",), cols, temperature=0.7, seed=9))
    options = sampled._client_options(cols[0])
    assert options["temperature"] == 0.7 and options["seed"] == 9  # every column: the same seed per request
    one = sbs.SideBySideConfig("m", ("lpld",), cols)
    sweep = sbs.SideBySideConfig("m", ("lpld",), cols, rate_fractions=(0.7, 1.3))
    assert one.cell_key("lpld", 0.7) == "lpld" and sweep.cell_key("lpld", 1.3) == "lpld@130%"
    order = sbs.SideBySideConfig("m", ("lpld",), sbs.parse_columns("tetriinfer,colocated", ["v=http://x"]))
    assert [c.label for c in order.ordered_columns()] == ["colocated", "tetriinfer", "v"]


def test_cli_registers_side_by_side() -> None:
    from tetriinfer.bench.cli import add_subparsers

    parser = argparse.ArgumentParser()
    add_subparsers(parser.add_subparsers())
    args = parser.parse_args(["bench", "side-by-side", "--modes", "tetriinfer,colocated", "--rate", "auto",
                              "--serve-arg=--chunk-size 128", "--out", "x.json"])
    assert args.rate is None and args.serve_arg == ["--chunk-size 128"] and callable(args.handler)
    assert args.rate_fraction == (0.7,)
    assert parser.parse_args(["bench", "side-by-side", "--rate-fraction", "0.5,1,1.5", "--out", "x"]
                             ).rate_fraction == (0.5, 1.0, 1.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "side-by-side", "--rate-fraction", "0.5,high", "--out", "x"])
    assert parser.parse_args(["bench", "side-by-side", "--rate", "0.5", "--out", "x"]).rate == 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "side-by-side", "--rate", "fast", "--out", "x"])
    # the existing sub-commands still parse
    assert parser.parse_args(["bench", "compare", "a.json"]).results == ["a.json"]


# ------------------------------------------------------------------------- the runner with fake servers


class FakeCluster:
    """A minimal OpenAI-style server with ``/cluster``: a token every ``itl`` s after ``ttft`` s; each
    request adds ``ttft + itl * tokens`` busy seconds to instance ``busy``."""

    def __init__(self, ttft: float, itl: float, hits: int = 0) -> None:
        self.ttft, self.itl, self.busy, self.in_flight = ttft, itl, 0.0, 0
        self.hits, self.done = hits, 0  # /metrics: each finished request looked up 100 prompt tokens, found hits
        # per request: (max_tokens, requests in flight including this one, its OpenAI ``user`` field)
        self.log: list[tuple[int, int, str | None]] = []
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"data": [{"id": "fake", "max_model_len": 2048}]}

        @app.get("/cluster")
        async def cluster() -> dict[str, Any]:
            inst = {"id": "busy", "queued": 0, "running": self.in_flight, "busy_s": self.busy}
            return {"instances": [inst], "requests_in_flight": self.in_flight}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            from tetriinfer.server.metrics import ServerMetrics

            m = ServerMetrics()
            m.update_cluster({"instances": [{"id": "busy", "busy_s": self.busy, "prefix_cache_hit_tokens":
                                             self.hits * self.done, "prefix_cache_queried_tokens": 100 * self.done}]})
            return PlainTextResponse(m.render()[0].decode())

        @app.post("/v1/completions")
        async def completions(request: Request) -> StreamingResponse:
            body = await request.json()
            n, user = int(body["max_tokens"]), body.get("user")

            async def stream() -> Any:
                self.in_flight += 1
                self.log.append((n, self.in_flight, user))
                await asyncio.sleep(self.ttft)
                for i in range(n):
                    if i:
                        await asyncio.sleep(self.itl)
                    usage = {"completion_tokens": i + 1}
                    yield f"data: {json.dumps({'choices': [{'text': 'x', 'finish_reason': None}], 'usage': usage})}\n\n"
                self.busy += self.ttft + self.itl * n
                self.done += 1
                self.in_flight -= 1
                yield f"data: {json.dumps({'choices': [{'text': '', 'finish_reason': 'length'}]})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


SERVERS: list[tuple[str, FakeCluster]] = []  # every fake started, in order (tests clear it first)


def fake_servers(monkeypatch: pytest.MonkeyPatch, speeds: dict[str, tuple[float, ...]]) -> list[tuple[str, tuple[str, ...]]]:
    """Replace ``serve`` with in-process FakeClusters (mode -> (ttft, itl[, hits])) and ``wait_idle`` with a direct
    ``/cluster`` read; returns the list that records each (mode, args) started, in order."""
    started: list[tuple[str, tuple[str, ...]]] = []

    @contextmanager
    def fake_serve(model: str, mode: str, args: list[str], timeout: float) -> Iterator[str]:
        started.append((mode, tuple(args)))
        srv = FakeCluster(*speeds[mode])
        SERVERS.append((mode, srv))
        try:
            yield srv.start()
        finally:
            srv.stop()

    monkeypatch.setattr(sbs, "serve", fake_serve)
    monkeypatch.setattr(sbs, "wait_idle", lambda url, timeout_s=120.0, settle_s=0.0: {
        i["id"]: i["busy_s"] for i in sbs.cluster_busy(url)["instances"]
    })
    return started


def test_each_column_measures_with_its_own_client_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``client_cores = ["NAME:LIST"]`` pins the load client for that column only; the others take the run default."""
    import tetriinfer.bench.client as client_mod

    fake_servers(monkeypatch, {"colocated": (0.02, 0.002), "tetriinfer": (0.02, 0.002)})
    seen: list[tuple[str, tuple[int, ...] | None]] = []
    real_run_benchmark = client_mod.run_benchmark

    def spy(cfg: Any, workload: Any, slo: Any, label: str) -> Any:
        seen.append((label, cfg.cores))
        return real_run_benchmark(cfg, workload, slo, label)

    monkeypatch.setattr(client_mod, "run_benchmark", spy)
    cols = sbs.parse_columns("tetriinfer,colocated,c2=colocated", [], [], ["tetriinfer:0", "c2:all"])
    by = {c.label: c for c in cols}
    assert by["tetriinfer"].client_cores == (0,) and by["colocated"].client_cores is None
    assert by["c2"].client_cores == tuple(range(os.cpu_count() or 1))
    cfg = sbs.SideBySideConfig(str(tmp_path), ("lpld",), cols, num_requests=2, rate=20.0, max_prompt_tokens=300,
                               max_output_tokens=12, progress=False, floor=False, client_cores=(0,))
    result, _ = sbs.SideBySide(cfg, "test").run()
    assert dict(seen) == {"tetriinfer": (0,), "colocated": (0,), "c2": tuple(range(os.cpu_count() or 1))}
    report = sbs.markdown_report(result)
    assert "**tetriinfer**" in report and "load client pinned to cores [0]" in report
    with pytest.raises(ValueError, match="no column named"):
        sbs.parse_columns("tetriinfer,colocated", [], [], ["sarathi:0"])
    with pytest.raises(ValueError, match="NAME:LIST"):
        sbs.parse_columns("tetriinfer,colocated", [], [], ["0"])
    with pytest.raises(ValueError, match="twice"):
        sbs.parse_columns("tetriinfer,colocated", [], [], ["tetriinfer:0", "tetriinfer:1"])


def test_runner_writes_the_exact_json_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started = fake_servers(monkeypatch, {"colocated": (0.08, 0.004), "tetriinfer": (0.02, 0.002)})
    cols = sbs.parse_columns("tetriinfer,colocated", [], ["tetriinfer:--chunk-size 128"])
    cfg = sbs.SideBySideConfig(
        str(tmp_path), ("lpld", "mixed"), cols, num_requests=5, probe_requests=4, probe_concurrency=2,
        max_prompt_tokens=300, max_output_tokens=12, progress=False,
    )
    result, raw = sbs.SideBySide(cfg, "test").run()
    assert [m for m, _ in started] == ["colocated", "tetriinfer"]  # the baseline (and its probe) first
    assert ("--chunk-size", "128") == started[1][1][-2:] and "--chunk-size" not in started[0][1]
    assert set(result) == {"workloads", "meta"}
    assert set(result["workloads"]) == {"lpld", "mixed"}
    for cells in result["workloads"].values():
        assert list(cells) == ["tetriinfer", "colocated"]
        for cell in cells.values():
            assert tuple(cell) == sbs.CELL_KEYS
            assert cell["completed"] == 5 and cell["failed"] == 0 and cell["resource_s"] > 0
        assert cells["colocated"]["perf_per_dollar"] == pytest.approx(1.0)
        # the faster fake is faster and cheaper, so its perf/$ beats the baseline
        assert cells["tetriinfer"]["jct_mean"] < cells["colocated"]["jct_mean"]
        assert cells["tetriinfer"]["perf_per_dollar"] > 1.0
    rates = result["meta"]["rates"]
    for wl in ("lpld", "mixed"):
        assert rates[wl]["rate_rps"] == pytest.approx(0.7 * rates[wl]["probed_rps"])
        assert rates[wl]["probed_rps"] > 0
        # the same requests in every column
        a, b = (raw[wl][c]["workload"] for c in ("tetriinfer", "colocated"))
        assert a == b
    path = sbs.save(result, tmp_path / "out.json")
    assert json.loads(path.read_text())["workloads"] == json.loads(json.dumps(result["workloads"]))
    plots = sbs.write_plots(result, raw, tmp_path / "plots")
    assert (tmp_path / "plots" / "summary.png") in plots and all(p.stat().st_size > 1000 for p in plots)


def test_rounds_rotate_the_column_order_and_pool_every_request(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    speeds = {"colocated": (0.06, 0.004), "tetriinfer": (0.02, 0.002)}
    started = fake_servers(monkeypatch, speeds)
    cols = sbs.parse_columns("tetriinfer,colocated", [], [])
    with pytest.raises(ValueError, match="rounds"):
        sbs.SideBySideConfig(str(tmp_path), ("lpld",), cols, rounds=0)
    cfg = sbs.SideBySideConfig(
        str(tmp_path), ("lpld",), cols, num_requests=4, probe_requests=4, probe_concurrency=2,
        max_prompt_tokens=300, max_output_tokens=12, progress=False, rounds=3,
    )
    result, raw = sbs.SideBySide(cfg, "test").run()
    # round 1: baseline first (its probe sets the rate), then rotated: no column always runs first or last
    assert [m for m, _ in started] == ["colocated", "tetriinfer", "tetriinfer", "colocated", "colocated", "tetriinfer"]
    assert result["meta"]["rounds"] == 3
    for label in ("tetriinfer", "colocated"):
        cell = result["workloads"]["lpld"][label]
        assert cell["completed"] == 12 and cell["failed"] == 0  # 3 rounds x 4 requests, pooled
        ids = [r["request_id"] for r in raw["lpld"][label]["requests"]]
        assert len(ids) == len(set(ids)) == 12
        # busy seconds add up over the rounds: 3 x 4 requests x (ttft + itl x tokens) of the fake
        assert cell["resource_s"] > 3 * 4 * speeds[label][0]
    assert result["workloads"]["lpld"]["tetriinfer"]["jct_mean"] < result["workloads"]["lpld"]["colocated"]["jct_mean"]
    # within-round changes: three rounds, each far below colocated (the fake's TTFT is 0.02 s vs 0.06 s)
    ch = result["meta"]["round_changes"]["lpld"]
    assert set(ch) == {"tetriinfer"} and len(ch["tetriinfer"]["ttft"]) == len(ch["tetriinfer"]["jct"]) == 3
    assert all(-0.8 < v < -0.4 for v in ch["tetriinfer"]["ttft"]) and all(v < 0 for v in ch["tetriinfer"]["jct"])
    assert "## Change vs colocated within each round" in sbs.markdown_report(result)


def test_keep_servers_starts_each_column_once_and_keeps_all_up_through_every_round(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    speeds = {"colocated": (0.06, 0.004), "tetriinfer": (0.02, 0.002)}
    SERVERS.clear()
    started = fake_servers(monkeypatch, speeds)
    live_at_each_run: list[int] = []
    run_column = sbs.SideBySide._run_column

    def counting(self: sbs.SideBySide, column: sbs.Column, url: str, ours: bool) -> None:
        live_at_each_run.append(sum(srv.thread.is_alive() for _, srv in SERVERS))
        run_column(self, column, url, ours)

    monkeypatch.setattr(sbs.SideBySide, "_run_column", counting)
    cols = sbs.parse_columns("tetriinfer,colocated", [], [])
    cfg = sbs.SideBySideConfig(
        str(tmp_path), ("lpld",), cols, num_requests=4, probe_requests=4, probe_concurrency=2,
        max_prompt_tokens=300, max_output_tokens=12, progress=False, rounds=3, keep_servers=True,
    )
    result, raw = sbs.SideBySide(cfg, "test").run()
    assert [m for m, _ in started] == ["colocated", "tetriinfer"]  # once each, however many rounds
    assert live_at_each_run == [2] * 6  # 3 rounds x 2 columns, both servers up at every one
    assert not any(srv.thread.is_alive() for _, srv in SERVERS)  # all stopped at the end
    assert result["meta"]["keep_servers"] is True
    for label in ("tetriinfer", "colocated"):
        assert result["workloads"]["lpld"][label]["completed"] == 12
        assert result["workloads"]["lpld"][label]["resource_s"] > 3 * 4 * speeds[label][0]
    ch = result["meta"]["round_changes"]["lpld"]["tetriinfer"]
    assert len(ch["ttft"]) == 3 and all(v < 0 for v in ch["ttft"])
    assert "(se)" in sbs.markdown_report(result)


def test_prefix_cache_hits_from_server_metrics_are_summed_over_rounds(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    fake_servers(monkeypatch, {"colocated": (0.02, 0.002), "tetriinfer": (0.02, 0.002, 40)})
    cfg = sbs.SideBySideConfig(str(tmp_path), ("lpld",), sbs.parse_columns("tetriinfer,colocated", [], []),
                               num_requests=3, rate=20.0, max_prompt_tokens=300, max_output_tokens=12,
                               progress=False, rounds=2, floor=False)
    result, _ = sbs.SideBySide(cfg, "test").run()
    details = result["meta"]["details"]["lpld"]
    assert (details["tetriinfer"]["prefix_cache_hit_tokens"], details["tetriinfer"]["prefix_cache_queried_tokens"]) \
        == (2 * 3 * 40, 2 * 3 * 100)
    assert details["colocated"]["prefix_cache_hit_tokens"] == 0
    assert ("Found in a prefix cache (server /metrics): colocated: 0 of 600 prompt tokens (0%); tetriinfer: 240 of "
            "600 prompt tokens (40%).") in sbs.markdown_report(result)


def _rec(rid: str, ttft: float, jct: float) -> dict[str, Any]:
    return RequestRecord(rid, 10, 2, arrival_s=0.0, send_s=0.0, first_token_s=ttft, chunk_times_s=[ttft, jct],
                         chunk_tokens=[1, 1], finish_s=jct, output_tokens=2, success=True).to_dict()


def test_round_changes_pair_rounds_by_suffix() -> None:
    assert [sbs.round_of(i) for i in ("a", "a#r1", "x#r12", "#r3", "a#rx")] == [0, 1, 12, 0, 0]
    cell = {
        "colocated": {"requests": [_rec("a", 1.0, 2.0), _rec("b", 3.0, 6.0), _rec("a#r1", 2.0, 4.0)]},
        "tetriinfer": {"requests": [_rec("a", 1.0, 1.0), _rec("b", 1.0, 3.0), _rec("a#r1", 3.0, 2.0)]},
        "partial": {"requests": [_rec("a", 1.0, 1.0)]},  # a round missing: left out
    }
    ch = sbs.round_changes(cell)
    assert set(ch) == {"tetriinfer"}
    # round 0: TTFT 1.0 vs 2.0 -> -50%, JCT 2.0 vs 4.0 -> -50%; round 1: TTFT 3.0 vs 2.0 -> +50%, JCT 2 vs 4 -> -50%
    assert ch["tetriinfer"]["ttft"] == pytest.approx([-0.5, 0.5])
    assert ch["tetriinfer"]["jct"] == pytest.approx([-0.5, -0.5])
    table = sbs.round_changes_table({"meta": {"round_changes": {"mixed": ch}}})
    # standard error = sd / sqrt(rounds): 70.7 / sqrt(2) = 50.0
    assert "| mixed | tetriinfer | -50% +50% | +0.0% +- 70.7 (50.0) | -50% -50% | -50.0% +- 0.0 (0.0) |" in table
    assert sbs.round_changes({"tetriinfer": cell["tetriinfer"]}) == {}


def test_load_sweep_probes_once_and_runs_every_fraction(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    speeds = {"colocated": (0.05, 0.004), "tetriinfer": (0.02, 0.002)}
    fake_servers(monkeypatch, speeds)
    probes: list[str] = []
    real_probe = sbs.SideBySide.probe

    def counting_probe(self: sbs.SideBySide, url: str, model: str, column: sbs.Column, name: str) -> float:
        probes.append(name)
        return real_probe(self, url, model, column, name)

    monkeypatch.setattr(sbs.SideBySide, "probe", counting_probe)
    cols = sbs.parse_columns("tetriinfer,colocated", [], [])
    cfg = sbs.SideBySideConfig(
        str(tmp_path), ("lpld",), cols, num_requests=4, probe_requests=4, probe_concurrency=2,
        max_prompt_tokens=300, max_output_tokens=12, progress=False, rate_fractions=(0.5, 1.5),
    )
    result, raw = sbs.SideBySide(cfg, "test").run()
    assert probes == ["lpld"]  # one probe per workload, shared by every fraction
    assert list(result["workloads"]) == ["lpld@50%", "lpld@150%"]
    rates = result["meta"]["rates"]
    probed = rates["lpld@50%"]["probed_rps"]
    assert rates["lpld@150%"]["probed_rps"] == probed
    assert rates["lpld@50%"]["rate_rps"] == pytest.approx(0.5 * probed)
    assert rates["lpld@150%"]["rate_rps"] == pytest.approx(1.5 * probed)
    # the same requests at every load, only the arrival times scaled (x 1/3 from 50% to 150%)
    slow, fast = (raw[k]["colocated"]["requests"] for k in ("lpld@50%", "lpld@150%"))
    assert [r["prompt_tokens"] for r in slow] == [r["prompt_tokens"] for r in fast]
    assert fast[-1]["arrival_s"] == pytest.approx(slow[-1]["arrival_s"] / 3)
    assert raw["lpld@150%"]["colocated"]["workload"]["target_rate"] == pytest.approx(1.5 * probed)
    for cells in result["workloads"].values():
        assert set(cells) == {"tetriinfer", "colocated"} and all(c["completed"] == 4 for c in cells.values())
    points = sbs.load_sweep_points(result)
    assert sorted(points) == [("lpld", "colocated"), ("lpld", "tetriinfer")]
    assert [p[0] for p in points[("lpld", "tetriinfer")]] == [0.5, 1.5]
    md = sbs.markdown_report(result)
    assert "50% / 150% of it (a load sweep" in md and "| lpld@150% |" in md
    plots = sbs.write_plots(result, raw, tmp_path / "plots")
    assert (tmp_path / "plots" / "load_sweep.png") in plots


def test_floor_is_measured_once_per_workload_on_the_baseline(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    SERVERS.clear()
    speeds = {"colocated": (0.05, 0.004), "tetriinfer": (0.02, 0.002)}
    fake_servers(monkeypatch, speeds)
    cols = sbs.parse_columns("tetriinfer,colocated", [], [])
    cfg = sbs.SideBySideConfig(
        str(tmp_path), ("lpld", "mixed"), cols, num_requests=5, probe_requests=4, probe_concurrency=2,
        max_prompt_tokens=300, max_output_tokens=12, progress=False, rate_fractions=(0.5, 1.5), rounds=2,
    )
    result, raw = sbs.SideBySide(cfg, "test").run()
    floors = result["meta"]["floor"]
    assert set(floors) == {"lpld", "mixed"}
    outputs = {name: [r["output_tokens"] for r in raw[f"{name}@50%"]["colocated"]["requests"]
                      if sbs.round_of(r["request_id"]) == 0] for name in floors}
    for name, f in floors.items():
        # alone, the fake answers after 0.05 s and then every 0.004 s: the floor sees exactly that
        assert f["requests"] == 5 and 0.05 <= f["mean_s"] < 0.2 and 0.05 <= f["median_s"] < 0.2
        # TPOT is (JCT - TTFT) / (tokens - 1) as the client sees it: a first token read late (a busy host) shortens
        # it, so only the JCT below is held to the fake's exact timing
        assert 0.002 <= f["tpot_mean_s"] < 0.03
        want_jct = 0.05 + 0.004 * (sum(outputs[name]) / 5 - 1)  # ttft + itl * (tokens - 1), mean over requests
        assert want_jct <= f["jct_mean_s"] < want_jct + 0.15
    # floor requests (tagged user="floor") ran only on colocated, once per workload over both fractions and
    # rounds, one at a time, each with the workload's own output length
    for mode, srv in SERVERS:
        if mode == "tetriinfer":
            assert all(user != "floor" for _, _, user in srv.log)
    coloc = [srv for mode, srv in SERVERS if mode == "colocated"]
    first_round = [(n, inflight) for n, inflight, user in coloc[0].log if user == "floor"]
    assert len(first_round) == 2 * 5 and all(inflight == 1 for _, inflight in first_round)
    assert sorted(n for n, _ in first_round) == sorted(outputs["lpld"] + outputs["mixed"])
    assert all(user != "floor" for _, _, user in coloc[1].log)  # the second round re-uses the floors
    assert all(user is None for _, _, user in coloc[0].log if user != "floor")  # only the floor is tagged
    rows = {r["workload"]: r for r in sbs.floor_rows(result)}
    assert set(rows) == set(result["workloads"]) == {"lpld@50%", "lpld@150%", "mixed@50%", "mixed@150%"}
    for key, r in rows.items():
        base = result["workloads"][key]["colocated"]
        f = floors[key.split("@")[0]]
        assert r["floor_s"] == f["mean_s"] and r["jct_floor_s"] == f["jct_mean_s"]
        assert r["best_change"] == pytest.approx(r["floor_s"] / base["ttft_mean"] - 1)
        assert r["best_jct_change"] == pytest.approx(r["jct_floor_s"] / base["jct_mean"] - 1)
        assert r["over_floor"]["colocated"] == pytest.approx(base["ttft_mean"] / r["floor_s"])
        assert r["jct_over_floor"]["colocated"] == pytest.approx(base["jct_mean"] / r["jct_floor_s"])
        assert r["over_floor"]["tetriinfer"] == pytest.approx(
            result["workloads"][key]["tetriinfer"]["ttft_mean"] / r["floor_s"])
    md = sbs.markdown_report(result)
    assert "## Floor" in md and "| lpld@150% | " in md and "tetriinfer TTFT / JCT over floor" in md
    # a result written before JCT floors existed (meta.ttft_floor, TTFT only) still reports its TTFT floor
    old = {**result, "meta": {**result["meta"], "ttft_floor": {k: {"mean_s": v["mean_s"]} for k, v in floors.items()}}}
    del old["meta"]["floor"]
    old_rows = sbs.floor_rows(old)
    assert [r["floor_s"] for r in old_rows] == [rows[r["workload"]]["floor_s"] for r in old_rows]
    assert all(r["best_jct_change"] is None and r["jct_over_floor"] == {} for r in old_rows)
    assert "| - |" in sbs.floor_table(old)
    # off: nothing measured, no section
    cfg_off = replace(cfg, floor=False, rate_fractions=(0.5,), rounds=1, workloads=("lpld",))
    result_off, _ = sbs.SideBySide(cfg_off, "test").run()
    assert result_off["meta"]["floor"] == {} and "## Floor" not in sbs.markdown_report(result_off)


# --------------------------------------------------------------------------------- a tiny real run


@pytest.mark.slow
def test_tiny_real_side_by_side(tiny_llama: Path, tmp_path: Path) -> None:
    """Two real ``tetriinfer serve`` processes (colocated, then tetriinfer), one small workload, rate auto."""
    from tetriinfer.cli import main

    out, md = tmp_path / "sbs.json", tmp_path / "sbs.md"
    rc = main([
        "bench", "side-by-side", "--model", str(tiny_llama), "--workloads", "lpld",
        "--modes", "tetriinfer,colocated", "-n", "4", "--rate", "auto", "--probe-requests", "3",
        "--probe-concurrency", "2", "--max-prompt-tokens", "200", "--max-output-tokens", "16",
        "--serve-arg", "tetriinfer:--chunk-size 64", "--out", str(out), "--md", str(md), "--no-progress",
    ])
    assert rc == 0
    result = json.loads(out.read_text())
    cells = result["workloads"]["lpld"]
    assert list(cells) == ["tetriinfer", "colocated"]
    for cell in cells.values():
        assert tuple(cell) == sbs.CELL_KEYS
        assert cell["completed"] == 4 and cell["failed"] == 0
        assert cell["resource_s"] > 0 and cell["ttft_mean"] <= cell["jct_mean"]
    assert cells["colocated"]["perf_per_dollar"] == pytest.approx(1.0)
    assert cells["tetriinfer"]["perf_per_dollar"] > 0
    busy = result["meta"]["details"]["lpld"]["tetriinfer"]["busy_per_instance_s"]
    assert set(busy) == {"prefill-0", "decode-0"} and all(v > 0 for v in busy.values())
    assert result["meta"]["rates"]["lpld"]["probed_rps"] > 0
    floor = result["meta"]["floor"]["lpld"]
    assert floor["requests"] == 4 and 0 < floor["mean_s"] <= cells["colocated"]["ttft_mean"] * 3
    assert floor["mean_s"] < floor["jct_mean_s"] <= cells["colocated"]["jct_mean"] * 3
    assert "| lpld | tetriinfer |" in md.read_text() and "## Floor" in md.read_text()


def test_length_scale_scales_trace_workloads_only() -> None:
    """--length-scale shrinks a trace's lengths and hash blocks; synthetic classes keep their own lengths."""
    trace = "trace:" + str(Path(__file__).parent / "fixtures" / "mooncake_conv_head30.jsonl")
    cols = sbs.parse_columns("tetriinfer,colocated")
    unclipped = {"max_prompt_tokens": None, "max_output_tokens": None}
    full = sbs.SideBySide(sbs.SideBySideConfig("m", (trace,), cols, **unclipped))._workload(trace, 10, None, 0)
    quarter = sbs.SideBySide(sbs.SideBySideConfig("m", (trace, "lpld"), cols, length_scale=0.25, **unclipped))
    small = quarter._workload(trace, 10, None, 0)
    for a, b in zip(full.requests, small.requests, strict=True):
        assert b.prompt_tokens == max(1, round(a.prompt_tokens * 0.25))
        assert b.output_tokens == max(1, round(a.output_tokens * 0.25))
        assert b.prefix_blocks == a.prefix_blocks and b.prefix_block_tokens == 128
    assert quarter._workload("lpld", 5, 1.0, 0).requests  # a synthetic class is not rejected by the scale
