"""Paged attention over block tables, built on ``scaled_dot_product_attention``.

KV cache layout per layer: ``k_cache``/``v_cache`` of shape [num_slots, num_kv_heads, head_dim] where
``num_slots = num_blocks * block_size`` and token ``t`` of a request with block table ``bt`` lives in
slot ``bt[t // block_size] * block_size + t % block_size``.

A step's flattened token batch is [T] (prefill segments back to back, then padding; or one token per
decoding request). ``AttentionMetadata`` says where each token's K/V goes and what each query may see.
Padding tokens write nowhere and attend to nothing (their outputs are zeros and never read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tetriinfer.engine.cpu_info import bf16_decode_wants_native_kernels, cpu_has_native
from tetriinfer.engine.cpu_kernels import (
    PREFILL_ATTN_MAX_HEAD_DIM,
    avx512_bf16_available,
    decode_attn,
    kernels_available,
    kernels_threaded,
    prefill_attn_bf16,
)


def _threads_ok() -> bool:
    """The native kernels split their work over torch's threads (OpenMP builds), or the engine runs one thread."""
    return kernels_threaded() or torch.get_num_threads() == 1


@dataclass
class PrefillSegmentMeta:
    q_start: int  # row of the segment's first token in the flat batch
    q_len: int
    ctx_start: int  # position of the first new token in the request (= cached prefix length)
    # Slots of positions [0, ctx_start + q_len) when ctx_start > 0 (else None: attend to fresh K/V only).
    ctx_slots: torch.Tensor | None
    # [q_len, ctx_len] bool, True = may attend; None when ctx_start == 0 (plain causal).
    mask: torch.Tensor | None


@dataclass
class DecodeGroupMeta:
    """Single-token segments with a cached prefix (decodes) of similar context lengths, attended as one
    padded batch (grouping by length bounds the K/V gathered for padding)."""

    rows: torch.Tensor  # [B] rows in the flat batch
    row_start: int | None  # rows are exactly [row_start, row_start + B): read/write with a slice
    slots: torch.Tensor  # [B, L] slots of each context, padded with the request's position-0 slot
    mask: torch.Tensor | None  # [B, 1, 1, L] bool validity; None when every context has length L
    lengths: torch.Tensor | None = None  # [B] int64 context lengths (row b's valid slots are slots[b, :len])


@dataclass
class AttentionMetadata:
    num_real_tokens: int  # rows [0, num_real_tokens) are real; the rest is chunk padding
    slot_mapping: torch.Tensor  # [num_real_tokens] int64: where each real token's K/V is written
    prefill_segments: list[PrefillSegmentMeta]
    decode_groups: list[DecodeGroupMeta] = field(default_factory=list)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    # q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D]. Grouped-query heads share K/V without copies
    # (enable_gqa: query head h reads kv head h // (H / Hkv), as repeat_interleave would; bit-identical).
    gqa = q.shape[1] != k.shape[1]
    if q.shape[2] == 1 and q.dtype != torch.float32 and q.device.type == "cpu" and not cpu_has_native(q.dtype):
        # Decode on a CPU without bf16/fp16 instructions: torch's reduced-precision SDPA kernel is several
        # times slower than fp32 there for single-query rows; compute in fp32, round the output once.
        o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=gqa)
        return o.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def native_decode_attention(kv_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decode rows over a contiguous KV cache of ``kv_dtype`` on ``device`` take the native kernel
    (`_use_decode_kernel` for the queries of that cache): the runner then forms one decode group of every row, since
    the kernel reads each row's own length and needs no padding buckets."""
    return (device.type == "cpu" and kv_dtype in (torch.bfloat16, torch.float32) and kernels_available()
            and _threads_ok())


def _use_decode_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The native paged decode attention (`cpu_kernels.decode_attn`) replaces gather + SDPA for CPU decode groups
    in fp32 and bf16 at any thread count (`_threads_ok`). It reads K/V in place; torch's path gathers them first.
    On AMX CPUs too: on a Sapphire Rapids core, bf16 decode steps of the tiny llama over 400-token contexts took
    7.8 / 11.0 / 16.3 / 20.9 ms with it against 8.4 / 11.6 / 18.5 / 24.2 ms with gather + SDPA at batch 8 / 16 / 32
    / 48, and the same below batch 8 (benchmarks/bench_decode_kernels.py)."""
    return q.dtype == k_cache.dtype and k_cache.is_contiguous() and native_decode_attention(q.dtype, q.device)


def _use_prefill_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The native AVX-512 BF16 causal attention (`cpu_kernels.prefill_attn_bf16`) replaces SDPA for bf16 prefill
    segments on CPUs without AMX that have AVX-512 BF16, at any thread count (`_threads_ok`: the kernel splits
    (head, query block) pairs over the threads, as torch's flash attention does)."""
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and k_cache.dtype == torch.bfloat16
            and k_cache.is_contiguous() and q.shape[-1] % 16 == 0 and q.shape[-1] <= PREFILL_ATTN_MAX_HEAD_DIM
            and bf16_decode_wants_native_kernels()
            and avx512_bf16_available() and _threads_ok())


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, H, D]
    n = meta.num_real_tokens
    if n:
        k_cache.index_copy_(0, meta.slot_mapping, k[:n])
        v_cache.index_copy_(0, meta.slot_mapping, v[:n])
    out = torch.zeros_like(q) if n < q.shape[0] else torch.empty_like(q)
    native_decode = _use_decode_kernel(q, k_cache)
    for g in meta.decode_groups:
        b, length = g.slots.shape
        if native_decode and g.lengths is not None:  # K/V read in place by the C kernel
            if g.row_start is not None:
                rows = slice(g.row_start, g.row_start + b)
                out[rows] = decode_attn(q[rows].contiguous(), k_cache, v_cache, g.slots, g.lengths)
            else:
                qd = q.index_select(0, g.rows)  # [B, H, D]
                out.index_copy_(0, g.rows, decode_attn(qd, k_cache, v_cache, g.slots, g.lengths))
            continue
        flat = g.slots.view(-1)
        kc = k_cache.index_select(0, flat).view(b, length, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
        vc = v_cache.index_select(0, flat).view(b, length, *v_cache.shape[1:]).transpose(1, 2)
        if g.row_start is not None:
            rows = slice(g.row_start, g.row_start + b)
            out[rows] = _sdpa(q[rows].unsqueeze(2), kc, vc, g.mask, causal=False).squeeze(2)  # [B, H, D]
        else:
            qd = q.index_select(0, g.rows).unsqueeze(2)  # [B, H, 1, D]
            out.index_copy_(0, g.rows, _sdpa(qd, kc, vc, g.mask, causal=False).squeeze(2))
    native_prefill = bool(meta.prefill_segments) and _use_prefill_kernel(q, k_cache)
    for seg in meta.prefill_segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if native_prefill:  # K/V already written to the cache above: read them there, in place
            slots = seg.ctx_slots if seg.ctx_slots is not None else meta.slot_mapping[rows]
            out[rows] = prefill_attn_bf16(q[rows], k_cache, v_cache, slots.contiguous(), seg.ctx_start)
            continue
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if seg.ctx_slots is None:
            ks = k[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q_len, D]
            vs = v[rows].transpose(0, 1).unsqueeze(0)
            o = _sdpa(qs, ks, vs, None, causal=True)
        else:
            ks = k_cache.index_select(0, seg.ctx_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
            vs = v_cache.index_select(0, seg.ctx_slots).transpose(0, 1).unsqueeze(0)
            o = _sdpa(qs, ks, vs, seg.mask, causal=False)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
