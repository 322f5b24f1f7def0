"""The broker: a native data plane with configuration, logging and metrics here.

The data plane (turbomq._native.broker, C++ over libzmq) runs the loop: one
thread, two ROUTER sockets, all routing state. docs/broker.md describes
routing, heartbeats, re-dispatch and cancellation, and why the loop is native.
clients/protocol stays the one judge of frames: the data plane accepts the common
well-formed generate, delta and final itself and hands every other frame to
`_validate` below, which runs clients/protocol's decoder.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Optional

import msgpack

from turbomq import _native
from turbomq.clients import protocol as P
from turbomq.clients.keys import KeyFileError, KeyPair, load_allow_list

from .config import BrokerConfig

log = logging.getLogger("turbomq.broker")

_CLIENT = 0  # the data plane's Side::Client; 1 is Side::Worker


def native_limits(limits: P.Limits):
    """protocol.Limits as the data plane holds them (every bound it checks)."""
    out = _native.broker.ProtocolLimits()
    for name in dir(out):
        if not name.startswith("_"):
            setattr(out, name, getattr(limits, name))
    return out


class Broker:
    def __init__(self, config: BrokerConfig):
        self.config = config
        self.limits = P.Limits(max_frame_bytes=config.max_frame_bytes)
        settings = _native.broker.BrokerSettings()
        for name in dir(settings):  # every BrokerConfig field the data plane has
            if not name.startswith("_") and hasattr(config, name):
                setattr(settings, name, getattr(config, name))
        settings.limits = native_limits(self.limits)
        settings.retryable_codes = sorted(P.RETRYABLE_CODES)
        settings.broker_id = config.broker_id or secrets.token_hex(8)
        self.broker_id: str = settings.broker_id
        self._allow_lists = {}  # domain -> (path, mtime of the version loaded)
        if config.curve_secret:
            pair = KeyPair.load(config.curve_secret)
            if pair.secret is None:
                raise KeyFileError(f"{config.curve_secret} holds no secret key")
            settings.curve_secret_key = pair.secret.decode()
            self._allow_lists = {"clients": [config.client_keys, None],
                                 "workers": [config.worker_keys, None]}
        # Optional metrics: .tick(stats) each tick, .finished(seconds) per request,
        # .queue_wait(seconds) per dispatch that waited in the queue.
        self.observer = None
        self._core = _native.broker.BrokerCore(settings, self._validate, self._log, self._tick)
        self.front_endpoint: str = self._core.front_endpoint
        self.back_endpoint: str = self._core.back_endpoint
        self._reload_allow_lists(strict=True)

    def _reload_allow_lists(self, strict: bool = False) -> None:
        """Load each allow-list whose file changed. A list that cannot be read
        keeps the version already loaded (at start: fails)."""
        for domain, entry in self._allow_lists.items():
            path, loaded = entry
            try:
                mtime = os.stat(path).st_mtime_ns
                if mtime == loaded:
                    continue
                keys = load_allow_list(path)
            except (OSError, KeyFileError) as e:
                if strict:
                    raise KeyFileError(str(e)) from None
                log.error("kept the %s allow-list: %s", domain, e)
                continue
            self._core.allow(domain, keys)
            entry[1] = mtime
            log.info("%s allow-list %s: %d keys", domain, path, len(keys))

    def _validate(self, side: int, frame: bytes) -> Optional[tuple]:
        """clients/protocol's verdict on a frame the data plane did not accept at sight."""
        decode = P.decode_client_request if side == _CLIENT else P.decode_worker_message
        try:
            decode(frame, self.limits)
        except P.ProtocolError as e:
            return e.code, e.message[:P.DEFAULT_LIMITS.max_message_chars], e.request_id
        return None

    @staticmethod
    def _log(level: int, message: str) -> None:
        log.log(level, "%s", message)

    def _tick(self, snapshot: bytes, durations: list, queue_waits: list) -> None:
        self._reload_allow_lists()
        observer = self.observer
        if observer is not None:
            observer.tick(msgpack.unpackb(snapshot))
            for seconds in durations:
                observer.finished(seconds)
            for seconds in queue_waits:
                observer.queue_wait(seconds)

    def run(self) -> None:
        """Serve until stop() (from any thread) or a signal handler raises."""
        self._core.run()

    def stop(self) -> None:
        self._core.stop()

    def close(self) -> None:
        self._core.close()


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
