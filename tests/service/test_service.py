"""The worker service end to end: a real broker, real worker processes on the
demo model (CPU), a real redis-server, the real client. Expected tokens come
from the engine run in this process on the same model (greedy), i.e. a
single-worker run with no faults."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_until
from helpers import demo_model_dir
from turbomq.clients import Client, Delta, Final, InvalidRequest, PromptTooLong, TurbomqError
from turbomq.clients import protocol as P

PY = sys.executable
LIFETIME_S = 180  # no process started here outlives this, whatever happens
CHILD_ENV = dict(os.environ, OMP_NUM_THREADS="1")
GREEDY = {"temperature": 0.0}


# ---------------------------------------------------------------- harness
class Cluster:
    """A broker and worker processes, each in its own process group with a
    hard lifetime; close() kills whatever is left."""

    def __init__(self, tmp: Path, redis_url: Optional[str] = None, **broker_flags):
        self.tmp = tmp
        self.redis_url = redis_url
        self.procs: list[subprocess.Popen] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.metrics_ports: dict[str, int] = {}
        self.broker_flags = {"heartbeat_interval": 0.1, "liveness": 5, "log_level": "WARNING",
                             **broker_flags}
        self.brokers: list[dict] = []  # {"proc", "front", "back"} per broker
        self.front, self.back = self.add_broker()

    def add_broker(self, front: str = "tcp://127.0.0.1:*", back: str = "tcp://127.0.0.1:*",
                   index: Optional[int] = None) -> tuple[str, str]:
        """Start a broker (another one of an active-active set, or broker
        `index` again on its endpoints); returns its (front, back)."""
        cmd = [PY, "-m", "turbomq.broker", "--front", front, "--back", back]
        for k, v in self.broker_flags.items():
            cmd += ["--" + k.replace("_", "-"), str(v)]
        proc = self._spawn(cmd)
        line = proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the broker did not start")
        endpoints = json.loads(line)
        entry = {"proc": proc, "front": endpoints["front"], "back": endpoints["back"]}
        if index is None:
            self.brokers.append(entry)
        else:
            self.brokers[index] = entry
        if len(self.brokers) == 1:
            self.metrics_ports["broker"] = endpoints.get("metrics_port")
        return endpoints["front"], endpoints["back"]

    @property
    def backs(self) -> str:
        return ",".join(b["back"] for b in self.brokers)

    def kill_broker(self, index: int = 0) -> None:
        proc = self.brokers[index]["proc"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)

    def restart_broker(self, index: int = 0, down_s: float = 0.0) -> None:
        """SIGKILL a broker, then start a new one on the same endpoints."""
        self.kill_broker(index)
        time.sleep(down_s)
        b = self.brokers[index]
        self.add_broker(b["front"], b["back"], index=index)

    def _spawn(self, cmd: list) -> subprocess.Popen:
        proc = subprocess.Popen(["timeout", "-s", "KILL", str(LIFETIME_S)] + cmd, text=True,
                                stdout=subprocess.PIPE, env=CHILD_ENV, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_worker(self, worker_id: str, broker: Optional[str] = None, slots: int = 8,
                     extra: tuple = ()) -> subprocess.Popen:
        cmd = [PY, "-m", "turbomq.worker.cli", "worker", "--model", demo_model_dir(),
               "--broker", broker or self.backs, "--worker-id", worker_id,
               "--max-batch-size", str(slots), "--log-level", "WARNING", *extra]
        if self.redis_url:
            cmd += ["--redis-url", self.redis_url]
        proc = self._spawn(cmd)
        self.workers[worker_id] = proc
        return proc

    def wait_ready(self, worker_id: str, timeout: float = 60) -> dict:
        """The worker's ready line: it loaded the model and serves /metrics."""
        line = self.workers[worker_id].stdout.readline()
        if not line:
            raise RuntimeError(f"worker {worker_id} exited while starting")
        info = json.loads(line)
        self.metrics_ports[worker_id] = info["metrics_port"]
        return info

    def start_workers(self, client: Client, n: int, slots: int = 8) -> None:
        ids = [f"w{i}" for i in range(n)]
        for wid in ids:
            self.start_worker(wid, slots=slots)
        for wid in ids:
            self.wait_ready(wid)
        wait_until(lambda: client.health()["workers"] == n, 30, f"{n} workers registered")

    def kill_worker(self, worker_id: str) -> None:
        proc = self.workers[worker_id]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def metrics(self, process: str) -> dict:
        """Every sample of a worker's (or the broker's) /metrics: {(name, labels...): value}."""
        url = f"http://127.0.0.1:{self.metrics_ports[process]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "worker"))
                out[(s.name,) + labels] = s.value
        return out

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            proc.stdout.close()


