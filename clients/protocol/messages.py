"""The message builders: one function per kind and direction, returning the
plain dict that `pack` sends. Each writes exactly the fields of its kind;
optional fields left as None are omitted."""

from __future__ import annotations

from typing import Any, Optional

from .schema import DEFAULT_LIMITS, PROTOCOL_VERSION, RETRYABLE_CODES, Kind


def _msg(kind: str, **fields: Any) -> dict:
    msg = {"v": PROTOCOL_VERSION, "kind": kind}
    for k, val in fields.items():
        if val is not None:
            msg[k] = val
    return msg


# client -> broker
def generate(request_id: str, prompt: Optional[str] = None, input_ids: Optional[list] = None,
             session_id: Optional[str] = None, params: Optional[dict] = None,
             stream: bool = False, timeout: Optional[float] = None,
             resume_tokens: Optional[list] = None, resume_text: Optional[str] = None,
             messages: Optional[list] = None) -> dict:
    return _msg(Kind.GENERATE, request_id=request_id, prompt=prompt, input_ids=input_ids,
                messages=messages, session_id=session_id, params=params or {}, stream=stream,
                timeout=timeout, resume_tokens=resume_tokens, resume_text=resume_text)


def cancel(request_id: str, attempt: Optional[int] = None) -> dict:
    return _msg(Kind.CANCEL, request_id=request_id, attempt=attempt)


def end_session(request_id: str, session_id: str, tenant: Optional[str] = None) -> dict:
    """Client -> broker without a tenant; broker -> worker with its client's."""
    return _msg(Kind.END_SESSION, request_id=request_id, session_id=session_id, tenant=tenant)


def health(request_id: str) -> dict:
    return _msg(Kind.HEALTH, request_id=request_id)


def stats(request_id: str) -> dict:
    return _msg(Kind.STATS, request_id=request_id)


def ping() -> dict:
    return _msg(Kind.PING)


# broker -> client (error and session_ended: worker -> broker too)
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


def pong(broker_id: str) -> dict:
    return _msg(Kind.PONG, broker_id=broker_id)


def session_ended(request_id: str, session_id: str) -> dict:
    return _msg(Kind.SESSION_ENDED, request_id=request_id, session_id=session_id)


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "completion_tokens": completion_tokens}


# worker <-> broker (cancel and end_session above serve the broker too)
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


def registered(heartbeat_interval: float, liveness: int, broker_id: Optional[str] = None) -> dict:
    return _msg(Kind.REGISTERED, heartbeat_interval=heartbeat_interval, liveness=liveness,
                broker_id=broker_id)


def dispatch(request_id: str, attempt: int, prompt: Optional[str], input_ids: Optional[list],
             session_id: Optional[str], params: dict, resume_tokens: list, resume_text: str,
             timeout: Optional[float] = None, turn_id: Optional[str] = None,
             tenant: Optional[str] = None) -> dict:
    return _msg(Kind.DISPATCH, request_id=request_id, attempt=attempt, prompt=prompt,
                input_ids=input_ids, session_id=session_id, params=params,
                resume_tokens=resume_tokens, resume_text=resume_text, timeout=timeout,
                turn_id=turn_id, tenant=tenant)


def reconnect() -> dict:
    return _msg(Kind.RECONNECT)
