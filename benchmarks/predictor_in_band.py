"""In-band prediction against the feature extractor it replaces, on the default model's held-out prompts.

The sampled-serving predictor (``serve --predictor sampled``) reads layer 20's state at each prompt's last token.
Served in-band, that state comes from the serving engine's own prefill (``ModelRunner.capture``), in the serving
dtype, instead of a second fp32 model (``FeatureExtractor``). For the prompts held out from the predictor's
training (the default split), this prints, per serving dtype: the share of prompts whose predicted bucket equals
the extractor's, the largest probability difference, accuracy and Spearman (bucket midpoint) against the sampled
lengths for both, and the head's time per prediction against the extractor's time per prompt, measured in the same
run:

    python benchmarks/predictor_in_band.py --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from tetriinfer.core.sampling_params import SamplingParams
    from tetriinfer.engine.engine_config import EngineConfig
    from tetriinfer.engine.llm_engine import LLMEngine
    from tetriinfer.engine.make_model import default_model_path
    from tetriinfer.predictor.dataset import split_of
    from tetriinfer.predictor.default import (
        HELD_OUT_FRACTION,
        HELD_OUT_SEED,
        sampled_predictor_path,
        served_prompt_text,
        shipped_lengths_path,
    )
    from tetriinfer.predictor.metrics import spearman
    from tetriinfer.predictor.own import InBandHead, OwnModelPredictor, served_prompt_ids

    model = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    rows = [json.loads(x) for x in shipped_lengths_path("sampled").read_text(encoding="utf-8").splitlines() if x.strip()]
    held = [r for r in rows
            if split_of(served_prompt_text(tok, r["prompt"]), HELD_OUT_SEED, HELD_OUT_FRACTION) == "val"]
    ids = [served_prompt_ids(tok, r["prompt"]) for r in held]
    y = np.array([r["output_tokens"] for r in held], dtype=float)
    folder = sampled_predictor_path()
    own = OwnModelPredictor.load(folder, model, num_threads=a.threads)
    t0 = time.perf_counter()
    ref = np.stack([own.predict_ids_probs([p])[0] for p in tqdm(ids, desc="extractor (fp32)", unit="prompt")])
    extractor_s = (time.perf_counter() - t0) / len(ids)
    head = InBandHead.load(folder, model)
    assert head is not None, "the sampled predictor's features are not in-band"
    spec, mids = own.spec, own.spec.midpoints()
    truth = spec.buckets_of(y.astype(int))

    def score(probs: np.ndarray) -> tuple[float, float | None]:
        return float((probs.argmax(1) == truth).mean()), spearman(mids[probs.argmax(1)], y)

    acc_ref, sp_ref = score(ref)
    print(f"{len(held)} held-out prompts; extractor: accuracy {acc_ref:.3f}, Spearman {sp_ref:.3f}, "
          f"{extractor_s * 1e3:.0f} ms per prompt")
    print("| serving dtype | same bucket as extractor | max prob diff | accuracy | Spearman | head us/prediction | "
          "extractor / head time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in a.dtypes.split(","):
        engine = LLMEngine(EngineConfig(str(model), dtype=dtype, num_threads=a.threads))
        engine.runner.capture(head.layers)
        for i, p in enumerate(ids):
            engine.add_request(str(i), None, p, SamplingParams(max_tokens=1, temperature=0.0))
        engine.runner.capture_ids.update(str(i) for i in range(len(ids)))
        with tqdm(total=len(ids), desc=f"serving prefill ({dtype})", unit="prompt") as bar:
            while engine.has_unfinished():
                bar.update(len(engine.step()))
        states = [engine.runner.captured[str(i)].numpy() for i in range(len(ids))]
        t0 = time.perf_counter()
        probs = np.stack([head.head.probs(head.features(s, len(p)))[0] for s, p in zip(states, ids, strict=True)])
        head_s = (time.perf_counter() - t0) / len(ids)
        acc, sp = score(probs)
        same = float((probs.argmax(1) == ref.argmax(1)).mean())
        print(f"| {dtype} | {same:.3f} | {float(np.abs(probs - ref).max()):.4f} | {acc:.3f} | {sp:.3f} | "
              f"{head_s * 1e6:.0f} | {extractor_s / head_s:.0f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
