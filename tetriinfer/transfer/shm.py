"""Shared-memory backend for processes on one host: control headers over zmq ipc, payload bytes through pooled
/dev/shm segments (sender copies in, receiver copies out; segments return to the sender's pool on Consumed)."""

from __future__ import annotations

import os
import tempfile

from tetriinfer.transfer.agent import ZmqAgent, unique_name
from tetriinfer.transfer.base import AgentConfig


class ShmBackend(ZmqAgent):
    kind = "shm"

    def __init__(self, *, config: AgentConfig | None = None, socket_dir: str | None = None,
                 pool_bytes: int = 256 << 20) -> None:
        directory = socket_dir or tempfile.gettempdir()
        if not os.path.isdir(directory):
            raise ValueError(f"socket_dir {directory!r} is not a directory")
        self._sock_path = os.path.join(directory, unique_name("tetrixfer") + ".sock")
        super().__init__(f"ipc://{self._sock_path}", config=config, use_shm=True, shm_pool_bytes=pool_bytes)

    def shutdown(self) -> None:
        super().shutdown()
        try:
            os.unlink(self._sock_path)
        except FileNotFoundError:
            pass
