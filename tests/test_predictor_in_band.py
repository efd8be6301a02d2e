"""In-band length prediction: a served-model predictor's features taken from the serving prefill itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_predictor_own import _fixture
from tetriinfer.predictor.buckets import BucketSpec
from tetriinfer.predictor.own import (
    FeatureExtractor,
    InBandHead,
    OwnFeatureConfig,
    OwnModelPredictor,
    in_band_layers,
    train_own_predictor,
)

SPEC = BucketSpec.for_granularity(100, 1000)
LAST = OwnFeatureConfig(layers=(1,), pooling=("last",), prefix_steps=0)


@pytest.fixture(scope="module")
def last_token_predictor(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("inband") / "pred"
    prompts, lengths = _fixture()
    train_own_predictor(prompts, lengths, tiny_llama, out, SPEC, target="tiny", feature_config=LAST,
                        head_kind="multinomial")
    return out


def test_only_last_token_states_of_inner_layers_run_in_band() -> None:
    assert in_band_layers(LAST, 2) == (1,)
    assert in_band_layers(OwnFeatureConfig(layers=(1, 2), pooling=("last",), prefix_steps=0), 3) == (1, 2)
    assert in_band_layers(OwnFeatureConfig(layers=(2,), pooling=("last",), prefix_steps=0), 2) is None  # final, normed
    assert in_band_layers(OwnFeatureConfig(layers=(0,), pooling=("last",), prefix_steps=0), 2) is None  # embeddings
    assert in_band_layers(OwnFeatureConfig(layers=(1,), pooling=("last", "mean"), prefix_steps=0), 2) is None
    assert in_band_layers(OwnFeatureConfig(layers=(1,), pooling=("last",), prefix_steps=4), 2) is None
    assert in_band_layers(OwnFeatureConfig(prefix_steps=8), 2) is None


def test_prefill_capture_gives_the_extractor_features_and_prediction(last_token_predictor: Path,
                                                                     tiny_llama: Path) -> None:
    from tetriinfer.core.sampling_params import SamplingParams
    from tetriinfer.engine.engine_config import EngineConfig
    from tetriinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(str(tiny_llama), chunk_size=8, num_threads=1))  # prompts span several chunks
    engine.runner.capture((1,))
    engine.runner.capture((1,))  # again with the same layers: nothing to do
    with pytest.raises(RuntimeError, match="captures layers"):
        engine.runner.capture((1, 1))
    rng = np.random.default_rng(3)
    prompts = {str(i): rng.integers(5, 400, size=n).tolist() for i, n in enumerate((3, 8, 9, 21, 40))}
    for rid, ids in prompts.items():
        engine.add_request(rid, None, ids, SamplingParams(max_tokens=3, temperature=0.0))
    engine.runner.capture_ids.update(prompts)
    while engine.has_unfinished():
        engine.step()
    assert set(engine.runner.captured) == set(prompts) and not engine.runner.capture_ids  # each once, at its end
    ex = FeatureExtractor(tiny_llama, LAST, num_threads=1)
    head = InBandHead.load(last_token_predictor, tiny_llama)
    assert head is not None and head.layers == (1,)
    own = OwnModelPredictor.load(last_token_predictor, num_threads=1)
    for rid, ids in prompts.items():
        states = engine.runner.captured[rid].numpy()
        want = ex.features([ids])[0]
        assert states.shape == (want.shape[0] - 1,)
        np.testing.assert_allclose(head.features(states, len(ids)), want, rtol=1e-4, atol=1e-4)
        in_band = head.head.probs(head.features(states, len(ids)))[0]
        np.testing.assert_allclose(in_band, own.predict_ids_probs([ids])[0], atol=1e-4)
        assert head.predict(states, len(ids)).bucket == own.predict_ids([ids])[0].bucket


def test_hook_modes_choose_in_band_where_the_features_allow(last_token_predictor: Path, tiny_llama: Path,
                                                           tmp_path: Path) -> None:
    from tetriinfer.runtime.predictor_hook import InBandHook, ModelHook, make_predictor_hook

    assert isinstance(make_predictor_hook(str(last_token_predictor), None, str(tiny_llama)), InBandHook)  # auto
    assert isinstance(make_predictor_hook(str(last_token_predictor), None, str(tiny_llama), "parallel"), ModelHook)
    pooled = tmp_path / "pooled"
    prompts, lengths = _fixture()
    train_own_predictor(prompts, lengths, tiny_llama, pooled, SPEC, target="tiny", head_kind="multinomial",
                        feature_config=OwnFeatureConfig(layers=(1,), pooling=("last", "mean"), prefix_steps=0))
    assert isinstance(make_predictor_hook(str(pooled), None, str(tiny_llama)), ModelHook)  # auto: not in-band
    with pytest.raises(ValueError, match="cannot run in-band"):
        make_predictor_hook(str(pooled), None, str(tiny_llama), "in-band")
    with pytest.raises(ValueError, match="predictor mode"):
        make_predictor_hook(str(pooled), None, str(tiny_llama), "eager")
    other = tmp_path / "other-model"
    other.mkdir()
    cfg = json.loads((tiny_llama / "config.json").read_text(encoding="utf-8"))
    (other / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}), encoding="utf-8")
    from tetriinfer.predictor.own import ArtifactError

    with pytest.raises(ArtifactError, match="not the one"):
        InBandHead.load(last_token_predictor, other)


def test_server_predicts_in_band_and_every_request_completes(last_token_predictor: Path, tiny_llama: Path) -> None:
    import httpx

    from tests.serve_helpers import ServeProcess

    srv = ServeProcess(tiny_llama, "--mode", "tetriinfer", "--prefill-instances", "1", "--decode-instances", "1",
                       "--predictor", str(last_token_predictor), "--chunk-size", "16")
    try:
        for i in range(4):
            body = {"model": "llama", "prompt": f"question {i} " + "word " * (7 * i), "max_tokens": 6,
                    "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6
        assert srv.predictions(at_least=4) == 4  # one prediction per request, from its own prefill
    finally:
        assert srv.stop() == 0
    # the start-up lines say which predictor serves
    assert f"length predictor: {last_token_predictor} (--predictor-mode auto)" in srv.output()
