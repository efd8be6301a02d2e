"""Where instance processes run: on this machine (``local``) or on the nodes of a Ray cluster (``ray``).

A launcher does two things for the front end: ``place(n)`` reserves a slot for each of n instances and says which
host each landed on (so the front end can give each its bind address and its cores on that host), then
``start(slot, argv, env)`` runs ``python -m tetriinfer.runtime.instance SPEC`` there and returns a handle with
``subprocess.Popen``'s surface (``pid``, ``returncode``, ``poll``, ``terminate``, ``kill``, ``wait``), which is all
the front end uses. The data path stays ours (ZeroMQ control, TCP/NIXL KV transfer between the hosts' addresses);
Ray only places processes and keeps them alive.

Ray: each instance is a Ray actor holding ``cores_per_instance`` CPUs (and one GPU on CUDA) that starts the
instance process on its node and reports its exit. The actor is the instance's parent: if the actor dies the
instance sees its parent change and exits; when the front end's Ray driver exits, Ray kills its actors. Polls never
block the front end's event loop: ``poll`` returns the last answer and keeps one status query in flight.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

LAUNCHERS = ("local", "ray")
INSTANCE_MODULE = ("-m", "tetriinfer.runtime.instance")  # + the hex spec, or --spare
LOOPBACK = "127.0.0.1"


class InstanceProcess(Protocol):
    """The part of ``subprocess.Popen`` the front end uses."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True)
class Slot:
    """Where one instance will run: ``host`` is the address it binds and peers dial; ``node`` names the machine
    (the hostname locally, the Ray node id on Ray; instances on one node share its cores: ``local_index`` counts
    them there, from 0)."""

    index: int
    node: str
    host: str
    local_index: int


class _SlotBook:
    """Slot numbering shared by the launchers: indices are never reused; on each node an instance gets the lowest
    free ``local_index`` (so a replacement or scale-out instance takes the cores a retired one left)."""

    def __init__(self) -> None:
        self._next = 0
        self._in_use: dict[str, set[int]] = {}

    def take(self, node: str, host: str) -> Slot:
        used = self._in_use.setdefault(node, set())
        local = next(i for i in range(len(used) + 1) if i not in used)
        used.add(local)
        self._next += 1
        return Slot(self._next - 1, node, host, local)

    def release(self, slot: Slot) -> None:
        self._in_use.get(slot.node, set()).discard(slot.local_index)


def spawn_spare(env: dict[str, str]) -> subprocess.Popen:
    """A warm spare: ``python -m tetriinfer.runtime.instance --spare`` (imports, then waits for a spec on stdin)."""
    return subprocess.Popen([sys.executable, *INSTANCE_MODULE, "--spare"], stdin=subprocess.PIPE,
                            env={**os.environ, **env})


def hand_spec(spare: subprocess.Popen, argv: list[str]) -> bool:
    """Give a live spare the instance command ``argv`` (``-m tetriinfer.runtime.instance SPEC``): True if it took
    it; False if ``argv`` is not an instance command or the spare is gone (the caller starts a fresh process)."""
    if argv[:2] != list(INSTANCE_MODULE) or len(argv) != 3 or spare.poll() is not None:
        return False
    assert spare.stdin is not None
    try:
        spare.stdin.write(argv[2].encode() + b"\n")
        spare.stdin.close()
    except OSError:  # it died just now
        spare.kill()
        return False
    return True


