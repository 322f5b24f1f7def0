"""The wire protocol: round trips, limits, and a bounded fixed-seed fuzz of
every decoder (whatever the bytes, the result is a message or a ProtocolError)."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest

from turbomq.clients import protocol as P
from turbomq.clients.protocol import Code, ProtocolError

from protocol_corpus import (BROKER_COMMANDS, CLIENT_REPLIES, CLIENT_REQUESTS, USAGE,
                             WORKER_MESSAGES, fuzz_frames, mutations)

DECODERS = [P.decode_client_request, P.decode_client_reply, P.decode_worker_message,
            P.decode_broker_command]


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
    from turbomq.worker.engine import sampling_params as sampling
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
def test_fuzz_decoders_raise_only_protocol_errors():
    rng = random.Random(20240607)
    seen_codes = set()
    decoded = 0
    for frame in fuzz_frames(rng):
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
    frames = list(fuzz_frames(random.Random(7)))
    for base in hot:
        frames.append(P.pack(base))
        frames += list(mutations(random.Random(11), base, 300))
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


def test_repeated_keys_are_refused_at_any_depth():
    packer = msgpack.Packer(use_bin_type=True)

    def repeated(pairs):
        return packer.pack_map_header(len(pairs)) + b"".join(
            packer.pack(k) + packer.pack(v) for k, v in pairs)

    top = repeated([("v", 1), ("kind", "ping"), ("kind", "ping")])
    nested = repeated([("v", 1), ("kind", "generate"), ("request_id", "r"), ("input_ids", [1]),
                       ("params", {"max_tokens": 2})])[:-len(packer.pack({"max_tokens": 2}))]
    nested += packer.pack_map_header(2) + packer.pack("max_tokens") + packer.pack(2) \
        + packer.pack("max_tokens") + packer.pack(3)
    for frame in (top, nested):
        for decode in DECODERS:
            with pytest.raises(ProtocolError) as info:
                decode(frame)
            assert info.value.code == Code.BAD_FRAME and "repeats a key" in info.value.message
