"""Reading (prompt, response) files into length records.

Accepted formats (the same for ``build-dataset --input`` and ``eval --data``):
- a JSON list of objects (AlpacaEval ``model_outputs.json``: ``instruction`` + ``output``);
- JSONL, one object per line, with ``prompt`` (or ``instruction``) and either ``response``/``output``
  (text; counted with the target tokenizer) or ``output_tokens`` (an integer count).

Invariant: every returned record has a non-empty prompt and either a text response or a count >= 0;
a file that yields no record, or holds a malformed one, raises ``ValueError`` naming file and row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPT_KEYS = ("prompt", "instruction")
TEXT_KEYS = ("response", "output")


@dataclass(frozen=True)
class RawRecord:
    """One prompt with either its response text or its generated-token count."""

    prompt: str
    source: str
    response: str | None = None
    output_tokens: int | None = None
    generator: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"{self.source}: empty prompt")
        if (self.response is None) == (self.output_tokens is None):
            raise ValueError(f"{self.source}: a record needs exactly one of a response text or output_tokens")
        if self.output_tokens is not None and self.output_tokens < 0:
            raise ValueError(f"{self.source}: output_tokens must be >= 0, got {self.output_tokens}")


def _record_from_obj(obj: Any, where: str) -> RawRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt = next((obj[k] for k in PROMPT_KEYS if k in obj), None)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"{where}: missing or empty prompt (one of {PROMPT_KEYS} must be a non-empty string)"
        )
    generator = obj.get("generator") if isinstance(obj.get("generator"), str) else None
    if "output_tokens" in obj:
        count = obj["output_tokens"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{where}: output_tokens must be a non-negative integer, got {count!r}")
        return RawRecord(prompt=prompt, source=where, output_tokens=count, generator=generator)
    text = next((obj[k] for k in TEXT_KEYS if k in obj), None)
    if not isinstance(text, str):
        raise ValueError(
            f"{where}: missing response: need 'output_tokens' (int) or one of {TEXT_KEYS} (string)"
        )
    return RawRecord(prompt=prompt, source=where, response=text, generator=generator)


def read_prompts_only(path: str | Path) -> list[str]:
    """Prompts of a file in any accepted format, or of a plain JSONL/JSON with only ``prompt`` keys."""
    out: list[str] = []
    for i, obj in enumerate(_iter_objects(Path(path))):
        where = f"{path}:{i + 1}"
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        prompt = next((obj[k] for k in PROMPT_KEYS if k in obj), None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: missing or empty prompt")
        out.append(prompt)
    if not out:
        raise ValueError(f"{path}: no records found (the file is empty)")
    return out


def _iter_objects(path: Path) -> list[Any]:
    if not path.exists():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.is_dir():
        raise ValueError(f"{path} is a directory; expected a .json or .jsonl file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: no records found (the file is empty)")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: malformed JSON: {exc}") from exc
        return list(data)
    objs: list[Any] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            objs.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: malformed JSON line: {exc}") from exc
    return objs


def read_records(path: str | Path) -> list[RawRecord]:
    """All records of one file; raises ``ValueError`` on an empty or malformed file."""
    p = Path(path)
    objs = _iter_objects(p)
    records = [_record_from_obj(obj, f"{p}:{i + 1}") for i, obj in enumerate(objs)]
    if not records:
        raise ValueError(f"{p}: no records found (the file is empty)")
    return records
