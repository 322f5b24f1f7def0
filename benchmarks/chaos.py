"""The long chaos run: many sessions of several turns through a real broker
pair, real CPU workers and a real redis-server, while faults of every kind
hit them at random. Every turn is checked against a fault-free reference.

    .venv/bin/python benchmarks/chaos.py [--sessions 1000 --turns 4 --minutes 10]
    make chaos

Faults: a worker SIGKILLed (and started again), a broker SIGKILLed (and
started again on its ports), redis-server SIGKILLed (and started again from
its AOF), a worker SIGSTOPped past its liveness (then SIGCONT). Per turn it
records: completed or lost, gaps and duplicates in the stream (index and seq),
tokens different from the reference, and the longest wait between two events
of the stream (the stall), attributed to the fault whose window it overlaps.

Writes docs/benchmarks/chaos.md and docs/benchmarks/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CHILD_ENV = dict(os.environ, OMP_NUM_THREADS="1")
FAULTS = ("worker_kill", "broker_kill", "redis_kill", "worker_stall")
CONVERSATIONS = 40  # distinct conversations; session i plays conversation i % 40
WORDS = ("harbour lantern orchard river mill quarry meadow bridge tower garden ferry valley "
         "market chapel forge lighthouse station cellar").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list, q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100.0 * (len(xs) - 1))))]


# ------------------------------------------------------------- the workload
@dataclass(frozen=True)
class Turn:
    prompt: str
    params: dict


def conversation(c: int, turns: int) -> list[Turn]:
    """Conversation c: greedy for even c, seeded sampling for odd c."""
    rng = random.Random(c)
    out = []
    for t in range(turns):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        prompt = (f"Conversation {c}. " if t == 0 else " ") + words.capitalize() + "."
        params = {"max_tokens": rng.randint(8, 24), "ignore_eos": True}
        params.update({"temperature": 0.0} if c % 2 == 0 else
                      {"temperature": 0.8, "top_k": 40, "seed": c * 100 + t})
        out.append(Turn(prompt, params))
    return out


def reference(model: str, turns: int) -> dict[int, list[list[int]]]:
    """Each conversation's tokens per turn, fault-free, in one in-process engine."""
    from turbomq.worker import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=model, max_batch_size=8))
    want = {}
    for c in range(CONVERSATIONS):
        sid = f"reference-{c}"
        want[c] = [engine.generate(prompts=t.prompt, session_id=sid,
                                   params=SamplingParams(**t.params))[0].token_ids
                   for t in conversation(c, turns)]
        engine.end_session(sid)
    return want


@dataclass
class TurnResult:
    session: int
    turn: int
    ok: bool
    error: str = ""
    gaps: int = 0
    duplicates: int = 0
    mismatch: bool = False
    stall_s: float = 0.0
    stall_at: float = 0.0  # when the longest wait ended (monotonic)
    started: float = 0.0
    ended: float = 0.0


# ----------------------------------------------------------------- processes
class Stack:
    """redis-server, two brokers and the workers, each restartable in place."""

    def __init__(self, tmp: Path, model: str, workers: int):
        self.tmp, self.model = tmp, model
        self.redis_port = free_port()
        self.fronts = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.backs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.start_redis()
        for i in range(2):
            self.start_broker(i)
        for i in range(workers):
            self.start_worker(i)
        for i in range(workers):
            self._ready_line(self.procs[f"worker-{i}"], 180)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def _spawn(self, name: str, cmd: list, stdout=subprocess.PIPE) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, text=True,
                                env=CHILD_ENV, start_new_session=True)
        self.procs[name] = proc
        return proc

    @staticmethod
    def _ready_line(proc: subprocess.Popen, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line:
                return json.loads(line)
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} while starting")
        raise RuntimeError("did not start in time")

    def start_redis(self) -> None:
        data = self.tmp / "redis"
        data.mkdir(exist_ok=True)
        self._spawn("redis", [shutil.which("redis-server"), "--port", str(self.redis_port),
                              "--bind", "127.0.0.1", "--dir", str(data), "--appendonly", "yes",
                              "--appendfsync", "everysec", "--save", "", "--daemonize", "no"],
                    stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def start_broker(self, i: int) -> None:
        proc = self._spawn(f"broker-{i}", [PY, "-m", "turbomq.broker", "--front", self.fronts[i],
                                           "--back", self.backs[i], "--log-level", "ERROR"])
        self._ready_line(proc, 30)

    def start_worker(self, i: int) -> None:
        self._spawn(f"worker-{i}", [PY, "-m", "turbomq.worker.cli", "worker", "--model", self.model,
                                    "--broker", ",".join(self.backs), "--worker-id", f"worker-{i}",
                                    "--redis-url", self.redis_url, "--max-batch-size", "16",
                                    "--no-metrics", "--log-level", "ERROR"])

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()

    def signal(self, name: str, sig: int) -> None:
        os.killpg(self.procs[name].pid, sig)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)


