"""Workload generation: class constraints, real length distributions, arrivals, trace replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tetriinfer.bench import arrivals
from tetriinfer.bench.workloads import (
    HEAVY_DECODE_TOKENS,
    HEAVY_PREFILL_TOKENS,
    SAMPLE_PATH,
    WorkloadRequest,
    classify,
    default_length_source,
    load_trace,
    load_workload,
    with_max_context,
)

FIX = Path(__file__).parent / "fixtures"
AZURE6 = FIX / "azure_conv_head6.csv"
MOON30 = FIX / "mooncake_conv_head30.jsonl"


def _source_pairs() -> np.ndarray:
    rows = load_trace(default_length_source())
    return np.array([(r.prompt_tokens, r.output_tokens) for r in rows], dtype=float)


def test_mixed_reproduces_trace_length_distribution() -> None:
    pairs = _source_pairs()
    w = load_workload("mixed", 20000, rate=10.0, seed=3)
    got = np.array([(r.prompt_tokens, r.output_tokens) for r in w], dtype=float)
    for col in (0, 1):
        assert got[:, col].mean() == pytest.approx(pairs[:, col].mean(), rel=0.03)
        assert np.median(got[:, col]) == pytest.approx(np.median(pairs[:, col]), rel=0.05)
        assert np.percentile(got[:, col], 90) == pytest.approx(np.percentile(pairs[:, col], 90), rel=0.05)
    # pairs are kept together: the (weak, negative) prompt/output correlation survives
    assert np.corrcoef(got.T)[0, 1] == pytest.approx(np.corrcoef(pairs.T)[0, 1], abs=0.05)


@pytest.mark.parametrize("name", ["lpld", "lphd", "hpld", "hphd"])
def test_class_constraints_and_conditional_distribution(name: str) -> None:
    w = load_workload(name, 4000, rate=5.0, seed=11)
    assert len(w) == 4000 and w.num_rejected == 0
    for r in w:
        assert classify(r.prompt_tokens, r.output_tokens) == name
        assert (r.prompt_tokens > HEAVY_PREFILL_TOKENS) == (name[:2] == "hp")
        assert (r.output_tokens > HEAVY_DECODE_TOKENS) == (name[2:] == "hd")
    pairs = _source_pairs()
    in_class = np.array([classify(int(p), int(o)) == name for p, o in pairs])
    ref = pairs[in_class]
    got = np.array([(r.prompt_tokens, r.output_tokens) for r in w], dtype=float)
    assert got[:, 0].mean() == pytest.approx(ref[:, 0].mean(), rel=0.05)
    assert got[:, 1].mean() == pytest.approx(ref[:, 1].mean(), rel=0.05)


def test_caps_condition_the_pool_and_max_context_marks_rejections() -> None:
    w = load_workload("hphd", 2000, seed=1, max_prompt_tokens=1536, max_output_tokens=400)
    assert all(HEAVY_PREFILL_TOKENS < r.prompt_tokens <= 1536 for r in w)
    assert all(HEAVY_DECODE_TOKENS < r.output_tokens <= 400 for r in w)
    assert w.arrival_process == "burst" and all(r.arrival_s == 0.0 for r in w)
    w = load_workload("mixed", 2000, seed=1, max_context=1024)
    too_long = [r for r in w if r.prompt_tokens + r.output_tokens > 1024]
    assert too_long and len(w) == 2000  # kept, not dropped
    assert all(r.rejected and "1024" in (r.reject_reason or "") for r in too_long)
    assert w.num_rejected == len(too_long)
    with pytest.raises(ValueError, match="no \\(prompt, output\\) pairs"):
        load_workload("hpld", 10, max_prompt_tokens=400)


def test_deterministic_by_seed() -> None:
    a = load_workload("lphd", 300, rate=2.0, seed=5)
    b = load_workload("lphd", 300, rate=2.0, seed=5)
    c = load_workload("lphd", 300, rate=2.0, seed=6)
    assert a.requests == b.requests
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in c]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]


def test_poisson_and_gamma_rates() -> None:
    w = load_workload("mixed", 20000, rate=8.0, seed=2)
    gaps = np.diff([r.arrival_s for r in w])
    assert w.requests[0].arrival_s == 0.0
    assert 1.0 / gaps.mean() == pytest.approx(8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps
    g = load_workload("mixed", 20000, rate=8.0, seed=2, arrival="gamma", burstiness_cv=3.0)
    gaps = np.diff([r.arrival_s for r in g])
    assert 1.0 / gaps.mean() == pytest.approx(8.0, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)
    assert arrivals.rescale_to_rate(arrivals.gamma_arrivals(50, 1.0, 2.0, 0), 7.5)[-1] == pytest.approx(
        49 / 7.5
    )


def test_trace_csv_replay_timescale_and_rate() -> None:
    w = load_workload(f"trace:{AZURE6}", 6)
    assert [r.prompt_tokens for r in w] == [374, 396, 879, 91, 91, 381]
    assert [r.output_tokens for r in w] == [44, 109, 55, 16, 16, 84]
    assert w.requests[1].arrival_s == pytest.approx(50.9951690 - 46.6805900)
    assert w.requests[5].arrival_s == pytest.approx(52.9921190 - 46.6805900)
    first4 = load_workload(f"trace:{AZURE6}", 4, trace_timescale=2.0)
    assert len(first4) == 4
    assert first4.requests[3].arrival_s == pytest.approx(2 * (51.3910170 - 46.6805900))
    fast = load_workload(f"trace:{AZURE6}", 6, rate=2.0)
    assert arrivals.observed_rate([r.arrival_s for r in fast]) == pytest.approx(2.0)
    # shape is preserved: gaps keep their proportions
    ratio = np.diff([r.arrival_s for r in fast]) / np.diff([r.arrival_s for r in w])
    assert np.allclose(ratio, ratio[0])
    with pytest.raises(ValueError, match="only 6 requests"):
        load_workload(f"trace:{AZURE6}", 7)
    with pytest.raises(ValueError, match="not both"):
        load_workload(f"trace:{AZURE6}", 3, rate=1.0, trace_timescale=2.0)


@pytest.mark.parametrize("path", [MOON30, FIX / "mooncake_conv_head30_noext"])
def test_trace_jsonl_replay(path: Path) -> None:
    w = load_workload(f"trace:{path}", 30, max_context=8192)
    assert w.requests[0].prompt_tokens == 6758 and w.requests[0].output_tokens == 500
    assert w.requests[10].arrival_s == pytest.approx(3.0)  # ms -> s
    assert w.requests[29].arrival_s == pytest.approx(9.0)
    assert all(r.rejected == (r.prompt_tokens + r.output_tokens > 8192) for r in w)
    assert 0 < w.num_rejected < 30
    w2 = load_workload(f"trace:{path}", 30, rate=3.0)
    assert arrivals.observed_rate([r.arrival_s for r in w2]) == pytest.approx(3.0)
    clipped = load_workload(f"trace:{path}", 30, max_prompt_tokens=2000, max_output_tokens=100)
    assert max(r.prompt_tokens for r in clipped) == 2000 and max(r.output_tokens for r in clipped) == 100
    assert clipped.notes and "clipped" in clipped.notes[0]
    with pytest.raises(ValueError, match="same instant"):
        load_workload(f"trace:{path}", 10, rate=1.0)  # the first 10 rows share timestamp 0


def test_trace_with_synthetic_arrivals() -> None:
    w = load_workload(f"trace:{MOON30}", 30, rate=4.0, arrival="poisson", seed=1)
    assert w.arrival_process == "poisson"
    assert [r.prompt_tokens for r in w][:2] == [6758, 7322]


def test_fallback_to_shipped_sample(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TETRIINFER_DATA_DIR", str(tmp_path))
    assert default_length_source() == SAMPLE_PATH
    assert len(load_trace(SAMPLE_PATH)) == 2000
    w = load_workload("lpld", 100, rate=1.0, seed=0)
    assert w.source == str(SAMPLE_PATH) and all(
        classify(r.prompt_tokens, r.output_tokens) == "lpld" for r in w
    )


def test_bad_names_and_values() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("chat", 5)
    with pytest.raises(FileNotFoundError):
        load_workload("trace:/nonexistent/x.csv", 5)
    with pytest.raises(ValueError, match="num_requests"):
        load_workload("mixed", 0)
    with pytest.raises(ValueError, match="rate"):
        load_workload("mixed", 5, rate=-1.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        WorkloadRequest("r", 0.0, 0, 5)
    with pytest.raises(ValueError, match="sorted"):
        arrivals.trace_arrivals([1.0, 0.5])


def test_with_max_context_and_roundtrip() -> None:
    w = with_max_context(load_workload(f"trace:{AZURE6}", 6), 400)
    assert [r.rejected for r in w] == [True, True, True, False, False, True]
    r = w.requests[0]
    assert WorkloadRequest.from_dict(r.to_dict()) == r
    assert w.describe()["num_rejected"] == 4


def test_stepped_workload_follows_its_rate_profile() -> None:
    """Each phase's arrivals fall inside it at about its rate (Poisson); ids say the phase; bad profiles are
    refused with a clear message."""
    from tetriinfer.bench.workloads import parse_rate_profile, stepped_workload

    phases = parse_rate_profile("2:100,10:100,2:100")
    assert phases == [(2.0, 100.0), (10.0, 100.0), (2.0, 100.0)]
    wl = stepped_workload("mixed", phases, seed=3, max_output_tokens=256)
    per_phase = [[r for r in wl.requests if r.request_id.startswith(f"p{i}-")] for i in range(3)]
    for i, (rate, secs) in enumerate(phases):
        got = per_phase[i]
        assert all(100 * i <= r.arrival_s < 100 * (i + 1) for r in got)
        assert 0.7 * rate * secs <= len(got) <= 1.05 * rate * secs  # draws arriving after the phase are dropped
    assert len(per_phase[1]) > 3 * len(per_phase[0])
    assert all(r.output_tokens <= 256 for r in wl.requests)
    assert stepped_workload("mixed", phases, seed=3, max_output_tokens=256).requests == wl.requests
    for bad in ("", "2", "2:60,x:3", "0:60", "2:-1"):
        with pytest.raises(ValueError, match="rate profile"):
            parse_rate_profile(bad)


def test_bench_workload_cli_takes_a_rate_profile(capsys: pytest.CaptureFixture[str]) -> None:
    from tetriinfer.cli import main

    assert main(["bench", "workload", "-w", "lpld", "--rate-profile", "1:20,4:20"]) == 0
    assert "rate profile 1:20,4:20" in capsys.readouterr().out
    assert main(["bench", "workload", "-w", "lpld", "--rate-profile", "1:20", "--rate", "3"]) == 2


def test_mooncake_hash_blocks_scale_and_share_exact_prefixes() -> None:
    """``--length-scale`` keeps a Mooncake trace's sharing: equal leading hash ids give equal leading tokens."""
    from tetriinfer.bench.client import PromptBuilder

    w = load_workload(f"trace:{MOON30}", 30, length_scale=1 / 16)
    first, second = w.requests[0], w.requests[1]
    assert first.prompt_tokens == round(6758 / 16) and first.output_tokens == round(500 / 16)
    assert first.prefix_blocks[:2] == (0, 1) and second.prefix_blocks[:2] == (0, 14)
    assert first.prefix_block_tokens == 32 and any("scaled" in n for n in w.notes)
    assert WorkloadRequest.from_dict(first.to_dict()) == first
    pb = PromptBuilder(None, seed=3)
    a = pb.build_from_blocks(0, first.prompt_tokens, first.prefix_blocks, 32)
    b = pb.build_from_blocks(1, second.prompt_tokens, second.prefix_blocks, 32)
    assert len(a) == first.prompt_tokens and len(b) == second.prompt_tokens
    assert a[:32] == b[:32] and a[32:64] != b[32:64]  # hash 0 shared, then 1 vs 14
    assert pb.build_from_blocks(5, 70, (0, 1), 32)[:64] == a[:64]  # fewer blocks than tokens: own tail
    assert len(pb.build_from_blocks(5, 70, (0, 1), 32)) == 70
    from tetriinfer.bench.client import BenchmarkClient, ClientConfig

    client = BenchmarkClient(ClientConfig("http://127.0.0.1:1", "m", seed=3))
    assert client.payload(0, first)["prompt"] == a  # what the server receives: these exact token ids
    full = load_workload(f"trace:{MOON30}", 3)
    assert full.requests[0].prefix_block_tokens == 512 and full.requests[0].prompt_tokens == 6758
    with pytest.raises(ValueError, match="length_scale"):
        load_workload("mixed", 5, length_scale=0.5)
    with pytest.raises(ValueError, match="length_scale"):
        load_workload(f"trace:{MOON30}", 5, length_scale=0)
