"""The worker process: one engine behind a DEALER socket to each broker.

Two threads. The engine's step thread runs the model and calls back with
tokens; the socket thread (the caller of `run`) owns the ZeroMQ sockets, since
ZeroMQ sockets are not thread-safe. With several brokers (an active-active
pair) the worker registers with every one; each request's tokens go back to
the broker that dispatched it. Engine events cross over through a queue
plus a wake-up byte on an inproc PAIR socket, so the socket thread sleeps in
one poll over the broker and the engine. docs/service.md describes the
process; docs/protocol.md the worker's contract it implements.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Optional

import zmq
from prometheus_client import CollectorRegistry

from turbomq.clients import protocol as P
from turbomq.clients.keys import CurveClient
from turbomq.clients.protocol import Code, Kind
from turbomq.monitoring import WorkerMetrics, serve_metrics

from ..engine import errors
from ..engine.engine import Engine, EngineConfig, StreamEvent
from .link import BrokerLink
from ..engine.sampling_params import InvalidParams, SamplingParams
from ..engine.session_store import InMemorySessionStore, SessionStoreError

log = logging.getLogger("turbomq.worker.service")

VERSION = "0.1.0"


def session_key(tenant: str, session_id: str) -> str:
    """Where a session lives on this worker and in Redis: under its tenant, so
    two tenants' sessions of one id never meet (docs/security.md)."""
    return f"{tenant}:{session_id}"


DEFAULT_SESSION_TTL_S = 7 * 24 * 3600.0


def _default_worker_id() -> str:
    return "worker-" + uuid.uuid4().hex[:8]


@dataclass
class WorkerConfig:
    engine: EngineConfig  # model path, device and the engine's options
    broker: str = "tcp://127.0.0.1:5556"  # the broker's back endpoint; several: comma-separated
    worker_id: str = field(default_factory=_default_worker_id)
    model_id: Optional[str] = None  # names the model to the broker and in Redis; default: model dir name
    redis_url: Optional[str] = None  # None: an in-process store, not shared with other workers
    # Seconds a session idle this long is dropped from Redis; None: kept until
    # end_session. A week by default, so abandoned sessions do not pile up.
    session_ttl: Optional[float] = DEFAULT_SESSION_TTL_S
    store_timeout: float = 0.5  # seconds per Redis call
    # What one tenant may keep in Redis (0: no limit); past it, rate_limited.
    tenant_max_sessions: int = 0
    tenant_max_tokens: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_port: Optional[int] = 0  # 0: a free port; None: no metrics endpoint
    heartbeat_interval: float = 0.5  # until the broker's `registered` sets its own
    # CurveZMQ (docs/security.md): this worker's NAME.key_secret and the
    # broker's public NAME.key; both or neither.
    curve_secret: Optional[str] = None
    broker_key: Optional[str] = None

    def __post_init__(self) -> None:
        if self.model_id is None:
            self.model_id = Path(self.engine.model).resolve().name or "model"
        if not 0 < len(self.worker_id) <= P.DEFAULT_LIMITS.max_id_chars:
            raise ValueError("worker_id must be 1..128 characters")
        if not 0 < len(self.model_id) <= 4 * P.DEFAULT_LIMITS.max_id_chars:
            raise ValueError("model_id must be 1..512 characters")
        if not self.brokers:
            raise ValueError("give at least one broker endpoint")
        if bool(self.curve_secret) != bool(self.broker_key):
            raise ValueError("CURVE needs both the worker's secret key and the broker's public key")

    @property
    def brokers(self) -> list[str]:
        return [b.strip() for b in self.broker.split(",") if b.strip()]


@dataclass(eq=False)
class _InFlight:
    """A dispatch the engine is running, as the socket thread sees it."""

    link: BrokerLink  # the broker that dispatched it
    key: str  # the broker's request id
    attempt: int
    session_id: Optional[str]  # the session's key here: "tenant:session_id"
    next_index: int  # position in the completion of the next token sent
    arrived: float
    last_token_at: Optional[float] = None


def open_session_store(config: WorkerConfig, metrics: WorkerMetrics,
                       max_session_tokens: Optional[int] = None):
    """Redis when a URL is given (shared by every worker), else the in-process store."""
    if config.redis_url is None:
        log.warning("no Redis URL: sessions are kept in this worker's memory only (not shared "
                    "with other workers, lost on restart)")
        return InMemorySessionStore()
    from .redis_store import RedisSessionStore
    from .store_guard import FailFastStore
    store = RedisSessionStore(config.redis_url, config.model_id, ttl_seconds=config.session_ttl,
                              timeout=config.store_timeout, observe=metrics.observe_store,
                              max_session_tokens=max_session_tokens,
                              tenant_max_sessions=config.tenant_max_sessions,
                              tenant_max_tokens=config.tenant_max_tokens)
    return FailFastStore(store)