class FaultInjector(threading.Thread):
    """One fault at a time, at random, until stopped; records each window."""

    def __init__(self, stack: Stack, workers: int, every_s: float, rng: random.Random):
        super().__init__(daemon=True)
        self.stack, self.workers, self.every_s, self.rng = stack, workers, every_s, rng
        self.windows: list[tuple[str, float, float]] = []  # (kind, start, end of recovery)
        self.stopping = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            while not self.stopping.wait(self.rng.uniform(0.5, 1.5) * self.every_s):
                kind = self.rng.choice(FAULTS)
                start = time.monotonic()
                getattr(self, kind)()
                self.windows.append((kind, start, time.monotonic()))
        except BaseException as e:  # reported by the main thread
            self.error = e

    def worker_kill(self) -> None:
        i = self.rng.randrange(self.workers)
        self.stack.kill(f"worker-{i}")
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.stack.start_worker(i)
        self.stack._ready_line(self.stack.procs[f"worker-{i}"], 180)

    def broker_kill(self) -> None:
        i = self.rng.randrange(2)
        self.stack.kill(f"broker-{i}")
        time.sleep(self.rng.uniform(0.2, 2.0))
        self.stack.start_broker(i)

    def redis_kill(self) -> None:
        self.stack.kill("redis")
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.stack.start_redis()

    def worker_stall(self) -> None:
        name = f"worker-{self.rng.randrange(self.workers)}"
        self.stack.signal(name, signal.SIGSTOP)
        try:
            time.sleep(self.rng.uniform(2.0, 3.0))  # past the liveness window (1.5 s)
        finally:
            self.stack.signal(name, signal.SIGCONT)


# ------------------------------------------------------------------ clients
def run_session(client, s: int, turns: list[Turn], want: list[list[int]],
                out: list[TurnResult]) -> None:
    from turbomq.clients import Delta, TurbomqError

    session = client.session(f"chaos-{s}")
    for t, turn in enumerate(turns):
        r = TurnResult(s, t, ok=False, started=time.monotonic())
        tokens, seq, last = [], 0, r.started
        try:
            for event in session.send(turn.prompt, stream=True, **turn.params):
                now = time.monotonic()
                if now - last > r.stall_s:
                    r.stall_s, r.stall_at = now - last, now
                last = now
                if isinstance(event, Delta):
                    if event.seq != seq:
                        r.gaps += event.seq > seq
                        r.duplicates += event.seq < seq
                    if event.index != len(tokens):
                        r.gaps += event.index > len(tokens)
                        r.duplicates += event.index < len(tokens)
                    seq = event.seq + 1
                    tokens.extend(event.token_ids)
            r.ok = True
        except TurbomqError as e:
            r.error = f"{e.code}: {e.message}"
        r.ended = time.monotonic()
        r.mismatch = r.ok and tokens != want[t]
        out.append(r)
        if not r.ok:
            return  # the session's later turns would build on a lost one


