"""The worker end of the broker connection: the socket, registration,
heartbeats with session-residency diffs, liveness and reconnect (points 1, 2
and 7 of the worker's contract in docs/protocol.md). No torch: any worker,
real or fake, can use it.

    link = BrokerLink(ctx, "tcp://127.0.0.1:5556", lambda: P.register(...))
    link.connect()
    while running:
        poll link.sock (and whatever else) for up to link.wait_s(now)
        for msg in link.receive(): ...            # dispatch / cancel / end_session
        if link.lost(now): drop in-flight work; link.connect()
        if link.beat_due(now): link.heartbeat(free_slots, free_kv, queue_len, resident)
"""

from __future__ import annotations

import logging
import time
from typing import AbstractSet, Callable, Optional

import zmq

from turbomq.clients import protocol as P
from turbomq.clients.keys import CurveClient
from turbomq.clients.protocol import Kind, ProtocolError

log = logging.getLogger("turbomq.worker.link")


class BrokerLink:
    def __init__(self, context: zmq.Context, endpoint: str, register: Callable[[], dict],
                 limits: P.Limits = P.DEFAULT_LIMITS, index: int = 0,
                 curve: Optional[CurveClient] = None):
        self.ctx = context
        self.endpoint = endpoint
        self.curve = curve  # CurveZMQ keys, when the broker asks for them
        self.index = index  # its place among the worker's brokers
        self._register = register  # builds the register message (ports may change)
        self.limits = limits
        self.sock: Optional[zmq.Socket] = None
        # The broker's values arrive with `registered`; these hold until then.
        self.heartbeat_interval = 0.5
        self.liveness = 3
        self.registered = False
        self.connects = 0
        self._last_heard = 0.0
        self._next_beat = 0.0
        self._reported: set[str] = set()  # sessions the broker has been told about
        self._reset_pending = True

    # ------------------------------------------------------------ socket
    def connect(self) -> zmq.Socket:
        """A fresh socket and a `register`. The broker re-dispatches whatever
        the old connection had in flight, so callers drop it first."""
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(self.sock)
        self.sock.connect(self.endpoint)
        self.registered = False
        self.connects += 1
        self._reported = set()
        self._reset_pending = True
        self.send(self._register())
        self._last_heard = time.monotonic()
        self._next_beat = self._last_heard + self.heartbeat_interval
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None

    def send(self, msg: dict) -> None:
        self.sock.send(P.pack(msg))

    # ----------------------------------------------------------- receive
    def receive(self) -> list[dict]:
        """Drain the socket. Link messages (registered, heartbeat, reconnect)
        are handled here; the work commands come back in order. A malformed
        frame is answered with an error naming no request and skipped."""
        work = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return work
            self._last_heard = time.monotonic()
            try:
                msg = P.decode_broker_command(frame, self.limits)
            except ProtocolError as e:
                log.warning("rejected a frame from the broker: %s %s", e.code, e.message)
                self.send(P.error(None, e.code, e.message))
                continue
            kind = msg["kind"]
            if kind == Kind.REGISTERED:
                self.heartbeat_interval = msg["heartbeat_interval"]
                self.liveness = msg["liveness"]
                self.registered = True
                self._next_beat = 0.0  # beat now, then at the broker's interval
            elif kind == Kind.RECONNECT:
                self._last_heard = 0.0  # lost() says so; the caller reconnects
            elif kind != Kind.HEARTBEAT:
                work.append(msg)

    # ---------------------------------------------------------- liveness
    def lost(self, now: float) -> bool:
        """Nothing heard for heartbeat_interval * liveness, or told to reconnect."""
        return now - self._last_heard > self.heartbeat_interval * self.liveness

    def beat_due(self, now: float) -> bool:
        return now >= self._next_beat

    def wait_s(self, now: float) -> float:
        """Seconds until the next heartbeat or liveness check is due."""
        expiry = self._last_heard + self.heartbeat_interval * self.liveness
        return max(0.0, min(self._next_beat, expiry) - now)

    def heartbeat(self, free_slots: int, free_kv_blocks: int, queue_len: int,
                  resident: AbstractSet[str]) -> None:
        """Send load and the change in resident sessions since the last
        heartbeat (all of them, with sessions_reset, after a register). Diffs
        over the per-message limit continue in the next heartbeats."""
        limit = self.limits.max_heartbeat_sessions
        added = sorted(resident - self._reported)[:limit]
        removed = sorted(self._reported - resident)[:limit]
        self.send(P.heartbeat(free_slots=max(free_slots, 0), free_kv_blocks=max(free_kv_blocks, 0),
                              queue_len=max(queue_len, 0), sessions_reset=self._reset_pending,
                              sessions_added=added, sessions_removed=removed))
        self._reported.difference_update(removed)
        self._reported.update(added)
        self._reset_pending = False
        self._next_beat = time.monotonic() + self.heartbeat_interval
