"""CPU scheduling priority of the serving processes (``--instance-nice``, ``--frontend-nice``).

On a CPU testbed each instance process stands in for an accelerator, but the front end (HTTP, detokenization,
SSE) and any load client on the host are not pinned and run on the same cores. Linux's scheduler moves them to
the least busy core -- with disaggregation, the prefill instance's -- so a prompt that arrives there waits for
them before its forward runs (measured with ``/proc/PID/schedstat``: docs/instance_priority.md). A GPU's kernels
are not delayed by the host's HTTP server; a lower nice value for the instance processes gives the CPU stand-in
the same property.

Linux keeps the nice value per thread, and a new thread inherits its creator's, so ``set_process_nice`` renices
every thread the process has now (a warm spare has already imported torch and ZeroMQ); threads made later
inherit it. Lowering the value below the current one needs root or CAP_SYS_NICE: without it, the value stays
and the reason is returned for the caller to log (never an exception: an instance without the privilege still
serves).
"""

from __future__ import annotations

import os
import sys

NICE_MIN, NICE_MAX = -20, 19


def check_nice(nice: int) -> int:
    if not NICE_MIN <= nice <= NICE_MAX:
        raise ValueError(f"nice must be in [{NICE_MIN}, {NICE_MAX}], got {nice}")
    return nice


def thread_ids() -> list[int]:
    """This process's thread ids (Linux: ``/proc/self/task``); elsewhere just the process id."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [os.getpid()]


def set_process_nice(nice: int) -> str | None:
    """Give every thread of this process the nice value ``nice``. Returns None on success, else why not."""
    check_nice(nice)
    try:
        for tid in thread_ids():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:  # the thread ended meanwhile
                continue
    except PermissionError as exc:
        return f"cannot set nice {nice} (needs root or CAP_SYS_NICE): {exc}"
    return None


def apply_nice(nice: int | None, who: str) -> None:
    """``set_process_nice`` for a process starting up (``None``: leave it as inherited); a refusal is printed to
    stderr as a warning naming ``who`` and the process goes on at its inherited priority."""
    if nice is None:
        return
    why_not = set_process_nice(nice)
    if why_not:
        print(f"{who}: warning: {why_not}; running at the inherited priority", file=sys.stderr, flush=True)


def thread_nice_values(pid: int) -> dict[int, int]:
    """Nice value of every thread of process ``pid`` (Linux ``/proc``; field 19 of ``stat``)."""
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()  # noqa: SIM115 - tiny read
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 onwards
        out[int(tid)] = int(fields[16])  # field 19 = index 16 from field 3
    return out