class LocalLauncher:
    """Instance processes on this machine, bound to loopback.

    ``warm_spares``: keep that many instance processes pre-started (``python -m tetriinfer.runtime.instance
    --spare``: the interpreter up and torch, transformers and the engine imported -- about 2 s of an instance's
    start -- then blocked reading its spec from stdin). ``prime(env)`` starts them (the front end calls it once
    the pool is up, so the first instances do not wait behind their spares); ``start`` hands a new instance's
    spec to a spare started with the same ``env`` and starts a replacement, or starts a fresh process when none
    is ready. A spare whose parent goes away reads EOF and exits. Each idle spare costs its imported modules'
    memory (~0.3-0.5 GB), no CPU.
    """

    name = "local"

    def __init__(self, warm_spares: int = 0, host: str = LOOPBACK) -> None:
        if warm_spares < 0:
            raise ValueError(f"warm_spares must be >= 0, got {warm_spares}")
        self.host = host  # what the instances and the front end's control socket bind (127.0.0.1, ::1, ...)
        self._book = _SlotBook()
        self.warm_spares = warm_spares
        self._spares: list[subprocess.Popen] = []
        self._spare_env: dict[str, str] | None = None
        self.spares_used = 0

    def frontend_host(self) -> str:
        return self.host

    def place(self, n: int) -> list[Slot]:
        node = socket.gethostname()
        return [self._book.take(node, self.host) for _ in range(n)]

    def start(self, slot: Slot, argv: list[str], env: dict[str, str]) -> InstanceProcess:
        if env == self._spare_env:
            self._spares = [p for p in self._spares if p.poll() is None]
            if self._spares and hand_spec(self._spares[0], argv):
                self.spares_used += 1
                proc = self._spares.pop(0)
                self._top_up()
                return proc
        return subprocess.Popen([sys.executable, *argv], env={**os.environ, **env})

    @property
    def spare_pids(self) -> list[int]:
        """Process ids of the spares started and not yet used (alive or not)."""
        return [p.pid for p in self._spares]

    def prime(self, env: dict[str, str]) -> None:
        """Start the warm spares (for instances started later with this ``env``)."""
        self._spare_env = dict(env)
        self._top_up()

    def _top_up(self) -> None:
        if self._spare_env is None:
            return
        while len(self._spares) < self.warm_spares:
            self._spares.append(spawn_spare(self._spare_env))

    def release(self, slot: Slot) -> None:
        """The instance in ``slot`` has exited: its cores are free for the next placement."""
        self._book.release(slot)

    def close(self) -> None:
        """Stop the idle spares (they hold nothing: EOF on stdin and SIGTERM, then a kill if one lingers)."""
        spares, self._spares = self._spares, []
        for proc in spares:
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.poll() is None:
                proc.terminate()
        for proc in spares:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("--launcher ray needs Ray: pip install 'tetriinfer[ray]' (ray 2.60)") from e
    return ray


class _InstanceHost:
    """A Ray actor's body: one instance process on the actor's node."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.spare: subprocess.Popen | None = None  # a warm spare waiting for its spec (RayLauncher.prime)

    def node_id(self) -> str:
        """The Ray node this actor runs on. Not the hostname: network namespaces on one machine (our two-node
        test) share one hostname but are different nodes."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def start_spare(self, env: dict[str, str]) -> int:
        self.spare = spawn_spare(env)
        return self.spare.pid

    def start(self, argv: list[str], env: dict[str, str]) -> tuple[int, bool]:
        """Run the instance: in the spare when there is a live one (True), else in a fresh process."""
        spare, self.spare = self.spare, None
        if spare is not None and hand_spec(spare, argv):
            self.proc = spare
            return spare.pid, True
        self.proc = subprocess.Popen([sys.executable, *argv], env={**os.environ, **env})
        return self.proc.pid, False

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, kill: bool) -> None:
        for proc in (self.proc, self.spare):
            if proc is not None and proc.poll() is None:
                (proc.kill if kill else proc.terminate)()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


# An instance whose actor is gone (node lost, actor killed) reads as exited with this code.
ACTOR_LOST = -1


