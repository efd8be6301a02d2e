"""RequestTable: unique ids, every request leaves exactly once, finished ids drained exactly once; and the
four schedulers that hold one keep their ``requests`` / ``abort`` / ``finish`` behaviour."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tetriinfer.core.colocated_scheduler import (
    ColocatedSchedulerConfig,
    SarathiScheduler,
    VLLMScheduler,
    make_colocated_scheduler,
)
from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.kv_cache_manager import KVCacheManager
from tetriinfer.core.local_scheduler import LocalScheduler, LocalSchedulerConfig
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.request import Request, RequestStatus
from tetriinfer.core.request_table import RequestTable
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.step import StepResult

BS = 4


def make_req(rid: str, n_prompt: int = 5, max_tokens: int = 8) -> Request:
    return Request(rid, [3] * n_prompt, SamplingParams(max_tokens=max_tokens))


class Harness:
    """A table over a real block manager, with a ``forget`` hook that records what it saw."""

    def __init__(self, blocks: int = 32) -> None:
        self.kv = KVCacheManager(blocks, BS)
        self.forgotten: list[tuple[str, RequestStatus, bool, int]] = []  # id, status, still held, blocks
        self.table = RequestTable(self.kv, forget=self._forget)

    def _forget(self, req: Request) -> None:
        rid = req.request_id
        self.forgotten.append((rid, req.status, rid in self.table, self.kv.num_blocks_of(rid)))

    def add(self, rid: str, n_tokens: int = 5) -> Request:
        req = make_req(rid, n_tokens)
        self.table.add(req)
        assert self.kv.allocate_slots(rid, n_tokens)
        return req


def test_add_get_contains_len_values_iter() -> None:
    h = Harness()
    a, b = h.add("a"), h.add("b")
    t = h.table
    assert len(t) == 2 and bool(t)
    assert "a" in t and "zz" not in t
    assert t.get("a") is a and t["b"] is b and t.get("zz") is None
    assert list(t) == ["a", "b"] and list(t.values()) == [a, b]
    with pytest.raises(KeyError):
        t["zz"]
    assert not RequestTable(h.kv, forget=h._forget)  # empty table is falsy


def test_duplicate_add_raises_the_schedulers_message_and_keeps_the_first() -> None:
    h = Harness()
    a = h.add("a")
    with pytest.raises(ValueError, match=r"^duplicate request id 'a'$"):
        h.table.add(make_req("a"))
    with pytest.raises(ValueError, match=r"^duplicate request id 'a'$"):
        h.table.require_new("a")
    h.table.require_new("b")  # a new id passes
    assert h.table["a"] is a and len(h.table) == 1


def test_mark_finished_sets_status_frees_forgets_deletes_and_records_once() -> None:
    h = Harness(blocks=8)
    a = h.add("a", n_tokens=9)  # 3 blocks
    assert h.kv.num_free_blocks == 5
    h.table.mark_finished(a, RequestStatus.FINISHED_STOPPED)
    assert a.status is RequestStatus.FINISHED_STOPPED
    assert h.kv.num_free_blocks == 8 and not h.kv.has("a")
    # The hook ran once, after the status was set and the blocks were freed, while "a" was still held.
    assert h.forgotten == [("a", RequestStatus.FINISHED_STOPPED, True, 0)]
    assert "a" not in h.table and len(h.table) == 0
    assert h.table.drain_finished() == ("a",)
    assert h.table.drain_finished() == ()  # drain clears


def test_finish_returns_request_once_then_none() -> None:
    h = Harness()
    a = h.add("a")
    assert h.table.finish("a", RequestStatus.FINISHED_ABORTED) is a
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert h.table.finish("a", RequestStatus.FINISHED_ABORTED) is None  # already gone
    assert h.table.finish("a", RequestStatus.FINISHED_LENGTH) is None
    assert a.status is RequestStatus.FINISHED_ABORTED  # the first ending stands
    assert len(h.forgotten) == 1
    assert h.table.drain_finished() == ("a",)


def test_finish_of_unknown_id_returns_none_and_changes_nothing() -> None:
    h = Harness()
    h.add("a")
    free = h.kv.num_free_blocks
    assert h.table.finish("nope", RequestStatus.FINISHED_ABORTED) is None
    assert h.forgotten == [] and len(h.table) == 1 and h.kv.num_free_blocks == free
    assert h.table.drain_finished() == ()


def test_finish_of_a_held_request_already_in_a_terminal_status_is_refused() -> None:
    h = Harness()
    req = make_req("a")
    req.status = RequestStatus.FINISHED_STOPPED
    h.table.add(req)  # schedulers that do not validate the status can hold one
    assert h.table.unfinished("a") is None
    assert h.table.finish("a", RequestStatus.FINISHED_ABORTED) is None
    assert "a" in h.table and req.status is RequestStatus.FINISHED_STOPPED and h.forgotten == []


def test_remove_leaves_without_status_change_freeing_or_recording() -> None:
    h = Harness()
    a = h.add("a", n_tokens=8)
    a.status = RequestStatus.RUNNING
    assert h.table.remove("a") is a
    assert a.status is RequestStatus.RUNNING
    assert h.kv.num_blocks_of("a") == 2  # the owner frees (or hands over) the blocks itself
    assert "a" not in h.table and h.forgotten == []
    assert h.table.drain_finished() == ()
    with pytest.raises(KeyError):
        h.table.remove("a")
    h.table.add(make_req("a"))  # the id may come back (re-prefill after a failed transfer)
    assert "a" in h.table


def test_mark_finished_rejects_misuse_without_changing_anything() -> None:
    h = Harness()
    a = h.add("a")
    with pytest.raises(ValueError, match="terminal"):
        h.table.mark_finished(a, RequestStatus.RUNNING)
    stranger = make_req("b")
    with pytest.raises(KeyError):
        h.table.mark_finished(stranger, RequestStatus.FINISHED_ABORTED)
    impostor = make_req("a")  # same id, not the held object
    with pytest.raises(KeyError):
        h.table.mark_finished(impostor, RequestStatus.FINISHED_ABORTED)
    assert a.status is RequestStatus.WAITING and stranger.status is RequestStatus.WAITING
    assert impostor.status is RequestStatus.WAITING
    assert h.table["a"] is a and h.kv.has("a") and h.forgotten == []
    assert h.table.drain_finished() == ()


def test_drain_returns_ids_in_finishing_order() -> None:
    h = Harness()
    for rid in "abcd":
        h.add(rid)
    h.table.finish("c", RequestStatus.FINISHED_STOPPED)
    h.table.mark_finished(h.table["a"], RequestStatus.FINISHED_LENGTH)
    assert h.table.drain_finished() == ("c", "a")
    h.table.finish("d", RequestStatus.FINISHED_ABORTED)
    assert h.table.drain_finished() == ("d",)
    assert list(h.table) == ["b"]


def test_view_is_read_only_and_live() -> None:
    h = Harness()
    a = h.add("a")
    view = h.table.view
    assert view.get("a") is a and "a" in view and len(view) == 1 and list(view.values()) == [a]
    with pytest.raises(TypeError):
        view["b"] = make_req("b")  # type: ignore[index]
    with pytest.raises(TypeError):
        del view["a"]  # type: ignore[attr-defined]
    b = h.add("b")
    assert view["b"] is b
    h.table.finish("a", RequestStatus.FINISHED_ABORTED)
    assert "a" not in view and len(view) == 1


_OPS = st.lists(
    st.tuples(st.sampled_from(["add", "finish", "abort", "remove", "drain"]), st.integers(0, 5)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_OPS)
def test_property_every_request_added_leaves_exactly_once(ops: list[tuple[str, int]]) -> None:
    h = Harness(blocks=64)
    added: list[str] = []  # one entry per add
    drained: list[str] = []
    removed: list[str] = []
    blocks_before = h.kv.num_free_blocks
    for op, i in ops:
        rid = f"r{i}"
        held = rid in h.table
        if op == "add":
            if held:
                with pytest.raises(ValueError):
                    h.table.add(make_req(rid))
            else:
                h.add(rid, n_tokens=1 + i)
                added.append(rid)
        elif op in ("finish", "abort"):
            status = RequestStatus.FINISHED_STOPPED if op == "finish" else RequestStatus.FINISHED_ABORTED
            got = h.table.finish(rid, status)
            assert (got is not None) == held
            assert not h.kv.has(rid)
        elif op == "remove":
            if held:
                h.table.remove(rid)
                h.kv.free_request(rid)  # as PrefillScheduler.release / DecodeScheduler.transfer_failed do
                removed.append(rid)
            else:
                with pytest.raises(KeyError):
                    h.table.remove(rid)
        else:
            drained.extend(h.table.drain_finished())
        assert set(h.table) == set(h.kv.request_ids())
    drained.extend(h.table.drain_finished())
    # Every add is matched by exactly one leaving: drained (finished) or removed, or still held.
    for rid in set(added):
        assert added.count(rid) == drained.count(rid) + removed.count(rid) + (rid in h.table)
    assert sorted(f[0] for f in h.forgotten) == sorted(drained)  # the hook ran once per finish
    assert h.kv.num_free_blocks == blocks_before - sum(h.kv.num_blocks_of(r) for r in h.table)


# ---- the schedulers that hold a table ---------------------------------------------------------------


def _local() -> LocalScheduler:
    return LocalScheduler(LocalSchedulerConfig(chunk_size=16, max_model_len=256), KVCacheManager(64, BS))


def _prefill() -> PrefillScheduler:
    return PrefillScheduler(PrefillSchedulerConfig(chunk_size=16, max_model_len=256), KVCacheManager(64, BS))


def _colocated(kind: str) -> Callable[[], VLLMScheduler | SarathiScheduler]:
    cfg = ColocatedSchedulerConfig(max_model_len=256)
    return lambda: make_colocated_scheduler(kind, cfg, KVCacheManager(64, BS))


QUEUEING: dict[str, Callable[[], LocalScheduler | PrefillScheduler | VLLMScheduler | SarathiScheduler]] = {
    "local": _local, "prefill": _prefill, "vllm": _colocated("vllm"), "sarathi": _colocated("sarathi"),
}


@pytest.mark.parametrize("kind", sorted(QUEUEING))
def test_scheduler_requests_abort_finish_and_finished_ids(kind: str) -> None:
    sched = QUEUEING[kind]()
    a, b, c = make_req("a"), make_req("b"), make_req("c")
    for r in (a, b, c):
        sched.add_request(r)
    with pytest.raises(ValueError, match=r"^duplicate request id 'a'$"):
        sched.add_request(make_req("a", n_prompt=10_000))  # the duplicate is reported before the length
    reqs = sched.requests
    assert len(reqs) == 3 and reqs["a"] is a and reqs.get("zz") is None and list(reqs.values()) == [a, b, c]
    with pytest.raises(TypeError):
        reqs["d"] = make_req("d")  # read-only to callers
    out = sched.schedule()  # a prefill chunk that allocates blocks for the queued requests
    assert out.segments
    assert sched.abort("zz") is None
    assert sched.abort("a") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("a") is None
    sched.finish("b", RequestStatus.FINISHED_STOPPED)
    sched.finish("b", RequestStatus.FINISHED_LENGTH)  # no effect: already finished
    assert b.status is RequestStatus.FINISHED_STOPPED
    assert "a" not in reqs and "b" not in reqs and len(reqs) == 1  # the mapping is live
    assert not sched.kv.has("a") and not sched.kv.has("b")
    sched.update(out, StepResult(out.step_id, {s.request_id: 7 for s in out.segments if s.sample}))
    assert sched.schedule().finished_request_ids == ("a", "b")
    assert sched.schedule().finished_request_ids == ()
    if hasattr(sched, "check_invariants"):  # LocalScheduler has none
        sched.check_invariants()


def test_prefill_release_is_not_reported_as_finished() -> None:
    sched = _prefill()
    sched.add_request(make_req("a", n_prompt=6))
    out = sched.schedule()
    upd = sched.update(out, StepResult(out.step_id, {s.request_id: 7 for s in out.segments if s.sample}))
    assert [r.request_id for r in upd.prefilled] == ["a"]
    assert sched.release("a") == 2 and "a" not in sched.requests and not sched.kv.has("a")
    assert sched.abort("a") is None
    assert sched.schedule().finished_request_ids == ()
    sched.check_invariants()


def test_decode_transfer_failed_is_not_reported_and_abort_is() -> None:
    sched = DecodeScheduler(DecodeSchedulerConfig(max_model_len=256), KVCacheManager(64, BS))

    def prefilled(rid: str) -> Request:
        req = make_req(rid)
        req.output_token_ids.append(9)
        req.num_computed_tokens = req.num_prompt_tokens
        return req

    a, b = prefilled("a"), prefilled("b")
    assert sched.reserve(a) and sched.reserve(b)
    with pytest.raises(ValueError, match=r"^duplicate request id 'a'$"):
        sched.reserve(prefilled("a"))
    assert sched.transfer_failed("a") is a and "a" not in sched.requests and not sched.kv.has("a")
    assert a.status is RequestStatus.WAITING  # handed back unfinished
    assert sched.abort("b") is b and not sched.kv.has("b") and not sched.reserved
    assert sched.schedule().finished_request_ids == ("b",)
    assert not sched.has_unfinished()
    sched.check_invariants()
