"""The broker loop: one thread, one zmq.Poller, two ROUTER sockets.

Clients (DEALER) talk to the front socket, workers (DEALER) to the back one.
docs/broker.md describes routing, heartbeats, re-dispatch and cancellation.
"""

from __future__ import annotations

import logging
import math
import os
import time
import types
from collections import deque
from typing import Optional

import msgpack
import zmq

from turbomq.clients import protocol as P
from turbomq.clients.protocol import Code, Kind, ProtocolError

from .config import BrokerConfig
from .state import BrokerStats, Pending, PendingEnd, WorkerState

log = logging.getLogger("turbomq.broker")

DRAIN_BATCH = 256  # messages taken from one socket before looking at the other
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_HEARTBEAT_FRAME = P.pack(P.heartbeat())
_RECONNECT_FRAME = P.pack(P.reconnect())
# With ROUTER_MANDATORY an unroutable id fails on the first frame, so a
# message is never half sent.
_SNDMORE_NOBLOCK = zmq.SNDMORE | zmq.NOBLOCK
_decode_client = P.decode_client_request
_decode_worker = P.decode_worker_message


def _raw_send(sock: zmq.Socket):
    """`sock.send` without pyzmq's Python-level wrapper (routing_id/group/copy
    handling the broker never uses): the Cython method bound to the socket."""
    base = getattr(zmq.backend, "Socket", None)
    if base is not None and isinstance(sock, base) and hasattr(base, "send"):
        return types.MethodType(base.send, sock)
    return sock.send