class RayInstance:
    """``InstanceProcess`` over a Ray actor (see the module docstring)."""

    def __init__(self, ray: Any, actor: Any, pid: int) -> None:
        self._ray = ray
        self.actor = actor
        self.pid = pid
        self.returncode: int | None = None
        self._pending: Any = None

    def _settle(self, ref: Any) -> int | None:
        try:
            return self._ray.get(ref)
        except Exception:  # RayActorError and friends: the actor (and so the instance) is gone
            return ACTOR_LOST

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._pending is None:
            self._pending = self.actor.poll.remote()
        ready, _ = self._ray.wait([self._pending], timeout=0)
        if ready:
            code = self._settle(self._pending)
            self._pending = None
            if code is not None:
                self.returncode = code
        return self.returncode

    def terminate(self) -> None:
        self._signal(kill=False)

    def kill(self) -> None:
        self._signal(kill=True)

    def _signal(self, kill: bool) -> None:
        if self.returncode is None:
            try:
                self._ray.get(self.actor.signal.remote(kill), timeout=10)
            except Exception:
                self.returncode = ACTOR_LOST

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 5.0 if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._settle(self.actor.wait.remote(min(left, 5.0)))
            if code is not None:
                self.returncode = code
            elif deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("ray instance", timeout or 0.0)
        return self.returncode


