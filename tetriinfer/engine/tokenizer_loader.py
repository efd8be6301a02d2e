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


def load_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Every end-of-sequence id of a model folder: ``config.json``'s ``eos_token_id`` first, then those of
    ``generation_config.json`` (an int or a list in either), without repeats; () if neither names one.

    Instruct models often end a turn with a token other than config.json's EOS (ChatML's ``<|im_end|>``,
    Llama 3's ``<|eot_id|>``); transformers' ``generate`` stops at every id of generation_config, and so must we.
    """
    import json

    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        for tid in value if isinstance(value, list) else [value]:
            if isinstance(tid, int) and not isinstance(tid, bool) and tid >= 0 and tid not in ids:
                ids.append(tid)
    return tuple(ids)
