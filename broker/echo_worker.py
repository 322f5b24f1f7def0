"""A model-free worker for tests and benchmarks, speaking the real worker
protocol: it registers, heartbeats, and answers each dispatch by streaming
the prompt's token ids back (cycled up to max_tokens), one step at a time.

    python -m turbomq.broker.echo_worker --broker tcp://127.0.0.1:5556 --delay 0.01

Output token i of a request is input_ids[i % len(input_ids)] (a text prompt
becomes its code points; chat messages the code points of their contents
joined), so a resumed stream is checkable exactly.
`--die-after N` exits abruptly after N deltas, to simulate a crash.

The connection itself (socket, register, heartbeats with session diffs,
liveness, reconnect) is turbomq.worker.service.link.BrokerLink, the real worker's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import zmq

from turbomq.clients import protocol as P
from turbomq.clients.keys import CurveClient
from turbomq.clients.protocol import Code, Kind
from turbomq.worker.service.link import BrokerLink  # torch-free (turbomq.worker imports lazily)


@dataclass
class EchoConfig:
    broker: str = "tcp://127.0.0.1:5556"
    worker_id: str = field(default_factory=lambda: "echo-" + uuid.uuid4().hex[:8])
    slots: int = 8
    kv_blocks: int = 1024
    delay: float = 0.0  # seconds per step (0: as fast as the sockets go)
    tokens_per_delta: int = 1
    die_after: int = 0  # os._exit after this many deltas; 0 never
    event_log: Optional[str] = None  # JSON lines: dispatch / cancel / end_session
    model: str = "echo"
    curve_secret: Optional[str] = None  # CurveZMQ: this worker's NAME.key_secret ...
    broker_key: Optional[str] = None  # ... and the broker's public NAME.key


def token_text(t: int) -> str:
    return chr(t) if 32 <= t < 0xD800 else f"<{t}>"


@dataclass(eq=False)
class EchoRequest:
    key: str
    attempt: int
    source: list  # the tokens echoed back
    max_tokens: int
    next_index: int  # resume point: tokens before it were delivered by someone else
    session_id: Optional[str]
    prompt_tokens: int


class EchoWorker:
    """The request side of a worker; the connection (socket, register,
    heartbeats, liveness, reconnect) is turbomq.worker.service.link.BrokerLink, as in
    the real worker (worker/service/loop.py)."""

    def __init__(self, config: EchoConfig, context: Optional[zmq.Context] = None):
        self.config = config
        self.ctx = context or zmq.Context.instance()
        curve = (CurveClient.load(config.curve_secret, config.broker_key)
                 if config.curve_secret else None)
        self.link = BrokerLink(self.ctx, config.broker, self._register_msg, curve=curve)
        self.active: dict[str, EchoRequest] = {}
        self.waiting: deque[EchoRequest] = deque()
        self.sessions: set[str] = set()  # resident sessions, reported in heartbeats
        self.deltas_sent = 0
        self._stopping = False
        self._log = open(config.event_log, "a", buffering=1) if config.event_log else None

    def stop(self) -> None:
        self._stopping = True

    def _event(self, **fields) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"worker_id": self.config.worker_id, **fields}) + "\n")

    def _register_msg(self) -> dict:
        c = self.config
        return P.register(c.worker_id, c.model, c.slots, c.kv_blocks)

    def _send(self, msg: dict) -> None:
        self.link.send(msg)

    def _heartbeat(self) -> None:
        self.link.heartbeat(free_slots=self.config.slots - len(self.active),
                            free_kv_blocks=self.config.kv_blocks, queue_len=len(self.waiting),
                            resident=self.sessions)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.link.connect(), zmq.POLLIN)
        next_step = time.monotonic()
        try:
            while not self._stopping:
                now = time.monotonic()
                wait = self.link.wait_s(now)
                if self.active:
                    wait = min(wait, max(0.0, next_step - now))
                if poller.poll(wait * 1000.0):
                    for msg in self.link.receive():
                        self._handle(msg)
                now = time.monotonic()
                if self.link.lost(now):
                    # The broker went away (or said reconnect): it re-dispatches
                    # whatever this connection had, so start over.
                    self.active.clear()
                    self.waiting.clear()
                    poller.unregister(self.link.sock)
                    poller.register(self.link.connect(), zmq.POLLIN)
                    continue
                if self.link.beat_due(now):
                    self._heartbeat()
                if self.active and now >= next_step:
                    self._step()
                    next_step = now + self.config.delay
        finally:
            self.link.close()

    def _handle(self, msg: dict) -> None:
        kind = msg["kind"]
        if kind == Kind.DISPATCH:
            self._on_dispatch(msg)
        elif kind == Kind.CANCEL:
            self._on_cancel(msg["request_id"], msg["attempt"])
        elif kind == Kind.END_SESSION:
            self._on_end_session(msg["request_id"], msg["session_id"], msg.get("tenant", ""))

    def _on_dispatch(self, msg: dict) -> None:
        text = msg.get("prompt")
        if text is None and msg.get("messages") is not None:  # a chat: its contents, in order
            text = "".join(m["content"] for m in msg["messages"])
        source = msg.get("input_ids") or [ord(c) for c in text] or [0]
        resume = msg["resume_tokens"]
        params = msg.get("params") or {}
        req = EchoRequest(key=msg["request_id"], attempt=msg["attempt"], source=source,
                          max_tokens=params.get("max_tokens", 16), next_index=len(resume),
                          session_id=msg.get("session_id"), prompt_tokens=len(source))
        self._event(event="dispatch", request_id=req.key, attempt=req.attempt,
                    resume=len(resume), session_id=req.session_id)
        expected = [source[i % len(source)] for i in range(len(resume))]
        if resume != expected:
            self._send(P.error(req.key, Code.INVALID_REQUEST, "resume_tokens do not match "
                               "this echo's output", attempt=req.attempt))
            return
        if req.session_id is not None:  # keyed by tenant, as the broker keys it
            self.sessions.add(f"{msg.get('tenant', '')}:{req.session_id}")
        if len(self.active) < self.config.slots:
            self.active[req.key] = req
        else:
            self.waiting.append(req)

    def _on_cancel(self, key: str, attempt: int) -> None:
        self._event(event="cancel", request_id=key, attempt=attempt)
        req = self.active.pop(key, None)
        if req is None:
            for w in self.waiting:
                if w.key == key:
                    req = w
                    self.waiting.remove(w)
                    break
        if req is not None and req.attempt == attempt:
            self._final(req, "cancelled")
        self._admit()

    def _on_end_session(self, key: str, sid: str, tenant: str) -> None:
        self._event(event="end_session", request_id=key, session_id=sid)
        if f"{tenant}:{sid}" in self.sessions:
            self.sessions.discard(f"{tenant}:{sid}")
            self._send(P.session_ended(key, sid))
        else:
            self._send(P.error(key, Code.UNKNOWN_SESSION, f"no session {sid!r}"))

    def _final(self, req: EchoRequest, reason: str, tokens: Optional[list] = None,
               text: str = "") -> None:
        usage = P.usage(req.prompt_tokens, 0, req.next_index)
        self._send(P.worker_final(req.key, req.attempt, reason, usage, tokens or [], text))

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.config.slots:
            req = self.waiting.popleft()
            self.active[req.key] = req

    def _step(self) -> None:
        """One 'decode step': every active request emits its next tokens."""
        per = self.config.tokens_per_delta
        done = []
        for req in self.active.values():
            start = req.next_index
            end = min(start + per, req.max_tokens)
            src, n = req.source, len(req.source)
            tokens = [src[i % n] for i in range(start, end)]
            text = "".join(token_text(t) for t in tokens)
            req.next_index = end
            if end >= req.max_tokens:
                # The last step's tokens ride on the final, as the engine's do.
                done.append(req)
                self._final(req, "length", tokens, text)
                continue
            self._send(P.worker_delta(req.key, req.attempt, start, tokens, text))
            self.deltas_sent += 1
            if self.config.die_after and self.deltas_sent >= self.config.die_after:
                os._exit(17)
        for req in done:
            del self.active[req.key]
        self._admit()


def main(argv: Optional[Sequence[str]] = None) -> int:
    d = EchoConfig()
    p = argparse.ArgumentParser(prog="echo_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--broker", default=d.broker)
    p.add_argument("--worker-id", default=None)
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--kv-blocks", type=int, default=d.kv_blocks)
    p.add_argument("--delay", type=float, default=d.delay, help="seconds per step")
    p.add_argument("--tokens-per-delta", type=int, default=d.tokens_per_delta)
    p.add_argument("--die-after", type=int, default=0, help="exit abruptly after N deltas")
    p.add_argument("--event-log", default=None)
    p.add_argument("--curve-secret", default=None)
    p.add_argument("--broker-key", default=None)
    args = p.parse_args(argv)
    config = EchoConfig(broker=args.broker, slots=args.slots, kv_blocks=args.kv_blocks,
                        delay=args.delay, tokens_per_delta=args.tokens_per_delta,
                        die_after=args.die_after, event_log=args.event_log,
                        curve_secret=args.curve_secret, broker_key=args.broker_key)
    if args.worker_id:
        config.worker_id = args.worker_id
    worker = EchoWorker(config)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