class RayLauncher:
    """Instances as Ray actors on the cluster at ``address`` (``auto``: the one ``ray start`` made on this machine;
    ``local``: start a private single-node Ray here; ``HOST:PORT``: that cluster's head)."""

    name = "ray"

    def __init__(self, address: str = "auto", *, cores_per_instance: int = 1, device: str = "cpu",
                 placement_timeout_s: float = 120.0, warm_spares: int = 0) -> None:
        if warm_spares < 0:
            raise ValueError(f"warm_spares must be >= 0, got {warm_spares}")
        if address == "local":
            # Ray 2.60 on Linux registers a node under its default-route address even when told loopback, unless
            # this (named for the platforms where loopback is its default) is off; it is read when ray is imported.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        self._ray = _ray()
        self.cores_per_instance = cores_per_instance
        self.device = device
        self.placement_timeout_s = placement_timeout_s
        self._owns_init = not self._ray.is_initialized()
        if self._owns_init:
            kw: dict[str, Any] = {"namespace": "tetriinfer", "log_to_driver": True}
            if address == "local":  # a private single-node cluster on loopback, no dashboard
                kw.update(_node_ip_address=LOOPBACK, include_dashboard=False)
            else:
                kw["address"] = address
            self._ray.init(**kw)
        self._actors: dict[int, Any] = {}  # by slot index
        self._book = _SlotBook()
        # Warm spares: actors asked for (placement may still be pending) whose process waits for a spec; a
        # placement takes ready ones first. See LocalLauncher for what a spare is.
        self.warm_spares = warm_spares
        self._spares: list[tuple[Any, Any]] = []  # (actor, ref to its start_spare -> pid)
        self._spare_env: dict[str, str] | None = None
        self._spare_slots: set[int] = set()  # slot indices whose actor holds a spare
        self.spares_used = 0

    def _node_address(self, node_id: str) -> str:
        """A node's address as its raylet registered it (``ray start --node-ip-address``); a worker process's own
        guess (``ray.util.get_node_ip_address``) follows the default route instead and can be wrong."""
        for node in self._ray.nodes():
            if node.get("NodeID") == node_id and node.get("Alive", True):
                return str(node["NodeManagerAddress"])
        raise RuntimeError(f"Ray node {node_id} is not alive")

    def frontend_host(self) -> str:
        return self._node_address(self._ray.get_runtime_context().get_node_id())

    def _host_cls(self) -> Any:
        options: dict[str, Any] = {"num_cpus": self.cores_per_instance}
        if self.device.startswith("cuda"):
            options["num_gpus"] = 1
        return self._ray.remote(_InstanceHost).options(**options)

    def prime(self, env: dict[str, str]) -> None:
        """Ask for the warm spares (one actor each, placed when the cluster has room; never waited for here)."""
        self._spare_env = dict(env)
        self._top_up()

    def _top_up(self) -> None:
        if self._spare_env is None:
            return
        while len(self._spares) < self.warm_spares:
            actor = self._host_cls().remote()
            self._spares.append((actor, actor.start_spare.remote(self._spare_env)))

    @property
    def spare_pids(self) -> list[int]:
        """Process ids of the spares that are up (placed and started)."""
        refs = [ref for _, ref in self._spares]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        return [self._ray.get(ref) for ref in ready]

    def _take_ready_spares(self, n: int) -> list[Slot]:
        slots = []
        for actor, ref in list(self._spares):
            if len(slots) >= n:
                break
            ready, _ = self._ray.wait([ref], timeout=0)
            if not ready:
                continue
            self._spares.remove((actor, ref))
            try:
                self._ray.get(ref)
                node = self._ray.get(actor.node_id.remote(), timeout=10)
            except Exception:  # the spare's actor died: drop it
                self._kill(actor)
                continue
            slot = self._book.take(node, self._node_address(node))
            self._actors[slot.index] = actor
            self._spare_slots.add(slot.index)
            slots.append(slot)
        return slots

    def place(self, n: int) -> list[Slot]:
        spares = self._take_ready_spares(n)
        return spares + (self._place_new(n - len(spares)) if n > len(spares) else [])

    def _place_new(self, n: int) -> list[Slot]:
        actors = [self._host_cls().remote() for _ in range(n)]
        refs = [a.node_id.remote() for a in actors]
        ready, pending = self._ray.wait(refs, num_returns=n, timeout=self.placement_timeout_s)
        if pending:
            for actor in actors:
                self._kill(actor)
            raise RuntimeError(
                f"Ray placed {len(ready)} of {n} instances in {self.placement_timeout_s:.0f} s: the cluster lacks "
                f"{self.cores_per_instance} free CPU(s){' and a GPU' if self.device.startswith('cuda') else ''} per instance "
                f"(ray status shows what it has)"
            )
        slots = []
        for actor, node in zip(actors, self._ray.get(refs), strict=True):
            slot = self._book.take(node, self._node_address(node))
            self._actors[slot.index] = actor
            slots.append(slot)
        return slots

    def _kill(self, actor: Any) -> None:
        try:
            self._ray.kill(actor)
        except Exception:  # already gone
            pass

    def release(self, slot: Slot) -> None:
        """The instance in ``slot`` has exited: free its actor (and so its CPUs in Ray's books) and its cores."""
        self._spare_slots.discard(slot.index)
        actor = self._actors.pop(slot.index, None)
        if actor is not None:
            self._kill(actor)
        self._book.release(slot)

    def start(self, slot: Slot, argv: list[str], env: dict[str, str]) -> InstanceProcess:
        actor = self._actors[slot.index]
        pid, warm = self._ray.get(actor.start.remote(argv, env), timeout=60)
        if slot.index in self._spare_slots:
            self._spare_slots.discard(slot.index)
            self.spares_used += int(warm)
            self._top_up()
        return RayInstance(self._ray, actor, pid)

    def close(self) -> None:
        for actor in [*self._actors.values(), *(a for a, _ in self._spares)]:
            self._kill(actor)
        self._actors = {}
        self._spares = []
        if self._owns_init and self._ray.is_initialized():
            self._ray.shutdown()


def make_launcher(name: str, *, ray_address: str = "auto", cores_per_instance: int = 1, device: str = "cpu",
                  placement_timeout_s: float = 120.0, warm_spares: int = 0,
                  local_host: str = LOOPBACK) -> LocalLauncher | RayLauncher:
    if name == "local":
        return LocalLauncher(warm_spares, host=local_host)
    if name == "ray":
        return RayLauncher(ray_address, cores_per_instance=cores_per_instance, device=device,
                           placement_timeout_s=placement_timeout_s, warm_spares=warm_spares)
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {name!r}")
