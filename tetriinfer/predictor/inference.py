"""Serving-side predictors: the trained classifier, an oracle, and a null predictor.

All three implement ``predict(prompts, ...) -> list[Prediction]`` with one prediction per prompt, in
order. ``Prediction.lower`` is the bucket's lower bound in tokens (what memory reservations use),
``upper`` its exclusive upper bound or ``None`` for the open-ended last bucket.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tetriinfer.predictor.artifact import PredictorMeta
from tetriinfer.predictor.buckets import DEFAULT_MAX_TOKENS, BucketSpec
from tetriinfer.predictor.refine import OnlineCalibrator, RefineConfig
from tetriinfer.predictor.target_tokenizer import TokenizerInfo


@dataclass(frozen=True)
class Prediction:
    """A predicted output-length bucket. ``probs`` is empty when the predictor has no distribution."""

    bucket: int
    lower: int
    upper: int | None
    probs: tuple[float, ...] = ()
    raw_probs: tuple[float, ...] = ()
    """The classifier's probabilities before online recalibration (empty when none was applied)."""

    def __post_init__(self) -> None:
        if self.bucket < 0 or self.lower < 0:
            raise ValueError("bucket and lower must be >= 0")
        if self.upper is not None and self.upper <= self.lower:
            raise ValueError(f"upper ({self.upper}) must be > lower ({self.lower})")

    @property
    def is_heavy_decode(self) -> bool:
        """Paper's threshold: a heavy decode generates more than 128 tokens (judged by the lower bound)."""
        return self.lower > 128

    @classmethod
    def from_probs(cls, spec: BucketSpec, probs: np.ndarray, raw: np.ndarray | None = None) -> Prediction:
        b = int(np.argmax(probs))
        return cls(
            bucket=b,
            lower=spec.lower(b),
            upper=spec.upper(b),
            probs=tuple(float(x) for x in probs),
            raw_probs=() if raw is None else tuple(float(x) for x in raw),
        )


class Predictor(Protocol):
    spec: BucketSpec

    def predict(self, prompts: Sequence[str]) -> list[Prediction]: ...


class LengthPredictor:
    """A trained classifier folder (weights, tokenizer, predictor.json) ready to predict.

    ``predict`` runs fixed batches of at most ``batch_size`` whole prompts (truncated to the
    predictor's ``max_length`` tokens, never chunked). It is thread-safe (one forward pass at a time).
    Online refinement (off by default): ``enable_refinement()`` attaches an ``OnlineCalibrator``;
    ``observe(prediction, true_length)`` feeds it served outcomes, and later predictions use the
    recalibrated probabilities (the argmax bucket may change).
    """

    def __init__(self, model: Any, tokenizer: Any, meta: PredictorMeta, batch_size: int = 32) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.meta = meta
        self.spec = meta.spec
        self.batch_size = batch_size
        self.calibrator: OnlineCalibrator | None = None
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        folder: str | Path,
        device: str = "cpu",
        num_threads: int | None = 1,
        granularity: int | None = None,
        target_tokenizer: TokenizerInfo | str | Path | None = None,
        batch_size: int = 32,
    ) -> LengthPredictor:
        """Load a predictor folder; raise ``ValueError`` when it does not fit the requested
        granularity / target tokenizer (a folder path or a ``TokenizerInfo``).

        ``num_threads`` sets torch's intra-op thread count for this process (``None`` leaves it).
        """
        import torch

        from tetriinfer.predictor.model import load_classifier

        meta = PredictorMeta.load(folder)
        if target_tokenizer is not None and not isinstance(target_tokenizer, TokenizerInfo):
            from tetriinfer.predictor.target_tokenizer import load_tokenizer, tokenizer_info

            target_tokenizer = tokenizer_info(target_tokenizer, load_tokenizer(target_tokenizer))
        meta.check_compatible(granularity, target_tokenizer)
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)
        model, tokenizer = load_classifier(folder)
        if int(model.config.num_labels) != meta.spec.num_buckets:
            raise ValueError(
                f"{folder}: model has {model.config.num_labels} labels but predictor.json has "
                f"{meta.spec.num_buckets} buckets"
            )
        model.to(device)
        model.eval()
        return cls(model, tokenizer, meta, batch_size=batch_size)

    def raw_probs(self, prompts: Sequence[str]) -> np.ndarray:
        """The classifier's probabilities, (len(prompts), num_buckets), without recalibration."""
        from tetriinfer.predictor.model import predict_probs

        with self._lock:
            return predict_probs(
                self.model, self.tokenizer, list(prompts), self.batch_size, self.meta.max_length
            )

    def predict_probs(self, prompts: Sequence[str]) -> np.ndarray:
        probs = self.raw_probs(prompts)
        return probs if self.calibrator is None else self.calibrator.apply(probs)

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        raw = self.raw_probs(prompts)
        if self.calibrator is None:
            return [Prediction.from_probs(self.spec, row) for row in raw]
        cal = self.calibrator.apply(raw)
        return [Prediction.from_probs(self.spec, c, r) for c, r in zip(cal, raw, strict=True)]

    def enable_refinement(self, config: RefineConfig | None = None) -> OnlineCalibrator:
        """Attach (or return the attached) online calibrator."""
        if self.calibrator is None:
            self.calibrator = OnlineCalibrator(self.spec, config)
        return self.calibrator

    def observe(self, prediction: Prediction, true_length: int) -> None:
        """Report a served request's true output length (no-op unless refinement is enabled)."""
        if self.calibrator is None:
            return
        probs = prediction.raw_probs or prediction.probs
        if probs:
            self.calibrator.observe(np.asarray(probs), true_length)


class OraclePredictor:
    """Perfect prediction from true output lengths (for ablations): ``predict(prompts, true_lengths)``."""

    def __init__(self, granularity: int, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.spec = BucketSpec.for_granularity(granularity, max_tokens)

    def predict(self, prompts: Sequence[str], true_lengths: Sequence[int] | None = None) -> list[Prediction]:
        if true_lengths is None:
            raise ValueError("OraclePredictor needs the true output length of every request")
        if len(true_lengths) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(true_lengths)} true lengths")
        out = []
        for n in true_lengths:
            b = self.spec.bucket_of(int(n))
            probs = tuple(1.0 if i == b else 0.0 for i in range(self.spec.num_buckets))
            out.append(Prediction(bucket=b, lower=self.spec.lower(b), upper=self.spec.upper(b), probs=probs))
        return out


class NullPredictor:
    """No prediction: every request gets bucket 0 with lower bound 0 and no upper bound.

    Schedulers treat ``upper is None and lower == 0`` as "unknown length" (vLLM-like behaviour).
    """

    def __init__(self, granularity: int = 200, max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.spec = BucketSpec.for_granularity(granularity, max_tokens)

    def predict(self, prompts: Sequence[str]) -> list[Prediction]:
        return [Prediction(bucket=0, lower=0, upper=None) for _ in prompts]
