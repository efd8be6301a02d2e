"""Request and response shapes of the OpenAI-compatible API (field names as OpenAI's and vLLM's).

Requests are pydantic models: unknown fields are ignored (as vLLM does), known fields are type- and
range-checked here, and a violation becomes a 400 with OpenAI's error JSON (see ``app.py``). Features we
do not implement (``n > 1``, ``logprobs``, ``echo``, ``suffix``, ``best_of > 1``, penalties, ``logit_bias``,
tools) are rejected with 400 by ``unsupported_reason`` rather than silently ignored.

Responses are plain dicts built by the ``*_response`` / ``*_chunk`` helpers, so streaming chunks carry
exactly OpenAI's keys (``finish_reason: null`` present, ``usage`` only where it belongs).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PromptIds = list[int]


class OpenAIError(Exception):
    """An error that becomes ``{"error": {...}}`` with HTTP status ``status_code``."""

    def __init__(
        self, message: str, *, status_code: int = 400, err_type: str | None = None, param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type or _ERROR_TYPES.get(status_code, "BadRequestError")
        self.param = param
        self.headers = headers


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status_code: int, err_type: str | None = None, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": err_type or _ERROR_TYPES.get(status_code, "BadRequestError"),
            "param": param,
            "code": status_code,
        }
    }


# ---- requests ---------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


NonNegInt = Annotated[int, Field(ge=0)]


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (vLLM's extras included)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def common_unsupported(self) -> str | None:
        if self.n != 1:
            return "n must be 1: this server returns one choice per prompt"
        if self.best_of not in (None, 1):
            return "best_of is not supported"
        if self.presence_penalty not in (None, 0.0) or self.frequency_penalty not in (None, 0.0):
            return "presence_penalty and frequency_penalty are not supported"
        if self.repetition_penalty not in (None, 1.0):
            return "repetition_penalty is not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=1)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, bool) for x in v) and v:
                raise ValueError("prompt must be a string, a list of strings or token ids")
            if any(isinstance(x, list) and not x for x in v):
                raise ValueError("a token-id prompt must not be empty")
        return v

    def prompts(self) -> list[str | PromptIds]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def unsupported_reason(self) -> str | None:
        if self.echo:
            return "echo is not supported"
        if self.logprobs is not None:
            return "logprobs is not supported"
        if self.suffix:
            return "suffix is not supported"
        return self.common_unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant")


class ChatMessage(BaseModel):
    """One chat message. Every role needs ``content``: a string, or (user and assistant) a list of text parts;
    system and developer messages take a string or text parts too. Other roles (tools) are not supported."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_for_role(self) -> ChatMessage:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"role must be one of {', '.join(CHAT_ROLES)}, got {self.role!r}")
        if self.content is None:
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts)")
        if isinstance(self.content, list) and any(p.type != "text" or p.text is None for p in self.content):
            raise ValueError(f"{self.role} message content parts must be {{'type': 'text', 'text': str}}")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(f"content parts of type {part.type!r} are not supported", param="messages")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_reason(self) -> str | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs is not supported"
        if self.tools:
            return "tools are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format other than text is not supported"
        return self.common_unsupported()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, int]
) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def completion_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: int | str | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_chunk(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, int] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def chat_response(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, int]
) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def chat_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: int | str | None = None
) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    use: dict[str, int] | None = None,
    stop_reason: int | str | None = None,
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    if delta is not None:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        choices.append(choice)
    out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def model_card(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "tetriinfer", "root": name,
            "parent": None, "max_model_len": max_model_len, "permission": []}

