"""The front end's bookkeeping without processes: a request handed to an instance that already died is recovered at
once, and ends with an error only when no live instance can take it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tetriinfer.core.membership import MemberState
from tetriinfer.runtime.cluster import ClusterEngineClient, InstanceInfo, _Stream
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.runtime.messages import NewRequest, WireParams


class _Proc:
    def poll(self) -> int | None:
        return None


def test_a_handover_to_a_dead_or_forgotten_instance_is_recovered_or_ends_at_once(tiny_llama: Path) -> None:
    async def run() -> None:
        client = ClusterEngineClient(ClusterConfig(model=str(tiny_llama)))
        live = InstanceInfo("decode-0", "decode", _Proc())  # type: ignore[arg-type]
        live.member.to(MemberState.SERVING, 0.0)
        dead = InstanceInfo("decode-1", "decode", _Proc())  # type: ignore[arg-type]
        dead.member.to(MemberState.DEAD, 0.0)
        client.instances = {"decode-0": live, "decode-1": dead}
        streams = {rid: _Stream(rid, 5) for rid in ("to-live", "to-dead", "to-forgotten")}
        params = WireParams(8, 0.0, 1.0, -1, None, 0, True, [], None)
        for rid, stream in streams.items():
            client.policy.add(rid, 0.0, 5)
            stream.original = stream.new_request = NewRequest(rid, [1, 2, 3, 4, 5], params, 0.0)
            stream.streamed = [7, 8]
            stream.next_index = 2
            client._by_engine_id[rid] = stream
        client.streams = dict(streams)
        client._started = True
        client._recover_if_gone(streams["to-live"], "decode-0")
        client._recover_if_gone(streams["to-dead"], "decode-1")
        client._recover_if_gone(streams["to-forgotten"], "decode-9")  # died and left the table (--replace-dead)
        assert not streams["to-live"].finished and streams["to-live"].queue.empty()
        for rid in ("to-dead", "to-forgotten"):  # sent again as a continuation of what was streamed
            s = streams[rid]
            assert s.attempt == 1 and s.engine_id == f"{rid}~r1" and s.offset == 2
            assert s.new_request.prompt_token_ids == [1, 2, 3, 4, 5, 7, 8] and s.new_request.params.max_tokens == 6
        client._recover_if_gone(streams["to-dead"], "decode-1")  # already recovering: told again, nothing changes
        assert streams["to-dead"].attempt == 1
        await asyncio.gather(*client._tasks)  # no live instance can prefill: each ends with one error event
        for rid, iid in (("to-dead", "decode-1"), ("to-forgotten", "decode-9")):
            ev = streams[rid].queue.get_nowait()
            assert streams[rid].finished and ev.finished and ev.finish_reason == "error" and iid in (ev.error or "")
            assert "no live instance can prefill" in (ev.error or "") and streams[rid].queue.empty()
        assert client.num_recovered == 2

    asyncio.run(run())