@pytest.fixture
def cluster(tmp_path):
    made: list[Cluster] = []

    def make(redis_url: Optional[str] = None, **broker_flags) -> Cluster:
        c = Cluster(tmp_path, redis_url, **broker_flags)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def client_for():
    clients: list[Client] = []

    def make(front: str, **kw) -> Client:
        c = Client(front, timeout=kw.pop("timeout", 60), **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


_engine = None


def reference_engine():
    """The fault-free single-engine reference, shared by this test process."""
    global _engine
    if _engine is None:
        from turbomq.worker import Engine, EngineConfig
        _engine = Engine(EngineConfig(model=demo_model_dir()))
    return _engine


def expected_tokens(prompts: list, max_tokens: int, **params) -> list[list[int]]:
    from turbomq.worker import SamplingParams
    results = reference_engine().generate(prompts=prompts, params=SamplingParams(
        max_tokens=max_tokens, **GREEDY, **params))
    return [r.token_ids for r in results]


def expected_session(session_id: str, turns: list, max_tokens: int,
                     sampling: Optional[dict] = None) -> list[list[int]]:
    """Each turn's tokens, fault-free (greedy unless `sampling` says otherwise)."""
    from turbomq.worker import SamplingParams
    engine = reference_engine()
    sampling = sampling if sampling is not None else GREEDY
    out = [engine.generate(prompts=turn, session_id=session_id,
                           params=SamplingParams(max_tokens=max_tokens, **sampling))[0].token_ids
           for turn in turns]
    engine.end_session(session_id)
    return out


def read_stream(stream) -> tuple[list, Final]:
    """The stream's tokens, checking seq and index have no gap or repeat."""
    tokens, final = [], None
    for i, event in enumerate(stream):
        if isinstance(event, Delta):
            assert event.seq == i and event.index == len(tokens), (event, len(tokens))
            tokens.extend(event.token_ids)
        else:
            final = event
    return tokens, final


def read_streams_killing_a_worker(svc: "Cluster", streams: list, streams_started: int,
                                  tokens_each: int) -> tuple[list, list]:
    """Read every stream a delta at a time, checking seq and index have no gap
    or repeat; once `streams_started` streams hold `tokens_each` tokens,
    SIGKILL whichever of w0 and w1 runs more of them (on a loaded machine the
    other may have none left), at the first pass where one runs any: killing
    an idle worker would test nothing. Returns the streams' tokens and
    finals."""
    tokens: list[list[int]] = [[] for _ in streams]
    seqs = [0] * len(streams)
    finals: list = [None] * len(streams)
    killed = False
    while any(f is None for f in finals):
        for i, stream in enumerate(streams):
            if finals[i] is not None:
                continue
            event = next(stream)
            if isinstance(event, Delta):
                assert event.seq == seqs[i] and event.index == len(tokens[i]), (i, event)
                seqs[i] += 1
                tokens[i].extend(event.token_ids)
            else:
                finals[i] = event
        if not killed and sum(len(t) >= tokens_each for t in tokens) >= streams_started:
            running = {w: svc.metrics(w).get(("turbomq_requests_running",), 0)
                       for w in ("w0", "w1")}
            victim = max(running, key=running.get)
            if running[victim] > 0:
                svc.kill_worker(victim)
                killed = True
    assert killed, "every stream was generated before the kill (the workers outran the reader)"
    return tokens, finals


# ------------------------------------------------------------------- tests
def test_sessions_spread_over_two_workers_and_survive_a_move(cluster, client_for, redis_server):
    svc = cluster(redis_server.url)
    client = client_for(svc.front)
    svc.start_workers(client, 2)
    turns = ["The harbour town woke slowly.", " And then the boats", " Martha climbed the steps",
             " The train arrived"]
    sessions = [f"s{i}" for i in range(6)]
    got: dict[str, list] = {s: [] for s in sessions}
    cached = 0
    for t, turn in enumerate(turns):
        if t == 2:
            # Both workers served turns, then the holder of s0 dies: its session
            # moves to the survivor, which rebuilds it from Redis.
            for wid in ("w0", "w1"):
                assert svc.metrics(wid)[("turbomq_requests_finished_total", ("reason", "length"))] > 0
            holder = "w0" if svc.metrics("w0")[("turbomq_sessions", ("state", "cached"))] else "w1"
            svc.kill_worker(holder)
            survivor = "w1" if holder == "w0" else "w0"
            wait_until(lambda: client.health()["workers"] == 1, 10, "the dead worker dropped")
        # The first turns all in flight at once: routing by free slots spreads
        # the sessions over both workers.
        streams = {sid: client.generate(turn + f" ({sid})", session_id=sid, max_tokens=6,
                                        stream=True, **GREEDY) for sid in sessions} if t == 0 else {}
        for sid in sessions:
            stream = streams.get(sid) or client.generate(turn + f" ({sid})", session_id=sid,
                                                         max_tokens=6, stream=True, **GREEDY)
            tokens, final = read_stream(stream)
            got[sid].append(tokens)
            cached += final.usage.cached_tokens
    assert cached > 0  # affinity: later turns reused resident KV
    assert svc.metrics(survivor)[("turbomq_session_cache_misses_total",)] > 0  # rebuilt sessions
    for sid in sessions:
        want = expected_session(f"ref-{sid}", [turn + f" ({sid})" for turn in turns], 6)
        assert got[sid] == want, sid
    client.end_session("s0")
    with pytest.raises(TurbomqError) as e:
        client.end_session("s0")
    assert e.value.code == "unknown_session"


def test_client_disconnect_cancels_on_the_worker(cluster, client_for, tmp_path):
    svc = cluster(client_timeout=30)
    client = client_for(svc.front)
    svc.start_workers(client, 1)
    script = tmp_path / "reader.py"
    script.write_text(
        "import sys\n"
        "from turbomq.clients import Client\n"
        "c = Client(sys.argv[1])\n"
        "for i, ev in enumerate(c.generate('Once upon a time', max_tokens=3000, ignore_eos=True,"
        " temperature=0, stream=True)):\n"
        "    if i == 3:\n"
        "        print('reading', flush=True)\n"
        "        sys.stdin.readline()\n")
    reader = subprocess.Popen(["timeout", "-s", "KILL", "60", PY, str(script), svc.front],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=CHILD_ENV, start_new_session=True)
    try:
        assert reader.stdout.readline().strip() == "reading"
        m = svc.metrics("w0")
        assert m[("turbomq_batch_slots_active",)] == 1
        os.killpg(reader.pid, signal.SIGKILL)  # gone without a word
        reader.wait(5)
    finally:
        if reader.poll() is None:
            os.killpg(reader.pid, signal.SIGKILL)
            reader.wait(5)
        reader.stdin.close()
        reader.stdout.close()

    def freed() -> bool:
        m = svc.metrics("w0")
        return (m[("turbomq_batch_slots_active",)] == 0
                and m[("turbomq_requests_finished_total", ("reason", "cancelled"))] == 1)

    # The broker finds out on its next send to the dead client and cancels.
    wait_until(freed, 10, "the worker cancelled the abandoned request")
    assert client.generate("Hello", max_tokens=3, **GREEDY).finish_reason in ("length", "stop")
    m = svc.metrics("w0")
    assert m[("turbomq_generated_tokens_total",)] < 3000
    assert m[("turbomq_time_to_first_token_seconds_count",)] == 2
    assert m[("turbomq_step_duration_seconds_count",)] > 0


CLIENT_SCRIPT = """
import json, sys
from turbomq.clients import Client, Delta
front, start, count, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.argv[5])
out = {}
with Client(front, timeout=120) as c:
    streams = [(i, c.generate(prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0,
                              stream=True)) for i in range(start, start + count)]
    for i, stream in streams:
        tokens, ok = [], True
        for n, ev in enumerate(stream):
            if isinstance(ev, Delta):
                ok = ok and ev.seq == n and ev.index == len(tokens)
                tokens.extend(ev.token_ids)
            else:
                reason = ev.finish_reason
        out[i] = {"tokens": tokens, "ordered": ok, "reason": reason}
print(json.dumps(out))
"""


def test_500_concurrent_streams_from_several_processes(cluster, client_for, tmp_path):
    svc = cluster(metrics_port=0)
    client = client_for(svc.front)
    svc.start_workers(client, 2)
    prompts = [f"Story {i}: the {w}" for i, w in enumerate(
        "harbour lighthouse river train baker school market teacher porter gulls".split())]
    want = expected_tokens(prompts, 6)
    script = tmp_path / "clients.py"
    script.write_text(CLIENT_SCRIPT)
    procs, per = [], 125
    for k in range(4):
        procs.append(subprocess.Popen(
            ["timeout", "-s", "KILL", "120", PY, str(script), svc.front, str(k * per), str(per), "6",
             json.dumps(prompts)], stdout=subprocess.PIPE, text=True, env=CHILD_ENV,
            start_new_session=True))
    results = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=150)
        assert proc.returncode == 0
        results.update(json.loads(out))
    assert len(results) == 500
    for i, r in results.items():
        assert r["ordered"] and r["reason"] in ("length", "stop")
        assert r["tokens"] == want[int(i) % len(prompts)], i
    stats = client.stats()
    assert stats["requests_by_outcome"]["completed"] == 500
    assert all(svc.metrics(w)[("turbomq_requests_finished_total", ("reason", "length"))] > 0
               for w in ("w0", "w1"))
    wait_until(lambda: svc.metrics("broker")[("turbomq_broker_requests_total",
                                              ("outcome", "completed"))] == 500,
               5, "the broker's metrics to count 500 completed requests")
    assert svc.metrics("broker")[("turbomq_broker_request_duration_seconds_count",)] == 500


