"""The gateway's configuration and its API keys.

An API key file has one `TENANT API_KEY` line per key (`#` starts a comment),
like the broker's allow-lists: each key belongs to a tenant of the security
model (docs/security.md). The gateway is a CURVE client of the broker once per
tenant, with that tenant's client key, so the broker sees each tenant as
itself: its sessions, its limits, its counters (docs/gateway.md, "Tenants").
The file is read again when it changes; a version that cannot be used keeps
the one already loaded."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

log = logging.getLogger("turbomq.gateway")

_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # as on the broker's allow-lists
MIN_KEY_CHARS = 16


class ConfigError(ValueError):
    """A gateway setting or file that cannot be used."""


@dataclass
class GatewayConfig:
    broker: list  # the broker's front endpoints (several: an active-active pair)
    host: str = "127.0.0.1"
    port: int = 8000
    # The names /v1/models lists and requests may ask for; every worker behind
    # the broker serves the one model.
    served_model_names: tuple = ("turbomq",)
    api_keys: Optional[str] = None  # the API key file; None: no authentication
    # CurveZMQ: the broker's public key, and the client keys the gateway
    # connects with: one per tenant from `tenant_keys` (DIR/TENANT.key_secret),
    # or `curve_secret` for a gateway that serves a single tenant.
    broker_key: Optional[str] = None
    curve_secret: Optional[str] = None
    tenant_keys: Optional[str] = None
    request_timeout: float = 300.0  # each request's deadline (a body's `timeout` may lower it)
    health_interval: float = 0.5  # how often the broker's health is asked
    reload_interval: float = 1.0  # how often the API key file is checked for changes
    # On SIGTERM, responses still streaming get this long to finish before
    # they are cut (their requests cancelled upstream): a stalled or slow
    # client cannot hold the gateway up; below Docker's 10 s stop timeout.
    shutdown_grace: float = 8.0
    log_level: str = "INFO"

    def check(self) -> None:
        if not self.broker:
            raise ConfigError("no broker address")
        if (self.curve_secret or self.tenant_keys) and not self.broker_key:
            raise ConfigError("CurveZMQ keys need --broker-key (the broker's public key)")
        if self.broker_key and not (self.curve_secret or self.tenant_keys):
            raise ConfigError("--broker-key needs --curve-secret or --tenant-keys")
        if not self.served_model_names:
            raise ConfigError("no served model name")
        if not self.shutdown_grace >= 0:
            raise ConfigError("--shutdown-grace must be >= 0 seconds")


def _digest(key: str) -> bytes:
    # Keys are looked up by digest: no comparison runs over the secret itself.
    return hashlib.sha256(key.encode()).digest()


def load_api_keys(path: str) -> dict[bytes, str]:
    """{sha256(API key): tenant} from a `TENANT API_KEY` per line file."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read the API key file {path}: {e}") from None
    keys: dict[bytes, str] = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{path}:{n}: expected `TENANT API_KEY`")
        tenant, key = parts
        if not _TENANT.fullmatch(tenant):
            raise ConfigError(f"{path}:{n}: tenant {tenant!r} must be 1..64 of A-Z a-z 0-9 _ . -")
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"{path}:{n}: an API key needs at least {MIN_KEY_CHARS} characters")
        if _digest(key) in keys:
            raise ConfigError(f"{path}:{n}: this API key is listed twice")
        keys[_digest(key)] = tenant
    return keys


@dataclass
class ApiKeys:
    """The API key file, read again when it changes (checked at most every
    `interval` seconds, on a request)."""
    path: str
    interval: float = 1.0
    keys: dict = field(default_factory=dict)
    _stamp: tuple = ()
    _checked: float = 0.0

    def __post_init__(self) -> None:
        self.keys = load_api_keys(self.path)
        self._stamp = self._stat()
        self._checked = time.monotonic()

    def _stat(self) -> tuple:
        try:
            st = os.stat(self.path)
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return ()

    @property
    def tenants(self) -> set[str]:
        return set(self.keys.values())

    def refresh(self, accept=lambda keys: None) -> None:
        """Reload if the file changed; `accept(keys)` may refuse the new
        version by raising ConfigError (then the old one stays)."""
        now = time.monotonic()
        if now - self._checked < self.interval:
            return
        self._checked = now
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            keys = load_api_keys(self.path)
            accept(keys)
        except ConfigError as e:
            log.error("API key file not reloaded, the loaded version stays: %s", e)
            return
        self.keys = keys
        log.info("API key file reloaded: %d keys, %d tenants", len(keys), len(set(keys.values())))

    def tenant(self, key: str) -> Optional[str]:
        return self.keys.get(_digest(key))


def new_api_key() -> str:
    import secrets
    return "sk-" + secrets.token_urlsafe(32)
