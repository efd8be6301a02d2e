"""Online refinement: recalibration improves calibration on a shifted sample; the buffer is bounded."""

from __future__ import annotations

import numpy as np
import pytest

from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.metrics import expected_calibration_error, nll
from tetriinfer.predictor.refine import OnlineCalibrator, RefineConfig, fit_temperature_bias

SPEC = BucketSpec(granularity=200, num_buckets=5)


def shifted_sample(rng: np.random.Generator, n: int, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A predictor calibrated for a uniform prior and overconfident (sharp likelihood) queried on a
    sample drawn from ``prior``: returns (predicted probs, true lengths)."""
    k = SPEC.num_buckets
    buckets = rng.choice(k, size=n, p=prior)
    x = buckets + rng.normal(0.0, 1.0, size=n)  # feature: noisy bucket index
    logits = -((x[:, None] - np.arange(k)[None, :]) ** 2) / (2 * 0.5**2)  # assumes sigma 0.5, truly 1.0
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    lengths = buckets * SPEC.granularity + rng.integers(0, SPEC.granularity, size=n)
    return probs, lengths


PRIOR = np.array([0.05, 0.1, 0.15, 0.5, 0.2])


def test_recalibration_improves_nll_and_ece_on_a_shifted_sample() -> None:
    rng = np.random.default_rng(0)
    cal = OnlineCalibrator(SPEC, RefineConfig(capacity=1000, min_samples=100))
    train_p, train_len = shifted_sample(rng, 1500, PRIOR)
    for p, n in zip(train_p, train_len, strict=True):
        cal.observe(p, int(n))
    assert len(cal) == 1000  # bounded buffer keeps the latest 1000
    assert cal.refit()
    temperature, bias = cal.params  # type: ignore[misc]
    assert temperature > 1.2  # the model was overconfident
    assert bias[3] > bias[0]  # bucket 3 is ten times more frequent than bucket 0 in the served mix

    test_p, test_len = shifted_sample(rng, 3000, PRIOR)
    truth = SPEC.buckets_of(test_len)
    after = cal.apply(test_p)
    np.testing.assert_allclose(after.sum(1), 1.0)
    assert nll(after, truth) < nll(test_p, truth) - 0.05
    assert expected_calibration_error(after, truth) < expected_calibration_error(test_p, truth) / 2
    assert np.mean(after.argmax(1) == truth) >= np.mean(test_p.argmax(1) == truth)


def test_identity_until_enough_samples_and_well_calibrated_input_is_left_alone() -> None:
    rng = np.random.default_rng(1)
    cal = OnlineCalibrator(SPEC, RefineConfig(min_samples=50))
    p = rng.dirichlet(np.ones(SPEC.num_buckets), size=4)
    for row in p:
        cal.observe(row, 10)
    assert not cal.refit()
    np.testing.assert_array_equal(cal.apply(p), p)
    # labels drawn from the predicted distribution: the fit stays near T = 1, b = 0
    probs = rng.dirichlet(np.ones(SPEC.num_buckets) * 0.7, size=4000)
    labels = np.array([rng.choice(SPEC.num_buckets, p=row) for row in probs])
    temperature, bias = fit_temperature_bias(probs, labels)
    assert abs(temperature - 1.0) < 0.1
    assert np.abs(bias - bias.mean()).max() < 0.15


def test_background_refit_runs_off_the_caller_thread() -> None:
    rng = np.random.default_rng(2)
    cal = OnlineCalibrator(SPEC, RefineConfig(capacity=256, min_samples=64, refit_every=64, background=True))
    probs, lengths = shifted_sample(rng, 200, PRIOR)
    for p, n in zip(probs, lengths, strict=True):
        cal.observe(p, int(n))
    cal.wait(timeout=10)
    assert cal.fits >= 1 and cal.params is not None
    with pytest.raises(ValueError, match="entries"):
        cal.observe(np.ones(3) / 3, 5)


def test_refine_config_validation() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        RefineConfig(capacity=10, min_samples=20)
    with pytest.raises(ValueError, match="capacity"):
        RefineConfig(capacity=0)
