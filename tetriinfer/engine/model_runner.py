"""Executes a ``SchedulerOutput`` on a model: builds the flat token batch and attention metadata,
runs one forward pass, samples, and returns a ``StepResult``.

The runner owns the model, the KV tensors and the sampler; it never decides what to run.
"""

from __future__ import annotations

import functools
import time

import torch

from tetriinfer.core.step import SchedulerOutput, StepResult
from tetriinfer.engine.attention import (
    AttentionMetadata,
    DecodeGroupMeta,
    PrefillSegmentMeta,
    native_decode_attention,
)
from tetriinfer.engine.cpu_kernels import argmax_rows, kernels_available
from tetriinfer.engine.kv_cache import KVCacheTensors
from tetriinfer.engine.model_config import ModelConfig
from tetriinfer.engine.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ModelConfig,
        kv: KVCacheTensors,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.kv = kv
        self.device = torch.device(device)
        self.sampler = Sampler(device=self.device, seed=seed)
        self._kv_layers = kv.layers()
        # When set, every sampled position's raw logits [V] are appended here per request (tests, debugging).
        self.logits_sink: dict[str, list[torch.Tensor]] | None = None
        # Hidden-state capture (``capture``): the requests whose next sampled position (a prompt's last token, in
        # the step that ends its prefill) keeps the outputs of ``_capture_layers``; ``captured`` holds them after
        # ``execute``, [len(layers) * hidden] float32 per request, until read.
        self.capture_ids: set[str] = set()
        self.captured: dict[str, torch.Tensor] = {}
        self._capture_layers: tuple[int, ...] = ()
        self._capture_rows: torch.Tensor | None = None
        self._capture_parts: dict[int, torch.Tensor] = {}  # layer -> [R, hidden], filled by the hooks

    def capture(self, layers: tuple[int, ...]) -> None:
        """Keep the outputs of decoder ``layers`` (1-based: ``L`` is the residual stream after ``L`` layers, the
        ``hidden_states[L]`` of transformers) at the sampled positions of the requests in ``capture_ids``. Once
        per runner (again with the same layers: nothing to do, as when an instance becomes a prefill instance once
        more). The fused decode path is not taken in a step that captures (it runs no per-layer modules)."""
        if self._capture_layers:
            if tuple(layers) != self._capture_layers:
                raise RuntimeError(f"this runner captures layers {self._capture_layers} already")
            return
        stack = self.model.layers  # type: ignore[attr-defined]
        if not layers or not all(1 <= x < len(stack) for x in layers):
            raise ValueError(f"capture layers must be in [1, {len(stack) - 1}], got {layers}")
        self._capture_layers = tuple(layers)
        for layer in set(layers):
            stack[layer - 1].register_forward_hook(functools.partial(self._keep_rows, layer))

    def _keep_rows(self, layer: int, _module: torch.nn.Module, _args: object, output: torch.Tensor) -> None:
        rows = self._capture_rows
        if rows is not None:  # output [T, hidden] -> the captured rows [R, hidden]
            self._capture_parts[layer] = output.index_select(0, rows).float()

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bs = self.kv.block_size
        return block_table[positions // bs] * bs + positions % bs

    def build_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """-> input_ids [T], positions [T], metadata, rows to sample (indices into the flat batch).

        Segments of one token with a cached prefix (decodes, in DECODE or MIXED steps) are attended together:
        in one group when the native decode kernel reads the KV cache, else in padded batches of similar context
        lengths; every other segment is a prefill segment attended on its own.
        """
        bs = self.kv.block_size
        ids: list[int] = []
        pos: list[int] = []  # [T] as Python ints, one tensor at the end (a decode step has one per row)
        slots: list[int] = []
        sample_rows: list[int] = []
        segs_meta: list[PrefillSegmentMeta] = []
        dec_rows: list[int] = []
        dec_tables: list[tuple[int, ...]] = []
        dec_lens: list[int] = []
        row = 0
        for seg in out.segments:
            n = seg.num_tokens
            bt = seg.block_table
            ids.extend(seg.token_ids)
            if n == 1:
                p = seg.start
                pos.append(p)
                slots.append(bt[p // bs] * bs + p % bs)
            else:
                pos.extend(range(seg.start, seg.end))
                slots.extend([bt[p // bs] * bs + p % bs for p in range(seg.start, seg.end)])
            if seg.sample:
                sample_rows.append(row + n - 1)
            if n == 1 and seg.start > 0:
                dec_rows.append(row)
                dec_tables.append(bt)
                dec_lens.append(seg.end)
            elif seg.start == 0:
                segs_meta.append(PrefillSegmentMeta(row, n, 0, None, None))
            else:
                ctx = torch.arange(0, seg.end, dtype=torch.long)
                mask = ctx[None, :] <= torch.arange(seg.start, seg.end, dtype=torch.long)[:, None]  # [n, end]
                segs_meta.append(
                    PrefillSegmentMeta(
                        row, n, seg.start,
                        self._slots(torch.tensor(bt, dtype=torch.long), ctx).to(self.device), mask.to(self.device),
                    )
                )
            row += n
        num_real = row
        ids.extend([0] * out.num_padding_tokens)
        pos.extend([0] * out.num_padding_tokens)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(num_real, slot_mapping, segs_meta)
        if dec_rows and native_decode_attention(self._kv_layers[0][0].dtype, self.device):
            # one group in batch order: the kernel reads each row's own length (no padded buckets), and rows that
            # are contiguous in the batch (every decode step) need no gather of q or scatter of the output
            meta.decode_groups.append(self._decode_group(dec_rows, dec_tables, dec_lens))
        elif dec_rows:
            order = sorted(range(len(dec_rows)), key=lambda i: -dec_lens[i])
            for group in _length_groups([dec_lens[i] for i in order]):
                idx = [order[j] for j in group]
                meta.decode_groups.append(
                    self._decode_group([dec_rows[i] for i in idx], [dec_tables[i] for i in idx],
                                       [dec_lens[i] for i in idx])
                )
        return input_ids, positions, meta, sample_rows

    def _greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """The argmax token of each row's logits ([N, hidden] -> N ids), as ``compute_logits(hidden).argmax(-1)``:
        on the CPU with the native kernels, straight from the model-dtype logits (no fp32 copy; torch's bf16 argmax
        is ~4x slower than its fp32 one, the kernel ~4x faster than both at SmolLM2's 48 x 49,152)."""
        logits = self.model.lm_logits(hidden)  # [N, V], model dtype
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and kernels_available():
            return argmax_rows(logits.contiguous())
        return logits.float().argmax(dim=-1).tolist()

    def _decode_group(self, rows: list[int], tables: list[tuple[int, ...]], lens: list[int]) -> DecodeGroupMeta:
        bs = self.kv.block_size
        max_len = max(lens)
        max_blocks = -(-max_len // bs)
        # [B, max_blocks]: each row's block table, cut or zero-padded to max_blocks
        table = torch.tensor([(*bt[:max_blocks], *(0,) * (max_blocks - len(bt))) for bt in tables], dtype=torch.long)
        ctx = torch.arange(max_len, dtype=torch.long)
        lengths = torch.tensor(lens, dtype=torch.long)
        valid = ctx[None, :] < lengths[:, None]  # [B, L]
        # Positions past a request's length re-read its position 0 (always written), then get masked.
        ctx_pos = torch.where(valid, ctx[None, :], 0)  # [B, L]
        slots = (table.gather(1, ctx_pos // bs) * bs + ctx_pos % bs).to(self.device)  # [B, L]
        mask = None if min(lens) == max_len else valid[:, None, None, :].to(self.device)  # [B, 1, 1, L]
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        return DecodeGroupMeta(
            rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            row_start=rows[0] if contiguous else None,
            slots=slots,
            mask=mask,
            lengths=lengths.to(self.device),
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        self.sampler.drop(out.finished_request_ids)
        if out.is_empty:
            return StepResult(step_id=out.step_id, elapsed_s=0.0)
        input_ids, positions, meta, sample_rows = self.build_inputs(out)
        capture_for = self._capture_for(out, sample_rows) if self.capture_ids else None
        hidden = self.model(input_ids, positions, self._kv_layers, meta)  # [T, hidden]
        if capture_for is not None:
            self._collect_capture(capture_for)
        sampled: dict[str, int] = {}
        logprobs: dict[str, dict[int, float]] = {}
        sample_segs = [s for s in out.segments if s.sample]
        if sample_segs and self.logits_sink is None and all(map(Sampler.argmax_only, sample_segs)):
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            for seg, tok in zip(sample_segs, self._greedy_tokens(hidden.index_select(0, rows)), strict=True):
                sampled[seg.request_id] = tok
        elif sample_segs:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [N, V] fp32
            if self.logits_sink is not None:
                for seg, row_logits in zip(sample_segs, logits, strict=True):
                    self.logits_sink.setdefault(seg.request_id, []).append(row_logits.clone())
            tokens, lps = self.sampler.sample(logits, sample_segs)
            for seg, tok, lp in zip(sample_segs, tokens, lps, strict=True):
                sampled[seg.request_id] = tok
                if lp is not None:
                    logprobs[seg.request_id] = lp
        return StepResult(out.step_id, sampled, logprobs, elapsed_s=time.perf_counter() - t0)

    def _capture_for(self, out: SchedulerOutput, sample_rows: list[int]) -> list[str] | None:
        """Arm the capture hooks for this step's sampled rows of requests in ``capture_ids``; their ids in row
        order, or None when no such row runs in this step."""
        ids, rows = [], []
        for seg, row in zip((s for s in out.segments if s.sample), sample_rows, strict=True):
            if seg.request_id in self.capture_ids:
                ids.append(seg.request_id)
                rows.append(row)
        if not ids:
            return None
        self._capture_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
        self._capture_parts = {}
        self.model.fused_decode_off = True  # type: ignore[attr-defined]
        return ids

    def _collect_capture(self, ids: list[str]) -> None:
        parts, self._capture_parts, self._capture_rows = self._capture_parts, {}, None
        self.model.fused_decode_off = False  # type: ignore[attr-defined]
        if any(x not in parts for x in self._capture_layers):
            return  # a path that ran no per-layer modules: nothing captured (the caller predicts without)
        states = torch.cat([parts[x] for x in self._capture_layers], dim=1).cpu()  # [R, len(layers) * hidden]
        for i, rid in enumerate(ids):
            self.capture_ids.discard(rid)
            self.captured[rid] = states[i]


# A decode group closes when the next (shorter) context is below this fraction of the group's longest:
# padding then costs at most 1 / GROUP_RATIO of the K/V a group really needs, and contexts up to
# GROUP_MIN_LEN tokens never split (gathering a few padded short contexts is cheaper than another call).
GROUP_RATIO = 0.7
GROUP_MIN_LEN = 64


def _length_groups(lens_desc: list[int]) -> list[list[int]]:
    """Indices into ``lens_desc`` (sorted descending) grouped into runs of similar lengths."""
    groups: list[list[int]] = []
    group_max = 0
    for i, n in enumerate(lens_desc):
        if groups and (n >= GROUP_RATIO * group_max or group_max <= GROUP_MIN_LEN):
            groups[-1].append(i)
        else:
            groups.append([i])
            group_max = n
    return groups