class WorkerService:
    def __init__(self, config: WorkerConfig, context: Optional[zmq.Context] = None):
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.registry = CollectorRegistry()
        self.metrics = WorkerMetrics(self.registry, config.worker_id)
        self.engine = Engine(config.engine)
        # A session never holds more than the model's context: the store
        # refuses to grow one past it (whoever writes).
        self.store = open_session_store(config, self.metrics, self.engine.max_model_len)
        self.engine.session_store = self.store
        self.metrics.set_info(model=config.model_id,
                              kv_dtype=str(self.engine.runner.kv_cache.dtype).removeprefix("torch."),
                              dtype=str(self.engine.runner.model.dtype).removeprefix("torch."),
                              device=config.engine.device, version=VERSION)
        self.metrics_server, self.metrics_port = None, None
        if config.metrics_port is not None:
            self.metrics_server, self.metrics_port = serve_metrics(
                self.registry, config.metrics_host, config.metrics_port)
        # Read by the socket thread, replaced by the step thread after each step.
        self._snapshot = (self.engine.stats(), frozenset(self.engine.resident_sessions()))
        self.metrics.sync_engine_stats(self._snapshot[0])
        self.engine.step_observer = self._on_step
        self._queued_ids: set[str] = set()  # step thread: requests not yet in the batch

        # engine -> socket thread
        self._events: "queue.SimpleQueue[tuple[str, StreamEvent, float]]" = queue.SimpleQueue()
        wake_addr = f"inproc://turbomq-worker-wake-{id(self):x}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(wake_addr)
        self._wake_tx = self.ctx.socket(zmq.PAIR)  # used by the step thread only
        self._wake_tx.connect(wake_addr)
        self._wake_pending = False

        curve = (CurveClient.load(config.curve_secret, config.broker_key)
                 if config.curve_secret else None)
        self.links = [BrokerLink(self.ctx, endpoint, self._register_msg, index=i, curve=curve)
                      for i, endpoint in enumerate(config.brokers)]
        for link in self.links:
            link.heartbeat_interval = config.heartbeat_interval
        self._inflight: dict[str, _InFlight] = {}  # engine request id -> request
        # (link, key, attempt) -> engine request id: keys are each broker's own
        self._engine_ids: dict[tuple[int, str, int], str] = {}
        # session -> (link, dispatch) waiting for the session's superseded request to end
        self._deferred: dict[str, tuple[BrokerLink, dict]] = {}
        # engine request id -> session of a request abandoned with its broker
        # link, cancelled but not yet ended in the engine
        self._abandoned: dict[str, str] = {}
        self._ids = itertools.count(1)
        self._stopping = False

    # ------------------------------------------------------------ lifecycle
    def _register_msg(self) -> dict:
        stats = self._snapshot[0]
        return P.register(self.config.worker_id, self.config.model_id, stats["slots_total"],
                          stats["kv_blocks_total"], self.metrics_port)

    def stop(self) -> None:
        """Ask `run` to return (from a signal handler or another thread)."""
        self._stopping = True

    def run(self) -> None:
        """Serve until stop(); then release everything."""
        self.engine.start()
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        for link in self.links:
            poller.register(link.connect(), zmq.POLLIN)
        try:
            while not self._stopping:
                # Bounded so a stop() from elsewhere is seen promptly.
                now = time.monotonic()
                wait = min([link.wait_s(now) for link in self.links] + [0.25])
                ready = dict(poller.poll(wait * 1000.0))
                if self._wake_rx in ready:
                    self._drain_events()
                for link in self.links:
                    if link.sock in ready:
                        for msg in link.receive():
                            self._handle(link, msg)
                now = time.monotonic()
                for link in self.links:
                    if link.lost(now):
                        log.warning("no word from the broker at %s: reconnecting", link.endpoint)
                        self.metrics.broker_reconnects.inc()
                        self._abandon(link)
                        poller.unregister(link.sock)
                        poller.register(link.connect(), zmq.POLLIN)
                    elif link.beat_due(now):
                        self._heartbeat(link)
        finally:
            self.close()

    def close(self) -> None:
        self.engine.close()
        for link in self.links:
            link.close()
        self._wake_rx.close(0)
        self._wake_tx.close(0)
        if self.metrics_server is not None:
            self.metrics_server.close()
        if hasattr(self.store, "close"):
            self.store.close()

    # ---------------------------------------------------- step thread side
    def _on_engine_event(self, engine_id: str, event: StreamEvent) -> None:
        self._events.put((engine_id, event, time.monotonic()))
        if event.finished:
            self._queued_ids.discard(engine_id)
        if not self._wake_pending:  # one wake-up per batch of events
            self._wake_pending = True
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def _on_step(self, plan, seconds: float) -> None:
        stats = self.engine.stats()
        self._snapshot = (stats, frozenset(self.engine.resident_sessions()))
        m = self.metrics
        m.sync_engine_stats(stats)
        if plan is None:
            return
        m.step_duration.observe(seconds)
        m.step_tokens.observe(sum(item.num_new_tokens for item in plan.scheduled))
        m.step_sequences.observe(len(plan.scheduled))
        for item in plan.scheduled:
            seq = item.seq
            if seq.request_id in self._queued_ids:
                self._queued_ids.discard(seq.request_id)
                m.queue_wait.observe(max(seq.first_admitted - seq.arrival, 0.0))

    # --------------------------------------------------- socket thread side
    def _drain_events(self) -> None:
        # Clear the flag before draining: an event queued after this point
        # sends a fresh wake-up, so none is left behind.
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        self._wake_pending = False
        while True:
            try:
                engine_id, event, at = self._events.get_nowait()
            except queue.Empty:
                return
            try:
                self._on_event(engine_id, event, at)
            except Exception:
                log.exception("failed to forward an engine event")

    def _on_event(self, engine_id: str, event: StreamEvent, at: float) -> None:
        req = self._inflight.get(engine_id)
        if req is None:  # abandoned at a reconnect: the broker moved it
            sid = self._abandoned.pop(engine_id, None) if event.finished else None
            deferred = self._deferred.pop(sid, None) if sid is not None else None
            if deferred is not None:
                self._on_dispatch(*deferred)
            return
        m = self.metrics
        n = len(event.token_ids)
        if n:
            if req.last_token_at is None:
                m.ttft.observe(at - req.arrived)
            else:
                gap = (at - req.last_token_at) / n
                for _ in range(n):
                    m.itl.observe(gap)
            req.last_token_at = at
        if not event.finished:
            if n or event.text:
                req.link.send(P.worker_delta(req.key, req.attempt, req.next_index,
                                             event.token_ids, event.text))
                req.next_index += n
            return
        self._forget(engine_id, req)
        deferred = self._deferred.pop(req.session_id, None) if req.session_id else None
        if deferred is not None:
            self._on_dispatch(*deferred)
        m.request_duration.observe(at - req.arrived)
        reason = event.finish_reason if event.error is None else "error"
        m.requests_finished.labels(reason=reason).inc()
        if reason == "error":
            err = event.error or errors.EngineError("the request failed in the engine")
            req.link.send(P.error(req.key, err.code, str(err), err.retryable, attempt=req.attempt))
            return
        u = event.usage
        req.link.send(P.worker_final(req.key, req.attempt, reason,
                                      P.usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens),
                                      event.token_ids, event.text))
        if req.session_id is not None and reason != "cancelled":
            self._record_holder(req.session_id)

    def _record_holder(self, session_id: str) -> None:
        """Note in Redis which worker holds the session's KV (informational:
        the broker routes by heartbeats)."""
        set_holder = getattr(self.store, "set_holder", None)
        if set_holder is None:
            return
        try:
            set_holder(session_id, self.config.worker_id)
        except SessionStoreError as e:
            log.debug("could not record the holder of %s: %s", session_id, e)

    def _forget(self, engine_id: str, req: _InFlight) -> None:
        self._inflight.pop(engine_id, None)
        self._engine_ids.pop((req.link.index, req.key, req.attempt), None)

    def _handle(self, link: BrokerLink, msg: dict) -> None:
        try:
            kind = msg["kind"]
            if kind == Kind.DISPATCH:
                self._on_dispatch(link, msg)
            elif kind == Kind.CANCEL:
                self._on_cancel(link, msg["request_id"], msg["attempt"])
            elif kind == Kind.END_SESSION:
                self._on_end_session(link, msg["request_id"],
                                     session_key(msg.get("tenant", ""), msg["session_id"]),
                                     msg["session_id"])
        except Exception as e:  # a bug on one message must not stop the worker
            log.exception("failed to handle %s", msg.get("kind"))
            if msg.get("kind") in (Kind.DISPATCH, Kind.END_SESSION):
                attempt = msg.get("attempt") if msg.get("kind") == Kind.DISPATCH else None
                link.send(P.error(msg["request_id"], Code.INTERNAL,
                                  f"worker fault: {type(e).__name__}", False, attempt=attempt))

    def _on_dispatch(self, link: BrokerLink, msg: dict) -> None:
        key, attempt = msg["request_id"], msg["attempt"]
        if (link.index, key, attempt) in self._engine_ids:
            return  # a repeated dispatch: the first one is running
        sid = msg.get("session_id")
        if sid is not None:
            sid = session_key(msg.get("tenant", ""), sid)
        if sid is not None and self._supersede(link, sid, msg):
            return
        engine_id = f"{link.index}.{link.connects}.{next(self._ids)}.{key}"
        resume = msg["resume_tokens"]
        req = _InFlight(link=link, key=key, attempt=attempt, session_id=sid,
                        next_index=len(resume), arrived=time.monotonic())
        try:
            params = SamplingParams(**(msg.get("params") or {}))
            self._inflight[engine_id] = req
            self._engine_ids[(link.index, key, attempt)] = engine_id
            self._queued_ids.add(engine_id)
            self.engine.submit(input_ids=msg.get("input_ids"), prompt=msg.get("prompt"),
                               messages=msg.get("messages"),
                               params=params, session_id=sid, request_id=engine_id,
                               callback=partial(self._on_engine_event, engine_id),
                               resume_tokens=resume, turn_id=msg.get("turn_id"),
                               cache_salt=msg.get("tenant", ""))
        except (InvalidParams, errors.EngineError) as e:
            self._reject(engine_id, req, e)
        except Exception as e:
            log.exception("dispatch %s failed", key)
            self._reject(engine_id, req, errors.EngineError(f"worker fault: {type(e).__name__}"))

    def _supersede(self, link: BrokerLink, session_id: str, msg: dict) -> bool:
        """A broker sends one request per session at a time, so a dispatch for
        a session that still runs here means the running one was given up (its
        broker was lost, its client moved on): cancel it and run the new one
        when it has ended. True if the dispatch was deferred."""
        running = next((eid for eid, r in self._inflight.items() if r.session_id == session_id),
                       None)
        if running is None:
            if session_id not in self._abandoned.values():
                return False
            running = next(eid for eid, sid in self._abandoned.items() if sid == session_id)
        replaced = self._deferred.get(session_id)
        if replaced is not None:  # an older deferred one is superseded too
            old_link, old = replaced
            old_link.send(P.error(old["request_id"], Code.SESSION_BUSY,
                                  f"superseded by a later request for session {session_id!r}",
                                  True, attempt=old["attempt"]))
        self._deferred[session_id] = (link, msg)
        try:
            self.engine.cancel(running)  # its final comes as an event; then the new one runs
        except errors.UnknownRequest:
            pass  # it finished meanwhile; that final is on its way
        return True

    def _reject(self, engine_id: str, req: _InFlight, e: Exception) -> None:
        self._forget(engine_id, req)
        self._queued_ids.discard(engine_id)
        if isinstance(e, InvalidParams):
            code, retryable = Code.INVALID_PARAMS, False
        else:
            code, retryable = e.code, e.retryable
        self.metrics.requests_finished.labels(reason="error").inc()
        req.link.send(P.error(req.key, code, str(e), retryable, attempt=req.attempt))

    def _on_cancel(self, link: BrokerLink, key: str, attempt: int) -> None:
        engine_id = self._engine_ids.get((link.index, key, attempt))
        if engine_id is None:
            return  # finished or never ran here: nothing to stop
        try:
            self.engine.cancel(engine_id)  # its `cancelled` final comes as an event
        except errors.UnknownRequest:
            pass  # it finished meanwhile; that final is on its way

    def _on_end_session(self, link: BrokerLink, key: str, session_id: str, client_sid: str) -> None:
        try:
            self.engine.end_session(session_id)
        except errors.UnknownSession:  # in the client's terms: no tenant prefix
            link.send(P.error(key, Code.UNKNOWN_SESSION, f"no session {client_sid!r}", False))
            return
        except errors.EngineError as e:
            link.send(P.error(key, e.code, str(e), e.retryable))
            return
        stats, resident = self._snapshot
        self._snapshot = (stats, resident - {session_id})
        link.send(P.session_ended(key, client_sid))

    def _abandon(self, link: BrokerLink) -> None:
        """The broker re-dispatches whatever this connection had (or its
        clients send it again elsewhere): stop it here."""
        for engine_id, req in list(self._inflight.items()):
            if req.link is not link:
                continue
            try:
                self.engine.cancel(engine_id)
            except errors.UnknownRequest:
                pass
            self._forget(engine_id, req)
            if req.session_id is not None:
                self._abandoned[engine_id] = req.session_id
        for sid, (deferred_link, _) in list(self._deferred.items()):
            if deferred_link is link:
                del self._deferred[sid]

    def _heartbeat(self, link: BrokerLink) -> None:
        stats, resident = self._snapshot
        link.heartbeat(free_slots=stats["slots_total"] - stats["slots_active"],
                            free_kv_blocks=stats["kv_blocks_total"] - stats["kv_blocks_used"],
                            queue_len=stats["waiting"], resident=resident)


def run_worker(config: WorkerConfig, ready=None) -> None:
    """Build the worker, call `ready(service)` once it can serve, run until stopped."""
    service = WorkerService(config)
    if ready is not None:
        ready(service)
    service.run()
