"""IncrementalDetokenizer: streamed text == final text == full decode, UTF-8 splits, stop strings."""

from __future__ import annotations

from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from tetriinfer.server.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    path = str(resources.files("tetriinfer").joinpath("data", "tokenizer.json"))
    return PreTrainedTokenizerFast(
        tokenizer_file=path, bos_token="<|bos|>", eos_token="<|eos|>", clean_up_tokenization_spaces=False
    )


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = [detok.add_tokens(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.finish())
    return deltas


TEXTS = [
    "Hello, world! This is a test.",
    "naïve café — déjà vu",
    "日本語のテキストと emoji 😀🎉 mixed",
    "  leading spaces and\nnew lines\n\n",
    "ü",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_streamed_equals_full_decode(tok: PreTrainedTokenizerFast, text: str, step: int) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids, step)
    assert "".join(deltas) == detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.num_tokens == len(ids) and not detok.stopped


def test_multibyte_character_split_across_tokens_waits_for_completion(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) >= 2, "the emoji must be split over several byte tokens for this test to mean anything"
    assert tok.decode(ids[:1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    partial = [detok.add_tokens([t]) for t in ids[:-1]]
    assert partial == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == "😀"


def test_incomplete_character_is_flushed_at_finish_like_a_full_decode(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("ab😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1].endswith("\ufffd")


def test_special_tokens_are_skipped_or_kept(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("hi there", add_special_tokens=False) + [tok.eos_token_id]
    skip = IncrementalDetokenizer(tok)
    assert "".join(stream(skip, ids)) == "hi there"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(keep, ids)) == "hi there<|eos|>"


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tok: PreTrainedTokenizerFast) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "fox ju"
    # Find the token that completes the stop string, and make sure it spans more than one token.
    ends = [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]
    pos = text.index(stop)
    completing = next(i for i, e in enumerate(ends) if e >= pos + len(stop))
    starting = next(i for i, e in enumerate(ends) if e > pos)
    assert completing > starting, "stop string should span token boundaries"
    detok = IncrementalDetokenizer(tok, stop=[stop])
    deltas = stream(detok, ids)
    assert detok.stopped and detok.stop_reason == stop
    assert "".join(deltas) == detok.text == text[:pos] == "The quick brown "
    assert detok.num_tokens == completing + 1
    # Nothing after the cut was ever emitted, and nothing after stopping.
    assert all(stop not in d for d in deltas)


def test_stop_string_include_in_output(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("alpha beta gamma", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["beta"], include_stop_str_in_output=True)
    assert "".join(stream(detok, ids)) == "alpha beta"


def test_stop_strings_ignored_before_min_tokens(tok: PreTrainedTokenizerFast) -> None:
    text = "x stop y stop z"
    ids = tok.encode(text, add_special_tokens=False)
    first_end = next(i for i in range(len(ids)) if "stop" in tok.decode(ids[: i + 1]))
    detok = IncrementalDetokenizer(tok, stop=["stop"], min_tokens=first_end + 2)
    out = "".join(stream(detok, ids))
    assert detok.stopped
    assert out == "x stop y "


def test_earliest_of_several_stop_strings_wins(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, stop=["four", "two"])
    assert "".join(stream(detok, ids, step=len(ids))) == "one "
    assert detok.stop_reason == "two"


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(object(), stop=[""])
    with pytest.raises(ValueError, match="min_tokens"):
        IncrementalDetokenizer(object(), min_tokens=-1)


ALPHABET = "ab xyz.,é日😀\n"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    stop_span=st.tuples(st.integers(0, 39), st.integers(1, 6)),
    step=st.integers(1, 4),
    use_stop=st.booleans(),
)
def test_streamed_text_equals_final_text_property(
    tok: PreTrainedTokenizerFast, text: str, stop_span: tuple[int, int], step: int, use_stop: bool
) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    full = tok.decode(ids)
    start, length = stop_span
    stop = full[start : start + length] if use_stop else ""
    detok = IncrementalDetokenizer(tok, stop=[stop] if stop else [])
    streamed = "".join(stream(detok, ids, step))
    assert streamed == detok.text
    if stop:
        assert detok.stopped
        assert streamed == full[: full.find(stop)]
    else:
        assert streamed == full


def test_fast_decoder_uses_the_rust_backend_only_where_decode_would_do_nothing_more(tok: PreTrainedTokenizerFast) -> None:
    """The direct backend path is taken for a fast tokenizer without space clean-up and gives decode's text; a
    tokenizer that cleans up spaces, or one without a backend, goes through its own decode."""
    from tetriinfer.server.detokenizer import fast_decoder

    calls: list[list[int]] = []

    class Spy:
        def __init__(self, inner: PreTrainedTokenizerFast, clean_up: bool) -> None:
            self.inner, self._tokenizer, self.clean_up_tokenization_spaces = inner, inner._tokenizer, clean_up

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            calls.append(list(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("<|bos|>" + TEXTS[2] + " and , spaces .")
    for skip in (True, False):
        want = tok.decode(ids, skip_special_tokens=skip)
        assert fast_decoder(Spy(tok, clean_up=False), skip)(ids) == want and calls == []
        assert fast_decoder(Spy(tok, clean_up=True), skip)(ids) == want and calls == [ids]
        calls.clear()
    bare = type("Bare", (), {"decode": lambda self, ids, skip_special_tokens=True: "x" * len(ids)})()
    assert fast_decoder(bare, True)([1, 2, 3]) == "xxx"
