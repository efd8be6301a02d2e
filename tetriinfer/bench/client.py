"""Open-loop load generator for any OpenAI-compatible server (``/v1/completions``, streaming).

Each workload request is sent at its scheduled arrival time regardless of how many are in flight (open
loop; an optional ``max_concurrency`` caps in-flight requests, and the resulting wait shows up as
``send_lag``). Requests ask for exactly ``output_tokens`` tokens: ``max_tokens`` = ``min_tokens`` = N and
``ignore_eos`` (vLLM extras, sent unless ``vllm_extras=False``); with ``output_lengths="natural"`` answers end
where the model ends them and ``output_tokens`` is only the ``max_tokens`` cap. Prompts are lists of token ids of exactly
the workload's length, built from a real text with the server's tokenizer when one is given (each
prompt starts with a few per-request random tokens so prefix caches do not share whole prompts), or from
random ids in ``random_token_range`` otherwise.

Token counting: per chunk, from the cumulative ``usage`` (vLLM's ``continuous_usage_stats``), else the
chunk's ``logprobs.tokens`` or ``token_ids``, else one token per non-empty text chunk; the total is the
final ``usage.completion_tokens`` when the server sends it (``stream_options.include_usage``).

Transport: ``bench.sse_transport`` (one ``asyncio.Protocol`` per request, on uvloop), which costs the machine
under test far less CPU per streamed token than httpx; ``ClientConfig(transport="httpx")`` keeps httpx's client
for comparison (`benchmarks/bench_client_overhead.py`).

Failures (HTTP errors, error events, disconnects, timeouts, a stream that ends before ``[DONE]``/a
finish reason) are recorded on the request and counted; they never stop the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import uvloop
from tqdm import tqdm

from tetriinfer.bench.metrics import SLO, RequestRecord, summarize
from tetriinfer.bench.server_usage import scrape_settled, usage_between
from tetriinfer.bench.sse_transport import Endpoint, RemoteProtocolError, post_stream
from tetriinfer.bench.workloads import Workload, WorkloadRequest, with_max_context
from tetriinfer.core.sampling_params import derived_seed
from tetriinfer.runtime.priority import apply_affinity, apply_realtime, check_rt_priority

_BASE_TEXT = (
    "The river bends twice before it reaches the old mill, and in late summer the water runs low enough "
    "that children wade across to the gravel bar to look for flat stones. Farmers on the eastern bank "
    "still argue about the bridge that was promised decades ago, while the ferry keeper keeps a ledger of "
    "every crossing, noting the weather, the cargo, and the names of strangers. In winter the mill wheel "
    "freezes, the roads turn to mud, and the village library becomes the warmest room in town, where "
    "students read history, chemistry, poetry and mathematics by the light of tall windows."
)


TRANSPORTS = ("raw", "httpx")


OUTPUT_LENGTHS: tuple[str, ...] = ("fixed", "natural")


@dataclass(frozen=True)
class ClientConfig:
    """How to reach the server and shape the requests."""

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    tokenizer: str | None = None
    max_context: int | None = None
    detect_max_context: bool = True
    vllm_extras: bool = True
    # > 0: sampled answers, each request with a seed derived from ``seed`` and its index (``request_seed``), so every
    # run of the same workload (every column of a side-by-side) draws the same answer for the same request
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_concurrency: int | None = None
    random_token_range: tuple[int, int] = (100, 1000)
    api_key: str | None = None
    seed: int = 0
    progress: bool = True
    user: str | None = None  # OpenAI's ``user`` field on every request (tags a run in the server's logs)
    server_usage: bool = True  # read the server's /metrics before and after the run (bench.server_usage)
    transport: str = "raw"  # "raw": bench.sse_transport (lean, the default); "httpx": httpx's streaming client
    rt_priority: int | None = None  # run the client under SCHED_FIFO at this priority for the run (run_client)
    cores: tuple[int, ...] | None = None  # pin the client to these CPU cores for the run (run_client)
    # "fixed": exactly the workload's output length (ignore_eos + min_tokens); "natural": answers end at EOS and
    # the workload's output length is only the max_tokens cap
    output_lengths: str = "fixed"


    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise ValueError("model must be a non-empty name (the server's model id)")
        if not self.endpoint.startswith("/"):
            raise ValueError(f"endpoint must start with '/', got {self.endpoint!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be >= 1, got {self.max_context}")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        lo, hi = self.random_token_range
        if not (0 <= lo < hi):
            raise ValueError(
                f"random_token_range must be (lo, hi) with 0 <= lo < hi, got {self.random_token_range}"
            )
        if self.rt_priority is not None:
            check_rt_priority(self.rt_priority)
        check_temperature(self.temperature)
        if self.output_lengths not in OUTPUT_LENGTHS:
            raise ValueError(f"output_lengths must be one of {', '.join(OUTPUT_LENGTHS)}, got {self.output_lengths!r}")
        if self.cores is not None and (not self.cores or min(self.cores) < 0):
            raise ValueError(f"cores must be a non-empty list of core numbers, got {self.cores}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise FileNotFoundError(f"tokenizer not found: {self.tokenizer}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def check_temperature(temperature: float) -> None:
    """ValueError unless ``temperature`` is in [0, 2] (OpenAI's range; 0 is greedy)."""
    if not 0.0 <= temperature <= 2.0:
        raise ValueError(f"temperature must be in [0, 2], got {temperature}")


def request_seed(seed: int, index: int) -> int:
    """The sampling seed of request ``index`` of a workload run with client ``seed``: a function of the two only
    (a 31-bit value, which every OpenAI-compatible server accepts)."""
    return derived_seed(f"request:{seed}:{index}")


class PromptBuilder:
    """Builds prompts of exactly N token ids, deterministic per (seed, request index); a prompt made of trace
    hash blocks (``build_from_blocks``) is deterministic per (seed, hash id) block by block, so two requests
    whose traces share leading hash ids share exactly those leading tokens (what a prefix cache can reuse)."""

    def __init__(
        self, tokenizer: str | None, seed: int, random_token_range: tuple[int, int] = (100, 1000)
    ) -> None:
        self._seed = seed
        self._range = random_token_range
        self._base_ids: np.ndarray | None = None
        if tokenizer is not None:
            ids = _encode_with_tokenizer(tokenizer, _BASE_TEXT)
            if len(ids) < 16:
                raise ValueError(f"tokenizer {tokenizer} encodes the base text to only {len(ids)} tokens")
            self._base_ids = np.asarray(ids, dtype=np.int64)

    def build(self, index: int, num_tokens: int) -> list[int]:
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {num_tokens}")
        rng = np.random.default_rng([self._seed, 7, index])
        if self._base_ids is None:
            lo, hi = self._range
            return rng.integers(lo, hi, size=num_tokens).tolist()
        base = self._base_ids
        reps = -(-num_tokens // len(base)) + 1
        start = int(rng.integers(0, len(base)))
        ids = np.tile(base, reps)[start : start + num_tokens].copy()
        head = min(8, num_tokens)
        ids[:head] = rng.choice(np.unique(base), size=head)  # per-request prefix: no shared prompt caches
        return ids.tolist()

    def _block(self, hash_id: int, block_tokens: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, 11, hash_id])
        if self._base_ids is None:
            lo, hi = self._range
            return rng.integers(lo, hi, size=block_tokens)
        return rng.choice(np.unique(self._base_ids), size=block_tokens)

    def build_from_blocks(self, index: int, num_tokens: int, hash_ids: tuple[int, ...], block_tokens: int) -> list[int]:
        """``num_tokens`` ids: the blocks of ``hash_ids`` in order (the last one cut short), then, if the trace
        names fewer blocks than the length needs, tokens of this request alone."""
        if num_tokens < 1 or block_tokens < 1:
            raise ValueError(f"need num_tokens >= 1 and block_tokens >= 1, got {num_tokens}, {block_tokens}")
        parts = [self._block(h, block_tokens) for h in hash_ids[: -(-num_tokens // block_tokens)]]
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if len(ids) < num_tokens:
            ids = np.concatenate([ids, np.asarray(self.build(index, num_tokens - len(ids)), dtype=np.int64)])
        return ids[:num_tokens].tolist()


def _encode_with_tokenizer(path: str, text: str) -> list[int]:
    p = Path(path)
    tok_file = p / "tokenizer.json" if p.is_dir() else p
    if tok_file.is_file() and tok_file.suffix == ".json":
        from tokenizers import Tokenizer

        return list(Tokenizer.from_file(str(tok_file)).encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    return list(tok.encode(text, add_special_tokens=False))


class _StreamFailure(Exception):
    pass


def _chunk_token_count(choice: dict[str, Any], text: str) -> int:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    return 1 if text else 0


_JSON = msgspec.json.Decoder()  # ~3x json.loads on a chunk; raises msgspec.DecodeError (a ValueError)


class _StreamTally:
    """One request's streamed events as they arrive: tokens per chunk, chunk times, the final usage.

    ``on_data(payload, now)`` takes one ``data:`` payload of the event stream (``now`` = ``time.perf_counter()``
    when it was read) and returns True at ``[DONE]``. Token counting is the module docstring's; an error event
    or a payload that is not a JSON object raises (the request fails)."""

    __slots__ = ("rec", "t0", "usage_total", "cumulative", "finished")

    def __init__(self, rec: RequestRecord, t0: float) -> None:
        self.rec = rec
        self.t0 = t0
        self.usage_total: int | None = None
        self.cumulative: int | None = None
        self.finished = False

    def on_data(self, payload: bytes, now: float) -> bool:
        if payload == b"[DONE]":
            self.finished = True
            return True
        data = _JSON.decode(payload)
        if not isinstance(data, dict):
            raise _StreamFailure(f"bad event: {payload[:200].decode('utf-8', 'replace')}")
        if "error" in data:
            raise _StreamFailure(f"server error event: {json.dumps(data['error'])[:300]}")
        choices = data.get("choices") or []
        usage = data.get("usage") or None
        completion = usage.get("completion_tokens") if usage else None
        n_tok = 0
        if choices:
            choice = choices[0]
            if completion is not None:
                n_tok = int(completion) - (self.cumulative or 0)
                self.cumulative = int(completion)
            else:
                n_tok = _chunk_token_count(choice, choice.get("text") or "")
            if choice.get("finish_reason") is not None:
                self.finished = True
        if completion is not None:
            self.usage_total = int(completion)
        if n_tok > 0:
            rec = self.rec
            if rec.first_token_s is None:
                rec.first_token_s = now - self.t0
            rec.chunk_times_s.append(now - self.t0)
            rec.chunk_tokens.append(n_tok)
        return False


class BenchmarkClient:
    """Sends one workload open-loop and returns per-request records plus the run duration."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self._prompts = PromptBuilder(config.tokenizer, config.seed, config.random_token_range)
        self._endpoint = Endpoint.from_url(config.url)
        self._auth = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None

    def payload(self, index: int, req: WorkloadRequest) -> dict[str, Any]:
        cfg = self.config
        prompt: list[int] | str
        if req.prompt_text is not None:
            prompt = req.prompt_text
        elif req.prefix_blocks:
            prompt = self._prompts.build_from_blocks(index, req.prompt_tokens, req.prefix_blocks,
                                                     req.prefix_block_tokens)
        else:
            prompt = self._prompts.build(index, req.prompt_tokens)
        body: dict[str, Any] = {
            "model": cfg.model,
            "prompt": prompt,
            "max_tokens": req.output_tokens,
            "temperature": cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cfg.temperature > 0:
            body["seed"] = request_seed(cfg.seed, index)
        if cfg.user is not None:
            body["user"] = cfg.user
        if cfg.vllm_extras:
            if cfg.output_lengths == "fixed":
                body["ignore_eos"] = True
                body["min_tokens"] = req.output_tokens
            body["stream_options"]["continuous_usage_stats"] = True
        return body

    async def detect_max_context(self, client: httpx.AsyncClient) -> int | None:
        """``max_model_len`` of the model from ``GET /v1/models`` (vLLM and ours report it), if any."""
        try:
            resp = await client.get(self.config.base_url.rstrip("/") + "/v1/models")
            if resp.status_code != 200:
                return None
            for card in resp.json().get("data", []):
                if card.get("id") == self.config.model and isinstance(card.get("max_model_len"), int):
                    return int(card["max_model_len"])
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return None

    async def _one(
        self,
        client: httpx.AsyncClient,
        index: int,
        req: WorkloadRequest,
        rec: RequestRecord,
        t0: float,
        sem: asyncio.Semaphore | None,
    ) -> None:
        if sem is not None:
            async with sem:
                await self._send(client, index, req, rec, t0)
        else:
            await self._send(client, index, req, rec, t0)

    async def _send(
        self, client: httpx.AsyncClient, index: int, req: WorkloadRequest, rec: RequestRecord, t0: float
    ) -> None:
        body = self.payload(index, req)
        rec.send_s = time.perf_counter() - t0
        tally = _StreamTally(rec, t0)
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                if self.config.transport == "raw":
                    await self._stream_raw(body, rec, tally)
                else:
                    await self._stream_httpx(client, body, rec, tally)
            rec.output_tokens = tally.usage_total if tally.usage_total is not None else sum(rec.chunk_tokens)
            if not tally.finished:
                raise _StreamFailure("stream ended before [DONE] or a finish_reason")
            if rec.output_tokens < 1 or not rec.chunk_times_s:
                raise _StreamFailure("stream finished without any output token")
            rec.success = True
        except _StreamFailure as exc:
            rec.error = str(exc)
        except TimeoutError:
            rec.error = f"timeout: no completion within {self.config.request_timeout_s} s"
        except (httpx.HTTPError, RemoteProtocolError, OSError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        except (json.JSONDecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
            rec.error = f"bad stream: {type(exc).__name__}: {exc}"
        finally:
            rec.finish_s = time.perf_counter() - t0
            if not rec.success and rec.output_tokens == 0:
                rec.output_tokens = sum(rec.chunk_tokens)

    async def _stream_raw(self, body: dict[str, Any], rec: RequestRecord, tally: _StreamTally) -> None:
        status, error_body = await post_stream(
            self._endpoint, json.dumps(body).encode(), tally.on_data, headers=self._auth,
            connect_timeout_s=self.config.connect_timeout_s,
        )
        rec.http_status = status
        if status != 200:
            raise _StreamFailure(f"HTTP {status}: {error_body[:300].decode('utf-8', 'replace')}")

    async def _stream_httpx(
        self, client: httpx.AsyncClient, body: dict[str, Any], rec: RequestRecord, tally: _StreamTally
    ) -> None:
        async with client.stream("POST", self.config.url, json=body) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                detail = (await resp.aread())[:300].decode("utf-8", "replace")
                raise _StreamFailure(f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                line = line.strip()
                if line.startswith("data:") and tally.on_data(line[5:].strip().encode(), time.perf_counter()):
                    break

    async def run(self, workload: Workload) -> tuple[list[RequestRecord], float, int | None]:
        """Send the workload; return (records in workload order, run duration s, max context used)."""
        cfg = self.config
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
            max_context = cfg.max_context
            if max_context is None and cfg.detect_max_context:
                max_context = await self.detect_max_context(client)
            workload = with_max_context(workload, max_context)
            records = [
                RequestRecord(
                    r.request_id,
                    r.prompt_tokens,
                    r.output_tokens,
                    r.arrival_s,
                    rejected=r.rejected,
                    error=r.reject_reason if r.rejected else None,
                )
                for r in workload.requests
            ]
            sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
            bar = tqdm(total=len(records), desc=workload.name, unit="req", disable=not cfg.progress)
            tasks: list[asyncio.Task[None]] = []
            t0 = time.perf_counter()
            try:
                for index, (req, rec) in enumerate(zip(workload.requests, records, strict=True)):
                    if req.rejected:
                        bar.update(1)
                        continue
                    delay = t0 + req.arrival_s - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    task = asyncio.create_task(self._one(client, index, req, rec, t0, sem))
                    task.add_done_callback(lambda _t: bar.update(1))
                    tasks.append(task)
                await asyncio.gather(*tasks)
                if cfg.output_lengths == "natural":  # shorter is expected; only going past the cap is a mismatch
                    for rec in records:
                        rec.expected_output_tokens = min(rec.output_tokens, rec.expected_output_tokens)
            finally:
                for task in tasks:
                    task.cancel()
                bar.close()
            duration = time.perf_counter() - t0
        return records, duration, max_context


def run_client(
    config: ClientConfig, workload: Workload, loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
) -> tuple[list[RequestRecord], float, int | None]:
    """``BenchmarkClient(config).run(workload)`` on its own event loop: uvloop's (less CPU per streamed token than
    asyncio's) unless ``loop_factory`` says otherwise.

    With ``config.rt_priority`` the calling process runs under ``SCHED_FIFO`` for the run (``SCHED_RESET_ON_FORK``:
    nothing it starts inherits it) and goes back to the normal scheduler after: a load client that shares cores
    with the server it measures then records each token when it arrives, not after an engine's forward that
    happened to run on its core. Without the privilege it warns and runs as it is.

    With ``config.cores`` the calling process runs on those cores for the run and gets its previous mask back
    after: on a CPU testbed, the client can then stay off the cores of the instances it measures."""
    realtime = config.rt_priority is not None and apply_realtime(config.rt_priority, "load client",
                                                                 reset_on_fork=True)
    previous_cores = tuple(sorted(os.sched_getaffinity(0))) if config.cores is not None else None
    pinned = apply_affinity(config.cores, "load client")
    try:
        with asyncio.Runner(loop_factory=loop_factory or uvloop.new_event_loop) as runner:
            return runner.run(BenchmarkClient(config).run(workload))
    finally:
        if realtime:
            apply_realtime(None, "load client")
        if pinned and previous_cores is not None:
            apply_affinity(previous_cores, "load client")


def run_benchmark(
    config: ClientConfig, workload: Workload, slo: SLO | None = None, label: str | None = None
) -> dict[str, Any]:
    """Run one workload against one server; the results dict (config, workload, summary, requests, and
    ``server_usage``: what the server's ``/metrics`` says the run cost, see ``bench.server_usage``; None for
    servers that export neither our counters nor vLLM's)."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    before = scrape_settled(config.base_url, config.api_key) if config.server_usage else None
    records, duration, max_context = run_client(config, workload)
    after = scrape_settled(config.base_url, config.api_key) if before is not None else None
    summary = summarize(records, duration, slo)
    cfg = asdict(config)
    cfg["max_context_used"] = max_context
    return {
        "benchmark": "tetriinfer bench",
        "format_version": 1,
        "label": label or f"{config.model}@{config.base_url}",
        "started_at": started,
        "config": cfg,
        "workload": workload.describe(),
        "summary": summary,
        "server_usage": usage_between(before, after),
        "requests": [r.to_dict() for r in records],
    }


def benchmark_server(
    base_url: str,
    model: str,
    workloads: Sequence[Workload],
    slo: SLO | None = None,
    label: str | None = None,
    **client_options: Any,
) -> dict[str, dict[str, Any]]:
    """Hook for ``bench side-by-side``: run each workload in turn against one server.

    Returns ``{workload.name: results dict}`` (see ``run_benchmark``); ``flat_summary(result["summary"])``
    gives the side-by-side row. ``client_options`` are further ``ClientConfig`` fields.
    """
    config = ClientConfig(base_url=base_url, model=model, **client_options)
    out: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        if workload.name in out:
            raise ValueError(f"workload {workload.name} given twice")
        out[workload.name] = run_benchmark(config, workload, slo, label)
    return out


def save_results(results: dict[str, Any], path: str | Path) -> Path:
    """Write a results dict as indented JSON (parent folders created)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return p
