"""Named model shapes (``tetriinfer.model_config``): presets parse, and the default one matches the model made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tetriinfer.model_config import DEFAULT_SIM_MODEL, MODEL_PRESETS, ModelConfig, model_config


def test_every_preset_parses_and_the_sim_default_is_one() -> None:
    assert DEFAULT_SIM_MODEL in MODEL_PRESETS
    for name in MODEL_PRESETS:
        cfg = model_config(name)
        assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.num_params() > 0
    assert 120e6 < model_config("smollm2-135m").num_params() < 150e6  # SmolLM2-135M
    assert 6.5e9 < model_config("llama-2-7b").num_params() < 7e9


def test_tiny_llama_preset_is_exactly_what_make_model_writes() -> None:
    from tetriinfer.engine import make_model as mm

    written = mm.build_config(mm.ModelSpec("llama", "tiny"), mm.tokenizer_info()).to_dict()
    made = ModelConfig.from_dict({**written, "architectures": ["LlamaForCausalLM"]})
    assert made == model_config("tiny-llama")


def test_unknown_model_and_folder_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a preset"):
        model_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS["mistral-7b"]))
    assert model_config(str(tmp_path)) == model_config("mistral-7b")
