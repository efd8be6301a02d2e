"""Request recovery after an instance dies: what a live instance is sent to continue a request's stream.

A request that an instance held when it died is sent again, under a new engine id, as a continuation: its prompt
is the original prompt followed by every token already streamed to the client, and its budget is what is left
(``max_tokens`` and ``min_tokens`` minus the tokens streamed). A live instance prefills that and samples the next
token, so the client's stream goes on with no duplicate and no missing token; with greedy sampling the output is
the one an undisturbed run gives (same model, same prefix). A seeded sampler's state is not carried over: seeded
random sampling continues with a re-seeded generator.

Engine ids: attempt 0 keeps the client's request id (what every instance knows it by); attempt ``k`` is
``"{request_id}~r{k}"``. Messages about an older attempt no longer match the stream and are dropped, and an
``Abort`` for the older id frees what survivors still hold of it.
"""

from __future__ import annotations

from tetriinfer.runtime.messages import NewRequest, WireParams


def engine_id(request_id: str, attempt: int) -> str:
    """The id instances know attempt ``attempt`` of ``request_id`` by."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    return request_id if attempt == 0 else f"{request_id}~r{attempt}"


def continuation(original: NewRequest, attempt: int, streamed: list[int]) -> NewRequest:
    """The request that continues ``original`` after ``streamed`` output tokens reached the client.

    Raises ValueError when nothing is left to generate (the stream should have finished)."""
    p = original.params
    left = p.max_tokens - len(streamed)
    if left < 1:
        raise ValueError(f"request {original.request_id!r} has no output budget left ({len(streamed)} streamed)")
    params = WireParams(
        max_tokens=left, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
        min_tokens=max(0, p.min_tokens - len(streamed)), ignore_eos=p.ignore_eos,
        stop_token_ids=list(p.stop_token_ids), logprobs=p.logprobs,
    )
    oracle = original.oracle_output_tokens
    return NewRequest(
        request_id=engine_id(original.request_id, attempt),
        prompt_token_ids=[*original.prompt_token_ids, *streamed],
        params=params, arrival_time=original.arrival_time, eos_token_id=original.eos_token_id,
        oracle_output_tokens=None if oracle is None else max(1, oracle - len(streamed)),
    )
