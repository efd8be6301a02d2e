"""Benchmark metrics against hand-computed examples (vllm bench serve definitions)."""

from __future__ import annotations

import pytest

from tetriinfer.bench.metrics import SLO, RequestRecord, distribution, flat_summary, summarize


def _records() -> list[RequestRecord]:
    a = RequestRecord(
        "a",
        10,
        4,
        arrival_s=0.0,
        send_s=0.1,
        first_token_s=0.3,
        chunk_times_s=[0.3, 0.4, 0.6],
        chunk_tokens=[1, 1, 2],
        finish_s=0.61,
        output_tokens=4,
        success=True,
    )
    b = RequestRecord(
        "b",
        20,
        1,
        arrival_s=1.0,
        send_s=1.0,
        first_token_s=1.5,
        chunk_times_s=[1.5],
        chunk_tokens=[1],
        finish_s=1.5,
        output_tokens=1,
        success=True,
    )
    c = RequestRecord(
        "c",
        30,
        5,
        arrival_s=2.0,
        send_s=2.05,
        first_token_s=2.25,
        chunk_times_s=[2.25, 2.35, 2.45, 2.55, 2.65],
        chunk_tokens=[1] * 5,
        finish_s=2.7,
        output_tokens=5,
        success=True,
    )
    d = RequestRecord(
        "d", 40, 8, arrival_s=3.0, send_s=3.0, finish_s=3.01, error="HTTP 500: boom", http_status=500
    )
    e = RequestRecord("e", 5000, 8, arrival_s=3.5, rejected=True, error="too long")
    return [a, b, c, d, e]


def test_per_request_definitions() -> None:
    a, b, c, d, e = _records()
    assert a.ttft_s == pytest.approx(0.2)
    assert a.e2e_s == pytest.approx(0.5)  # last token - send
    assert a.jct_s == pytest.approx(0.6)  # last token - scheduled arrival
    assert a.tpot_s == pytest.approx(0.1)  # (0.5 - 0.2) / (4 - 1)
    assert a.itls_s == pytest.approx([0.1, 0.2])  # one gap per chunk, even for the 2-token chunk
    assert b.tpot_s is None and b.itls_s == []
    assert d.ttft_s is None and d.jct_s is None and d.tpot_s is None
    assert e.itls_s == []


def test_summary_hand_computed() -> None:
    s = summarize(_records(), duration_s=4.0)
    assert (s["num_requests"], s["completed"], s["failed"], s["rejected"]) == (5, 3, 1, 1)
    assert s["output_len_mismatch"] == 0
    # TTFT [0.2, 0.5, 0.2]: numpy linear percentiles on sorted [0.2, 0.2, 0.5]
    assert s["ttft"]["mean"] == pytest.approx(0.3)
    assert s["ttft"]["median"] == pytest.approx(0.2)
    assert s["ttft"]["p90"] == pytest.approx(0.2 + 0.8 * 0.3)
    assert s["ttft"]["p99"] == pytest.approx(0.2 + 0.98 * 0.3)
    assert s["tpot"]["count"] == 2 and s["tpot"]["mean"] == pytest.approx(0.1)
    # ITL gaps: a -> [0.1, 0.2], c -> [0.1] * 4
    assert s["itl"]["count"] == 6
    assert s["itl"]["mean"] == pytest.approx(0.7 / 6)
    assert s["itl"]["median"] == pytest.approx(0.1)
    assert s["itl"]["p90"] == pytest.approx(0.15)
    assert s["itl"]["max"] == pytest.approx(0.2)
    assert s["e2e"]["mean"] == pytest.approx((0.5 + 0.5 + 0.6) / 3)
    assert s["jct"]["mean"] == pytest.approx((0.6 + 0.5 + 0.65) / 3)
    assert s["send_lag"]["max"] == pytest.approx(0.1)
    # throughputs over the 4 s run, completed requests only
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["total_output_tokens"] == 10 and s["total_input_tokens"] == 60
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert s["goodput"] is None and s["good_requests"] is None
    assert s["errors"] == {"HTTP 500": 1}


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        (SLO(ttft_ms=300, tpot_ms=150), 2),  # b misses TTFT
        (SLO(ttft_ms=600), 3),
        (SLO(tpot_ms=50), 1),  # only b: a one-token request counts as TPOT 0
        (SLO(e2e_ms=550), 2),  # c has E2E 0.6
        (SLO(ttft_ms=100), 0),
    ],
)
def test_goodput(slo: SLO, good: int) -> None:
    s = summarize(_records(), duration_s=4.0, slo=slo)
    assert s["good_requests"] == good
    assert s["goodput"] == pytest.approx(good / 4.0)
    assert s["slo_attainment"] == pytest.approx(good / 5)