class FakeBroker:
    """A ROUTER socket that speaks the broker side to one worker."""

    def __init__(self):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ident = None

    def recv(self, timeout: float = 10.0, skip_heartbeats: bool = True) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                ident, frame = self.sock.recv_multipart()
                self.ident = ident
                msg = P.decode_worker_message(frame)
                if msg["kind"] == "heartbeat" and skip_heartbeats:
                    self.send_raw(P.pack(P.heartbeat()))
                    continue
                return msg
        raise AssertionError("no message from the worker")

    def send_raw(self, frame: bytes) -> None:
        self.sock.send_multipart([self.ident, frame])

    def send(self, msg: dict) -> None:
        self.send_raw(P.pack(msg))

    def close(self) -> None:
        self.sock.close(0)


def _dispatch(key: str, **kw) -> dict:
    fields = {"prompt": None, "input_ids": [0, 5, 6, 7], "session_id": None,
              "params": {"max_tokens": 4, "temperature": 0.0}, "resume_tokens": [],
              "resume_text": ""}
    fields.update(kw)
    return P.dispatch(key, 1, fields["prompt"], fields["input_ids"], fields["session_id"],
                      fields["params"], fields["resume_tokens"], fields["resume_text"], 30.0)


def _run_to_end(fake: FakeBroker, key: str) -> tuple[list, dict]:
    tokens = []
    while True:
        msg = fake.recv()
        assert msg["request_id"] == key, msg
        if msg["kind"] == "delta":
            assert msg["index"] == len(tokens)
            tokens += msg["token_ids"]
        else:
            if msg["kind"] == "final":
                tokens += msg["token_ids"]
            return tokens, msg


