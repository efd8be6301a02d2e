"""TCP backend: ZeroMQ across hosts. The receiver's ROUTER binds host:port; senders connect a DEALER to it.
Payload arrays go out as zero-copy frames; the receiver copies each frame into its posted buffer."""

from __future__ import annotations

from tetriinfer.transfer.agent import ZmqAgent
from tetriinfer.transfer.base import AgentConfig


class TcpBackend(ZmqAgent):
    kind = "tcp"

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 config: AgentConfig | None = None) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if host in ("0.0.0.0", "*") and not advertise_host:
            raise ValueError("binding all interfaces needs advertise_host (the address peers should dial)")
        super().__init__(f"tcp://{host}:{port or '*'}", config=config, advertise=advertise_host)
