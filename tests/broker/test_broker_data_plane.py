"""The broker's native data plane against clients/protocol, the protocol's one definition.

The data plane accepts the common well-formed generate, delta and final
frames itself and hands every other frame to clients/protocol. So: whatever it
accepts, clients/protocol must accept too, and read to the same fields; whatever
clients/protocol accepts, the data plane must read to the same fields.
"""

from __future__ import annotations

import random

import msgpack
import pytest

from turbomq import _native
from turbomq.broker.core import native_limits
from turbomq.clients import protocol as P
from turbomq.clients.protocol import ProtocolError

from protocol_corpus import USAGE, fuzz_frames, mutations

CLIENT, WORKER = 0, 1
LIMITS = native_limits(P.DEFAULT_LIMITS)
MAX_ID = P.DEFAULT_LIMITS.max_id_chars

# What clients and workers send in the ordinary course: all of it must take the fast path.
HOT_CLIENT = [
    P.generate("r", input_ids=[1, 2], params={"max_tokens": 2}),
    P.generate("r", prompt="hi", session_id="s", params={}, stream=True, timeout=1.5),
    P.generate("r", prompt="é" * 10, params={
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
        "repetition_penalty": 1.1, "seed": 2 ** 64 - 1, "stop": ["\n", "END"],
        "stop_token_ids": [2], "ignore_eos": True, "skip_special_tokens": False}),
    P.generate("r", input_ids=[0, P.MAX_TOKEN_ID], params={"stop": "x", "seed": -(2 ** 63)},
               timeout=P.DEFAULT_LIMITS.max_timeout_s),
    P.generate("é" * MAX_ID, prompt="p", session_id="😀" * MAX_ID),  # limits count characters
]
HOT_WORKER = [
    P.worker_delta("k1", 1, 0, [5], "e"), P.worker_delta("k1", 1, 7, [], ""),
    P.worker_final("k1", 1, "length", USAGE, [1], "a"),
    P.worker_final("k1", 3, "stop", USAGE, [], "✓"), P.worker_final("k1", 1, "cancelled", USAGE, [], ""),
]


