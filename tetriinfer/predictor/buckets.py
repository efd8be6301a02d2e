"""Output-length buckets.

Invariants of :class:`BucketSpec`:
- bucket ``i`` covers ``[i * g, (i + 1) * g)`` tokens for ``0 <= i < num_buckets - 1``;
- the last bucket ``num_buckets - 1`` is open-ended: ``[(num_buckets - 1) * g, inf)``;
- every non-negative length maps to exactly one bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_MAX_TOKENS = 2048
"""Lengths at or beyond the last regular bucket share the open-ended last bucket.

2048 tokens covers the p99 of every AlpacaEval generator (max p99 is 1483) and typical
``max_tokens`` limits, so the last bucket holds only rare outliers."""


@dataclass(frozen=True)
class BucketSpec:
    """A granularity ``g`` and a number of buckets (the last one open-ended)."""

    granularity: int
    num_buckets: int

    def __post_init__(self) -> None:
        if not isinstance(self.granularity, int) or self.granularity <= 0:
            raise ValueError(f"granularity must be a positive integer, got {self.granularity!r}")
        if not isinstance(self.num_buckets, int) or self.num_buckets < 2:
            raise ValueError(f"num_buckets must be an integer >= 2, got {self.num_buckets!r}")

    @classmethod
    def for_granularity(cls, granularity: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> BucketSpec:
        """Enough buckets that every length below ``max_tokens`` has a closed bucket, plus the open one."""
        if granularity <= 0:
            raise ValueError(f"granularity must be a positive integer, got {granularity!r}")
        if max_tokens < granularity:
            raise ValueError(f"max_tokens ({max_tokens}) must be >= granularity ({granularity})")
        return cls(granularity=int(granularity), num_buckets=math.ceil(max_tokens / granularity) + 1)

    def bucket_of(self, length: int) -> int:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        return min(int(length) // self.granularity, self.num_buckets - 1)

    def buckets_of(self, lengths: np.ndarray | list[int]) -> np.ndarray:
        arr = np.asarray(lengths, dtype=np.int64)
        if arr.size and arr.min() < 0:
            raise ValueError("lengths must be >= 0")
        return np.minimum(arr // self.granularity, self.num_buckets - 1)

    def lower(self, bucket: int) -> int:
        self._check(bucket)
        return bucket * self.granularity

    def upper(self, bucket: int) -> int | None:
        """Exclusive upper bound in tokens; ``None`` for the open-ended last bucket."""
        self._check(bucket)
        return None if bucket == self.num_buckets - 1 else (bucket + 1) * self.granularity

    def midpoint(self, bucket: int) -> float:
        """Representative length of a bucket (the open last bucket uses ``lower + g / 2``)."""
        self._check(bucket)
        return bucket * self.granularity + self.granularity / 2.0

    def midpoints(self) -> np.ndarray:
        return (np.arange(self.num_buckets) + 0.5) * self.granularity

    def coarser(self, granularity: int) -> BucketSpec:
        """The spec at a coarser multiple ``granularity`` whose open bucket starts at or before ours,
        so every one of our buckets lies entirely inside one of its buckets."""
        if granularity % self.granularity != 0:
            raise ValueError(
                f"granularity {granularity} is not a multiple of the predictor's granularity "
                f"{self.granularity}; probabilities can only be merged into coarser multiples"
            )
        open_lower = (self.num_buckets - 1) * self.granularity
        return BucketSpec(granularity=granularity, num_buckets=max(2, open_lower // granularity + 1))

    def coarsen_map(self, coarse: BucketSpec) -> np.ndarray:
        """For each of our buckets, the ``coarse`` bucket that contains it (see ``coarser``)."""
        if coarse.granularity % self.granularity != 0:
            raise ValueError(
                f"granularity {coarse.granularity} is not a multiple of the predictor's granularity "
                f"{self.granularity}; probabilities can only be merged into coarser multiples"
            )
        if (coarse.num_buckets - 1) * coarse.granularity > (self.num_buckets - 1) * self.granularity:
            raise ValueError("the coarse open-ended bucket must start at or before the fine one")
        lowers = np.arange(self.num_buckets) * self.granularity
        return np.minimum(lowers // coarse.granularity, coarse.num_buckets - 1)

    def coarsen_probs(self, probs: np.ndarray, coarse: BucketSpec) -> np.ndarray:
        """Sum fine-bucket probabilities (last axis) into ``coarse`` buckets."""
        mapping = self.coarsen_map(coarse)
        out = np.zeros(probs.shape[:-1] + (coarse.num_buckets,), dtype=np.float64)
        for fine, c in enumerate(mapping):
            out[..., c] += probs[..., fine]
        return out

    def to_json(self) -> dict[str, int]:
        return {"granularity": self.granularity, "num_buckets": self.num_buckets}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> BucketSpec:
        try:
            return cls(granularity=int(data["granularity"]), num_buckets=int(data["num_buckets"]))  # type: ignore[arg-type]
        except KeyError as exc:
            raise ValueError(f"bucket spec is missing key {exc}") from exc

    def _check(self, bucket: int) -> None:
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket {bucket} out of range [0, {self.num_buckets})")
