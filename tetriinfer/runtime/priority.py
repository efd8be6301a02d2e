"""CPU scheduling priority and placement of the serving processes: the levers behind ``--cpu-layout``
(``instance_nice``, ``frontend_nice``, ``prefill_rt_priority``, ``frontend_rt_priority``, ``frontend_cores``;
which ones a run uses is decided in ``runtime.cpu_layout``).

On a CPU testbed each instance process stands in for an accelerator, but the front end (HTTP, detokenization,
SSE) and any load client on the host are not pinned and run on the same cores. Linux's scheduler moves them to
the least busy core -- with disaggregation, the prefill instance's -- so a prompt that arrives there waits for
them before its forward runs (measured with ``/proc/PID/schedstat``: docs/side_by_side.md). A GPU's kernels
are not delayed by the host's HTTP server; a lower nice value for the instance processes gives the CPU stand-in
the same property.

Linux keeps the nice value per thread, and a new thread inherits its creator's, so ``set_process_nice`` renices
every thread the process has now (a warm spare has already imported torch and ZeroMQ); threads made later
inherit it. Lowering the value below the current one needs root or CAP_SYS_NICE: without it, the value stays
and the reason is returned for the caller to log (never an exception: an instance without the privilege still
serves).

A nice value only weights the fair scheduler: a prefill that wakes on a core where the front end or the load
client is running still waits for the scheduler to preempt them (0.98 s per 96 prompts at nice -10,
docs/side_by_side.md). ``set_process_realtime`` puts every thread under ``SCHED_FIFO``, which preempts any
normal task at once; an instance takes it while it holds the prefill role, whose work is short, bursty and on
the TTFT path, and gives it back when it flips to decode (``Instance``). The kernel's real-time throttling
(``/proc/sys/kernel/sched_rt_runtime_us``, 95% by default) keeps a core from being taken whole.

The converse problem: a front end (or load client) thread that the scheduler left on the prefill instance's core
waits behind the whole forward, and the tokens it should have passed on reach the client together afterwards.
``frontend_rt_priority`` puts the front end's threads under ``SCHED_FIFO`` at a priority above the prefill
instance's, so its short bursts of work preempt a forward instead (what a GPU host gets from CPU cores of its
own). It is set with ``SCHED_RESET_ON_FORK``: the instances and threads the front end starts do not inherit it.

Placement is the other lever: ``frontend_cores`` (and the load client's ``client_cores``) confine those
processes to chosen cores, e.g. the prefill instance's, so that a decode instance's core runs nothing but its
steps, as a GPU's decode would (docs/side_by_side.md).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

NICE_MIN, NICE_MAX = -20, 19
RT_PRIORITY_MIN, RT_PRIORITY_MAX = 1, 99  # SCHED_FIFO's range on Linux


def check_nice(nice: int) -> int:
    if not NICE_MIN <= nice <= NICE_MAX:
        raise ValueError(f"nice must be in [{NICE_MIN}, {NICE_MAX}], got {nice}")
    return nice


def check_rt_priority(priority: int) -> int:
    if not RT_PRIORITY_MIN <= priority <= RT_PRIORITY_MAX:
        raise ValueError(f"real-time priority must be in [{RT_PRIORITY_MIN}, {RT_PRIORITY_MAX}], got {priority}")
    return priority


def check_frontend_priorities(frontend_rt: int | None, frontend_nice: int | None, prefill_rt: int | None) -> None:
    """Refuse ``frontend_rt_priority`` combinations that cannot do what they say: with a nice value too (a
    ``SCHED_FIFO`` thread ignores it, and the instances would no longer inherit it), or not above the prefill
    instances' priority (the front end would still wait behind a forward)."""
    if frontend_rt is None:
        return
    check_rt_priority(frontend_rt)
    if frontend_nice is not None:
        raise ValueError("frontend_rt_priority and frontend_nice exclude each other: a real-time front end "
                         "ignores its nice value; give instances theirs with instance_nice")
    if prefill_rt is not None and frontend_rt <= prefill_rt:
        raise ValueError(f"frontend_rt_priority ({frontend_rt}) must be above prefill_rt_priority ({prefill_rt}), "
                         "or the front end still waits behind a prompt's forward")


