"""The OpenAI API's side of the gateway, without any HTTP: request bodies
checked and turned into a `generate` call of the client library, replies and
stream chunks built from its events, and errors mapped to OpenAI error
objects with their HTTP status. Plain Python (no Starlette), so it is tested
on its own and the app stays a thin shell (docs/gateway.md)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import protocol as P
from ..errors import TurbomqError
from ..types import Usage


class ApiError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


# The service's error codes as HTTP statuses and OpenAI error types.
_STATUS = {
    P.Code.OVERLOADED: (429, "overloaded_error"),
    P.Code.RATE_LIMITED: (429, "rate_limit_error"),
    P.Code.NO_WORKERS: (503, "service_unavailable_error"),
    P.Code.WORKER_LOST: (503, "service_unavailable_error"),
    P.Code.SESSION_STORE_UNAVAILABLE: (503, "service_unavailable_error"),
    P.Code.TIMEOUT: (504, "timeout_error"),
    P.Code.SESSION_BUSY: (409, "conflict_error"),
    P.Code.UNKNOWN_SESSION: (404, "not_found_error"),
    P.Code.PROMPT_TOO_LONG: (400, "invalid_request_error"),
    P.Code.INTERNAL: (500, "server_error"),
}
_CLIENT_CODES = {P.Code.BAD_FRAME, P.Code.BAD_VERSION, P.Code.UNKNOWN_KIND, P.Code.INVALID_FIELD,
                 P.Code.FRAME_TOO_LARGE, P.Code.DUPLICATE_REQUEST, P.Code.INVALID_REQUEST,
                 P.Code.INVALID_PARAMS}


def from_service(e: TurbomqError) -> ApiError:
    """A client-library error as the OpenAI error the HTTP client gets."""
    if e.code in _CLIENT_CODES:
        return ApiError(400, e.message, "invalid_request_error", e.code)
    status, type_ = _STATUS.get(e.code, (500, "server_error"))
    code = "context_length_exceeded" if e.code == P.Code.PROMPT_TOO_LONG else e.code
    return ApiError(status, e.message, type_, code)


# ------------------------------------------------------------- requests
# Fields a body may carry: the OpenAI API's (those the engine cannot honour are
# refused below, by value), then turbomq's own (sent with `extra_body`).
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
           "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user",
           "metadata", "store", "service_tier"}
_COMPLETIONS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                   "parallel_tool_calls", "functions", "function_call", "response_format",
                   "modalities", "audio", "prediction", "reasoning_effort", "web_search_options"}
# turbomq's extensions: the engine's other sampling parameters, a session to
# keep KV resident across turns, and the request's deadline in seconds.
_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos",
               "skip_special_tokens", "session_id", "timeout"}
# Accepted and ignored: they change nothing the engine does.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}


@dataclass
class Call:
    """One checked request: what to pass to AsyncClient.generate, and how to answer."""
    chat: bool
    model: str
    stream: bool
    include_usage: bool
    inputs: dict  # prompt= | input_ids= | messages=
    params: dict  # sampling params and session_id, timeout
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    @property
    def session_id(self) -> Optional[str]:
        return self.params.get("session_id")


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < lo or v > hi or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise invalid(f"'{name}' must be a number in {bound}, got {v!r}", name)
    return v


def _int(body: dict, name: str, lo: int, hi: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise invalid(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def _unsupported(name: str, what: str) -> ApiError:
    return invalid(f"'{name}' is not supported: {what}", name, "unsupported_parameter")


def _check_common(body: dict, allowed: set, limits: P.Limits) -> dict:
    unknown = sorted(set(body) - allowed - _EXTENSIONS)
    if unknown:
        raise invalid(f"unknown parameter(s): {', '.join(unknown)}", unknown[0],
                      "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required", "model", "missing_required_parameter")
    n = _int(body, "n", 1, 1 << 30)
    if n not in (None, 1):
        raise _unsupported("n", "one choice per request (n=1)")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, -2.0, 2.0) not in (None, 0):
            raise _unsupported(name, "the engine has no presence or frequency penalty; "
                                     "'repetition_penalty' (extra_body) is its form")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "the engine has no logit bias")
    if body.get("logprobs") not in (None, False, 0):
        raise _unsupported("logprobs", "the engine does not return log probabilities")
    params: dict = {}
    for name, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                                  ("min_p", 0.0, 1.0, False),
                                  ("repetition_penalty", 0.0, float("inf"), True)):
        v = _number(body, name, lo, hi, lo_open)
        if v is not None:
            params[name] = float(v)
    for name, lo, hi in (("seed", -(1 << 63), (1 << 63) - 1), ("top_k", -1, 1 << 31)):
        v = _int(body, name, lo, hi)
        if v is not None:
            params[name] = v
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)) \
                or len(stop) > limits.max_stop_strings:
            raise invalid(f"'stop' must be a string or up to {limits.max_stop_strings} "
                          "non-empty strings", "stop")
        if stop:
            params["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
            raise invalid("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        params["stop_token_ids"] = ids
    for name in ("ignore_eos", "skip_special_tokens"):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, bool):
                raise invalid(f"'{name}' must be a boolean", name)
            params[name] = v
    sid = body.get("session_id")
    if sid is not None:
        if not isinstance(sid, str) or not 0 < len(sid) <= limits.max_id_chars:
            raise invalid(f"'session_id' must be a string of 1..{limits.max_id_chars} "
                          "characters", "session_id")
        params["session_id"] = sid
    timeout = _number(body, "timeout", 0.0, limits.max_timeout_s, lo_open=True)
    if timeout is not None:
        params["timeout"] = float(timeout)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("'stream_options' may hold only 'include_usage'", "stream_options")
        if not stream:
            raise invalid("'stream_options' is only allowed with 'stream': true",
                          "stream_options")
        include_usage = bool(options.get("include_usage"))
    return {"model": model, "stream": stream, "include_usage": include_usage, "params": params}


def _max_tokens(body: dict, names: tuple, limits: P.Limits, params: dict) -> None:
    for name in names:
        v = _int(body, name, 1, limits.max_new_tokens)
        if v is not None:
            params["max_tokens"] = v
            return
    # OpenAI's default: as many as the context allows (the engine stops there).
    params["max_tokens"] = limits.max_new_tokens


def parse_completion(body: Any, limits: P.Limits = P.DEFAULT_LIMITS) -> Call:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    c = _check_common(body, _COMPLETIONS, limits)
    if body.get("echo"):
        raise _unsupported("echo", "the prompt is not echoed")
    if body.get("suffix"):
        raise _unsupported("suffix", "no insertion")
    if body.get("best_of") not in (None, 1):
        raise _unsupported("best_of", "one sequence per request")
    _max_tokens(body, ("max_tokens",), limits, c["params"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        inputs = {"prompt": prompt}
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        inputs = {"input_ids": prompt}
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _unsupported("prompt", "one prompt per request (send a batch as several)")
    else:
        raise invalid("'prompt' must be a string or a list of token ids", "prompt")
    return Call(False, c["model"], c["stream"], c["include_usage"], inputs, c["params"])


def _content(m: dict, i: int) -> str:
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _unsupported(f"messages[{i}].content", "only text content parts")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"'messages[{i}].content' must be a string or a list of text parts",
                  f"messages[{i}].content")


def parse_chat(body: Any, limits: P.Limits = P.DEFAULT_LIMITS) -> Call:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    c = _check_common(body, _CHAT, limits)
    for name in ("tools", "functions"):
        if body.get(name):
            raise _unsupported(name, "no tool calling")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise _unsupported(name, "no tool calling")
    if body.get("top_logprobs") not in (None, 0):
        raise _unsupported("top_logprobs", "the engine does not return log probabilities")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _unsupported("response_format", "plain text only")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
        if body.get(name) is not None:
            raise _unsupported(name, "not offered by this model server")
    if body.get("modalities") not in (None, ["text"]):
        raise _unsupported("modalities", "text only")
    _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits, c["params"])
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("'messages' must be a non-empty list", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"'messages[{i}]' must be an object with a 'role'", f"messages[{i}]")
        if m.get("tool_calls") or m["role"] in ("tool", "function"):
            raise _unsupported(f"messages[{i}]", "no tool calling")
        role = "system" if m["role"] == "developer" else m["role"]
        messages.append({"role": role, "content": _content(m, i)})
    if c["params"].get("session_id") is not None:
        # The session holds the conversation so far: a client that sends the
        # whole history each turn (as OpenAI clients do) sends the part after
        # the last assistant message as this turn's new messages.
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        messages = messages[last + 1:]
        if not messages:
            raise invalid("a session turn needs a message after the last assistant message",
                          "messages")
    return Call(True, c["model"], c["stream"], c["include_usage"], {"messages": messages},
                c["params"])


# -------------------------------------------------------------- replies
def usage_body(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def finish_reason(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def response(call: Call, text: str, reason: str, usage: Usage) -> dict:
    """The whole (non-streaming) reply."""
    if call.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason(reason)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None,
                  "finish_reason": finish_reason(reason)}
        obj = "text_completion"
    return {"id": call.response_id, "object": obj, "created": call.created, "model": call.model,
            "choices": [choice], "usage": usage_body(usage)}


def chunk(call: Call, text: Optional[str] = None, reason: Optional[str] = None,
          role: bool = False, usage: Optional[Usage] = None) -> dict:
    """One streamed chunk: text, the finish reason, the assistant role (the
    first chat chunk), or only usage (no choices)."""
    if call.chat:
        obj = "chat.completion.chunk"
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None,
                  "finish_reason": reason and finish_reason(reason)}
    else:
        obj = "text_completion"
        choice = {"index": 0, "text": text or "", "logprobs": None,
                  "finish_reason": reason and finish_reason(reason)}
    out = {"id": call.response_id, "object": obj, "created": call.created, "model": call.model,
           "choices": [] if usage is not None else [choice]}
    if usage is not None:
        out["usage"] = usage_body(usage)
    elif call.include_usage:
        out["usage"] = None
    return out


def models_body(names: list, created: int) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created,
                                        "owned_by": "turbomq"} for n in names]}
