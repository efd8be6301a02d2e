"""OpenAI-compatible HTTP API over any ``EngineClient`` (FastAPI; run it with uvicorn).

``build_app(client, served_model_name=..., api_key=...)`` returns the app. Routes:
``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming SSE or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``GET /cluster``, ``GET /version``; on a multi-instance server also
``POST /cluster/instances`` (``{"role": ...}``: scale out by one) and ``DELETE /cluster/instances/{id}`` (scale in:
drain, then stop), both under the API key like ``/cluster``.

Behaviour (vLLM's, which users compare against):
- ``max_tokens`` when absent: completions 16 (OpenAI's and vLLM's default), chat the whole context left
  (``max_model_len - prompt tokens``, like vLLM); both are capped to the context left. An explicit
  ``max_tokens`` that does not fit next to the prompt is a 400, as in vLLM.
- Text prompts are tokenized with ``tokenizer.encode`` (special tokens added, as ``LLM.generate`` does);
  chat messages go through the model's own chat template (rendered by ``server.chat_template`` exactly as
  transformers' ``apply_chat_template(tokenize=False)`` would, then encoded without adding special tokens,
  since the template writes them), or a plain ``role: content`` fallback when the tokenizer has none.
- Generation stops at every EOS id of the model folder's generation_config (unless ``ignore_eos``), with
  ``finish_reason: "stop"``; no token follows the EOS.
- Text is produced by ``IncrementalDetokenizer`` (stop strings, partial UTF-8), so streamed text equals
  the non-streamed text; a stop string found here aborts the request in the engine.
- Errors: OpenAI's ``{"error": {"message", "type", "param", "code"}}``; validation problems are 400
  (never 422), an unknown model 404, a missing/bad API key 401 (only ``/v1/*`` and ``/cluster`` are
  protected; ``/health``, ``/metrics`` and ``/version`` stay open), a failure inside the engine 500, or
  while streaming an error event followed by ``data: [DONE]``.
- A client that disconnects (streaming or not) gets its request aborted in the engine.
- Limits (``server.limits.ServerLimits``): prompts per request, prompt tokens per request and ``max_tokens`` are
  checked before any prompt is tokenized or submitted (400 above them); admitted engine requests and their tokens
  are bounded, and a request beyond the bounds is refused with 429 and ``Retry-After`` (OpenAI's error shape).

The app's lifespan calls ``client.start()`` and ``client.shutdown()`` unless ``manage_client=False``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tetriinfer import __version__
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.runtime.engine_client import EngineClient, TokenEvent
from tetriinfer.server.chat_template import ChatTemplateError, render_chat, special_tokens_of
from tetriinfer.server.detokenizer import IncrementalDetokenizer
from tetriinfer.server.limits import Admission, ServerLimits, default_pending_tokens
from tetriinfer.server.metrics import ServerMetrics
from tetriinfer.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    chat_choice,
    chat_chunk,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_response,
    error_body,
    model_card,
    new_id,
    now_s,
    usage,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_COMPLETION_MAX_TOKENS = 16
_DISCONNECT_POLL_S = 0.25
_PROTECTED_PREFIXES = ("/v1/", "/cluster")


class AddInstanceRequest(pydantic.BaseModel):
    role: str  # prefill | decode (disaggregated modes), colocated (colocated modes)


class _Disconnected(Exception):
    """The HTTP client went away before the response was ready."""


# ---- one choice (one engine request) --------------------------------------------------------------
class _ChoiceRun:
    """Drives one engine request: events -> detokenizer -> text deltas; records metrics once.

    Invariant: ``run`` yields after every event; once it returns, ``finish_reason`` is set, or the
    iteration was cut short (disconnect) and the request was aborted in the engine.
    """

    def __init__(
        self,
        client: EngineClient,
        metrics: ServerMetrics,
        index: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        detok: IncrementalDetokenizer,
        t0: float,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.index = index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.detok = detok
        self.t0 = t0
        self.t_first: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self._gen: AsyncIterator[TokenEvent] | None = None
        self._first: TokenEvent | None = None
        self._engine_finished = False
        self._recorded = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.detok.num_tokens

    async def open(self) -> None:
        """Submit the request and wait for its first event (so bad input is a 400, not a broken stream)."""
        gen = self.client.generate(self.request_id, self.prompt_ids, self.params)
        self._gen = gen
        try:
            self._first = await gen.__anext__()
        except ValueError as exc:
            raise OpenAIError(str(exc), status_code=400) from exc
        except StopAsyncIteration as exc:
            raise OpenAIError("the engine closed the request without any event", status_code=500) from exc
        except RuntimeError as exc:
            raise OpenAIError(str(exc), status_code=503) from exc
        except BaseException:
            await self.close()
            raise

    async def run(self) -> AsyncIterator[str]:
        assert self._gen is not None and self._first is not None, "open() first"
        try:
            event: TokenEvent = self._first
            while True:
                delta = self._apply(event)
                yield delta
                if self.finish_reason is not None:
                    return
                try:
                    event = await self._gen.__anext__()
                except StopAsyncIteration:
                    self.error = "the engine stream ended without a finished event"
                    self.finish_reason = "error"
                    yield self.detok.finish()
                    return
        finally:
            await self.close()

    async def collect(self) -> None:
        async for _ in self.run():
            pass

    def _apply(self, event: TokenEvent) -> str:
        if event.token_ids and self.t_first is None:
            self.t_first = time.perf_counter()
        delta = self.detok.add_tokens(event.token_ids)
        if self.detok.stopped:
            self.finish_reason = "stop"
            self.stop_reason = self.detok.stop_reason
            self._engine_finished = event.finished
            return delta
        if event.finished:
            self._engine_finished = True
            delta += self.detok.finish()
            self.finish_reason = event.finish_reason or "stop"
            self.stop_reason = event.stop_reason
            if self.finish_reason == "error":
                self.error = event.error or "the request failed inside the engine"
        return delta

    async def close(self) -> None:
        """Close the engine stream, abort the request if it is still running, record metrics (once)."""
        with anyio.CancelScope(shield=True):
            gen, self._gen = self._gen, None
            aclose: Callable[[], Awaitable[None]] | None = getattr(gen, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            if not self._engine_finished:
                with contextlib.suppress(Exception):
                    await self.client.abort(self.request_id)
        if not self._recorded and self._first is not None:  # requests refused at submission are 4xx
            self._recorded = True
            t_end = time.perf_counter()
            self.metrics.observe_request(
                finish_reason=self.finish_reason or "abort",
                prompt_tokens=self.num_prompt_tokens,
                completion_tokens=self.num_output_tokens,
                ttft_s=None if self.t_first is None else self.t_first - self.t0,
                e2e_s=t_end - self.t0,
            )


# ---- helpers ------------------------------------------------------------------------------------
def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_DONE = "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """StreamingResponse that always closes its body iterator (so aborts run promptly on disconnect)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def _race_disconnect(raw: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``; if the HTTP client disconnects first, cancel it and raise ``_Disconnected``."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise _Disconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _extra_eos_ids(client: EngineClient) -> tuple[int, ...]:
    """EOS ids of the model folder's generation_config beyond the one the engine stops at by itself."""
    from tetriinfer.engine.tokenizer_loader import load_eos_token_ids

    folder = getattr(client.tokenizer, "name_or_path", None)
    if not folder:
        return ()
    return tuple(t for t in load_eos_token_ids(folder) if t != client.eos_token_id)


def _fallback_chat_text(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    text = "\n".join(lines) + "\n"
    if add_generation_prompt:
        text += "assistant:"
    return text


class _ApiKeyMiddleware:
    """Bearer-token check for ``/v1/*`` and ``/cluster`` (pure ASGI, so streaming is untouched)."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics) -> None:
        self.app = app
        self._key = api_key.encode()
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and scope["path"].startswith(
            _PROTECTED_PREFIXES
        ):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self._key):
                self._metrics.observe_error(401)
                resp = JSONResponse(
                    error_body("Unauthorized: send a valid API key as 'Authorization: Bearer <key>'", 401),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---- the app ------------------------------------------------------------------------------------
class _Server:
    """Request handling shared by the routes; holds no per-request state."""

    def __init__(self, client: EngineClient, served_model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits | None = None) -> None:
        self.client = client
        self.model = served_model_name
        self.metrics = metrics
        self.limits = limits = limits or ServerLimits()
        self.admission = Admission(limits.max_pending_requests, limits.max_pending_tokens)
        self._capacity_known = limits.max_pending_tokens is not None
        self.created = now_s()
        self.extra_eos_ids = _extra_eos_ids(client)

    # -- admission
    def _resolve_capacity(self) -> None:
        """The default token bound comes from the KV capacity, known once the client has started."""
        if self._capacity_known:
            return
        try:
            info = self.client.cluster_info()
        except Exception:  # noqa: BLE001 - no capacity figure: keep the floor
            info = {}
        block = getattr(getattr(self.client, "config", None), "block_size", 16)
        blocks = sum(int(i.get("kv_blocks_total") or 0) for i in info.get("instances", []))
        if blocks:
            self.admission.max_tokens = default_pending_tokens(blocks * int(block))
            self._capacity_known = True
        else:
            self.admission.max_tokens = default_pending_tokens(0)

    def admit(self, runs: list[_ChoiceRun]) -> tuple[int, int]:
        """Count ``runs`` against the front-end bounds, or raise a 429; returns what to release at the end."""
        self._resolve_capacity()
        ticket = (len(runs), sum(r.num_prompt_tokens + r.params.max_tokens for r in runs))
        if not self.admission.try_admit(*ticket):
            raise OpenAIError(
                f"The server is overloaded ({self.admission.held_requests} requests, "
                f"{self.admission.held_tokens} tokens pending); retry after {self.limits.retry_after_s} s.",
                status_code=429, headers={"Retry-After": str(self.limits.retry_after_s)},
            )
        return ticket

    def check_prompt_count(self, num_prompts: int) -> None:
        if num_prompts > self.limits.max_prompts_per_request:
            raise OpenAIError(
                f"too many prompts in one request: {num_prompts} > {self.limits.max_prompts_per_request} "
                "(send them as separate requests)", param="prompt")

    def check_prompt_tokens(self, total: int) -> None:
        if total > self.limits.max_prompt_tokens_per_request:
            raise OpenAIError(
                f"too many prompt tokens in one request: {total} > {self.limits.max_prompt_tokens_per_request}",
                param="prompt")

    # -- validation
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise OpenAIError(f"The model `{name}` does not exist.", status_code=404, param="model")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            tok = self.client.tokenizer
            if tok is None:
                raise OpenAIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
            if not prompt:
                raise OpenAIError("the prompt is empty", param="prompt")
            return list(tok.encode(prompt))
        return [int(t) for t in prompt]

    def chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.client.tokenizer
        if tok is None:
            raise OpenAIError("chat needs a tokenizer and this model has none; use /v1/completions with ids")
        msgs = [self._message_dict(m) for m in req.messages]
        template = getattr(tok, "chat_template", None)
        if isinstance(template, str) and template:  # the model's own template, rendered as transformers does
            try:
                text = render_chat(
                    template, msgs, add_generation_prompt=req.add_generation_prompt and not
                    req.continue_final_message, continue_final_message=req.continue_final_message,
                    special_tokens=special_tokens_of(tok), **dict(req.chat_template_kwargs or {}),
                )
            except (ChatTemplateError, TypeError) as exc:  # e.g. a role the template rejects
                raise OpenAIError(f"the chat template failed: {exc}", param="messages") from exc
            return list(tok.encode(text, add_special_tokens=False))
        return list(tok.encode(_fallback_chat_text(msgs, req.add_generation_prompt)))

    @staticmethod
    def _message_dict(m: ChatMessage) -> dict[str, str]:
        return {"role": m.role, "content": m.text()}

    def max_tokens_for(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        limit = self.client.max_model_len
        if prompt_len >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens (and at least one output token is needed). Please reduce the length "
                "of the prompt.",
                param="prompt",
            )
        left = limit - prompt_len
        cap = self.limits.max_tokens_default
        if default is None or (cap is not None and cap < default):
            default = cap
        if requested is None:
            return left if default is None else min(default, left)
        if self.limits.max_tokens_limit is not None and requested > self.limits.max_tokens_limit:
            raise OpenAIError(f"max_tokens must be <= {self.limits.max_tokens_limit}, got {requested}",
                              param="max_tokens")
        if requested > left:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                "completion). Please reduce the length of the prompt or completion.",
                param="max_tokens",
            )
        return requested

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                seed=req.seed,
                min_tokens=req.min_tokens,
                ignore_eos=req.ignore_eos,
                stop=tuple(req.stop_list()),
                # generation_config's other EOS ids end the answer too (unless EOS is ignored)
                stop_token_ids=tuple(dict.fromkeys([*(req.stop_token_ids or ()),
                                                    *(() if req.ignore_eos else self.extra_eos_ids)])),
            )
        except ValueError as exc:
            raise OpenAIError(str(exc)) from exc

    def new_run(
        self,
        index: int,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        req: CompletionRequest | ChatCompletionRequest,
        t0: float,
    ) -> _ChoiceRun:
        tok = self.client.tokenizer
        if tok is None and params.stop:
            raise OpenAIError("stop strings need a tokenizer and this model has none", param="stop")
        detok = IncrementalDetokenizer(
            tok if tok is not None else _NoTokenizer(),
            stop=params.stop,
            min_tokens=params.min_tokens,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        return _ChoiceRun(self.client, self.metrics, index, request_id, ids, params, detok, t0)

    async def open_all(self, raw: Request, runs: list[_ChoiceRun]) -> None:
        """Submit every run and wait for each one's first event; on any failure close them all."""
        tasks = [asyncio.ensure_future(r.open()) for r in runs]
        try:
            await _race_disconnect(raw, asyncio.gather(*tasks))
        except BaseException:
            with anyio.CancelScope(shield=True):
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for r in runs:
                    await r.close()
            raise

    # -- completions
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        reason = req.unsupported_reason()
        if reason:
            raise OpenAIError(reason)
        if isinstance(req.prompt, list) and not all(isinstance(x, int) for x in req.prompt):
            self.check_prompt_count(len(req.prompt))  # before any tokenizing
        prompts = req.prompts()
        self.check_prompt_tokens(sum(len(p) for p in prompts if isinstance(p, list)))
        rid = new_id("cmpl")
        runs = []
        total = 0
        for i, p in enumerate(prompts):
            if i:
                await asyncio.sleep(0)  # let other requests (and /health) run between prompts
            ids = self.tokenize(p)
            total += len(ids)
            self.check_prompt_tokens(total)
            max_tokens = self.max_tokens_for(req.max_tokens, len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
            params = self.sampling_params(req, max_tokens)
            runs.append(self.new_run(i, rid if len(prompts) == 1 else f"{rid}-{i}", ids, params, req, t0))
        return await self._serve(raw, runs, rid, req, chat=False)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        t0 = time.perf_counter()
        self.check_model(req.model)
        reason = req.unsupported_reason()
        if reason:
            raise OpenAIError(reason)
        ids = self.chat_prompt_ids(req)
        self.check_prompt_tokens(len(ids))
        max_tokens = self.max_tokens_for(req.requested_max_tokens(), len(ids), None)
        params = self.sampling_params(req, max_tokens)
        rid = new_id("chatcmpl")
        return await self._serve(raw, [self.new_run(0, rid, ids, params, req, t0)], rid, req, chat=True)

    async def _serve(
        self,
        raw: Request,
        runs: list[_ChoiceRun],
        rid: str,
        req: CompletionRequest | ChatCompletionRequest,
        *,
        chat: bool,
    ) -> Response:
        ticket = self.admit(runs)
        self.metrics.in_flight.inc()
        handed_over = False
        try:
            try:
                await self.open_all(raw, runs)
            except _Disconnected:
                return Response(status_code=499)
            created = now_s()
            if req.stream:
                stream = self._stream_chat(runs[0], rid, created, req) if chat else self._stream_completion(
                    runs, rid, created, req)
                handed_over = True
                return _SSEResponse(
                    self._counted(stream, ticket), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            try:
                await _race_disconnect(raw, asyncio.gather(*(r.collect() for r in runs)))
            except _Disconnected:
                return Response(status_code=499)
            failed = [r for r in runs if r.error]
            if failed:
                raise OpenAIError(failed[0].error or "engine error", status_code=500)
            use = usage(sum(r.num_prompt_tokens for r in runs), sum(r.num_output_tokens for r in runs))
            if chat:
                r = runs[0]
                body = chat_response(rid, created, self.model,
                                     [chat_choice(0, r.detok.text, r.finish_reason, r.stop_reason)], use)
            else:
                body = completion_response(
                    rid, created, self.model,
                    [completion_choice(r.index, r.detok.text, r.finish_reason, r.stop_reason) for r in runs],
                    use,
                )
            return JSONResponse(body)
        finally:
            for r in runs:
                if not handed_over:
                    await r.close()
            if not handed_over:
                self.metrics.in_flight.dec()
                self.admission.release(*ticket)

    async def _counted(self, stream: AsyncIterator[str], ticket: tuple[int, int]) -> AsyncIterator[str]:
        try:
            async for item in stream:
                yield item
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
            self.metrics.in_flight.dec()
            self.admission.release(*ticket)

    async def _merged(self, runs: list[_ChoiceRun]) -> AsyncIterator[tuple[_ChoiceRun, str]]:
        """(run, delta) items of all runs as they come; one run needs no extra tasks."""
        if len(runs) == 1:
            gen = runs[0].run()
            try:
                async for delta in gen:
                    yield runs[0], delta
            finally:
                await gen.aclose()
            return
        q: asyncio.Queue[tuple[_ChoiceRun, str] | BaseException | None] = asyncio.Queue()

        async def pump(run: _ChoiceRun) -> None:
            try:
                async for delta in run.run():
                    q.put_nowait((run, delta))
            except Exception as exc:
                q.put_nowait(exc)
            finally:
                q.put_nowait(None)

        tasks = [asyncio.create_task(pump(r)) for r in runs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)
            for r in runs:
                await r.close()

    def _usage_of(self, runs: list[_ChoiceRun]) -> dict[str, int]:
        return usage(sum(r.num_prompt_tokens for r in runs), sum(r.num_output_tokens for r in runs))

    async def _stream_completion(
        self, runs: list[_ChoiceRun], rid: str, created: int, req: CompletionRequest
    ) -> AsyncIterator[str]:
        opts = req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        merged = self._merged(runs)
        try:
            async for run, delta in merged:
                if run.error:
                    yield _sse(error_body(run.error, 500))
                    yield _DONE
                    return
                if not delta and run.finish_reason is None and not continuous:
                    continue
                choice = completion_choice(run.index, delta, run.finish_reason,
                                           run.stop_reason if run.finish_reason else None)
                yield _sse(completion_chunk(rid, created, self.model, [choice],
                                            self._usage_of(runs) if continuous else None))
            if opts and opts.include_usage:
                yield _sse(completion_chunk(rid, created, self.model, [], self._usage_of(runs)))
            yield _DONE
        finally:
            await merged.aclose()

    async def _stream_chat(
        self, run: _ChoiceRun, rid: str, created: int, req: ChatCompletionRequest
    ) -> AsyncIterator[str]:
        opts = req.stream_options
        continuous = bool(opts and opts.continuous_usage_stats)
        gen = run.run()
        try:
            first = chat_chunk(rid, created, self.model, {"role": "assistant", "content": ""},
                               use=self._usage_of([run]) if continuous else None)
            yield _sse(first)
            async for delta in gen:
                if run.error:
                    yield _sse(error_body(run.error, 500))
                    yield _DONE
                    return
                if not delta and run.finish_reason is None:
                    continue
                yield _sse(chat_chunk(rid, created, self.model, {"content": delta} if delta else {},
                                      run.finish_reason, self._usage_of([run]) if continuous else None,
                                      stop_reason=run.stop_reason))
            if opts and opts.include_usage:
                yield _sse(chat_chunk(rid, created, self.model, None, use=self._usage_of([run])))
            yield _DONE
        finally:
            await gen.aclose()

    # -- info
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [model_card(self.model, self.client.max_model_len, self.created)]}


class _NoTokenizer:
    """Stand-in for models without a tokenizer: output text is empty (clients read token counts)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def build_app(
    client: EngineClient,
    *,
    served_model_name: str,
    api_key: str | None = None,
    metrics: ServerMetrics | None = None,
    manage_client: bool = True,
    after_start: Callable[[], None] | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``client``.

    ``metrics``: pass your own ``ServerMetrics`` to observe transfers/flips into it (also reachable as
    ``app.state.metrics``). ``manage_client``: start/shut down the client in the app's lifespan.
    ``after_start``: called in the lifespan once the client has started, before the first request is served.
    ``limits``: per-request limits and front-end bounds (``ServerLimits()`` when None).
    """
    if not served_model_name:
        raise ValueError("served_model_name must be a non-empty string")
    if api_key is not None and not api_key:
        raise ValueError("api_key must be None or a non-empty string")
    metrics = metrics if metrics is not None else ServerMetrics()
    server = _Server(client, served_model_name, metrics, limits or ServerLimits())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_client:
            await client.start()
        if after_start is not None:
            after_start()
        try:
            yield
        finally:
            if manage_client:
                await client.shutdown()

    app = FastAPI(title="TetriInfer OpenAI-compatible API", version=__version__, lifespan=lifespan)
    app.state.metrics = metrics
    app.state.client = client
    app.state.admission = server.admission
    app.state.served_model_name = served_model_name
    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key, metrics=metrics)

    def _error(message: str, status: int, param: str | None = None, err_type: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.observe_error(status)
        return JSONResponse(error_body(message, status, err_type, param), status_code=status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error(exc.message, exc.status_code, exc.param, exc.err_type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        param = None
        for err in errors[:5]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
                continue
            where = ".".join(loc) or "body"
            param = param or (loc[0] if loc else None)
            parts.append(f"{where}: {err.get('msg')}")
        return _error("; ".join(parts) or "invalid request", 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(f"{type(exc).__name__}: {exc}", 500)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await server.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(body, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        ok = client.is_healthy()
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            metrics.update_cluster(client.cluster_info())
        except Exception:  # a scrape must still show the request metrics
            log.exception("cluster_info() failed during a metrics scrape")
        data, content_type = metrics.render()
        return Response(content=data, media_type=content_type)

    @app.get("/cluster")
    async def cluster() -> dict[str, Any]:
        return {**client.cluster_info(), "frontend_pid": os.getpid()}  # the instances list their own pids

    @app.post("/cluster/instances")
    async def add_instance(body: AddInstanceRequest) -> dict[str, Any]:
        """Scale out by one instance of ``role``; answers when it has started (its startup time included)."""
        if not hasattr(client, "add_instance"):
            raise StarletteHTTPException(400, "this server runs one in-process engine: it has no instances to add")
        try:
            return await client.add_instance(body.role)
        except ValueError as exc:
            raise StarletteHTTPException(400, str(exc)) from exc
        except RuntimeError as exc:
            raise StarletteHTTPException(503, str(exc)) from exc

    @app.delete("/cluster/instances/{instance_id}")
    async def remove_instance(instance_id: str) -> dict[str, Any]:
        """Scale in: drain the instance (nothing it holds is lost), then stop it; answers when it has left."""
        if not hasattr(client, "remove_instance"):
            raise StarletteHTTPException(400, "this server runs one in-process engine: it has no instances")
        try:
            return await client.remove_instance(instance_id)
        except KeyError as exc:
            raise StarletteHTTPException(404, f"no instance {instance_id!r}") from exc
        except ValueError as exc:
            raise StarletteHTTPException(409, str(exc)) from exc
        except RuntimeError as exc:
            raise StarletteHTTPException(503, str(exc)) from exc

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    return app
