"""Profile one engine on this device: prefill tokens per forward and decode batch size sweeps.

Finds the accelerator-saturate threshold (the paper's ChunkSize): the smallest prefill size after which
tokens/s stops rising by more than ``saturation_gain`` (5%). The JSON profile feeds the simulator's cost
model.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.llm_engine import build_runner
from tetriinfer.engine.profile_config import ProfileConfig


@dataclass
class Profile:
    model: str
    dtype: str
    device: str
    num_threads: int
    machine: str
    num_params: int
    prefill: list[dict[str, float]] = field(default_factory=list)  # tokens, seconds, tokens_per_s
    decode: list[dict[str, float]] = field(default_factory=list)  # batch, context, seconds, tokens_per_s
    chunk_size: int = 0


def saturation_point(sizes: list[int], tokens_per_s: list[float], gain: float) -> int:
    """First size whose successor improves tokens/s by at most ``gain`` (relative); else the largest."""
    for i in range(len(sizes) - 1):
        if tokens_per_s[i + 1] <= tokens_per_s[i] * (1.0 + gain):
            return sizes[i]
    return sizes[-1]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run_profile(engine_config: EngineConfig, config: ProfileConfig, progress: bool = True) -> Profile:
    parts = build_runner(engine_config)
    runner, kv, cfg = parts.runner, parts.kv_manager, parts.model_config
    max_len = parts.max_model_len
    params = SamplingParams(max_tokens=1, temperature=0.0)
    prefill_sizes = [n for n in config.prefill_tokens if n < max_len]
    prof = Profile(
        model=engine_config.model,
        dtype=engine_config.dtype,
        device=engine_config.device,
        num_threads=torch.get_num_threads(),
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        num_params=cfg.num_params(),
    )
    total = len(prefill_sizes) + len(config.decode_batches)
    bar = tqdm(total=total, desc="profile", disable=not progress)
    for n in prefill_sizes:
        if not kv.allocate_slots("p", n):
            bar.update(1)
            continue
        seg = ScheduledSegment("p", 0, tuple(range(5, 5 + n)), tuple(kv.block_table("p")), True, params, 0)
        out = SchedulerOutput(1, StepKind.PREFILL, (seg,))
        reps = config.repeats if n <= 1024 else 1
        secs = _time(lambda out=out: runner.execute(out), reps)
        kv.free_request("p")
        prof.prefill.append({"tokens": n, "seconds": secs, "tokens_per_s": n / secs})
        bar.set_postfix(prefill=n, tok_s=f"{n / secs:.0f}")
        bar.update(1)
    ctx = min(config.decode_context, max_len - 1)
    for b in config.decode_batches:
        ids = [f"d{i}" for i in range(b)]
        if not all(kv.allocate_slots(r, ctx + 1) for r in ids):
            for r in ids:
                kv.free_request(r)
            bar.update(1)
            continue
        segs = tuple(ScheduledSegment(r, ctx, (7,), tuple(kv.block_table(r)), True, params, 1) for r in ids)
        out = SchedulerOutput(1, StepKind.DECODE, segs)
        secs = _time(lambda out=out: runner.execute(out), config.repeats)
        for r in ids:
            kv.free_request(r)
        prof.decode.append({"batch": b, "context": ctx, "seconds": secs, "tokens_per_s": b / secs})
        bar.set_postfix(decode=b, ms=f"{secs * 1e3:.1f}")
        bar.update(1)
    bar.close()
    if prof.prefill:
        prof.chunk_size = saturation_point(
            [int(r["tokens"]) for r in prof.prefill], [r["tokens_per_s"] for r in prof.prefill], config.saturation_gain
        )
    return prof


def format_table(prof: Profile) -> str:
    lines = ["| prefill tokens/forward | ms | tokens/s |", "|---:|---:|---:|"]
    for r in prof.prefill:
        mark = " (ChunkSize)" if int(r["tokens"]) == prof.chunk_size else ""
        lines.append(f"| {int(r['tokens'])}{mark} | {r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:.0f} |")
    lines += ["", "| decode batch | context | ms/step | tokens/s |", "|---:|---:|---:|---:|"]
    for r in prof.decode:
        lines.append(
            f"| {int(r['batch'])} | {int(r['context'])} | {r['seconds'] * 1e3:.1f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def save_profile(prof: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(prof), indent=2))