def _odd_frames():
    """Valid and invalid frames a random fuzz seldom builds."""
    g = HOT_CLIENT[0]
    d, f = HOT_WORKER[0], HOT_WORKER[2]
    yield P.pack({**g, "request_id": "é" * (MAX_ID + 1)})  # one character too many
    yield P.pack({**g, "request_id": ""})
    yield P.pack({**g, "params": {"max_tokens": 2, "stop": [1]}})
    yield P.pack({**g, "params": {"max_tokens": True}})
    yield P.pack({**g, "params": {"max_tokens": 2.0}})
    yield P.pack({**g, "params": {"temperature": float("inf")}})
    yield P.pack({**g, "params": {"top_p": 0}})
    yield P.pack({**g, "params": {"top_p": 1}})
    yield P.pack({**g, "params": {"top_k": -2}})
    yield P.pack({**g, "params": {"stop": ""}})
    yield P.pack({**g, "params": {"stop": ["a"] * 17}})
    yield P.pack({**g, "params": {"seed": None}})
    yield P.pack({**g, "params": {"bogus": 1}})
    yield P.pack({**g, "params": None})
    yield P.pack({**g, "prompt": None})
    yield P.pack({**g, "prompt": "x"})  # both prompt and input_ids
    yield P.pack({**g, "input_ids": None, "prompt": "x"})
    yield P.pack({**g, "input_ids": []})
    yield P.pack({**g, "input_ids": [True]})
    yield P.pack({**g, "stream": None})
    yield P.pack({**g, "timeout": 0})
    yield P.pack({**g, "timeout": None})
    yield P.pack({**g, "session_id": None})
    yield P.pack({**g, "v": True})
    yield P.pack({**g, "v": 1.0})
    yield P.pack({**d, "attempt": -1})
    yield P.pack({**d, "index": 2 ** 31})
    yield P.pack({**d, "extra": 1})
    yield P.pack({**f, "usage": {**USAGE, "extra": 0}})
    yield P.pack({**f, "usage": {"prompt_tokens": 1, "cached_tokens": 0}})
    yield P.pack({**f, "finish_reason": "done"})
    yield msgpack.packb({**d, "token_ids": [1]}, use_single_float=True)
    yield msgpack.packb({"v": 1, "kind": "generate", "request_id": "r", "input_ids": [1],
                         "params": {"temperature": 0.5}}, use_single_float=True)
    # Duplicate keys: the last one counts, as in the dict clients/protocol builds.
    head = b"\x85\xa1v\x01\xa4kind\xa8generate\xaarequest_id\xa1r"
    yield head + b"\xa9input_ids\x91\x05" + b"\xa9input_ids\x92\x01\x02"
    yield head + b"\xa9input_ids\xc0" + b"\xa9input_ids\x91\x07"
    # Strings that are not UTF-8: a surrogate, an overlong form, a truncated sequence.
    for bad in (b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82"):
        yield P.pack({**g, "request_id": "RID"}).replace(b"RID", bad[:3].ljust(3, b"a"))
    yield P.pack(g) + b"\x00"  # trailing bytes
    yield P.pack({**g, "input_ids": [1] * (P.DEFAULT_LIMITS.max_prompt_tokens + 1)})


def _corpus():
    frames = [f for f in fuzz_frames(random.Random(5)) if isinstance(f, bytes)]
    for base in HOT_CLIENT + HOT_WORKER:
        frames.append(P.pack(base))
        frames += list(mutations(random.Random(13), base, 200))
    frames += list(_odd_frames())
    return frames


def _decode(side: int, frame: bytes):
    decode = P.decode_client_request if side == CLIENT else P.decode_worker_message
    try:
        return decode(frame)
    except ProtocolError:
        return None


def _client_fields(msg: dict) -> dict:
    generate = msg["kind"] == "generate"
    has_prompt = generate and msg.get("prompt") is not None
    has_messages = generate and msg.get("messages") is not None
    source = "prompt" if has_prompt else "messages" if has_messages else "input_ids"
    return {"kind": msg["kind"], "request_id": msg.get("request_id", ""),
            "session_id": msg.get("session_id"), "has_prompt": has_prompt,
            "has_messages": has_messages,
            "prompt_or_ids": msg[source] if generate else None,
            "params": msg.get("params") or {}, "stream": msg.get("stream", False),
            "timeout": float(msg.get("timeout") or 0.0)}


def _native_client_fields(r: dict) -> dict:
    r = dict(r)
    r["prompt_or_ids"] = msgpack.unpackb(r["prompt_or_ids"]) if r["prompt_or_ids"] else None
    r["params"] = msgpack.unpackb(r["params"]) if r["params"] else {}
    return r


def _worker_fields(msg: dict) -> dict:
    usage = msg.get("usage") or {}
    return {"kind": msg["kind"], "request_id": msg.get("request_id"), "attempt": msg.get("attempt"),
            "index": msg.get("index"), "token_ids": msg.get("token_ids", []),
            "text": msg.get("text", ""), "finish_reason": msg.get("finish_reason", ""),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": usage.get("cached_tokens", 0)}


def _same_fields(side: int, native: dict, msg: dict) -> bool:
    if side == CLIENT:
        return _native_client_fields(native) == _client_fields(msg)
    return native == _worker_fields(msg)


@pytest.mark.parametrize("side", [CLIENT, WORKER])
def test_fast_path_accepts_only_what_protocol_accepts(side):
    fast_accepted = 0
    for frame in _corpus():
        native = _native.broker.read_frame(side, frame, LIMITS, True)
        if native is None:
            continue
        msg = _decode(side, frame)
        assert msg is not None, f"data plane accepted a frame clients/protocol rejects: {frame[:80]!r}"
        assert _same_fields(side, native, msg), (native, msg)
        fast_accepted += 1
    assert fast_accepted >= 40  # fixed seeds: the count is the same every run


@pytest.mark.parametrize("side", [CLIENT, WORKER])
def test_data_plane_reads_every_valid_frame_as_protocol_does(side):
    valid = 0
    for frame in _corpus():
        msg = _decode(side, frame)
        if msg is None:
            continue
        native = _native.broker.read_frame(side, frame, LIMITS, False)
        assert native is not None, f"valid frame the data plane cannot read: {frame[:80]!r}"
        assert _same_fields(side, native, msg), (native, msg)
        valid += 1
    assert valid >= 40


@pytest.mark.parametrize("side,messages", [(CLIENT, HOT_CLIENT), (WORKER, HOT_WORKER)])
def test_ordinary_frames_take_the_fast_path(side, messages):
    for msg in messages:
        frame = P.pack(msg)
        assert _native.broker.read_frame(side, frame, LIMITS, True) is not None, msg
