"""Command line: `python -m turbomq.broker --front ... --back ...`."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from typing import Optional, Sequence

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
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> BrokerConfig:
    return BrokerConfig(front=args.front, back=args.back,
                        heartbeat_interval=args.heartbeat_interval, liveness=args.liveness,
                        queue_bound=args.queue_bound, max_frame_bytes=args.max_frame_bytes,
                        client_timeout=args.client_timeout, default_timeout=args.default_timeout,
                        cancel_grace=args.cancel_grace, max_redispatch=args.max_redispatch)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = config_from_args(args)

    def ready(broker) -> None:
        def stop(_signum, _frame):
            broker.stop()
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        # One JSON line with the bound endpoints, for scripts that asked for port *.
        print(json.dumps({"front": broker.front_endpoint, "back": broker.back_endpoint}), flush=True)

    run_broker(config, ready=ready)
    return 0
