"""KV-cache transfer: one polled API (send/recv, write/read, chunk-wise open/append/close) over in-process,
shared-memory, TCP, torch.distributed (gloo/NCCL; `TorchDistBackend`, imported on first use) and (optional) NIXL
links, plus fault injection, link pacing and a retry policy.

Receive buffers should come from `backend.alloc_like(shapes, dtype)`: on shm they live in a shared-memory arena
that the sender writes directly (one copy); on other links they are ordinary tensors."""

from tetriinfer.transfer.base import AgentConfig, Peer, TransferBackend, TransferStats
from tetriinfer.transfer.factory import BACKENDS, make_backend, nixl_available
from tetriinfer.transfer.faulty import FaultPlan, FaultyBackend
from tetriinfer.transfer.inproc import InprocBackend
from tetriinfer.transfer.messages import RemoteRegion
from tetriinfer.transfer.paced import LINK_PRESETS, PacedLink, parse_bandwidth, parse_duration
from tetriinfer.transfer.retry import RetryingSender, RetryPolicy
from tetriinfer.transfer.shm import ShmBackend
from tetriinfer.transfer.state import (
    LEGAL_TRANSITIONS,
    IllegalTransition,
    Role,
    TransferRecord,
    TransferState,
    TransferStatus,
)
from tetriinfer.transfer.tcp import TcpBackend

__all__ = [
    "BACKENDS", "LEGAL_TRANSITIONS", "LINK_PRESETS", "AgentConfig", "FaultPlan", "FaultyBackend",
    "IllegalTransition", "InprocBackend", "PacedLink", "Peer", "RemoteRegion", "RetryPolicy",
    "RetryingSender", "Role", "ShmBackend", "TcpBackend", "TransferBackend", "TransferRecord",
    "TransferState", "TransferStats", "TransferStatus", "make_backend", "nixl_available",
    "parse_bandwidth", "parse_duration",
]


def __getattr__(name: str) -> object:
    """`TorchDistBackend` on first use, so that importing the package does not import torch."""
    if name == "TorchDistBackend":
        from tetriinfer.transfer.torchdist import TorchDistBackend

        return TorchDistBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
