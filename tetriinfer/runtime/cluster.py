"""The front end of a multi-process cluster: global scheduler, cluster monitor, and the client API.

Request lifecycle (disaggregated mode), as the front end sees it:
arrive (``generate``; row in the request status table) -> routed to the least-loaded prefill instance ->
first token (from the prefill instance) -> dispatched (decode instance chosen) -> tokens (from the decode
instance) -> finished | aborted | failed. Colocated modes skip the dispatch. Tokens can arrive from two
instances over different sockets, so they are reordered by output index before streaming. Every request
ends with exactly one terminal event.

Instance failure: when the monitor finds an instance dead, every unfinished request it held is sent again to a
live instance (``runtime.recovery``): one that had not started is routed again; one that had streamed tokens is
prefilled again from its prompt plus those tokens under a new engine id and continues the same client stream (no
duplicate, no missing token). Survivors are told to abort the old engine id (freeing its KV), and messages about it
are dropped. Only when no live instance can take a request does it end with an error event.

The cluster monitor keeps the instance table (role, pid, host, state, last report), aggregates decode
load and broadcasts it to prefill instances every report interval, and, with flipping on, runs the flip
policy and tells instances to switch roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from tetriinfer.core.flip_policy import FlipAction
from tetriinfer.core.global_policy import GlobalPolicy, LocalPrefillConfig, Phase
from tetriinfer.core.load import LoadReport, Role, accepting
from tetriinfer.core.membership import Membership, MemberState
from tetriinfer.core.migration import MIGRATION_ROLES, MigrationPlanner
from tetriinfer.core.pd_controller import PDController
from tetriinfer.core.rebalance import Rebalancer
from tetriinfer.core.sampling_params import SamplingParams
from tetriinfer.core.scale_policy import ScaleAction, ScaleCommand, ScalePolicy
from tetriinfer.engine.model_config import ModelConfig
from tetriinfer.net import free_loopback_port, url_host
from tetriinfer.runtime.cluster_config import ClusterConfig
from tetriinfer.runtime.engine_client import TokenEvent
from tetriinfer.runtime.instance_spec import InstanceSpec, encode_spec
from tetriinfer.runtime.launcher import (
    INSTANCE_MODULE,
    InstanceProcess,
    LocalLauncher,
    RayLauncher,
    Slot,
    make_launcher,
)
from tetriinfer.runtime.messages import (
    CONTROL_KEY_ENV,
    Abort,
    DecodeLoads,
    Dispatched,
    Hello,
    Migrate,
    Migrating,
    MigrationDone,
    NewRequest,
    PeerTable,
    PredictorStat,
    Retire,
    Retired,
    RoleSwitched,
    SetRole,
    Shutdown,
    Tokens,
    TransferStat,
    WireLoad,
    WireParams,
    Yield,
    Yielded,
    decode,
    encode,
    encode_load,
    front_end_control_key,
)
from tetriinfer.runtime.recovery import continuation
from tetriinfer.runtime.worker_base import load_from_wire


@dataclass
class InstanceInfo:
    instance_id: str
    role: str
    process: InstanceProcess
    hello: Hello | None = None
    load: WireLoad | None = None
    socket: zmq.asyncio.Socket | None = None
    last_seen: float = 0.0
    flips: int = 0
    node: str = ""  # the machine it runs on (the launcher's placement)
    slot: Slot | None = None
    member: Membership = field(default_factory=Membership)  # the lifecycle (core.membership)
    retired: Retired | None = None  # its Retired message (drain time)
    exited_at: float | None = None  # when the monitor first saw its process gone
    replacing: bool = False  # died; a replacement is starting (--replace-dead)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def routable(self) -> bool:
        """May receive new work: SERVING (connected, not being removed; an added instance can report before the
        front end has connected to it) and its process running."""
        return self.member.serving and self.alive

    @property
    def retiring(self) -> bool:
        return self.member.draining


@dataclass
class _Stream:
    request_id: str
    num_prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    next_index: int = 0
    pending: dict[int, Any] = field(default_factory=dict)
    finished: bool = False
    instances: set[str] = field(default_factory=set)
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    new_request: NewRequest | None = None  # what was sent, kept to route it again (queue rebalancing)
    original: NewRequest | None = None  # attempt 0 as sent (recovery continues from it)
    attempt: int = 0  # how many times it was sent again after an instance died (runtime.recovery)
    engine_id: str = ""  # the id instances know the current attempt by
    offset: int = 0  # output tokens streamed before the current attempt (its index 0 is this output index)
    streamed: list[int] = field(default_factory=list)  # every output token id delivered, in order
    prefill_id: str | None = None  # the instance the current attempt was routed to
    recovering: bool = False  # being routed again after an instance died

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or self.request_id


INSTANCE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


class ClusterEngineClient:
    """``EngineClient`` over instance processes on this machine."""

    def __init__(self, config: ClusterConfig, *, model_name: str | None = None) -> None:
        if config.keep_offer:
            raise ValueError("--keep-offer is simulated only: the runtime's prefill worker does not take a KV handoff")
        self.config = config
        self.model_name = model_name or os.path.basename(os.path.normpath(config.model))
        self._model_config = ModelConfig.from_pretrained(config.model)
        self.max_model_len = config.max_model_len or self._model_config.max_position_embeddings
        self._tokenizer: Any | None = None
        self.eos_token_id: int | None = None
        self.instances: dict[str, InstanceInfo] = {}
        self.streams: dict[str, _Stream] = {}
        self._by_engine_id: dict[str, _Stream] = {}  # the current attempt's engine id -> its stream
        self.num_recovered = 0  # requests sent again after an instance holding them died
        self.num_dropped_frames = 0  # control frames that failed authentication or parsing
        self.policy = GlobalPolicy(LocalPrefillConfig(
            enabled=config.local_prefill and config.disaggregated, interference_weight=config.local_prefill_weight,
        ), config.prefix_affinity())
        self.flip_policy = PDController(config.pd_controller_config())  # core.pd_controller
        self.flip_log: list[dict[str, Any]] = []
        self.scale_log: list[dict[str, Any]] = []  # add / remove / replace events, in order
        self.scale_policy = ScalePolicy(config.scale_config())
        self.rebalancer = Rebalancer(config.rebalance_config())
        self.num_migrated = 0  # requests handed back unstarted and routed again (--rebalance)
        self.migration = MigrationPlanner(config.migration_config())  # live migration of running decodes
        self.migration_log: dict[str, Any] = {"moves": 0, "moved": 0, "returned": 0, "seconds": 0.0, "bytes": 0,
                                              "moved_by_reason": {}, "recent": []}
        self._next_id: dict[str, int] = {}  # role -> next instance number (ids are never reused)
        self._front_address = ""
        self._scale_lock = asyncio.Lock()  # one membership change at a time
        self.transfer_log = {"count": 0, "bytes": 0, "seconds": 0.0, "failed": 0}
        self.num_kept_decodes = 0  # requests a prefill instance decoded itself (--keep-decode)
        self.ttft_by_prefill_role: dict[str, list] = {}  # role -> [requests, summed TTFT seconds]
        self.predictor_log = {"count": 0, "seconds": 0.0}
        self.metrics: Any = None  # a server.metrics.ServerMetrics, set by the server
        self._ctx: zmq.asyncio.Context | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._started = False
        self._closing = False
        self._kv_init_method = ""  # torchdist rendezvous, chosen at start
        self._launcher: LocalLauncher | RayLauncher | None = None

    # ---- EngineClient ----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    def is_healthy(self) -> bool:
        """Started, not closing, and able to serve a new request: a live instance can prefill it and, when
        disaggregated, a live instance can decode it (a dead instance's requests are recovered by the others)."""
        if not self._started or self._closing:
            return False
        live = {i.role for i in self.instances.values() if i.alive and not i.member.state.final}
        if not live & {"prefill", "colocated"} and not (self.config.local_prefill and "decode" in live):
            return False
        return not self.config.disaggregated or self.config.keep_decode or "decode" in live

    async def start(self) -> None:
        """Place and start the instances, load the tokenizer meanwhile, wait for every instance's hello, hand out
        the peer table. On any failure every started instance is stopped and the launcher closed."""
        try:
            await self._start()
        except BaseException:
            await self._kill_all()
            if self._launcher is not None:
                self._launcher.close()
                self._launcher = None
            raise

    async def _start(self) -> None:
        from tetriinfer.engine.tokenizer_loader import load_tokenizer

        if self.config.load_format in ("fast", "fast-shm"):
            # Make the fast checkpoint once, here, before instances race to (and time out making) it.
            from tetriinfer.engine.loader import ensure_checkpoint, parse_dtype

            await asyncio.to_thread(ensure_checkpoint, self.config.model, parse_dtype(self.config.dtype))
        c = self.config
        self._launcher = await asyncio.to_thread(
            make_launcher, c.launcher, ray_address=c.ray_address, cores_per_instance=c.cores_per_instance,
            device=c.device, placement_timeout_s=c.startup_timeout_s, warm_spares=c.warm_spares,
            local_host=c.instance_host)
        roles = c.roles()
        slots = await asyncio.to_thread(self._launcher.place, len(roles))
        if c.kv_backend.split(":")[-1] == "shm" and len({s.node for s in slots}) > 1:
            raise RuntimeError(f"kv backend {c.kv_backend!r} needs every instance on one host; Ray placed them on "
                               f"{len({s.node for s in slots})} nodes (use --kv-backend tcp)")
        front_host = self._launcher.frontend_host()
        self._ctx = zmq.asyncio.Context()
        if ":" in front_host:  # IPv6 node addresses: every control socket speaks IPv6
            self._ctx.setsockopt(zmq.IPV6, 1)
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{url_host(front_host)}")
        address = f"tcp://{url_host(front_host)}:{port}"
        if c.kv_backend.split(":")[-1] == "torchdist":
            self._kv_init_method = f"tcp://127.0.0.1:{free_loopback_port()}"
        self._front_address = address
        for slot, role in zip(slots, roles, strict=True):
            await self._launch(role, slot)
        # The tokenizer loads (seconds: transformers' import) while the instances start, not before.
        if self.config.load_format != "dummy":
            self._tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
        eos = self._model_config.eos_token_id
        if eos is None and self._tokenizer is not None:
            eos = self._tokenizer.eos_token_id
        self.eos_token_id = eos
        await self._await_hellos()
        for info in self.instances.values():
            self._connect(info)
        await self._send_peer_table()
        if c.warm_spares:
            await asyncio.to_thread(self._launcher.prime, self._instance_env())  # for scale-out and replacements
        self._started = True
        self._tasks.append(asyncio.create_task(self._receive_loop()))
        self._tasks.append(asyncio.create_task(self._monitor_loop()))

    @staticmethod
    def _instance_env() -> dict[str, str]:
        """Environment of every instance: offline, unbuffered, and the control key its frames are signed with."""
        return {**INSTANCE_ENV, CONTROL_KEY_ENV: front_end_control_key().hex()}

    async def _launch(self, role: str, slot: Slot) -> InstanceInfo:
        """Start one instance of ``role`` in ``slot`` (its id: the role's next number) and add it to the table."""
        n = self._next_id.get(role, 0)
        self._next_id[role] = n + 1
        iid = {"prefill": "prefill-", "decode": "decode-", "colocated": "instance-"}[role] + str(n)
        spec = self._spec(iid, role, slot, self._front_address)
        assert self._launcher is not None
        proc = await asyncio.to_thread(
            self._launcher.start, slot, [*INSTANCE_MODULE, encode_spec(spec).hex()], self._instance_env())
        info = InstanceInfo(iid, role, proc, node=slot.node, slot=slot)
        self.instances[iid] = info
        return info

    def _connect(self, info: InstanceInfo) -> None:
        assert self._ctx is not None and info.hello is not None
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(info.hello.address)
        info.socket = sock
        info.member.to(MemberState.SERVING, time.time())

    async def _send_peer_table(self) -> None:
        """Every connected instance learns the current membership (added ones appear, removed ones vanish)."""
        table = {i.instance_id: i.hello.address for i in self.instances.values() if i.hello and i.alive}
        for info in self.instances.values():
            if info.socket is not None and info.alive:
                with contextlib.suppress(zmq.ZMQError):
                    await info.socket.send(encode(PeerTable(table)))

    # ---- membership: scale out / in, replace the dead --------------------------------------
    def _roles_allowed(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.config.disaggregated else ("colocated",)

    async def add_instance(self, role: str, *, action: str = "add") -> dict[str, Any]:
        """Scale out: place and start one instance of ``role`` while serving, wait for its hello, tell every
        instance the new membership. It receives work from its first load report on (routing and the decode-load
        broadcast only consider instances that have reported). Raises ValueError for a role this mode has no use
        for or a KV backend with a fixed membership; RuntimeError when it cannot start (nothing is left behind)."""
        if role not in self._roles_allowed():
            raise ValueError(f"mode {self.config.mode!r} runs {' and '.join(self._roles_allowed())} instances, "
                             f"not {role!r}")
        if self.config.kv_backend.split(":")[-1] == "torchdist":
            raise ValueError("kv backend 'torchdist' has a fixed world size: instances cannot be added")
        if not self._started or self._closing:
            raise RuntimeError("the cluster is not running")
        async with self._scale_lock:
            assert self._launcher is not None
            t0 = time.perf_counter()
            slot = (await asyncio.to_thread(self._launcher.place, 1))[0]
            if self.config.kv_backend.split(":")[-1] == "shm" and any(
                    i.node != slot.node for i in self.instances.values() if i.alive):
                self._launcher.release(slot)
                raise ValueError("kv backend 'shm' needs every instance on one host; the new one was placed on "
                                 "another node")
            spares_used = self._launcher.spares_used
            info = await self._launch(role, slot)
            warm = self._launcher.spares_used > spares_used
            deadline = time.monotonic() + self.config.startup_timeout_s
            while info.hello is None:
                failed = (f"exited with code {info.process.returncode} during startup" if not info.alive
                          else "did not start in time" if time.monotonic() > deadline else None)
                if failed:
                    if info.alive:
                        info.process.kill()
                    await asyncio.to_thread(info.process.wait, 30)
                    self.instances.pop(info.instance_id, None)
                    self._launcher.release(slot)
                    raise RuntimeError(f"new {role} instance {info.instance_id} {failed}")
                await asyncio.sleep(0.05)
            self._connect(info)
            await self._send_peer_table()
            entry = {"action": action, "instance": info.instance_id, "role": role, "node": slot.node,
                     "startup_s": time.perf_counter() - t0, "warm": warm, "time": time.time()}
            self.scale_log.append(entry)
            return entry

    async def remove_instance(self, instance_id: str, *, timeout_s: float = 600.0, action: str = "remove",
                              on_draining: Callable[[], None] | None = None) -> dict[str, Any]:
        """Scale in: stop routing and dispatching to the instance, let it finish everything it holds (queued
        prompts, transfers, running decodes), then it exits and leaves the membership. No request is lost: the
        instance is only told to retire after prefill instances have seen a decode-load broadcast without it, and
        it waits out a grace period of emptiness for dispatches decided before that. Refuses (ValueError) to
        remove the last live instance that can prefill, or the last decode instance of a disaggregated cluster.
        A dead instance is just dropped from the table. KeyError: no such instance. ``on_draining`` runs once the
        instance is marked retiring. The membership lock is held while marking and while leaving, not during the
        drain: other changes (an addition, another removal) go ahead meanwhile."""
        async with self._scale_lock:
            info = self.instances.get(instance_id)
            if info is None:
                raise KeyError(instance_id)
            if info.member.draining:
                raise ValueError(f"instance {instance_id} is already being removed")
            t0 = time.perf_counter()
            if info.alive:
                others = [i for i in self.instances.values() if i.routable and i is not info]
                if not any(i.role == info.role for i in others):
                    raise ValueError(f"{instance_id} is the last live {info.role} instance: add another first")
                info.member.to(MemberState.DRAINING, time.time())
                if self.config.flip:
                    self.flip_policy.remove(instance_id)
        if on_draining is not None:
            on_draining()
        if info.alive:
            # two broadcasts without it before it is told to retire: prefill instances stop dispatching to it
            await asyncio.sleep(2.5 * self.config.report_interval_s)
            assert info.socket is not None
            await info.socket.send(encode(Retire(grace_s=max(0.3, 3 * self.config.report_interval_s))))
            deadline = time.monotonic() + timeout_s
            while info.retired is None and info.alive and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if not info.alive:  # retired -- or crashed mid-drain: then what it held ends now, before it leaves
                grace_end = time.monotonic() + self._exit_grace_s()
                while info.retired is None and time.monotonic() < grace_end:
                    await asyncio.sleep(0.05)
                self._declare_gone(info, time.time())
                self._fail_streams_of_dead()
            if info.retired is None and info.alive:
                info.member.to(MemberState.SERVING, time.time())  # give it back its work rather than kill it
                raise RuntimeError(f"{instance_id} did not drain within {timeout_s:.0f} s; it keeps serving")
            try:
                await asyncio.to_thread(info.process.wait, 30)
            except subprocess.TimeoutExpired:
                info.process.kill()
                await asyncio.to_thread(info.process.wait, 30)
        async with self._scale_lock:
            if not info.alive:  # dead before it was asked, or crashed while draining: what it held ends now
                self._declare_gone(info, time.time())
                self._fail_streams_of_dead()
            entry = {"action": action, "instance": instance_id, "role": info.role, "node": info.node,
                     "drain_s": info.retired.drain_s if info.retired else None,
                     "total_s": time.perf_counter() - t0, "was_dead": info.retired is None, "time": time.time()}
            self._forget(info)
            await self._send_peer_table()
            self.scale_log.append(entry)
            return entry

    def _forget(self, info: InstanceInfo) -> None:
        self.instances.pop(info.instance_id, None)
        if info.socket is not None:
            info.socket.close(linger=0)
        if self._launcher is not None and info.slot is not None:
            self._launcher.release(info.slot)
        if self.config.flip:
            self.flip_policy.remove(info.instance_id)
        self.rebalancer.forget(info.instance_id)
        self.migration.forget(info.instance_id)
        self.policy.forget_instance(info.instance_id)

    async def _autoscale(self, cmd: ScaleCommand) -> None:
        """Carry out one autoscaling command; the policy hears once when it is done (an ADD: its instances serve; a
        REMOVE: its instance drains) or failed, and cools down."""
        told = False

        def tell() -> None:
            nonlocal told
            if not told:
                told = True
                self.scale_policy.finished(time.time())

        try:
            if cmd.action is ScaleAction.ADD:
                for _ in range(cmd.count):  # membership changes run one at a time (the scale lock)
                    entry = await self.add_instance(cmd.role, action="autoscale-add")
                    entry["mean_load"] = cmd.mean_load
            else:
                assert cmd.instance_id is not None
                entry = await self.remove_instance(cmd.instance_id, action="autoscale-remove", on_draining=tell)
                entry["mean_load"] = cmd.mean_load
        except Exception as e:  # noqa: BLE001 - recorded; the pool stays as it is
            self.scale_log.append({"action": f"autoscale-{cmd.action.value}-failed", "role": cmd.role,
                                   "instance": cmd.instance_id, "error": str(e), "time": time.time()})
        finally:
            tell()

    async def _replace(self, dead: InstanceInfo) -> None:
        """--replace-dead: a dead instance (its requests already ended with an error) leaves the table and a new
        one of its role takes its place (on a warm host with --load-format fast-shm, in about a second)."""
        async with self._scale_lock:
            self._forget(dead)
            self.scale_log.append({"action": "died", "instance": dead.instance_id, "role": dead.role,
                                   "node": dead.node, "exit_code": dead.process.returncode, "time": time.time()})
        try:
            await self.add_instance(dead.role, action="replace")
        except Exception as e:  # noqa: BLE001 - recorded; the cluster keeps serving with what it has
            self.scale_log.append({"action": "replace-failed", "role": dead.role, "error": str(e),
                                   "time": time.time()})

    def _spec(self, iid: str, role: str, slot: Slot, frontend: str) -> InstanceSpec:
        c = self.config
        pol = c.role_policies()
        index = slot.index
        return InstanceSpec(
            instance_id=iid, role=role, frontend_address=frontend, model=c.model, host=slot.host, dtype=c.dtype,
            device=c.device, load_format=c.load_format, chunk_size=c.chunk_size, block_size=c.block_size,
            pad_last_chunk=c.pad_last_chunk,
            num_kv_blocks=c.num_kv_blocks, kv_cache_memory_gb=c.kv_cache_memory_gb, max_num_seqs=c.max_num_seqs,
            max_model_len=self.max_model_len, cpu_cores=c.cores_for(slot.local_index),
            num_threads=c.cores_per_instance if c.device == "cpu" else None, nice=c.instance_nice,
            prefill_rt_priority=c.prefill_rt_priority, seed=c.seed + index,
            enable_prefix_caching=c.enable_prefix_caching,
            prefill_policy=pol.prefill_policy, prefill_sched_batch=c.prefill_sched_batch,
            cache_aware_prefill_order=c.cache_aware_prefill_order, prefill_merge_limit=c.prefill_merge_limit,
            prefill_tail_tokens=c.prefill_tail_tokens, dispatch_policy=pol.dispatch_policy, decode_policy=pol.decode_policy,
            colocated_policy=pol.colocated_policy, max_num_batched_tokens=pol.max_num_batched_tokens,
            heavy_decode_tokens=c.heavy_decode_tokens, keep_decode=pol.keep_decode,
            keep_decode_ratio=c.keep_decode_ratio, keep_decode_rule=c.keep_decode_rule,
            prompt_only_prefill=c.prompt_only_prefill, dispatch_when_full=c.dispatch_when_full, kv_backend=c.kv_backend, kv_rank=index,
            kv_world_size=len(c.roles()), kv_init_method=self._kv_init_method, kv_transfer=c.kv_transfer, kv_handoff=c.kv_handoff,
            link_bandwidth=c.link_bandwidth,
            transfer_timeout_s=c.transfer_timeout_s, transfer_attempts=c.transfer_attempts,
            fault_drop_p=c.fault_drop_p, fault_delay_p=c.fault_delay_p, fault_corrupt_p=c.fault_corrupt_p,
            predictor=pol.predictor, predictor_mode=c.predictor_mode, report_interval_s=c.report_interval_s,
        )

    async def _await_hellos(self) -> None:
        assert self._pull is not None
        deadline = time.monotonic() + self.config.startup_timeout_s
        while any(i.hello is None for i in self.instances.values()):
            for info in self.instances.values():
                if info.process.poll() is not None:
                    await self._kill_all()
                    raise RuntimeError(
                        f"instance {info.instance_id} exited with code {info.process.returncode} during startup"
                    )
            if time.monotonic() > deadline:
                await self._kill_all()
                raise RuntimeError("instances did not start in time")
            if await self._pull.poll(200):
                try:
                    msg = decode(await self._pull.recv())
                except Exception:  # noqa: BLE001 - an unauthenticated or malformed frame is dropped
                    continue
                if isinstance(msg, Hello) and msg.instance_id in self.instances:
                    self.instances[msg.instance_id].hello = msg
                    self.instances[msg.instance_id].last_seen = time.time()

    async def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for info in self.instances.values():
            if info.socket is not None:
                with contextlib.suppress(zmq.ZMQError):
                    await info.socket.send(encode(Shutdown()))
        await self._kill_all(grace_s=10.0)
        for s in self.streams.values():
            if not s.finished:
                self._finish_stream(s, "abort", error="server shutting down")
        for info in self.instances.values():
            if info.socket is not None:
                info.socket.close(linger=0)
        if self._pull is not None:
            self._pull.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._launcher is not None:
            self._launcher.close()

    async def _kill_all(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        for info in self.instances.values():
            while info.process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if info.process.poll() is None:
                info.process.terminate()
        for info in self.instances.values():
            try:
                info.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                info.process.kill()
                info.process.wait()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        oracle_output_tokens: int | None = None,
    ) -> AsyncIterator[TokenEvent]:
        if not self._started or self._closing:
            raise RuntimeError("the cluster is not running")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_token_ids)} tokens (prompt + at least one output token must fit)"
            )
        vocab = self._model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if request_id in self.streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        if oracle_output_tokens is None and (params.ignore_eos or params.min_tokens >= params.max_tokens):
            oracle_output_tokens = params.max_tokens  # the output length is known exactly (oracle ablations)
        stream = _Stream(request_id, len(prompt_token_ids))
        self.streams[request_id] = stream
        self._by_engine_id[request_id] = stream
        self.policy.add(request_id, time.time(), len(prompt_token_ids), prompt_token_ids=prompt_token_ids)
        try:
            msg = NewRequest(
                request_id, list(prompt_token_ids), WireParams.from_params(params), time.time(),
                self.eos_token_id, oracle_output_tokens,
            )
            stream.new_request = stream.original = msg
            target = await self._route(request_id)
            stream.instances.add(target)
            stream.prefill_id = target
            if stream.attempt == 0 and not stream.finished:  # else an instance died meanwhile: recovery sent it
                await self._send_to(stream, target, msg)
            while True:
                event: TokenEvent = await stream.queue.get()
                yield event
                if event.finished:
                    return
        finally:
            if not stream.finished:
                await self.abort(request_id)
            self.streams.pop(request_id, None)
            if self._by_engine_id.get(stream.engine_id) is stream:
                del self._by_engine_id[stream.engine_id]
            with contextlib.suppress(KeyError, ValueError):
                self._count_ttft(self.policy.forget(request_id))

    def _count_ttft(self, rec: Any) -> None:
        """Front-end TTFT of a request that got a first token, by the role of the instance that prefilled it
        (``prefill``; ``decode`` = conditional disaggregation; ``colocated``): where the TTFT goes."""
        info = self.instances.get(rec.prefill_instance) if rec.prefill_instance else None
        if rec.ttft is None or info is None:
            return
        acc = self.ttft_by_prefill_role.setdefault(info.role, [0, 0.0])
        acc[0] += 1
        acc[1] += rec.ttft

    async def _route(self, request_id: str, avoid: str | None = None) -> str:
        """The instance that prefills this request; only live instances are candidates (a dead one's last load
        report stays in the table), and not ``avoid`` while another live instance of its role is. Raises when no
        instance that can prefill is alive."""
        while True:
            live = [i for i in self.instances.values() if i.routable]
            avoided = self.instances.get(avoid) if avoid is not None else None
            if avoided is not None and any(i.role == avoided.role and i is not avoided for i in live):
                live = [i for i in live if i is not avoided]
            if not any(i.role in ("prefill", "colocated") or (self.config.local_prefill and i.role == "decode")
                       for i in live):
                raise RuntimeError("no live instance can prefill this request (see /cluster)")
            if self.config.disaggregated and not self.config.keep_decode and not any(i.role == "decode" for i in live):
                raise RuntimeError("no live decode instance (see /cluster)")
            loads = [load_from_wire(i.load) for i in live if i.load is not None]
            loads = self.flip_policy.annotate(loads) if self.config.flip else loads
            if not loads:  # before the first reports: route by index
                firsts = [i.instance_id for i in live if i.role in ("prefill", "colocated")]
                loads = [LoadReport(iid, Role.PREFILL) for iid in firsts]
            iid = self.policy.route(request_id, loads, time.time())
            if iid is not None:
                return iid
            await asyncio.sleep(self.config.report_interval_s)

    async def abort(self, request_id: str) -> None:
        stream = self.streams.get(request_id)
        if stream is not None and not stream.finished:
            self._finish_stream(stream, "abort")
        engine_id = stream.engine_id if stream is not None else request_id
        for info in list(self.instances.values()):
            if info.socket is not None and info.process.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    await info.socket.send(encode(Abort(engine_id)))

    async def _send_to(self, stream: _Stream, target: str, msg: NewRequest) -> None:
        """Send ``msg`` (the stream's current attempt) to ``target``; if it is gone meanwhile, recover."""
        info = self.instances.get(target)
        try:
            await info.socket.send(encode(msg))  # type: ignore[union-attr]
        except (AttributeError, zmq.ZMQError):
            self._recover(stream, f"instance {target} is gone")

    def _stream_of(self, engine_id: str) -> _Stream | None:
        """The unfinished stream whose current attempt has this engine id (None: an older attempt, or ended)."""
        stream = self._by_engine_id.get(engine_id)
        return None if stream is None or stream.finished else stream

    # ---- recovery after an instance died ---------------------------------------------------
    def _recover(self, stream: _Stream, why: str) -> None:
        """Send ``stream``'s request again to a live instance as a continuation (``runtime.recovery``); survivors
        abort the old attempt. Ends the stream with an error only when no live instance can take it."""
        if stream.finished or stream.recovering or stream.original is None:
            return
        if len(stream.streamed) >= stream.original.params.max_tokens:  # every token arrived, only its end was lost
            self._finish_stream(stream, "length")
            self._tasks.append(asyncio.create_task(self._broadcast_aborts([stream.engine_id])))
            return
        old = stream.engine_id
        stream.recovering = True
        stream.attempt += 1
        stream.offset = stream.next_index
        stream.pending.clear()
        stream.instances = set()
        stream.prefill_id = None
        if self._by_engine_id.get(old) is stream:
            del self._by_engine_id[old]
        self._tasks.append(asyncio.create_task(self._broadcast_aborts([old])))
        try:
            msg = continuation(stream.original, stream.attempt, stream.streamed)
        except ValueError as e:
            self._finish_stream(stream, "error", error=f"{why}; cannot continue: {e}")
            return
        stream.engine_id = msg.request_id
        stream.new_request = msg
        self._by_engine_id[msg.request_id] = stream
        self.num_recovered += 1
        self._tasks.append(asyncio.create_task(self._resend(stream, msg, why)))

    async def _resend(self, stream: _Stream, msg: NewRequest, why: str) -> None:
        rid = stream.request_id
        try:
            with contextlib.suppress(KeyError, ValueError):
                self.policy.restart(rid, len(msg.prompt_token_ids))
            target = await self._route(rid)
        except RuntimeError as e:  # nothing live can prefill it
            stream.recovering = False
            self._finish_stream(stream, "error", error=f"{why}; {e}")
            return
        except (KeyError, ValueError):  # ended (and maybe forgotten) meanwhile
            stream.recovering = False
            if not stream.finished:
                self._finish_stream(stream, "error", error=f"{why}; the request could not be routed again")
            return
        stream.recovering = False
        if stream.finished or stream.engine_id != msg.request_id:
            return
        stream.instances.add(target)
        stream.prefill_id = target
        await self._send_to(stream, target, msg)

    # ---- receiving -------------------------------------------------------------------------
    def _finish_stream(self, stream: _Stream, reason: str, stop: int | None = None, error: str | None = None) -> None:
        if stream.finished:
            return
        stream.finished = True
        phase = {"abort": Phase.ABORTED, "error": Phase.FAILED}.get(reason, Phase.FINISHED)
        with contextlib.suppress(KeyError):
            self.policy.on_terminal(stream.request_id, phase, time.time(), reason)
        now = time.perf_counter()
        metrics = {"e2e_s": now - stream.arrival}
        if stream.first_token is not None:
            metrics["ttft_s"] = stream.first_token - stream.arrival
        stream.queue.put_nowait(
            TokenEvent(stream.request_id, (), True, reason, stop, error=error,
                       num_prompt_tokens=stream.num_prompt_tokens, metrics=metrics)
        )

    def _on_tokens(self, msg: Tokens) -> None:
        for item in msg.items:
            stream = self._stream_of(item.request_id)
            if stream is None or stream.recovering:
                continue
            stream.instances.add(msg.instance_id)
            if msg.instance_id != stream.prefill_id and item.token_ids:
                stream.instances.discard(stream.prefill_id)  # decoding elsewhere: the KV left its prefill instance
            stream.pending[item.index + stream.offset] = item
            while stream.next_index in stream.pending and not stream.finished:
                it = stream.pending.pop(stream.next_index)
                if it.token_ids:
                    if stream.first_token is None:
                        stream.first_token = time.perf_counter()
                    stream.next_index += len(it.token_ids)
                    stream.streamed.extend(it.token_ids)
                    with contextlib.suppress(KeyError):
                        self.policy.on_tokens(stream.request_id, len(it.token_ids), time.time())
                    stream.queue.put_nowait(
                        TokenEvent(stream.request_id, tuple(it.token_ids), num_prompt_tokens=stream.num_prompt_tokens)
                    )
                if it.finished:
                    self._finish_stream(stream, it.finish_reason or "stop", it.stop_reason, it.error)
            # An error can be reported at an index tokens never reached (e.g. a failed transfer).
            for idx, it in list(stream.pending.items()):
                if it.finished and it.finish_reason == "error" and not stream.finished:
                    stream.pending.pop(idx)
                    self._finish_stream(stream, "error", error=it.error)

    async def _receive_loop(self) -> None:
        assert self._pull is not None
        while True:
            data = await self._pull.recv()
            try:
                msg = decode(data)
            except Exception:  # noqa: BLE001 - an unauthenticated or malformed frame is dropped, never unpickled
                self.num_dropped_frames += 1
                continue
            if isinstance(msg, Tokens):
                self._on_tokens(msg)
            elif isinstance(msg, WireLoad):
                info = self.instances.get(msg.instance_id)
                if info is not None:
                    info.load = msg
                    info.last_seen = time.time()
                    info.role = msg.role if info.role != "colocated" else info.role
            elif isinstance(msg, Dispatched):
                stream = self._stream_of(msg.request_id)
                if stream is None or stream.recovering:
                    continue
                stream.instances.add(msg.decode_id)  # it holds the request from now on: its failure must recover it
                with contextlib.suppress(KeyError, ValueError):
                    self.policy.on_dispatched(stream.request_id, msg.decode_id)
                self._recover_if_gone(stream, msg.decode_id)
                target = self.instances.get(msg.decode_id)
                if target is not None and target.role == "prefill":  # kept there to decode (--keep-decode)
                    self.num_kept_decodes += 1
            elif isinstance(msg, TransferStat):
                self.transfer_log["count"] += 1
                self.transfer_log["bytes"] += msg.num_bytes
                self.transfer_log["seconds"] += msg.seconds
                self.transfer_log["failed"] += int(msg.outcome != "done")
                if self.metrics is not None:
                    self.metrics.observe_transfer(msg.num_bytes, msg.seconds, backend=msg.backend, outcome=msg.outcome)
            elif isinstance(msg, RoleSwitched):
                self._on_switched(msg)
            elif isinstance(msg, Hello):  # an instance added while serving
                info = self.instances.get(msg.instance_id)
                if info is not None and info.hello is None:
                    info.hello = msg
                    info.last_seen = time.time()
            elif isinstance(msg, Yielded):
                self._tasks.append(asyncio.create_task(self._on_yielded(msg)))
            elif isinstance(msg, Migrating):
                for rid in msg.request_ids:  # its target now holds it too: a failure there must recover it
                    stream = self._stream_of(rid)
                    if stream is None or stream.recovering:
                        continue
                    stream.instances.add(msg.target)
                    with contextlib.suppress(KeyError, ValueError):
                        self.policy.on_dispatched(stream.request_id, msg.target)
                    self._recover_if_gone(stream, msg.target)
            elif isinstance(msg, MigrationDone):
                self._on_migration_done(msg)
            elif isinstance(msg, Retired):
                info = self.instances.get(msg.instance_id)
                if info is not None:
                    info.retired = msg
                    if info.member.draining:
                        info.member.to(MemberState.RETIRED, time.time())
            elif isinstance(msg, PredictorStat):
                self.predictor_log["count"] += len(msg.latencies_s)
                self.predictor_log["seconds"] += sum(msg.latencies_s)
                if self.metrics is not None and hasattr(self.metrics, "observe_predictor"):
                    for secs in msg.latencies_s:
                        self.metrics.observe_predictor(secs)

    async def _on_yielded(self, msg: Yielded) -> None:
        """Queue rebalancing: the donor handed these requests back unstarted; route each again, the donor
        avoided. A request whose client went away meanwhile is dropped (its abort already went to every
        instance); one that cannot be routed now waits in ``_route`` like a new arrival."""
        self.rebalancer.done(msg.instance_id)
        for eid in msg.request_ids:
            stream = self._stream_of(eid)
            if stream is None or stream.recovering or stream.new_request is None:
                continue
            rid = stream.request_id
            try:
                self.policy.reroute(rid)
                target = await self._route(rid, avoid=msg.instance_id)
            except (KeyError, ValueError):
                continue  # ended meanwhile
            except RuntimeError as e:  # nothing left that can prefill it
                self._finish_stream(stream, "error", error=str(e))
                continue
            if stream.finished or stream.engine_id != eid:
                continue
            stream.instances.discard(msg.instance_id)
            stream.instances.add(target)
            stream.prefill_id = target
            self.num_migrated += 1
            await self._send_to(stream, target, stream.new_request)

    def _on_migration_done(self, msg: MigrationDone) -> None:
        self.migration.done(msg.instance_id)
        log = self.migration_log
        log["moves"] += 1
        log["moved"] += len(msg.moved)
        log["returned"] += len(msg.returned)
        log["seconds"] += msg.seconds
        log["bytes"] += msg.num_bytes
        by_reason = log["moved_by_reason"]
        by_reason[msg.reason] = by_reason.get(msg.reason, 0) + len(msg.moved)
        log["recent"] = [*log["recent"][-49:], {"source": msg.instance_id, "reason": msg.reason,
                                                "moved": len(msg.moved), "returned": len(msg.returned),
                                                "seconds": msg.seconds, "bytes": msg.num_bytes, "time": time.time()}]
        for eid in msg.moved:  # its source no longer holds it
            stream = self._stream_of(eid)
            if stream is not None:
                stream.instances.discard(msg.instance_id)
        for eid in msg.returned:  # it decodes on at its source
            stream = self._stream_of(eid)
            if stream is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.policy.on_dispatched(stream.request_id, msg.instance_id)

    async def _plan_migrations(self) -> None:
        """Live migration round: evacuate decode or colocated instances that are leaving (retiring, or draining
        for a flip), balance the others within their tier (``core.migration``)."""
        members = [i for i in self.instances.values() if i.alive and i.socket is not None and i.load is not None]
        loads = [load_from_wire(i.load) for i in members]  # type: ignore[arg-type]
        roles = {i.instance_id: i.role for i in members}
        evacuate = {i.instance_id for i in members if i.role in MIGRATION_ROLES and (
            i.member.draining or i.load.state == "draining")}  # type: ignore[union-attr]
        routable = {i.instance_id for i in members if i.routable}
        loads = [r for r in loads if r.instance_id in routable or r.instance_id in evacuate]
        for cmd in self.migration.plan(loads, roles, evacuate):
            info = self.instances[cmd.source]
            try:
                await info.socket.send(encode(Migrate([list(t) for t in cmd.targets], cmd.reason)))  # type: ignore[union-attr]
            except zmq.ZMQError:
                self.migration.done(cmd.source)

    def _on_switched(self, msg: RoleSwitched) -> None:
        info = self.instances[msg.instance_id]
        old = info.role
        info.role = msg.role
        info.flips += 1
        self.policy.forget_instance(msg.instance_id)  # its routing history and cache model are of the old role
        rec = self.flip_policy.on_switched(msg.instance_id, time.time())
        entry = {"instance": msg.instance_id, "from": old, "to": msg.role, "drain_s": msg.drain_s,
                 "switch_s": msg.switch_s, "total_s": rec.total_s if rec else None, "time": time.time()}
        self.flip_log.append(entry)
        if self.metrics is not None:
            self.metrics.observe_flip(old, msg.role, msg.switch_s)

    async def _monitor_loop(self) -> None:
        interval = self.config.report_interval_s
        while True:
            await asyncio.sleep(interval)
            self._check_processes()
            loads = [load_from_wire(i.load) for i in self.instances.values() if i.load is not None and i.routable]
            if self.config.autoscale and self._started and not self._closing:
                roles = {i.instance_id: i.role for i in self.instances.values() if i.routable}
                for cmd in self.scale_policy.observe(loads, roles, time.time()):
                    self._tasks.append(asyncio.create_task(self._autoscale(cmd)))
            if self.config.rebalance and self._started and not self._closing:
                roles = {i.instance_id: i.role for i in self.instances.values() if i.routable}
                for move in self.rebalancer.plan(loads, roles):
                    await self.instances[move.donor].socket.send(encode(Yield(move.count)))  # type: ignore[union-attr]
            if self.config.migrate and self._started and not self._closing:
                await self._plan_migrations()
            if self.config.flip and self.config.disaggregated and loads:
                for cmd in self.flip_policy.observe(loads, time.time()):
                    info = self.instances[cmd.instance_id]
                    switch = cmd.action is FlipAction.SWITCH
                    await info.socket.send(encode(SetRole(cmd.to_role.value, switch)))  # type: ignore[union-attr]
                loads = self.flip_policy.annotate(loads)
            if not self.config.disaggregated:
                continue
            decode_loads = [  # live ones only: prefill instances must not dispatch to a dead decode instance
                i.load for i in self.instances.values()
                if i.load is not None and i.load.role == "decode" and i.routable
            ]
            annotated = {r.instance_id: r for r in loads}
            from tetriinfer.runtime.worker_base import wire_load

            payload = []
            for w in decode_loads:
                rep = annotated.get(w.instance_id, load_from_wire(w))
                payload.append(encode_load(wire_load(replace(rep), w.busy_s, w.steps)))
            msg = encode(DecodeLoads(payload, [r.instance_id for r in accepting(loads, Role.PREFILL)]))
            for info in self.instances.values():
                if info.role == "prefill" and info.socket is not None and info.alive:
                    await info.socket.send(msg)

    def _exit_grace_s(self) -> float:
        """How long an exited draining instance's ``Retired`` (sent just before it exits) may take to arrive."""
        return max(1.0, 5 * self.config.report_interval_s)

    def _check_processes(self) -> None:
        """Instances whose process exited: RETIRED ones were expected to; any other becomes DEAD (a draining one
        once its ``Retired`` had time to arrive) and, with --replace-dead, a dead one that was serving is replaced.
        Every round, unfinished requests that touched a DEAD instance end with an error."""
        if self._closing:
            return
        now = time.time()
        for info in list(self.instances.values()):
            if info.alive or info.member.state.final:
                continue
            if info.exited_at is None:
                info.exited_at = now
            if info.member.draining and info.retired is None and now - info.exited_at < self._exit_grace_s():
                continue  # its Retired may still be on the wire
            was_draining = info.member.draining
            self._declare_gone(info, now)
            if (info.member.state is MemberState.DEAD and not was_draining and self.config.replace_dead
                    and self._started and not info.replacing):
                info.replacing = True
                self._tasks.append(asyncio.create_task(self._replace(info)))
        self._fail_streams_of_dead()

    def _declare_gone(self, info: InstanceInfo, now: float) -> None:
        """An exited instance leaves the live states: RETIRED if it said so, else DEAD."""
        if info.member.state.final:
            return
        if info.member.draining and info.retired is not None:
            info.member.to(MemberState.RETIRED, now)
        else:
            info.member.to(MemberState.DEAD, now)
            self.migration.forget(info.instance_id)
            self.rebalancer.forget(info.instance_id)
            self.policy.forget_instance(info.instance_id)  # what was routed there is recovered, not counted

    def _recover_if_gone(self, stream: _Stream, instance_id: str) -> None:
        """A request handed to an instance that already died (and, with --replace-dead, left the table) is sent
        again now, not when the handover times out; the instances still holding the old attempt free it."""
        info = self.instances.get(instance_id)
        if stream.finished or (info is not None and info.member.state is not MemberState.DEAD):
            return
        self._recover(stream, f"instance {instance_id} died")

    def _fail_streams_of_dead(self) -> None:
        """Every unfinished request a DEAD instance held is recovered (sent again to a live instance)."""
        names = {i.instance_id for i in self.instances.values() if i.member.state is MemberState.DEAD}
        if not names:
            return
        for stream in list(self.streams.values()):
            if stream.instances & names and not stream.finished and not stream.recovering:
                self._recover(stream, f"instance {sorted(stream.instances & names)} died")

    async def _broadcast_aborts(self, request_ids: list[str]) -> None:
        for info in list(self.instances.values()):
            if info.socket is None or not info.alive:
                continue
            for rid in request_ids:
                with contextlib.suppress(zmq.ZMQError):
                    await info.socket.send(encode(Abort(rid)))

    # ---- introspection ---------------------------------------------------------------------
    def cluster_info(self) -> dict[str, Any]:
        held: dict[str, int] = {}  # unfinished streams each instance holds, by the router's own bookkeeping
        for stream in self.streams.values():
            if not stream.finished:
                for iid in stream.instances:
                    held[iid] = held.get(iid, 0) + 1
        out = []
        for info in self.instances.values():
            load = info.load
            hello = info.hello
            alive = info.process.poll() is None
            out.append({
                "id": info.instance_id,
                "role": info.role,
                "pid": info.process.pid,
                "host": hello.host if hello else None,
                "node": info.node,
                "retiring": info.member.draining,
                "membership": info.member.state.value,
                "address": hello.address if hello else None,
                "state": (load.state if load else "starting") if alive else "dead",
                "kv_blocks_used": load.num_used_blocks if load else 0,
                "kv_blocks_total": hello.kv_blocks_total if hello else 0,
                "queued": load.num_queued if load else 0,
                "running": load.num_running if load else 0,
                "streams_held": held.get(info.instance_id, 0),
                "utilization": load.utilization if load else 0.0,
                "busy_s": load.busy_s if load else 0.0,
                "steps": load.steps if load else 0,
                "prefix_cache_hit_tokens": load.prefix_hit_tokens if load else 0,
                "prefix_cache_queried_tokens": load.prefix_queried_tokens if load else 0,
                "prefix_cache_blocks": load.prefix_cached_blocks if load else 0,
                "flips": info.flips,
                "last_report_age_s": (time.time() - info.last_seen) if info.last_seen else None,
            })
        return {
            "mode": self.config.mode,
            "instances": out,
            "flips": list(self.flip_log),
            "pd_controller": self.config.pd_controller if self.config.flip else "static",
            "split": [{"time": t, "prefill": p, "decode": d} for t, p, d in self.flip_policy.timeline],
            "scaling": list(self.scale_log),
            "transfers": dict(self.transfer_log),
            "predictor": dict(self.predictor_log),
            "local_prefills": self.policy.num_local_prefills,
            "kept_decodes": self.num_kept_decodes,
            "warm_spares": {"pids": self._launcher.spare_pids if self._launcher else [],
                            "used": self._launcher.spares_used if self._launcher else 0},
            "rebalance": {"moves": self.rebalancer.num_moves, "migrated": self.num_migrated,
                          "pending": sorted(self.rebalancer.pending)},
            "migration": {**{k: v for k, v in self.migration_log.items() if k != "recent"},
                          "moved_by_reason": dict(self.migration_log["moved_by_reason"]),
                          "pending": sorted(self.migration.pending), "recent": list(self.migration_log["recent"])},
            "ttft_by_prefill_role": {role: {"count": n, "mean_s": total / n}
                                     for role, (n, total) in self.ttft_by_prefill_role.items()},
            "requests_in_flight": sum(1 for s in self.streams.values() if not s.finished),
            "recovered": self.num_recovered,
            "dropped_control_frames": self.num_dropped_frames,
        }

