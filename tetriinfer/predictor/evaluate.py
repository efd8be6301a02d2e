"""Evaluating a predictor folder on held-out prompts, beside the majority and prompt-length baselines.

Invariant: a prompt the predictor saw in training (its sha256 is in ``train_prompt_hashes``) is never
scored, whatever file or dataset it comes from; for the dataset the predictor was trained on this
leaves exactly the ``val`` split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tetriinfer.predictor.artifact import PredictorMeta
from tetriinfer.predictor.dataset import META_FILE as DATASET_META
from tetriinfer.predictor.dataset import LengthDataset, measure_records, prompt_hash
from tetriinfer.predictor.metrics import coarsen_histogram, granularity_report
from tetriinfer.predictor.records import read_records
from tetriinfer.predictor.target_tokenizer import load_tokenizer, tokenizer_info


@dataclass(frozen=True)
class EvalRows:
    prompts: list[str]
    output_tokens: np.ndarray
    prompt_tokens: np.ndarray
    excluded_seen: int


def load_eval_rows(meta: PredictorMeta, data: str | Path, target_tokenizer: str | Path | None) -> EvalRows:
    """Rows of a dataset folder or a raw data file, minus prompts seen in training."""
    path = Path(data)
    if path.is_dir() and (path / DATASET_META).exists():
        ds = LengthDataset.load(path)
        if target_tokenizer is not None:
            meta.check_compatible(
                target_tokenizer=tokenizer_info(target_tokenizer, load_tokenizer(target_tokenizer))
            )
        meta.check_compatible(target_tokenizer=ds.target_tokenizer)
        rows = [(r.prompt, r.output_tokens, r.prompt_tokens) for r in ds.rows]
    else:
        records = read_records(path)
        tok_path = target_tokenizer if target_tokenizer is not None else meta.target_tokenizer.path
        if not Path(tok_path).exists():
            raise FileNotFoundError(
                f"target tokenizer {tok_path} recorded in the predictor is missing; pass --target-tokenizer DIR"
            )
        tok = load_tokenizer(tok_path)
        meta.check_compatible(target_tokenizer=tokenizer_info(tok_path, tok))
        rows = [(rec.prompt, n, p) for rec, n, p in measure_records(records, tok)]
    kept = [r for r in rows if prompt_hash(r[0]) not in meta.train_prompt_hashes]
    if not kept:
        raise ValueError(
            f"every prompt in {data} was used to train this predictor; nothing held out to evaluate"
        )
    return EvalRows(
        prompts=[r[0] for r in kept],
        output_tokens=np.array([r[1] for r in kept], dtype=np.int64),
        prompt_tokens=np.array([r[2] for r in kept], dtype=np.int64),
        excluded_seen=len(rows) - len(kept),
    )


def report_from_probs(
    meta: PredictorMeta, probs: np.ndarray, rows: EvalRows, granularities: Sequence[int] | None = None
) -> dict[str, Any]:
    """``{"granularity": {"<g>": {...metrics...}}, ...}``; coarser granularities merge bucket probabilities."""
    fine = meta.spec
    out: dict[str, Any] = {}
    for g in granularities or [fine.granularity]:
        if g == fine.granularity:
            spec, p, hist = fine, probs, np.asarray(meta.train_histogram, dtype=np.float64)
        else:
            spec = fine.coarser(g)  # raises ValueError when g is not a multiple
            p = fine.coarsen_probs(probs, spec)
            hist = coarsen_histogram(list(meta.train_histogram), fine, spec)
        report = granularity_report(
            p, rows.output_tokens, rows.prompt_tokens, spec, hist, meta.length_baseline
        )
        report["trained_granularity"] = fine.granularity
        out[str(g)] = report
    return {
        "granularity": out,
        "target": meta.target,
        "excluded_seen_in_training": rows.excluded_seen,
    }


def evaluate_predictor(
    predictor_dir: str | Path,
    data: str | Path,
    target_tokenizer: str | Path | None = None,
    granularities: Sequence[int] | None = None,
    batch_size: int = 64,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    from tetriinfer.predictor.inference import LengthPredictor

    meta = PredictorMeta.load(predictor_dir)
    rows = load_eval_rows(meta, data, target_tokenizer)
    predictor = LengthPredictor.load(predictor_dir, num_threads=num_threads, batch_size=batch_size)
    probs = predictor.predict_probs(rows.prompts)
    return report_from_probs(meta, probs, rows, granularities)
