"""`make_backend(name, **kw)`: the one way the runtime builds a transfer backend.

Names: inproc, shm, tcp, nixl, torchdist (kw: rank, world_size, init_method, backend='auto'|'gloo'|'nccl', ...;
building it is collective: every rank constructs its own), faulty (kw: inner=<name or backend>, plan=FaultPlan or
its fields), paced (kw: inner=..., bandwidth='200Gbps', latency=0). Unknown keyword arguments raise ValueError.
"""

from __future__ import annotations

from typing import Any

from tetriinfer.transfer.base import AgentConfig, TransferBackend
from tetriinfer.transfer.faulty import FaultPlan, FaultyBackend
from tetriinfer.transfer.inproc import InprocBackend
from tetriinfer.transfer.paced import PacedLink
from tetriinfer.transfer.shm import ShmBackend
from tetriinfer.transfer.tcp import TcpBackend

BACKENDS = ("inproc", "shm", "tcp", "nixl", "torchdist", "faulty", "paced")


def nixl_available() -> bool:
    from tetriinfer.transfer.nixl_backend import NIXL_AVAILABLE

    return NIXL_AVAILABLE


def _inner(kw: dict[str, Any]) -> TransferBackend:
    inner = kw.pop("inner", "inproc")
    if isinstance(inner, str):
        inner_kw = kw.pop("inner_kw", {})
        if "config" in kw and "config" not in inner_kw:
            inner_kw["config"] = kw.pop("config")
        return make_backend(inner, **inner_kw)
    return inner


def make_backend(name: str, **kw: Any) -> TransferBackend:
    config = kw.get("config")
    if config is not None and not isinstance(config, AgentConfig):
        raise ValueError("config must be an AgentConfig")
    try:
        if name == "inproc":
            return InprocBackend(**kw)
        if name == "shm":
            return ShmBackend(**kw)
        if name == "tcp":
            return TcpBackend(**kw)
        if name == "nixl":
            from tetriinfer.transfer.nixl_backend import NixlBackend

            return NixlBackend(**kw)
        if name == "torchdist":
            from tetriinfer.transfer.torchdist import TorchDistBackend  # imports torch: only when asked for

            return TorchDistBackend(**kw)
        if name == "faulty":
            inner = _inner(kw)
            plan = kw.pop("plan", None) or FaultPlan(**kw)
            return FaultyBackend(inner, plan)
        if name == "paced":
            inner = _inner(kw)
            return PacedLink(inner, **kw)
    except TypeError as e:
        raise ValueError(f"bad options for transfer backend {name!r}: {e}") from e
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
