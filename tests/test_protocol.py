"""The wire protocol: round trips, limits, and a bounded fixed-seed fuzz of
every decoder (whatever the bytes, the result is a message or a ProtocolError)."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest

from turbomq.clients import protocol as P
from turbomq.clients.protocol import Code, ProtocolError

DECODERS = [P.decode_client_request, P.decode_client_reply, P.decode_worker_message,
            P.decode_broker_command]

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


@pytest.mark.parametrize("decode,messages", [
    (P.decode_client_request, CLIENT_REQUESTS), (P.decode_client_reply, CLIENT_REPLIES),
    (P.decode_worker_message, WORKER_MESSAGES), (P.decode_broker_command, BROKER_COMMANDS)])
def test_round_trip(decode, messages):
    for msg in messages:
        assert decode(P.pack(msg)) == msg


def test_kinds_belong_to_their_direction():
    with pytest.raises(ProtocolError) as info:
        P.decode_client_request(P.pack(P.register("w", "m", 1, 1)))
    assert info.value.code == Code.UNKNOWN_KIND
    with pytest.raises(ProtocolError):
        P.decode_worker_message(P.pack(P.dispatch("k", 1, "p", None, None, {}, [], "")))


@pytest.mark.parametrize("mutate,code", [
    (lambda m: m.update(v=2), Code.BAD_VERSION),
    (lambda m: m.update(v=True), Code.BAD_VERSION),
    (lambda m: m.pop("v"), Code.BAD_VERSION),
    (lambda m: m.update(kind="teleport"), Code.UNKNOWN_KIND),
    (lambda m: m.update(kind=3), Code.UNKNOWN_KIND),
    (lambda m: m.update(extra=1), Code.INVALID_FIELD),
    (lambda m: m.update(prompt="x"), Code.INVALID_FIELD),  # both prompt and input_ids
    (lambda m: m.pop("input_ids"), Code.INVALID_FIELD),  # neither
    (lambda m: m.update(input_ids=[]), Code.INVALID_FIELD),
    (lambda m: m.update(input_ids=[-1]), Code.INVALID_FIELD),
    (lambda m: m.update(input_ids=[True]), Code.INVALID_FIELD),
    (lambda m: m.update(input_ids=[1] * 65537), Code.INVALID_FIELD),
    (lambda m: m.update(request_id=""), Code.INVALID_FIELD),
    (lambda m: m.update(request_id="r" * 129), Code.INVALID_FIELD),
    (lambda m: m.update(session_id=5), Code.INVALID_FIELD),
    (lambda m: m.update(stream=1), Code.INVALID_FIELD),
    (lambda m: m.update(timeout=0), Code.INVALID_FIELD),
    (lambda m: m.update(timeout=float("nan")), Code.INVALID_FIELD),
    (lambda m: m.update(params=[1]), Code.INVALID_FIELD),
    (lambda m: m.update(params={"top_P": 0.5}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"max_tokens": 0}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"max_tokens": True}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"temperature": float("inf")}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"top_p": 0}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"stop": [""]}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"stop": ["a"] * 17}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"stop": ["a" * 257]}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"stop_token_ids": [1.0]}), Code.INVALID_FIELD),
    (lambda m: m.update(params={"ignore_eos": 0}), Code.INVALID_FIELD),
])
def test_generate_validation(mutate, code):
    msg = P.generate("r", input_ids=[1, 2], params={"max_tokens": 2})
    mutate(msg)
    with pytest.raises(ProtocolError) as info:
        P.decode_client_request(P.pack(msg))
    assert info.value.code == code
    if code == Code.INVALID_FIELD and type(msg.get("request_id")) is str and 0 < len(msg["request_id"]) <= 128:
        assert info.value.request_id == msg["request_id"]  # so the error reply can name it


def test_frame_size_limit():
    big = P.pack(P.generate("r", prompt="x" * (1 << 20)))
    with pytest.raises(ProtocolError) as info:
        P.decode_client_request(big)
    assert info.value.code == Code.FRAME_TOO_LARGE
    assert P.decode_client_request(big, P.Limits(max_frame_bytes=2 << 20,
                                                 max_prompt_chars=2 << 20))["prompt"]
    with pytest.raises(ProtocolError) as info:
        P.decode_client_request(P.pack(P.generate("r", prompt="x" * 262145)))
    assert info.value.code == Code.INVALID_FIELD


def test_heartbeat_session_lists_are_bounded():
    ok = P.heartbeat(free_slots=1, free_kv_blocks=1, queue_len=0, sessions_added=["s"] * 1024)
    P.decode_worker_message(P.pack(ok))
    with pytest.raises(ProtocolError):
        P.decode_worker_message(P.pack({**ok, "sessions_added": ["s"] * 1025}))


def test_sampling_fields_match_the_engine():
    sampling = pytest.importorskip("turbomq.worker.sampling")  # needs torch
    names = {f.name for f in dataclasses.fields(sampling.SamplingParams)}
    assert P.SAMPLING_FIELDS == names
    wire = sampling.SamplingParams(max_tokens=3, stop=["x"], seed=1).to_dict()
    msg = P.decode_client_request(P.pack(P.generate("r", prompt="p", params=wire)))
    assert sampling.SamplingParams.from_dict(msg["params"]) == sampling.SamplingParams.from_dict(wire)


def test_retryable_codes_are_known():
    assert P.RETRYABLE_CODES <= P.ALL_CODES
    assert P.error("r", Code.OVERLOADED, "")["retryable"] is True
    assert P.error("r", Code.INVALID_FIELD, "")["retryable"] is False


# ------------------------------------------------------------------- fuzz
def _random_value(rng: random.Random, depth: int = 0):
    choices = [None, True, False, rng.randint(-2 ** 63, 2 ** 64 - 1), rng.random() * 1e6,
               float("nan"), "", "x" * rng.randint(1, 300), b"\x00\xff", -1, 0, 1, 2 ** 31]
    if depth < 3:
        choices += [[_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))],
                    {str(rng.randint(0, 9)): _random_value(rng, depth + 1)}]
    return rng.choice(choices)


def _mutations(rng: random.Random, base: dict, n: int):
    for _ in range(n):
        m = dict(base)
        for _ in range(rng.randint(1, 3)):
            op = rng.random()
            key = rng.choice(list(m) + ["zzz"])
            if op < 0.2:
                m.pop(key, None)
            else:
                m[key] = _random_value(rng)
        yield msgpack.packb(m, use_bin_type=True)


def _fuzz_frames(rng: random.Random):
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
        yield from _mutations(rng, base, 40)
    yield b"\x91" * 100_000  # deeply nested arrays
    yield msgpack.packb({(1, 2): 1}, use_bin_type=True)  # non-string map key
    yield msgpack.packb({"v": 1, "kind": "generate", "request_id": "r",
                         "input_ids": [1], "when": msgpack.Timestamp(1, 0)})
    yield msgpack.packb(msgpack.ExtType(5, b"xx"))
    yield b"\x00" * (P.DEFAULT_LIMITS.max_frame_bytes + 1)
    yield "text, not bytes"


def test_fuzz_decoders_raise_only_protocol_errors():
    rng = random.Random(20240607)
    seen_codes = set()
    decoded = 0
    for frame in _fuzz_frames(rng):
        for decode in DECODERS:
            try:
                msg = decode(frame)
            except ProtocolError as e:
                assert e.code in P.ALL_CODES
                assert not e.message.startswith("malformed "), e.message  # a check's own bug
                assert isinstance(e.message, str)
                seen_codes.add(e.code)
            else:
                assert isinstance(msg, dict) and msg["v"] == P.PROTOCOL_VERSION
                P.pack(msg)  # whatever decodes can be sent on
                decoded += 1
    assert {Code.BAD_FRAME, Code.BAD_VERSION, Code.UNKNOWN_KIND, Code.INVALID_FIELD,
            Code.FRAME_TOO_LARGE} <= seen_codes
    assert decoded > 0  # the fuzz also reached valid frames


@pytest.mark.parametrize("decode,checks", [
    (P.decode_client_request, P.CLIENT_REQUEST_CHECKS),
    (P.decode_worker_message, P.WORKER_MESSAGE_CHECKS)])
def test_fast_paths_agree_with_the_full_checks(decode, checks):
    """The broker's decoders take a shortcut for well-formed generate, delta
    and final frames; on any frame they accept and reject exactly what the
    field-by-field path does, with the same code and request id."""
    def outcome(f, frame):
        try:
            return "ok", f(frame)
        except ProtocolError as e:
            return e.code, e.request_id

    hot = [P.generate("r", input_ids=[1, 2], params={"max_tokens": 2}),
           P.generate("r", prompt="hi", session_id="s", params={}, stream=True, timeout=1.5),
           P.worker_delta("k1", 1, 0, [5], "e"), P.worker_final("k1", 1, "length", USAGE, [1], "a")]
    frames = list(_fuzz_frames(random.Random(7)))
    for base in hot:
        frames.append(P.pack(base))
        frames += list(_mutations(random.Random(11), base, 300))
    frames += [P.pack({**hot[0], "params": {"max_tokens": 2, "stop": [1]}}),  # odd param type
               P.pack({**hot[0], "request_id": msgpack.ExtType(1, b"x")}),
               P.pack({**hot[2], "text": msgpack.Timestamp(1, 0)}),
               P.pack({**hot[3], "usage": {**USAGE, "cached_tokens": True}}),
               bytearray(P.pack(hot[0])), memoryview(P.pack(hot[2]))]
    accepted = 0
    for frame in frames:
        fast = outcome(decode, frame)
        assert fast == outcome(lambda f: P._decode(f, checks, P.DEFAULT_LIMITS), frame)
        accepted += fast[0] == "ok"
    assert accepted >= len(hot)
