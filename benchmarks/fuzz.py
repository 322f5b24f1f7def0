"""The long fuzz run: a million malformed frames at a real broker (both
sockets) with a real CPU worker behind it, while a valid request goes
through every few seconds.

    .venv/bin/python benchmarks/fuzz.py [--frames 1000000]
    make fuzz

Frames: random bytes, mutated valid frames (bit flips, truncations, fields
replaced by wrong types, huge numbers, deep nesting, invalid UTF-8, repeated
keys), frames at and over the size limit. Client frames go to the front; the
back gets the same kinds from a rogue DEALER that is no registered worker,
and from one that registers and then sends garbage for requests it never
got. Checks: no process dies or hangs, every malformed client frame is
answered with an `error` of a documented code, the broker's and the worker's
memory grows at most 10%, and the valid request returns the same tokens each
time. Writes docs/benchmarks/fuzz.md and docs/benchmarks/fuzz.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
sys.path.insert(0, str(ROOT / "tests"))
from protocol_corpus import CLIENT_REQUESTS, WORKER_MESSAGES, random_value  # noqa: E402

from turbomq.clients import Client  # noqa: E402
from turbomq.clients import protocol as P  # noqa: E402

LIMIT = P.DEFAULT_LIMITS.max_frame_bytes


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def repeated_key(rng: random.Random, base: dict) -> bytes:
    packer = msgpack.Packer(use_bin_type=True)
    pairs = list(base.items())
    k = rng.choice(pairs)[0]
    pairs.insert(rng.randrange(len(pairs) + 1), (k, random_value(rng)))
    return packer.pack_map_header(len(pairs)) + b"".join(packer.pack(a) + packer.pack(b)
                                                         for a, b in pairs)


def frames(rng: random.Random, bases: list) -> bytes:
    """One malformed (or odd) frame, of a kind picked at random."""
    base = rng.choice(bases)
    kind = rng.randrange(10)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:  # bit flips
        b = bytearray(P.pack(base))
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 2:  # truncation
        f = P.pack(base)
        return f[:rng.randrange(len(f))]
    if kind == 3:  # a field of the wrong type or a huge number
        m = dict(base)
        m[rng.choice(list(m) + ["zzz"])] = rng.choice(
            [random_value(rng), 2 ** 63, -(2 ** 63), 2 ** 64 - 1, 1e308, float("nan"), [], {}])
        return msgpack.packb(m, use_bin_type=True)
    if kind == 4:  # deep nesting
        depth = rng.randint(20, 2000)
        return b"\x91" * depth + b"\x00" if rng.random() < 0.5 else b"\x81\xa1a" * depth + b"\x00"
    if kind == 5:  # invalid UTF-8 in a string field
        f = P.pack({**base, "request_id": "abc"})
        return f.replace(b"\xa3abc", b"\xa3a\xff\xfe")
    if kind == 6:
        return repeated_key(rng, base)
    if kind == 7:  # at and over the size limit
        size = rng.choice([LIMIT - 8, LIMIT, LIMIT + 1, LIMIT + 4096])
        return P.pack({**base, "prompt": "x" * (size - 60)})[:size]
    if kind == 8:  # a valid kind from the wrong direction
        return P.pack(rng.choice(WORKER_MESSAGES if base in CLIENT_REQUESTS else CLIENT_REQUESTS))
    return msgpack.packb(random_value(rng), use_bin_type=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=1_000_000)
    ap.add_argument("--probe-every", type=float, default=3.0, help="seconds between valid requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args()
    from turbomq.worker.model.demo import write_demo_model

    tmp = Path(tempfile.mkdtemp(prefix="turbomq-fuzz-"))
    write_demo_model(tmp / "demo", seed=0)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    broker = subprocess.Popen([PY, "-m", "turbomq.broker", "--front", "tcp://127.0.0.1:*",
                               "--back", "tcp://127.0.0.1:*", "--log-level", "CRITICAL"],
                              stdout=subprocess.PIPE, text=True, env=env)
    ep = json.loads(broker.stdout.readline())
    worker = subprocess.Popen([PY, "-m", "turbomq.worker.cli", "worker", "--model",
                               str(tmp / "demo"), "--broker", ep["back"], "--worker-id", "w0",
                               "--no-metrics", "--log-level", "CRITICAL"],
                              stdout=subprocess.PIPE, text=True, env=env)
    worker.stdout.readline()  # ready
    ctx = zmq.Context.instance()
    probe = Client(ep["front"], timeout=60)
    while probe.health()["workers"] < 1:
        time.sleep(0.1)
    want = probe.generate("The fuzz run begins", max_tokens=12, temperature=0).token_ids
    # Memory is compared from the end of a warm-up (first-use allocations of
    # every decode path are no growth) to the end of the run.
    warmup = min(50_000, args.frames // 20)
    rss0 = None

    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(ep["front"])
    rogue = ctx.socket(zmq.DEALER)  # never registers
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(ep["back"])
    liar = ctx.socket(zmq.DEALER)  # registers, then sends garbage
    liar.setsockopt(zmq.LINGER, 0)
    liar.connect(ep["back"])
    liar.send(P.pack(P.register("liar", "demo", 0, 0)))
    rng = random.Random(args.seed)
    codes: dict = {}
    sent = client_sent = answered = probes = probe_mismatch = 0
    begin = last_probe = time.monotonic()
    documented = set(P.ALL_CODES)
    bad_codes = []
    pending = 0
    while sent < args.frames:
        side = rng.random()
        if side < 0.6:
            frame = frames(rng, CLIENT_REQUESTS)
            try:  # only malformed ones: each must get exactly one error
                P.decode_client_request(frame)
                continue
            except P.ProtocolError:
                pass
            client.send(frame)
            client_sent += 1
            pending += 1
        elif side < 0.8:
            rogue.send(frames(rng, WORKER_MESSAGES))
        else:
            liar.send(frames(rng, WORKER_MESSAGES) if rng.random() < 0.7 else
                      P.pack(rng.choice(WORKER_MESSAGES)))
        sent += 1
        if rss0 is None and sent >= warmup:
            rss0 = {"broker": rss_kib(broker.pid), "worker": rss_kib(worker.pid)}
        if pending >= 200 or sent == args.frames:  # read the replies to the client frames
            deadline = time.monotonic() + 10
            while pending and time.monotonic() < deadline:
                if not client.poll(1000):
                    continue
                while True:
                    try:
                        reply = P.decode_client_reply(client.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    pending -= 1
                    if reply["kind"] == "error":
                        answered += 1
                        codes[reply["code"]] = codes.get(reply["code"], 0) + 1
                        if reply["code"] not in documented:
                            bad_codes.append(reply["code"])
                    else:
                        bad_codes.append(f"a {reply['kind']} for a malformed frame")
            for sock in (rogue, liar):
                while sock.poll(0):
                    sock.recv()
        now = time.monotonic()
        if now - last_probe >= args.probe_every:
            last_probe = now
            probes += 1
            got = probe.generate("The fuzz run begins", max_tokens=12, temperature=0).token_ids
            probe_mismatch += got != want
            if broker.poll() is not None or worker.poll() is not None:
                break
            print(f"  {sent:,} frames, {now - begin:.0f} s", flush=True)
    elapsed = time.monotonic() - begin
    alive = broker.poll() is None and worker.poll() is None
    got = probe.generate("The fuzz run begins", max_tokens=12, temperature=0).token_ids if alive else None
    probes += 1
    probe_mismatch += got != want
    rss1 = {"broker": rss_kib(broker.pid), "worker": rss_kib(worker.pid)} if alive else rss0
    growth = {k: round(rss1[k] / rss0[k] - 1, 4) for k in rss0}
    stats = probe.stats() if alive else {}
    for p in (broker, worker):
        p.terminate()
        p.wait(10)
    summary = {
        "frames": sent, "elapsed_s": round(elapsed, 1), "frames_per_s": round(sent / elapsed),
        "alive": alive, "client_frames": client_sent,
        "client_frames_answered_with_error": answered, "error_codes": codes,
        "undocumented_codes": sorted(set(bad_codes)),
        "probes": probes, "probe_mismatches": probe_mismatch,
        "rss_kib_start": rss0, "rss_kib_end": rss1, "rss_growth": growth,
        "broker_frames_rejected": stats.get("frames_rejected"),
        "broker_worker_frames_rejected": stats.get("worker_frames_rejected"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps(summary, indent=1) + "\n")
    ok = (alive and not bad_codes and probe_mismatch == 0 and answered == client_sent
          and all(g <= 0.10 for g in growth.values()))
    (out / "fuzz.md").write_text(f"""# Fuzz run

