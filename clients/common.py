"""What the sync and async clients share: building requests, reading replies."""

from __future__ import annotations

import uuid
from typing import Any, Optional, Sequence, Union

import zmq

from . import protocol as P
from .errors import InvalidRequest, ServerError, TurbomqError, error_for, from_reply
from .resume import SEND_TIMEOUT_S
from .types import Delta, Final, Result, Usage

PromptLike = Union[str, Sequence[int], None]


def connect_dealer(ctx, endpoint: str, curve) -> "zmq.Socket":
    """The client's socket to a broker: no linger, sends that no broker takes
    within SEND_TIMEOUT_S dropped (the resend after failover carries them),
    CurveZMQ keys when given."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
    if curve is not None:
        curve.apply(sock)
    sock.connect(endpoint)
    return sock


def new_id() -> str:
    return uuid.uuid4().hex


def sampling_params(max_tokens: int, temperature: float, top_p: float, top_k: int,
                    stop: Any, seed: Optional[int], extra: dict) -> dict:
    params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
              "top_k": top_k, **extra}
    if stop is not None:
        params["stop"] = list(stop) if isinstance(stop, tuple) else stop
    if seed is not None:
        params["seed"] = seed
    return params


def split_prompt(prompt: PromptLike, input_ids: Optional[Sequence[int]]) -> tuple:
    """`prompt` may be text or, for convenience, a list of token ids."""
    if prompt is not None and not isinstance(prompt, str):
        if input_ids is not None:
            raise InvalidRequest(P.Code.INVALID_FIELD, "give exactly one of prompt or input_ids")
        prompt, input_ids = None, prompt
    if input_ids is not None:
        input_ids = [int(t) if not isinstance(t, bool) else t for t in input_ids]
    return prompt, input_ids


def generate_message(prompt: PromptLike, input_ids: Optional[Sequence[int]],
                     session_id: Optional[str], sampling: dict, stream: bool, timeout: float,
                     request_id: Optional[str], limits: P.Limits,
                     messages: Optional[Sequence[dict]] = None) -> dict:
    """A checked `generate` message: the part the sync and async clients share."""
    prompt, input_ids = split_prompt(prompt, input_ids)
    msg = P.generate(request_id or new_id(), prompt, input_ids, session_id, sampling, stream,
                     timeout, messages=list(messages) if messages is not None else None)
    encode_checked(msg, limits)
    return msg


def encode_checked(msg: dict, limits: P.Limits) -> bytes:
    """Pack and run the broker's own decoder on it, so a bad request fails
    here with the same message the broker would send."""
    frame = P.pack(msg)
    try:
        P.decode_client_request(frame, limits)
    except P.ProtocolError as e:
        raise error_for(e.code, e.message, False, msg.get("request_id")) from None
    return frame


def decode_reply(frame: bytes, limits: P.Limits) -> dict:
    try:
        return P.decode_client_reply(frame, limits)
    except P.ProtocolError as e:
        raise ServerError(e.code, f"unreadable reply from the broker: {e.message}") from None


def to_event(msg: dict) -> Union[Delta, Final]:
    """A reply to a streaming generate as an event; errors raise."""
    kind = msg["kind"]
    if kind == P.Kind.DELTA:
        return Delta(msg["request_id"], msg["seq"], msg["index"], msg["token_ids"], msg["text"])
    if kind == P.Kind.FINAL:
        return Final(msg["request_id"], msg["finish_reason"], Usage.from_wire(msg["usage"]))
    raise reply_error(msg)


def to_result(msg: dict) -> Result:
    if msg["kind"] != P.Kind.FINAL:
        raise reply_error(msg)
    return Result(msg["request_id"], msg["token_ids"], msg["text"], msg["finish_reason"],
                  Usage.from_wire(msg["usage"]))


def reply_error(msg: dict) -> TurbomqError:
    if msg["kind"] == P.Kind.ERROR:
        return from_reply(msg)
    return ServerError(P.Code.BAD_FRAME, f"unexpected {msg['kind']!r} reply")
