"""Model architecture description parsed from a Hugging Face ``config.json``, and named shape presets.

Supported families: the Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``) and OPT (``OPTForCausalLM``).

Layering: this module sits below both the engine (which builds models from a ``ModelConfig``) and the
simulator (which prices steps from one); it imports only the standard library, never torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "OPTForCausalLM": "opt",
}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one decoder-only model. Validated at construction."""

    family: str  # "llama" | "opt"
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # OPT only
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    activation: str = "silu"
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in ("llama", "opt"):
            raise ValueError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (weights the forward pass reads), for roofline arithmetic."""
        h, v = self.hidden_size, self.vocab_size
        if self.family == "llama":
            attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
            mlp = 3 * h * self.intermediate_size
            per_layer = attn + mlp + 2 * h
        else:
            attn = 4 * h * h + 4 * h
            mlp = 2 * h * self.intermediate_size + self.intermediate_size + h
            per_layer = attn + mlp + 4 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        common = dict(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=int(cfg["num_attention_heads"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            eos_token_id=eos,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            raw=cfg,
        )
        if family == "llama":
            num_heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            rope_params = cfg.get("rope_parameters")  # transformers 5.x layout
            if isinstance(rope_params, dict):
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
                "default",
                None,
            ):
                rope_scaling = None
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind not in ("linear", "llama3"):
                    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
            is_qwen2 = arch == "Qwen2ForCausalLM"
            return cls(
                **common,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim),
                intermediate_size=int(cfg["intermediate_size"]),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                attention_bias=bool(cfg.get("attention_bias", False)) or is_qwen2,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None,
                activation=str(cfg.get("hidden_act", "silu")),
            )
        num_heads = int(cfg["num_attention_heads"])
        proj = cfg.get("word_embed_proj_dim") or int(cfg["hidden_size"])
        return cls(
            **common,
            num_kv_heads=num_heads,
            head_dim=int(cfg["hidden_size"]) // num_heads,
            intermediate_size=int(cfg["ffn_dim"]),
            norm_eps=1e-5,
            attention_bias=bool(cfg.get("enable_bias", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            word_embed_proj_dim=int(proj),
            do_layer_norm_before=bool(cfg.get("do_layer_norm_before", True)),
            activation=str(cfg.get("activation_function", "relu")),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        if not path.exists():
            raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
        if not path.is_dir():
            raise FileNotFoundError(f"model path {str(path)!r} is not a folder")
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg_path}: invalid JSON ({exc})") from None
        return cls.from_dict(cfg)


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int, ctx: int,
           **extra: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": inter,
            "vocab_size": vocab, "max_position_embeddings": ctx, **extra}


# Published shapes (HF config.json fields), plus the two models the product ships or makes:
# ``tiny-llama`` is exactly what ``tetriinfer make-model --arch llama --preset tiny`` writes (a test keeps
# them equal), ``smollm2-135m`` is SmolLM2-135M-Instruct's config.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": _llama(384, 8, 6, 2, 1024, 8192, 2048, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2, tie_word_embeddings=False),
    "smollm2-135m": _llama(576, 30, 9, 3, 1536, 49152, 8192, head_dim=64, rms_norm_eps=1e-5,
                           rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                           bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True),
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama-3-8b": _llama(4096, 32, 32, 8, 14336, 128256, 8192),
    "mistral-7b": _llama(4096, 32, 32, 8, 14336, 32000, 32768),
    "opt-13b": {"architectures": ["OPTForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 40,
                "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048},
}
# The model a simulation prices when none is named: the shape of the engine's generated default model.
DEFAULT_SIM_MODEL = "tiny-llama"


def model_config(name_or_dir: str) -> ModelConfig:
    """A preset name (``MODEL_PRESETS``) or a model folder with a ``config.json``."""
    if name_or_dir in MODEL_PRESETS:
        return ModelConfig.from_dict(MODEL_PRESETS[name_or_dir])
    path = Path(name_or_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_dir!r}: not a preset ({', '.join(MODEL_PRESETS)}) "
                         f"and no {path}")
    return ModelConfig.from_dict(json.loads(path.read_text()))
