"""How a decoded map is judged: the field checks, and one table per direction
mapping each kind to its check. A check raises `ProtocolError` naming the
first thing wrong, or returns. The `*_ok` predicates are the broker's fast
paths: an inline check of the common well-formed frame (the native data plane
mirrors them; tests/test_broker_data_plane.py compares the verdicts)."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from .schema import (_CANCEL_B, _DELTA_C, _DELTA_W, _DISPATCH, _END_SESSION, _END_SESSION_B, _ERROR, _FINAL_C,
                     _FINAL_W, _GENERATE, _HEALTH_R, _HEARTBEAT_W, _NO_FIELDS, _REGISTER,
                     _PONG_R, _REGISTERED_B, _REQUEST_ID_ONLY, _STATS_R, _USAGE_KEYS, DEFAULT_LIMITS,
                     FINISH_REASONS, MAX_TOKEN_ID, Code, Kind, Limits, ProtocolError)


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


_SKIP = object()  # what _field returns for a field with nothing to check


def _field(msg: dict, name: str, required: bool, nullable: bool = False) -> Any:
    """msg[name], or _SKIP where it is absent and optional, or nil and nullable."""
    if name not in msg:
        if required:
            raise _bad(msg, f"{name} is required")
        return _SKIP
    v = msg[name]
    return _SKIP if v is None and nullable else v


def _check_str(msg: dict, name: str, max_len: int, required: bool = True,
               nullable: bool = False, empty_ok: bool = False) -> None:
    v = _field(msg, name, required, nullable)
    if v is _SKIP:
        return
    if type(v) is not str:
        raise _bad(msg, f"{name} must be a string, got {type(v).__name__}")
    if len(v) > max_len or (not v and not empty_ok):
        raise _bad(msg, f"{name} must be 1..{max_len} characters" if not empty_ok
                   else f"{name} must be at most {max_len} characters")


def _check_int(msg: dict, name: str, lo: int, hi: int, required: bool = True,
               nullable: bool = False) -> None:
    v = _field(msg, name, required, nullable)
    if v is _SKIP:
        return
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(msg, f"{name} must be an int in [{lo}, {hi}], got {v!r}"[:200])


def _check_bool(msg: dict, name: str, required: bool = False) -> None:
    v = _field(msg, name, required)
    if v is not _SKIP and type(v) is not bool:
        raise _bad(msg, f"{name} must be a bool")


def _check_ids(msg: dict, name: str, max_len: int, required: bool = True, min_len: int = 0) -> None:
    ids = _field(msg, name, required)
    if ids is _SKIP:
        return
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


# -------------------------------------------------------- sampling params
def _num_range(lo: float, hi: float, lo_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: _is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi


# Field names and ranges follow turbomq.worker.engine.sampling_params.SamplingParams; a test
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


# ------------------------------------------------- checks shared by kinds
def _check_prompt(msg: dict, limits: Limits) -> None:
    given = [k for k in ("prompt", "input_ids", "messages") if msg.get(k) is not None]
    if len(given) != 1:
        raise _bad(msg, "give exactly one of prompt, input_ids or messages")
    if given[0] == "prompt":
        _check_str(msg, "prompt", limits.max_prompt_chars)
    elif given[0] == "input_ids":
        _check_ids(msg, "input_ids", limits.max_prompt_tokens, min_len=1)
    else:
        _check_messages(msg, limits)


def _check_messages(msg: dict, limits: Limits) -> None:
    """A chat prompt: [{"role": str, "content": str}, ...], rendered by the
    worker with the model's chat template; its text counts against the
    prompt's character limit."""
    messages = msg["messages"]
    if type(messages) is not list or not 0 < len(messages) <= limits.max_messages:
        raise _bad(msg, f"messages must be a list of 1..{limits.max_messages} messages")
    chars = 0
    for m in messages:
        if (type(m) is not dict or m.keys() != {"role", "content"} or type(m["role"]) is not str
                or type(m["content"]) is not str or not 0 < len(m["role"]) <= 32):
            raise _bad(msg, "each message must be {role: str (1..32 characters), content: str}")
        chars += len(m["content"])
    if chars > limits.max_prompt_chars:
        raise _bad(msg, f"messages hold {chars} characters, over {limits.max_prompt_chars}")


def _check_timeout(msg: dict, limits: Limits) -> None:
    t = msg.get("timeout")
    if t is not None and not (_is_num(t) and 0 < t <= limits.max_timeout_s):
        raise _bad(msg, f"timeout must be a number of seconds in (0, {limits.max_timeout_s}] or nil")


def _check_usage(msg: dict) -> None:
    usage = msg.get("usage")
    if type(usage) is not dict or usage.keys() != _USAGE_KEYS:
        raise _bad(msg, "usage must be a map of prompt_tokens, cached_tokens, completion_tokens")
    for v in usage.values():
        if type(v) is not int or not 0 <= v <= MAX_TOKEN_ID:
            raise _bad(msg, "usage counts must be ints >= 0")


def _check_delta(msg: dict, limits: Limits, allowed: frozenset, counter: str) -> None:
    """A delta either way; `counter` is seq (to a client) or attempt (from a worker)."""
    _check_fields(msg, allowed)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_int(msg, counter, 0, MAX_TOKEN_ID)
    _check_int(msg, "index", 0, MAX_TOKEN_ID)
    _check_ids(msg, "token_ids", limits.max_delta_tokens)
    _check_str(msg, "text", limits.max_text_chars, empty_ok=True)


