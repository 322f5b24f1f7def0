"""Shared fixtures: a real redis-server and a real prometheus, started by the
tests on free loopback ports in temp dirs. Neither is ever mocked; a missing
binary fails the test with a pointer to `make test`, which installs both."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH; run `make test` (it installs redis-server "
                    f"and prometheus), or: apt-get install -y redis-server prometheus",
                    pytrace=False)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def _stop_process(proc: Optional[subprocess.Popen], sig: int = signal.SIGTERM, timeout: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# ------------------------------------------------------------------ redis
@dataclass
class RedisServer:
    """A redis-server on 127.0.0.1 that keeps its data dir and port across
    stop/start, with appendfsync always: every acknowledged write survives
    even kill()."""

    dir: Path
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None
    # ACL: only this user, with this password (the default user is off).
    user: Optional[str] = None
    password: Optional[str] = None
    tls: bool = False  # TLS only (a self-signed certificate in dir)

    @property
    def url(self) -> str:
        auth = f"{self.user}:{self.password}@" if self.user else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.dir / 'cert.pem'}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10) -> None:
        assert not self.running, "redis-server already running"
        binary = require_binary("redis-server")
        args = [binary, "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
                "--logfile", str(self.dir / "redis.log")]
        if self.tls:
            cert, key = self.dir / "cert.pem", self.dir / "key.pem"
            if not cert.exists():
                subprocess.run([require_binary("openssl"), "req", "-x509", "-newkey", "rsa:2048",
                                "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
                                "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                               check=True, capture_output=True, timeout=60)
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                     "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                     "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.user:
            args += ["--user", "default", "off",
                     "--user", self.user, "on", f">{self.password}", "~*", "&*", "+@all"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(self._answers, timeout, f"redis-server on port {self.port}")
        except TimeoutError:
            self.stop()
            log = (self.dir / "redis.log")
            raise RuntimeError(f"redis-server did not start: {log.read_text() if log.exists() else ''}")

    def _answers(self) -> bool:
        if not self.running:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                               f"{(self.dir / 'redis.log').read_text()}")
        if self.tls or self.user:
            import redis
            try:
                return bool(redis.Redis.from_url(self.url, socket_timeout=0.5).ping())
            except redis.RedisError:
                return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM)."""
        _stop_process(self.proc)

    def kill(self) -> None:
        """Crash it (SIGKILL): no shutdown work at all."""
        _stop_process(self.proc, signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_server(tmp_path_factory) -> RedisServer:
    """A fresh, running redis-server for one test; stop()/kill()/start()/restart()
    it mid-test. `.url` stays valid across restarts."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


# ------------------------------------------------------------- prometheus
@dataclass
class PrometheusServer:
    """A prometheus scraping `targets` (host:port strings) every `interval`."""

    dir: Path
    targets: list[str]
    interval: str = "1s"
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> None:
        binary = require_binary("prometheus")
        config = self.dir / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval,
                       "scrape_timeout": self.interval},
            "scrape_configs": [{"job_name": "turbomq",
                                "static_configs": [{"targets": list(self.targets)}]}],
        }, indent=2))
        log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        log.close()
        try:
            wait_until(self._ready, timeout, f"prometheus on port {self.port}", interval=0.1)
        except Exception:
            self.stop()
            raise RuntimeError(f"prometheus did not start:\n{self.log()}")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log(self) -> str:
        path = self.dir / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def api(self, path: str, **params) -> object:
        """GET /api/v1/<path>; returns `data`, raises on an API error."""
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=5) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus API {path} failed: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """Instant query; the result vector: [{'metric': {...}, 'value': [t, 'v']}, ...]."""
        return self.api("query", query=promql)["result"]

    def wait_for(self, promql: str, timeout: float = 15,
                 check: Callable[[list[dict]], bool] = bool) -> list[dict]:
        """Poll a query until `check(result)` holds (default: non-empty)."""
        box: list = []

        def poll() -> bool:
            box[:] = [self.query(promql)]
            return check(box[0])

        wait_until(poll, timeout, f"PromQL {promql!r}", interval=0.25)
        return box[0]

    def wait_targets_up(self, timeout: float = 15) -> None:
        """Every target scraped successfully at least once."""
        def all_up() -> bool:
            active = self.api("targets")["activeTargets"]
            return len(active) == len(self.targets) and all(t["health"] == "up" for t in active)
        wait_until(all_up, timeout, f"targets up: {self.targets}", interval=0.25)

    def stop(self) -> None:
        _stop_process(self.proc)


@pytest.fixture
def prometheus(tmp_path_factory):
    """Start a real prometheus: `prom = prometheus(["127.0.0.1:9100", ...])`.
    Stopped at teardown. Then `prom.wait_targets_up()`, `prom.query(q)`,
    `prom.wait_for(q)`."""
    started: list[PrometheusServer] = []

    def start(targets: list[str], interval: str = "1s") -> PrometheusServer:
        server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), list(targets), interval)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
