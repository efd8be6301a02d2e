"""Collecting output lengths from an OpenAI-compatible server (the paper's labelling step).

Each prompt is sent once to ``/v1/completions`` (or ``/v1/chat/completions`` with ``chat=True``);
the generated token count is ``usage.completion_tokens``. Results are appended to a JSONL file, one
line per finished prompt, flushed as they arrive, so an interrupted run resumes by skipping the prompts
already in the file. Invariant: the file never holds two lines for one prompt written by this module.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tetriinfer.core.sampling_params import derived_seed


@dataclass(frozen=True)
class CollectConfig:
    url: str
    model: str
    concurrency: int = 8
    max_tokens: int = 1024
    chat: bool = False
    temperature: float = 0.0
    sample_seed: int | None = None  # with temperature > 0: each prompt's request seed derives from it and the prompt
    timeout_s: float = 600.0
    retries: int = 2

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--collect-from must be an http(s) URL, got {self.url!r}")
        if not self.model:
            raise ValueError("--model is required with --collect-from")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.retries < 0 or self.timeout_s <= 0:
            raise ValueError("retries must be >= 0 and timeout_s > 0")

    @property
    def endpoint(self) -> str:
        base = self.url.rstrip("/")
        for suffix in ("/chat/completions", "/completions"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
        if not base.endswith("/v1"):
            base += "/v1"
        return base + ("/chat/completions" if self.chat else "/completions")


@dataclass(frozen=True)
class CollectResult:
    requested: int
    skipped_done: int
    collected: int
    failed: int
    errors: tuple[str, ...]


def done_prompts(out_file: Path) -> set[str]:
    """Prompts already recorded; a torn last line (crash mid-write) is ignored and later rewritten."""
    if not out_file.exists():
        return set()
    done: set[str] = set()
    lines = out_file.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{out_file}:{i + 1}: malformed line in collected file: {exc}") from exc
        done.add(obj["prompt"])
    return done


def _repair_tail(out_file: Path) -> None:
    """Drop a torn final line so appends start on a fresh line."""
    if not out_file.exists():
        return
    data = out_file.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n")
        out_file.write_bytes(data[: cut + 1] if cut >= 0 else b"")


def prompt_seed(prompt: str, sample_seed: int) -> int:
    """The request seed of one prompt: a function of the prompt text and ``sample_seed`` only, so a resumed or
    repeated collection draws the same answer for the same prompt from a server that honours ``seed``."""
    return derived_seed(f"sample:{sample_seed}:{prompt}")


def _payload(config: CollectConfig, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
    }
    if config.sample_seed is not None and config.temperature > 0:
        body["seed"] = prompt_seed(prompt, config.sample_seed)
    if config.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _parse(config: CollectConfig, data: dict[str, Any]) -> tuple[int, str, str | None]:
    usage = data.get("usage") or {}
    n = usage.get("completion_tokens")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"response has no usage.completion_tokens: {str(data)[:200]}")
    choice = (data.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") if config.chat else choice.get("text")
    return n, text or "", choice.get("finish_reason")


async def _collect_async(
    prompts: list[str], out_file: Path, config: CollectConfig, show_progress: bool
) -> tuple[int, list[str]]:
    import httpx

    sem = asyncio.Semaphore(config.concurrency)
    errors: list[str] = []
    collected = 0
    bar = tqdm(total=len(prompts), desc="collect", unit="req", disable=not show_progress)
    with out_file.open("a", encoding="utf-8") as fh:
        async with httpx.AsyncClient(timeout=config.timeout_s) as client:

            async def one(prompt: str) -> None:
                nonlocal collected
                async with sem:
                    last: str = ""
                    body = _payload(config, prompt)
                    for _attempt in range(config.retries + 1):
                        try:
                            resp = await client.post(config.endpoint, json=body)
                            resp.raise_for_status()
                            n, text, finish = _parse(config, resp.json())
                        except (httpx.HTTPError, ValueError, json.JSONDecodeError) as exc:
                            last = f"{type(exc).__name__}: {exc}"
                            continue
                        line = {
                            "prompt": prompt,
                            "output_tokens": n,
                            "finish_reason": finish,
                            "model": config.model,
                            "response_text": text,
                        }
                        if "seed" in body:
                            line["seed"] = body["seed"]
                        fh.write(json.dumps(line, ensure_ascii=False) + "\n")
                        fh.flush()
                        collected += 1
                        break
                    else:
                        errors.append(f"{prompt[:60]!r}: {last}")
                    bar.update(1)

            await asyncio.gather(*(one(p) for p in prompts))
    bar.close()
    return collected, errors


def collect_lengths(
    prompts: list[str], out_file: str | Path, config: CollectConfig, show_progress: bool = True
) -> CollectResult:
    """Query the server for every prompt not yet in ``out_file``; append one JSONL line per success."""
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    _repair_tail(out)
    done = done_prompts(out)
    unique = list(dict.fromkeys(prompts))
    todo = [p for p in unique if p not in done]
    collected, errors = asyncio.run(_collect_async(todo, out, config, show_progress)) if todo else (0, [])
    return CollectResult(
        requested=len(unique),
        skipped_done=len(unique) - len(todo),
        collected=collected,
        failed=len(errors),
        errors=tuple(errors),
    )
