"""Length prediction at a prefill instance: ``none``, ``oracle`` (true lengths, for ablations) or a
trained predictor folder (``tetriinfer predictor train``).

``predict_one(prompt_token_ids, oracle_output_tokens) -> (bucket, lower, upper) | None``.
"""

from __future__ import annotations

import time
from typing import Any

DEFAULT_GRANULARITY = 200


class OracleHook:
    def __init__(self, granularity: int = DEFAULT_GRANULARITY) -> None:
        self.granularity = granularity
        self.latencies: list[float] = []

    def predict_one(self, prompt_token_ids: list[int], oracle_output_tokens: int | None) -> tuple[int, int, int] | None:
        if oracle_output_tokens is None:
            return None
        b = oracle_output_tokens // self.granularity
        return b, b * self.granularity, (b + 1) * self.granularity


class ModelHook:
    """A trained classifier; prompts are detokenized with the served model's tokenizer first."""

    def __init__(self, predictor_dir: str, tokenizer: Any) -> None:
        from tetriinfer.predictor.inference import LengthPredictor

        self.predictor = LengthPredictor.load(predictor_dir, device="cpu", num_threads=1)
        self.tokenizer = tokenizer
        self.latencies: list[float] = []

    def predict_one(self, prompt_token_ids: list[int], oracle_output_tokens: int | None) -> tuple[int, int, int] | None:
        t0 = time.perf_counter()
        text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=True) if self.tokenizer else ""
        p = self.predictor.predict([text])[0]
        self.latencies.append(time.perf_counter() - t0)
        upper = p.upper if p.upper is not None else p.lower + 10 * max(1, p.lower)
        return p.bucket, p.lower, upper


def make_predictor_hook(spec: str, tokenizer: Any = None) -> OracleHook | ModelHook | None:
    if spec in ("", "none"):
        return None
    if spec == "oracle":
        return OracleHook()
    return ModelHook(spec, tokenizer)
