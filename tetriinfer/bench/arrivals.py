"""Arrival processes for open-loop load: Poisson, gamma (bursty), and trace timestamps.

Pure functions: no clock, no I/O. Every function returns arrival times in seconds relative to the
start of the run, non-decreasing, with the first arrival at exactly 0.0 (the run starts when the first
request is due). Random processes are deterministic for a given ``seed``.

Rate convention: for ``n`` arrivals spanning ``T`` seconds the rate is ``(n - 1) / T`` (the number of
inter-arrival gaps over the span, i.e. the inverse of the mean gap). ``rescale_to_rate`` makes that
rate exact; the random processes have it in expectation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def _check_n(n: int) -> None:
    if n < 0:
        raise ValueError(f"number of arrivals must be >= 0, got {n}")


def _check_rate(rate: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive finite number of requests/s, got {rate}")


def burst_arrivals(n: int) -> list[float]:
    """All ``n`` requests due at t=0 (``vllm bench serve`` with ``--request-rate inf``)."""
    _check_n(n)
    return [0.0] * n


def gamma_arrivals(n: int, rate: float, cv: float, seed: int) -> list[float]:
    """Arrivals whose gaps are i.i.d. gamma with mean ``1/rate`` and coefficient of variation ``cv``.

    ``cv == 1`` is a Poisson process (exponential gaps); ``cv > 1`` is burstier, ``cv < 1`` smoother.
    (vLLM's ``--burstiness`` is the gamma shape ``k``; here ``k = 1 / cv**2``.)
    """
    _check_n(n)
    _check_rate(rate)
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"burstiness cv must be a positive finite number, got {cv}")
    if n == 0:
        return []
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    gaps = np.random.default_rng(seed).gamma(shape, scale, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """A Poisson process at ``rate`` requests/s (exponential gaps with mean ``1/rate``)."""
    return gamma_arrivals(n, rate, 1.0, seed)


def trace_arrivals(timestamps_s: Sequence[float], timescale: float = 1.0) -> list[float]:
    """Trace timestamps (seconds, any origin) shifted so the first is 0, gaps multiplied by ``timescale``.

    ``timescale`` 2.0 stretches the trace to twice its length (half the rate); 0.5 compresses it (twice
    the rate). Timestamps must be sorted: a trace replay never reorders requests.
    """
    if not (timescale > 0 and math.isfinite(timescale)):
        raise ValueError(f"trace timescale must be a positive finite number, got {timescale}")
    if not timestamps_s:
        return []
    t0 = float(timestamps_s[0])
    out: list[float] = []
    prev = t0
    for i, t in enumerate(timestamps_s):
        if t < prev:
            raise ValueError(
                f"trace timestamps must be sorted; entry {i} ({t}) is before entry {i - 1} ({prev})"
            )
        prev = t
        out.append((float(t) - t0) * timescale)
    return out


def observed_rate(arrivals_s: Sequence[float]) -> float | None:
    """``(n - 1) / span`` of the arrivals, or None when undefined (fewer than 2 arrivals or zero span)."""
    if len(arrivals_s) < 2:
        return None
    span = arrivals_s[-1] - arrivals_s[0]
    if span <= 0:
        return None
    return (len(arrivals_s) - 1) / span


def rescale_to_rate(arrivals_s: Sequence[float], rate: float) -> list[float]:
    """Scale the arrivals' gaps uniformly so that ``observed_rate`` equals ``rate`` exactly.

    The shape of the process (burstiness, order) is preserved. Raises ValueError when the input has no
    defined rate (all requests at the same instant) since there is nothing to scale.
    """
    _check_rate(rate)
    if len(arrivals_s) < 2:
        return [0.0] * len(arrivals_s)
    current = observed_rate(arrivals_s)
    if current is None:
        raise ValueError("cannot rescale arrivals to a rate: all requests arrive at the same instant")
    factor = current / rate
    t0 = arrivals_s[0]
    return [(t - t0) * factor for t in arrivals_s]


def make_arrivals(n: int, process: str, rate: float | None, seed: int, cv: float = 1.0) -> list[float]:
    """Synthetic arrivals by name: ``poisson`` or ``gamma`` at ``rate``; ``rate is None`` means a burst."""
    if rate is None:
        return burst_arrivals(n)
    if process == "poisson":
        if cv != 1.0:
            raise ValueError("a burstiness cv other than 1 needs the gamma arrival process")
        return poisson_arrivals(n, rate, seed)
    if process == "gamma":
        return gamma_arrivals(n, rate, cv, seed)
    raise ValueError(f"unknown arrival process {process!r}; expected 'poisson' or 'gamma'")
