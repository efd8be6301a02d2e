"""``EngineClient`` over one ``LLMEngine`` stepping on a background thread (tests, single-engine serving).

Threads: the engine (model, scheduler, KV blocks) is touched only by the engine thread. The asyncio
side talks to it through a thread-safe command queue (add / abort / stop); the engine thread answers
through ``loop.call_soon_threadsafe`` into one ``asyncio.Queue`` per request.

Invariants:
- Every request passed to ``generate`` gets exactly one event with ``finished=True`` (completed, aborted,
  failed, or aborted by ``shutdown``), and that event is the last one of its stream.
- When the finished event is sent, the request holds no KV block (the scheduler frees blocks in the call
  that finishes a request; aborts are applied before the event is sent).
- Closing a ``generate`` iterator before its finished event (client disconnect, ``break``, task cancel)
  aborts the request in the engine.
- Token events carry the tokens produced since the previous event of that request, in order; together
  they are exactly the request's output tokens.
- ``cluster_info()`` reads a snapshot the engine thread publishes after every loop iteration, so it never
  races with the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tetriinfer.core.request import Request
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.llm_engine import LLMEngine, load_tokenizer
from tetriinfer.runtime.engine_client import TokenEvent

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request."""

    request: Request | None
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[TokenEvent]
    sent: int = 0
    num_prompt_tokens: int = 0


@dataclass
class _Counters:
    finished: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    step_errors: int = 0
    busy_s: float = 0.0  # seconds spent in engine steps (the resource usage ``tetriinfer bench`` reads)


