"""The paper's workload classes built from real prompts, for runs with natural output lengths.

``real:CLASS`` (``CLASS`` in lpld, lphd, hpld, hphd, mixed) is a workload of real text sent through the served
model's chat template, meant for ``--output-lengths natural``, where the model decides when to stop:

- Light prompts are AlpacaEval instructions, one user turn each. Only instructions held out from the default
  predictor's training are used (the served-form prompt hash split, seed 0, 20%: see
  ``predictor/default.py``), so a run with ``--predictor default`` meets its real errors, not its training set.
  Which instructions decode heavily is known from the shipped lengths of the default model, greedy
  (``data/smollm2_lengths.jsonl``) or, for sampled runs, at temperature 0.7 (``data/smollm2_lengths_t07.jsonl``):
  heavy decode when it wrote more than ``HEAVY_DECODE_TOKENS`` tokens.
- Heavy prompts are real long texts (other models' AlpacaEval answers, joined until the rendered prompt passes
  ``HEAVY_PREFILL_TOKENS``) under a task that sets the answer's size: "summarize in two sentences" for light
  decode, "rewrite in your own words, keeping every detail" for heavy decode.
- ``output_tokens`` is the ``max_tokens`` cap: ``HEAVY_DECODE_TOKENS`` for the light-decode classes (so an answer
  can never become heavy) and ``heavy_cap`` for the heavy ones.
- ``mixed`` holds the four classes in equal shares (counts differ by at most one), in a seeded order.

Invariants: deterministic per ``seed``; requests sorted by arrival; every prompt is within ``max_prompt_tokens``
(heavy texts are chosen so); prompts within a class are drawn without replacement until the pool is used up.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tetriinfer.bench.arrivals import make_arrivals
from tetriinfer.bench.workload_types import (
    ALPACA_DEFAULT_FILE,
    CLASS_NAMES,
    HEAVY_DECODE_TOKENS,
    HEAVY_PREFILL_TOKENS,
    Workload,
    WorkloadRequest,
    _mark_rejections,
)
from tetriinfer.predictor.default import HELD_OUT_FRACTION, HELD_OUT_SEED

REAL_PREFIX = "real:"
LONG_TEXT_FILES = ("gpt4_1106_preview.json", "Meta-Llama-3-70B-Instruct.json", "Qwen2-72B-Instruct.json")
TASKS = {
    "ld": "Summarize the following text in two sentences.\n\n",
    "hd": "Rewrite the following text in your own words, keeping every detail.\n\n",
}


@dataclass(frozen=True)
class RealPrompt:
    """A chat-rendered prompt, its token count and its decode class (``ld``/``hd``)."""

    text: str
    tokens: int
    decode: str


def lengths_for(temperature: float) -> str:
    """Which shipped lengths class the light prompts of a run at ``temperature``: ``greedy`` at 0, else
    ``sampled``."""
    return "sampled" if temperature > 0 else "greedy"


def is_real_workload(name: str) -> bool:
    return name.strip().lower().startswith(REAL_PREFIX)


def _known_lengths(kind: str = "greedy") -> dict[str, int]:
    from tetriinfer.predictor.default import read_length_samples, shipped_lengths_path

    prompts, samples = read_length_samples([shipped_lengths_path(kind)])
    return {prompt: lengths[0] for prompt, lengths in zip(prompts, samples, strict=True)}


def chat_tokenizer(tokenizer_dir: str, who: str) -> Any:
    """The served model's tokenizer (local folder); ValueError naming ``who`` when it has no chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{who} the served model's tokenizer with a chat template: {tokenizer_dir}")
    return tok


def render_user_turn(tok: Any, content: str) -> tuple[str, int]:
    """``content`` as one user turn through the chat template (generation prompt added): the text and its tokens."""
    text = str(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True))
    return text, len(tok.encode(text, add_special_tokens=False))


def light_prompts(tok: Any, source: Path, lengths: str = "greedy") -> dict[str, list[RealPrompt]]:
    """Held-out AlpacaEval instructions by decode class, by the default model's shipped ``lengths`` (``greedy`` or
    ``sampled``: see ``predictor.default.SHIPPED_LENGTHS``)."""
    from tetriinfer.predictor.dataset import split_of
    from tetriinfer.predictor.default import served_prompt_text

    known = _known_lengths(lengths)
    pools: dict[str, list[RealPrompt]] = {"ld": [], "hd": []}
    for row in json.loads(source.read_text(encoding="utf-8")):
        instruction = str(row["instruction"])
        length = known.get(instruction)
        if length is None or split_of(served_prompt_text(tok, instruction), HELD_OUT_SEED, HELD_OUT_FRACTION) != "val":
            continue
        text, n = render_user_turn(tok, instruction)
        if n <= HEAVY_PREFILL_TOKENS:
            pools["hd" if length > HEAVY_DECODE_TOKENS else "ld"].append(RealPrompt(text, n, ""))
    return pools


