"""Per-request benchmark records and their summary, with ``vllm bench serve`` definitions.

Pure: no clock, no I/O. All times are seconds relative to the start of the run (t=0 is when the first
request was due).

Definitions (per successful request; ``vllm bench serve`` in parentheses where it differs):
- TTFT = first streamed token - send time. vLLM also measures from the moment its client sends the request
  (``st = perf_counter()`` before the POST), not from the scheduled arrival, so client lag is excluded;
  we report that lag separately as ``send_lag`` (send - scheduled arrival).
- E2E latency = last streamed token - send time (vLLM's ``latency``: time of the last content chunk).
- JCT = last streamed token - scheduled arrival (the paper's job completion time; equals E2E + send lag).
- TPOT = (E2E - TTFT) / (output_tokens - 1), only for requests with more than one output token; for
  goodput a one-token request counts as TPOT 0 (as in vLLM).
- ITL = the gaps between consecutive streamed chunks that carried tokens. Like vLLM, a chunk that carries
  several tokens yields one gap (so mean ITL can exceed TPOT when servers batch tokens into chunks).
- Percentiles use numpy's linear interpolation (``np.percentile``), like vLLM.
- Throughputs divide by the run duration: completed requests, output tokens of completed requests, and
  prompt + output tokens of completed requests (vLLM's ``total_token_throughput``).
- Goodput = completed requests meeting every given SLO (TTFT, TPOT, E2E; ``<=``) per second of run
  (vLLM's ``request_goodput``; DistServe's "max rate at 90% attainment" is a search over runs of this).
  ``slo_attainment`` = those requests / all requests (failed and rejected ones count as misses).
- Counts: ``completed`` (success), ``failed`` (sent, did not finish: HTTP error, disconnect, timeout),
  ``rejected`` (never sent: too long for the server's context).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means "not constrained"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a positive number of milliseconds, got {value}")

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


@dataclass
class RequestRecord:
    """What one request did. Filled by the client; times relative to run start.

    Invariants for a successful record: ``send_s <= first_token_s == chunk_times_s[0]``,
    ``chunk_times_s`` non-decreasing, ``len(chunk_tokens) == len(chunk_times_s)``, ``output_tokens >= 1``.
    """

    request_id: str
    prompt_tokens: int
    expected_output_tokens: int
    arrival_s: float
    send_s: float | None = None
    first_token_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_s: float | None = None
    output_tokens: int = 0
    success: bool = False
    rejected: bool = False
    error: str | None = None
    http_status: int | None = None

    @property
    def last_token_s(self) -> float | None:
        return self.chunk_times_s[-1] if self.chunk_times_s else None

    @property
    def ttft_s(self) -> float | None:
        if not self.success or self.send_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float | None:
        last = self.last_token_s
        if not self.success or self.send_s is None or last is None:
            return None
        return last - self.send_s

    @property
    def jct_s(self) -> float | None:
        last = self.last_token_s
        return None if not self.success or last is None else last - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output - 1); None for one-token outputs and unsuccessful requests."""
        e2e, ttft = self.e2e_s, self.ttft_s
        if e2e is None or ttft is None or self.output_tokens <= 1:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        if not self.success:
            return []
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def meets(self, slo: SLO) -> bool:
        """True when the request completed and every set SLO holds (``<=``)."""
        if not self.success:
            return False
        ttft, e2e = self.ttft_s, self.e2e_s
        tpot = self.tpot_s if self.output_tokens > 1 else 0.0
        if slo.ttft_ms is not None and (ttft is None or ttft * 1e3 > slo.ttft_ms):
            return False
        if slo.tpot_ms is not None and (tpot is None or tpot * 1e3 > slo.tpot_ms):
            return False
        return not (slo.e2e_ms is not None and (e2e is None or e2e * 1e3 > slo.e2e_ms))

    def to_dict(self) -> dict[str, Any]:
        """``dataclasses.asdict`` without its generic deep copy (a simulated run turns millions into dicts)."""
        out = {name: getattr(self, name) for name in _RECORD_FIELDS}
        out["chunk_times_s"], out["chunk_tokens"] = list(self.chunk_times_s), list(self.chunk_tokens)  # copies
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))