class InProcessEngineClient:
    """One engine on a thread, behind the ``EngineClient`` protocol (``cluster_info`` mode "single")."""

    def __init__(
        self, config: EngineConfig, *, model_name: str | None = None, engine: LLMEngine | None = None
    ) -> None:
        self.config = config
        self._engine = engine if engine is not None else LLMEngine(config)
        self.model_name = model_name or os.path.basename(os.path.normpath(config.model))
        self.max_model_len: int = self._engine.max_model_len
        self.eos_token_id: int | None = self._engine.eos_token_id
        self._vocab_size = self._engine.model_config.vocab_size
        # The HTTP side gets its own tokenizer object: HF fast tokenizers are not safe to share
        # between the event-loop thread and the engine thread (which decodes for stop strings).
        self._tokenizer = (
            load_tokenizer(config.model) if self._engine.tokenizer is not None else None
        )
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._accept_lock = threading.Lock()
        self._accepting = False
        self._open: set[str] = set()  # request ids with a stream not yet finished (event-loop side)
        self._counters = _Counters()
        self._fatal: str | None = None
        self._snapshot: dict[str, Any] = self._make_snapshot("starting")

    # ---- EngineClient ----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        with self._accept_lock:
            self._accepting = True
        self._thread = threading.Thread(target=self._run, name="tetriinfer-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; requests still running get a finished "abort" event."""
        thread = self._thread
        if thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 30.0)
        self._thread = None

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """Stream tokens. Raises ValueError (before any event) for a prompt the engine cannot take."""
        self._validate(request_id, prompt_token_ids)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[TokenEvent] = asyncio.Queue()
        with self._accept_lock:
            if not self._accepting:
                raise RuntimeError("the engine is not running (start() not called, shut down, or failed)")
            self._commands.put(("add", request_id, list(prompt_token_ids), params, loop, out))
        self._open.add(request_id)
        finished = False
        try:
            while True:
                event = await out.get()
                finished = event.finished
                yield event
                if finished:
                    return
        finally:
            self._open.discard(request_id)
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; a no-op when it is unknown or already finished."""
        self._commands.put(("abort", request_id))

    def cluster_info(self) -> dict[str, Any]:
        snap = dict(self._snapshot)
        snap["instances"] = [dict(i) for i in snap["instances"]]
        return snap

    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._fatal is None

    # ---- validation ------------------------------------------------------------------------
    def _validate(self, request_id: str, ids: list[int]) -> None:
        if request_id in self._open:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the model's context is {self.max_model_len} tokens "
                "(prompt + at least one output token)"
            )
        bad = [t for t in ids if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self._vocab_size})")

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        live: dict[str, _Live] = {}
        try:
            while True:
                block = not engine.has_unfinished()
                if not self._drain_commands(live, block):
                    break
                if engine.has_unfinished():
                    self._step(live)
                self._snapshot = self._make_snapshot("running")
        except BaseException as exc:  # noqa: BLE001 - the thread must never die silently
            self._fatal = f"{type(exc).__name__}: {exc}"
            log.exception("engine thread crashed")
        finally:
            with self._accept_lock:
                self._accepting = False
            # Requests queued but never added still get their one finished event.
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] == "add":
                    live[cmd[1]] = _Live(request=None, loop=cmd[4], out=cmd[5], num_prompt_tokens=len(cmd[2]))
            reason = "error" if self._fatal else "abort"
            for rid in list(live):
                with contextlib.suppress(Exception):
                    engine.abort(rid)
                self._finish(live, rid, (), reason, error=self._fatal or "the engine was shut down")
            self._snapshot = self._make_snapshot("failed" if self._fatal else "stopped")

    def _drain_commands(self, live: dict[str, _Live], block: bool) -> bool:
        """Apply queued commands; return False on "stop"."""
        while True:
            try:
                cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if cmd[0] == "stop":
                return False
            if cmd[0] == "add":
                self._add(live, *cmd[1:])
            elif cmd[0] == "abort":
                rid = cmd[1]
                if rid in live:
                    self._engine.abort(rid)
                    self._finish(live, rid, (), "abort")

    def _add(
        self,
        live: dict[str, _Live],
        rid: str,
        ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        out: asyncio.Queue[TokenEvent],
    ) -> None:
        entry = _Live(request=None, loop=loop, out=out, num_prompt_tokens=len(ids))
        live[rid] = entry
        try:
            self._engine.add_request(rid, None, ids, params)
        except Exception as exc:  # ValueError for bad input; anything else is reported the same way
            self._finish(live, rid, (), "error", error=str(exc))
            return
        entry.request = self._engine.scheduler.requests.get(rid)

    def _step(self, live: dict[str, _Live]) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self._engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._counters.step_errors += 1
            for rid in list(live):
                with contextlib.suppress(Exception):
                    self._engine.abort(rid)
                self._finish(live, rid, (), "error", error=f"engine step failed: {type(exc).__name__}: {exc}")
            return
        self._counters.steps += 1
        self._counters.busy_s += time.perf_counter() - t0
        done = {o.request_id: o for o in outputs}
        for rid, entry in list(live.items()):
            if rid in done:
                out = done[rid].outputs[0]
                self._finish(
                    live, rid, out.token_ids[entry.sent :], out.finish_reason or "stop",
                    stop_reason=out.stop_reason, metrics=done[rid].metrics,
                )
            elif entry.request is not None and len(entry.request.output_token_ids) > entry.sent:
                new = entry.request.output_token_ids[entry.sent :]
                entry.sent += len(new)
                self._post(entry, TokenEvent(rid, tuple(new), num_prompt_tokens=entry.num_prompt_tokens))

    def _finish(
        self,
        live: dict[str, _Live],
        rid: str,
        tokens: Any,
        reason: str,
        *,
        stop_reason: int | str | None = None,
        error: str | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        entry = live.pop(rid)
        self._counters.finished[reason] = self._counters.finished.get(reason, 0) + 1
        event = TokenEvent(
            request_id=rid,
            token_ids=tuple(tokens),
            finished=True,
            finish_reason=reason,
            stop_reason=stop_reason,
            error=error,
            num_prompt_tokens=entry.num_prompt_tokens,
            metrics=dict(metrics or {}),
        )
        self._post(entry, event)

    @staticmethod
    def _post(entry: _Live, event: TokenEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            entry.loop.call_soon_threadsafe(entry.out.put_nowait, event)

    def _make_snapshot(self, state: str) -> dict[str, Any]:
        sched = self._engine.scheduler
        kv = sched.kv
        instance = {
            "id": "engine-0",
            "role": "colocated",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "state": state,
            "kv_blocks_used": kv.num_used_blocks,
            "kv_blocks_total": kv.num_blocks,
            "queued": len(sched.waiting),
            "running": len(sched.running),
            **kv.prefix_cache_stats(),
            "steps": self._counters.steps,
            "busy_s": self._counters.busy_s,
            "step_errors": self._counters.step_errors,
            "requests_finished": dict(self._counters.finished),
            "updated_at": time.time(),
        }
        return {"mode": "single", "instances": [instance], "flips": []}
