"""Build a model from a local Hugging Face folder (or with dummy weights) on a device and dtype."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from tetriinfer.engine import fast_checkpoint as fc
from tetriinfer.engine.model_config import ModelConfig
from tetriinfer.engine.models.llama import LlamaForCausalLM
from tetriinfer.engine.models.opt import OPTForCausalLM
from tetriinfer.engine.weight_files import weight_files

log = logging.getLogger(__name__)

# auto/safetensors: the HF folder; dummy: seeded random weights; fast / fast-shm: the loading-optimized
# checkpoint cache (fast_checkpoint.py), fast-shm also sharing one host-memory copy among this host's instances.
LOAD_FORMATS = ("auto", "safetensors", "dummy", "fast", "fast-shm")

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


_INIT_SKIPPED = (nn.Linear, nn.Embedding, nn.LayerNorm)


@contextlib.contextmanager
def _no_parameter_init() -> Iterator[None]:
    """Modules built inside skip ``reset_parameters``: every parameter is then loaded or filled explicitly,
    and torch's initializers on the meta device import ``torch._dynamo`` (~2 s of every instance start)."""
    saved = {cls: cls.__dict__["reset_parameters"] for cls in _INIT_SKIPPED}
    try:
        for cls in _INIT_SKIPPED:
            cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn  # type: ignore[method-assign]


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model's modules with parameters left as allocated (callers load or fill every one)."""
    with _no_parameter_init():
        if cfg.family == "llama":
            return LlamaForCausalLM(cfg)
        return OPTForCausalLM(cfg)


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
    for hf_name, tensor in _iter_tensors(weight_files(model_dir)):
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
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r} ({', '.join(LOAD_FORMATS)})")
    if load_format in ("fast", "fast-shm"):
        return _load_fast(Path(model_dir), torch_dtype, device, shm=load_format == "fast-shm")
    cfg = ModelConfig.from_pretrained(model_dir)
    model = _empty_model(cfg, torch_dtype)
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
    return _finish(model), cfg


def _finish(model: nn.Module) -> nn.Module:
    if hasattr(model, "rotary"):
        model.rotary.inv_freq = model.rotary.inv_freq.float()  # keep RoPE frequencies in fp32
    model.eval()
    return model


def _empty_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model with uninitialized CPU parameters of ``dtype`` (``torch.empty``: allocated lazily, never touched
    here) and computed buffers (left in fp32; ``load_model`` casts them as before). Built on CPU, not the meta
    device: meta tensor ops import ``torch._dynamo`` (~2 s). Parameters get ``dtype`` before any weight is
    copied in, so a bf16 checkpoint is copied once, not upcast into fp32 and cast back (3x slower for 1B)."""
    model = build_model(cfg)
    if dtype != torch.float32:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.dtype != dtype:
                    module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def _load_fast(model_dir: Path, dtype: torch.dtype, device: str, shm: bool) -> tuple[nn.Module, ModelConfig]:
    """``fast`` / ``fast-shm``: the cached loading-optimized checkpoint (made on first use), see
    ``engine/fast_checkpoint.py``. The loaded model carries ``load_stats`` (a ``LoadStats``)."""
    ckpt, converted_s = ensure_checkpoint(model_dir, dtype)
    cfg = ModelConfig.from_pretrained(model_dir)
    model = _empty_model(cfg)
    stats = fc.load_fast(model, ckpt, device=device, shm=shm)
    if converted_s:
        stats = replace(stats, converted_s=converted_s)
    model = model.to(device=device)  # buffers (RoPE frequencies); parameters are already there
    model.load_stats = stats
    log.info("loaded %s from fast checkpoint %s (%s tier): %.2f GiB in %.3f s (%.2f GiB/s, %d readers)",
             model_dir, ckpt, stats.tier, stats.bytes / 2**30, stats.seconds, stats.gib_per_s, stats.num_readers)
    return _finish(model), cfg


def ensure_checkpoint(model_dir: str | Path, dtype: torch.dtype) -> tuple[Path, float]:
    """The cached fast checkpoint of ``model_dir`` at ``dtype``, made now (one normal load, then a write) if
    missing. Returns (path, seconds spent converting; 0 when it was cached)."""
    fingerprint = fc.source_fingerprint(model_dir, dtype)
    path = fc.checkpoint_cache_dir() / fc.fingerprint_digest(fingerprint)
    if (path / "index.json").is_file():
        return path, 0.0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:  # instances starting together convert once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "index.json").is_file():
            return path, 0.0
        t0 = time.perf_counter()
        model, _ = load_model(model_dir, dtype=dtype, device="cpu", load_format="auto")
        fc.write_checkpoint(model, path, fingerprint)
        elapsed = time.perf_counter() - t0
    log.info("made fast checkpoint %s from %s in %.1f s", path, model_dir, elapsed)
    return path, elapsed
