"""A Llama-family model's decode step as one native call (`csrc/decode_kernels.c`, ``tetri_llama_decode_layers``).

A decode step at small batch does little arithmetic per layer and many small operations: RMSNorm, four matmuls,
two RoPEs, two KV writes, attention, two residual adds, SiLU and a product; issued one by one from Python each costs
a few microseconds of dispatch (module calls, routing checks, output allocation, ctypes argument conversion), about
4 ms of a 19 ms batch-1 step of SmolLM2-135M (30 layers) on one Zen 4 core. Here the whole layer stack runs in C, on
the same kernels the per-op path picks for this step (`Linear.native_kernel`, the decode attention of
`attention._use_decode_kernel`), with torch's per-op rounding: the matmul and attention outputs are bit-identical
to the per-op path, RMSNorm and RoPE are its fused kernels, and the residual adds and SiLU-times-up are computed as
torch computes them (SiLU's exp may differ from torch's by about one fp32 ulp).

When it applies (`FusedDecode.applies`): a Llama-family model on the CPU in fp32 or bf16, native kernels available
and usable at this thread count, every step row a decode (one new token after a cached prefix, one decode group
in batch order, no padding), every matmul of the layer stack routed to a native kernel at this row count, and
``TETRIINFER_FUSED_DECODE`` not set to 0. Otherwise the model runs its per-op path.

Invariants: reads the weights and caches in place; keeps only the layer pointer table (their addresses, rebuilt when
the caches list or a layer's weights are replaced) and one scratch buffer per dtype (sized for the most rows
seen), owned here.
"""

from __future__ import annotations

import os

import torch

from tetriinfer.engine import cpu_kernels
from tetriinfer.engine.attention import AttentionMetadata, native_decode_attention
from tetriinfer.engine.models.layers import use_fused


def fused_decode_enabled() -> bool:
    return os.environ.get("TETRIINFER_FUSED_DECODE", "1") != "0"


class FusedDecode:
    """The fused decode step of one `LlamaForCausalLM` (owned by it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._table: torch.Tensor | None = None  # [num_layers * cpu_kernels.LLAMA_LAYER_WORDS] int64 addresses
        self._table_key: tuple[int, int, int, int] | None = None
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._fns: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def applies(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> bool:
        """Whether this step (``x`` [T, hidden] embeddings) can run fused; see the module docstring."""
        t = x.shape[0]
        if (not fused_decode_enabled() or meta.prefill_segments or len(meta.decode_groups) != 1
                or meta.num_real_tokens != t or x.dtype not in (torch.float32, torch.bfloat16) or not use_fused(x)):
            return False
        g = meta.decode_groups[0]
        if g.lengths is None or g.row_start != 0 or g.slots.shape[0] != t:
            return False
        if not native_decode_attention(x.dtype, x.device) or not all(  # `attention._use_decode_kernel`, per cache
                k.dtype == x.dtype and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            return False
        return self._matmul_fns(x) is not None

    def _matmul_fns(self, x: torch.Tensor) -> torch.Tensor | None:
        """[qkv, o, gate_up, down, attention] kernel addresses for rows like ``x``, or None where a matmul of the
        stack would not take a native kernel. Every layer's matmuls share the shapes, hence the routing."""
        key = (x.shape[0], x.dtype)
        fns = self._fns.get(key)
        if fns is None and key not in self._fns:
            cfg = self.model.cfg
            names = {lin.native_kernel(x.new_empty((x.shape[0], lin.in_features)))
                     for layer in self.model.layers
                     for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                 layer.mlp.down_proj)}
            if len(names) == 1 and None not in names:  # one native kernel for every matmul of the stack
                name = names.pop()
                assert name is not None
                addrs = [cpu_kernels.matmul_address(name, x.dtype)] * 4
                addrs.append(cpu_kernels.decode_attn_address(x.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
                fns = torch.tensor(addrs, dtype=torch.int64)
            self._fns[key] = fns
        return fns

    def _layer_table(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The layer pointer table, rebuilt when the caches list or the first or last layer's qkv weight changed
        (weights are loaded, converted or packed before serving; a reload replaces them all)."""
        first, last = self.model.layers[0].self_attn.qkv_proj.weight, self.model.layers[-1].self_attn.qkv_proj.weight
        key = (id(kv_caches), kv_caches[0][0].data_ptr(), first.data_ptr(), last.data_ptr())
        if key == self._table_key and self._table is not None:
            return self._table
        tensors: list[torch.Tensor | None] = []
        for layer, (k, v) in zip(self.model.layers, kv_caches, strict=True):
            a, m = layer.self_attn, layer.mlp
            tensors += [layer.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias, a.o_proj.weight,
                        a.o_proj.bias, layer.post_attention_layernorm.weight, m.gate_up_proj.weight,
                        m.gate_up_proj.bias, m.down_proj.weight, m.down_proj.bias, k, v]
        if not all(p is None or p.is_contiguous() for p in tensors):
            raise ValueError("fused decode: a weight or cache tensor is not contiguous")
        self._table = torch.tensor([0 if p is None else p.data_ptr() for p in tensors], dtype=torch.int64)
        self._table_key = key
        return self._table

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Every decoder layer on ``x`` [B, hidden] (overwritten) -> ``x``. ``applies`` must hold; cos, sin
        [B, 1, head_dim] contiguous."""
        cfg = self.model.cfg
        b = x.shape[0]
        fns = self._matmul_fns(x)
        assert fns is not None
        table = self._layer_table(kv_caches)
        n = cpu_kernels.llama_decode_scratch(b, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             cfg.intermediate_size)
        scratch = self._scratch.get(x.dtype)
        if scratch is None or scratch.numel() < n:  # one buffer per dtype, grown to the most rows seen
            scratch = self._scratch[x.dtype] = torch.empty(n, dtype=x.dtype)
        g = meta.decode_groups[0]
        cpu_kernels.llama_decode_layers(
            x, table, len(self.model.layers), fns, cos.contiguous(), sin.contiguous(), meta.slot_mapping, g.slots,
            g.lengths, cfg, scratch)
        return x

