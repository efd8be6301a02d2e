"""Loading the target model's tokenizer offline and identifying it.

A target tokenizer is either a local Hugging Face folder (loaded with ``AutoTokenizer``) or a single
``tokenizer.json`` file (loaded with ``PreTrainedTokenizerFast``). Its identity is a fingerprint of its
vocabulary, so the same tokenizer copied to another path is recognised as the same target.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TokenizerInfo:
    """Where a target tokenizer was loaded from, and its vocabulary fingerprint."""

    path: str
    name: str
    fingerprint: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "name": self.name, "fingerprint": self.fingerprint}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TokenizerInfo:
        try:
            return cls(path=str(data["path"]), name=str(data["name"]), fingerprint=str(data["fingerprint"]))
        except KeyError as exc:
            raise ValueError(f"target tokenizer info is missing key {exc}") from exc


def load_tokenizer(path: str | Path) -> Any:
    """Load a tokenizer from a local folder or ``tokenizer.json`` file, never from the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"tokenizer not found: {p} (give a local Hugging Face folder or tokenizer.json)"
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if p.is_file():
        if p.suffix != ".json":
            raise ValueError(f"tokenizer file must be a tokenizer.json, got {p}")
        return PreTrainedTokenizerFast(tokenizer_file=str(p))
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not load a tokenizer from {p}: {exc}") from exc


def tokenizer_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()
    return digest[:16]


def tokenizer_info(path: str | Path, tokenizer: Any) -> TokenizerInfo:
    p = Path(path).resolve()
    name = p.parent.name if p.is_file() else p.name
    return TokenizerInfo(path=str(p), name=name, fingerprint=tokenizer_fingerprint(tokenizer))


def count_tokens(tokenizer: Any, texts: list[str], batch_size: int = 256) -> list[int]:
    """Token counts without special tokens (what a model generates / reads as content)."""
    counts: list[int] = []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        enc = tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]
        counts.extend(len(ids) for ids in enc)
    return counts
