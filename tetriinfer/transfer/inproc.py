"""In-process backend: agents in one process exchange zero-copy zmq inproc frames; the receiver does the only
memcpy (sender buffer -> posted buffer)."""

from __future__ import annotations

from tetriinfer.transfer.agent import ZmqAgent, unique_name
from tetriinfer.transfer.base import AgentConfig


class InprocBackend(ZmqAgent):
    kind = "inproc"

    def __init__(self, *, config: AgentConfig | None = None, name: str | None = None) -> None:
        super().__init__(f"inproc://{name or unique_name('tetrixfer')}", config=config)