def distribution(values: Sequence[float] | np.ndarray, consume: bool = False) -> dict[str, float | int | None]:
    """count, mean, median, p90, p99, std, min, max (seconds); None values when empty.

    ``consume``: ``values`` is a float64 array the caller gives up: the order statistics partition it in place
    instead of copies (no second array of its size at once). The numbers are the same either way: mean and std
    (order-dependent sums) are taken before anything moves, and the order statistics do not depend on the order."""
    if len(values) == 0:
        return {
            k: (0 if k == "count" else None)
            for k in ("count", "mean", "median", "p90", "p99", "std", "min", "max")
        }
    arr = np.asarray(values, dtype=float)
    mean, std, lo, hi = float(arr.mean()), float(arr.std()), float(arr.min()), float(arr.max())
    in_place = consume and isinstance(values, np.ndarray) and arr is values
    return {
        "count": int(arr.size),
        "mean": mean,
        "median": float(np.median(arr, overwrite_input=in_place)),
        "p90": float(np.percentile(arr, 90, overwrite_input=in_place)),
        "p99": float(np.percentile(arr, 99, overwrite_input=in_place)),
        "std": std,
        "min": lo,
        "max": hi,
    }


def summarize(
    records: list[RequestRecord], duration_s: float | None = None, slo: SLO | None = None
) -> dict[str, Any]:
    """The run summary. ``duration_s`` defaults to the latest finish (or last token) time of any record."""
    slo = slo or SLO()
    ok = [r for r in records if r.success]
    rejected = sum(r.rejected for r in records)
    failed = sum(1 for r in records if not r.success and not r.rejected)
    if duration_s is None:
        ends = [t for r in records for t in (r.finish_s, r.last_token_s) if t is not None]
        duration_s = max(ends) if ends else 0.0
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    good = sum(r.meets(slo) for r in records) if slo.is_set else None
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": failed,
        "rejected": rejected,
        "output_len_mismatch": sum(r.output_tokens != r.expected_output_tokens for r in ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "slo": asdict(slo),
        "good_requests": good,
        "goodput": per_s(good) if good is not None else None,
        "slo_attainment": (good / len(records) if records else None) if good is not None else None,
        "ttft": distribution([v for r in ok if (v := r.ttft_s) is not None]),
        "tpot": distribution([v for r in ok if (v := r.tpot_s) is not None]),
        "itl": distribution(_itls(ok), consume=True),
        "e2e": distribution([v for r in ok if (v := r.e2e_s) is not None]),
        "jct": distribution([v for r in ok if (v := r.jct_s) is not None]),
        "send_lag": distribution([r.send_s - r.arrival_s for r in records if r.send_s is not None]),
        "errors": _error_counts(records),
    }


def _itls(ok: list[RequestRecord]) -> np.ndarray:
    """Every successful request's token gaps (``itls_s``), in record order, as one float64 array: the same values
    (each an IEEE difference of two token times) without a Python float per gap."""
    out = np.empty(sum(max(0, len(r.chunk_times_s) - 1) for r in ok))
    at = 0
    for r in ok:  # each request's gaps written into its slice (np.diff's subtraction, without a list of arrays)
        n = len(r.chunk_times_s) - 1
        if n > 0:
            t = np.asarray(r.chunk_times_s, dtype=float)
            np.subtract(t[1:], t[:-1], out=out[at:at + n])
            at += n
    return out


def _error_counts(records: list[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.success and not r.rejected and r.error:
            key = r.error.split(":", 1)[0][:80]
            counts[key] = counts.get(key, 0) + 1
    return counts


def flat_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """The flat per-(workload, mode) shape used by ``bench side-by-side`` (seconds, req/s).

    ``resource_s`` and ``perf_per_dollar`` need the server's /metrics and a baseline; the caller adds them.
    """
    return {
        "ttft_mean": summary["ttft"]["mean"],
        "ttft_p99": summary["ttft"]["p99"],
        "tpot_mean": summary["tpot"]["mean"],
        "jct_mean": summary["jct"]["mean"],
        "jct_p99": summary["jct"]["p99"],
        "throughput_rps": summary["request_throughput"],
        "goodput_rps": summary["goodput"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "rejected": summary["rejected"],
    }
