"""A model's own chat template (tokenizer_config ``chat_template``), rendered with jinja2 the way
transformers' ``apply_chat_template(..., tokenize=False)`` renders it.

Same environment as transformers: a sandboxed, immutable jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text,
``raise_exception`` and ``strftime_now`` globals; the template sees ``messages``,
``add_generation_prompt``, the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) and any
extra keyword arguments. ``continue_final_message`` cuts the text right after the final message's
content, so the model continues that message instead of starting a new turn.

Invariant: rendering is a pure function of (template, messages, flags, special tokens); a template
error surfaces as ``ChatTemplateError`` with the template's own message.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

_CONTINUE_TAG = "\x00TETRIINFER_CONTINUE\x00"


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """The compiled jinja2 template for ``source`` (cached: a server renders one template all day)."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc


def special_tokens_of(tokenizer: Any) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... of an HF tokenizer, as strings (those it defines)."""
    out: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            out[name] = str(value)
    return out


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text ``source`` makes of ``messages`` (see the module docstring)."""
    from jinja2.exceptions import TemplateError

    template = compile_template(source)
    chat = [dict(m) for m in messages]
    if continue_final_message:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ChatTemplateError("continue_final_message needs a final message with text content")
        chat[-1]["content"] = chat[-1]["content"] + _CONTINUE_TAG
    context = {**(special_tokens or {}), **kwargs}
    try:
        text = template.render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc
    if continue_final_message:
        cut = text.rfind(_CONTINUE_TAG)
        if cut < 0:
            raise ChatTemplateError("the chat template does not render the final message's content")
        text = text[:cut]
    return str(text)
