"""Length datasets: rows of (prompt, output tokens, bucket, split), saved as JSONL + ``dataset.json``.

Invariants:
- the split is a function of the prompt text and the seed only (``split_of``), so a prompt that appears
  in several input files (the AlpacaEval files share their 805 instructions) lands in exactly one split;
- ``bucket == spec.bucket_of(output_tokens)`` on every row;
- ``dataset.json`` counts match the rows in ``train.jsonl`` / ``val.jsonl``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tetriinfer.predictor.buckets import DEFAULT_MAX_TOKENS, BucketSpec
from tetriinfer.predictor.records import RawRecord, read_records
from tetriinfer.predictor.target_tokenizer import TokenizerInfo, count_tokens, load_tokenizer, tokenizer_info

SPLITS = ("train", "val")
META_FILE = "dataset.json"


def prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def split_unit(prompt: str, seed: int, salt: str = "split") -> float:
    """A uniform number in [0, 1) determined by the prompt text, the seed and a salt."""
    digest = hashlib.sha256(f"{salt}:{seed}:{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(prompt: str, seed: int, val_fraction: float) -> str:
    return "val" if split_unit(prompt, seed) < val_fraction else "train"


@dataclass(frozen=True)
class LengthRow:
    prompt: str
    output_tokens: int
    bucket: int
    split: str
    prompt_tokens: int
    source: str

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.output_tokens < 0 or self.prompt_tokens < 0:
            raise ValueError("token counts must be >= 0")


@dataclass(frozen=True)
class DatasetConfig:
    granularity: int
    max_tokens: int = DEFAULT_MAX_TOKENS
    val_fraction: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.granularity <= 0:
            raise ValueError(f"granularity must be > 0, got {self.granularity}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_tokens < self.granularity:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= granularity ({self.granularity})")

    @property
    def spec(self) -> BucketSpec:
        return BucketSpec.for_granularity(self.granularity, self.max_tokens)


@dataclass
class LengthDataset:
    """Rows plus the metadata needed to train and to check a predictor against its target."""

    spec: BucketSpec
    target_tokenizer: TokenizerInfo
    target: str
    seed: int
    val_fraction: float
    rows: list[LengthRow]
    sources: list[str] = field(default_factory=list)

    def split(self, name: str) -> list[LengthRow]:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}")
        return [r for r in self.rows if r.split == name]

    def meta(self) -> dict[str, Any]:
        counts: dict[str, Any] = {}
        for name in SPLITS:
            rows = self.split(name)
            hist = [0] * self.spec.num_buckets
            for r in rows:
                hist[r.bucket] += 1
            counts[name] = {"rows": len(rows), "prompts": len({r.prompt for r in rows}), "histogram": hist}
        return {
            "format": "tetriinfer-length-dataset/1",
            **self.spec.to_json(),
            "target": self.target,
            "target_tokenizer": self.target_tokenizer.to_json(),
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "sources": self.sources,
            "counts": counts,
        }

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in SPLITS:
            with (out / f"{name}.jsonl").open("w", encoding="utf-8") as fh:
                for r in self.split(name):
                    fh.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")
        (out / META_FILE).write_text(json.dumps(self.meta(), indent=2) + "\n", encoding="utf-8")
        return out

    @classmethod
    def load(cls, path: str | Path) -> LengthDataset:
        d = Path(path)
        meta_path = d / META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(f"not a length dataset (no {META_FILE}): {d}")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{meta_path}: malformed JSON: {exc}") from exc
        spec = BucketSpec.from_json(meta)
        rows: list[LengthRow] = []
        for name in SPLITS:
            f = d / f"{name}.jsonl"
            if not f.exists():
                raise FileNotFoundError(f"dataset split file missing: {f}")
            for lineno, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = LengthRow(**json.loads(line))
                except (json.JSONDecodeError, TypeError) as exc:
                    raise ValueError(f"{f}:{lineno}: malformed dataset row: {exc}") from exc
                if row.bucket != spec.bucket_of(row.output_tokens):
                    raise ValueError(
                        f"{f}:{lineno}: bucket {row.bucket} does not match {row.output_tokens} tokens"
                    )
                rows.append(row)
        if not rows:
            raise ValueError(f"dataset {d} has no rows")
        return cls(
            spec=spec,
            target_tokenizer=TokenizerInfo.from_json(meta["target_tokenizer"]),
            target=str(meta.get("target", "")),
            seed=int(meta["seed"]),
            val_fraction=float(meta["val_fraction"]),
            rows=rows,
            sources=list(meta.get("sources", [])),
        )


def measure_records(records: Sequence[RawRecord], tokenizer: Any) -> list[tuple[RawRecord, int, int]]:
    """(record, output tokens, prompt tokens) with text responses counted by the target tokenizer."""
    texts = [r.response for r in records if r.response is not None]
    text_counts = iter(count_tokens(tokenizer, [t for t in texts if t is not None]))
    prompt_counts = count_tokens(tokenizer, [r.prompt for r in records])
    out: list[tuple[RawRecord, int, int]] = []
    for rec, ptoks in zip(records, prompt_counts, strict=True):
        n = rec.output_tokens if rec.output_tokens is not None else next(text_counts)
        out.append((rec, int(n), int(ptoks)))
    return out


def target_name(records: Sequence[RawRecord], files: Sequence[str | Path]) -> str:
    gens = sorted({r.generator for r in records if r.generator})
    if gens:
        return "+".join(gens)
    return "+".join(Path(f).stem for f in files)


def build_dataset(
    files: Sequence[str | Path],
    target_tokenizer: str | Path,
    config: DatasetConfig,
    target: str | None = None,
    limit: int | None = None,
) -> LengthDataset:
    """Read every file, count lengths with the target tokenizer, bucket and split by prompt.

    ``limit`` keeps only the first ``limit`` records of each file (for small slices).
    """
    if not files:
        raise ValueError("give at least one input file")
    records: list[RawRecord] = []
    for f in files:
        recs = read_records(f)
        records.extend(recs[:limit] if limit is not None else recs)
    tok = load_tokenizer(target_tokenizer)
    info = tokenizer_info(target_tokenizer, tok)
    spec = config.spec
    rows = [
        LengthRow(
            prompt=rec.prompt,
            output_tokens=n,
            bucket=spec.bucket_of(n),
            split=split_of(rec.prompt, config.seed, config.val_fraction),
            prompt_tokens=p,
            source=Path(rec.source.rsplit(":", 1)[0]).name,
        )
        for rec, n, p in measure_records(records, tok)
    ]
    return LengthDataset(
        spec=spec,
        target_tokenizer=info,
        target=target or target_name(records, files),
        seed=config.seed,
        val_fraction=config.val_fraction,
        rows=rows,
        sources=[str(Path(f).resolve()) for f in files],
    )