def test_malformed_input_at_the_worker_socket(cluster, tmp_path):
    svc = cluster()
    fake = FakeBroker()
    try:
        svc.start_worker("raw", broker=fake.endpoint)
        reg = fake.recv()
        assert reg["kind"] == "register" and reg["worker_id"] == "raw" and reg["metrics_port"] > 0
        fake.send(P.registered(0.2, 50))
        beat = fake.recv(skip_heartbeats=False)
        assert beat["kind"] == "heartbeat" and beat["sessions_reset"] is True
        fake.send(P.heartbeat())

        rng = random.Random(1234)
        garbage = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))) for _ in range(20)]
        garbage += [msgpack.packb([1, 2]), msgpack.packb({"v": 9, "kind": "dispatch"}),
                    msgpack.packb({"v": 1, "kind": "explode"}),
                    msgpack.packb({"v": 1, "kind": "dispatch", "request_id": "x"})]
        for frame in garbage:
            fake.send_raw(frame)
        errors = []
        while len(errors) < len(garbage):
            msg = fake.recv()
            assert msg["kind"] == "error" and msg["request_id"] is None, msg
            errors.append(msg["code"])
        assert {"bad_frame", "bad_version", "unknown_kind", "invalid_field"} <= set(errors)

        # Well-formed but refused by the engine: the engine's code comes back.
        cases = {"a": (_dispatch("a", input_ids=[5, 99999]), "invalid_request"),
                 "b": (_dispatch("b", params={"stop_token_ids": [5000]}), "invalid_params"),
                 "c": (_dispatch("c", input_ids=[5] * 5000), "prompt_too_long"),
                 "d": (_dispatch("d", resume_tokens=[1, 2, 3, 4]), "invalid_request")}
        for key, (msg, _) in cases.items():
            fake.send(msg)
        for _ in cases:
            msg = fake.recv()
            assert msg["kind"] == "error" and msg["attempt"] == 1, msg
            assert msg["code"] == cases[msg["request_id"]][1], msg
        fake.send(P.cancel("nobody", 1))  # ignored
        fake.send(P.end_session("e1", "no-such-session"))
        msg = fake.recv()
        assert (msg["kind"], msg["request_id"], msg["code"]) == ("error", "e1", "unknown_session")

        # Still serving, and correctly.
        fake.send(_dispatch("ok", params={"max_tokens": 5, "temperature": 0.0}))
        tokens, final = _run_to_end(fake, "ok")
        assert final["kind"] == "final" and final["attempt"] == 1
        assert tokens == _expect_ids([0, 5, 6, 7], 5)
        assert svc.workers["raw"].poll() is None
    finally:
        fake.close()


