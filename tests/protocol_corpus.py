"""A fixed corpus of protocol messages and a seeded fuzz over them, shared by
the decoder tests (tests/clients) and the native data plane's (tests/broker)."""

from __future__ import annotations

import random

import msgpack

from turbomq.clients import protocol as P
from turbomq.clients.protocol import Code

USAGE = P.usage(5, 2, 3)

CLIENT_REQUESTS = [
    P.generate("r1", prompt="hello", session_id="s1",
               params={"max_tokens": 4, "temperature": 0.0, "stop": ["\n"], "seed": 7},
               stream=True, timeout=2.5),
    P.generate("r2", input_ids=[1, 2, 3], params={"top_k": -1, "stop": "x", "stop_token_ids": [2]}),
    P.cancel("r1"), P.end_session("r3", "s1"), P.health("r4"), P.stats("r5"), P.ping(),
]
CLIENT_REPLIES = [
    P.delta("r1", 0, 0, [1, 2], "ab"), P.final("r1", 1, "stop", USAGE, [], ""),
    P.final("r2", 0, "length", USAGE, [1, 2, 3], "abc"),
    P.error("r1", Code.OVERLOADED, "busy"), P.error(None, Code.BAD_FRAME, "?"),
    P.health_reply("r4", "ok", 2, 0, 1), P.stats_reply("r5", {"a": 1}), P.session_ended("r3", "s1"),
]
WORKER_MESSAGES = [
    P.register("w1", "llama", 8, 1000, 9100), P.register("w2", "llama", 1, 0),
    P.heartbeat(free_slots=3, free_kv_blocks=10, queue_len=0, sessions_reset=True,
                sessions_added=["s1"], sessions_removed=[]),
    P.worker_delta("k1", 1, 0, [5], "e"), P.worker_final("k1", 2, "cancelled", USAGE, [], ""),
    P.error("k1", Code.PROMPT_TOO_LONG, "too long", attempt=1), P.session_ended("e1", "s1"),
]
BROKER_COMMANDS = [
    P.registered(0.5, 3), P.heartbeat(), P.reconnect(), P.cancel("k1", 1), P.end_session("e1", "s1"),
    P.dispatch("k1", 2, None, [1, 2], "s1", {"max_tokens": 8}, [1], "a", 3.0),
]


def random_value(rng: random.Random, depth: int = 0):
    choices = [None, True, False, rng.randint(-2 ** 63, 2 ** 64 - 1), rng.random() * 1e6,
               float("nan"), "", "x" * rng.randint(1, 300), b"\x00\xff", -1, 0, 1, 2 ** 31]
    if depth < 3:
        choices += [[random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))],
                    {str(rng.randint(0, 9)): random_value(rng, depth + 1)}]
    return rng.choice(choices)


def mutations(rng: random.Random, base: dict, n: int):
    for _ in range(n):
        m = dict(base)
        for _ in range(rng.randint(1, 3)):
            op = rng.random()
            key = rng.choice(list(m) + ["zzz"])
            if op < 0.2:
                m.pop(key, None)
            else:
                m[key] = random_value(rng)
        yield msgpack.packb(m, use_bin_type=True)


def fuzz_frames(rng: random.Random):
    for _ in range(1500):
        yield rng.randbytes(rng.randint(0, 200))
    valid = [P.pack(m) for m in CLIENT_REQUESTS + CLIENT_REPLIES + WORKER_MESSAGES + BROKER_COMMANDS]
    for frame in valid:  # truncations and bit flips of real frames
        for _ in range(15):
            b = bytearray(frame)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            yield bytes(b)
            yield frame[:rng.randrange(len(frame))]
    for base in CLIENT_REQUESTS + CLIENT_REPLIES + WORKER_MESSAGES + BROKER_COMMANDS:
        yield from mutations(rng, base, 40)
    yield b"\x91" * 100_000  # deeply nested arrays
    yield msgpack.packb({(1, 2): 1}, use_bin_type=True)  # non-string map key
    yield msgpack.packb({"v": 1, "kind": "generate", "request_id": "r",
                         "input_ids": [1], "when": msgpack.Timestamp(1, 0)})
    yield msgpack.packb(msgpack.ExtType(5, b"xx"))
    yield b"\x00" * (P.DEFAULT_LIMITS.max_frame_bytes + 1)
    yield "text, not bytes"