`make fuzz` (`.venv/bin/python benchmarks/fuzz.py`): {sent:,} malformed frames in
{elapsed:.0f} s ({sent / elapsed:,.0f}/s) at a real broker with a real CPU worker (demo model)
behind it, on {summary['machine']}: 60% client frames at the front, 20% at the back from a
DEALER that never registered, 20% from one that registered and sends garbage (and stray
valid messages for requests it never got). Kinds: random bytes, bit flips, truncations,
wrong types and huge numbers, deep nesting (to 2,000 levels), invalid UTF-8, repeated keys,
frames at and over the 1 MiB limit, valid kinds from the wrong direction.

| check | result |
| --- | --- |
| broker and worker alive at the end | {'yes' if alive else 'NO'} |
| malformed client frames answered with one `error` each | {answered:,} of {client_sent:,} |
| error codes outside the documented set | {len(set(bad_codes))} |
| valid request every {args.probe_every:g} s: same tokens | {probes - probe_mismatch} of {probes} |
| broker RSS, after {warmup:,} frames of warm-up -> at the end | {rss0['broker']:,} -> {rss1['broker']:,} KiB ({growth['broker']:+.1%}) |
| worker RSS, likewise | {rss0['worker']:,} -> {rss1['worker']:,} KiB ({growth['worker']:+.1%}) |

Error codes answered: {', '.join(f'`{k}` {v:,}' for k, v in sorted(codes.items()))}.

Targets: no crash or hang, every malformed client frame answered with a documented
error, RSS growth at most 10%, the same tokens for the valid request throughout:
{'met' if ok else 'NOT met'}.
""")
    print(json.dumps(summary, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
