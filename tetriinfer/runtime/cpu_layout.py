"""``--cpu-layout auto|none|FILE``: where the serving processes run and at what CPU priority, as one setting.

On a CPU host each instance process stands in for an accelerator and is pinned to its own cores, but the front
end (HTTP, routing, streaming) and a load client are not, and the scheduler puts them on whichever core is idle
-- often one whose steps they then delay. The individual levers are in ``runtime.priority``; this module decides
which of them a run uses:

- ``none`` (default): change nothing (every process at the inherited priority, the front end unpinned).
- ``auto``: the layout measured best on a 2-core host (docs/side_by_side.md, section CPU layout), applied only
  where it means something and is permitted: local CPU instances, every core taken by an instance. Disaggregated
  modes then run the prefill instances under ``SCHED_FIFO`` (priority 10) and the front end above them (11),
  pinned to the first prefill instance's cores; colocated modes pin the front end to the first instance's cores at
  priority 11 (a colocated instance under ``SCHED_FIFO`` starves its front end). Without the privilege for
  ``SCHED_FIFO`` only the pinning is applied. With cores to spare, the front end is pinned to those instead and
  nothing is prioritized. Every decision is logged, with its reason (``CpuLayout.notes``).
- ``FILE``: a TOML file naming the individual knobs, for experiments::

      instance_nice = -10          # nice value of the instance processes (-20..19; below 0 needs root)
      prefill_rt_priority = 10     # SCHED_FIFO priority of instances while they prefill (1..99)
      frontend_nice = 0            # nice value of the front end (instances inherit it)
      frontend_rt_priority = 11    # SCHED_FIFO priority of the front end's threads, above prefill_rt_priority
      frontend_cores = "0"         # pin the front end's threads once the instances run
      client_rt_priority = 20      # bench: SCHED_FIFO priority of the load client
      client_cores = ["tetriinfer:0"]  # bench: [NAME:]LIST cores of the load client (NAME: one column)

Invariants: a ``CpuLayout`` is validated when built (ranges, and the combinations that cannot do what they say,
``check_frontend_priorities``); an unknown key or a wrong type in a file is an error naming it; a lever the
process may not use is logged and skipped, never fatal (an instance without the privilege still serves).
"""

from __future__ import annotations

import threading
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tetriinfer.runtime.priority import check_frontend_priorities, check_nice, check_rt_priority, parse_cores

LAYOUT_CHOICES = ("auto", "none")
# The layout measured best on 2 cores (docs/side_by_side.md): prefill under SCHED_FIFO, the front end above it
# on the prefill core, the load client above both on the same core.
AUTO_PREFILL_RT = 10
AUTO_FRONTEND_RT = 11
AUTO_CLIENT_RT = 20
DISAGGREGATED_MODES = ("tetriinfer", "distserve")


@dataclass(frozen=True)
class CpuLayout:
    """The CPU placement and priority of a run's processes; ``None``/empty: leave that one as inherited."""

    instance_nice: int | None = None
    prefill_rt_priority: int | None = None
    frontend_nice: int | None = None
    frontend_rt_priority: int | None = None
    frontend_cores: tuple[int, ...] | None = None
    client_rt_priority: int | None = None
    client_cores: tuple[str, ...] = ()  # "[NAME:]LIST" as `bench side-by-side` takes them; a bare LIST for all
    source: str = field(default="none", compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)  # what ``auto`` decided, and why

    def __post_init__(self) -> None:
        for name in ("instance_nice", "frontend_nice"):
            value = getattr(self, name)
            if value is not None:
                check_nice(value)
        for name in ("prefill_rt_priority", "client_rt_priority"):
            value = getattr(self, name)
            if value is not None:
                check_rt_priority(value)
        check_frontend_priorities(self.frontend_rt_priority, self.frontend_nice, self.prefill_rt_priority)
        if self.frontend_cores is not None and not self.frontend_cores:
            raise ValueError("frontend_cores must name at least one core")
        for spec in self.client_cores:
            name, sep, cores = spec.rpartition(":")
            if sep and not name:
                raise ValueError(f"client_cores {spec!r}: a column's cores are NAME:LIST")
            if cores != "all":
                parse_cores(cores)

    @property
    def is_empty(self) -> bool:
        return self == CpuLayout()

    def client_cores_for_run(self) -> tuple[int, ...] | None:
        """The load client's cores for a single ``bench`` run (no column names there)."""
        named = [s for s in self.client_cores if ":" in s]
        if named:
            raise ValueError(f"client_cores {named}: NAME:LIST applies to `bench side-by-side` columns only")
        if len(self.client_cores) > 1:
            raise ValueError(f"client_cores: one LIST for a bench run, got {list(self.client_cores)}")
        return parse_cores(self.client_cores[0]) if self.client_cores else None

    def describe(self) -> str:
        """One line naming every lever set (for the log and reports)."""
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name not in ("source", "notes") and getattr(self, f.name) not in (None, ())]
        return f"cpu layout {self.source}: " + (", ".join(parts) if parts else "nothing changed")