def heavy_texts(tok: Any, data_dir: Path, max_prompt_tokens: int) -> list[str]:
    """Long real texts whose rendered task prompt has ``HEAVY_PREFILL_TOKENS`` < tokens <= ``max_prompt_tokens``:
    consecutive answers of each file joined (blank line between) until long enough."""
    longest_task = max(TASKS.values(), key=len)
    texts: list[str] = []
    for name in LONG_TEXT_FILES:
        path = data_dir / name
        if not path.is_file():
            continue
        parts: list[str] = []
        for row in json.loads(path.read_text(encoding="utf-8")):
            parts.append(str(row["output"]).strip())
            joined = "\n\n".join(parts)
            _, n = render_user_turn(tok, longest_task + joined)
            if n > max_prompt_tokens:
                parts = []
            elif n > HEAVY_PREFILL_TOKENS + 16:  # margin: the shorter task must still be heavy
                texts.append(joined)
                parts = []
    return texts


def real_class_workload(
    name: str,
    num_requests: int,
    rate: float | None,
    seed: int,
    tokenizer_dir: str,
    *,
    heavy_cap: int = 384,
    max_prompt_tokens: int = 1536,
    arrival: str | None = None,
    burstiness_cv: float = 1.0,
    max_context: int | None = None,
    alpaca_file: str | os.PathLike[str] | None = None,
    lengths: str = "greedy",
) -> Workload:
    """``real:CLASS``: see the module docstring. ``heavy_cap`` is the heavy-decode classes' ``max_tokens``;
    ``lengths`` (``greedy`` or ``sampled``) says which of the default model's shipped lengths sort the light prompts
    into decode classes: the ones of the decoding the run will use."""
    cls = name.strip().lower()[len(REAL_PREFIX):]
    if cls not in CLASS_NAMES:
        raise ValueError(f"unknown real workload {name!r}; expected real:CLASS with CLASS one of {', '.join(CLASS_NAMES)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if heavy_cap <= HEAVY_DECODE_TOKENS:
        raise ValueError(f"heavy_cap must exceed {HEAVY_DECODE_TOKENS} tokens (else no answer is heavy), got {heavy_cap}")
    if max_prompt_tokens <= HEAVY_PREFILL_TOKENS + 16:
        raise ValueError(f"max_prompt_tokens must exceed {HEAVY_PREFILL_TOKENS + 16} for heavy prompts, got {max_prompt_tokens}")
    process = arrival or "poisson"
    if process == "trace":
        raise ValueError("real workloads have no timestamps; use arrival 'poisson' or 'gamma'")
    source = Path(alpaca_file) if alpaca_file else ALPACA_DEFAULT_FILE
    tok = chat_tokenizer(tokenizer_dir, "real workloads need")
    rng = np.random.default_rng([seed, 13])
    four = ["lpld", "lphd", "hpld", "hphd"]
    classes = ([four[i] for i in rng.permutation(np.arange(num_requests) % 4).tolist()] if cls == "mixed"
               else [cls] * num_requests)
    light = light_prompts(tok, source, lengths) if any(c[:2] == "lp" for c in classes) else {}
    heavy = heavy_texts(tok, source.parent, max_prompt_tokens) if any(c[:2] == "hp" for c in classes) else []
    if any(c[:2] == "lp" for c in classes) and not (light["ld"] and light["hd"]):
        raise ValueError(f"no held-out instructions of both decode classes in {source}")
    if any(c[:2] == "hp" for c in classes) and not heavy:
        raise ValueError(f"no long texts fit max_prompt_tokens={max_prompt_tokens} in {source.parent}")
    orders: dict[str, list[int]] = {}
    used: dict[str, int] = {}

    def draw(key: str, size: int) -> int:  # without replacement, reshuffled when a pool is used up
        if used.get(key, 0) % size == 0:
            orders[key] = rng.permutation(size).tolist()
        i = orders[key][used.get(key, 0) % size]
        used[key] = used.get(key, 0) + 1
        return int(i)

    arrivals = make_arrivals(num_requests, process, rate, seed, burstiness_cv)
    requests: list[WorkloadRequest] = []
    for i, c in enumerate(classes):
        decode = c[2:]
        cap = heavy_cap if decode == "hd" else HEAVY_DECODE_TOKENS
        if c[:2] == "lp":
            pool = light[decode]
            p = pool[draw(c, len(pool))]
            text, n = p.text, p.tokens
        else:
            text, n = render_user_turn(tok, TASKS[decode] + heavy[draw("hp", len(heavy))])
        requests.append(WorkloadRequest(f"real-{c}-{i}", arrivals[i], n, cap, prompt_text=text))
    counts = {c: classes.count(c) for c in sorted(set(classes))}
    notes = (
        f"real prompts, chat-rendered, light ones classed by {lengths} lengths ({', '.join(f'{k}: {v}' for k, v in counts.items())}); light prompts are "
        f"AlpacaEval instructions held out from the default predictor, heavy ones long answers under a summarize "
        f"(light decode) or rewrite (heavy decode) task; natural output lengths capped at {HEAVY_DECODE_TOKENS} "
        f"(light decode) / {heavy_cap} (heavy decode)",
    )
    return Workload(f"real:{cls}", tuple(_mark_rejections(requests, max_context)), str(source),
                    process if rate is not None else "burst", rate, seed, notes)

