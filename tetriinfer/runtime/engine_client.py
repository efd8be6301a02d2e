"""The interface between the HTTP server and whatever serves requests.

``EngineClient`` is implemented by the in-process client (one ``LLMEngine`` on a thread, for tests and
``--mode single``) and by the cluster front end (global scheduler + instance processes). The HTTP layer
only ever sees this protocol.

Every ``generate`` stream ends with exactly one event whose ``finished`` is true (completed, aborted or
failed); after it, the request holds no KV block anywhere.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tetriinfer.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request. ``finish_reason`` is "stop" | "length" | "abort" | "error" when finished."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: tuple[dict[int, float], ...] = ()
    error: str | None = None
    num_prompt_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    eos_token_id: int | None

    @property
    def tokenizer(self) -> Any | None: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens. Cancelling the iteration (client disconnect) aborts it."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def cluster_info(self) -> dict[str, Any]:
        """``{"mode": str, "instances": [{"id", "role", "pid", "host", "state", "kv_blocks_used",
        "kv_blocks_total", "queued", "running", ...}], "flips": [...]}``"""
        ...

    def is_healthy(self) -> bool: ...
