"""Prefill role: queue -> length prediction -> fixed-size chunked prefill -> dispatch -> KV send.

Lifecycle of a request here (disaggregated mode):
NewRequest -> queued (PrefillScheduler) -> predicted -> chunks prefilled -> first token to the client ->
KV copied to a staging buffer and the device blocks released -> dispatched (Handoff to a decode
instance) -> KVReady (the decode side reserved blocks and posted memory) -> sent -> KVDone: staging
freed. With a pull hand-off (``kv_handoff``; shm by default) the staging buffer is registered as a region and
named in the Handoff; the decode instance reads it one-sided (no KVReady, nothing to do here) -> KVDone:
region closed, staging freed. A KVDone(failed) re-dispatches (up to ``max_dispatch_attempts``), then the request fails with a
clean error. Abort at any point frees whatever the request holds here.

With ``keep_decode`` (``core.keep_decode``) a just-prefilled request may instead stay: its blocks pass from
the prefill scheduler to a decode scheduler of this instance (``PrefillScheduler.keep`` ->
``DecodeScheduler.adopt``, nothing copied or freed) and it decodes here in steps where no prompt is queued
(prefill keeps priority), reported to the front end as dispatched to this instance.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tetriinfer.core.decode_scheduler import DecodeScheduler, DecodeSchedulerConfig
from tetriinfer.core.dispatcher import Dispatcher, DispatcherConfig, charge_dispatch
from tetriinfer.core.keep_decode import KeepDecodeConfig, keep_commitment, keep_row, should_keep
from tetriinfer.core.load import InstanceState, LoadReport, prefill_instance_report
from tetriinfer.core.prefill_scheduler import PrefillScheduler, PrefillSchedulerConfig
from tetriinfer.core.request import Request
from tetriinfer.core.step import SchedulerOutput, merge_steps, split_result
from tetriinfer.runtime.fault_hooks import SendHold, hold_config_from_env
from tetriinfer.runtime.messages import (
    Abort,
    DecodeLoads,
    Dispatched,
    Handoff,
    KVDone,
    KVReady,
    NewRequest,
    Prediction,
    PrefillDone,
    WireParams,
    decode_load,
)
from tetriinfer.runtime.predictor_hook import InBandHook
from tetriinfer.runtime.worker_base import InstanceContext, apply_decode_step, load_from_wire, schedule_decode
from tetriinfer.transfer.messages import RemoteRegion


@dataclass
class StagedKV:
    request: Request
    tensors: list[torch.Tensor]  # 2 * num_layers tensors [n_blocks, block_size, Hkv, D]
    num_blocks: int
    dispatch_attempts: int = 0
    decode_id: str | None = None
    sending_tid: str | None = None
    send_started: float = 0.0
    region: RemoteRegion | None = None  # pull hand-off: ``tensors`` registered for one-sided reads
    rng_state: bytes = b""  # a seeded request's sampler state after its first token (travels with the hand-off)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass
class KVStream:
    """A chunk-wise transfer: the decode instance is chosen after the request's first chunk and its KV
    blocks are sent as chunks complete. Slot ``l * num_blocks + b`` = layer tensor ``l`` (K/V
    interleaved), block ``b``. Device blocks are held until the decode side confirms (KVDone)."""

    request: Request
    decode_id: str
    num_blocks: int
    dispatch_attempts: int = 1
    transfer_id: str | None = None
    sent_blocks: int = 0
    prefilled: bool = False
    closed: bool = False
    keep: list[torch.Tensor] = field(default_factory=list)  # sources live until the transfer ends


class PrefillWorker:
    role = "prefill"

    def __init__(self, ctx: InstanceContext) -> None:
        spec = ctx.spec
        self.ctx = ctx
        self.scheduler = PrefillScheduler(
            PrefillSchedulerConfig(
                policy=spec.prefill_policy,
                prefill_sched_batch=spec.prefill_sched_batch,
                cache_aware_order=spec.cache_aware_prefill_order,
                merge_limit=spec.prefill_merge_limit,
                tail_tokens=spec.prefill_tail_tokens,
                chunk_size=spec.chunk_size,
                pad_last_chunk=spec.pad_last_chunk,
                max_model_len=ctx.max_model_len,
                require_prediction=(ctx.predictor is not None and spec.predictor_mode != "sequential"
                                    and not isinstance(ctx.predictor, InBandHook)),
            ),
            ctx.kv_manager,
        )
        # in-band prediction: this instance's own prefill keeps the predictor's hidden states at each prompt's last
        # token (ModelRunner.capture) and the head predicts from them as the prompt's last chunk ends: no second
        # model runs, and the prediction is there when the request is prefilled (before it is kept or dispatched)
        self.in_band: InBandHook | None = ctx.predictor if isinstance(ctx.predictor, InBandHook) else None
        if self.in_band is not None:
            ctx.runner.capture(self.in_band.layers)
        self.prediction_service = None
        if ctx.predictor is not None and self.in_band is None and spec.predictor_mode != "sequential":
            from tetriinfer.runtime.predictor_hook import PredictionService

            self.prediction_service = PredictionService(ctx.predictor)
        self.predictor_latencies: list[float] = []
        self.dispatcher = Dispatcher(
            DispatcherConfig(policy=spec.dispatch_policy, heavy_decode_tokens=spec.heavy_decode_tokens, seed=spec.seed,
                             alpha_empty=spec.dispatch_when_full)
        )
        self.decode_loads: list[LoadReport] = []
        self.prefill_ids: list[str] = []  # ACTIVE prefill instances, as the monitor last broadcast them
        hold = hold_config_from_env()  # test-only fault injection (runtime.fault_hooks); None unless asked for
        self.send_hold = SendHold(hold, ctx.instance_id) if hold is not None else None
        self.staged: dict[str, StagedKV] = {}
        self.streams: dict[str, KVStream] = {}  # chunk-wise transfers (kv_transfer == "chunk")
        self.chunk_mode = spec.kv_transfer == "chunk"
        # Pull: the decode instance reads the staged KV itself, so a hand-off never waits for this instance's
        # next forward to end (push needs this loop to answer KVReady). Auto: where reads need no owner (shm).
        self.pull_kv = spec.kv_handoff == "pull" or (spec.kv_handoff == "auto" and ctx.backend.kind == "shm")
        self.no_stream: set[str] = set()  # requests whose chunk-wise transfer failed
        self.awaiting_dispatch: deque[str] = deque()
        self.oracle: dict[str, int] = {}
        self.keep_config = KeepDecodeConfig(enabled=spec.keep_decode, ratio=spec.keep_decode_ratio,
                                            rule=spec.keep_decode_rule, prompt_instance=spec.prompt_only_prefill)
        self.kept = DecodeScheduler(  # requests decoded here (keep_decode); shares this instance's KV blocks
            DecodeSchedulerConfig(
                policy="greedy", max_num_seqs=spec.max_num_seqs, max_model_len=ctx.max_model_len,
                heavy_decode_tokens=spec.heavy_decode_tokens,
            ),
            ctx.kv_manager,
        )

    # ---- messages ------------------------------------------------------------------------
    def handle(self, msg: object) -> None:
        if isinstance(msg, NewRequest):
            self._on_new(msg)
        elif isinstance(msg, DecodeLoads):
            self.decode_loads = [load_from_wire(decode_load(b)) for b in msg.reports]
            self.prefill_ids = list(msg.prefill_ids)
        elif isinstance(msg, KVReady):
            self._on_kv_ready(msg)
        elif isinstance(msg, KVDone):
            self._on_kv_done(msg)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id)

    def _on_new(self, msg: NewRequest) -> None:
        ctx = self.ctx
        try:
            req = msg.to_request()
            self._predict(req, msg)
            self.scheduler.add_request(req)
        except ValueError as exc:
            ctx.emit_error(msg.request_id, 0, str(exc))

    def _predict(self, req: Request, msg: NewRequest) -> None:
        pred = self.ctx.predictor
        if pred is None:
            return
        if self.in_band is not None:  # predicted from this request's own prefill (_take_in_band)
            self.ctx.runner.capture_ids.add(req.request_id)
            return
        if self.prediction_service is not None:  # parallel: overlaps this request's prefill
            self.prediction_service.submit(req.request_id, req.prompt_token_ids, msg.oracle_output_tokens)
            return
        t0 = time.perf_counter()
        bucket = pred.predict_one(req.prompt_token_ids, msg.oracle_output_tokens)
        self.predictor_latencies.append(time.perf_counter() - t0)
        if bucket is not None:
            req.predicted_bucket, req.predicted_lower, req.predicted_upper = bucket

    def _collect_predictions(self) -> None:
        if self.prediction_service is None:
            return
        for rid, bucket, secs in self.prediction_service.drain():
            self.predictor_latencies.append(secs)
            if rid not in self.scheduler.requests:
                continue
            b, lo, hi = bucket if bucket is not None else (0, 0, 0)
            if bucket is None:  # unknown length: dispatch as a light request with no reservation hint
                req = self.scheduler.requests[rid]
                ready = self.scheduler.set_prediction(rid, 0, 0, 0)
                req.predicted_bucket = req.predicted_lower = req.predicted_upper = None
            else:
                ready = self.scheduler.set_prediction(rid, b, lo, hi)
            if ready is not None:
                self._stage(ready)

    def take_unstarted(self, limit: int) -> list[Request]:
        """Queue rebalancing: queued prompts with no chunk prefilled leave for another prefill instance (a
        prediction still running for one is dropped when it lands: the request is no longer held)."""
        taken = self.scheduler.take_unstarted(limit)
        for req in taken:
            self.oracle.pop(req.request_id, None)
            self.ctx.runner.capture_ids.discard(req.request_id)
        return taken

    def _take_in_band(self) -> None:
        """Predictions from the states the last forward captured (requests whose prefill it ended); a request
        left without one (nothing captured) is dispatched as one of unknown length, as a failed prediction is."""
        captured = self.ctx.runner.captured
        if not captured:
            return
        head = self.in_band
        assert head is not None
        for rid, states in captured.items():
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            t0 = time.perf_counter()
            req.predicted_bucket, req.predicted_lower, req.predicted_upper = head.predict(
                states.numpy(), req.num_prompt_tokens)
            self.predictor_latencies.append(time.perf_counter() - t0)
        captured.clear()

    # ---- stepping ------------------------------------------------------------------------
    def has_work(self) -> bool:
        # Requests waiting only for their prediction do not count: the loop then sleeps on its socket
        # (<= 5 ms) instead of spinning on the core the predictor thread needs.
        return (self.scheduler.num_queued > 0 or bool(self.awaiting_dispatch)
                or bool(self.kept.running or self.kept.suspended))

    def is_empty(self) -> bool:
        return (not self.scheduler.has_unfinished() and not self.staged and not self.streams
                and not self.kept.has_unfinished())

    def step(self) -> bool:
        """One prefill chunk if a prompt is queued (and can get blocks), else one decode step of kept requests."""
        self._collect_predictions()
        self._retry_dispatch()
        if self.scheduler.num_queued:
            out = self.scheduler.schedule()
            if not out.is_empty:
                self._prefill_step(out)
                return True
        return self._decode_step()

    def _kept_schedule(self) -> SchedulerOutput | None:
        return schedule_decode(self.kept) if self.kept.running or self.kept.suspended else None

    def _decode_step(self) -> bool:
        out = self._kept_schedule()
        if out is None:
            return False
        apply_decode_step(self.ctx, self.kept, out, self.ctx.runner.execute(out))
        return not out.is_empty

    def _prefill_step(self, out: SchedulerOutput) -> None:
        """One prefill chunk; kept decodes ride along in the same forward (a few rows on a chunk of
        ``chunk_size``: they advance a token instead of stalling for the chunk).

        Chunk-wise transfer dispatches a request *before* its first chunk runs: the decode instance reserves
        blocks and posts its memory (KVReady) while this forward computes, so the KV can go out as soon as the
        loop reads that reply, instead of the reply waiting behind the next prompt's forward (a single-chunk
        prompt would otherwise take the per-request path: dispatch after the forward, then a round trip)."""
        if self.chunk_mode:
            self._open_streams(out, before_forward=True)
        dec = self._kept_schedule()
        run = merge_steps(out, dec) if dec is not None and not dec.is_empty else out
        self.ctx.let_io_run()  # what earlier steps queued (Handoffs, first tokens) leaves before this forward
        result = self.ctx.runner.execute(run)
        if self.in_band is not None:
            self._take_in_band()
        upd = self.scheduler.update(out, split_result(result, out))
        self.ctx.emit_update(self.scheduler.requests, upd.new_tokens, upd.finished)
        self.ctx.flush_outbox()  # first tokens out before the KV staging copies and dispatch below
        self.ctx.let_io_run()
        if dec is not None:
            apply_decode_step(self.ctx, self.kept, dec, split_result(result, dec))
        for req in upd.finished:
            stream = self.streams.get(req.request_id)
            if stream is not None:  # ended by its first token: the decode side must free its reservation
                self.ctx.reply_peer(stream.decode_id, Abort(req.request_id))  # a gone decode holds nothing
                self._drop_stream(req.request_id)
        if self.chunk_mode:
            self._open_streams(out)
        for req in upd.prefilled:
            self._on_prefilled(req)
        if self.chunk_mode:
            self._pump_streams()

    def _on_prefilled(self, req: Request) -> None:
        stream = self.streams.get(req.request_id)
        if stream is None:
            self._stage(req)
            return
        stream.prefilled = True
        # a seeded request's sampler state goes along (the decode instance samples on from it); the generator stays
        # here until the KV is in, for the staging fallback should the stream fail
        rng = self.ctx.runner.sampler.export_state(req.request_id)
        if not self.ctx.reply_peer(stream.decode_id, PrefillDone(req.request_id, list(req.output_token_ids), rng)):
            # the decode instance left the peer table mid-stream: hand the request over another way, as after a
            # failed chunk-wise transfer (staging copy + dispatch to a live decode instance)
            self._decode_gone(stream.decode_id)
            self._drop_stream(req.request_id)
            self.no_stream.add(req.request_id)
            if req.request_id in self.scheduler.handed_over:
                self._stage(req)
                if req.request_id in self.staged:
                    self.staged[req.request_id].dispatch_attempts = stream.dispatch_attempts
            return
        self._pump_stream(stream)

    # ---- chunk-wise transfer -------------------------------------------------------------
    def _open_streams(self, out, before_forward: bool = False) -> None:
        for seg in out.segments:
            rid = seg.request_id
            req = self.scheduler.requests.get(rid)
            if req is None or rid in self.streams or rid in self.staged or rid in self.no_stream:
                continue
            if before_forward and self.keep_config.enabled and seg.end >= req.num_tokens:
                continue  # prefilled by this forward: after it, the per-request path decides keep or dispatch
            if req.status.name != "WAITING" or req.output_token_ids:
                continue  # already prefilled (a re-prefill after a failed stream): the per-request path
            if self.scheduler.ends_with_first_token(req):
                continue  # nothing to decode: its first token ends it here
            if self._may_keep(req, prefilling=True):
                continue  # the keep rule would keep it now: decided again once prefilled (core.keep_decode)
            if self.ctx.predictor is not None and req.predicted_bucket is None:
                continue  # dispatch needs the prediction; retried after the next chunk (in-band: once prefilled)
            decision = self.dispatcher.choose(self.decode_loads, req.num_tokens + 1, req.predicted_lower)
            if decision.instance_id is None:
                continue
            n = self.ctx.kv_manager.pool.blocks_for_tokens(req.num_prompt_tokens)
            if not self._send_handoff(req, decision.instance_id, n, early=True):
                self._decode_gone(decision.instance_id)  # no stream: the next step chooses among the live ones
                continue
            self._account_dispatch(decision.instance_id, req)
            self.streams[rid] = KVStream(req, decision.instance_id, n)
            self.ctx.send_front(Dispatched(rid, decision.instance_id))

    def _pump_streams(self) -> None:
        for stream in list(self.streams.values()):
            self._pump_stream(stream)

    def _pump_stream(self, stream: KVStream) -> None:
        if stream.transfer_id is None or stream.closed:
            return
        req = stream.request
        bs = self.ctx.kv_manager.block_size
        upto = stream.num_blocks if stream.prefilled else min(stream.num_blocks, req.num_computed_tokens // bs)
        if upto > stream.sent_blocks:
            table = self.scheduler.block_table(req.request_id)
            tensors = self.ctx.runner.kv.read_blocks(table[stream.sent_blocks : upto])  # 2L x [k, bs, H, D]
            k = upto - stream.sent_blocks
            buffers = [t[i] for t in tensors for i in range(k)]
            slots = [layer * stream.num_blocks + stream.sent_blocks + i for layer in range(len(tensors)) for i in range(k)]
            stream.keep.extend(tensors)
            try:
                self.ctx.backend.append(stream.transfer_id, buffers, slots=slots)
            except (KeyError, ValueError, RuntimeError):
                return  # the receiver times out and re-posts or gives up
            stream.sent_blocks = upto
        if stream.prefilled and stream.sent_blocks == stream.num_blocks:
            try:
                self.ctx.backend.close(stream.transfer_id)
            except (KeyError, ValueError, RuntimeError):
                return
            stream.closed = True

    def _drop_stream(self, rid: str) -> None:
        stream = self.streams.pop(rid, None)
        if stream is not None and stream.transfer_id is not None:
            self.ctx.release_transfer(stream.transfer_id)

    def _may_keep(self, req: Request, prefilling: bool = False) -> bool:
        """``core.keep_decode.should_keep`` for ``req`` here, now; ``prefilling``: asked while ``req`` is still
        queued here (a chunk-wise transfer about to open), which then does not count as a prompt waiting."""
        if not self.keep_config.enabled:
            return False
        kv, cap = self.ctx.kv_manager, self.ctx.max_model_len
        own, blocks = keep_commitment(self.keep_config, (keep_row(r, cap) for r in self.kept.requests.values()),
                                      keep_row(req, cap), kv.block_size)
        return should_keep(
            self.keep_config, own_running=len(self.kept.running) + len(self.kept.suspended),
            own_queued=self.scheduler.num_queued - prefilling, own_committed_blocks=own, request_blocks=blocks,
            pool_blocks=kv.num_blocks, decode_loads=self.decode_loads, instance_id=self.ctx.instance_id,
            prefill_ids=self.prefill_ids,
        )

    def _try_keep(self, req: Request) -> bool:
        """Keep a just-prefilled request here to decode it (``core.keep_decode``)? If so its blocks move to
        ``self.kept`` and the front end learns it is decoding on this instance."""
        if not self._may_keep(req):
            return False
        self.kept.adopt(self.scheduler.keep(req.request_id))
        self.ctx.send_front(Dispatched(req.request_id, self.ctx.instance_id))
        return True

    def _keep_staged(self, rid: str) -> bool:
        """Decode here a staged request that waits for a decode instance with room (``--dispatch-when-full
        wait``), when the keep rule allows it now: its KV is copied from staging back into blocks of this
        instance (no transfer), the staging copy is freed, and the front end learns it decodes here."""
        staged = self.staged[rid]
        req = staged.request
        if not self._may_keep(req) or not self.kept.reserve(req):
            return False
        table = self.kept.block_table(rid)
        self.ctx.runner.kv.write_blocks(table[: staged.num_blocks], staged.tensors)
        if staged.rng_state and req.sampling_params.seed is not None:
            self.ctx.runner.sampler.import_state(rid, req.sampling_params.seed, staged.rng_state)
        self.kept.on_kv_received(rid)
        self._drop(rid)
        self.ctx.send_front(Dispatched(rid, self.ctx.instance_id))
        return True

    def _stage(self, req: Request) -> None:
        """Copy the request's KV out of the device blocks, release them, and dispatch (or keep it here)."""
        if self._try_keep(req):
            return
        table = self.scheduler.block_table(req.request_id)
        n = self.ctx.kv_manager.pool.blocks_for_tokens(req.num_computed_tokens)
        kv = self.ctx.runner.kv
        region = None
        if self.pull_kv:  # staged in memory the link lets peers read (shm: this instance's arena)
            shape = (n, kv.block_size, *kv.k[0].shape[1:])
            tensors = kv.read_blocks(table[:n], out=self.ctx.backend.alloc_like([shape] * (2 * len(kv.k)),
                                                                                kv.k[0].dtype))
            region = self.ctx.backend.register(_region_id(req.request_id), tensors)
        else:
            tensors = kv.read_blocks(table[:n])
        self.scheduler.release(req.request_id)
        # a seeded request's generator leaves with it: whichever instance decodes it samples on from this state,
        # so its tokens are the ones a single colocated instance (or the offline engine) gives
        rng = self.ctx.runner.sampler.export_state(req.request_id)
        self.ctx.runner.sampler.drop([req.request_id])
        self.staged[req.request_id] = StagedKV(req, tensors, n, region=region, rng_state=rng)
        self._dispatch(req.request_id)

    def _dispatch(self, rid: str) -> None:
        staged = self.staged[rid]
        req = staged.request
        decision = self.dispatcher.choose(self.decode_loads, req.num_tokens, req.predicted_lower)
        if decision.instance_id is None:
            if rid not in self.awaiting_dispatch:
                self.awaiting_dispatch.append(rid)
            return
        if not self._send_handoff(req, decision.instance_id, staged.num_blocks, early=False, kv_region=staged.region,
                                  rng_state=staged.rng_state):
            self._decode_gone(decision.instance_id)
            if rid not in self.awaiting_dispatch:  # retried next step, among the live decode instances
                self.awaiting_dispatch.append(rid)
            return
        staged.decode_id = decision.instance_id
        staged.dispatch_attempts += 1
        self._account_dispatch(decision.instance_id, req)
        self.ctx.send_front(Dispatched(rid, decision.instance_id))

    def _send_handoff(self, req: Request, decode_id: str, num_blocks: int, early: bool,
                      kv_region: RemoteRegion | None = None, rng_state: bytes = b"") -> bool:
        """Send the request's ``Handoff``; False (nothing sent) when ``decode_id`` left the peer table (died or
        retired since the load report that chose it)."""
        pred = None
        if req.predicted_bucket is not None:
            pred = Prediction(req.predicted_bucket, req.predicted_lower or 0, req.predicted_upper or 0)
        return self.ctx.reply_peer(
            decode_id,
            Handoff(
                request_id=req.request_id,
                prefill_id=self.ctx.instance_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=[] if early else req.output_token_ids,
                params=WireParams.from_params(req.sampling_params),
                arrival_time=req.arrival_time,
                eos_token_id=req.eos_token_id,
                num_kv_blocks=num_blocks,
                prediction=pred,
                early=early,
                kv_region=kv_region,
                rng_state=rng_state,
            ),
        )

    def _decode_gone(self, decode_id: str) -> None:
        """``decode_id`` is no longer reachable: leave it out of dispatch until a load broadcast names it again
        (the front end's next broadcast no longer does)."""
        self.decode_loads = [r for r in self.decode_loads if r.instance_id != decode_id]

    def _account_dispatch(self, decode_id: str, req: Request) -> None:
        """Optimistically charge the chosen instance until its next load report (avoids herding)."""
        self.decode_loads = charge_dispatch(self.decode_loads, decode_id, req.num_tokens, req.predicted_lower,
                                            self.ctx.spec.heavy_decode_tokens)

    def _retry_dispatch(self) -> None:
        for _ in range(len(self.awaiting_dispatch)):
            rid = self.awaiting_dispatch.popleft()
            if rid in self.staged and not self._keep_staged(rid):
                self._dispatch(rid)

    # ---- transfer ------------------------------------------------------------------------
    def _on_kv_ready(self, msg: KVReady) -> None:
        stream = self.streams.get(msg.request_id)
        if stream is not None:
            if stream.transfer_id is not None:  # a re-posted receive: start over
                self.ctx.release_transfer(stream.transfer_id)
            stream.transfer_id, stream.sent_blocks, stream.closed, stream.keep = msg.transfer_id, 0, False, []
            try:
                self.ctx.backend.open(msg.transfer_id, msg.region, timeout_s=self.ctx.spec.transfer_timeout_s)
            except (ValueError, RuntimeError):
                stream.transfer_id = None
                return
            self._pump_stream(stream)
            return
        staged = self.staged.get(msg.request_id)
        if staged is None:  # aborted meanwhile; the decode side times out and frees its blocks
            return
        backend = self.ctx.backend
        if staged.sending_tid is not None:
            self.ctx.release_transfer(staged.sending_tid)
        staged.sending_tid = msg.transfer_id
        staged.send_started = time.perf_counter()
        try:
            if self.send_hold is not None and self.send_hold.take(staged.decode_id or ""):
                self._send_held(msg, staged)
            else:
                backend.send(msg.transfer_id, staged.tensors, msg.region, timeout_s=self.ctx.spec.transfer_timeout_s)
        except (ValueError, RuntimeError, KeyError):
            staged.sending_tid = None  # the receiver times out and re-posts or gives up

    def _send_held(self, msg: KVReady, staged: StagedKV) -> None:
        """Test-only (``runtime.fault_hooks``): the same send as ``backend.send``, held with half the payload
        queued until the test releases it (or kills this instance meanwhile)."""
        assert self.send_hold is not None
        backend, tid, tensors = self.ctx.backend, msg.transfer_id, staged.tensors
        half = max(1, len(tensors) // 2)
        backend.open(tid, msg.region, timeout_s=self.ctx.spec.transfer_timeout_s)
        backend.append(tid, tensors[:half], slots=list(range(half)))
        queued = sum(t.numel() * t.element_size() for t in tensors[:half])
        self.send_hold.hold(msg.request_id, tid, staged.decode_id or "", queued, staged.nbytes)
        if tensors[half:]:
            backend.append(tid, tensors[half:], slots=list(range(half, len(tensors))))
        backend.close(tid)

    def poll_transfers(self) -> None:
        """Free finished sends. Success is decided (and reported) by the receiving decode instance."""
        from tetriinfer.transfer import TransferState

        for staged in list(self.staged.values()):
            tid = staged.sending_tid
            if tid is None:
                continue
            state = self.ctx.backend.poll(tid)
            if state is TransferState.DONE or state is TransferState.FAILED:
                self.ctx.release_transfer(tid)
                staged.sending_tid = None


    def _on_kv_done(self, msg: KVDone) -> None:
        stream = self.streams.get(msg.request_id)
        if stream is not None:
            self._drop_stream(msg.request_id)
            rid = msg.request_id
            if not msg.failed:
                if rid in self.scheduler.handed_over:
                    self.scheduler.release(rid)
                self.ctx.runner.sampler.drop([rid])
                return
            # Chunk-wise transfer failed: fall back to the per-request path (staging copy + re-dispatch).
            self.no_stream.add(rid)
            if rid in self.scheduler.handed_over:
                self._stage(stream.request)
                if rid in self.staged:  # else kept here to decode (--keep-decode)
                    self.staged[rid].dispatch_attempts = stream.dispatch_attempts
            return
        staged = self.staged.get(msg.request_id)
        if staged is None:
            return
        if not msg.failed:
            self._drop(msg.request_id)
            return
        if staged.dispatch_attempts >= self.ctx.spec.max_dispatch_attempts:
            self.ctx.emit_error(
                msg.request_id, staged.request.num_output_tokens, f"KV transfer failed: {msg.reason}"
            )
            self._drop(msg.request_id)
            return
        self._dispatch(msg.request_id)

    def _drop(self, rid: str) -> None:
        staged = self.staged.pop(rid, None)
        if staged is not None and staged.sending_tid is not None:
            self.ctx.release_transfer(staged.sending_tid)
        if staged is not None and staged.region is not None:
            self.ctx.backend.deregister(staged.region.region_id)  # closes it first: a late reader fails cleanly
        if rid in self.awaiting_dispatch:
            self.awaiting_dispatch.remove(rid)

    def abort(self, rid: str) -> None:
        self._drop_stream(rid)
        self.no_stream.discard(rid)
        if self.prediction_service is not None:
            self.prediction_service.cancel(rid)
        self.ctx.runner.capture_ids.discard(rid)
        self.ctx.runner.captured.pop(rid, None)
        if self.scheduler.abort(rid) is None:
            if rid in self.scheduler.handed_over:
                self.scheduler.release(rid)
        self.kept.abort(rid)
        self._drop(rid)
        self.ctx.runner.sampler.drop([rid])

    def load_report(self, now: float, utilization: float, state: InstanceState) -> LoadReport:
        rep = self.scheduler.load_report(self.ctx.instance_id, now, utilization, state)
        held = len(self.staged) + len(self.kept.running) + len(self.kept.suspended)  # prefilled, KV still here
        return prefill_instance_report(rep, held)


def _region_id(request_id: str) -> str:
    """Name of a request's staged KV region for pull hand-offs (unique while the request is staged here). Its
    random part travels only in the Handoff over the authenticated control channel: only the decode instance it
    was dispatched to can name (and read) the region."""
    return f"{request_id}#kv.{secrets.token_hex(8)}"
