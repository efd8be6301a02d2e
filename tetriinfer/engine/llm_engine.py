"""One engine: model runner + local scheduler + detokenization, stepped by its owner.

Used by the offline ``LLM`` API; serving instances reuse ``build_runner`` with their own schedulers.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.local_scheduler import LocalScheduler, LocalSchedulerConfig
from tetriinfer.core.request import FINISH_REASON, Request, RequestStatus
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.engine.device import configure_device
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.huge_pages import move_weights_to_huge_pages
from tetriinfer.engine.kv_cache import KVCacheTensors, bytes_per_block
from tetriinfer.engine.loader import load_model, parse_dtype
from tetriinfer.engine.model_config import ModelConfig
from tetriinfer.engine.model_runner import ModelRunner
from tetriinfer.engine.onednn_packing import pack_linear_weights
from tetriinfer.engine.outputs import CompletionOutput, RequestOutput
from tetriinfer.engine.tokenizer_loader import load_tokenizer  # noqa: F401 - re-exported (engine API)


def _num_kv_blocks(config: EngineConfig, cfg: ModelConfig, max_model_len: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(cfg, config.block_size, parse_dtype(config.dtype))
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    elif config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        budget = 0.85 * free
    else:
        budget = 2 * 2**30
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)  # more can never be used
    return max(1, min(int(budget // per_block), useful))


@dataclass
class EngineParts:
    model: torch.nn.Module
    model_config: ModelConfig
    runner: ModelRunner
    kv_manager: KVCacheManager
    max_model_len: int


def build_runner(config: EngineConfig) -> EngineParts:
    configure_device(config.device, config.num_threads, config.cpu_cores)
    model, cfg = load_model(config.model, config.dtype, config.device, config.load_format, config.seed)
    if config.device == "cpu":
        move_weights_to_huge_pages(model)  # decode streams every weight per step: 2 MiB pages, fewer TLB misses
    pack_linear_weights(model, parse_dtype(config.dtype), config.device)
    max_len = config.max_model_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's {cfg.max_position_embeddings} positions"
        )
    num_blocks = _num_kv_blocks(config, cfg, max_len)
    kv_tensors = KVCacheTensors(cfg, num_blocks, config.block_size, parse_dtype(config.dtype), config.device)
    runner = ModelRunner(model, cfg, kv_tensors, config.device, seed=config.seed)
    return EngineParts(model, cfg, runner, KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching), max_len)


@dataclass
class _Tracked:
    request: Request
    prompt: str | None
    text: str = ""
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_runner(config)
        self.model_config = parts.model_config
        self.runner = parts.runner
        self.kv_manager = parts.kv_manager
        self.max_model_len = parts.max_model_len
        self.tokenizer = load_tokenizer(config.model) if config.load_format != "dummy" else None
        sched_cfg = LocalSchedulerConfig(
            chunk_size=config.chunk_size,
            max_num_seqs=config.max_num_seqs,
            pad_last_chunk=config.pad_last_chunk,
            max_model_len=self.max_model_len,
        )
        self.scheduler = LocalScheduler(sched_cfg, self.kv_manager)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        eos = self.model_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
    ) -> None:
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a prompt needs text or token ids")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        req = Request(
            request_id=request_id,
            prompt_token_ids=[int(t) for t in prompt_token_ids],
            sampling_params=params,
            eos_token_id=self.eos_token_id,
        )
        self.scheduler.add_request(req)
        self._tracked[request_id] = _Tracked(req, prompt)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return outputs of requests that finished in it."""
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        update = self.scheduler.update(out, result)
        now = time.perf_counter()
        finished = list(update.finished)
        for rid in update.new_tokens:
            tracked = self._tracked.get(rid)
            if tracked is None:
                continue
            if tracked.first_token is None:
                tracked.first_token = now
            params = tracked.request.sampling_params
            if params.stop and not tracked.request.is_finished and self.tokenizer is not None:
                text = self._detokenize(tracked.request.output_token_ids)
                hit = _find_stop(text, params.stop, tracked.request.num_output_tokens >= params.min_tokens)
                if hit is not None:
                    tracked.request.stop_reason = hit
                    self.scheduler.finish(rid, RequestStatus.FINISHED_STOPPED)
                    finished.append(tracked.request)
        return [self._finalize(req) for req in finished]

    def _detokenize(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _finalize(self, req: Request) -> RequestOutput:
        tracked = self._tracked.pop(req.request_id)
        text = self._detokenize(req.output_token_ids)
        if isinstance(req.stop_reason, str):
            cut = text.find(req.stop_reason)
            if cut >= 0:
                text = text[:cut]
        lps = req.output_logprobs or None
        cum = None
        if lps:
            cum = float(sum(lp[t] for lp, t in zip(lps, req.output_token_ids, strict=False)))
        now = time.perf_counter()
        metrics = {
            "ttft_s": (tracked.first_token or now) - tracked.arrival,
            "e2e_s": now - tracked.arrival,
            "num_preemptions": float(req.num_preemptions),
        }
        return RequestOutput(
            request_id=req.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=list(req.output_token_ids),
                    finish_reason=FINISH_REASON[req.status],
                    stop_reason=req.stop_reason,
                    logprobs=lps,
                    cumulative_logprob=cum,
                )
            ],
            metrics=metrics,
        )

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._tracked.pop(request_id, None)


def _find_stop(text: str, stops: tuple[str, ...], allowed: bool) -> str | None:
    if not allowed:
        return None
    for s in stops:
        if s in text:
            return s
    return None
