"""Property tests of every decoder, and of the broker's native reader against
them: whatever the bytes, a decoder returns a message or raises
ProtocolError; what the native data plane accepts at sight, the protocol
accepts with the same fields. (`make fuzz` runs the long version against
real processes: docs/benchmarks/fuzz.md.)"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from protocol_corpus import BROKER_COMMANDS, CLIENT_REPLIES, CLIENT_REQUESTS, WORKER_MESSAGES
from turbomq.clients import protocol as P

DECODERS = [P.decode_client_request, P.decode_client_reply, P.decode_worker_message,
            P.decode_broker_command]
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
           | st.floats(allow_nan=True) | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=16)
bases = st.sampled_from(CLIENT_REQUESTS + CLIENT_REPLIES + WORKER_MESSAGES + BROKER_COMMANDS)


def judged(decode, frame: bytes):
    try:
        msg = decode(frame)
    except P.ProtocolError as e:
        assert e.code in P.ALL_CODES and isinstance(e.message, str)
        return None
    assert isinstance(msg, dict) and msg["v"] == P.PROTOCOL_VERSION
    P.pack(msg)  # whatever decodes can be sent on
    return msg


@SETTINGS
@given(st.binary(max_size=400))
def test_random_bytes(frame):
    for decode in DECODERS:
        judged(decode, frame)


@SETTINGS
@given(base=bases, key=st.text(max_size=12) | st.sampled_from(
    ["v", "kind", "request_id", "params", "input_ids", "prompt", "token_ids", "usage", "seq",
     "index", "attempt", "resume_tokens", "session_id", "timeout", "tenant"]), value=values)
def test_mutated_messages(base, key, value):
    m = dict(base)
    m[key] = value
    frame = msgpack.packb(m, use_bin_type=True)
    for decode in DECODERS:
        judged(decode, frame)


@SETTINGS
@given(base=bases, data=st.data())
def test_truncated_and_flipped(base, data):
    frame = bytearray(P.pack(base))
    cut = data.draw(st.integers(0, len(frame)))
    flip = data.draw(st.integers(0, len(frame) - 1))
    frame[flip] ^= 1 << data.draw(st.integers(0, 7))
    for f in (bytes(frame), bytes(frame[:cut])):
        for decode in DECODERS:
            judged(decode, f)


@SETTINGS
@given(base=st.sampled_from(CLIENT_REQUESTS + WORKER_MESSAGES), key=st.text(max_size=12),
       value=values)
def test_native_reader_never_accepts_more_than_the_protocol(base, key, value):
    native = pytest.importorskip("turbomq._native")
    if not hasattr(native, "broker"):
        pytest.skip("turbomq._native was built without the broker")
    m = dict(base)
    m[key] = value
    frame = msgpack.packb(m, use_bin_type=True)
    limits = native.broker.ProtocolLimits()
    side = 0 if base in CLIENT_REQUESTS else 1
    read = native.broker.read_frame(side, frame, limits, True)
    if read is None:
        return  # not at sight: the protocol judges it
    decode = P.decode_client_request if side == 0 else P.decode_worker_message
    msg = judged(decode, frame)
    assert msg is not None, f"the data plane accepted a frame the protocol refuses: {m!r}"
    assert read["request_id"] == msg.get("request_id")
