"""Incremental detokenization for streaming, with stop strings that may span token boundaries.

``IncrementalDetokenizer`` turns a growing list of output token ids into text deltas.

Invariants:
- The concatenation of every delta returned by ``add_tokens`` and ``finish`` equals ``text`` at all
  times: what was streamed is exactly the final text (nothing is ever retracted).
- Without a stop string, after ``finish`` ``text == tokenizer.decode(token_ids, skip_special_tokens=...)``
  for tokenizers whose decode is prefix-stable on character boundaries (byte-level BPE, SentencePiece
  with a Metaspace decoder); each token is decoded against a small window of the tokens before it, so
  a token's leading space is kept and the cost per token does not grow with the output length.
- A delta never ends in a partial UTF-8 character: while the newest bytes decode to U+FFFD we wait for
  the next token (``finish`` flushes whatever is left, as a full decode would show it).
- Stop strings (vLLM semantics): checked only once ``min_tokens`` output tokens exist, against the text
  added since the previous check plus ``len(stop) - 1`` characters before it, so a stop string split
  across tokens is found. The text is cut before the earliest match (or after it when
  ``include_stop_str_in_output``). The last ``max(len(stop)) - 1`` characters are held back until they
  can no longer start a match, so no prefix of a stop string is ever streamed and then cut.
- After a stop string matches, ``stopped`` is true, ``stop_reason`` is the matching string, and further
  tokens are ignored; ``num_tokens`` counts the tokens consumed up to and including the one that
  completed the match (vLLM's ``completion_tokens``).

Speed: each token costs two decodes of a few ids. For a ``transformers`` fast tokenizer that does not clean up
tokenization spaces, those go straight to its Rust ``tokenizers.Tokenizer`` (what its ``decode`` calls after
Python-side argument handling), about 4x cheaper per call; every other tokenizer goes through ``decode``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


def fast_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` equal to ``tokenizer.decode(ids, skip_special_tokens=...)``: the Rust backend's decode when
    that is all ``decode`` would do (a fast tokenizer, no clean-up of tokenization spaces), else ``decode``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        *,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self._decode_ids = fast_decoder(tokenizer, skip_special_tokens)
        self._stop = tuple(stop)
        self._min_tokens = min_tokens
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this are already in ``_decoded``
        self._decoded = ""  # all text decoded so far (before any stop cut)
        self._emitted = 0  # characters of ``_decoded`` already returned as deltas
        self._checked = 0  # ``_decoded`` length at the previous stop-string check
        self.stopped = False
        self.stop_reason: str | None = None
        self._finished = False

    # ---- public --------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """Everything returned as deltas so far (the final text once ``finish`` was called)."""
        return self._decoded[: self._emitted]

    @property
    def num_tokens(self) -> int:
        """Output tokens consumed (after a stop string: up to the one completing it)."""
        return len(self.token_ids)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Feed new output tokens; return the text that may be streamed now (possibly empty)."""
        if self._finished:
            raise RuntimeError("add_tokens() after finish()")
        start = self._emitted
        for tid in token_ids:
            if self.stopped:
                break
            self.token_ids.append(int(tid))
            piece = self._decode_newest(flush=False)
            if piece:
                self._decoded += piece
                self._check_stop()
        if not self.stopped:
            self._emitted = max(self._emitted, len(self._decoded) - self._holdback)
        return self._decoded[start : self._emitted]

    def finish(self) -> str:
        """No more tokens will come: flush held-back text and any incomplete character."""
        if self._finished:
            return ""
        self._finished = True
        start = self._emitted
        if not self.stopped:
            piece = self._decode_newest(flush=True)
            if piece:
                self._decoded += piece
                self._check_stop()
            if not self.stopped:
                self._emitted = len(self._decoded)
        return self._decoded[start : self._emitted]

    # ---- internals -----------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids)

    def _decode_newest(self, *, flush: bool) -> str:
        """Text contributed by the tokens after ``_read_offset``; '' while a character is incomplete."""
        if self._read_offset >= len(self.token_ids):
            return ""
        window = self.token_ids[self._prefix_offset :]
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text):
            # Only special (skipped) tokens, or bytes of a character not yet complete.
            if flush:
                self._read_offset = len(self.token_ids)
            return ""
        if new_text.endswith(_REPLACEMENT) and not flush:
            return ""
        piece = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return piece

    def _check_stop(self) -> None:
        if not self._stop or len(self.token_ids) < self._min_tokens:
            self._checked = len(self._decoded)
            return
        best: tuple[int, str] | None = None
        for s in self._stop:
            pos = self._decoded.find(s, max(0, self._checked - len(s) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        self._checked = len(self._decoded)
        if best is None:
            return
        pos, s = best
        end = pos + len(s) if self._include_stop else pos
        # Held-back text guarantees end >= _emitted (see the module invariants).
        self._decoded = self._decoded[:end]
        self._emitted = max(self._emitted, end)
        self.stopped = True
        self.stop_reason = s
