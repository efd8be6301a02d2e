"""Llama-family decoder (Llama, Mistral, Qwen2): RoPE, RMSNorm, SwiGLU, grouped-query attention,
optional qkv bias, tied or untied embeddings. Shapes: T = tokens in the flat step batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tetriinfer.engine import cpu_kernels
from tetriinfer.engine.attention import AttentionMetadata, paged_attention
from tetriinfer.engine.fused_decode import FusedDecode
from tetriinfer.engine.model_config import ModelConfig
from tetriinfer.engine.models.layers import Linear, RMSNorm, RotaryEmbedding, apply_rope, use_fused


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"  # Qwen2: bias on q/k/v only
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        c = self.cfg
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(q.view(t, c.num_heads, c.head_dim), cos, sin)  # [T, H, D]
        k = apply_rope(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)  # [T, Hkv, D]
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        o = paged_attention(q, k, v, kv[0], kv[1], meta)  # [T, H, D]
        return self.o_proj(o.reshape(t, c.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gu = self.gate_up_proj(x)  # [T, 2 * inter]
        if gu.dim() == 2 and gu.is_contiguous() and use_fused(gu):  # decode: one native call, torch's rounding
            return self.down_proj(cpu_kernels.silu_mul(gu))
        gate, up = gu.split(self.inter, dim=-1)  # [T, inter] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin, kv, meta):  # x [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fused_decode = FusedDecode(self)  # the layer stack of small-batch decode steps as one native call
        self.fused_decode_off = False  # set for a step that must run the layer modules (ModelRunner.capture)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if x.device.type == "cpu" and not self.fused_decode_off and self.fused_decode.applies(x, kv_caches, meta):
            return self.norm(self.fused_decode.run(x, cos, sin, kv_caches, meta))
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        return self.lm_logits(hidden).float()

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] in the model dtype
        return self.lm_head(hidden)

    @staticmethod
    def map_weight_name(name: str) -> tuple[str, int | None, int]:
        """HF parameter name -> (our name, shard index or None, number of shards)."""
        name = name.removeprefix("model.")
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            if f"self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), i, 3
        for i, proj in enumerate(("gate_proj", "up_proj")):
            if f"mlp.{proj}." in name:
                return name.replace(proj, "gate_up_proj"), i, 2
        return name, None, 1

    def shard_sizes(self, our_name: str) -> list[int]:
        c = self.cfg
        if "qkv_proj" in our_name:
            return [c.q_size, c.kv_size, c.kv_size]
        if "gate_up_proj" in our_name:
            return [c.intermediate_size, c.intermediate_size]
        raise KeyError(our_name)
