"""What the broker knows about workers and requests, and its counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional


@dataclass(eq=False, slots=True)
class WorkerState:
    identity: bytes  # ZeroMQ routing id on the back socket
    worker_id: str
    model: str
    slots: int
    kv_blocks: int
    metrics_port: Optional[int]
    expiry: float  # dropped when not heard from by then
    free_kv_blocks: int = 0
    queue_len: int = 0  # the worker's own backlog, from heartbeats
    sessions: set = field(default_factory=set)  # session ids it reports resident
    inflight: dict = field(default_factory=dict)  # broker key -> Pending
    alive: bool = True

    @property
    def free_slots(self) -> int:
        # The broker's own count is current; a heartbeat's is up to an interval old.
        return self.slots - len(self.inflight)


@dataclass(eq=False, slots=True)
class Pending:
    """One generate request from accept to its final reply."""

    key: str  # broker-assigned id used towards workers
    client: bytes  # routing id on the front socket
    request_id: str  # the client's id
    msg: dict  # the decoded generate message
    stream: bool
    session_id: Optional[str]
    deadline: float
    worker: Optional[WorkerState] = None
    attempt: int = 0
    redispatches: int = 0
    delivered: list = field(default_factory=list)  # token ids already accepted, in order
    text_parts: list = field(default_factory=list)
    seq: int = 0  # next delta sequence number towards the client
    cancelling: bool = False  # the client cancelled; waiting for the worker's final
    client_done: bool = False  # the client got its last message; only the slot is held
    release_at: float = 0.0  # when client_done: free the slot by then even without a final


@dataclass(eq=False, slots=True)
class PendingEnd:
    """An end_session waiting for the worker's answer."""

    client: bytes
    request_id: str
    session_id: str
    worker: WorkerState
    deadline: float


@dataclass
class BrokerStats:
    requests_received: int = 0
    outcomes: Counter = field(default_factory=Counter)  # completed, cancelled, timeout, ...
    routing: Counter = field(default_factory=Counter)  # affinity, moved, new, stateless
    frames_rejected: Counter = field(default_factory=Counter)  # client frames, by error code
    worker_frames_rejected: Counter = field(default_factory=Counter)
    redispatches: int = 0
    redispatches_resumed: int = 0  # re-dispatched after tokens had been delivered
    duplicates_dropped: int = 0  # deltas already delivered (resends)
    stale_dropped: int = 0  # messages from a superseded attempt or unknown request
    cancels_forwarded: int = 0
    workers_registered: int = 0
    workers_lost: int = 0
    messages_in: int = 0
    messages_out: int = 0

    def snapshot(self, **gauges: int) -> dict:
        return {
            "requests_received": self.requests_received,
            "requests_by_outcome": dict(self.outcomes),
            "routing": dict(self.routing),
            "frames_rejected": dict(self.frames_rejected),
            "worker_frames_rejected": dict(self.worker_frames_rejected),
            "redispatches": self.redispatches,
            "redispatches_resumed": self.redispatches_resumed,
            "duplicates_dropped": self.duplicates_dropped,
            "stale_dropped": self.stale_dropped,
            "cancels_forwarded": self.cancels_forwarded,
            "workers_registered": self.workers_registered,
            "workers_lost": self.workers_lost,
            "messages_in": self.messages_in,
            "messages_out": self.messages_out,
            **gauges,
        }