def thread_ids() -> list[int]:
    """This process's thread ids (Linux: ``/proc/self/task``); elsewhere just the process id."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [os.getpid()]


def _each_thread(action: Callable[[int], None]) -> None:
    """``action(tid)`` for every thread of this process, skipping threads that end meanwhile."""
    for tid in thread_ids():
        try:
            action(tid)
        except ProcessLookupError:
            continue


def set_process_nice(nice: int) -> str | None:
    """Give every thread of this process the nice value ``nice``. Returns None on success, else why not."""
    check_nice(nice)
    try:
        _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))
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


def set_process_realtime(priority: int | None, reset_on_fork: bool = False) -> str | None:
    """Put every thread of this process under ``SCHED_FIFO`` at ``priority`` (None: back to ``SCHED_OTHER``,
    which keeps each thread's nice value). Threads made later inherit the policy, unless ``reset_on_fork``
    (``SCHED_RESET_ON_FORK``): then every thread or process started from these threads begins under the normal
    scheduler, and a negative nice value is not inherited either. Returns None on success, else why not (the
    policy is then unchanged: the first thread refused is the calling one or an earlier one)."""
    if priority is not None:
        check_rt_priority(priority)
    if not hasattr(os, "sched_setscheduler"):
        return "real-time scheduling needs Linux"
    policy, param = (os.SCHED_OTHER, os.sched_param(0)) if priority is None else (
        os.SCHED_FIFO, os.sched_param(priority))
    if reset_on_fork and priority is not None:
        policy |= os.SCHED_RESET_ON_FORK
    try:
        _each_thread(lambda tid: os.sched_setscheduler(tid, policy, param))
    except PermissionError as exc:
        return f"cannot take SCHED_FIFO priority {priority} (needs root or CAP_SYS_NICE): {exc}"
    return None


def apply_realtime(priority: int | None, who: str, reset_on_fork: bool = False) -> bool:
    """``set_process_realtime``; a refusal is printed to stderr as a warning naming ``who`` and the process goes
    on under its current policy. True when the process now runs as asked."""
    why_not = set_process_realtime(priority, reset_on_fork)
    if why_not:
        print(f"{who}: warning: {why_not}; running under the normal scheduler", file=sys.stderr, flush=True)
    return why_not is None


def parse_cores(spec: str) -> tuple[int, ...]:
    """CPU cores from a list such as ``"0"``, ``"0,2"`` or ``"0-3,6"`` (sorted, without repeats); a clear
    ValueError for anything else, and for cores this machine does not have."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"cores must be a list like '0', '0,2' or '0-3', got {spec!r}")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"core range {part!r} runs backwards")
        cores.update(range(first, last + 1))
    ncpu = os.cpu_count() or 1
    missing = sorted(c for c in cores if c >= ncpu)
    if missing:
        raise ValueError(f"cpu cores {missing} do not exist (this machine has {ncpu})")
    return tuple(sorted(cores))


def set_process_affinity(cores: tuple[int, ...]) -> str | None:
    """Confine every thread this process has now to ``cores`` (threads made later inherit their creator's mask;
    processes already started keep theirs). Returns None on success, else why not."""
    if not hasattr(os, "sched_setaffinity"):
        return "core affinity needs Linux"
    try:
        _each_thread(lambda tid: os.sched_setaffinity(tid, set(cores)))
    except OSError as exc:
        return f"cannot pin to cores {list(cores)}: {exc}"
    return None


def apply_affinity(cores: tuple[int, ...] | None, who: str) -> bool:
    """``set_process_affinity`` (None: leave the mask as inherited); a refusal is printed to stderr as a warning
    naming ``who`` and the process goes on unpinned. True when the process now runs on ``cores``."""
    if cores is None:
        return False
    why_not = set_process_affinity(cores)
    if why_not:
        print(f"{who}: warning: {why_not}; running unpinned", file=sys.stderr, flush=True)
    return why_not is None


def thread_affinities(pid: int) -> dict[int, frozenset[int]]:
    """The cores each thread of process ``pid`` may run on."""
    return _per_thread(pid, lambda tid: frozenset(os.sched_getaffinity(tid)))


def _per_thread(pid: int, read: Callable[[int], T]) -> dict[int, T]:
    """``read(tid)`` for every thread of process ``pid``; threads that exit meanwhile are left out."""
    out: dict[int, T] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = read(int(tid))
        except ProcessLookupError:
            continue
    return out


def is_realtime() -> bool:
    """Whether the calling thread runs under ``SCHED_FIFO`` (False where Linux's scheduling calls are missing)."""
    if not hasattr(os, "sched_getscheduler"):
        return False
    return os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO


def yield_if_realtime() -> None:
    """``sched_yield`` when the calling thread runs under ``SCHED_FIFO``: every runnable thread of the same priority on
    this core (e.g. ZeroMQ's I/O thread, which sends what the caller queued) runs before the caller goes on."""
    if is_realtime():
        os.sched_yield()


def thread_policies(pid: int) -> dict[int, tuple[int, int]]:
    """(scheduling policy, real-time priority) of every thread of process ``pid``; policy is one of ``os.SCHED_*``
    (without the ``SCHED_RESET_ON_FORK`` flag: ``resets_on_fork`` tells that)."""
    return _per_thread(pid, lambda tid: (os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK,
                                         os.sched_getparam(tid).sched_priority))


def resets_on_fork(pid: int) -> dict[int, bool]:
    """Whether each thread of process ``pid`` has ``SCHED_RESET_ON_FORK`` (its children start unprivileged)."""
    return _per_thread(pid, lambda tid: bool(os.sched_getscheduler(tid) & os.SCHED_RESET_ON_FORK))


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
