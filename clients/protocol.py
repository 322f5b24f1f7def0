"""The turbomq wire protocol: the one definition of every message.

Every frame is one msgpack map with `v` (protocol version) and `kind`. Four
directions, each with its own decoder:

    client -> broker   generate, cancel, end_session, health, stats, ping
    broker -> client   delta, final, error, health, stats, session_ended
    worker -> broker   register, heartbeat, delta, final, error, session_ended
    broker -> worker   registered, heartbeat, dispatch, cancel, end_session, reconnect

Decoders validate types, ranges and sizes and raise `ProtocolError(code, message)`
for anything malformed, never another exception. docs/protocol.md documents
each field. This module depends on msgpack only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import msgpack

PROTOCOL_VERSION = 1


class Kind:
    GENERATE = "generate"
    CANCEL = "cancel"
    END_SESSION = "end_session"
    HEALTH = "health"
    STATS = "stats"
    PING = "ping"
    DELTA = "delta"
    FINAL = "final"
    ERROR = "error"
    SESSION_ENDED = "session_ended"
    REGISTER = "register"
    REGISTERED = "registered"
    HEARTBEAT = "heartbeat"
    DISPATCH = "dispatch"
    RECONNECT = "reconnect"


class Code:
    """Stable error codes. Clients branch on these, never on messages."""

    # malformed input (protocol level)
    BAD_FRAME = "bad_frame"
    BAD_VERSION = "bad_version"
    UNKNOWN_KIND = "unknown_kind"
    INVALID_FIELD = "invalid_field"
    FRAME_TOO_LARGE = "frame_too_large"
    DUPLICATE_REQUEST = "duplicate_request"
    # service state
    OVERLOADED = "overloaded"
    NO_WORKERS = "no_workers"
    TIMEOUT = "timeout"
    UNKNOWN_REQUEST = "unknown_request"
    WORKER_LOST = "worker_lost"
    INTERNAL = "internal"
    # the engine's codes, passed through from workers
    INVALID_REQUEST = "invalid_request"
    PROMPT_TOO_LONG = "prompt_too_long"
    UNKNOWN_SESSION = "unknown_session"
    SESSION_BUSY = "session_busy"
    SESSION_STORE_UNAVAILABLE = "session_store_unavailable"
    INVALID_PARAMS = "invalid_params"


ALL_CODES = frozenset(v for k, v in vars(Code).items() if k.isupper())
# Retrying the same request later may succeed.
RETRYABLE_CODES = frozenset({Code.OVERLOADED, Code.NO_WORKERS, Code.TIMEOUT, Code.WORKER_LOST,
                             Code.SESSION_BUSY, Code.SESSION_STORE_UNAVAILABLE})

FINISH_REASONS = frozenset({"stop", "length", "cancelled"})

MAX_TOKEN_ID = (1 << 31) - 1


class ProtocolError(Exception):
    """A frame that is not a valid message. `request_id` is set when the frame
    was readable enough to name one, so the error reply can carry it."""

    def __init__(self, code: str, message: str, request_id: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r})"


@dataclass(frozen=True)
class Limits:
    """Size bounds every decoder enforces. Broker, workers and clients share
    the defaults; a deployment may raise them (all sides alike)."""

    max_frame_bytes: int = 1 << 20
    max_prompt_tokens: int = 65536
    max_prompt_chars: int = 262144
    max_id_chars: int = 128  # request ids, session ids, worker ids, model ids
    max_new_tokens: int = 65536  # bound on params.max_tokens and on resume_tokens
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int = 256
    max_delta_tokens: int = 65536  # token_ids in one delta / final
    max_text_chars: int = 1 << 19  # text in one delta / final
    max_message_chars: int = 4096  # error messages
    max_heartbeat_sessions: int = 1024  # per list in one heartbeat
    max_timeout_s: float = 86400.0


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------- encoding
_packer = msgpack.Packer(use_bin_type=True)


def pack(msg: Mapping[str, Any]) -> bytes:
    return _packer.pack(msg)


_unpackb = msgpack.unpackb


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
                              timestamp=0, use_list=True)
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


# ------------------------------------------------------------- field checks
def _usable_id(rid: Any) -> Optional[str]:
    """A request id fit to echo back in an error reply, else None."""
    return rid if type(rid) is str and 0 < len(rid) <= DEFAULT_LIMITS.max_id_chars else None


def _bad(msg: dict, text: str) -> ProtocolError:
    return ProtocolError(Code.INVALID_FIELD, text, _usable_id(msg.get("request_id")))


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_num(v: Any) -> bool:
    return (type(v) is int or type(v) is float) and math.isfinite(v)


def _check_str(msg: dict, name: str, max_len: int, required: bool = True,
               nullable: bool = False, empty_ok: bool = False) -> None:
    if name not in msg:
        if required:
            raise _bad(msg, f"{name} is required")
        return
    v = msg[name]
    if v is None and nullable:
        return
    if type(v) is not str:
        raise _bad(msg, f"{name} must be a string, got {type(v).__name__}")
    if len(v) > max_len or (not v and not empty_ok):
        raise _bad(msg, f"{name} must be 1..{max_len} characters" if not empty_ok
                   else f"{name} must be at most {max_len} characters")


def _check_int(msg: dict, name: str, lo: int, hi: int, required: bool = True,
               nullable: bool = False) -> None:
    if name not in msg:
        if required:
            raise _bad(msg, f"{name} is required")
        return
    v = msg[name]
    if v is None and nullable:
        return
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(msg, f"{name} must be an int in [{lo}, {hi}], got {v!r}"[:200])


def _check_bool(msg: dict, name: str, required: bool = False) -> None:
    if name not in msg:
        if required:
            raise _bad(msg, f"{name} is required")
        return
    if type(msg[name]) is not bool:
        raise _bad(msg, f"{name} must be a bool")


def _check_ids(msg: dict, name: str, max_len: int, required: bool = True, min_len: int = 0) -> None:
    if name not in msg:
        if required:
            raise _bad(msg, f"{name} is required")
        return
    ids = msg[name]
    if type(ids) is not list:
        raise _bad(msg, f"{name} must be a list of ints")
    if not min_len <= len(ids) <= max_len:
        raise _bad(msg, f"{name} must hold {min_len}..{max_len} token ids, got {len(ids)}")
    for t in ids:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise _bad(msg, f"{name} must hold ints in [0, {MAX_TOKEN_ID}]")


def _check_fields(msg: dict, allowed: frozenset) -> None:
    extra = msg.keys() - allowed
    if extra:
        names = sorted(str(k) for k in extra)[:8]
        raise _bad(msg, f"unknown field(s) {names} for kind {msg['kind']!r}")


def _fields(*names: str) -> frozenset:
    return frozenset(("v", "kind") + names)


# -------------------------------------------------------- sampling params
def _num_range(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: _is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi


# Field names and ranges follow turbomq.worker.sampling.SamplingParams; a test
# keeps the two in step. The worker re-validates with its vocabulary size.
SAMPLING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_tokens": (lambda v: _is_int(v) and 1 <= v <= DEFAULT_LIMITS.max_new_tokens,
                   "an int in [1, max_new_tokens]"),
    "temperature": (_num_range(0.0, 1e6), "a finite number >= 0"),
    "top_p": (_num_range(0.0, 1.0, lo_open=True), "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and -1 <= v <= MAX_TOKEN_ID, "an int >= -1"),
    "min_p": (_num_range(0.0, 1.0), "a number in [0, 1]"),
    "repetition_penalty": (_num_range(0.0, 1e6, lo_open=True), "a finite number > 0"),
    "seed": (lambda v: v is None or (_is_int(v) and -(1 << 63) <= v < (1 << 64)), "an int or nil"),
    "stop": (None, "a string or a list of non-empty strings"),  # checked with limits below
    "stop_token_ids": (None, "a list of token ids"),
    "ignore_eos": (lambda v: type(v) is bool, "a bool"),
    "skip_special_tokens": (lambda v: type(v) is bool, "a bool"),
}
SAMPLING_FIELDS = frozenset(SAMPLING_CHECKS)


def _check_params(msg: dict, limits: Limits) -> None:
    if "params" not in msg:
        return
    params = msg["params"]
    if type(params) is not dict:
        raise _bad(msg, "params must be a map of sampling fields")
    for name, value in params.items():
        check = SAMPLING_CHECKS.get(name)
        if check is None:
            raise _bad(msg, f"unknown sampling field {str(name)[:64]!r}; allowed: {sorted(SAMPLING_FIELDS)}")
        ok, want = check
        if name == "stop":
            stops = [value] if type(value) is str else value
            good = (type(stops) is list and len(stops) <= limits.max_stop_strings
                    and all(type(s) is str and 0 < len(s) <= limits.max_stop_chars for s in stops))
            if not good:
                raise _bad(msg, f"params.stop must be {want}: at most {limits.max_stop_strings} "
                                f"strings of 1..{limits.max_stop_chars} characters")
        elif name == "stop_token_ids":
            good = (type(value) is list and len(value) <= limits.max_stop_token_ids
                    and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value))
            if not good:
                raise _bad(msg, f"params.stop_token_ids must be {want} (at most "
                                f"{limits.max_stop_token_ids})")
        elif name == "max_tokens":
            if not (_is_int(value) and 1 <= value <= limits.max_new_tokens):
                raise _bad(msg, f"params.max_tokens must be an int in [1, {limits.max_new_tokens}]")
        elif not ok(value):
            raise _bad(msg, f"params.{name} must be {want}, got {value!r}"[:200])


def _check_prompt(msg: dict, limits: Limits) -> None:
    has_prompt, has_ids = msg.get("prompt") is not None, msg.get("input_ids") is not None
    if has_prompt == has_ids:
        raise _bad(msg, "give exactly one of prompt or input_ids")
    if has_prompt:
        _check_str(msg, "prompt", limits.max_prompt_chars)
    else:
        _check_ids(msg, "input_ids", limits.max_prompt_tokens, min_len=1)


def _check_timeout(msg: dict, limits: Limits) -> None:
    t = msg.get("timeout")
    if t is not None and not (_is_num(t) and 0 < t <= limits.max_timeout_s):
        raise _bad(msg, f"timeout must be a number of seconds in (0, {limits.max_timeout_s}] or nil")


def _check_usage(msg: dict) -> None:
    usage = msg.get("usage")
    if type(usage) is not dict or usage.keys() != {"prompt_tokens", "cached_tokens", "completion_tokens"}:
        raise _bad(msg, "usage must be a map of prompt_tokens, cached_tokens, completion_tokens")
    for v in usage.values():
        if type(v) is not int or not 0 <= v <= MAX_TOKEN_ID:
            raise _bad(msg, "usage counts must be ints >= 0")


def _check_error_fields(msg: dict, limits: Limits) -> None:
    _check_str(msg, "request_id", limits.max_id_chars, nullable=True)
    _check_str(msg, "code", 64)
    _check_str(msg, "message", limits.max_message_chars, empty_ok=True)
    _check_bool(msg, "retryable", required=True)


# ---------------------------------------------------------- client -> broker
_GENERATE = _fields("request_id", "prompt", "input_ids", "session_id", "params", "stream", "timeout")


def _generate_ok(msg: dict, limits: Limits) -> bool:
    """The common well-formed generate, checked inline; False sends it through
    the field-by-field checks (which name what is wrong, or accept it)."""
    if not msg.keys() <= _GENERATE:
        return False
    rid = msg.get("request_id")
    if type(rid) is not str or not 0 < len(rid) <= limits.max_id_chars:
        return False
    prompt, ids = msg.get("prompt"), msg.get("input_ids")
    if prompt is None:
        if type(ids) is not list or not 0 < len(ids) <= limits.max_prompt_tokens:
            return False
        for t in ids:
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                return False
    elif ids is not None or type(prompt) is not str or not 0 < len(prompt) <= limits.max_prompt_chars:
        return False
    sid = msg.get("session_id")
    if sid is not None and (type(sid) is not str or not 0 < len(sid) <= limits.max_id_chars):
        return False
    if "stream" in msg and type(msg["stream"]) is not bool:
        return False
    t = msg.get("timeout")
    if t is not None and not (_is_num(t) and 0 < t <= limits.max_timeout_s):
        return False
    if "params" in msg:
        params = msg["params"]
        if type(params) is not dict:
            return False
        if len(params) == 1 and "max_tokens" in params:  # the usual one
            m = params["max_tokens"]
            return type(m) is int and 1 <= m <= limits.max_new_tokens
        if params:
            _check_params(msg, limits)  # raises just as the full path would here
    return True


def _c_generate(msg: dict, limits: Limits) -> None:
    if _generate_ok(msg, limits):
        return
    _check_fields(msg, _GENERATE)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_prompt(msg, limits)
    _check_str(msg, "session_id", limits.max_id_chars, required=False, nullable=True)
    _check_params(msg, limits)
    _check_bool(msg, "stream")
    _check_timeout(msg, limits)


def _c_request_id_only(allowed: frozenset) -> Callable[[dict, Limits], None]:
    def check(msg: dict, limits: Limits) -> None:
        _check_fields(msg, allowed)
        _check_str(msg, "request_id", limits.max_id_chars)
    return check


_END_SESSION = _fields("request_id", "session_id")


def _c_end_session(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _END_SESSION)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_str(msg, "session_id", limits.max_id_chars)


def _c_ping(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _fields())


CLIENT_REQUEST_CHECKS = {
    Kind.GENERATE: _c_generate,
    Kind.CANCEL: _c_request_id_only(_fields("request_id")),
    Kind.END_SESSION: _c_end_session,
    Kind.HEALTH: _c_request_id_only(_fields("request_id")),
    Kind.STATS: _c_request_id_only(_fields("request_id")),
    Kind.PING: _c_ping,
}


# ---------------------------------------------------------- broker -> client
_DELTA_C = _fields("request_id", "seq", "index", "token_ids", "text")
_FINAL_C = _fields("request_id", "seq", "finish_reason", "usage", "token_ids", "text")
_ERROR = _fields("request_id", "code", "message", "retryable", "attempt")


def _r_delta(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _DELTA_C)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_int(msg, "seq", 0, MAX_TOKEN_ID)
    _check_int(msg, "index", 0, MAX_TOKEN_ID)
    _check_ids(msg, "token_ids", limits.max_delta_tokens)
    _check_str(msg, "text", limits.max_text_chars, empty_ok=True)


def _check_final_common(msg: dict, limits: Limits) -> None:
    _check_str(msg, "request_id", limits.max_id_chars)
    reason = msg.get("finish_reason")
    if type(reason) is not str or reason not in FINISH_REASONS:
        raise _bad(msg, f"finish_reason must be one of {sorted(FINISH_REASONS)}")
    _check_usage(msg)
    _check_ids(msg, "token_ids", limits.max_delta_tokens)
    _check_str(msg, "text", limits.max_text_chars, empty_ok=True)


def _r_final(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _FINAL_C)
    _check_final_common(msg, limits)
    _check_int(msg, "seq", 0, MAX_TOKEN_ID)


def _r_error(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _ERROR)
    _check_error_fields(msg, limits)


_HEALTH_R = _fields("request_id", "status", "workers", "queue_depth", "inflight")


def _r_health(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _HEALTH_R)
    _check_str(msg, "request_id", limits.max_id_chars)
    if msg.get("status") not in ("ok", "degraded"):
        raise _bad(msg, "status must be 'ok' or 'degraded'")
    for name in ("workers", "queue_depth", "inflight"):
        _check_int(msg, name, 0, MAX_TOKEN_ID)


def _r_stats(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _fields("request_id", "stats"))
    _check_str(msg, "request_id", limits.max_id_chars)
    if type(msg.get("stats")) is not dict:
        raise _bad(msg, "stats must be a map")


def _r_session_ended(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _END_SESSION)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_str(msg, "session_id", limits.max_id_chars)


CLIENT_REPLY_CHECKS = {
    Kind.DELTA: _r_delta,
    Kind.FINAL: _r_final,
    Kind.ERROR: _r_error,
    Kind.HEALTH: _r_health,
    Kind.STATS: _r_stats,
    Kind.SESSION_ENDED: _r_session_ended,
}


# ---------------------------------------------------------- worker -> broker
_REGISTER = _fields("worker_id", "model", "slots", "kv_blocks", "metrics_port")
_HEARTBEAT_W = _fields("free_slots", "free_kv_blocks", "queue_len", "sessions_reset",
                       "sessions_added", "sessions_removed")
_DELTA_W = _fields("request_id", "attempt", "index", "token_ids", "text")
_FINAL_W = _fields("request_id", "attempt", "finish_reason", "usage", "token_ids", "text")


def _w_register(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _REGISTER)
    _check_str(msg, "worker_id", limits.max_id_chars)
    _check_str(msg, "model", limits.max_id_chars * 4)
    _check_int(msg, "slots", 1, 1 << 20)
    _check_int(msg, "kv_blocks", 0, MAX_TOKEN_ID)
    _check_int(msg, "metrics_port", 0, 65535, required=False, nullable=True)


def _check_sessions(msg: dict, name: str, limits: Limits) -> None:
    if name not in msg:
        return
    v = msg[name]
    if type(v) is not list or len(v) > limits.max_heartbeat_sessions:
        raise _bad(msg, f"{name} must be a list of at most {limits.max_heartbeat_sessions} session ids")
    for s in v:
        if type(s) is not str or not 0 < len(s) <= limits.max_id_chars:
            raise _bad(msg, f"{name} must hold session id strings")


def _w_heartbeat(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _HEARTBEAT_W)
    _check_int(msg, "free_slots", 0, 1 << 20)
    _check_int(msg, "free_kv_blocks", 0, MAX_TOKEN_ID)
    _check_int(msg, "queue_len", 0, MAX_TOKEN_ID)
    _check_bool(msg, "sessions_reset")
    _check_sessions(msg, "sessions_added", limits)
    _check_sessions(msg, "sessions_removed", limits)


def _plain_ids(ids: Any, max_len: int) -> bool:
    if type(ids) is not list or len(ids) > max_len:
        return False
    for t in ids:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            return False
    return True


def _w_delta_ok(msg: dict, limits: Limits) -> bool:
    """The common well-formed worker delta, checked inline. Seven keys with
    all five fields present leaves no room for an unknown one."""
    rid, attempt, index, text = (msg.get("request_id"), msg.get("attempt"), msg.get("index"),
                                 msg.get("text"))
    return (len(msg) == 7 and type(rid) is str and 0 < len(rid) <= limits.max_id_chars
            and type(attempt) is int and 0 <= attempt <= MAX_TOKEN_ID
            and type(index) is int and 0 <= index <= MAX_TOKEN_ID
            and type(text) is str and len(text) <= limits.max_text_chars
            and _plain_ids(msg.get("token_ids"), limits.max_delta_tokens))


def _w_delta(msg: dict, limits: Limits) -> None:
    # The field-by-field checks only run to name what is wrong.
    if _w_delta_ok(msg, limits):
        return
    _check_fields(msg, _DELTA_W)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_int(msg, "attempt", 0, MAX_TOKEN_ID)
    _check_int(msg, "index", 0, MAX_TOKEN_ID)
    _check_ids(msg, "token_ids", limits.max_delta_tokens)
    _check_str(msg, "text", limits.max_text_chars, empty_ok=True)


_USAGE_KEYS = frozenset(("prompt_tokens", "cached_tokens", "completion_tokens"))


def _w_final_ok(msg: dict, limits: Limits) -> bool:
    """As _w_delta_ok: eight keys with all six required fields present."""
    rid, attempt, reason, usage, text = (msg.get("request_id"), msg.get("attempt"),
                                         msg.get("finish_reason"), msg.get("usage"),
                                         msg.get("text"))
    return (len(msg) == 8 and type(rid) is str and 0 < len(rid) <= limits.max_id_chars
            and type(attempt) is int and 0 <= attempt <= MAX_TOKEN_ID
            and type(reason) is str and reason in FINISH_REASONS
            and type(text) is str and len(text) <= limits.max_text_chars
            and type(usage) is dict and usage.keys() == _USAGE_KEYS
            and _plain_ids(list(usage.values()), 3)
            and _plain_ids(msg.get("token_ids"), limits.max_delta_tokens))


def _w_final(msg: dict, limits: Limits) -> None:
    if _w_final_ok(msg, limits):
        return
    _check_fields(msg, _FINAL_W)
    _check_final_common(msg, limits)
    _check_int(msg, "attempt", 0, MAX_TOKEN_ID)


def _w_error(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _ERROR)
    _check_error_fields(msg, limits)
    _check_int(msg, "attempt", 0, MAX_TOKEN_ID, required=False)


WORKER_MESSAGE_CHECKS = {
    Kind.REGISTER: _w_register,
    Kind.HEARTBEAT: _w_heartbeat,
    Kind.DELTA: _w_delta,
    Kind.FINAL: _w_final,
    Kind.ERROR: _w_error,
    Kind.SESSION_ENDED: _r_session_ended,
}


# ---------------------------------------------------------- broker -> worker
_DISPATCH = _fields("request_id", "attempt", "prompt", "input_ids", "session_id", "params",
                    "resume_tokens", "resume_text", "timeout")


def _b_registered(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _fields("heartbeat_interval", "liveness"))
    hb = msg.get("heartbeat_interval")
    if not (_is_num(hb) and 0 < hb <= 3600):
        raise _bad(msg, "heartbeat_interval must be seconds in (0, 3600]")
    _check_int(msg, "liveness", 1, 1000)


def _b_dispatch(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _DISPATCH)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_int(msg, "attempt", 0, MAX_TOKEN_ID)
    _check_prompt(msg, limits)
    _check_str(msg, "session_id", limits.max_id_chars, required=False, nullable=True)
    _check_params(msg, limits)
    _check_ids(msg, "resume_tokens", limits.max_new_tokens)
    _check_str(msg, "resume_text", limits.max_text_chars, empty_ok=True)
    _check_timeout(msg, limits)


def _b_cancel(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _fields("request_id", "attempt"))
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_int(msg, "attempt", 0, MAX_TOKEN_ID)


def _b_empty(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _fields())


BROKER_COMMAND_CHECKS = {
    Kind.REGISTERED: _b_registered,
    Kind.HEARTBEAT: _b_empty,
    Kind.DISPATCH: _b_dispatch,
    Kind.CANCEL: _b_cancel,
    Kind.END_SESSION: _c_end_session,
    Kind.RECONNECT: _b_empty,
}


# ----------------------------------------------------------------- decoders
def _decode(frame: bytes, checks: dict, limits: Limits) -> dict:
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


# ----------------------------------------------------------------- builders
# Plain dicts (what msgpack packs). Each builder writes exactly the fields of
# its kind; optional fields left as None are omitted.
def _msg(kind: str, **fields: Any) -> dict:
    msg = {"v": PROTOCOL_VERSION, "kind": kind}
    for k, val in fields.items():
        if val is not None:
            msg[k] = val
    return msg


def generate(request_id: str, prompt: Optional[str] = None, input_ids: Optional[list] = None,
             session_id: Optional[str] = None, params: Optional[dict] = None,
             stream: bool = False, timeout: Optional[float] = None) -> dict:
    return _msg(Kind.GENERATE, request_id=request_id, prompt=prompt, input_ids=input_ids,
                session_id=session_id, params=params or {}, stream=stream, timeout=timeout)


def cancel(request_id: str, attempt: Optional[int] = None) -> dict:
    return _msg(Kind.CANCEL, request_id=request_id, attempt=attempt)


def end_session(request_id: str, session_id: str) -> dict:
    return _msg(Kind.END_SESSION, request_id=request_id, session_id=session_id)


def health(request_id: str) -> dict:
    return _msg(Kind.HEALTH, request_id=request_id)


def stats(request_id: str) -> dict:
    return _msg(Kind.STATS, request_id=request_id)


def ping() -> dict:
    return _msg(Kind.PING)


def delta(request_id: str, seq: int, index: int, token_ids: list, text: str) -> dict:
    return {"v": PROTOCOL_VERSION, "kind": Kind.DELTA, "request_id": request_id, "seq": seq,
            "index": index, "token_ids": token_ids, "text": text}


def final(request_id: str, seq: int, finish_reason: str, usage: dict, token_ids: list,
          text: str) -> dict:
    return {"v": PROTOCOL_VERSION, "kind": Kind.FINAL, "request_id": request_id, "seq": seq,
            "finish_reason": finish_reason, "usage": usage, "token_ids": token_ids, "text": text}


def error(request_id: Optional[str], code: str, message: str,
          retryable: Optional[bool] = None, attempt: Optional[int] = None) -> dict:
    msg = {"v": PROTOCOL_VERSION, "kind": Kind.ERROR, "request_id": request_id, "code": code,
           "message": message[:DEFAULT_LIMITS.max_message_chars],
           "retryable": code in RETRYABLE_CODES if retryable is None else retryable}
    if attempt is not None:
        msg["attempt"] = attempt
    return msg


def health_reply(request_id: str, status: str, workers: int, queue_depth: int, inflight: int) -> dict:
    return _msg(Kind.HEALTH, request_id=request_id, status=status, workers=workers,
                queue_depth=queue_depth, inflight=inflight)


def stats_reply(request_id: str, stats_map: dict) -> dict:
    return _msg(Kind.STATS, request_id=request_id, stats=stats_map)


def session_ended(request_id: str, session_id: str) -> dict:
    return _msg(Kind.SESSION_ENDED, request_id=request_id, session_id=session_id)


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "completion_tokens": completion_tokens}


# worker side
def register(worker_id: str, model: str, slots: int, kv_blocks: int,
             metrics_port: Optional[int] = None) -> dict:
    return _msg(Kind.REGISTER, worker_id=worker_id, model=model, slots=slots, kv_blocks=kv_blocks,
                metrics_port=metrics_port)


def heartbeat(free_slots: Optional[int] = None, free_kv_blocks: Optional[int] = None,
              queue_len: Optional[int] = None, sessions_reset: Optional[bool] = None,
              sessions_added: Optional[list] = None, sessions_removed: Optional[list] = None) -> dict:
    """Worker -> broker with the load fields; broker -> worker with none."""
    return _msg(Kind.HEARTBEAT, free_slots=free_slots, free_kv_blocks=free_kv_blocks,
                queue_len=queue_len, sessions_reset=sessions_reset,
                sessions_added=sessions_added, sessions_removed=sessions_removed)


def worker_delta(request_id: str, attempt: int, index: int, token_ids: list, text: str) -> dict:
    return {"v": PROTOCOL_VERSION, "kind": Kind.DELTA, "request_id": request_id,
            "attempt": attempt, "index": index, "token_ids": token_ids, "text": text}


def worker_final(request_id: str, attempt: int, finish_reason: str, usage_map: dict,
                 token_ids: list, text: str) -> dict:
    return {"v": PROTOCOL_VERSION, "kind": Kind.FINAL, "request_id": request_id,
            "attempt": attempt, "finish_reason": finish_reason, "usage": usage_map,
            "token_ids": token_ids, "text": text}


def registered(heartbeat_interval: float, liveness: int) -> dict:
    return _msg(Kind.REGISTERED, heartbeat_interval=heartbeat_interval, liveness=liveness)


def dispatch(request_id: str, attempt: int, prompt: Optional[str], input_ids: Optional[list],
             session_id: Optional[str], params: dict, resume_tokens: list, resume_text: str,
             timeout: Optional[float] = None) -> dict:
    return _msg(Kind.DISPATCH, request_id=request_id, attempt=attempt, prompt=prompt,
                input_ids=input_ids, session_id=session_id, params=params,
                resume_tokens=resume_tokens, resume_text=resume_text, timeout=timeout)


def reconnect() -> dict:
    return _msg(Kind.RECONNECT)
