"""Bytes to messages and back: pack, unpack, and the four decoders, one per
direction, each with its fast path for the broker's hot frames. The only
module of the protocol that uses msgpack."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import msgpack

from .schema import DEFAULT_LIMITS, PROTOCOL_VERSION, Code, Kind, Limits, ProtocolError
from .validate import (BROKER_COMMAND_CHECKS, CLIENT_REPLY_CHECKS, CLIENT_REQUEST_CHECKS,
                       WORKER_MESSAGE_CHECKS, _generate_ok, _usable_id, _w_delta_ok, _w_final_ok)

# --------------------------------------------------------------- encoding
_packer = msgpack.Packer(use_bin_type=True)


def pack(msg: Mapping[str, Any]) -> bytes:
    return _packer.pack(msg)


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """Maps whose keys repeat are refused: two readers (this one, the broker's
    native one) could otherwise take different copies of the value."""
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _RepeatedKey("a map repeats a key")
    return d


def _unpackb(frame: bytes) -> Any:
    return msgpack.unpackb(frame, object_pairs_hook=_unique_keys)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not part of the protocol")


def unpack(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> dict:
    """Bytes -> a map with a supported version and a string kind (not yet
    checked against a direction)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(Code.BAD_FRAME, "frame must be bytes")
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(Code.FRAME_TOO_LARGE,
                            f"frame of {len(frame)} bytes exceeds {limits.max_frame_bytes}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                              timestamp=0, use_list=True, object_pairs_hook=_unique_keys)
    except _RepeatedKey as e:
        raise ProtocolError(Code.BAD_FRAME, str(e)) from None
    except Exception as e:  # msgpack raises many types for bad input
        raise ProtocolError(Code.BAD_FRAME, f"not a msgpack frame: {type(e).__name__}") from None
    if type(msg) is not dict:
        raise ProtocolError(Code.BAD_FRAME, f"frame must be a map, got {type(msg).__name__}")
    v = msg.get("v")
    if v != PROTOCOL_VERSION or type(v) is not int:
        raise ProtocolError(Code.BAD_VERSION, f"protocol version {v!r} not supported "
                            f"(this side speaks {PROTOCOL_VERSION})",
                            _usable_id(msg.get("request_id")))
    if type(msg.get("kind")) is not str:
        raise ProtocolError(Code.UNKNOWN_KIND, "kind must be a string",
                            _usable_id(msg.get("request_id")))
    return msg


# ----------------------------------------------------------------- decoders
def _decode(frame: bytes, checks: dict, limits: Limits) -> dict:
    """The full path: unpack, then the kind's field-by-field check."""
    msg = unpack(frame, limits)
    check = checks.get(msg["kind"])
    if check is None:
        raise ProtocolError(Code.UNKNOWN_KIND, f"unknown kind {msg['kind'][:64]!r}; expected one of "
                            f"{sorted(checks)}", _usable_id(msg.get("request_id")))
    try:
        check(msg, limits)
    except ProtocolError:
        raise
    except Exception as e:  # a check tripped on an odd type: still the sender's fault
        raise ProtocolError(Code.INVALID_FIELD, f"malformed {msg['kind'][:64]!r} message "
                            f"({type(e).__name__})", _usable_id(msg.get("request_id"))) from None
    return msg


def _quick_map(frame: Any, limits: Limits) -> Optional[dict]:
    """A version-1 map with a string kind, or None: the full decoder then
    judges the frame (and names what is wrong). msgpack's defaults differ from
    unpack's options only in turning ext types into objects, and the fast
    checks that use this accept plain types only, so both accept the same
    frames."""
    if type(frame) is not bytes or len(frame) > limits.max_frame_bytes:
        return None
    try:
        msg = _unpackb(frame)
    except Exception:  # malformed: the full decoder says how
        return None
    if type(msg) is not dict:
        return None
    v = msg.get("v")
    if type(v) is not int or v != PROTOCOL_VERSION:
        return None
    return msg


def decode_client_request(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> dict:
    """A frame a client sent to the broker."""
    # The broker's hot path: a well-formed generate in one unpack and one
    # inline check; anything else takes the full path below.
    msg = _quick_map(frame, limits)
    if msg is not None and msg.get("kind") == Kind.GENERATE:
        try:
            if _generate_ok(msg, limits):
                return msg
        except Exception:  # the full path raises the right ProtocolError
            pass
    return _decode(frame, CLIENT_REQUEST_CHECKS, limits)


def decode_client_reply(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> dict:
    """A frame the broker sent to a client."""
    return _decode(frame, CLIENT_REPLY_CHECKS, limits)


def decode_worker_message(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> dict:
    """A frame a worker sent to the broker."""
    # The broker's hot path, as for generate: well-formed deltas and finals.
    msg = _quick_map(frame, limits)
    if msg is not None:
        kind = msg.get("kind")
        if ((kind == Kind.DELTA and _w_delta_ok(msg, limits))
                or (kind == Kind.FINAL and _w_final_ok(msg, limits))):
            return msg
    return _decode(frame, WORKER_MESSAGE_CHECKS, limits)


def decode_broker_command(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> dict:
    """A frame the broker sent to a worker."""
    return _decode(frame, BROKER_COMMAND_CHECKS, limits)
