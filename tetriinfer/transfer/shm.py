"""Shared-memory backend for processes on one host: control headers over zmq ipc, payload bytes in /dev/shm.

Fast path (one memcpy): receive into buffers from `alloc()` / `alloc_like()` -- they live in this backend's
pooled shared-memory arena, `recv()` advertises where, and the sender copies straight into them. Symmetrically, a
sender whose buffers come from its own `alloc()` lets the receiver copy straight out of them.
Fallback (two memcpys): ordinary buffers go through pooled staging segments (sender copies in, receiver copies
out; segments return to the sender's pool on Consumed).

Runtime usage (decode side): `staging = backend.alloc_like([shape] * (2 * num_layers), dtype)`, then
`region = backend.recv(tid, staging)`; after DONE copy `staging` into the KV cache and drop it (the memory returns
to the arena when the last reference goes).
"""

from __future__ import annotations

import os
import tempfile

from tetriinfer.transfer.agent import ZmqAgent, unique_name
from tetriinfer.transfer.base import AgentConfig


class ShmBackend(ZmqAgent):
    kind = "shm"

    def __init__(self, *, config: AgentConfig | None = None, socket_dir: str | None = None,
                 pool_bytes: int = 256 << 20, arena_segment_bytes: int = 64 << 20,
                 arena_keep_bytes: int = 512 << 20) -> None:
        directory = socket_dir or tempfile.gettempdir()
        if not os.path.isdir(directory):
            raise ValueError(f"socket_dir {directory!r} is not a directory")
        self._sock_path = os.path.join(directory, unique_name("tetrixfer") + ".sock")
        super().__init__(f"ipc://{self._sock_path}", config=config, use_shm=True, shm_pool_bytes=pool_bytes,
                         arena_segment_bytes=arena_segment_bytes, arena_keep_bytes=arena_keep_bytes)

    def shutdown(self) -> None:
        super().shutdown()
        try:
            os.unlink(self._sock_path)
        except FileNotFoundError:
            pass
