"""OPT decoder (the paper's model family): learned positions (offset 2), LayerNorm, ReLU MLP,
biases everywhere, tied embeddings. Shapes: T = tokens in the flat step batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetriinfer.engine.attention import AttentionMetadata, paged_attention
from tetriinfer.engine.model_config import ModelConfig
from tetriinfer.engine.models.layers import Linear

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}
_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.qkv_proj = Linear(h, 3 * h, bias=cfg.attention_bias)
        self.out_proj = Linear(h, h, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, kv, meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        c = self.cfg
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, c.num_heads, c.head_dim).unbind(1)  # [T, H, D] each
        o = paged_attention(q, k, v, kv[0], kv[1], meta)
        return self.out_proj(o.reshape(t, c.hidden_size))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported OPT activation {cfg.activation!r}")
        self.pre_norm = cfg.do_layer_norm_before
        self.act = _ACTIVATIONS[cfg.activation]
        h = cfg.hidden_size
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.fc1 = Linear(h, cfg.intermediate_size, bias=cfg.attention_bias)
        self.fc2 = Linear(cfg.intermediate_size, h, bias=cfg.attention_bias)
        self.final_layer_norm = nn.LayerNorm(h, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, kv, meta: AttentionMetadata) -> torch.Tensor:
        residual = x
        if self.pre_norm:
            x = self.self_attn_layer_norm(x)
        x = residual + self.self_attn(x, kv, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        residual = x
        if self.pre_norm:
            x = self.final_layer_norm(x)
        x = residual + self.fc2(self.act(self.fc1(x)))
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        proj = cfg.word_embed_proj_dim or h
        self.embed_tokens = nn.Embedding(cfg.vocab_size, proj)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + _POSITION_OFFSET, h)
        self.project_in = Linear(proj, h, bias=False) if proj != h else None
        self.project_out = Linear(h, proj, bias=False) if proj != h else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_layer_norm = nn.LayerNorm(h, eps=cfg.norm_eps) if cfg.do_layer_norm_before else None
        self.lm_head = Linear(proj, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, proj]
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + _POSITION_OFFSET)  # [T, hidden]
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, proj] -> [N, vocab] fp32
        return self.lm_logits(hidden).float()

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, proj] -> [N, vocab] in the model dtype
        return self.lm_head(hidden)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, int | None, int]:
        for prefix in ("model.decoder.", "decoder."):
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            if f"self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), i, 3
        return name, None, 1

    def shard_sizes(self, our_name: str) -> list[int]:
        h = self.cfg.hidden_size
        if "qkv_proj" in our_name:
            return [h, h, h]
        raise KeyError(our_name)