def _check_final(msg: dict, limits: Limits, allowed: frozenset, counter: str) -> None:
    """A final either way, as _check_delta."""
    _check_fields(msg, allowed)
    _check_str(msg, "request_id", limits.max_id_chars)
    reason = msg.get("finish_reason")
    if type(reason) is not str or reason not in FINISH_REASONS:
        raise _bad(msg, f"finish_reason must be one of {sorted(FINISH_REASONS)}")
    _check_usage(msg)
    _check_ids(msg, "token_ids", limits.max_delta_tokens)
    _check_str(msg, "text", limits.max_text_chars, empty_ok=True)
    _check_int(msg, counter, 0, MAX_TOKEN_ID)


def _check_error(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _ERROR)
    _check_str(msg, "request_id", limits.max_id_chars, nullable=True)
    _check_str(msg, "code", 64)
    _check_str(msg, "message", limits.max_message_chars, empty_ok=True)
    _check_bool(msg, "retryable", required=True)


def _b_end_session(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _END_SESSION_B)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_str(msg, "session_id", limits.max_id_chars)
    _check_str(msg, "tenant", limits.max_tenant_chars, required=False, empty_ok=True)


def _end_session(msg: dict, limits: Limits) -> None:
    """end_session and session_ended, in every direction."""
    _check_fields(msg, _END_SESSION)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_str(msg, "session_id", limits.max_id_chars)


def _no_fields(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _NO_FIELDS)


# ---------------------------------------------------------- client -> broker
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
    _check_resume(msg, limits)


def _check_resume(msg: dict, limits: Limits) -> None:
    """resume_tokens: what the client already has of this request's output
    (it continues after them); resume_text: their text, only beside them."""
    _check_ids(msg, "resume_tokens", limits.max_new_tokens, required=False)
    _check_str(msg, "resume_text", limits.max_text_chars, required=False, empty_ok=True)
    if "resume_text" in msg and "resume_tokens" not in msg:
        raise _bad(msg, "resume_text needs resume_tokens")


def _c_request_id_only(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _REQUEST_ID_ONLY)
    _check_str(msg, "request_id", limits.max_id_chars)


CLIENT_REQUEST_CHECKS = {
    Kind.GENERATE: _c_generate,
    Kind.CANCEL: _c_request_id_only,
    Kind.END_SESSION: _end_session,
    Kind.HEALTH: _c_request_id_only,
    Kind.STATS: _c_request_id_only,
    Kind.PING: _no_fields,
}


# ---------------------------------------------------------- broker -> client
def _r_delta(msg: dict, limits: Limits) -> None:
    _check_delta(msg, limits, _DELTA_C, "seq")


def _r_final(msg: dict, limits: Limits) -> None:
    _check_final(msg, limits, _FINAL_C, "seq")


def _r_pong(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _PONG_R)
    _check_str(msg, "broker_id", limits.max_id_chars)


def _r_health(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _HEALTH_R)
    _check_str(msg, "request_id", limits.max_id_chars)
    if msg.get("status") not in ("ok", "degraded"):
        raise _bad(msg, "status must be 'ok' or 'degraded'")
    for name in ("workers", "queue_depth", "inflight"):
        _check_int(msg, name, 0, MAX_TOKEN_ID)


def _r_stats(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _STATS_R)
    _check_str(msg, "request_id", limits.max_id_chars)
    if type(msg.get("stats")) is not dict:
        raise _bad(msg, "stats must be a map")


CLIENT_REPLY_CHECKS = {
    Kind.DELTA: _r_delta,
    Kind.FINAL: _r_final,
    Kind.ERROR: _check_error,
    Kind.HEALTH: _r_health,
    Kind.STATS: _r_stats,
    Kind.SESSION_ENDED: _end_session,
    Kind.PONG: _r_pong,
}


# ---------------------------------------------------------- worker -> broker
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
        # "tenant:session_id" keys: a tenant name, a colon, a session id
        if type(s) is not str or not 0 < len(s) <= limits.max_tenant_chars + 1 + limits.max_id_chars:
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


# A well-formed delta or final passes its fast check; the field-by-field
# checks only run to name what is wrong.
def _w_delta(msg: dict, limits: Limits) -> None:
    if not _w_delta_ok(msg, limits):
        _check_delta(msg, limits, _DELTA_W, "attempt")


def _w_final(msg: dict, limits: Limits) -> None:
    if not _w_final_ok(msg, limits):
        _check_final(msg, limits, _FINAL_W, "attempt")


def _w_error(msg: dict, limits: Limits) -> None:
    _check_error(msg, limits)
    _check_int(msg, "attempt", 0, MAX_TOKEN_ID, required=False)


WORKER_MESSAGE_CHECKS = {
    Kind.REGISTER: _w_register,
    Kind.HEARTBEAT: _w_heartbeat,
    Kind.DELTA: _w_delta,
    Kind.FINAL: _w_final,
    Kind.ERROR: _w_error,
    Kind.SESSION_ENDED: _end_session,
}


# ---------------------------------------------------------- broker -> worker
def _b_registered(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _REGISTERED_B)
    _check_str(msg, "broker_id", limits.max_id_chars, required=False)
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
    _check_str(msg, "turn_id", limits.max_id_chars, required=False)
    _check_str(msg, "tenant", limits.max_tenant_chars, required=False, empty_ok=True)


def _b_cancel(msg: dict, limits: Limits) -> None:
    _check_fields(msg, _CANCEL_B)
    _check_str(msg, "request_id", limits.max_id_chars)
    _check_int(msg, "attempt", 0, MAX_TOKEN_ID)


BROKER_COMMAND_CHECKS = {
    Kind.REGISTERED: _b_registered,
    Kind.HEARTBEAT: _no_fields,
    Kind.DISPATCH: _b_dispatch,
    Kind.CANCEL: _b_cancel,
    Kind.END_SESSION: _b_end_session,
    Kind.RECONNECT: _no_fields,
}
