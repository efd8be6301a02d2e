"""Workloads: what requests arrive when, with how many prompt and output tokens.

Pure module (no torch, no sockets, no clock) so the benchmark client and the simulator build the very
same request lists. Sources:

- ``trace:FILE`` replays a real trace: Azure CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) or
  Mooncake JSONL (``timestamp`` in ms, ``input_length``, ``output_length``), detected by extension or
  content. Arrivals are the trace's timestamps (optionally time-scaled or rescaled to a rate).
- ``lpld``, ``lphd``, ``hpld``, ``hphd`` are the paper's classes: (prompt, output) pairs resampled with
  replacement from a real trace's rows that satisfy the class (heavy prefill: prompt > 512 tokens;
  heavy decode: output > 128 tokens; light: at or below). ``mixed`` resamples from all rows. Pairs are
  kept together, so the classes keep the trace's joint distribution. Arrivals are Poisson or gamma.

Invariants of a returned ``Workload``: requests are sorted by ``arrival_s`` (first at 0.0), ids are
unique, and every request that the target server cannot hold (``prompt + output > max_context``) is
present with ``rejected=True`` - never silently dropped.

The default length source is ``../shared/data/AzureLLMInferenceTrace_conv.csv`` (set
``TETRIINFER_DATA_DIR`` to point elsewhere); when it is absent the 2,000-row sample shipped in
``tetriinfer/data/azure_conv_sample.csv`` is used instead.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import numpy as np

from tetriinfer.bench.arrivals import (
    make_arrivals,
    rescale_to_rate,
    trace_arrivals,
)
from tetriinfer.bench.real_workloads import chat_tokenizer, real_class_workload, render_user_turn
from tetriinfer.bench.workload_types import (  # noqa: F401 - re-exported: callers import them from here
    ALPACA_DEFAULT_FILE,
    AZURE_CONV_FILENAME,
    CLASS_NAMES,
    HEAVY_DECODE_TOKENS,
    HEAVY_PREFILL_TOKENS,
    MOONCAKE_CONV_FILENAME,
    SAMPLE_PATH,
    TRACE_HASH_BLOCK_TOKENS,
    TraceRow,
    Workload,
    WorkloadRequest,
    _mark_rejections,
    classify,
    length_stats,
)


def _parse_timestamp(text: str) -> float:
    """Seconds from a numeric string or an ISO date-time (Azure's has 7 fractional digits)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    main, _, frac = text.partition(".")
    base = datetime.fromisoformat(main)
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


def _detect_format(path: Path, text: str) -> str:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return "jsonl" if stripped.startswith("{") else "csv"
    raise ValueError(f"trace file {path} is empty")


def _rows_from_csv(path: Path, text: str) -> list[TraceRow]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
    if reader.fieldnames is None or not need.issubset({f.strip() for f in reader.fieldnames}):
        raise ValueError(
            f"trace CSV {path} must have columns TIMESTAMP,ContextTokens,GeneratedTokens; got {reader.fieldnames}"
        )
    rows: list[TraceRow] = []
    for i, rec in enumerate(reader, start=2):
        rec = {k.strip(): v for k, v in rec.items() if k is not None}
        try:
            rows.append(
                TraceRow(
                    _parse_timestamp(rec["TIMESTAMP"]), int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
                )
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"trace CSV {path}, data line {i}: cannot parse {rec}: {exc}") from exc
    return rows


def _rows_from_jsonl(path: Path, text: str) -> list[TraceRow]:
    rows: list[TraceRow] = []
    for i, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            rec = json.loads(line)
            rows.append(
                TraceRow(
                    float(rec["timestamp"]) / 1000.0, int(rec["input_length"]), int(rec["output_length"]),
                    tuple(int(h) for h in rec.get("hash_ids") or ()),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"trace JSONL {path}, line {i}: need timestamp (ms), input_length, output_length: {exc}"
            ) from exc
    return rows


@functools.lru_cache(maxsize=8)
def _load_trace_cached(path_str: str, mtime_ns: int) -> tuple[TraceRow, ...]:
    path = Path(path_str)
    text = path.read_text(encoding="utf-8")
    fmt = _detect_format(path, text)
    rows = _rows_from_csv(path, text) if fmt == "csv" else _rows_from_jsonl(path, text)
    if not rows:
        raise ValueError(f"trace file {path} has no requests")
    return tuple(rows)


def load_trace(path: str | os.PathLike[str]) -> tuple[TraceRow, ...]:
    """All rows of an Azure CSV or Mooncake JSONL trace, in file order (cached per file version)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"trace file not found: {p}")
    return _load_trace_cached(str(p.resolve()), p.stat().st_mtime_ns)


def shared_data_dir() -> Path:
    """``$TETRIINFER_DATA_DIR`` if set, else ``<project root>/../shared/data`` (may not exist). In a compiled copy
    (``scripts/build_native_sim.py``) the project root is the checkout it was built from, named in the copy's
    ``tetriinfer/NATIVE_BUILD.json``, so a copy anywhere reads the same data as its sources."""
    env = os.environ.get("TETRIINFER_DATA_DIR")
    if env:
        return Path(env).expanduser()
    package = Path(__file__).resolve().parents[1]
    root = package.parent
    marker = package / "NATIVE_BUILD.json"
    if marker.is_file():
        root = Path(json.loads(marker.read_text())["source_root"])
    return root.parent / "shared" / "data"


def default_length_source() -> Path:
    """The full Azure conversation trace when present, else the shipped 2,000-row sample."""
    full = shared_data_dir() / AZURE_CONV_FILENAME
    return full if full.is_file() else SAMPLE_PATH


def _resolve_source(length_source: str | os.PathLike[str] | None) -> Path:
    if length_source is None or str(length_source) == "azure":
        return default_length_source()
    if str(length_source) == "mooncake":
        return shared_data_dir() / MOONCAKE_CONV_FILENAME
    if str(length_source) == "sample":
        return SAMPLE_PATH
    return Path(length_source)


# -------------------------------------------------------------------------------------------- workloads




def _class_pool(
    rows: tuple[TraceRow, ...], name: str, max_prompt: int | None, max_output: int | None
) -> np.ndarray:
    """(k, 2) array of (prompt, output) pairs of the class within the caps."""
    pairs = np.array([(r.prompt_tokens, r.output_tokens) for r in rows], dtype=np.int64)
    keep = (pairs[:, 0] >= 1) & (pairs[:, 1] >= 1)
    if max_prompt is not None:
        keep &= pairs[:, 0] <= max_prompt
    if max_output is not None:
        keep &= pairs[:, 1] <= max_output
    if name != "mixed":
        heavy_p = pairs[:, 0] > HEAVY_PREFILL_TOKENS
        heavy_d = pairs[:, 1] > HEAVY_DECODE_TOKENS
        keep &= heavy_p if name[:2] == "hp" else ~heavy_p
        keep &= heavy_d if name[2:] == "hd" else ~heavy_d
    return pairs[keep]


def _check_positive_int(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_length_scale(length_scale: float) -> None:
    """``--length-scale`` must be a positive finite factor (ValueError otherwise)."""
    if not (length_scale > 0 and math.isfinite(length_scale)):
        raise ValueError(f"length_scale must be a positive finite number, got {length_scale}")


def load_workload(
    name: str,
    num_requests: int,
    rate: float | None = None,
    seed: int = 0,
    *,
    arrival: str | None = None,
    burstiness_cv: float = 1.0,
    trace_timescale: float | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    max_context: int | None = None,
    length_source: str | os.PathLike[str] | None = None,
    length_scale: float = 1.0,
    trace_repeat: int = 1,
    tokenizer: str | None = None,
    output_cap: int = 1024,
    real_lengths: str = "greedy",
) -> Workload:
    """Build a workload by name: ``lpld|lphd|hpld|hphd|mixed``, ``trace:FILE``, ``scale:N``, ``alpaca[:FILE]``
    or ``real:CLASS``.

    - ``alpaca[:FILE]``: real prompts (see ``alpaca_workload``; needs the served model's ``tokenizer``),
      each asking for at most ``output_cap`` tokens.
    - ``real:CLASS``: the classes built from real prompts for natural output lengths (see
      ``bench/real_workloads.py``; needs ``tokenizer``); ``max_output_tokens`` is the heavy-decode cap;
      ``real_lengths`` (``greedy``/``sampled``) the shipped lengths that class the light prompts.

    - ``num_requests``: class workloads draw this many; traces take their first ``num_requests`` rows.
    - ``rate``: mean request rate (req/s). Class workloads: rate of the Poisson/gamma process, or None
      for a burst (all at t=0, like ``vllm bench serve --request-rate inf``). Traces: rescale the trace's
      timestamps (or, with ``arrival='poisson'|'gamma'``, replace them) so the rate is exactly ``rate``.
    - ``arrival``: ``poisson`` (default for classes), ``gamma`` (with ``burstiness_cv``) or ``trace``
      (default and only valid timestamp source for traces).
    - ``trace_timescale``: multiply trace gaps by this (2 = half the rate); exclusive with ``rate``.
    - ``max_prompt_tokens`` / ``max_output_tokens``: class workloads sample only pairs within the caps
      (the class-conditioned distribution below the caps); traces clip lengths to the caps (noted).
    - ``max_context``: requests with ``prompt + output > max_context`` are kept but marked rejected.
    - ``length_source``: trace file the classes resample from (``azure`` default, ``mooncake``,
      ``sample`` or a path).
    - ``length_scale``: traces only: multiply prompt and output lengths (and a Mooncake trace's hash-block size,
      so shared prefixes stay shared) by this, before the caps: replays a long-context trace on a small model.
    - ``trace_repeat``: traces only: the trace played ``K`` times back to back (each copy starts one mean gap after
      the previous one ends; request ids stay unique), so ``num_requests`` may reach ``K`` x its rows.
    - ``scale:N``: a synthetic trace of ``N`` requests for runs larger than any trace file: each request's
      (prompt, output) pair and its gap to the previous arrival are drawn independently, with replacement, from
      ``length_source``'s rows and inter-arrival gaps (seeded by ``seed``: the same inputs give the same
      requests); hash blocks are dropped. Then handled as a trace: its first ``num_requests`` requests, arrivals
      rescaled to ``rate`` when given, lengths scaled and capped alike.
    """
    check_length_scale(length_scale)
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"rate must be a positive finite number of requests/s, got {rate}")
    for label, value in (
        ("max_prompt_tokens", max_prompt_tokens),
        ("max_output_tokens", max_output_tokens),
        ("max_context", max_context),
    ):
        _check_positive_int(label, value)
    key = name.strip()
    if trace_repeat < 1:
        raise ValueError(f"trace_repeat must be >= 1, got {trace_repeat}")
    if trace_repeat != 1 and not key.lower().startswith("trace:"):
        raise ValueError("trace_repeat applies only to trace:FILE workloads")
    if key.lower().startswith("scale:"):
        count = key[len("scale:"):]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"scale:N needs a positive request count N, got {key!r}")
        source = _resolve_source(length_source)
        if num_requests > int(count):
            raise ValueError(f"{key} has only {count} requests, {num_requests} requested")
        rows = scale_rows(load_trace(source), num_requests, seed)  # the first num_requests of the N
        return _rows_workload(
            f"scale:{int(count)}", f"{int(count)} requests drawn from {source}", "scale", rows, num_requests, rate,
            seed, arrival, burstiness_cv, None, max_prompt_tokens, max_output_tokens, max_context, length_scale,
        )
    if key.lower().startswith("real:"):
        if tokenizer is None:
            raise ValueError("real:CLASS workloads need the served model's tokenizer (--tokenizer DIR)")
        return real_class_workload(key, num_requests, rate, seed, tokenizer, heavy_cap=max_output_tokens or 384,
                                   max_prompt_tokens=max_prompt_tokens or 1536, arrival=arrival,
                                   burstiness_cv=burstiness_cv, max_context=max_context,
                                   lengths=real_lengths)
    if key.lower() == "alpaca" or key.lower().startswith("alpaca:"):
        if tokenizer is None:
            raise ValueError("the alpaca workload needs the served model's tokenizer (--tokenizer DIR)")
        return alpaca_workload(key[len("alpaca:"):] or None, num_requests, rate, seed, tokenizer,
                               output_cap=output_cap, arrival=arrival, burstiness_cv=burstiness_cv,
                               max_context=max_context)
    if key.lower().startswith("trace:"):
        return _trace_workload(
            key[len("trace:") :],
            num_requests,
            rate,
            seed,
            arrival,
            burstiness_cv,
            trace_timescale,
            max_prompt_tokens,
            max_output_tokens,
            max_context,
            length_scale,
            trace_repeat,
        )
    key = key.lower()
    if length_scale != 1.0:
        raise ValueError("length_scale applies only to trace:FILE workloads")
    if key not in CLASS_NAMES:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(CLASS_NAMES)} or trace:FILE")
    if trace_timescale is not None:
        raise ValueError("trace_timescale applies only to trace:FILE workloads")
    process = arrival or "poisson"
    if process == "trace":
        raise ValueError(f"workload {key} has no trace timestamps; use arrival 'poisson' or 'gamma'")
    source = _resolve_source(length_source)
    rows = load_trace(source)
    pool = _class_pool(rows, key, max_prompt_tokens, max_output_tokens)
    if len(pool) == 0:
        raise ValueError(
            f"no (prompt, output) pairs in {source} satisfy class {key} with max_prompt_tokens="
            f"{max_prompt_tokens}, max_output_tokens={max_output_tokens} (heavy prefill > "
            f"{HEAVY_PREFILL_TOKENS}, heavy decode > {HEAVY_DECODE_TOKENS} tokens)"
        )
    idx = np.random.default_rng([seed, 1]).integers(0, len(pool), size=num_requests)
    arrivals = make_arrivals(num_requests, process, rate, seed, burstiness_cv)
    requests = [
        WorkloadRequest(f"{key}-{i}", arrivals[i], int(pool[j, 0]), int(pool[j, 1]))
        for i, j in enumerate(idx.tolist())
    ]
    notes = (f"lengths resampled from {len(pool)} of {len(rows)} rows of {source.name}",)
    return Workload(
        key,
        tuple(_mark_rejections(requests, max_context)),
        str(source),
        process if rate is not None else "burst",
        rate,
        seed,
        notes,
    )


def _trace_workload(
    path: str,
    num_requests: int,
    rate: float | None,
    seed: int,
    arrival: str | None,
    burstiness_cv: float,
    trace_timescale: float | None,
    max_prompt: int | None,
    max_output: int | None,
    max_context: int | None,
    length_scale: float = 1.0,
    trace_repeat: int = 1,
) -> Workload:
    if not path:
        raise ValueError("trace workload needs a file: trace:FILE")
    rows = repeat_rows(load_trace(path), trace_repeat)
    if num_requests > len(rows):
        raise ValueError(f"trace {path} has only {len(rows)} requests, {num_requests} requested"
                         + (f" ({trace_repeat} repeats)" if trace_repeat > 1 else ""))
    name = f"trace:{Path(path).name}" + (f"x{trace_repeat}" if trace_repeat > 1 else "")
    return _rows_workload(name, str(Path(path)), "trace", rows, num_requests, rate, seed, arrival, burstiness_cv,
                          trace_timescale, max_prompt, max_output, max_context, length_scale)


def repeat_rows(rows: Sequence[TraceRow], times: int) -> tuple[TraceRow, ...]:
    """``rows`` played ``times`` times back to back: copy ``k`` is shifted by ``k`` x (the trace's span plus its
    mean gap), so arrivals stay ordered and the gap between copies is a typical one."""
    rows = tuple(rows)
    if times == 1 or not rows:
        return rows
    ts = [r.timestamp_s for r in rows]
    span = max(ts) - min(ts)
    period = span + (span / (len(rows) - 1) if len(rows) > 1 else 1.0)
    return tuple(replace(r, timestamp_s=r.timestamp_s + k * period) for k in range(times) for r in rows)


def scale_rows(rows: Sequence[TraceRow], n: int, seed: int) -> tuple[TraceRow, ...]:
    """``n`` synthetic rows: lengths and inter-arrival gaps drawn with replacement from ``rows`` (deterministic
    given ``seed``; hash blocks dropped). Gaps are the sorted timestamps' differences (one 1 s gap for a
    one-row trace)."""
    if not rows:
        raise ValueError("scale:N needs a length source with at least one row")
    ts = sorted(r.timestamp_s for r in rows)
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False)] or [1.0]
    rng = random.Random(seed)
    pick, m, g = rng.randrange, len(rows), len(gaps)
    out: list[TraceRow] = []
    t = 0.0
    for _ in range(n):
        row = rows[pick(m)]
        out.append(TraceRow(t, row.prompt_tokens, row.output_tokens))
        t += gaps[pick(g)]
    return tuple(out)


def _rows_workload(
    name: str,
    source: str,
    id_prefix: str,
    rows: Sequence[TraceRow],
    num_requests: int,
    rate: float | None,
    seed: int,
    arrival: str | None,
    burstiness_cv: float,
    trace_timescale: float | None,
    max_prompt: int | None,
    max_output: int | None,
    max_context: int | None,
    length_scale: float = 1.0,
) -> Workload:
    """The first ``num_requests`` of ``rows`` as a workload (a trace file's, or synthetic ones)."""
    if rate is not None and trace_timescale is not None:
        raise ValueError("give either rate or trace_timescale for a trace, not both")
    rows = rows[:num_requests]
    process = arrival or "trace"
    notes: list[str] = []
    if process == "trace":
        arrivals = trace_arrivals([r.timestamp_s for r in rows], trace_timescale or 1.0)
        if rate is not None:
            arrivals = rescale_to_rate(arrivals, rate)
    else:
        if trace_timescale is not None:
            raise ValueError("trace_timescale needs trace timestamps (arrival 'trace')")
        arrivals = make_arrivals(len(rows), process, rate, seed, burstiness_cv)
        if rate is None:
            process = "burst"
    requests: list[WorkloadRequest] = []
    clipped = 0
    block_tokens = max(1, round(TRACE_HASH_BLOCK_TOKENS * length_scale))
    if length_scale != 1.0:
        notes.append(f"lengths scaled by {length_scale:g} (hash blocks of {block_tokens} tokens)")
    for i, (row, t) in enumerate(zip(rows, arrivals, strict=True)):
        prompt, output = row.prompt_tokens, row.output_tokens
        if length_scale != 1.0:
            prompt, output = max(1, round(prompt * length_scale)), max(1, round(output * length_scale))
        if max_prompt is not None and prompt > max_prompt:
            prompt, clipped = max_prompt, clipped + 1
        if max_output is not None and output > max_output:
            output, clipped = max_output, clipped + 1
        rejected = prompt < 1 or output < 1
        requests.append(
            WorkloadRequest(
                f"{id_prefix}-{i}",
                t,
                max(prompt, 1),
                max(output, 0),
                None,
                rejected,
                f"trace row has {prompt} prompt / {output} output tokens" if rejected else None,
                row.hash_ids,
                block_tokens if row.hash_ids else 0,
            )
        )
    if clipped:
        notes.append(
            f"{clipped} lengths clipped to max_prompt_tokens={max_prompt}/max_output_tokens={max_output}"
        )
    return Workload(
        name,
        tuple(_mark_rejections(requests, max_context)),
        source,
        process,
        rate,
        seed,
        tuple(notes),
    )


def parse_rate_profile(text: str) -> list[tuple[float, float]]:
    """``"2:60,8:90"`` -> [(2.0 req/s, 60.0 s), (8.0, 90.0)]: a rate held for that long, then the next."""
    phases = []
    for part in text.split(","):
        rate, sep, secs = part.partition(":")
        try:
            phases.append((float(rate), float(secs)))
        except ValueError:
            raise ValueError(f"rate profile wants RATE:SECONDS pairs, got {part!r} in {text!r}") from None
        if not sep:
            raise ValueError(f"rate profile wants RATE:SECONDS pairs, got {part!r} in {text!r}")
    if not phases or any(r <= 0 or s <= 0 for r, s in phases):
        raise ValueError(f"rate profile wants positive rates and durations, got {text!r}")
    return phases


def stepped_workload(name: str, phases: list[tuple[float, float]], seed: int = 0, **kw: object) -> Workload:
    """Poisson arrivals of the class workload ``name`` whose rate steps through ``phases`` (``parse_rate_profile``):
    per phase, ``round(rate x seconds)`` draws, those arriving after the phase's end dropped; request ids say
    their phase (``p0-...``). ``kw``: further ``load_workload`` options (length caps, source)."""
    reqs, start = [], 0.0
    for i, (rate, secs) in enumerate(phases):
        part = load_workload(name, max(1, round(rate * secs)), rate, seed + i, **kw)  # type: ignore[arg-type]
        reqs += [replace(r, request_id=f"p{i}-{r.request_id}", arrival_s=r.arrival_s + start)
                 for r in part.requests if r.arrival_s < secs]
        start += secs
    reqs.sort(key=lambda r: r.arrival_s)
    profile = ",".join(f"{r:g}:{s:g}" for r, s in phases)
    return Workload(f"{name}@{profile}", tuple(reqs), "stepped", "poisson", None, seed,
                    notes=(f"rate profile {profile} (req/s:seconds)",))


def with_max_context(workload: Workload, max_context: int | None) -> Workload:
    """The same workload with requests over ``max_context`` (prompt + output) marked rejected."""
    _check_positive_int("max_context", max_context)
    if max_context is None:
        return workload
    requests = tuple(_mark_rejections(list(workload.requests), max_context))
    return Workload(
        workload.name,
        requests,
        workload.source,
        workload.arrival_process,
        workload.rate,
        workload.seed,
        workload.notes,
    )


def workload_summary_line(workload: Workload) -> str:
    """One human line: name, count, arrivals, rate, length medians."""
    d = workload.describe()
    rate = d["observed_rate"]
    rate_text = f" at {rate:.3f} req/s" if rate else ""
    return (
        f"{d['name']}: {d['num_requests']} requests ({d['num_rejected']} rejected), "
        f"{d['arrival_process']} arrivals{rate_text}, prompt median {d['prompt_tokens']['median']:.0f}, "
        f"output median {d['output_tokens']['median']:.0f} tokens"
    )




def alpaca_workload(
    path: str | os.PathLike[str] | None,
    num_requests: int,
    rate: float | None,
    seed: int,
    tokenizer_dir: str,
    *,
    output_cap: int = 1024,
    arrival: str | None = None,
    burstiness_cv: float = 1.0,
    max_context: int | None = None,
) -> Workload:
    """Real prompts: AlpacaEval instructions, each rendered as one user turn through the served model's chat
    template (``tokenizer_dir``), sent as completion text; ``output_tokens`` is ``output_cap`` (meant for
    natural output lengths, where it is only the ``max_tokens`` cap). Instructions are drawn without
    replacement in a seeded order (with replacement only past the file's size)."""

    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    _check_positive_int("output_cap", output_cap)
    source = Path(path) if path else ALPACA_DEFAULT_FILE
    try:
        prompts = [str(row["instruction"]) for row in json.loads(source.read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{source}: expected an AlpacaEval JSON list of objects with 'instruction': {exc}") from exc
    if not prompts:
        raise ValueError(f"no prompts in {source}")
    tok = chat_tokenizer(tokenizer_dir, "the alpaca workload needs")
    rng = np.random.default_rng([seed, 7])
    order = np.concatenate([rng.permutation(len(prompts)) for _ in range(math.ceil(num_requests / len(prompts)))])
    process = arrival or "poisson"
    if process == "trace":
        raise ValueError("the alpaca workload has no timestamps; use arrival 'poisson' or 'gamma'")
    arrivals = make_arrivals(num_requests, process, rate, seed, burstiness_cv)
    requests = []
    for i in range(num_requests):
        text, n = render_user_turn(tok, prompts[int(order[i])])
        requests.append(WorkloadRequest(f"alpaca-{i}", arrivals[i], n, output_cap, prompt_text=text))
    notes = (f"{num_requests} AlpacaEval instructions of {len(prompts)} in {source.name}, chat-rendered; "
             f"output lengths natural, capped at {output_cap}",)
    return Workload("alpaca", tuple(_mark_rejections(requests, max_context)), str(source),
                    process if rate is not None else "burst", rate, seed, notes)
