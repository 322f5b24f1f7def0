"""Command line: `python -m turbomq.broker --front ... --back ...`."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Optional, Sequence

from turbomq.clients.keys import KeyFileError

from .config import BrokerConfig
from .core import run_broker


def build_parser() -> argparse.ArgumentParser:
    d = BrokerConfig()
    p = argparse.ArgumentParser(prog="turbomq broker", description="turbomq request broker")
    p.add_argument("--front", default=d.front, help="endpoint clients connect to "
                   "(tcp://HOST:* picks a free port)")
    p.add_argument("--back", default=d.back, help="endpoint workers connect to")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval,
                   help="seconds between heartbeats")
    p.add_argument("--liveness", type=int, default=d.liveness,
                   help="missed heartbeats before a worker is dropped")
    p.add_argument("--queue-bound", type=int, default=d.queue_bound,
                   help="requests queued when all workers are full; past it: overloaded")
    p.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes)
    p.add_argument("--client-timeout", type=float, default=d.client_timeout,
                   help="cancel the requests of a client silent this many seconds")
    p.add_argument("--default-timeout", type=float, default=d.default_timeout,
                   help="request deadline in seconds when the client sets none")
    p.add_argument("--cancel-grace", type=float, default=d.cancel_grace)
    p.add_argument("--max-redispatch", type=int, default=d.max_redispatch)
    p.add_argument("--fail-fast", action="store_true",
                   help="refuse (no_workers, worker_lost) a request no worker can take now, "
                        "instead of queueing it until one comes or its deadline passes")
    p.add_argument("--curve-secret", default=d.curve_secret, metavar="FILE",
                   help="the broker's NAME.key_secret: encrypt both links and admit only the "
                        "keys of --client-keys and --worker-keys (docs/security.md)")
    p.add_argument("--client-keys", default=d.client_keys, metavar="FILE",
                   help="allow-list of client keys, `TENANT PUBLIC_KEY` per line; re-read on change")
    p.add_argument("--worker-keys", default=d.worker_keys, metavar="FILE",
                   help="allow-list of worker keys, `NAME PUBLIC_KEY` per line; re-read on change")
    p.add_argument("--allow-plain", action="store_true",
                   help="serve unauthenticated, unencrypted links on a non-loopback address")
    p.add_argument("--tenant-max-inflight", type=int, default=d.tenant_max_inflight,
                   help="requests in flight per tenant (0: no limit); past it: rate_limited")
    p.add_argument("--tenant-tokens-per-s", type=float, default=d.tenant_tokens_per_s,
                   help="generated tokens per second per tenant (0: no limit), over a bucket of "
                        "--tenant-token-burst-s seconds; past it: rate_limited")
    p.add_argument("--tenant-token-burst-s", type=float, default=d.tenant_token_burst_s)
    p.add_argument("--broker-id", default=d.broker_id,
                   help="this broker's id in pong/registered replies (default: random)")
    p.add_argument("--spin-us", type=float, default=d.spin_us,
                   help="microseconds to keep polling after a burst before sleeping (0: never)")
    p.add_argument("--prefix-routing", choices=("on", "off"), default="on" if d.prefix_routing else "off",
                   help="send requests without a session that share a leading prompt to the same "
                        "worker, whose prefix cache holds their KV (docs/broker.md)")
    p.add_argument("--prefix-bytes", type=int, default=d.prefix_bytes,
                   help="bytes of the prompt (of each first message; /4: token ids) the routing "
                        "key covers")
    p.add_argument("--prefix-balance", type=float, default=d.prefix_balance, metavar="EPS",
                   help="a worker takes its keys' requests while it has at most (1 + EPS) times "
                        "its share of the requests in flight; past that the key's next worker")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: a free one; default: none)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--log-level", default="INFO")
    return p


# Stats names -> the catalogue's label values (docs/metrics.md).
_OUTCOMES = {"completed": "completed", "cancelled": "cancelled", "client_gone": "cancelled",
             "timeout": "timeout", "overloaded": "rejected", "no_workers": "rejected",
             "session_busy": "rejected", "duplicate_request": "rejected",
             "rate_limited": "rejected"}  # others: error
_DECISIONS = {"affinity": "affinity", "moved": "moved", "new": "new", "prefix": "prefix",
              "stateless": "stateless"}
_REJECTS = {"bad_frame": "malformed", "unknown_kind": "unknown_type", "bad_version": "bad_version",
            "frame_too_large": "too_large"}  # others: invalid


class MetricsSync:
    """Copies the broker's own counters into BrokerMetrics once per tick (by
    difference), so the data plane pays nothing per message."""

    def __init__(self, metrics) -> None:
        self.m = metrics
        self._last: dict = {}

    def _add(self, family, label: str, value: str, key: str, total: float) -> None:
        delta = total - self._last.get(key, 0)
        if delta > 0:
            (family.labels(**{label: value}) if label else family).inc(delta)
        self._last[key] = total

    def tick(self, stats: dict) -> None:
        m = self.m
        for name, n in stats["requests_by_outcome"].items():
            self._add(m.requests, "outcome", _OUTCOMES.get(name, "error"), "o:" + name, n)
        for name, n in stats["routing"].items():
            self._add(m.routing_decisions, "decision", _DECISIONS.get(name, "stateless"), "r:" + name, n)
        for side, counts in (("c", stats["frames_rejected"]), ("w", stats["worker_frames_rejected"])):
            for code, n in counts.items():
                self._add(m.frames_rejected, "reason", _REJECTS.get(code, "invalid"),
                          f"f{side}:{code}", n)
        for tenant, outcomes in stats["tenant_outcomes"].items():
            for name, n in outcomes.items():
                labels = {"tenant": tenant or "plain", "outcome": _OUTCOMES.get(name, "error")}
                key = f"t:{tenant}:{name}"
                delta = n - self._last.get(key, 0)
                if delta > 0:
                    m.tenant_requests.labels(**labels).inc(delta)
                self._last[key] = n
        self._add(m.redispatches, "", "", "redispatches", stats["redispatches"])
        self._add(m.resumed_requests, "", "", "resumed", stats["requests_resumed"])
        m.requests_in_flight.set(stats["inflight"])
        m.queue_depth.set(stats["queue_depth"])
        m.workers_alive.set(stats["workers_alive"])

    def finished(self, seconds: float) -> None:
        self.m.request_duration.observe(seconds)

    def queue_wait(self, seconds: float) -> None:
        self.m.queue_wait.observe(seconds)


def _serve_metrics(broker, host: str, port: int) -> int:
    # Imported here: a broker without --metrics-port needs no prometheus-client.
    from prometheus_client import CollectorRegistry
    from turbomq.monitoring import BrokerMetrics, serve_metrics

    registry = CollectorRegistry()
    broker.observer = MetricsSync(BrokerMetrics(registry))
    _, bound = serve_metrics(registry, host, port)
    return bound


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(front=args.front, back=args.back,
                        heartbeat_interval=args.heartbeat_interval, liveness=args.liveness,
                        queue_bound=args.queue_bound, max_frame_bytes=args.max_frame_bytes,
                        client_timeout=args.client_timeout, default_timeout=args.default_timeout,
                        cancel_grace=args.cancel_grace, max_redispatch=args.max_redispatch,
                        spin_us=args.spin_us, fail_fast=args.fail_fast,
                        broker_id=args.broker_id, curve_secret=args.curve_secret,
                        client_keys=args.client_keys, worker_keys=args.worker_keys,
                        allow_plain=args.allow_plain,
                        tenant_max_inflight=args.tenant_max_inflight,
                        tenant_tokens_per_s=args.tenant_tokens_per_s,
                        tenant_token_burst_s=args.tenant_token_burst_s,
                        prefix_routing=args.prefix_routing == "on",
                        prefix_bytes=args.prefix_bytes, prefix_balance=args.prefix_balance)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:  # a refused configuration: one clear line
        print(f"turbomq broker: error: {e}", file=sys.stderr)
        return 2

    def ready(broker) -> None:
        def stop(_signum, _frame):
            broker.stop()
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        endpoints = {"front": broker.front_endpoint, "back": broker.back_endpoint}
        if args.metrics_port is not None:
            endpoints["metrics_port"] = _serve_metrics(broker, args.metrics_host, args.metrics_port)
        # One JSON line with the bound endpoints, for scripts that asked for port *.
        print(json.dumps(endpoints), flush=True)

    try:
        run_broker(config, ready=ready)
    except KeyFileError as e:
        print(f"turbomq broker: error: {e}", file=sys.stderr)
        return 2
    return 0
