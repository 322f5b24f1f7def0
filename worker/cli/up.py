"""`turbomq up`: the whole service on one machine. A broker, K worker
processes, optionally the OpenAI-compatible gateway and, unless a Redis URL
is given, a throw-away local redis-server.
Children run in their own process groups, so a Ctrl-C reaches only this
process, which then stops them in order: workers, broker, Redis.

No torch here: the workers import it in their own processes."""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

log = logging.getLogger("turbomq.up")

START_TIMEOUT_S = 120.0  # model load included


def gpu_count() -> int:
    """NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES honoured), found
    without torch: the driver's `nvidia-smi -L`."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) \
        if listed.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def resolve_device(device: str, workers: Optional[int]) -> tuple[str, int]:
    """`auto`: the GPUs when there are any (one worker per GPU), else the CPU (2 workers)."""
    gpus = gpu_count() if device == "auto" or workers is None else 0
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    if workers is None:
        workers = max(gpus, 1) if device == "cuda" else 2
    return device, workers


@dataclass
class UpConfig:
    model: str
    workers: int = 2
    # Brokers run active-active: every worker registers with each, clients
    # fail over between their fronts (broker i's front: the port of `front` + i).
    brokers: int = 1
    front: str = "tcp://127.0.0.1:5555"
    # None: ipc (a unix socket in a private temp folder) where libzmq has it, else
    # tcp://127.0.0.1:*. Broker and workers share the machine; over ipc the hop
    # costs less CPU and latency than tcp loopback (docs/broker.md, Performance).
    back: Optional[str] = None
    redis_url: Optional[str] = None  # None: start a local redis-server if there is one
    device: str = "cpu"  # "cuda" gives worker i cuda:i
    worker_args: list = field(default_factory=list)  # engine flags passed to every worker
    metrics: bool = True  # each process serves /metrics on a free port
    # CurveZMQ on every link: keys for the brokers, each worker and one client
    # are made in a private temporary folder (docs/security.md).
    curve: bool = False
    # The OpenAI-compatible HTTP gateway on this port (0: a free one); None: none.
    gateway_port: Optional[int] = None
    log_level: str = "WARNING"


@dataclass
class Running:
    brokers: list  # [{"front", "back", "metrics_port"}], one per broker
    redis_url: Optional[str]
    workers: list  # [{"worker_id", "metrics_port"}]
    keys: Optional[dict] = None  # with curve: {"client_secret", "broker_key"} file paths
    gateway: Optional[dict] = None  # {"gateway": URL, "port"} when one runs

    @property
    def fronts(self) -> list[str]:
        return [b["front"] for b in self.brokers]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_json_line(proc: subprocess.Popen, what: str, timeout: float) -> dict:
    """The first stdout line of a child: the JSON it prints once it serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if line:
                return json.loads(line)
    raise RuntimeError(f"{what} did not start within {timeout:.0f}s")