class Broker:
    def __init__(self, config: BrokerConfig, context: Optional[zmq.Context] = None):
        self.config = config
        self.limits = P.Limits(max_frame_bytes=config.max_frame_bytes)
        self._ctx = context or zmq.Context.instance()
        self.front = self._router(config.front)
        self.back = self._router(config.back)
        self.front_endpoint = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.back_endpoint = self.back.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stats = BrokerStats()
        self.workers: dict[bytes, WorkerState] = {}
        self.requests: dict[str, Pending] = {}  # broker key -> request
        self.by_client: dict[tuple[bytes, str], Pending] = {}
        self.client_requests: dict[bytes, set] = {}  # client -> broker keys
        self.client_seen: dict[bytes, float] = {}
        self.queue: deque[Pending] = deque()
        self.affinity: dict[str, WorkerState] = {}  # session -> worker holding its KV
        self.busy_sessions: set[str] = set()
        self.pending_ends: dict[str, PendingEnd] = {}
        self._next_key = 0
        self._stopping = False
        # Optional metrics: .tick(broker) each tick, .finished(seconds) per request.
        self.observer = None
        self._packb = msgpack.Packer(use_bin_type=True).pack
        self._front_send = _raw_send(self.front)
        self._back_send = _raw_send(self.back)
        self._silence_s = config.heartbeat_interval * config.liveness  # a worker's allowance

    def _router(self, endpoint: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises
        sock.setsockopt(zmq.SNDHWM, self.config.send_hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.send_hwm)
        # Frames a little over the limit get a frame_too_large reply; far over, the
        # peer's connection is dropped before the frame is buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * self.config.max_frame_bytes)
        sock.bind(endpoint)
        return sock

    # ------------------------------------------------------------- loop
    def stop(self) -> None:
        self._stopping = True

    def close(self) -> None:
        self.front.close(0)
        self.back.close(0)

    def run(self) -> None:
        # zmq_poll on a fixed item list: what zmq.Poller.poll does, minus its wrapper.
        items = [(self.front, _POLLIN), (self.back, _POLLIN)]
        poll, monotonic, yield_cpu = zmq.zmq_poll, time.monotonic, os.sched_yield
        interval = self.config.heartbeat_interval
        spin_s = self.config.spin_us * 1e-6
        next_tick = monotonic() + interval
        spin_until = 0.0
        back = self.back
        drain, on_worker, on_client = self._drain, self._on_worker_frames, self._on_client_frames
        while not self._stopping:
            now = monotonic()
            if now < spin_until:
                events = poll(items, 0)
                if not events:
                    # Spinning must not hold off a thread waiting for this CPU:
                    # most often our own I/O thread, carrying the next message.
                    yield_cpu()
            else:
                # Rounded up: a timeout truncated to 0 ms would spin until the tick.
                wait_ms = math.ceil((next_tick - now) * 1000.0)
                events = poll(items, wait_ms if wait_ms > 0 else 0)
            if events:
                for sock, _ in events:
                    if sock is back:
                        drain(back, on_worker)
                    else:
                        drain(sock, on_client)
                now = monotonic()
                spin_until = now + spin_s
            if now >= next_tick:
                self._tick(now)
                next_tick = now + interval

    def _drain(self, sock: zmq.Socket, handle) -> None:
        # Two plain recv calls are cheaper than recv_multipart for the usual
        # [routing id, payload]; extra frames are collected only when present.
        # Polling said a message is there; after it, EVENTS (one C call) says
        # whether to go on, so a lone message (the common case at low load)
        # costs no zmq.Again exception.
        # A message of other than two frames reaches `handle` as (ident, [frames after it]).
        recv, opt = sock.recv, sock.getsockopt
        stats = self.stats
        for i in range(DRAIN_BATCH):
            try:
                ident = recv(_NOBLOCK)
            except zmq.Again:
                return
            payload = recv()
            if opt(_RCVMORE):
                payload = [payload]
                while opt(_RCVMORE):
                    payload.append(recv())
            stats.messages_in += 1
            try:
                handle(ident, payload)
            except Exception:  # a bug in one message must not stop the broker
                log.exception("failed to handle a message")
            if i == 0 and not opt(_EVENTS) & _POLLIN:
                return

    # ------------------------------------------------------------ sending
    def _send_client(self, client: bytes, msg: dict) -> bool:
        """False when the client is gone (or not reading): its requests are cancelled."""
        try:
            self._front_send(client, _SNDMORE_NOBLOCK)
            self._front_send(self._packb(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._client_gone(client, "client_gone")
                return False
            raise
        self.stats.messages_out += 1
        return True

    def _send_worker(self, worker: WorkerState, frame: bytes) -> bool:
        try:
            self._back_send(worker.identity, _SNDMORE_NOBLOCK)
            self._back_send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                if worker.alive:
                    self._worker_lost(worker, "unreachable")
                return False
            raise
        self.stats.messages_out += 1
        return True

    def _reply_error(self, client: bytes, request_id: Optional[str], code: str, message: str) -> None:
        self._send_client(client, P.error(request_id, code, message))

    # ------------------------------------------------------------ clients
    def _on_client_frames(self, client: bytes, frame) -> None:
        now = time.monotonic()
        self.client_seen[client] = now
        if type(frame) is not bytes:  # more than one frame after the routing id
            self.stats.frames_rejected[Code.BAD_FRAME] += 1
            self._reply_error(client, None, Code.BAD_FRAME,
                              f"expected one frame per message, got {len(frame)}")
            return
        try:
            msg = _decode_client(frame, self.limits)
        except ProtocolError as e:
            self.stats.frames_rejected[e.code] += 1
            self._reply_error(client, e.request_id, e.code, e.message)
            return
        kind = msg["kind"]
        if kind == "generate":
            self._on_generate(client, msg, now)
        elif kind == Kind.PING:
            pass
        elif kind == Kind.CANCEL:
            self._on_cancel(client, msg["request_id"])
        elif kind == Kind.END_SESSION:
            self._on_end_session(client, msg)
        elif kind == Kind.HEALTH:
            alive = len(self.workers)
            self._send_client(client, P.health_reply(
                msg["request_id"], "ok" if alive else "degraded", alive, len(self.queue),
                len(self.requests)))
        elif kind == Kind.STATS:
            self._send_client(client, P.stats_reply(msg["request_id"], self.stats_snapshot()))

    def _refuse(self, client: bytes, request_id: str, code: str, message: str) -> None:
        self.stats.outcomes[code] += 1
        self._reply_error(client, request_id, code, message)

    def _on_generate(self, client: bytes, msg: dict, now: float) -> None:
        self.stats.requests_received += 1
        rid = msg["request_id"]
        sid = msg.get("session_id")
        ckey = (client, rid)
        if ckey in self.by_client:
            return self._refuse(client, rid, Code.DUPLICATE_REQUEST,
                                f"request id {rid!r} is already in flight")
        if sid is not None and sid in self.busy_sessions:
            return self._refuse(client, rid, Code.SESSION_BUSY,
                                f"session {sid!r} already has a request in flight")
        if not self.workers:
            return self._refuse(client, rid, Code.NO_WORKERS, "no worker is connected")
        worker = self._pick(sid)
        if worker is None and len(self.queue) >= self.config.queue_bound:
            return self._refuse(client, rid, Code.OVERLOADED,
                                f"every worker is busy and {len(self.queue)} requests are queued")
        self._next_key += 1
        key = f"{self._next_key:x}"
        p = Pending(key, client, rid, msg, msg.get("stream", False), sid,
                    now + (msg.get("timeout") or self.config.default_timeout))
        self.requests[key] = p
        self.by_client[ckey] = p
        keys = self.client_requests.get(client)
        if keys is None:
            self.client_requests[client] = {key}
        else:
            keys.add(key)
        if sid is not None:
            self.busy_sessions.add(sid)
        if worker is None:
            self.queue.append(p)
        else:
            self._dispatch(p, worker, now)

    def _pick(self, sid: Optional[str]) -> Optional[WorkerState]:
        """Where a request goes now, or None when every worker is full."""
        if sid is not None:
            owner = self.affinity.get(sid)
            if owner is not None and owner.alive and owner.free_slots > 0:
                return owner
        best, best_load = None, None
        for w in self.workers.values():
            free = w.free_slots
            if free > 0:
                load = (free, w.free_kv_blocks)
                if best_load is None or load > best_load:
                    best, best_load = w, load
        return best

    def _dispatch(self, p: Pending, worker: WorkerState, now: Optional[float] = None) -> None:
        sid = p.session_id
        m = p.msg
        if now is None:
            now = time.monotonic()
        p.attempt += 1
        p.worker = worker
        worker.inflight[p.key] = p
        # What P.dispatch builds, written out: this runs once per request.
        out = {"v": 1, "kind": "dispatch", "request_id": p.key, "attempt": p.attempt}
        prompt = m.get("prompt")
        if prompt is not None:
            out["prompt"] = prompt
        else:
            out["input_ids"] = m["input_ids"]
        out["params"] = m.get("params") or {}
        out["resume_tokens"] = p.delivered
        out["resume_text"] = "".join(p.text_parts) if p.text_parts else ""
        out["timeout"] = round(max(p.deadline - now, 0.001), 3)
        if sid is None:
            decision = "stateless"
        else:
            out["session_id"] = sid
            owner = self.affinity.get(sid)
            decision = "affinity" if owner is worker else "new" if owner is None else "moved"
            self.affinity[sid] = worker
        self._send_worker(worker, self._packb(out))
        self.stats.routing[decision] += 1

    def _drain_queue(self) -> None:
        while self.queue:
            p = self.queue[0]
            worker = self._pick(p.session_id)
            if worker is None:
                return
            self.queue.popleft()
            self._dispatch(p, worker)

    def _on_cancel(self, client: bytes, rid: str) -> None:
        p = self.by_client.get((client, rid))
        if p is None:
            self._reply_error(client, rid, Code.UNKNOWN_REQUEST,
                              f"no request {rid!r} in flight (finished or never sent)")
            return
        if p.worker is None:  # still queued: nothing ran, answer at once
            self.queue.remove(p)
            self._cancelled_final(p)
            return
        # The worker confirms with a final (finish_reason cancelled) carrying true usage.
        p.cancelling = True
        p.release_at = time.monotonic() + self.config.cancel_grace
        self.stats.cancels_forwarded += 1
        self._send_worker(p.worker, self._packb(P.cancel(p.key, p.attempt)))

    def _on_end_session(self, client: bytes, msg: dict) -> None:
        rid, sid = msg["request_id"], msg["session_id"]
        if sid in self.busy_sessions:
            self._reply_error(client, rid, Code.SESSION_BUSY, f"session {sid!r} has a request in flight")
            return
        worker = self.affinity.get(sid)
        if worker is None or not worker.alive:
            # Any worker can drop a session: the token store is shared.
            worker = max(self.workers.values(), key=lambda w: w.free_slots, default=None)
        if worker is None:
            self._reply_error(client, rid, Code.NO_WORKERS, "no worker is connected")
            return
        self._next_key += 1
        key = f"e{self._next_key:x}"
        self.pending_ends[key] = PendingEnd(client, rid, sid, worker,
                                            time.monotonic() + self.config.cancel_grace * 5)
        self._send_worker(worker, self._packb(P.end_session(key, sid)))

    def _client_gone(self, client: bytes, outcome: str) -> None:
        """Cancel everything the client has in flight; nothing more is sent to it."""
        for key in list(self.client_requests.get(client, ())):
            p = self.requests.get(key)
            if p is not None and not p.client_done:
                self._abandon(p, outcome)

    def _abandon(self, p: Pending, outcome: str) -> None:
        """The client gets nothing more for `p`; the worker is told to stop."""
        self.stats.outcomes[outcome] += 1
        p.client_done = True
        self._forget_client_side(p)
        if p.worker is None:
            if p in self.queue:
                self.queue.remove(p)
            self._release(p)
            return
        p.release_at = time.monotonic() + self.config.cancel_grace
        self.stats.cancels_forwarded += 1
        self._send_worker(p.worker, self._packb(P.cancel(p.key, p.attempt)))

    # ------------------------------------------------------------ workers
    def _on_worker_frames(self, ident: bytes, frame) -> None:
        if type(frame) is not bytes:  # more than one frame after the routing id
            self.stats.worker_frames_rejected[Code.BAD_FRAME] += 1
            return
        try:
            msg = _decode_worker(frame, self.limits)
        except ProtocolError as e:
            self.stats.worker_frames_rejected[e.code] += 1
            log.warning("rejected a frame from worker %r: %s", ident, e.message)
            return
        kind = msg["kind"]
        worker = self.workers.get(ident)
        if worker is None or kind == Kind.REGISTER:
            if kind == Kind.REGISTER:
                self._on_register(ident, msg)
            else:  # dropped earlier, or the broker restarted
                self._send_raw(ident, _RECONNECT_FRAME)
            return
        worker.expiry = time.monotonic() + self._silence_s
        if kind == "delta":
            self._on_delta(worker, msg)
        elif kind == "final":
            self._on_final(worker, msg)
        elif kind == Kind.HEARTBEAT:
            self._on_heartbeat(worker, msg)
        elif kind == Kind.ERROR:
            self._on_worker_error(worker, msg)
        elif kind == Kind.SESSION_ENDED:
            self._on_session_ended(worker, msg["request_id"], None)

    def _send_raw(self, ident: bytes, frame: bytes) -> None:
        try:
            self.back.send_multipart((ident, frame), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _on_register(self, ident: bytes, msg: dict) -> None:
        old = self.workers.get(ident)
        now = time.monotonic()
        worker = WorkerState(identity=ident, worker_id=msg["worker_id"], model=msg["model"],
                             slots=msg["slots"], kv_blocks=msg["kv_blocks"],
                             metrics_port=msg.get("metrics_port"),
                             expiry=now + self.config.heartbeat_interval * self.config.liveness,
                             free_kv_blocks=msg["kv_blocks"])
        self.workers[ident] = worker
        self.stats.workers_registered += 1
        if old is not None:  # it started over with us: its old work is gone
            self._worker_lost(old, "re-registered")
        log.info("worker %s registered: %d slots, %d kv blocks", worker.worker_id, worker.slots,
                 worker.kv_blocks)
        self._send_worker(worker, self._packb(P.registered(self.config.heartbeat_interval,
                                                          self.config.liveness)))
        self._drain_queue()

    def _on_heartbeat(self, worker: WorkerState, msg: dict) -> None:
        worker.free_kv_blocks = msg["free_kv_blocks"]
        worker.queue_len = msg["queue_len"]
        if msg.get("sessions_reset"):
            for sid in worker.sessions:
                if self.affinity.get(sid) is worker:
                    del self.affinity[sid]
            worker.sessions.clear()
        for sid in msg.get("sessions_removed", ()):
            worker.sessions.discard(sid)
            if self.affinity.get(sid) is worker:
                del self.affinity[sid]
        for sid in msg.get("sessions_added", ()):
            worker.sessions.add(sid)
            owner = self.affinity.get(sid)
            # Where a session last ran beats an older copy another worker still holds.
            if owner is None or not owner.alive:
                self.affinity[sid] = worker

    def _current(self, worker: WorkerState, msg: dict) -> Optional[Pending]:
        """The request a worker message belongs to, or None for a stale one."""
        p = self.requests.get(msg["request_id"])
        if p is None or p.worker is not worker or p.attempt != msg.get("attempt"):
            self.stats.stale_dropped += 1
            return None
        return p

    def _accept_tokens(self, p: Pending, msg: dict) -> Optional[list]:
        """The new tokens of a delta/final in order, [] for a duplicate, None for a gap."""
        tokens = msg["token_ids"]
        index, have = msg["index"] if "index" in msg else len(p.delivered), len(p.delivered)
        if index != have:
            if index > have:
                return None
            if index + len(tokens) <= have:
                self.stats.duplicates_dropped += 1
                return []
            tokens = tokens[have - index:]
        p.delivered.extend(tokens)
        return tokens

    def _on_delta(self, worker: WorkerState, msg: dict) -> None:
        p = self.requests.get(msg["request_id"])
        if p is None or p.worker is not worker or p.attempt != msg["attempt"]:
            self.stats.stale_dropped += 1
            return
        if p.client_done:
            return
        delivered = p.delivered
        start = len(delivered)
        if msg["index"] == start:  # in order, the usual case
            tokens = msg["token_ids"]
            delivered.extend(tokens)
        else:
            tokens = self._accept_tokens(p, msg)
            if tokens is None:
                return self._fail_gap(p, msg)
        text = msg["text"]
        if not tokens and not text:
            return
        p.text_parts.append(text)
        if p.stream:
            seq = p.seq
            p.seq = seq + 1
            # The worker's delta with the client's id and seq in place of key and attempt.
            self._send_client(p.client, {"v": 1, "kind": "delta", "request_id": p.request_id,
                                         "seq": seq, "index": start, "token_ids": tokens,
                                         "text": text})

    def _on_final(self, worker: WorkerState, msg: dict) -> None:
        p = self.requests.get(msg["request_id"])
        if p is None or p.worker is not worker or p.attempt != msg["attempt"]:
            self.stats.stale_dropped += 1
            return
        if p.client_done:
            self._release(p)
            return
        # A final has no index: its tokens follow the last delta's.
        delivered = p.delivered
        start = len(delivered)
        tail = msg["token_ids"]
        delivered.extend(tail)
        text = msg["text"]
        # The worker's map is ours (freshly decoded): patch it instead of copying.
        usage = msg["usage"]
        usage["completion_tokens"] = len(delivered)  # includes tokens from earlier attempts
        reason = msg["finish_reason"]
        if p.stream:
            p.text_parts.append(text)
            if tail or text:
                self._send_client(p.client, {"v": 1, "kind": "delta", "request_id": p.request_id,
                                             "seq": p.seq, "index": start, "token_ids": tail,
                                             "text": text})
                p.seq += 1
            tokens, text = [], ""
        else:
            tokens = delivered
            if p.text_parts:
                p.text_parts.append(text)
                text = "".join(p.text_parts)
        p.client_done = True  # before the send: a gone client is not cancelled twice
        self._send_client(p.client, {"v": 1, "kind": "final", "request_id": p.request_id,
                                     "seq": p.seq, "finish_reason": reason, "usage": usage,
                                     "token_ids": tokens, "text": text})
        self._finish(p, "cancelled" if reason == "cancelled" else "completed")

    def _on_worker_error(self, worker: WorkerState, msg: dict) -> None:
        rid = msg["request_id"]
        if rid is not None and rid in self.pending_ends:
            return self._on_session_ended(worker, rid, msg)
        if rid is None:
            log.warning("worker %s reported: %s %s", worker.worker_id, msg["code"], msg["message"])
            return
        p = self._current(worker, msg)
        if p is None:
            return
        if not p.client_done:
            self._last_reply(p, P.error(p.request_id, msg["code"], msg["message"], msg["retryable"]))
        self._finish(p, "failed")

    def _on_session_ended(self, worker: WorkerState, key: str, err: Optional[dict]) -> None:
        end = self.pending_ends.pop(key, None)
        if end is None:
            self.stats.stale_dropped += 1
            return
        if err is None:
            if self.affinity.get(end.session_id) is not None:
                del self.affinity[end.session_id]
            for w in self.workers.values():
                w.sessions.discard(end.session_id)
            self._send_client(end.client, P.session_ended(end.request_id, end.session_id))
        else:
            self._send_client(end.client, P.error(end.request_id, err["code"], err["message"],
                                                  err["retryable"]))

    def _fail_gap(self, p: Pending, msg: dict) -> None:
        log.error("worker skipped tokens on %s: index %s, have %d", p.key, msg.get("index"),
                  len(p.delivered))
        self._last_reply(p, P.error(p.request_id, Code.INTERNAL,
                                    "worker stream had a gap; request aborted"))
        self._abandon(p, "failed")

    # -------------------------------------------------------- lifecycle
    def _forget_client_side(self, p: Pending) -> None:
        self.by_client.pop((p.client, p.request_id), None)
        keys = self.client_requests.get(p.client)
        if keys is not None:
            keys.discard(p.key)
            if not keys:
                del self.client_requests[p.client]

    def _release(self, p: Pending) -> None:
        """Free everything `p` holds: its slot, its session lock, its entry."""
        self.requests.pop(p.key, None)
        if p.worker is not None:
            p.worker.inflight.pop(p.key, None)
            p.worker = None
        if p.session_id is not None:
            self.busy_sessions.discard(p.session_id)
        if self.queue:
            self._drain_queue()

    def _finish(self, p: Pending, outcome: str) -> None:
        if self.observer is not None:  # the deadline was set at arrival
            started = p.deadline - (p.msg.get("timeout") or self.config.default_timeout)
            self.observer.finished(time.monotonic() - started)
        self.stats.outcomes[outcome] += 1
        p.client_done = True
        self._forget_client_side(p)
        self._release(p)

    def _last_reply(self, p: Pending, msg: dict) -> None:
        # Marked done first: if the send finds the client gone, nothing is cancelled twice.
        p.client_done = True
        self._send_client(p.client, msg)

    def _fail(self, p: Pending, code: str, message: str) -> None:
        self._last_reply(p, P.error(p.request_id, code, message))
        self._finish(p, code)

    def _cancelled_final(self, p: Pending) -> None:
        """The broker's own final for a cancel the worker could not confirm."""
        self._last_reply(p, P.final(p.request_id, p.seq, "cancelled", P.usage(0, 0, len(p.delivered)),
                                    [] if p.stream else p.delivered,
                                    "" if p.stream else "".join(p.text_parts)))
        self._finish(p, "cancelled")

    def _worker_lost(self, worker: WorkerState, why: str) -> None:
        log.warning("worker %s lost (%s); %d requests in flight", worker.worker_id, why,
                    len(worker.inflight))
        worker.alive = False
        if self.workers.get(worker.identity) is worker:
            del self.workers[worker.identity]
        self.stats.workers_lost += 1
        for sid in [s for s, w in self.affinity.items() if w is worker]:
            del self.affinity[sid]
        for key, end in list(self.pending_ends.items()):
            if end.worker is worker:
                del self.pending_ends[key]
                self._send_client(end.client, P.error(end.request_id, Code.WORKER_LOST,
                                                      "the worker died before answering"))
        orphans = list(worker.inflight.values())
        worker.inflight.clear()
        requeue = []
        for p in orphans:
            p.worker = None
            if p.client_done:
                self._release(p)
            elif p.cancelling:
                self._cancelled_final(p)
            elif not self.workers or p.redispatches >= self.config.max_redispatch:
                self._fail(p, Code.WORKER_LOST, f"worker {worker.worker_id} was lost and the "
                           "request could not be moved")
            else:
                p.redispatches += 1
                self.stats.redispatches += 1
                if p.delivered:
                    self.stats.redispatches_resumed += 1
                requeue.append(p)
        # Moved requests go ahead of new ones: they were admitted first.
        self.queue.extendleft(reversed(requeue))
        if not self.workers:
            while self.queue:
                self._fail(self.queue.popleft(), Code.NO_WORKERS, "no worker is connected")
        self._drain_queue()

    def _tick(self, now: float) -> None:
        for worker in list(self.workers.values()):
            if now > worker.expiry:
                self._worker_lost(worker, "missed heartbeats")
            else:
                self._send_worker(worker, _HEARTBEAT_FRAME)
        silent_before = now - self.config.client_timeout
        for client in list(self.client_requests):
            if self.client_seen.get(client, 0.0) < silent_before:
                self._client_gone(client, "client_gone")
        for client in [c for c, t in self.client_seen.items()
                       if t < silent_before and c not in self.client_requests]:
            del self.client_seen[client]
        for p in list(self.requests.values()):
            if p.client_done:
                if now > p.release_at:  # the worker never confirmed the cancel
                    self._release(p)
            elif p.cancelling and now > p.release_at:
                self._cancelled_final(p)
            elif now > p.deadline:
                self._last_reply(p, P.error(p.request_id, Code.TIMEOUT, "the request's deadline passed"))
                self._abandon(p, "timeout")
        for key, end in list(self.pending_ends.items()):
            if now > end.deadline:
                del self.pending_ends[key]
                self._send_client(end.client, P.error(end.request_id, Code.TIMEOUT,
                                                      "the worker did not answer end_session"))
        if self.observer is not None:
            self.observer.tick(self)

    def stats_snapshot(self) -> dict:
        return self.stats.snapshot(
            queue_depth=len(self.queue), workers_alive=len(self.workers),
            inflight=len(self.requests), slots_total=sum(w.slots for w in self.workers.values()),
            slots_free=sum(w.free_slots for w in self.workers.values()),
            sessions_tracked=len(self.affinity), clients=len(self.client_requests))


def run_broker(config: BrokerConfig, ready=None) -> None:
    """Serve until SIGINT/SIGTERM (when run from main) or `broker.stop()`.
    `ready(broker)` is called once the sockets are bound."""
    broker = Broker(config)
    try:
        if ready is not None:
            ready(broker)
        broker.run()
    finally:
        broker.close()
