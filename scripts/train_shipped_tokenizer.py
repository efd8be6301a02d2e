"""Train the byte-level BPE tokenizer shipped as ``tetriinfer/data/tokenizer.json``.

One-off and reproducible: the corpus is every distinct instruction and response text in
``shared/data/alpaca_eval/*.json`` (files read in sorted order, texts deduplicated in first-seen
order), and the ``tokenizers`` BPE trainer is deterministic for a fixed corpus, so running this
twice writes byte-identical files. ``make-model`` only copies the result; it never trains.

Invariants of the result:
- vocabulary size is exactly ``VOCAB_SIZE`` (8192), special tokens included;
- the special tokens have the fixed ids 0..4 in ``SPECIAL_TOKENS`` order;
- all 256 byte symbols are in the vocabulary, so any text encodes without an unknown token and
  ``decode(encode(text), skip_special_tokens=True) == text`` (no normalizer, no prefix space);
- encoding prepends ``<|bos|>`` (like Llama 3), the chat template therefore starts with ``bos_token``
  and is tokenized with ``add_special_tokens=False``.

Usage::

    python scripts/train_shipped_tokenizer.py [--data ../shared/data/alpaca_eval] [--out tetriinfer/data/tokenizer.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Pre-tokenization split (the Qwen2 / cl100k family pattern: contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newlines, spaces). It must equal the pattern that
# transformers' Qwen2Tokenizer hard-codes: transformers 5 rebuilds the pre-tokenizer of any qwen2
# folder with it, and using the same split everywhere makes llama, opt and qwen2 folders tokenize alike.
SPLIT_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "alpaca_eval"
DEFAULT_OUT = REPO_ROOT / "tetriinfer" / "data" / "tokenizer.json"


def load_corpus(data_dir: Path) -> list[str]:
    """Distinct non-empty instruction/response texts, in a deterministic order."""
    files = sorted(data_dir.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no *.json files in {data_dir}")
    seen: set[str] = set()
    texts: list[str] = []
    for path in files:
        rows = json.loads(path.read_text(encoding="utf-8"))
        for row in rows:
            for key in ("instruction", "output"):
                text = row.get(key)
                if isinstance(text, str) and text.strip() and text not in seen:
                    seen.add(text)
                    texts.append(text)
    return texts


def build_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # No normalizer: decoding gives back the exact input bytes. (transformers 5 adds NFC for qwen2
    # folders, so there the round trip is exact for NFC text, i.e. nearly all text.)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )

    def batches() -> Iterator[list[str]]:
        for start in range(0, len(texts), 256):
            yield texts[start : start + 256]

    tokenizer.train_from_iterator(batches(), trainer=trainer, length=len(texts))
    bos = SPECIAL_TOKENS[0]
    bos_id = tokenizer.token_to_id(bos)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            ),
        ]
    )
    return tokenizer


def check(tokenizer: Tokenizer) -> None:
    """Raise if the trained tokenizer breaks one of the module's invariants."""
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise ValueError(f"vocab size {tokenizer.get_vocab_size(with_added_tokens=True)} != {VOCAB_SIZE}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise ValueError(
                f"special token {token} has id {tokenizer.token_to_id(token)}, want {expected_id}"
            )
    for sample in (
        "Hello, world!",
        "  two  spaces\n\ttab",
        "naïve café — 東京 🚀",
        "cafe\u0301",
        "12345",
        "",
    ):
        ids = tokenizer.encode(sample).ids
        if ids[:1] != [0]:
            raise ValueError("encoding does not start with <|bos|>")
        if tokenizer.decode(ids, skip_special_tokens=True) != sample:
            raise ValueError(f"round trip failed for {sample!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of alpaca_eval *.json files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write tokenizer.json")
    args = parser.parse_args(argv)

    texts = load_corpus(args.data)
    print(f"corpus: {len(texts)} distinct texts, {sum(len(t) for t in texts):,} characters", file=sys.stderr)
    tokenizer = build_tokenizer(texts)
    check(tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Compact JSON keeps the shipped file small; sorted keys are not needed (the trainer is deterministic).
    tokenizer.save(str(args.out), pretty=False)
    data = args.out.read_bytes()
    sample = texts[0]
    ratio = len(sample.encode("utf-8")) / max(1, len(tokenizer.encode(sample).ids) - 1)
    print(f"wrote {args.out} ({len(data):,} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]})")
    print(f"vocab {tokenizer.get_vocab_size()}, {ratio:.2f} bytes/token on the first corpus text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
