"""Length prediction at a prefill instance: ``none``, ``oracle`` (true lengths, for ablations) or a
trained predictor folder: a fine-tuned classifier (``tetriinfer predictor train``) or a served-model
predictor (``tetriinfer predictor train-own``), which reads the prompt's token ids as served.

``predict_one(prompt_token_ids, oracle_output_tokens) -> (bucket, lower, upper) | None``.

Modes (``PREDICTOR_MODES``): ``parallel`` runs the hook on a background thread beside the prefill (the paper's
parallel mode), ``sequential`` before it; ``in-band`` takes a served-model predictor's features from the serving
prefill itself (``InBandHook``: the prefill keeps the hidden states the head reads, so no second model runs);
``auto`` is ``in-band`` where the predictor's features allow it (``predictor.own.in_band_layers``), else
``parallel``.
"""

from __future__ import annotations

import time
from typing import Any

DEFAULT_GRANULARITY = 200
PREDICTOR_MODES = ("auto", "in-band", "parallel", "sequential")


class OracleHook:
    def __init__(self, granularity: int = DEFAULT_GRANULARITY) -> None:
        self.granularity = granularity
        self.latencies: list[float] = []

    def predict_one(self, prompt_token_ids: list[int], oracle_output_tokens: int | None) -> tuple[int, int, int] | None:
        if oracle_output_tokens is None:
            return None
        b = oracle_output_tokens // self.granularity
        return b, b * self.granularity, (b + 1) * self.granularity

    def predict_many(
        self, prompts: list[list[int]], oracles: list[int | None]
    ) -> list[tuple[int, int, int] | None]:
        return [self.predict_one(p, o) for p, o in zip(prompts, oracles, strict=True)]


class ModelHook:
    """A trained predictor folder. A fine-tuned classifier sees the prompt detokenized with the served
    model's tokenizer; a served-model predictor sees the prompt's token ids themselves."""

    def __init__(self, predictor_dir: str, tokenizer: Any, model_dir: str | None = None) -> None:
        from tetriinfer.predictor.own import OwnModelPredictor, is_own_predictor

        self.predictor: Any
        self.takes_ids = is_own_predictor(predictor_dir)
        if self.takes_ids:  # the served model's own features: must be the model being served
            self.predictor = OwnModelPredictor.load(predictor_dir, model_dir=model_dir, num_threads=1)
        else:
            from tetriinfer.predictor.inference import LengthPredictor

            self.predictor = LengthPredictor.load(predictor_dir, device="cpu", num_threads=1)
        self.tokenizer = tokenizer
        self.latencies: list[float] = []

    def _predict(self, prompts: list[list[int]]) -> list[Any]:
        if self.takes_ids:
            return list(self.predictor.predict_ids(prompts))
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else "" for ids in prompts]
        return list(self.predictor.predict(texts))

    def predict_one(self, prompt_token_ids: list[int], oracle_output_tokens: int | None) -> tuple[int, int, int] | None:
        t0 = time.perf_counter()
        p = self._predict([prompt_token_ids])[0]
        self.latencies.append(time.perf_counter() - t0)
        return self._bounds(p)

    def predict_many(
        self, prompts: list[list[int]], oracles: list[int | None]
    ) -> list[tuple[int, int, int] | None]:
        """One fixed batch through the predictor (cheaper per prompt than one at a time for a classifier)."""
        return [self._bounds(p) for p in self._predict(prompts)]

    @staticmethod
    def _bounds(p: Any) -> tuple[int, int, int]:
        upper = p.upper if p.upper is not None else p.lower + 10 * max(1, p.lower)
        return p.bucket, p.lower, upper


class InBandHook:
    """A served-model predictor read from the serving prefill's own hidden states (``predictor.own.InBandHead``):
    the prefill worker asks its runner to keep ``layers`` at each prompt's last token and calls ``predict`` with
    them once the prompt is prefilled."""

    def __init__(self, head: Any) -> None:
        self.head = head
        self.layers: tuple[int, ...] = head.layers

    def predict(self, states: Any, prompt_tokens: int) -> tuple[int, int, int]:
        return ModelHook._bounds(self.head.predict(states, prompt_tokens))


def make_predictor_hook(spec: str, tokenizer: Any = None, model_dir: str | None = None,
                        mode: str = "auto") -> OracleHook | ModelHook | InBandHook | None:
    """``model_dir`` is the served model's folder (a served-model predictor runs it for its features, or reads
    them from its prefill in-band). ``mode``: see the module docstring; ``in-band`` for a predictor that cannot
    run so is a ValueError."""
    if mode not in PREDICTOR_MODES:
        raise ValueError(f"predictor mode must be one of {', '.join(PREDICTOR_MODES)}, got {mode!r}")
    if spec in ("", "none"):
        return None
    if spec == "oracle":
        return OracleHook()
    if mode in ("auto", "in-band") and model_dir is not None:
        from tetriinfer.predictor.own import InBandHead, is_own_predictor

        head = InBandHead.load(spec, model_dir) if is_own_predictor(spec) else None
        if head is not None:
            return InBandHook(head)
    if mode == "in-band":
        raise ValueError(f"predictor {spec} cannot run in-band: only a served-model predictor whose features are "
                         "last-token hidden states of inner layers (no mean pooling, no greedy steps) can")
    return ModelHook(spec, tokenizer, model_dir)


class PredictionService:
    """Runs a hook on a background thread so prediction overlaps the main model's prefill (the
    paper's *parallel* mode). ``submit`` never blocks; ``drain`` returns finished predictions.

    Invariant: every submitted request id comes back from ``drain`` exactly once (with ``None`` when
    the hook fails or has no answer), unless cancelled first.
    """

    def __init__(self, hook: OracleHook | ModelHook, max_batch: int = 16) -> None:
        import queue
        import threading

        self.hook = hook
        self.max_batch = max_batch
        self._in: queue.Queue = queue.Queue()
        self._out: list[tuple[str, tuple[int, int, int] | None, float]] = []
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="length-predictor", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_token_ids: list[int], oracle: int | None) -> None:
        self._in.put((request_id, prompt_token_ids, oracle))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def drain(self) -> list[tuple[str, tuple[int, int, int] | None, float]]:
        with self._lock:
            out, self._out = self._out, []
            keep = [o for o in out if o[0] not in self._cancelled]
            self._cancelled.difference_update(o[0] for o in out)
        return keep

    def _run(self) -> None:
        import queue

        while True:
            item = self._in.get()
            if item is None:
                return
            batch = [item]  # everything queued meanwhile joins one fixed batch (up to max_batch)
            while len(batch) < self.max_batch:
                try:
                    nxt = self._in.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._in.put(None)
                    break
                batch.append(nxt)
            t0 = time.perf_counter()
            try:
                preds = self.hook.predict_many([b[1] for b in batch], [b[2] for b in batch])
            except Exception:  # noqa: BLE001 - a failed prediction degrades to "unknown", never a crash
                preds = [None] * len(batch)
            per_request = (time.perf_counter() - t0) / len(batch)
            with self._lock:
                self._out.extend((b[0], p, per_request) for b, p in zip(batch, preds, strict=True))

    def close(self) -> None:
        self._in.put(None)
