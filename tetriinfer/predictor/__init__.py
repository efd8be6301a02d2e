"""Output-length predictor (paper section "length predictor"): prompt -> output-length bucket.

Importing this package is cheap (no torch); the model loads in ``LengthPredictor.load``.

Serving API::

    from tetriinfer.predictor import LengthPredictor, OraclePredictor, NullPredictor, Prediction
    p = LengthPredictor.load("predictor_dir", device="cpu", num_threads=1)
    [pred] = p.predict(["Write a haiku about autumn."])
    pred.bucket, pred.lower, pred.upper, pred.probs
"""

from __future__ import annotations

from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.inference import (
    LengthPredictor,
    NullPredictor,
    OraclePredictor,
    Prediction,
    Predictor,
)
from tetriinfer.predictor.refine import OnlineCalibrator, RefineConfig

__all__ = [
    "BucketSpec",
    "LengthPredictor",
    "NullPredictor",
    "OnlineCalibrator",
    "OraclePredictor",
    "Prediction",
    "Predictor",
    "RefineConfig",
]
