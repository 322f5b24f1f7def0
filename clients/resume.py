"""What a client keeps so that no accepted request is lost with its broker
(docs/protocol.md, "Resume").

Per generate in flight, `InFlight` holds the request as first sent and the
output already handed to the application. When the broker that holds it is
gone (silent past the liveness window, or its pong names another broker id:
it restarted) or answers with a retryable error, the client sends the same
request again, to the same or the next broker, with `resume_tokens` /
`resume_text`: the stream goes on at the next index, with no gap and no
duplicate. `BrokerWatch` tracks which broker the client talks to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from . import protocol as P
from .errors import ServerError

# The client waits this much past a request's timeout for the broker's own
# `timeout` error before giving up locally.
DEADLINE_GRACE_S = 1.0

# Errors a client retries by itself (with backoff, until the deadline): the
# service will take the request once a worker, the session or the store is
# free again. Others (overloaded: back-pressure; timeout) reach the application.
RETRIED_CODES = frozenset({P.Code.NO_WORKERS, P.Code.WORKER_LOST, P.Code.SESSION_BUSY,
                           P.Code.SESSION_STORE_UNAVAILABLE})
RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)
# A send the socket cannot take this fast (no connection to a broker) is
# dropped; the resend after the failover carries it.
SEND_TIMEOUT_S = 0.5


@dataclass(eq=False)
class InFlight:
    request_id: str
    msg: dict  # the generate as first sent
    deadline: float  # monotonic; the broker's own deadline is DEADLINE_GRACE_S earlier
    broker_id: Optional[str] = None  # the broker it was last sent to, once known
    tokens: list = field(default_factory=list)  # delivered to the application (streams)
    text: str = ""
    seq: int = 0  # next seq handed to the application
    retries: int = 0
    retry_at: Optional[float] = None  # a retry is due then
    sends: int = 0

    @property
    def stream(self) -> bool:
        return bool(self.msg.get("stream"))

    def frame(self, now: float) -> bytes:
        """The generate to send (again), with what the application already has."""
        msg = dict(self.msg)
        if self.tokens:
            msg["resume_tokens"] = list(self.tokens)
            msg["resume_text"] = self.text
        msg["timeout"] = round(max(self.deadline - DEADLINE_GRACE_S - now, 0.001), 3)
        self.sends += 1
        return P.pack(msg)

    def accept(self, msg: dict, now: float) -> Optional[dict]:
        """A reply as the application sees it (seq renumbered across resends),
        or None: a delta already delivered, or an error this client retries."""
        kind = msg["kind"]
        if kind == P.Kind.DELTA:
            have, index, ids = len(self.tokens), msg["index"], msg["token_ids"]
            if index < have and index + len(ids) <= have:
                return None  # delivered before a resend
            if index != have:
                raise ServerError(P.Code.INTERNAL, f"stream out of order: tokens from {index} "
                                                   f"after {have}", False, self.request_id)
            self.tokens.extend(ids)
            self.text += msg["text"]
            out = {**msg, "seq": self.seq}
            self.seq += 1
            return out
        if kind == P.Kind.FINAL:
            return {**msg, "seq": self.seq}
        if kind == P.Kind.ERROR:
            if msg["code"] == P.Code.DUPLICATE_REQUEST and self.sends > 1:
                return None  # sent again to a broker that had it after all: it goes on there
            if msg["code"] in RETRIED_CODES and self._retry(now):
                return None
        return msg

    def _retry(self, now: float) -> bool:
        delay = RETRY_BACKOFF_S[min(self.retries, len(RETRY_BACKOFF_S) - 1)]
        if now + delay >= self.deadline - DEADLINE_GRACE_S:
            return False
        self.retries += 1
        self.retry_at = now + delay
        return True


class BrokerWatch:
    """Which broker the client talks to, and whether it is still there."""

    def __init__(self, endpoints: Sequence[str], ping_interval: float, liveness: int):
        if not endpoints:
            raise ValueError("give at least one broker endpoint")
        self.endpoints = list(endpoints)
        self.ping_interval = ping_interval
        self.liveness = liveness
        self.index = 0
        self.broker_id: Optional[str] = None  # from the last pong
        # The first ping sent since the broker was last heard from: silence is
        # measured from there, so a client that stopped reading for a while
        # (an application busy elsewhere) does not count as a dead broker.
        self.unanswered_since: Optional[float] = None
        self.failovers = 0

    @property
    def endpoint(self) -> str:
        return self.endpoints[self.index]

    def heard(self, now: float) -> None:
        self.unanswered_since = None

    def pinged(self, now: float) -> None:
        if self.unanswered_since is None:
            self.unanswered_since = now

    def silent(self, now: float) -> bool:
        """No word from the broker for `liveness` ping intervals after a ping."""
        since = self.unanswered_since
        return since is not None and now - since > self.ping_interval * self.liveness

    def next_endpoint(self, now: float) -> str:
        """Move on (round robin; the same one when there is one): a fresh
        connection whose broker is not known yet."""
        self.index = (self.index + 1) % len(self.endpoints)
        self.broker_id = None
        self.unanswered_since = None
        self.failovers += 1
        return self.endpoint

    def lost_by_pong(self, broker_id: str, inflight: Sequence[InFlight]) -> list[InFlight]:
        """A pong: the requests sent to another broker than this one are gone
        (it restarted on the same address). Requests sent before any pong was
        heard are taken to be with this one."""
        self.broker_id = broker_id
        lost = []
        for req in inflight:
            if req.broker_id is None:
                req.broker_id = broker_id
            elif req.broker_id != broker_id and req.retry_at is None:
                lost.append(req)
        return lost
