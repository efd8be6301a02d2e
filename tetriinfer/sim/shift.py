"""A load that shifts: workload phases played one after the other (``shift:hpld+lphd+hpld``).

Each phase is one of the bench's workloads (``bench.workloads.load_workload``) with an equal share of the
requests at the same rate; phase ``k`` starts when phase ``k - 1``'s last request has arrived. Request ids
are prefixed with the phase index so they stay unique. Used by ``tetriinfer sim side-by-side`` to show the P:D
controller moving the split and back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tetriinfer.bench.workloads import Workload, load_workload

SHIFT_PREFIX = "shift:"


def phase_names(name: str) -> list[str]:
    """``shift:a+b+c`` -> ``[a, b, c]`` (at least two phases)."""
    if not name.lower().startswith(SHIFT_PREFIX):
        raise ValueError(f"a shifting workload is named {SHIFT_PREFIX}A+B[+...], got {name!r}")
    phases = [p.strip() for p in name[len(SHIFT_PREFIX):].split("+") if p.strip()]
    if len(phases) < 2:
        raise ValueError(f"{name!r}: a shifting workload needs at least two phases")
    if any(p.lower().startswith((SHIFT_PREFIX, "trace:")) for p in phases):
        raise ValueError(f"{name!r}: phases are the bench's synthetic workloads (lpld, lphd, hpld, hphd, mixed)")
    return phases


def phased_workload(name: str, num_requests: int, rate: float | None, seed: int, **kwargs: Any) -> Workload:
    """The phases of ``name`` back to back, ``num_requests`` split evenly (the first phases get the rest)."""
    phases = phase_names(name)
    if num_requests < len(phases):
        raise ValueError(f"{name!r}: need at least one request per phase, got {num_requests}")
    base, extra = divmod(num_requests, len(phases))
    requests = []
    offset = 0.0
    for k, phase in enumerate(phases):
        n = base + (1 if k < extra else 0)
        wl = load_workload(phase, n, rate, seed + k, **kwargs)
        gap = 1.0 / rate if rate else 0.0
        for r in wl.requests:
            requests.append(dataclasses.replace(r, request_id=f"p{k}-{r.request_id}", arrival_s=r.arrival_s + offset))
        offset = (requests[-1].arrival_s if requests else offset) + gap
    return Workload(name=name, requests=tuple(requests), source="shift", arrival_process=kwargs.get("arrival")
                    or "poisson", rate=rate, seed=seed,
                    notes=(f"phases {', '.join(phases)}, {base}+ requests each, one after the other",))