def test_default_duration_is_latest_finish() -> None:
    s = summarize(_records())
    assert s["duration_s"] == pytest.approx(3.01)
    assert s["request_throughput"] == pytest.approx(3 / 3.01)


def test_empty_and_all_failed() -> None:
    s = summarize([], duration_s=0.0)
    assert s["completed"] == 0 and s["ttft"]["mean"] is None and s["request_throughput"] is None
    failed = [RequestRecord("x", 5, 5, 0.0, send_s=0.0, finish_s=1.0, error="ReadError: x")]
    s = summarize(failed, slo=SLO(ttft_ms=1000))
    assert s["failed"] == 1 and s["good_requests"] == 0 and s["ttft"]["count"] == 0


def test_output_mismatch_counted() -> None:
    r = RequestRecord(
        "m",
        5,
        10,
        0.0,
        send_s=0.0,
        first_token_s=0.1,
        chunk_times_s=[0.1, 0.2],
        chunk_tokens=[1, 1],
        finish_s=0.2,
        output_tokens=2,
        success=True,
    )
    assert summarize([r])["output_len_mismatch"] == 1


def test_distribution_and_flat() -> None:
    d = distribution([1.0, 2.0, 3.0, 4.0])
    assert d["median"] == 2.5 and d["p90"] == pytest.approx(3.7) and d["std"] == pytest.approx(1.118034, 1e-6)
    flat = flat_summary(summarize(_records(), duration_s=4.0))
    assert flat["ttft_mean"] == pytest.approx(0.3) and flat["completed"] == 3 and flat["failed"] == 1
    assert flat["jct_p99"] == pytest.approx(0.6 + 0.98 * 0.05)


def test_record_roundtrip_and_slo_validation() -> None:
    r = _records()[0]
    assert RequestRecord.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="tpot_ms"):
        SLO(tpot_ms=-1)


def test_itl_gaps_and_consumed_distribution_match_the_plain_computation() -> None:
    """``_itls`` writes every gap into one array (no list of per-request arrays) and ``distribution(...,
    consume=True)`` partitions it in place: the summary's numbers equal the plain concatenation's, bit for bit."""
    import random
    from array import array

    import numpy as np

    from tetriinfer.bench.metrics import RequestRecord, _itls, distribution

    rng = random.Random(3)
    recs = []
    for i in range(300):
        t, times = rng.random(), array("d")
        for _ in range(rng.randint(0, 40)):
            t += rng.expovariate(30.0)
            times.append(t)
        rec = RequestRecord(f"r{i}", 10, len(times), 0.0, chunk_times_s=times)  # type: ignore[arg-type]
        rec.success = True
        recs.append(rec)
    gaps = [np.diff(np.asarray(r.chunk_times_s, dtype=float)) for r in recs if len(r.chunk_times_s) > 1]
    plain = np.concatenate(gaps)
    fast = _itls(recs)
    assert fast.tobytes() == plain.tobytes()
    assert distribution(fast, consume=True) == distribution(plain.tolist())
    assert distribution(np.empty(0), consume=True)["count"] == 0
