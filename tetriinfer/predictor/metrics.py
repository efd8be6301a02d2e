"""Accuracy metrics and the two baselines a length predictor must beat.

- majority: always the most frequent training bucket;
- prompt length: a least-squares line ``output_tokens ~ a + b * prompt_tokens`` fit on the training split,
  bucketed at evaluation time (so it works at any granularity).
Spearman correlation compares predicted lengths (bucket midpoints) with true lengths; it is ``None``
when undefined (a constant prediction, e.g. the majority baseline).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from tetriinfer.predictor.buckets import BucketSpec


@dataclass(frozen=True)
class LengthBaseline:
    """``output_tokens ~ intercept + slope * prompt_tokens`` (fit on the training split)."""

    intercept: float
    slope: float

    @classmethod
    def fit(
        cls, prompt_tokens: np.ndarray | list[int], output_tokens: np.ndarray | list[int]
    ) -> LengthBaseline:
        x = np.asarray(prompt_tokens, dtype=np.float64)
        y = np.asarray(output_tokens, dtype=np.float64)
        if x.size == 0:
            raise ValueError("cannot fit the prompt-length baseline on an empty training set")
        if x.size < 2 or np.ptp(x) == 0:
            return cls(intercept=float(y.mean()), slope=0.0)
        slope, intercept = np.polyfit(x, y, 1)
        return cls(intercept=float(intercept), slope=float(slope))

    def predict_lengths(self, prompt_tokens: np.ndarray | list[int]) -> np.ndarray:
        x = np.asarray(prompt_tokens, dtype=np.float64)
        return np.maximum(0.0, self.intercept + self.slope * x)

    def predict_buckets(self, prompt_tokens: np.ndarray | list[int], spec: BucketSpec) -> np.ndarray:
        return spec.buckets_of(np.round(self.predict_lengths(prompt_tokens)).astype(np.int64))

    def to_json(self) -> dict[str, float]:
        return {"intercept": self.intercept, "slope": self.slope}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LengthBaseline:
        return cls(intercept=float(data["intercept"]), slope=float(data["slope"]))


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    from scipy.stats import spearmanr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rho = float(spearmanr(a, b).statistic)
    return None if math.isnan(rho) else rho


def confusion(true_buckets: np.ndarray, pred_buckets: np.ndarray, num_buckets: int) -> np.ndarray:
    """``m[t, p]`` = number of rows with true bucket t predicted as p."""
    m = np.zeros((num_buckets, num_buckets), dtype=np.int64)
    np.add.at(m, (np.asarray(true_buckets), np.asarray(pred_buckets)), 1)
    return m


def majority_bucket(histogram: list[int] | np.ndarray) -> int:
    h = np.asarray(histogram)
    if h.sum() <= 0:
        raise ValueError("empty training histogram")
    return int(np.argmax(h))


def coarsen_histogram(histogram: list[int], fine: BucketSpec, coarse: BucketSpec) -> np.ndarray:
    return fine.coarsen_probs(np.asarray(histogram, dtype=np.float64), coarse)


def granularity_report(
    probs: np.ndarray,
    true_lengths: np.ndarray,
    prompt_tokens: np.ndarray,
    spec: BucketSpec,
    train_histogram: np.ndarray,
    baseline: LengthBaseline,
) -> dict[str, Any]:
    """Metrics at one granularity; ``probs`` is (n, spec.num_buckets), already coarsened to ``spec``."""
    true_lengths = np.asarray(true_lengths)
    n = int(true_lengths.size)
    if n == 0:
        raise ValueError("no rows to evaluate")
    truth = spec.buckets_of(true_lengths)
    pred = probs.argmax(axis=1)
    mids = spec.midpoints()
    expected = probs @ mids
    maj = majority_bucket(train_histogram)
    base_pred = baseline.predict_buckets(prompt_tokens, spec)
    return {
        "accuracy": float(np.mean(pred == truth)),
        "within_one": float(np.mean(np.abs(pred - truth) <= 1)),
        "spearman": spearman(mids[pred], true_lengths),
        "spearman_expected": spearman(expected, true_lengths),
        "mae_tokens": float(np.mean(np.abs(expected - true_lengths))),
        "majority_accuracy": float(np.mean(truth == maj)),
        "majority_within_one": float(np.mean(np.abs(truth - maj) <= 1)),
        "length_baseline_accuracy": float(np.mean(base_pred == truth)),
        "length_baseline_within_one": float(np.mean(np.abs(base_pred - truth) <= 1)),
        "length_baseline_spearman": spearman(mids[base_pred], true_lengths),
        "n": n,
        "confusion": confusion(truth, pred, spec.num_buckets).tolist(),
    }


def nll(probs: np.ndarray, buckets: np.ndarray, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood of the true buckets."""
    p = probs[np.arange(len(buckets)), np.asarray(buckets)]
    return float(-np.mean(np.log(np.clip(p, eps, 1.0))))


def expected_calibration_error(probs: np.ndarray, buckets: np.ndarray, bins: int = 10) -> float:
    """Top-label ECE: |confidence - accuracy| averaged over equal-width confidence bins."""
    conf = probs.max(axis=1)
    correct = probs.argmax(axis=1) == np.asarray(buckets)
    edges = np.linspace(0.0, 1.0, bins + 1)
    ece = 0.0
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        mask = (conf > lo) & (conf <= hi)
        if mask.any():
            ece += mask.mean() * abs(conf[mask].mean() - correct[mask].mean())
    return float(ece)
