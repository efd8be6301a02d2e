"""A model folder's tokenizer, without importing torch (the front end needs the tokenizer, not the model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The model folder's HF tokenizer, or None if it ships none (then prompts must be token ids)."""
    path = Path(model_dir)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
