"""CurveZMQ keys: who may talk to a broker, and over encrypted links.

A key pair is two files in ZeroMQ's certificate format: NAME.key (the public
key, safe to hand out) and NAME.key_secret (both keys; keep it private).
`turbomq keys new DIR NAME` writes them. A broker admits the public keys its
allow-lists name: text files with one `NAME PUBLIC_KEY` line per key (for a
client key NAME is its tenant, for a worker key the worker's name); a line
starting with `#` is a comment. docs/security.md describes the model."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import zmq
import zmq.auth

PathLike = Union[str, Path]
# Names on allow-lists (tenants, workers): no ':', which separates a tenant
# from a session id in the keys of sessions.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class KeyFileError(ValueError):
    """A key file or allow-list that cannot be used."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: Optional[bytes]  # None when only the public key was read

    @classmethod
    def load(cls, path: PathLike) -> "KeyPair":
        try:
            public, secret = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as e:
            raise KeyFileError(f"cannot read the key file {path}: {e}") from None
        if public is None or len(public) != 40 or (secret is not None and len(secret) != 40):
            raise KeyFileError(f"{path} holds no CurveZMQ key")
        return cls(public, secret)


def new_keypair(directory: PathLike, name: str) -> tuple[Path, Path]:
    """Write DIR/NAME.key and DIR/NAME.key_secret (mode 0600); returns both paths."""
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"bad key name {name!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_allow_list(path: PathLike) -> dict[str, str]:
    """{Z85 public key: name} from a `NAME PUBLIC_KEY` per line file."""
    keys: dict[str, str] = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise KeyFileError(f"cannot read the allow-list {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):  # (Z85 keys may hold a '#' themselves)
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) != 40:
            raise KeyFileError(f"{path}:{n}: expected `NAME PUBLIC_KEY` (a 40-character Z85 key)")
        name, key = parts
        if not _NAME.fullmatch(name):
            raise KeyFileError(f"{path}:{n}: name {name!r} must be 1..64 of A-Z a-z 0-9 _ . -")
        try:
            zmq.utils.z85.decode(key)
        except Exception:
            raise KeyFileError(f"{path}:{n}: {key!r} is not a Z85 key") from None
        keys[key] = name
    return keys


def allow_line(public_key_file: PathLike, name: Optional[str] = None) -> str:
    """The allow-list line of a public key file (NAME defaults to the file's stem)."""
    pair = KeyPair.load(public_key_file)
    return f"{name or Path(public_key_file).name.split('.')[0]} {pair.public.decode()}"


@dataclass(frozen=True)
class CurveClient:
    """The keys a client or worker connects with: its own pair and the
    broker's public key."""
    own: KeyPair
    server_public: bytes

    @classmethod
    def load(cls, secret_file: PathLike, server_public_file: PathLike) -> "CurveClient":
        own = KeyPair.load(secret_file)
        if own.secret is None:
            raise KeyFileError(f"{secret_file} holds no secret key (use NAME.key_secret)")
        return cls(own, KeyPair.load(server_public_file).public)

    def apply(self, sock: zmq.Socket) -> None:
        """Before connect: encrypt, and authenticate to the broker with our key."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.own.public
        sock.curve_secretkey = self.own.secret


def init_deployment(directory: PathLike) -> list[Path]:
    """The keys and secrets of one deployment (compose runs this on first
    start): broker, worker and client key pairs, the allow-lists naming them
    (the client as tenant `default`), a Redis password with the redis.conf
    that requires it (ACL user `turbomq`; the default user off), a Grafana
    admin password and an API key for the HTTP gateway (tenant `default`). Files already there are kept; returns those written."""
    import secrets

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name in ("broker", "worker", "client"):
        if not (directory / f"{name}.key_secret").exists():
            written += new_keypair(directory, name)

    def put(name: str, text: str, private: bool = True) -> None:
        path = directory / name
        if not path.exists():
            path.write_text(text)
            os.chmod(path, 0o600 if private else 0o644)
            written.append(path)

    put("workers.allow", allow_line(directory / "worker.key") + "\n", private=False)
    put("clients.allow", allow_line(directory / "client.key", "default") + "\n", private=False)
    put("redis.password", secrets.token_urlsafe(24) + "\n")
    password = (directory / "redis.password").read_text().strip()
    # Read by the redis and grafana containers' own (non-root) users.
    put("redis.conf", f"user default off\nuser turbomq on >{password} ~* &* +@all\n",
        private=False)
    put("grafana.password", secrets.token_urlsafe(18) + "\n", private=False)
    # The HTTP gateway's API key file (docs/gateway.md): one key, tenant `default`.
    put("api.keys", "default sk-" + secrets.token_urlsafe(32) + "\n")
    return written


def with_password(url: str, password_file: PathLike) -> str:
    """`url` with the password read from a file (kept out of command lines)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    password = Path(password_file).read_text().strip()
    parts = urlsplit(url)
    user = quote(parts.username or "", safe="")
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def is_local_endpoint(endpoint: str) -> bool:
    """ipc/inproc, or tcp on a loopback address: plain is fine there."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or an interface (*, eth0): reachable from outside
