"""The offline API, shaped like vLLM's so users switch with one import.

Example (``from tetriinfer import LLM, SamplingParams``)::

    llm = LLM(model="path/to/hf-folder", dtype="bfloat16")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.llm_engine import LLMEngine
from tetriinfer.engine.outputs import RequestOutput
from tetriinfer.engine.tokenizer_loader import load_eos_token_ids

PromptType = str | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        chunk_size: int = 512,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        kv_cache_memory_gb: float | None = None,
        load_format: str = "auto",
        seed: int = 0,
        num_threads: int | None = None,
        cpu_cores: Sequence[int] | None = None,
        pad_last_chunk: bool = True,
        enable_prefix_caching: bool = False,
    ) -> None:
        from tetriinfer.engine.make_model import resolve_model

        model = resolve_model(None if model is None else str(model))  # None: the real default model
        self.config = EngineConfig(
            model=str(model),
            dtype=dtype,
            device=device,
            chunk_size=chunk_size,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            pad_last_chunk=pad_last_chunk,
            load_format=load_format,
            seed=seed,
            num_threads=num_threads,
            cpu_cores=tuple(cpu_cores) if cpu_cores is not None else None,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.engine = LLMEngine(self.config)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        Prompts are strings or ``{"prompt_token_ids": [...]}`` dicts. All inputs are validated before any
        work starts, so a bad prompt never leaves half a batch queued.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        parsed: list[tuple[str | None, list[int]]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if engine.tokenizer is None:
                    raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
                ids = engine.tokenizer.encode(p)
                parsed.append((p, ids))
            elif isinstance(p, dict) and "prompt_token_ids" in p:
                parsed.append((p.get("prompt"), list(p["prompt_token_ids"])))
            else:
                raise ValueError(f"prompt {i} must be a string or a dict with 'prompt_token_ids'")
            ids = parsed[-1][1]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= engine.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens but the model's context is {engine.max_model_len} "
                    "tokens (prompt + at least one output token)"
                )
        # generation_config's other EOS ids (e.g. ChatML's <|im_end|>) end an answer too, as in transformers
        extra_eos = tuple(t for t in load_eos_token_ids(self.config.model) if t != engine.eos_token_id)
        if extra_eos:
            params_list = [p if p.ignore_eos else dataclasses.replace(
                p, stop_token_ids=tuple(dict.fromkeys((*p.stop_token_ids, *extra_eos)))) for p in params_list]
        ids_in_order = []
        for (text, ids), params in zip(parsed, params_list, strict=True):
            rid = engine.new_request_id()
            engine.add_request(rid, text, ids, params)
            ids_in_order.append(rid)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm)
        while engine.has_unfinished():
            for out in engine.step():
                done[out.request_id] = out
                bar.update(1)
        bar.close()
        return [done[rid] for rid in ids_in_order]
