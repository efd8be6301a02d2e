"""The workload data types: what one request and one workload are, the paper's class thresholds, and the
default files. Pure (no torch, no sockets, no clock); ``bench.workloads`` builds workloads of these and re-exports
them.

Invariants of a ``Workload``: requests sorted by ``arrival_s`` (first at 0.0), ids unique, and every request that
the target server cannot hold present with ``rejected=True``, never silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tetriinfer.bench.arrivals import observed_rate

HEAVY_PREFILL_TOKENS = 512
"""A prompt is heavy when it has strictly more tokens than this (paper, section 2)."""
HEAVY_DECODE_TOKENS = 128
"""An output is heavy when it has strictly more tokens than this (the ShareGPT median)."""

CLASS_NAMES: tuple[str, ...] = ("lpld", "lphd", "hpld", "hphd", "mixed")
AZURE_CONV_FILENAME = "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_CONV_FILENAME = "mooncake_conversation_trace.jsonl"
TRACE_HASH_BLOCK_TOKENS = 512  # Mooncake's traces name each 512-token block of a prompt by a hash id
SAMPLE_PATH = Path(__file__).resolve().parent.parent / "data" / "azure_conv_sample.csv"


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    ``arrival_s`` is seconds after the start of the run. ``output_tokens`` is the exact number of tokens
    the client asks for (``max_tokens``, with EOS ignored where the server allows it). A request with
    ``rejected=True`` is never sent; it is reported in the ``rejected`` count.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prompt_text: str | None = None
    rejected: bool = False
    reject_reason: str | None = None
    prefix_blocks: tuple[int, ...] = ()  # trace hash ids of the prompt's blocks (Mooncake): equal ids, equal tokens
    prefix_block_tokens: int = 0  # tokens per such block (Mooncake: 512, times the workload's length scale)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not (self.arrival_s >= 0 and math.isfinite(self.arrival_s)):
            raise ValueError(f"{self.request_id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"{self.request_id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 0:
            raise ValueError(f"{self.request_id}: output_tokens must be >= 0, got {self.output_tokens}")
        if self.rejected and not self.reject_reason:
            raise ValueError(f"{self.request_id}: a rejected request needs a reject_reason")
        if self.prefix_blocks and self.prefix_block_tokens < 1:
            raise ValueError(f"{self.request_id}: prefix_blocks need prefix_block_tokens >= 1")

    @property
    def workload_class(self) -> str:
        return classify(self.prompt_tokens, self.output_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prompt_text": self.prompt_text,
            "rejected": self.rejected,
            "reject_reason": self.reject_reason,
            "prefix_blocks": list(self.prefix_blocks),
            "prefix_block_tokens": self.prefix_block_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkloadRequest:
        return cls(**{**data, "prefix_blocks": tuple(data.get("prefix_blocks") or ())})


@dataclass(frozen=True)
class TraceRow:
    """One row of a length trace: timestamp in seconds (any origin) and token counts."""

    timestamp_s: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per 512-token block of the prompt; equal ids, equal content


@dataclass(frozen=True)
class Workload:
    """A named, ordered list of requests plus how it was made (for reports)."""

    name: str
    requests: tuple[WorkloadRequest, ...]
    source: str
    arrival_process: str
    rate: float | None
    seed: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workload {self.name}: request ids must be unique")
        if any(b.arrival_s < a.arrival_s for a, b in zip(self.requests, self.requests[1:], strict=False)):
            raise ValueError(f"workload {self.name}: requests must be sorted by arrival_s")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.requests)

    @property
    def num_rejected(self) -> int:
        return sum(r.rejected for r in self.requests)

    def describe(self) -> dict[str, Any]:
        """Metadata and length statistics (JSON-serializable)."""
        prompts = [r.prompt_tokens for r in self.requests]
        outputs = [r.output_tokens for r in self.requests]
        arrivals = [r.arrival_s for r in self.requests]
        return {
            "name": self.name,
            "source": self.source,
            "arrival_process": self.arrival_process,
            "target_rate": self.rate,
            "observed_rate": observed_rate(arrivals),
            "seed": self.seed,
            "num_requests": len(self.requests),
            "num_rejected": self.num_rejected,
            "duration_s": arrivals[-1] if arrivals else 0.0,
            "prompt_tokens": length_stats(prompts),
            "output_tokens": length_stats(outputs),
            "notes": list(self.notes),
        }


def classify(prompt_tokens: int, output_tokens: int) -> str:
    """The paper's class of a (prompt, output) pair: ``lpld``, ``lphd``, ``hpld`` or ``hphd``."""
    p = "hp" if prompt_tokens > HEAVY_PREFILL_TOKENS else "lp"
    d = "hd" if output_tokens > HEAVY_DECODE_TOKENS else "ld"
    return p + d


def length_stats(values: list[int]) -> dict[str, float | int | None]:
    """mean / median / p90 / p99 / min / max of token counts (None for an empty list)."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None, "min": None, "max": None}
    arr = np.asarray(values, dtype=float)
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "min": int(arr.min()),
        "max": int(arr.max()),
    }


# ----------------------------------------------------------------------------------------------- traces


def _mark_rejections(requests: list[WorkloadRequest], max_context: int | None) -> list[WorkloadRequest]:
    if max_context is None:
        return requests
    out: list[WorkloadRequest] = []
    for r in requests:
        total = r.prompt_tokens + r.output_tokens
        if total > max_context and not r.rejected:
            reason = (
                f"prompt ({r.prompt_tokens}) + output ({r.output_tokens}) = {total} tokens "
                f"exceeds max context {max_context}"
            )
            r = WorkloadRequest(
                r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.prompt_text, True, reason
            )
        out.append(r)
    return out


ALPACA_DEFAULT_FILE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "alpaca_eval" / "gpt4_1106_preview.json"
