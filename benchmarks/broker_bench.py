"""Broker overhead, measured against a direct client<->worker baseline in the same run.

Both paths use the same echo worker process (no model) and the same raw
DEALER/ROUTER client code, so the difference is the broker hop:

    direct:   bench (ROUTER, plays the broker) <-> echo worker (DEALER)
    brokered: bench (DEALER client) <-> broker (ROUTER|ROUTER) <-> echo worker

Latency: one request at a time, max_tokens=1, send -> final (the worker's one
message is the final, which the broker forwards). Throughput: several
streaming requests in flight, one token per delta; messages/s = deltas the
client received per second. Also: latency through the `Client` library.

    .venv/bin/python benchmarks/broker_bench.py [--quick] [--transport ipc,tcp] [--spin-us N]

Each transport in --transport (ipc unix sockets, tcp loopback) gets the whole
set of measurements; the first one is the headline.

Writes docs/benchmarks/broker.md and docs/benchmarks/broker.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import msgpack
import zmq

from turbomq import _native
from turbomq.broker.config import BrokerConfig
from turbomq.clients import Client, CurveClient
from turbomq.clients.keys import allow_line, new_keypair
from turbomq.clients import protocol as P

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


ROUNDS = 10  # latency samples are taken in this many alternating rounds per path


def percentile(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100.0 * (len(xs) - 1))))]


def spawn_worker(endpoint: str, slots: int, keys: Optional[dict] = None,
                 worker_id: str = "bench") -> subprocess.Popen:
    curve = ["--curve-secret", keys["worker_secret"], "--broker-key", keys["broker_key"]] if keys else []
    return subprocess.Popen([PY, "-m", "turbomq.broker.echo_worker", "--broker", endpoint,
                             "--slots", str(slots), "--worker-id", worker_id, *curve])


# The prefix-routing pair's prompt: longer than the routing key's 256 bytes,
# so the key hashes all it may.
PREFIX_PROMPT = ("You are the harbour master's assistant. Answer questions about tides, berths "
                 "and pilotage in the bay, briefly, and never guess a tide time. ") * 3


def curve_keys(folder: str) -> dict:
    """Key pairs for a broker, a worker and a client, and the allow-lists."""
    (broker_key, broker_secret), (worker_key, worker_secret), (client_key, client_secret) = (
        new_keypair(folder, name) for name in ("broker", "worker", "client"))
    Path(folder, "workers.allow").write_text(allow_line(worker_key) + "\n")
    Path(folder, "clients.allow").write_text(allow_line(client_key) + "\n")
    return {"broker_secret": str(broker_secret), "broker_key": str(broker_key),
            "worker_secret": str(worker_secret), "client": CurveClient.load(client_secret, broker_key),
            "workers_allow": str(Path(folder, "workers.allow")),
            "clients_allow": str(Path(folder, "clients.allow"))}


class Endpoints:
    """Fresh endpoints of one transport: tcp loopback (free ports) or ipc."""

    def __init__(self, transport: str):
        if transport not in ("tcp", "ipc"):
            raise ValueError(f"unknown transport {transport!r}")
        self.transport = transport
        self._dir = tempfile.mkdtemp(prefix="turbomq-bench-") if transport == "ipc" else None
        self._n = 0

    def new(self) -> str:
        """An endpoint to bind (tcp: port * is resolved by the binder)."""
        if self.transport == "tcp":
            return "tcp://127.0.0.1:*"
        self._n += 1
        return f"ipc://{self._dir}/s{self._n}"

    def bind(self, sock: zmq.Socket) -> str:
        sock.bind(self.new())
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def cleanup(self) -> None:
        if self._dir is not None:
            for name in os.listdir(self._dir):
                os.unlink(os.path.join(self._dir, name))
            os.rmdir(self._dir)


def spawn_broker(eps: Endpoints, spin_us: float, keys: Optional[dict] = None,
                 flags: tuple = ()) -> tuple:
    curve = (["--curve-secret", keys["broker_secret"], "--client-keys", keys["clients_allow"],
              "--worker-keys", keys["workers_allow"]] if keys else [])
    proc = subprocess.Popen([PY, "-m", "turbomq.broker", "--front", eps.new(),
                             "--back", eps.new(), "--log-level", "WARNING",
                             "--queue-bound", "100000", "--spin-us", str(spin_us), *curve, *flags],
                            stdout=subprocess.PIPE, text=True)
    ep = json.loads(proc.stdout.readline())
    return proc, ep["front"], ep["back"]


class DirectPath:
    """The bench process is the worker's broker: dispatch in, deltas/final out."""

    def __init__(self, ctx: zmq.Context, slots: int, eps: Endpoints):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.worker = spawn_worker(eps.bind(self.sock), slots)
        while True:  # wait for register
            ident, frame = self.sock.recv_multipart()
            if msgpack.unpackb(frame)["kind"] == "register":
                break
        self.ident = ident
        # Long liveness: this side never heartbeats.
        self.sock.send_multipart([ident, P.pack(P.registered(1.0, 1000))])
        self.n = 0

    def send(self, max_tokens: int, stream: bool) -> str:
        self.n += 1
        key = f"d{self.n}"
        self.sock.send_multipart([self.ident, P.pack(P.dispatch(
            key, 1, None, [7, 8, 9], None, {"max_tokens": max_tokens}, [], ""))])
        return key

    def recv(self) -> dict:
        return msgpack.unpackb(self.sock.recv_multipart()[1])

    def close(self) -> None:
        self.worker.terminate()
        self.worker.wait(5)
        self.sock.close(0)


