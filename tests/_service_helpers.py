"""Real broker and echo-worker processes on loopback, for the service tests.

Every process is started with a hard lifetime (`timeout`), tracked, and
killed when the harness closes, so a failing test never leaves one behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

PY = sys.executable
LIFETIME_S = 60  # no test process outlives this, whatever happens


class Service:
    def __init__(self, tmp_path: Path, **broker_flags):
        self.tmp = tmp_path
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.broker_flags = {"heartbeat-interval": 0.1, "liveness": 5, "log-level": "WARNING",
                             **broker_flags}
        self.front, self.back = self._start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.event_log = tmp_path / "events.jsonl"
        self.event_log.touch()

    def _start_broker(self, front: str, back: str) -> tuple[str, str]:
        cmd = ["timeout", "-s", "KILL", str(LIFETIME_S), PY, "-m", "turbomq.broker",
               "--front", front, "--back", back]
        for k, v in self.broker_flags.items():
            cmd += [f"--{k}"] if v is True else [f"--{k}", str(v)]
        self.broker = self._spawn(cmd, stdout=subprocess.PIPE)
        line = self.broker.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("broker did not start")
        endpoints = json.loads(line)
        self.metrics_port = endpoints.get("metrics_port")  # with --metrics-port
        return endpoints["front"], endpoints["back"]

    def restart_broker(self, down_s: float = 0.0) -> None:
        """SIGKILL the broker, then start a new one on the same endpoints."""
        os.killpg(self.broker.pid, signal.SIGKILL)
        self.broker.wait(5)
        time.sleep(down_s)
        self._start_broker(self.front, self.back)

    def _spawn(self, cmd: list, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, text=True, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def add_worker(self, worker_id: str, slots: int = 4, delay: float = 0.0,
                   die_after: int = 0, kv_blocks: int = 1024) -> subprocess.Popen:
        # No `timeout` wrapper here: the test SIGKILLs the worker itself by pid.
        cmd = [PY, "-m", "turbomq.broker.echo_worker", "--broker", self.back,
               "--worker-id", worker_id, "--slots", str(slots), "--delay", str(delay),
               "--kv-blocks", str(kv_blocks), "--event-log", str(self.event_log)]
        if die_after:
            cmd += ["--die-after", str(die_after)]
        proc = self._spawn(cmd)
        self.workers[worker_id] = proc
        return proc

    def wait_workers(self, client, n: int, within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if client.health()["workers"] == n:
                return
            time.sleep(0.05)
        raise AssertionError(f"{n} workers did not register within {within}s")

    def kill_worker(self, worker_id: str) -> None:
        proc = self.workers[worker_id]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)

    def events(self, event: Optional[str] = None) -> list[dict]:
        out = []
        for line in self.event_log.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                if event is None or e["event"] == event:
                    out.append(e)
        return out

    def wait_event(self, event: str, n: int = 1, within: float = 5.0) -> list[dict]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = self.events(event)
            if len(found) >= n:
                return found
            time.sleep(0.02)
        raise AssertionError(f"fewer than {n} {event!r} events within {within}s: {self.events()}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(3)
            if proc.stdout is not None:
                proc.stdout.close()


def expected_echo(source: list, n: int) -> list:
    return [source[i % len(source)] for i in range(n)]
