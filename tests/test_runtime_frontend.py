"""The front end's bookkeeping without processes: a request handed to an instance that already died ends at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tetriinfer.core.membership import MemberState
from tetriinfer.runtime.cluster import ClusterEngineClient, InstanceInfo, _Stream
from tetriinfer.runtime.cluster_config import ClusterConfig


class _Proc:
    def poll(self) -> int | None:
        return None


def test_a_handover_to_a_dead_or_forgotten_instance_ends_the_request_at_once(tiny_llama: Path) -> None:
    async def run() -> None:
        client = ClusterEngineClient(ClusterConfig(model=str(tiny_llama)))
        live = InstanceInfo("decode-0", "decode", _Proc())  # type: ignore[arg-type]
        live.member.to(MemberState.SERVING, 0.0)
        dead = InstanceInfo("decode-1", "decode", _Proc())  # type: ignore[arg-type]
        dead.member.to(MemberState.DEAD, 0.0)
        client.instances = {"decode-0": live, "decode-1": dead}
        streams = {rid: _Stream(rid, 5) for rid in ("to-live", "to-dead", "to-forgotten")}
        client.streams = dict(streams)
        client._fail_if_gone(streams["to-live"], "decode-0")
        client._fail_if_gone(streams["to-dead"], "decode-1")
        client._fail_if_gone(streams["to-forgotten"], "decode-9")  # died and left the table (--replace-dead)
        assert not streams["to-live"].finished and streams["to-live"].queue.empty()
        for rid, iid in (("to-dead", "decode-1"), ("to-forgotten", "decode-9")):
            ev = streams[rid].queue.get_nowait()
            assert streams[rid].finished and ev.finished and ev.finish_reason == "error" and iid in (ev.error or "")
            assert streams[rid].queue.empty()
        client._fail_if_gone(streams["to-dead"], "decode-1")  # exactly one terminal event, however often told
        assert streams["to-dead"].queue.empty()
        await asyncio.gather(*client._tasks)  # the abort broadcast finds no connected instance and returns

    asyncio.run(run())