class BrokeredPath:
    def __init__(self, ctx: zmq.Context, front: str, curve: Optional[CurveClient] = None,
                 prompt: Optional[str] = None):
        self.prompt = prompt  # None: input_ids [7, 8, 9], as the direct path sends
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(front)
        self.n = 0

    def send(self, max_tokens: int, stream: bool) -> str:
        self.n += 1
        rid = f"b{self.n}"
        inputs = {"prompt": self.prompt} if self.prompt else {"input_ids": [7, 8, 9]}
        self.sock.send(P.pack(P.generate(rid, **inputs, params={"max_tokens": max_tokens},
                                         stream=stream)))
        return rid

    def recv(self) -> dict:
        return msgpack.unpackb(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


def latency(path, n: int, warmup: int) -> list:
    out = []
    for i in range(n + warmup):
        t0 = time.perf_counter()
        path.send(1, False)
        while True:
            msg = path.recv()
            if msg["kind"] in ("final", "error"):
                break
        if msg["kind"] == "error":
            raise RuntimeError(msg)
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def throughput(path, streams: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    for _ in range(streams):
        path.send(tokens, True)
    deltas, finals = 0, 0
    while finals < streams:
        msg = path.recv()
        kind = msg["kind"]
        if kind == "delta":
            deltas += 1
        elif kind == "final":
            finals += 1
        elif kind == "error":
            raise RuntimeError(msg)
    elapsed = time.perf_counter() - t0
    return {"messages": deltas, "seconds": elapsed, "messages_per_s": deltas / elapsed}


def library_latency(front: str, n: int, warmup: int) -> list:
    out = []
    with Client(front) as c:
        for i in range(n + warmup):
            t0 = time.perf_counter()
            c.generate(input_ids=[7, 8, 9], max_tokens=1)
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e6)
    return out


_RAW_ECHO = """
import sys, zmq
s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1])
if len(sys.argv) > 2:  # say hello, so a ROUTER in front learns our id
    s.send(b"hello")
while True:
    s.send_multipart(s.recv_multipart())
"""

# The least a Python ROUTER/ROUTER broker can do: forward frames, no decode.
_PY_FORWARDER = """
import sys, zmq
c = zmq.Context()
f = c.socket(zmq.ROUTER); f.bind(sys.argv[1])
b = c.socket(zmq.ROUTER); b.bind(sys.argv[2])
worker, _ = b.recv_multipart()
poller = zmq.Poller(); poller.register(f, zmq.POLLIN); poller.register(b, zmq.POLLIN)
while True:
    for sock, _ in poller.poll():
        if sock is f:
            b.send_multipart([worker] + f.recv_multipart())
        else:
            f.send_multipart(b.recv_multipart()[1:])
"""


def hop_floor(ctx: zmq.Context, n: int, eps: Endpoints) -> dict:
    """What one extra hop costs with no broker logic: a raw echo reached
    directly, through libzmq's C proxy (zmq.proxy, ROUTER|DEALER), and through
    a minimal Python ROUTER/ROUTER forwarder. Rounds interleave the three."""
    def pinger(front: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(front)
        return s

    def ping(s: zmq.Socket, count: int) -> list:
        out = []
        for i in range(count + count // 10):
            t0 = time.perf_counter()
            s.send(b"x" * 48)
            s.recv()
            if i >= count // 10:
                out.append((time.perf_counter() - t0) * 1e6)
        return out

    def endpoint() -> str:
        if eps.transport == "ipc":
            return eps.new()
        probe = ctx.socket(zmq.ROUTER)  # a free port, released for the child to bind
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(0)
        return f"tcp://127.0.0.1:{port}"

    alone, c_front, c_back, p_front, p_back = (endpoint() for _ in range(5))
    procs = [subprocess.Popen([PY, "-c", code, *argv]) for code, argv in (
        ("import sys, zmq\ns = zmq.Context().socket(zmq.ROUTER)\ns.bind(sys.argv[1])\n"
         "while True:\n    s.send_multipart(s.recv_multipart())", [alone]),
        ("import sys, zmq\nc = zmq.Context()\nf = c.socket(zmq.ROUTER); f.bind(sys.argv[1])\n"
         "b = c.socket(zmq.DEALER); b.bind(sys.argv[2])\nzmq.proxy(f, b)", [c_front, c_back]),
        (_RAW_ECHO, [c_back]), (_PY_FORWARDER, [p_front, p_back]), (_RAW_ECHO, [p_back, "hello"]))]
    paths = {"direct": alone, "c_proxy": c_front, "py_forwarder": p_front}
    got = {k: [] for k in paths}
    try:
        time.sleep(0.5)
        socks = {k: pinger(front) for k, front in paths.items()}
        for _ in range(ROUNDS):
            for k, sock in socks.items():
                got[k] += ping(sock, n // ROUNDS)
        for sock in socks.values():
            sock.close(0)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    d = percentile(got["direct"], 50)
    return {"direct_p50_us": round(d, 1),
            "c_proxy_p50_us": round(percentile(got["c_proxy"], 50), 1),
            "added_p50_us": round(percentile(got["c_proxy"], 50) - d, 1),
            "py_forwarder_p50_us": round(percentile(got["py_forwarder"], 50), 1),
            "py_forwarder_added_p50_us": round(percentile(got["py_forwarder"], 50) - d, 1)}


def routing_work() -> dict:
    """Nanoseconds per request of prefix routing's own work (the key, the
    pick), in C++ with no sockets: a prompt, token ids and a chat, each
    longer than the key reads, over 4 and 16 workers."""
    chat = [{"role": "system", "content": PREFIX_PROMPT},
            {"role": "user", "content": PREFIX_PROMPT}, {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "And then?"}]
    frames = {"prompt": {"prompt": PREFIX_PROMPT}, "input_ids": {"input_ids": list(range(1000, 1300))},
              "messages": {"messages": chat}}
    out = {}
    for name, inputs in frames.items():
        frame = msgpack.packb({"v": 1, "kind": "generate", "request_id": "r", **inputs})
        for workers in (4, 16):
            best = min(_native.broker.prefix_routing_ns(frame, "tenant", 256, workers, 200_000)
                       for _ in range(3))
            out[f"{name}_{workers}_workers_ns"] = round(best, 1)
    return out


def summary(us: list) -> dict:
    return {"p50_us": round(percentile(us, 50), 1), "p90_us": round(percentile(us, 90), 1),
            "p99_us": round(percentile(us, 99), 1), "mean_us": round(statistics.fmean(us), 1),
            "n": len(us)}


def measure(ctx: zmq.Context, transport: str, args) -> dict:
    """Every measurement over one transport."""
    warmup = max(args.requests // 10, 100)
    eps = Endpoints(transport)
    keys = curve_keys(tempfile.mkdtemp(prefix="turbomq-bench-keys-"))
    broker, front, back = spawn_broker(eps, args.spin_us)
    bworker = spawn_worker(back, slots=args.streams)
    cbroker, cfront, cback = spawn_broker(eps, args.spin_us, keys)  # CURVE on both sockets
    cworker = spawn_worker(cback, slots=args.streams, keys=keys)
    # Prefix routing on and off: two brokers alike but for --prefix-routing,
    # each with its echo worker, sent the same long prompt. (One worker each:
    # several would outrun this one client on a small machine; what scoring
    # more workers costs is in routing_work().)
    pair = {}
    for mode in ("on", "off"):
        proc, pfront, pback = spawn_broker(eps, args.spin_us, flags=("--prefix-routing", mode))
        pair[mode] = {"front": pfront, "procs": [proc, spawn_worker(pback, slots=args.streams)],
                      "path": BrokeredPath(ctx, pfront, prompt=PREFIX_PROMPT)}
    direct = DirectPath(ctx, args.streams, eps)
    brokered = BrokeredPath(ctx, front)
    curved = BrokeredPath(ctx, cfront, keys["client"])
    try:
        for f, curve in ((front, None), (cfront, keys["client"]), (pair["on"]["front"], None),
                         (pair["off"]["front"], None)):
            with Client(f, curve=curve) as c:
                while c.health()["workers"] < 1:
                    time.sleep(0.05)
        # Interleave the paths so drift on the shared machine hits all alike.
        lat_direct, lat_brokered, lat_curve = [], [], []
        lat_pair = {"on": [], "off": []}
        for r in range(ROUNDS):
            lat_direct += latency(direct, args.requests // ROUNDS, warmup // ROUNDS)
            lat_brokered += latency(brokered, args.requests // ROUNDS, warmup // ROUNDS)
            lat_curve += latency(curved, args.requests // ROUNDS, warmup // ROUNDS)
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):  # neither always first
                lat_pair[mode] += latency(pair[mode]["path"], args.requests // ROUNDS,
                                          warmup // ROUNDS)
        lat_library = library_latency(front, args.requests // 4, warmup // 4)
        tp_direct, tp_brokered, tp_curve = [], [], []
        tp_pair = {"on": [], "off": []}
        for r in range(args.repeats):
            tp_direct.append(throughput(direct, args.streams, args.tokens))
            tp_brokered.append(throughput(brokered, args.streams, args.tokens))
            tp_curve.append(throughput(curved, args.streams, args.tokens))
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                tp_pair[mode].append(throughput(pair[mode]["path"], args.streams, args.tokens))
        with Client(front) as c:
            broker_stats = c.stats()
        pair_routing = {}
        for mode in ("on", "off"):
            with Client(pair[mode]["front"]) as c:
                pair_routing[mode] = c.stats()["routing"]
    finally:
        direct.close()
        brokered.close()
        curved.close()
        procs = [broker, bworker, cbroker, cworker]
        for mode in pair:
            pair[mode]["path"].close()
            procs += pair[mode]["procs"]
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(5)
    try:
        floor = hop_floor(ctx, args.requests // 2, eps)
    finally:
        eps.cleanup()
    d, b, lib = summary(lat_direct), summary(lat_brokered), summary(lat_library)
    cv = summary(lat_curve)
    best_d = max(tp_direct, key=lambda r: r["messages_per_s"])
    best_b = max(tp_brokered, key=lambda r: r["messages_per_s"])
    best_c = max(tp_curve, key=lambda r: r["messages_per_s"])
    on, off = summary(lat_pair["on"]), summary(lat_pair["off"])
    best_on = max(tp_pair["on"], key=lambda r: r["messages_per_s"])
    best_off = max(tp_pair["off"], key=lambda r: r["messages_per_s"])
    prefix_pair = {
        "prompt_chars": len(PREFIX_PROMPT),
        "latency": {"on": on, "off": off, "on_minus_off_p50_us": round(on["p50_us"] - off["p50_us"], 1),
                    "on_minus_off_p99_us": round(on["p99_us"] - off["p99_us"], 1)},
        "throughput": {"on_messages_per_s": round(best_on["messages_per_s"]),
                       "off_messages_per_s": round(best_off["messages_per_s"]),
                       "on_vs_off": round(best_on["messages_per_s"] / best_off["messages_per_s"], 3),
                       "runs_on": [round(r["messages_per_s"]) for r in tp_pair["on"]],
                       "runs_off": [round(r["messages_per_s"]) for r in tp_pair["off"]]},
        "routing": pair_routing,
    }
    return {
        "transport": TRANSPORTS[transport],
        "latency": {"direct": d, "brokered": b, "brokered_curve": cv,
                    "client_library_brokered": lib,
                    "added_p50_us": round(b["p50_us"] - d["p50_us"], 1),
                    "added_p99_us": round(b["p99_us"] - d["p99_us"], 1),
                    "curve_added_p50_us": round(cv["p50_us"] - d["p50_us"], 1)},
        "throughput": {"streams": args.streams, "tokens_per_stream": args.tokens,
                       "direct_messages_per_s": round(best_d["messages_per_s"]),
                       "brokered_messages_per_s": round(best_b["messages_per_s"]),
                       "brokered_curve_messages_per_s": round(best_c["messages_per_s"]),
                       "curve_vs_plain": round(best_c["messages_per_s"] / best_b["messages_per_s"], 3),
                       "runs_direct": [round(r["messages_per_s"]) for r in tp_direct],
                       "runs_brokered": [round(r["messages_per_s"]) for r in tp_brokered],
                       "runs_brokered_curve": [round(r["messages_per_s"]) for r in tp_curve]},
        "hop_floor_c_proxy": floor,
        "prefix_routing": prefix_pair,
        "broker_counters": {k: broker_stats[k] for k in ("messages_in", "messages_out",
                                                          "requests_by_outcome")},
    }


TRANSPORTS = {"tcp": "tcp loopback", "ipc": "ipc (unix domain sockets)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=5000, help="latency samples per path")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams for throughput")
    ap.add_argument("--tokens", type=int, default=25000, help="tokens (= deltas) per stream")
    ap.add_argument("--repeats", type=int, default=3, help="throughput runs per path (best kept)")
    ap.add_argument("--transport", default="ipc,tcp",
                    help="comma-separated transports to measure, headline first "
                         "(ipc: unix sockets, as `turbomq up` links broker and workers; "
                         "tcp: loopback; default ipc,tcp)")
    ap.add_argument("--spin-us", type=float, default=BrokerConfig().spin_us,
                    help="the broker's --spin-us (default: the broker's default)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.tokens, args.repeats = 1000, 5000, 1
    transports = [t.strip() for t in args.transport.split(",") if t.strip()]
    for t in transports:
        if t not in TRANSPORTS:
            ap.error(f"unknown transport {t!r} (tcp or ipc)")
    ctx = zmq.Context.instance()
    runs = {t: measure(ctx, t, args) for t in transports}
    head = runs[transports[0]]
    work = routing_work()
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                    "broker_libzmq": _native.broker.zmq_version(),
                    "msgpack": ".".join(map(str, msgpack.version)),
                    "transport": head["transport"], "broker_spin_us": args.spin_us},
        # The headline transport's figures at the top level; every transport under "transports".
        **{k: head[k] for k in ("latency", "throughput", "hop_floor_c_proxy", "prefix_routing",
                                "broker_counters")},
        "transports": runs,
        "prefix_routing_work": work,
    }
    table = render(result)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "broker.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "broker.md").write_text(MD_HEAD + table + "\n" + MD_TAIL)
    return 0


def render(r: dict) -> str:
    rows = ["| transport | path | p50 µs | p90 µs | p99 µs | messages/s |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, t in r["transports"].items():
        lat, tp = t["latency"], t["throughput"]
        rows += [
            f"| {name} | direct client <-> worker | {lat['direct']['p50_us']} | "
            f"{lat['direct']['p90_us']} | {lat['direct']['p99_us']} | "
            f"{tp['direct_messages_per_s']:,} |",
            f"| {name} | through the broker | {lat['brokered']['p50_us']} | "
            f"{lat['brokered']['p90_us']} | {lat['brokered']['p99_us']} | "
            f"{tp['brokered_messages_per_s']:,} |",
            f"| {name} | through the broker, CURVE on both links | {lat['brokered_curve']['p50_us']} | "
            f"{lat['brokered_curve']['p90_us']} | {lat['brokered_curve']['p99_us']} | "
            f"{tp['brokered_curve_messages_per_s']:,} ({tp['curve_vs_plain']:.0%} of plain) |",
            f"| {name} | through the broker, `Client` library | "
            f"{lat['client_library_brokered']['p50_us']} | "
            f"{lat['client_library_brokered']['p90_us']} | "
            f"{lat['client_library_brokered']['p99_us']} | |",
            f"| {name} | **added by the broker** | **{lat['added_p50_us']}** | | "
            f"**{lat['added_p99_us']}** | |",
            f"| {name} | **added by the broker, CURVE** | **{lat['curve_added_p50_us']}** | | | |",
        ]
        pr = t["prefix_routing"]
        for mode in ("on", "off"):
            pl = pr["latency"][mode]
            rows.append(f"| {name} | through the broker, {pr['prompt_chars']}-character prompt, "
                        f"prefix routing {mode} | {pl['p50_us']} | "
                        f"{pl['p90_us']} | {pl['p99_us']} | "
                        f"{pr['throughput'][mode + '_messages_per_s']:,} |")
        rows.append(f"| {name} | **prefix routing on minus off** | "
                    f"**{pr['latency']['on_minus_off_p50_us']}** | | "
                    f"**{pr['latency']['on_minus_off_p99_us']}** | "
                    f"{pr['throughput']['on_vs_off']:.0%} of off |")
    rows.append("")
    for name, t in r["transports"].items():
        f = t["hop_floor_c_proxy"]
        rows.append(f"Reference, no broker logic ({name}): a raw echo answers in "
                    f"{f['direct_p50_us']} µs p50 directly, {f['c_proxy_p50_us']} µs through "
                    f"libzmq's C `zmq.proxy` (one extra hop alone adds **{f['added_p50_us']} µs**) "
                    f"and {f['py_forwarder_p50_us']} µs through a minimal Python ROUTER/ROUTER "
                    f"forwarder (adds {f['py_forwarder_added_p50_us']} µs).")
        rows.append("")
    w = r["prefix_routing_work"]
    rows.append("Prefix routing's own work per request, in C++ without sockets (best of 3 x "
                "200,000): the key of a prompt (256 bytes hashed) and the pick among 4 / 16 "
                f"workers {w['prompt_4_workers_ns']} / {w['prompt_16_workers_ns']} ns; of token "
                f"ids (64 ids) {w['input_ids_4_workers_ns']} / {w['input_ids_16_workers_ns']} ns; "
                f"of a chat (system and first user message, 256 bytes each) "
                f"{w['messages_4_workers_ns']} / {w['messages_16_workers_ns']} ns.")
    rows.append("")
    m = r["machine"]
    tp = r["throughput"]
    runs = "; ".join(f"{name}: direct {t['throughput']['runs_direct']}, brokered "
                     f"{t['throughput']['runs_brokered']}, prefix routing on "
                     f"{t['prefix_routing']['throughput']['runs_on']}, off "
                     f"{t['prefix_routing']['throughput']['runs_off']}"
                     for name, t in r["transports"].items())
    rows.append(f"{m['cpus']} CPUs, Python {m['python']}, pyzmq {m['pyzmq']} (libzmq {m['libzmq']}; "
                f"the broker's native data plane: libzmq {m['broker_libzmq']}), "
                f"msgpack {m['msgpack']}; tcp is loopback, ipc is unix domain sockets; broker "
                f"`--spin-us {m['broker_spin_us']:g}`. Latency: {ROUNDS} alternating rounds per path. "
                f"Throughput: {tp['streams']} streams x {tp['tokens_per_stream']:,} one-token "
                f"deltas, best of {len(tp['runs_brokered'])} (runs: {runs}).")
    return "\n".join(rows) + "\n"


MD_HEAD = """# Broker benchmark

`benchmarks/broker_bench.py`: the broker alone with an echo worker (no model),
side by side with a direct client <-> worker DEALER/ROUTER baseline in the same
run. Latency is one request at a time (`max_tokens=1`, send -> final);
throughput counts one-token deltas received by the client per second with
several streams in flight. Client, broker and worker share the machine's CPUs.
Each transport is a separate set of processes: ipc (unix domain sockets, the
headline: `turbomq up` links broker and workers so), then tcp loopback; "added
by the broker" compares paths over the same transport.
Figures on this shared 2-CPU machine drift by tens of percent between runs;
compare rows of one run.

"""

MD_TAIL = """
"CURVE on both links": a second broker with CurveZMQ on its front and back
sockets (keys on its allow-lists, `docs/security.md`), with its own echo
worker and a client holding an allowed key, measured in the same rounds as
the plain broker. The target for it is at least 80% of the plain broker's
messages/s.

"Prefix routing on / off": two more brokers, alike but for `--prefix-routing`
(docs/broker.md, Prefix routing), each with its echo worker, are sent the
same prompt of more characters than the routing key reads (256 bytes), in
the same rounds as the other paths (which of the two goes first alternates).
"On minus off" is what computing the key and scoring the workers costs per
request, within the run's noise when it is near zero; the line after the
table measures that work alone, in C++, for 4 and 16 workers.

The issue 4 target is an added p50 of at most 100 µs with at least 50,000
messages/s. The broker's loop is native (C++ over libzmq; `docs/broker.md`,
Performance). The two reference hops above carry no broker logic: libzmq's C
proxy is about the least a broker hop can add here, and the minimal Python
forwarder is what a broker loop in Python pays before any logic at all.

Earlier figures, same benchmark, with the broker loop in Python: 121.2 µs
(ipc) and 126.1 µs (tcp) added p50 at 80,588 and 77,988 messages/s in the
last such run (C proxy in that run: 76.4 / 86.5 µs); 270.1 µs over tcp before
any hot-path work.

Reproduce: `.venv/bin/python benchmarks/broker_bench.py [--transport ipc,tcp]
[--spin-us N]` (figures in `broker.json`: the first transport at the top level,
all of them under `transports`).
"""


if __name__ == "__main__":
    sys.exit(main())
