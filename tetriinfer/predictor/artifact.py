"""``predictor.json``: everything besides the weights that a trained predictor folder carries.

Invariants: ``train_histogram`` has ``spec.num_buckets`` entries (training-split bucket counts, for
the majority baseline); ``train_prompt_hashes`` holds the sha256 of every prompt the predictor saw in
training or early stopping, so evaluation can exclude them; a folder is only usable with the
granularity and target tokenizer recorded here (``check_compatible``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.metrics import LengthBaseline
from tetriinfer.predictor.target_tokenizer import TokenizerInfo

META_FILE = "predictor.json"
FORMAT = "tetriinfer-length-predictor/1"


@dataclass(frozen=True)
class PredictorMeta:
    spec: BucketSpec
    target: str
    target_tokenizer: TokenizerInfo
    base_model: str
    max_length: int
    train_histogram: tuple[int, ...]
    length_baseline: LengthBaseline
    train_prompt_hashes: frozenset[str]
    metrics: dict[str, Any] = field(default_factory=dict)
    train_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.train_histogram) != self.spec.num_buckets:
            raise ValueError(
                f"train_histogram has {len(self.train_histogram)} entries, expected {self.spec.num_buckets}"
            )
        if self.max_length < 8:
            raise ValueError(f"max_length must be >= 8, got {self.max_length}")

    def check_compatible(
        self, granularity: int | None = None, target_tokenizer: TokenizerInfo | None = None
    ) -> None:
        """Raise ``ValueError`` if this predictor does not match the requested granularity / target."""
        if granularity is not None and granularity != self.spec.granularity:
            raise ValueError(
                f"predictor was trained for granularity {self.spec.granularity}, but granularity "
                f"{granularity} was requested"
            )
        if target_tokenizer is not None and target_tokenizer.fingerprint != self.target_tokenizer.fingerprint:
            raise ValueError(
                f"predictor was trained with target tokenizer {self.target_tokenizer.name!r} "
                f"({self.target_tokenizer.path}), which differs from the requested {target_tokenizer.name!r} "
                f"({target_tokenizer.path}); retrain for this target"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            **self.spec.to_json(),
            "bucket_lower_bounds": [self.spec.lower(b) for b in range(self.spec.num_buckets)],
            "target": self.target,
            "target_tokenizer": self.target_tokenizer.to_json(),
            "base_model": self.base_model,
            "max_length": self.max_length,
            "train_histogram": list(self.train_histogram),
            "length_baseline": self.length_baseline.to_json(),
            "metrics": self.metrics,
            "train_config": self.train_config,
            "train_prompt_hashes": sorted(self.train_prompt_hashes),
        }

    def save(self, folder: str | Path) -> None:
        (Path(folder) / META_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: str | Path) -> PredictorMeta:
        path = Path(folder) / META_FILE
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"predictor folder not found: {folder}")
        if not path.exists():
            raise FileNotFoundError(f"not a predictor folder (no {META_FILE}): {folder}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: malformed JSON: {exc}") from exc
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: unknown format {data.get('format')!r}, expected {FORMAT!r}")
        try:
            return cls(
                spec=BucketSpec.from_json(data),
                target=str(data["target"]),
                target_tokenizer=TokenizerInfo.from_json(data["target_tokenizer"]),
                base_model=str(data["base_model"]),
                max_length=int(data["max_length"]),
                train_histogram=tuple(int(x) for x in data["train_histogram"]),
                length_baseline=LengthBaseline.from_json(data["length_baseline"]),
                train_prompt_hashes=frozenset(data.get("train_prompt_hashes", [])),
                metrics=dict(data.get("metrics", {})),
                train_config=dict(data.get("train_config", {})),
            )
        except KeyError as exc:
            raise ValueError(f"{path}: missing key {exc}") from exc
