"""Online refinement (beyond the paper; off by default): recalibrating bucket probabilities from
served requests.

Served requests report (the predicted probabilities, the true output length). A bounded buffer keeps
the latest ``capacity`` of them. A refit learns a temperature ``T`` and a per-bucket log-prior shift
``b`` minimising ``NLL + l2 * |b|^2`` on the buffer; ``apply`` then maps ``p -> softmax(log p / T + b)``.
The bias corrects label shift (the served mix has a different length prior than the training set),
the temperature corrects over/under-confidence.

Invariants: the buffer never holds more than ``capacity`` samples; before ``min_samples`` observations
``apply`` is the identity; parameters are swapped atomically, so ``apply`` may run concurrently with a
background refit and always sees one consistent (T, b) pair.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from tetriinfer.predictor.buckets import BucketSpec

_EPS = 1e-9


@dataclass(frozen=True)
class RefineConfig:
    capacity: int = 4096
    min_samples: int = 64
    refit_every: int = 64
    l2: float = 1e-2
    max_iter: int = 200
    background: bool = False

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not 1 <= self.min_samples <= self.capacity:
            raise ValueError(f"min_samples must be in [1, capacity], got {self.min_samples}")
        if self.refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {self.refit_every}")
        if self.l2 < 0 or self.max_iter < 1:
            raise ValueError("l2 must be >= 0 and max_iter >= 1")


def _scaled(logp: np.ndarray, temperature: float, bias: np.ndarray) -> np.ndarray:
    z = logp / temperature + bias
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def fit_temperature_bias(
    probs: np.ndarray, buckets: np.ndarray, l2: float = 1e-2, max_iter: int = 200
) -> tuple[float, np.ndarray]:
    """Minimise mean NLL of ``softmax(log p / T + b)`` plus ``l2 * |b|^2`` (L-BFGS, analytic gradient)."""
    from scipy.optimize import minimize

    logp = np.log(np.clip(probs, _EPS, 1.0))
    n, k = probs.shape
    onehot = np.zeros((n, k))
    onehot[np.arange(n), buckets] = 1.0

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        inv_t, bias = np.exp(theta[0]), theta[1:]
        z = logp * inv_t + bias
        z = z - z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1))
        q = np.exp(z - lse[:, None])
        loss = float(np.mean(lse - (z * onehot).sum(axis=1))) + l2 * float(bias @ bias)
        diff = (q - onehot) / n
        g_bias = diff.sum(axis=0) + 2 * l2 * bias
        g_log_inv_t = float((diff * logp).sum()) * inv_t
        return loss, np.concatenate([[g_log_inv_t], g_bias])

    res = minimize(objective, np.zeros(k + 1), jac=True, method="L-BFGS-B", options={"maxiter": max_iter})
    return float(1.0 / np.exp(res.x[0])), res.x[1:].copy()


class OnlineCalibrator:
    """Bounded buffer of served (probs, true bucket) pairs and the recalibration fit on it."""

    def __init__(self, spec: BucketSpec, config: RefineConfig | None = None) -> None:
        self.spec = spec
        self.config = config or RefineConfig()
        self._buffer: deque[tuple[np.ndarray, int]] = deque(maxlen=self.config.capacity)
        self._lock = threading.Lock()
        self._fit_lock = threading.Lock()
        self._params: tuple[float, np.ndarray] | None = None
        self._since_fit = 0
        self._thread: threading.Thread | None = None
        self.fits = 0

    def __len__(self) -> int:
        return len(self._buffer)

    @property
    def params(self) -> tuple[float, np.ndarray] | None:
        return self._params

    def observe(self, probs: np.ndarray | list[float], true_length: int) -> None:
        """Record one served request; in background mode, start a refit every ``refit_every`` samples."""
        p = np.asarray(probs, dtype=np.float64)
        if p.shape != (self.spec.num_buckets,):
            raise ValueError(f"probs must have {self.spec.num_buckets} entries, got shape {p.shape}")
        with self._lock:
            self._buffer.append((p, self.spec.bucket_of(int(true_length))))
            self._since_fit += 1
            due = len(self._buffer) >= self.config.min_samples and self._since_fit >= self.config.refit_every
        if due and self.config.background:
            self.refit_async()

    def refit(self) -> bool:
        """Fit on a snapshot of the buffer; returns False (and keeps old params) with too few samples."""
        with self._fit_lock:
            with self._lock:
                if len(self._buffer) < self.config.min_samples:
                    return False
                probs = np.stack([p for p, _ in self._buffer])
                buckets = np.array([b for _, b in self._buffer])
                self._since_fit = 0
            self._params = fit_temperature_bias(probs, buckets, self.config.l2, self.config.max_iter)
            self.fits += 1
            return True

    def refit_async(self) -> threading.Thread | None:
        """Start a background refit unless one is already running."""
        if self._thread is not None and self._thread.is_alive():
            return None
        self._thread = threading.Thread(target=self.refit, name="predictor-refit", daemon=True)
        self._thread.start()
        return self._thread

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def apply(self, probs: np.ndarray) -> np.ndarray:
        """Recalibrated probabilities (identity until the first successful fit)."""
        params = self._params
        p = np.asarray(probs, dtype=np.float64)
        if params is None:
            return p
        single = p.ndim == 1
        out = _scaled(np.log(np.clip(np.atleast_2d(p), _EPS, 1.0)), params[0], params[1])
        return out[0] if single else out
