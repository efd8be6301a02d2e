"""One instance process: an engine, a role worker, sockets, a transfer backend, and the step loop.

The loop (single thread): drain control messages -> poll KV transfers -> run one scheduler step ->
flush streamed tokens -> report load every ``report_interval_s``. A role flip (``SetRole``) first
drains, then swaps the worker in place; the model and KV tensors stay loaded.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import time

import zmq

from tetriinfer.core.load import InstanceState
from tetriinfer.core.migration import MIGRATION_ROLES
from tetriinfer.engine.engine_config import EngineConfig
from tetriinfer.engine.llm_engine import build_runner
from tetriinfer.net import url_host
from tetriinfer.runtime.colocated_worker import ColocatedWorker
from tetriinfer.runtime.decode_worker import DecodeWorker
from tetriinfer.runtime.instance_spec import InstanceSpec, decode_spec
from tetriinfer.runtime.messages import (
    CONTROL_KEY_ENV,
    Handoff,
    Hello,
    KVDone,
    Message,
    Migrate,
    MigrationDone,
    PeerTable,
    PredictorStat,
    Retire,
    Retired,
    RoleSwitched,
    SetRole,
    Shutdown,
    Yield,
    Yielded,
    control_key_from_env,
    decode,
    encode,
)
from tetriinfer.runtime.prefill_worker import PrefillWorker
from tetriinfer.runtime.priority import apply_nice, apply_realtime
from tetriinfer.runtime.worker_base import InstanceContext, wire_load

WORKERS = {"prefill": PrefillWorker, "decode": DecodeWorker, "colocated": ColocatedWorker}


def make_transfer_backend(spec: InstanceSpec):
    from tetriinfer.transfer import AgentConfig, FaultPlan, FaultyBackend, PacedLink, make_backend

    name = spec.kv_backend
    faulty = name.startswith("faulty")
    base = name.split(":", 1)[1] if faulty and ":" in name else ("tcp" if faulty else name)
    config = AgentConfig(timeout_s=spec.transfer_timeout_s)
    if base == "torchdist":  # one rank per instance; construction is collective (all instances start together)
        backend = make_backend(base, config=config, rank=spec.kv_rank, world_size=spec.kv_world_size,
                               init_method=spec.kv_init_method)
    elif base == "tcp":
        backend = make_backend(base, config=config, host=spec.host)
    else:
        backend = make_backend(base, config=config)
    if spec.link_bandwidth:
        backend = PacedLink(backend, bandwidth=spec.link_bandwidth, latency=spec.link_latency_s)
    if faulty:
        plan = FaultPlan(
            drop_p=spec.fault_drop_p, delay_p=spec.fault_delay_p, corrupt_p=spec.fault_corrupt_p,
            delay_s=spec.fault_delay_s, seed=spec.seed,
        )
        backend = FaultyBackend(backend, plan)
    return backend


class Instance:
    def __init__(self, spec: InstanceSpec) -> None:
        self.spec = spec
        engine_config = EngineConfig(
            model=spec.model, dtype=spec.dtype, device=spec.device, chunk_size=spec.chunk_size,
            pad_last_chunk=spec.pad_last_chunk,
            block_size=spec.block_size, num_kv_blocks=spec.num_kv_blocks,
            kv_cache_memory_gb=spec.kv_cache_memory_gb, max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len, load_format=spec.load_format, seed=spec.seed,
            num_threads=spec.num_threads, cpu_cores=tuple(spec.cpu_cores) if spec.cpu_cores else None,
            enable_prefix_caching=spec.enable_prefix_caching,
        )
        parts = build_runner(engine_config)
        self.zctx = zmq.Context()
        if ":" in spec.host:  # IPv6 node addresses: every control socket speaks IPv6
            self.zctx.setsockopt(zmq.IPV6, 1)
        self.pull = self.zctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port(f"tcp://{url_host(spec.host)}")
        self.address = f"tcp://{url_host(spec.host)}:{port}"
        self.front = self.zctx.socket(zmq.PUSH)
        self.front.setsockopt(zmq.LINGER, 1000)
        self.front.connect(spec.frontend_address)
        self.peers: dict[str, zmq.Socket] = {}
        self.peer_addresses: dict[str, str] = {}
        self.backend = make_transfer_backend(spec)
        predictor = None
        if spec.role == "prefill" and spec.predictor not in ("", "none"):
            from tetriinfer.engine.llm_engine import load_tokenizer
            from tetriinfer.runtime.predictor_hook import make_predictor_hook

            predictor = make_predictor_hook(spec.predictor, load_tokenizer(spec.model), str(spec.model),
                                            spec.predictor_mode)
        self.ctx = InstanceContext(
            spec=spec, runner=parts.runner, kv_manager=parts.kv_manager, max_model_len=parts.max_model_len,
            backend=self.backend, send_front=self._send_front, send_peer=self._send_peer, predictor=predictor,
        )
        self.worker = WORKERS[spec.role](self.ctx)
        self.role = spec.role
        self.state = InstanceState.ACTIVE
        self.target_role: str | None = None
        self.drain_started = 0.0
        self.retire: Retire | None = None  # scale-in requested: drain, then exit
        self._empty_since: float | None = None
        self.busy_s = 0.0
        self.num_dropped_frames = 0  # control frames that failed authentication or parsing
        self.steps = 0
        self._busy_since_report = 0.0
        self._last_report = 0.0
        self._parent = os.getppid()
        # Everything allocated so far (torch, the model, the engine) lives as long as the process: move it out of
        # the collector's reach, so a full GC pass (~0.25 s with torch's object graph) cannot stall a step.
        gc.collect()
        gc.freeze()
        self._apply_role_priority()
        self._send_front(
            Hello(spec.instance_id, spec.role, self.address, os.getpid(), socket.gethostname(),
                  parts.kv_manager.num_blocks, parts.max_model_len)
        )

    def _apply_role_priority(self) -> None:
        """With ``spec.prefill_rt_priority``: ``SCHED_FIFO`` while this instance holds the prefill role, the normal
        scheduler in any other (runtime.priority). Called at start and after every flip."""
        if self.spec.prefill_rt_priority is None:
            return
        apply_realtime(self.spec.prefill_rt_priority if self.role == "prefill" else None, self.spec.instance_id)

    # ---- sockets ---------------------------------------------------------------------------
    def _send_front(self, msg: Message) -> None:
        self.front.send(encode(msg))

    def _send_peer(self, instance_id: str, msg: Message) -> None:
        sock = self.peers.get(instance_id)
        if sock is None:
            address = self.peer_addresses.get(instance_id)
            if address is None:
                raise RuntimeError(f"unknown peer instance {instance_id!r}")
            sock = self.zctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            self.peers[instance_id] = sock
        sock.send(encode(msg))

    # ---- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while True:
                timeout_ms = 0 if self.worker.has_work() else 5
                if self.pull.poll(timeout_ms):
                    for _ in range(256):
                        try:
                            data = self.pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            msg = decode(data)
                        except Exception:  # noqa: BLE001 - unauthenticated (unknown peer) or malformed: dropped
                            self.num_dropped_frames += 1
                            continue
                        if self._handle(msg) is False:
                            return
                self.worker.poll_transfers()
                t0 = time.perf_counter()
                if self.worker.step():
                    dt = time.perf_counter() - t0
                    self.busy_s += dt
                    self._busy_since_report += dt
                    self.steps += 1
                self._flush()
                self._maybe_flip()
                self._maybe_report()
                if self.retire is not None and self._retired():
                    return
                if os.getppid() != self._parent:  # front end died: do not linger as an orphan
                    return
        finally:
            self._close()

    def _handle(self, msg: Message) -> bool:
        if isinstance(msg, Shutdown):
            return False
        if isinstance(msg, PeerTable):
            self.peer_addresses = dict(msg.addresses)
            for gone in set(self.peers) - set(self.peer_addresses):  # retired or replaced peers
                self.peers.pop(gone).close(linger=0)
        elif isinstance(msg, Retire):
            if self.retire is None:
                self.retire = msg
                self.target_role = None  # a pending flip is moot
                self.state = InstanceState.DRAINING
                self.drain_started = time.perf_counter()
                self._report(force=True)
        elif isinstance(msg, Yield):  # queue rebalancing: give back what has not started here
            taken = self.worker.take_unstarted(msg.count) if self.state is InstanceState.ACTIVE else []
            self._send_front(Yielded(self.spec.instance_id, [r.request_id for r in taken]))
            if taken:
                self._report(force=True)
        elif isinstance(msg, Migrate):  # live migration: decode and colocated workers hold running decodes
            if self.role in MIGRATION_ROLES:
                self.worker.handle(msg)
            else:
                self._send_front(MigrationDone(self.spec.instance_id, [], [], 0.0, 0, msg.reason))
        elif isinstance(msg, Handoff) and msg.migrated and (
                self.role not in MIGRATION_ROLES or self.state is not InstanceState.ACTIVE or self.retire is not None):
            # a migrant for an instance that is leaving or no longer decodes: it stays at its source
            with contextlib.suppress(RuntimeError):
                self._send_peer(msg.prefill_id, KVDone(msg.request_id, failed=True,
                                                       reason=f"target is {self.state.value} ({self.role})"))
        elif isinstance(msg, SetRole):
            if msg.role != self.role and msg.role in WORKERS:
                if self.state is InstanceState.ACTIVE:
                    self.state = InstanceState.DRAINING
                    self.drain_started = time.perf_counter()
                if msg.switch:
                    self.target_role = msg.role
        else:
            self.worker.handle(msg)
        return True

    def _flush(self) -> None:
        self.ctx.flush_outbox()

    def _maybe_flip(self) -> None:
        if self.target_role is None or not self.worker.is_empty():
            return
        t_switch = time.perf_counter()
        drain_s = t_switch - self.drain_started
        self.state = InstanceState.FLIPPING
        self.ctx.kv_manager.check_invariants()
        self.worker = WORKERS[self.target_role](self.ctx)
        self.role = self.target_role
        self.target_role = None
        self._apply_role_priority()
        self.state = InstanceState.ACTIVE
        switch_s = time.perf_counter() - t_switch
        self._send_front(RoleSwitched(self.spec.instance_id, self.role, drain_s, switch_s))
        self._report(force=True)

    def _retired(self) -> bool:
        """Scale-in: True once the worker has been empty for the grace period (then ``Retired`` is sent)."""
        assert self.retire is not None
        now = time.perf_counter()
        if not self.worker.is_empty():
            self._empty_since = None
            return False
        if self._empty_since is None:
            self._empty_since = now
        if now - self._empty_since < self.retire.grace_s:
            return False
        self.ctx.kv_manager.check_invariants()
        self._send_front(Retired(self.spec.instance_id, now - self.drain_started))
        return True

    def _maybe_report(self) -> None:
        self._report(force=False)

    def _report(self, force: bool) -> None:
        now = time.time()
        interval = now - self._last_report
        if not force and interval < self.spec.report_interval_s:
            return
        util = min(1.0, self._busy_since_report / interval) if interval > 0 else 0.0
        rep = self.worker.load_report(now, util, self.state)
        self._send_front(wire_load(rep, self.busy_s, self.steps, self.ctx.kv_manager))
        lat = getattr(self.worker, "predictor_latencies", None)
        if lat:
            self._send_front(PredictorStat(self.spec.instance_id, list(lat)))
            lat.clear()
        self._busy_since_report = 0.0
        self._last_report = now

    def _close(self) -> None:
        try:
            self.backend.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        for s in [self.pull, self.front, *self.peers.values()]:
            s.close(linger=500)
        self.zctx.term()


def main(argv: list[str] | None = None) -> int:
    """``SPEC_HEX``: run that instance. ``--spare``: a warm spare (``LocalLauncher``): everything is imported
    already; wait for the spec on stdin (EOF: the launcher closed or went away, exit quietly)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--spare"]:
        line = sys.stdin.readline().strip()
        if not line:
            return 0
        args = [line]
    spec = decode_spec(bytes.fromhex(args[0]))
    if not control_key_from_env():
        print(f"instance needs its front end's control key in ${CONTROL_KEY_ENV}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    apply_nice(spec.nice, spec.instance_id)
    Instance(spec).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