class LocalService:
    """Start, watch and stop the processes of `turbomq up`."""

    def __init__(self, config: UpConfig):
        self.config = config
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._tmp: Optional[str] = None
        self._ipc_dir: Optional[str] = None
        self._folders: list[str] = []  # more temporary folders, removed at stop

    def _spawn(self, name: str, cmd: list, stdout=subprocess.PIPE) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=stdout, text=True, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def start(self) -> Running:
        c = self.config
        redis_url = self._redis()
        keys = self._keys() if c.curve else None
        brokers = []
        for i in range(c.brokers):
            cmd = [sys.executable, "-m", "turbomq.broker", "--front", _nth_endpoint(c.front, i),
                   "--back", self._back(i), "--log-level", c.log_level]
            if keys:
                cmd += ["--curve-secret", keys["broker_secret"], "--client-keys",
                        keys["client_keys"], "--worker-keys", keys["worker_keys"]]
            if c.metrics:
                cmd += ["--metrics-port", "0"]
            name = "broker" if c.brokers == 1 else f"broker-{i}"
            brokers.append(_read_json_line(self._spawn(name, cmd), name, 30))
        backs = ",".join(b["back"] for b in brokers)
        workers = []
        for i in range(c.workers):
            device = f"cuda:{i}" if c.device == "cuda" else c.device
            cmd = [sys.executable, "-m", "turbomq.worker.cli", "worker", "--model", c.model,
                   "--device", device, "--broker", backs, "--worker-id", f"worker-{i}",
                   "--log-level", c.log_level, *c.worker_args]
            if keys:
                cmd += ["--curve-secret", keys["worker_secrets"][i], "--broker-key",
                        keys["broker_key"]]
            if redis_url:
                cmd += ["--redis-url", redis_url]
            if not c.metrics:
                cmd += ["--no-metrics"]
            self._spawn(f"worker-{i}", cmd)
        for name, proc in self.procs:
            if name.startswith("worker-"):
                workers.append(_read_json_line(proc, name, START_TIMEOUT_S))
        gateway = None
        if c.gateway_port is not None:
            fronts = ",".join(b["front"] for b in brokers)
            cmd = [sys.executable, "-m", "turbomq.worker.cli", "gateway", "--broker", fronts,
                   "--port", str(c.gateway_port),
                   "--served-model-name", Path(c.model.rstrip("/")).name or "turbomq",
                   "--log-level", c.log_level]
            if keys:  # one tenant: the run's client key
                cmd += ["--curve-secret", keys["client_secret"], "--broker-key", keys["broker_key"]]
            gateway = _read_json_line(self._spawn("gateway", cmd), "gateway", 60)
        return Running(brokers, redis_url, workers,
                       keys and {k: keys[k] for k in ("client_secret", "broker_key")}, gateway)

    def _keys(self) -> dict:
        """Key pairs for the brokers (one, shared), each worker and a client,
        and the allow-lists naming them."""
        from turbomq.clients.keys import allow_line, new_keypair

        folder = Path(self._tmpdir("turbomq-keys-"))
        broker_key, broker_secret = new_keypair(folder, "broker")
        workers = [new_keypair(folder, f"worker-{i}") for i in range(self.config.workers)]
        client_key, client_secret = new_keypair(folder, "client")
        (folder / "workers.allow").write_text(
            "".join(allow_line(pub) + "\n" for pub, _ in workers))
        (folder / "clients.allow").write_text(allow_line(client_key, "default") + "\n")
        return {"broker_secret": str(broker_secret), "broker_key": str(broker_key),
                "worker_secrets": [str(sec) for _, sec in workers],
                "client_secret": str(client_secret), "client_key": str(client_key),
                "worker_keys": str(folder / "workers.allow"),
                "client_keys": str(folder / "clients.allow")}

    def _tmpdir(self, prefix: str) -> str:
        folder = tempfile.mkdtemp(prefix=prefix)
        self._folders.append(folder)
        return folder

    def _back(self, i: int) -> str:
        if self.config.back is not None:
            return _nth_endpoint(self.config.back, i)
        import zmq  # pyzmq comes with the broker

        if not zmq.has("ipc"):
            return "tcp://127.0.0.1:*"
        if self._ipc_dir is None:
            self._ipc_dir = tempfile.mkdtemp(prefix="turbomq-")
        return f"ipc://{self._ipc_dir}/back-{i}"

    def _redis(self) -> Optional[str]:
        if self.config.redis_url:
            return self.config.redis_url
        binary = shutil.which("redis-server")
        if binary is None:
            log.warning("no --redis-url and no redis-server on PATH: each worker keeps its own "
                        "sessions in memory, so a session works only while it stays on one worker")
            return None
        self._tmp = tempfile.mkdtemp(prefix="turbomq-redis-")
        port = _free_port()
        self._spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", self._tmp,
                              "--save", "", "--appendonly", "no", "--daemonize", "no",
                              "--loglevel", "warning"], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return f"redis://127.0.0.1:{port}/0"
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the local redis-server did not start")

    def failed(self) -> Optional[str]:
        """The name of a child that exited, if any."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                return f"{name} (exit code {proc.returncode})"
        return None

    def stop(self) -> None:
        # Workers first (they talk to both others), then the brokers, then Redis.
        def rank(name: str) -> int:  # the gateway goes with the workers
            return 1 if name.startswith("broker") else 2 if name == "redis" else 0

        for step in (0, 1, 2):
            group = [proc for name, proc in self.procs if rank(name) == step]
            for proc in group:
                if proc.poll() is None:
                    proc.terminate()
            for proc in group:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
        for _, proc in self.procs:
            if proc.stdout is not None:
                proc.stdout.close()
        for folder in (self._tmp, self._ipc_dir, *self._folders):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def _nth_endpoint(endpoint: str, i: int) -> str:
    """Broker i's endpoint: tcp://host:PORT -> tcp://host:PORT+i (a `*` port
    stays free for each); other transports get a -i suffix."""
    if i == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{head}:{int(port) + i}"
    if endpoint.startswith("tcp://"):
        return endpoint
    return f"{endpoint}-{i}"


def _describe(running: Running) -> str:
    lines = [f"turbomq is up. Clients connect to {', '.join(running.fronts)}"]
    for b in running.brokers:
        port = b.get("metrics_port")
        lines.append(f"  broker   front {b['front']}, back {b['back']}"
                     + (f", metrics http://127.0.0.1:{port}/metrics" if port else ""))
    if running.keys:
        lines.append(f"  keys     CurveZMQ on every link; a client connects with "
                     f"--curve-secret {running.keys['client_secret']} "
                     f"--broker-key {running.keys['broker_key']}")
    if running.gateway:
        lines.append(f"  gateway  OpenAI API at {running.gateway['gateway']}/v1 "
                     f"(metrics {running.gateway['gateway']}/metrics)")
    lines.append(f"  redis    {running.redis_url}" if running.redis_url
                 else "  redis    none: sessions are per worker (in-process stores)")
    for w in running.workers:
        port = w.get("metrics_port")
        lines.append(f"  worker   {w['worker_id']}"
                     + (f", metrics http://127.0.0.1:{port}/metrics" if port else ""))
    return "\n".join(lines)


def smoke(front, workers: int, curve=None) -> str:
    """Stream one generation through the real client; returns its text."""
    from turbomq.clients import Client, Final

    with Client(front, timeout=60, curve=curve) as client:
        deadline = time.monotonic() + 30
        while client.health()["workers"] < workers:
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not register with the broker")
            time.sleep(0.1)
        text = []
        question = [{"role": "user", "content": "What is the capital of France?"}]
        print(f"> {question[0]['content']}", flush=True)
        for event in client.generate(messages=question, max_tokens=48, temperature=0,
                                     stream=True):
            if isinstance(event, Final):
                print(f"\n[{event.finish_reason}; {event.usage.completion_tokens} tokens]", flush=True)
            else:
                text.append(event.text)
                print(event.text, end="", flush=True)
        return "".join(text)


def smoke_gateway(url: str, model: str) -> str:
    """One completion through the gateway's OpenAI API (plain HTTP, no
    openai package needed); returns its text."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 30
    while True:  # the gateway learns of the workers from the broker's health
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.loads(r.read()).get("workers"):
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not see the workers")
        time.sleep(0.1)
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 16,
                       "temperature": 0.8, "seed": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        reply = json.loads(r.read())
    choice = reply["choices"][0]
    print(f"{choice['text']}\n[gateway: {choice['finish_reason']}; "
          f"{reply['usage']['completion_tokens']} tokens]", flush=True)
    return choice["text"]


def run_up(config: UpConfig, smoke_test: bool = False) -> int:
    service = LocalService(config)
    stopping = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        running = service.start()
        print(_describe(running), flush=True)
        if smoke_test:
            curve = None
            if running.keys:
                from turbomq.clients import CurveClient
                curve = CurveClient.load(running.keys["client_secret"], running.keys["broker_key"])
            smoke(running.fronts, config.workers, curve)
            if running.gateway:
                smoke_gateway(running.gateway["gateway"],
                              Path(config.model.rstrip("/")).name or "turbomq")
            return 0
        print("Ctrl-C stops everything.", flush=True)
        while not stopping:
            failed = service.failed()
            if failed:
                print(f"turbomq up: {failed} stopped; shutting down", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    except (RuntimeError, OSError) as e:
        print(f"turbomq up: error: {e}", file=sys.stderr)
        return 1
    finally:
        service.stop()
