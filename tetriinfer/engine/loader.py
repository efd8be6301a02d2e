"""Build a model from a local Hugging Face folder (or with dummy weights) on a device and dtype."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tetriinfer.engine.model_config import ModelConfig
from tetriinfer.engine.models.llama import LlamaForCausalLM
from tetriinfer.engine.models.opt import OPTForCausalLM

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def build_model(cfg: ModelConfig) -> nn.Module:
    if cfg.family == "llama":
        return LlamaForCausalLM(cfg)
    return OPTForCausalLM(cfg)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"model folder {str(model_dir)!r} is missing weight files: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    files = sorted(model_dir.glob("pytorch_model*.bin"))
    if files:
        return files
    raise FileNotFoundError(
        f"model folder {str(model_dir)!r} has no weights (*.safetensors or pytorch_model*.bin); "
        "use load_format='dummy' for random weights"
    )


def _iter_tensors(files: list[Path]):
    from safetensors import safe_open

    for f in files:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    yield name, sf.get_tensor(name)
        else:  # local file from the user's own folder; weights_only refuses arbitrary objects
            state = torch.load(str(f), map_location="cpu", weights_only=True)
            yield from state.items()


def load_weights(model: nn.Module, model_dir: Path) -> None:
    """Copy checkpoint tensors into ``model``; every parameter must be covered exactly."""
    params = dict(model.named_parameters())
    tied = getattr(model.cfg, "tie_word_embeddings", False)
    loaded: dict[str, set[int | None]] = {}
    for hf_name, tensor in _iter_tensors(_weight_files(model_dir)):
        if "rotary_emb.inv_freq" in hf_name:
            continue
        name, shard, num_shards = model.map_weight_name(hf_name)
        if name == "lm_head.weight" and tied:
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} does not belong to a {model.cfg.architecture}")
        param = params[name]
        with torch.no_grad():
            if shard is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}"
                    )
                param.copy_(tensor)
            else:
                sizes = model.shard_sizes(name)
                offset = sum(sizes[:shard])
                dst = param.narrow(0, offset, sizes[shard])
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
                dst.copy_(tensor)
        loaded.setdefault(name, set()).add(shard)
    missing = []
    for name in params:
        if name == "lm_head.weight" and tied:
            continue
        got = loaded.get(name)
        if got is None:
            missing.append(name)
        elif None not in got and len(got) != len(model.shard_sizes(name)):
            missing.append(f"{name} (some shards)")
    if missing:
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing weights: {missing[:8]}")


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
) -> tuple[nn.Module, ModelConfig]:
    """Load a model. ``load_format='dummy'`` gives seeded random weights and needs only config.json
    (or a ``ModelConfig``-compatible dict folder), as vLLM's dummy format does."""
    torch_dtype = parse_dtype(dtype)
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r} (auto, safetensors, dummy)")
    cfg = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to_empty(device="cpu")
    # Buffers computed at construction (rotary inv_freq) were lost on the meta device: rebuild them.
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            from tetriinfer.engine.models.layers import rope_inv_freq

            module.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if load_format == "dummy":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or "layer_norm.weight" in name:
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    else:
        load_weights(model, Path(model_dir))
    model = model.to(device=device, dtype=torch_dtype)
    if hasattr(model, "rotary"):
        model.rotary.inv_freq = model.rotary.inv_freq.float()  # keep RoPE frequencies in fp32
    model.eval()
    return model, cfg