def attribute(results: list[TurnResult], windows: list, liveness_s: float) -> dict:
    """Stall of each turn, per fault kind whose window (plus the time the
    service needs to notice) held the turn's longest wait."""
    by_kind: dict[str, list[float]] = {k: [] for k in FAULTS + ("none",)}
    for r in results:
        if not r.ok:
            continue
        wait_from, wait_to = r.stall_at - r.stall_s, r.stall_at
        kind = "none"
        for k, start, end in windows:
            if wait_from <= end + liveness_s and wait_to >= start:
                kind = k
                break
        by_kind[kind].append(r.stall_s)
    return by_kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=10.0,
                    help="spread the sessions over about this long")
    ap.add_argument("--concurrency", type=int, default=24, help="sessions in flight")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fault-every", type=float, default=8.0, help="mean seconds between faults")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args()

    from turbomq.clients import Client
    from turbomq.worker.model.demo import write_demo_model

    tmp = Path(tempfile.mkdtemp(prefix="turbomq-chaos-"))
    model = str(tmp / "demo")
    write_demo_model(model, seed=0)
    print("reference run ...", flush=True)
    want = reference(model, args.turns)
    stack = Stack(tmp, model, args.workers)
    rng = random.Random(args.seed)
    injector = FaultInjector(stack, args.workers, args.fault_every, rng)
    results: list[TurnResult] = []
    lock = threading.Lock()
    next_session = [0]
    # Pace session starts so the run lasts about --minutes.
    pace = args.minutes * 60.0 / max(args.sessions, 1)
    begin = time.monotonic()

    def client_loop() -> None:
        client = Client(stack.fronts, timeout=120.0)
        try:
            while True:
                with lock:
                    s = next_session[0]
                    if s >= args.sessions:
                        return
                    next_session[0] += 1
                delay = begin + s * pace - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                c = s % CONVERSATIONS
                out: list[TurnResult] = []
                run_session(client, s, conversation(c, args.turns), want[c], out)
                with lock:
                    results.extend(out)
                    done = len(results)
                if done % 200 < args.turns:
                    print(f"  {done} turns, {time.monotonic() - begin:.0f} s, "
                          f"{len(injector.windows)} faults", flush=True)
        finally:
            client.close()

    print(f"{args.sessions} sessions x {args.turns} turns, {args.concurrency} in flight, "
          f"a fault every ~{args.fault_every:g} s", flush=True)
    injector.start()
    threads = [threading.Thread(target=client_loop) for _ in range(args.concurrency)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        injector.stopping.set()
        injector.join(300)
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - begin
    if injector.error is not None:
        raise injector.error

    expected_turns = args.sessions * args.turns
    ok = [r for r in results if r.ok]
    lost = expected_turns - len(ok)
    stalls = attribute(results, injector.windows, liveness_s=1.5)
    faults = {k: sum(1 for w in injector.windows if w[0] == k) for k in FAULTS}
    summary = {
        "sessions": args.sessions, "turns_per_session": args.turns, "turns_expected": expected_turns,
        "turns_ok": len(ok), "turns_lost": lost,
        "gaps": sum(r.gaps for r in results), "duplicates": sum(r.duplicates for r in results),
        "mismatched_turns": sum(r.mismatch for r in results),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "faults": faults, "elapsed_s": round(elapsed, 1), "workers": args.workers,
        "brokers": 2, "concurrency": args.concurrency,
        "stall_s": {k: {"turns": len(v), "p50": round(percentile(v, 50), 3),
                        "p99": round(percentile(v, 99), 3), "max": round(max(v), 3) if v else None}
                    for k, v in stalls.items()},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    write_report(summary, Path(args.out), " ".join(sys.argv[1:]))
    print(json.dumps(summary, indent=1))
    clean = lost == 0 and summary["gaps"] == 0 and summary["duplicates"] == 0 \
        and summary["mismatched_turns"] == 0
    return 0 if clean else 1


def write_report(s: dict, out: Path, argv: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(s, indent=1) + "\n")
    rows = "\n".join(
        f"| {k} | {v['turns']} | {v['p50']:.3f} | {v['p99']:.3f} | "
        f"{'-' if v['max'] is None else format(v['max'], '.3f')} |"
        for k, v in s["stall_s"].items())
    faults = ", ".join(f"{k} {n}" for k, n in s["faults"].items())
    (out / "chaos.md").write_text(f"""# Chaos run

`make chaos` (`.venv/bin/python benchmarks/chaos.py{' ' + argv if argv else ''}`): {s['sessions']} sessions x
{s['turns_per_session']} turns through two brokers (active-active), {s['workers']} CPU workers
(demo model) and redis-server (AOF, `appendfsync everysec`), {s['concurrency']} sessions in
flight, on {s['machine']}, {s['elapsed_s']} s. Faults, one at a time at random: {faults}.
Conversations alternate greedy and seeded sampling; every turn is compared with a
fault-free in-process run of the same conversation.

| turns expected | ok | lost | gaps | duplicates | mismatched tokens |
| ---: | ---: | ---: | ---: | ---: | ---: |
| {s['turns_expected']} | {s['turns_ok']} | {s['turns_lost']} | {s['gaps']} | {s['duplicates']} | {s['mismatched_turns']} |

Stall: a turn's longest wait between two events of its stream (its request
sent to the first event included), by the fault whose window (plus the 1.5 s
liveness window) held it; `none`: turns no fault touched.

| fault | turns | p50 s | p99 s | max s |
| --- | ---: | ---: | ---: | ---: |
{rows}

Targets: 0 lost, 0 gaps, 0 duplicates, 0 mismatches; stall after a broker kill
at most 2 s p99 with default settings.
""")


if __name__ == "__main__":
    sys.exit(main())
