"""make-model: HF-loadable, deterministic random checkpoints with the shipped tokenizer."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tetriinfer.engine import cli as engine_cli
from tetriinfer.engine import make_model as mm

ARCHS = ("llama", "opt", "qwen2")
HF_CLASS = {"llama": "LlamaForCausalLM", "opt": "OPTForCausalLM", "qwen2": "Qwen2ForCausalLM"}

ROUND_TRIP_TEXTS = (
    "Hello, world!",
    "  leading and  double spaces, trailing space ",
    "tabs\tand\nnew\r\nlines\n\n",
    "naïve café, Zürich, Ærøskøbing, façade",
    "東京は日本の首都です。",
    "emoji 🚀🔥👩‍👩‍👧 and math ∑ x² ≤ ∞",
    "مرحبا بالعالم",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """On a shared 2-core machine, two spinning intra-op threads make tiny forwards ~40x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny float32 model per arch, seed 0."""
    root = tmp_path_factory.mktemp("models")
    return {arch: mm.make_model(arch, "tiny", root / arch, seed=0) for arch in ARCHS}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_hf(path: Path) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_with_exact_keys_and_our_values(made: dict[str, Path], arch: str) -> None:
    path = made[arch]
    model, info = _load_hf(path)
    assert type(model).__name__ == HF_CLASS[arch]
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert not info["error_msgs"]
    # HF must use the stored tensors, not re-initialise any of them (e.g. a tied lm_head).
    stored = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(stored) == set(params)
    for name, tensor in stored.items():
        assert torch.equal(params[name].detach(), tensor), name
    shape = mm.PRESET_SHAPES[(arch, "tiny")]
    assert model.config.hidden_size == shape.hidden
    assert model.config.num_hidden_layers == shape.layers
    assert model.config.vocab_size == 8192
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [HF_CLASS[arch]]
    assert config["model_type"] == arch
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    if arch == "llama":
        assert config["num_key_value_heads"] == 2 and not config["tie_word_embeddings"]
    if arch == "qwen2":
        assert config["tie_word_embeddings"] and "model.layers.0.self_attn.q_proj.bias" in stored
        assert "lm_head.weight" not in stored  # tied weights stored once
    if arch == "opt":
        assert config["do_layer_norm_before"] and config["word_embed_proj_dim"] == shape.hidden
    assert sorted(p.name for p in path.iterdir()) == sorted(mm.MODEL_FILES)


@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_in_expected_range(made: dict[str, Path], arch: str) -> None:
    count = mm.count_parameters(made[arch])
    model, _ = _load_hf(made[arch])
    assert count == model.num_parameters()
    assert 12_000_000 <= count <= 25_000_000, count
    assert json.loads((made[arch] / mm.PROVENANCE_FILE).read_text())["num_parameters"] == count


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_identical_bytes_different_seed_different_weights(
    made: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    again = mm.make_model(arch, "tiny", tmp_path / "again", seed=0)
    for name in mm.MODEL_FILES:
        assert _sha256(again / name) == _sha256(made[arch] / name), name
    other = mm.make_model(arch, "tiny", tmp_path / "other", seed=1)
    base = load_file(str(made[arch] / "model.safetensors"))
    changed = load_file(str(other / "model.safetensors"))
    assert set(base) == set(changed)
    for name in base:  # every tensor is re-drawn, not just some
        assert not torch.equal(base[name], changed[name]), name


def test_bfloat16_is_the_float32_draw_rounded(made: dict[str, Path], tmp_path: Path) -> None:
    path = mm.make_model("qwen2", "tiny", tmp_path / "bf16", seed=0, dtype="bfloat16")
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    bf16 = load_file(str(path / "model.safetensors"))
    fp32 = load_file(str(made["qwen2"] / "model.safetensors"))
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name
    model, info = _load_hf(path)
    assert info["missing_keys"] == set() and model.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ARCHS)
def test_random_model_is_not_degenerate(made: dict[str, Path], arch: str) -> None:
    """Logits spread over a few nats, and the next token depends on the prompt."""
    from transformers import AutoTokenizer

    model, _ = _load_hf(made[arch])
    tokenizer = AutoTokenizer.from_pretrained(made[arch])
    prompts = ["The capital of France is", "Write a poem about the sea.", "def fib(n):", "Explain gravity"]
    argmaxes = set()
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            logits = model(ids).logits[0, -1]  # [vocab]
            assert 2.0 < logits.std().item() < 8.0
            argmaxes.add(int(logits.argmax()))
        generated = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)[
            0, ids.shape[1] :
        ]
    assert len(argmaxes) >= 3
    assert len(set(generated.tolist())) >= 8  # greedy decoding does not collapse onto one token


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_and_has_fixed_specials(made: dict[str, Path], arch: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(made[arch])
    assert len(tokenizer) == 8192
    assert [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id] == [0, 1, 2]
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [3, 4]
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert all(0 <= i < 8192 for i in ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.decode(ids[1:]) == text
    # English compresses: the BPE merges were learned, not just bytes.
    english = "The quick brown fox jumps over the lazy dog because it wanted to explain something."
    assert len(tokenizer(english, add_special_tokens=False)["input_ids"]) < len(english) / 3


def test_all_archs_tokenize_alike(made: dict[str, Path]) -> None:
    """transformers 5 rebuilds qwen2 tokenizers (NFC + Qwen's split); ours is built to match that."""
    from transformers import AutoTokenizer

    tokenizers = {arch: AutoTokenizer.from_pretrained(made[arch]) for arch in ARCHS}
    for text in ROUND_TRIP_TEXTS:
        ids = {arch: tok(text)["input_ids"] for arch, tok in tokenizers.items()}
        assert ids["llama"] == ids["opt"] == ids["qwen2"], text
    decomposed = "cafe\u0301"  # not NFC: exact for llama/opt, NFC-normalised by transformers for qwen2
    for arch, tok in tokenizers.items():
        decoded = tok.decode(tok(decomposed)["input_ids"], skip_special_tokens=True)
        assert decoded == ("caf\u00e9" if arch == "qwen2" else decomposed)


def test_chat_template_renders_chatml(made: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(made["llama"])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there 👋"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there 👋<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 0 and ids.count(0) == 1  # exactly one <|bos|>
    assert ids.count(3) == 3 and ids.count(4) == 2  # specials are single tokens
    generation = json.loads((made["llama"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 4]  # a chat turn ends at <|im_end|>


def test_shipped_tokenizer_is_small_and_exact() -> None:
    path = mm.shipped_tokenizer_path()
    assert path.stat().st_size < 1_000_000
    info = mm.tokenizer_info(path)
    assert info.vocab_size == 8192
    assert [info.special_ids[t] for t in mm.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]


def test_tiny_model_path_races_creates_once_and_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TETRIINFER_CACHE", str(cache))
    # Force a real race: both threads finish building before either publishes.
    barrier = threading.Barrier(2, timeout=120)
    real_publish: Callable[[Path, Path, bool], None] = mm._publish

    def racing_publish(staging: Path, out: Path, force: bool) -> None:
        barrier.wait()
        real_publish(staging, out, force)

    monkeypatch.setattr(mm, "_publish", racing_publish)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(mm.tiny_model_path())
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    expected = (cache / "models" / "tiny-llama").absolute()
    assert results == [expected, expected]
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-llama"]  # no temp leftovers
    provenance = mm.read_provenance(expected)
    assert provenance is not None and (provenance["arch"], provenance["preset"]) == ("llama", "tiny")
    inode = (expected / "model.safetensors").stat().st_ino

    def must_not_build(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("tiny_model_path rebuilt an existing model")

    monkeypatch.setattr(mm, "make_model", must_not_build)
    assert mm.tiny_model_path() == expected
    assert (expected / "model.safetensors").stat().st_ino == inode


def test_tiny_model_path_refuses_foreign_folder(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny-llama"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a complete model"):
        mm.tiny_model_path(tmp_path)


def test_cli_refuses_non_empty_folder_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tetriinfer.cli import main

    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    (out / "pytorch_model.bin").write_bytes(b"stale weights a loader could prefer")
    assert main(["make-model", "--arch", "opt", "--preset", "tiny", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "pytorch_model.bin"]  # untouched

    assert main(["make-model", "--arch", "opt", "--out", str(out), "--seed", "3", "--force"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == str(out.absolute())
    count = mm.count_parameters(out)
    assert f"{count:,} parameters" in printed[1]
    assert (out / "keep.txt").read_text() == "user file"
    assert not (out / "pytorch_model.bin").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted((*mm.MODEL_FILES, "keep.txt"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.tmp-")]
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        assert "model.decoder.embed_positions.weight" in handle.keys()  # noqa: SIM118


def test_bad_spec_leaves_destination_alone_and_empty_folder_is_filled(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    with pytest.raises(ValueError, match="unknown preset"):
        mm.make_model("llama", "huge", out)
    assert list(out.iterdir()) == []
    assert mm.make_model("opt", "tiny", out) == out.absolute()  # an empty folder needs no --force
    assert sorted(p.name for p in out.iterdir()) == sorted(mm.MODEL_FILES)
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]  # staging folder renamed away


def test_spec_validation_and_cli_choices_agree() -> None:
    assert engine_cli.ARCH_CHOICES == mm.ARCHS
    assert engine_cli.PRESET_CHOICES == mm.PRESETS
    assert engine_cli.DTYPE_CHOICES == mm.DTYPES
    for bad in (
        {"arch": "gpt2", "preset": "tiny"},
        {"arch": "llama", "preset": "huge"},
        {"arch": "llama", "preset": "tiny", "dtype": "float16"},
        {"arch": "llama", "preset": "tiny", "seed": -1},
        {"arch": "llama", "preset": "tiny", "seed": True},
    ):
        with pytest.raises(ValueError):
            mm.ModelSpec(**bad)
    with pytest.raises(ValueError, match="divisible"):
        mm.ModelShape(hidden=384, layers=2, heads=5, kv_heads=1, intermediate=8, max_position_embeddings=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_small_preset_shape_is_benchmark_sized(arch: str) -> None:
    """Counted on the meta device (no weights are drawn): ~100M parameters."""
    spec = mm.ModelSpec(arch=arch, preset="small")
    shapes = mm.parameter_shapes(mm.build_config(spec, mm.tokenizer_info()))
    count = sum(torch.Size(s).numel() for s in shapes.values())
    assert 90_000_000 <= count <= 150_000_000, count