def _expect_ids(ids: list, max_tokens: int) -> list:
    from turbomq.worker import SamplingParams
    return reference_engine().generate(input_ids=[ids], params=SamplingParams(
        max_tokens=max_tokens, **GREEDY))[0].token_ids


def test_malformed_input_via_the_broker(cluster, client_for):
    svc = cluster()
    client = client_for(svc.front)
    svc.start_workers(client, 1)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(svc.front)
    try:
        rng = random.Random(99)
        for _ in range(30):
            raw.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80))))
            assert raw.poll(5000)
            reply = P.decode_client_reply(raw.recv())
            assert reply["kind"] == "error" and not reply["retryable"]
    finally:
        raw.close(0)
    # Valid frames the engine refuses: a clear error each, from the worker.
    with pytest.raises(InvalidRequest) as e:
        client.generate(input_ids=[5, 5000], max_tokens=3)
    assert e.value.code == "invalid_request" and "vocabulary" in e.value.message
    with pytest.raises(InvalidRequest) as e:
        client.generate("Hi", max_tokens=3, stop_token_ids=[4096])
    assert e.value.code == "invalid_params"
    with pytest.raises(PromptTooLong):
        client.generate(input_ids=[7] * 5000, max_tokens=3)
    r = client.generate(input_ids=[0, 5, 6, 7], max_tokens=5, **GREEDY)
    assert r.token_ids == _expect_ids([0, 5, 6, 7], 5)
    assert svc.alive()


