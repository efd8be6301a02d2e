"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens, logprobs."""

from __future__ import annotations

import torch

from tetriinfer.core.step import ScheduledSegment


class Sampler:
    """Owns the per-request random generators (seeded requests are reproducible across runs)."""

    def __init__(self, device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._default = torch.Generator(device=device).manual_seed(seed)

    def drop(self, request_ids: tuple[str, ...] | list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def export_state(self, request_id: str) -> bytes:
        """The request's seeded generator state (empty: it has none yet, or is unseeded), for live migration.
        Raw bytes of torch's state tensor: nothing executable, restored with ``import_state``."""
        gen = self._generators.get(request_id)
        return b"" if gen is None else bytes(gen.get_state().numpy().tobytes())

    def import_state(self, request_id: str, seed: int, state: bytes) -> None:
        """Continue a migrated seeded request's generator where its source stopped. ValueError: malformed."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        expect = gen.get_state().numel()
        if len(state) != expect:
            raise ValueError(f"sampler state for {request_id!r} has {len(state)} bytes, expected {expect}")
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self._generators[request_id] = gen

    def _generator(self, seg: ScheduledSegment) -> torch.Generator:
        seed = seg.sampling_params.seed
        if seed is None:
            return self._default
        gen = self._generators.get(seg.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[seg.request_id] = gen
        return gen

    @staticmethod
    def argmax_only(seg: ScheduledSegment) -> bool:
        """Whether the segment's token is the plain argmax of its logits: greedy, no logprobs, nothing banned now
        (min_tokens reached, or nothing to ban). A step whose rows are all such needs none of `sample`'s
        bookkeeping (no copy of the greedy rows' logits): one argmax over the logits gives its tokens."""
        p = seg.sampling_params
        return p.greedy and p.logprobs is None and (
            seg.num_output_tokens >= p.min_tokens
            or not (p.stop_token_ids or (seg.eos_token_id is not None and not p.ignore_eos)))

    def sample(
        self, logits: torch.Tensor, segs: list[ScheduledSegment]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits [N, V] float32, one row per sampling segment -> N token ids (+ logprobs)."""
        n = logits.shape[0]
        for i, seg in enumerate(segs):  # suppress EOS / stop tokens until min_tokens is reached
            p = seg.sampling_params
            if seg.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids)
                if seg.eos_token_id is not None and not p.ignore_eos:
                    banned.append(seg.eos_token_id)
                if banned:
                    logits[i, banned] = float("-inf")
        tokens: list[int] = [0] * n
        greedy_rows = [i for i, s in enumerate(segs) if s.sampling_params.greedy]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            picked = logits.index_select(0, idx).argmax(dim=-1).tolist()
            for i, t in zip(greedy_rows, picked, strict=True):
                tokens[i] = t
        for i, seg in enumerate(segs):
            p = seg.sampling_params
            if p.greedy:
                continue
            row = logits[i] / p.temperature
            if p.top_k > 0 and p.top_k < row.shape[-1]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                probs = torch.softmax(sorted_logits, dim=-1)
                cum = probs.cumsum(-1)
                remove = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
                sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
                row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
            probs = torch.softmax(row, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=self._generator(seg)).item())
        logprobs: list[dict[int, float] | None] = [None] * n
        want = [i for i, s in enumerate(segs) if s.sampling_params.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for j, i in enumerate(want):
                k = segs[i].sampling_params.logprobs or 0
                entry: dict[int, float] = {}
                if k > 0:
                    top = torch.topk(lp[j], k)
                    entry.update(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                entry[tokens[i]] = float(lp[j, tokens[i]])
                logprobs[i] = entry
        return tokens, logprobs
