"""Broker settings."""

from __future__ import annotations

from dataclasses import dataclass

from turbomq.clients.keys import is_local_endpoint


@dataclass
class BrokerConfig:
    front: str = "tcp://127.0.0.1:5555"  # clients connect here (ROUTER)
    back: str = "tcp://127.0.0.1:5556"  # workers connect here (ROUTER)
    heartbeat_interval: float = 0.5  # seconds between heartbeats, both ways
    liveness: int = 3  # heartbeats a worker may miss before it is dropped
    queue_bound: int = 1024  # requests waiting for a free slot; past it: overloaded
    max_frame_bytes: int = 1 << 20  # larger frames get frame_too_large
    client_timeout: float = 30.0  # cancel the requests of a client silent this long
    default_timeout: float = 300.0  # request deadline when the client sets none
    cancel_grace: float = 2.0  # wait this long for a worker to confirm a cancel
    max_redispatch: int = 3  # worker losses one request survives
    # False: a request with no worker to run it (none connected, or its worker
    # lost with no other) waits in the queue until one comes or its deadline
    # passes. True: it fails at once (no_workers / worker_lost).
    fail_fast: bool = False
    broker_id: str = ""  # this process's id in pong/registered; "" picks a random one
    # CurveZMQ (docs/security.md): the broker's NAME.key_secret; both sockets
    # then encrypt and admit only the public keys of the allow-lists, which
    # are read again whenever their files change. "": plain.
    curve_secret: str = ""
    client_keys: str = ""  # allow-list of client keys: `TENANT PUBLIC_KEY` lines
    worker_keys: str = ""  # allow-list of worker keys: `NAME PUBLIC_KEY` lines
    # Plain mode is for loopback and ipc; on any other address it needs this.
    allow_plain: bool = False
    # Per tenant (a client key's name on client_keys; plain mode: one tenant),
    # 0 = no limit. Past a limit, new requests get the retryable rate_limited.
    tenant_max_inflight: int = 0  # requests in flight
    tenant_tokens_per_s: float = 0.0  # generated tokens per second, averaged over ...
    tenant_token_burst_s: float = 10.0  # ... a bucket holding this many seconds of them
    send_hwm: int = 100_000  # per-peer outbound queue, in messages
    # After a burst of messages, keep polling (without sleeping) this long for
    # the next one before blocking: a reply that comes back soon is picked up
    # at once instead of after a wake-up. 0: block at once.
    spin_us: float = 250.0
    # Cache-aware routing of requests without a session (docs/broker.md,
    # "Prefix routing"): requests whose leading prefix_bytes (of the prompt,
    # of each first message, or prefix_bytes / 4 token ids) are equal go to the
    # same worker, where its prefix cache holds their KV, while that worker
    # has a free slot and at most (1 + prefix_balance) times its share of the
    # requests in flight; else the next worker in the key's order. False:
    # the worker with the most free slots, as for a session without an owner.
    prefix_routing: bool = True
    prefix_bytes: int = 256  # about one KV block (64 tokens) of text
    prefix_balance: float = 0.5

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0 or self.liveness < 1:
            raise ValueError("heartbeat_interval must be > 0 and liveness >= 1")
        if self.queue_bound < 0 or self.max_frame_bytes < 1024:
            raise ValueError("queue_bound must be >= 0 and max_frame_bytes >= 1024")
        if self.client_timeout <= 0 or self.default_timeout <= 0:
            raise ValueError("client_timeout and default_timeout must be > 0")
        if not 0 <= self.spin_us <= 1_000_000:
            raise ValueError("spin_us must be in [0, 1e6]")
        if self.tenant_max_inflight < 0 or self.tenant_tokens_per_s < 0 or self.tenant_token_burst_s <= 0:
            raise ValueError("tenant limits must be >= 0 (and the burst > 0)")
        if self.prefix_bytes < 1 or not 0 <= self.prefix_balance <= 1000:
            raise ValueError("prefix_bytes must be >= 1 and prefix_balance in [0, 1000]")
        if self.curve_secret and not (self.client_keys and self.worker_keys):
            raise ValueError("CURVE needs both allow-lists: client_keys and worker_keys")
        exposed = [e for e in (self.front, self.back) if not is_local_endpoint(e)]
        if not self.curve_secret and exposed and not self.allow_plain:
            raise ValueError(f"plain (unauthenticated) mode on {', '.join(exposed)}: anyone who "
                             "reaches it is trusted. Give curve_secret (--curve-secret) with "
                             "allow-lists, or allow_plain (--allow-plain) to accept that")