@pytest.mark.parametrize("template", [True, False], ids=["messages", "no-template-text"])
def test_chat_command_keeps_a_session(cluster, client_for, tmp_path, template):
    # The demo model has a chat template: lines go as messages. A model
    # without one gets them as plain text.
    svc = cluster()
    client = client_for(svc.front)
    if template:
        svc.start_workers(client, 1)
    else:
        model = tmp_path / "plain"
        shutil.copytree(demo_model_dir(), model)
        config = json.loads((model / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        svc.start_worker("w0", extra=("--model", str(model)))
        svc.wait_ready("w0")
        wait_until(lambda: client.health()["workers"] == 1, 30, "the worker registered")
    out = subprocess.run(
        ["timeout", "-s", "KILL", "60", PY, "-m", "turbomq.worker.cli", "chat", "--broker",
         svc.front, "--max-tokens", "5", "--temperature", "0"],
        input="Hello there\nAnd then?\n/reset\nHi\n/quit\n", capture_output=True, text=True,
        env=CHILD_ENV, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("[length]") + out.stdout.count("[stop]") == 3
    assert "[new session]" in out.stdout and "error" not in out.stdout
    m = svc.metrics("w0")
    assert m[("turbomq_session_cache_hits_total",)] == 1  # the second turn reused its KV


def test_counters_follow_hits_evictions_and_misses(cluster, client_for):
    """A resident session's next turn raises hits; pressure that evicts it
    raises evictions; its next turn then raises misses (and re-prefills).
    Without prefix caching, which would find the evicted session's blocks."""
    svc = cluster()
    client = client_for(svc.front)
    # 12 blocks of 16 tokens: about two sessions of ~80 tokens fit
    svc.start_worker("w0", extra=("--block-size", "16", "--num-kv-blocks", "12",
                                  "--no-prefix-caching"))
    svc.wait_ready("w0")
    wait_until(lambda: client.health()["workers"] == 1, 30, "the worker registered")

    def turn(session: str, text: str) -> None:
        client.generate(prompt=text, session_id=session, max_tokens=16, **GREEDY)

    def count(name: str) -> float:
        return svc.metrics("w0")[(name,)]

    # metrics are synced after each step, so a final can beat them: wait for them
    def reaches(name: str, value: float, what: str) -> None:
        wait_until(lambda: count(name) >= value, 5, what)

    turn("a", "The quick brown fox jumps over the lazy dog and runs far away. " * 2)
    hits = count("turbomq_session_cache_hits_total")
    turn("a", "Then it rested.")
    reaches("turbomq_session_cache_hits_total", hits + 1, "a hit for the resident session")

    evictions = count("turbomq_kv_evictions_total")
    misses = count("turbomq_session_cache_misses_total")
    for other in ("b", "c"):
        turn(other, "Once upon a time there was a small village by the sea. " * 2)
    reaches("turbomq_kv_evictions_total", evictions + 1, "an eviction under pressure")
    turn("a", "And then?")
    reaches("turbomq_session_cache_misses_total", misses + 1, "a miss for the evicted session")
    assert count("turbomq_session_cache_misses_total") == misses + 1
    reaches("turbomq_reprefilled_tokens_total", 1, "the evicted session's history re-prefilled")


def test_messages_through_the_service(cluster, client_for, tmp_path):
    # A chat prompt travels as messages (protocol, broker, worker) and the
    # worker renders it with the model's template; a session's later turn
    # sends only its new messages.
    model = tmp_path / "chat-model"
    shutil.copytree(demo_model_dir(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (Path(__file__).resolve().parents[1] / "data" / "chat_templates"
                               / "chatml.jinja").read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    svc = cluster()
    svc.start_worker("w0", extra=("--model", str(model)))
    svc.wait_ready("w0")
    client = client_for(svc.front)
    wait_until(lambda: client.health()["workers"] == 1, 30, "the worker registered")
    first = [{"role": "user", "content": "Name a colour."}]
    then = [{"role": "user", "content": "And another one?"}]
    from turbomq.worker import Engine, EngineConfig, SamplingParams
    params = SamplingParams(max_tokens=6, **GREEDY)
    with Engine(EngineConfig(model=str(model), max_batch_size=2)) as ref:
        want = []
        for turn in (first, then):
            events = []
            ref.submit(messages=turn, params=params, session_id="ref", callback=events.append)
            while not (events and events[-1].finished):
                ref.step()
            want.append([t for e in events for t in e.token_ids])
    chat = client.session("colours", max_tokens=6, **GREEDY)
    got = [chat.send(None, messages=turn).token_ids for turn in (first, then)]
    assert got == want
    with pytest.raises(InvalidRequest):  # a malformed message is refused at the client
        client.generate(messages=[{"role": "user"}])


def test_a_stopped_worker_leaves_cleanly_and_exits_0(cluster, client_for):
    """SIGTERM: the worker finishes its loop, closes the engine (every tensor)
    and its broker links, and exits 0; the broker then counts no worker."""
    svc = cluster()
    client = client_for(svc.front)
    proc = svc.start_worker("w0")
    svc.wait_ready("w0")
    wait_until(lambda: client.health()["workers"] == 1, 30, "the worker registered")
    assert client.generate(prompt="Hello", max_tokens=4, temperature=0).finish_reason == "length"
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(30) == 0
    wait_until(lambda: client.health()["workers"] == 0, 30, "the broker saw the worker go")