_INT_KEYS = ("instance_nice", "prefill_rt_priority", "frontend_nice", "frontend_rt_priority", "client_rt_priority")


def layout_from_dict(data: dict[str, Any], source: str) -> CpuLayout:
    """A ``CpuLayout`` from a TOML table; unknown keys and wrong types are errors naming ``source``."""
    known = {*_INT_KEYS, "frontend_cores", "client_cores"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{source}: unknown cpu layout key(s) {unknown}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for key in _INT_KEYS:
        if key in data:
            if isinstance(data[key], bool) or not isinstance(data[key], int):
                raise ValueError(f"{source}: {key} must be an integer, got {data[key]!r}")
            kwargs[key] = data[key]
    if "frontend_cores" in data:
        value = data["frontend_cores"]
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ValueError(f"{source}: frontend_cores must be a core list like \"0\" or \"0-1\", got {value!r}")
        kwargs["frontend_cores"] = parse_cores(value)
    if "client_cores" in data:
        value = data["client_cores"]
        specs = [value] if isinstance(value, str) else value
        if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
            raise ValueError(f"{source}: client_cores must be a string or a list of strings, got {value!r}")
        kwargs["client_cores"] = tuple(specs)
    try:
        return CpuLayout(**kwargs, source=source)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def read_layout_file(path: str | Path) -> CpuLayout:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--cpu-layout: {str(p)!r} is neither auto, none nor a TOML file")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--cpu-layout {p}: invalid TOML ({exc})") from None
    return layout_from_dict(data, str(p))


def realtime_permitted() -> bool:
    """Whether this process may take ``SCHED_FIFO``: tried on a short-lived thread of its own (the policy is per
    thread on Linux), so no thread that goes on running is changed."""
    import os

    if not hasattr(os, "sched_setscheduler"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except OSError:
            result.append(False)
            return
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        result.append(True)

    t = threading.Thread(target=probe, name="rt-probe")
    t.start()
    t.join()
    return bool(result and result[0])


def auto_layout(*, mode: str, instances: int, cores_per_instance: int, device: str, launcher: str,
                keep_decode: bool, ncpu: int, realtime_ok: bool) -> CpuLayout:
    """The measured-best layout for this deployment (see the module docstring); pure, so it is tested directly.

    ``instances`` counts every instance process on this host."""
    notes: list[str] = []
    if device != "cpu" or launcher != "local" or mode == "single":
        why = (f"device {device}" if device != "cpu" else f"launcher {launcher}" if launcher != "local"
               else "mode single (one in-process engine)")
        return CpuLayout(source="auto", notes=(f"nothing to place: {why}",))
    used = instances * cores_per_instance
    first = tuple(sorted({i % ncpu for i in range(cores_per_instance)}))
    if used < ncpu:
        spare = tuple(range(used, ncpu))
        return CpuLayout(frontend_cores=spare, source="auto",
                         notes=(f"cores {list(spare)} are free of instances: the front end runs there",))
    disaggregated = mode in DISAGGREGATED_MODES
    notes.append(f"every core runs an instance: the front end shares the first {'prefill ' if disaggregated else ''}"
                 f"instance's cores {list(first)}")
    prefill_rt = frontend_rt = None
    if not realtime_ok:
        notes.append("SCHED_FIFO not permitted (needs root or CAP_SYS_NICE): pinning only")
    else:
        frontend_rt = AUTO_FRONTEND_RT
        if disaggregated and not keep_decode:
            prefill_rt = AUTO_PREFILL_RT
            notes.append(f"prefill instances under SCHED_FIFO {prefill_rt}, the front end above them at {frontend_rt}")
        else:
            why = "--keep-decode decodes on the prefill core" if disaggregated else "colocated instances run steps " \
                  "back to back and would starve their front end"
            notes.append(f"instances at normal priority ({why}); the front end under SCHED_FIFO {frontend_rt}")
    return CpuLayout(prefill_rt_priority=prefill_rt, frontend_rt_priority=frontend_rt, frontend_cores=first,
                     source="auto", notes=tuple(notes))


def auto_client_layout(ncpu: int, realtime_ok: bool) -> CpuLayout:
    """``bench --cpu-layout auto``: the load client on core 0 (where ``serve --cpu-layout auto`` puts the front end
    beside the first prefill instance) under ``SCHED_FIFO`` 20 where permitted; unpinned with 3+ cores."""
    if ncpu > 2:
        return CpuLayout(source="auto", notes=(f"{ncpu} cores: the load client is left to the scheduler",))
    rt = AUTO_CLIENT_RT if realtime_ok else None
    note = f"the load client on core 0 under SCHED_FIFO {rt}" if rt else \
        "the load client on core 0 (SCHED_FIFO not permitted: pinning only)"
    return CpuLayout(client_rt_priority=rt, client_cores=("0",), source="auto", notes=(note,))


def load_layout(value: str) -> CpuLayout | None:
    """``none`` -> an empty layout, a FILE -> its layout, ``auto`` -> None (the caller resolves it); anything
    else is a clear error."""
    if value == "none":
        return CpuLayout()
    if value == "auto":
        return None
    return read_layout_file(value)
