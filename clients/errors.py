"""Typed exceptions of the client library, one per family of error codes."""

from __future__ import annotations

from typing import Optional

from .protocol import Code


class TurbomqError(Exception):
    """Base class. `code` is the protocol's stable error code; `retryable` says
    whether sending the same request again later may succeed."""

    def __init__(self, code: str, message: str, retryable: bool = False,
                 request_id: Optional[str] = None):
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.retryable = retryable
        self.request_id = request_id


class Overloaded(TurbomqError):
    """Every worker is busy and the broker's queue is full."""


class Unavailable(TurbomqError):
    """No worker can serve now: none connected, one died, or the session store is down."""


class Timeout(TurbomqError):
    """The request's deadline passed (broker-side or waiting for a reply)."""


class InvalidRequest(TurbomqError):
    """The request is malformed or out of bounds; resending it will not help."""


class PromptTooLong(InvalidRequest):
    pass


class UnknownSession(TurbomqError):
    pass


class SessionBusy(TurbomqError):
    """The session already has a request in flight."""


class UnknownRequest(TurbomqError):
    pass


class ServerError(TurbomqError):
    """Anything else: a broker or worker fault, or an unreadable reply."""


_BY_CODE = {
    Code.OVERLOADED: Overloaded,
    Code.RATE_LIMITED: Overloaded,  # this tenant's share, not the service, is full
    Code.NO_WORKERS: Unavailable,
    Code.WORKER_LOST: Unavailable,
    Code.SESSION_STORE_UNAVAILABLE: Unavailable,
    Code.TIMEOUT: Timeout,
    Code.PROMPT_TOO_LONG: PromptTooLong,
    Code.UNKNOWN_SESSION: UnknownSession,
    Code.SESSION_BUSY: SessionBusy,
    Code.UNKNOWN_REQUEST: UnknownRequest,
}
for _code in (Code.BAD_FRAME, Code.BAD_VERSION, Code.UNKNOWN_KIND, Code.INVALID_FIELD,
              Code.FRAME_TOO_LARGE, Code.DUPLICATE_REQUEST, Code.INVALID_REQUEST,
              Code.INVALID_PARAMS):
    _BY_CODE[_code] = InvalidRequest


def error_for(code: str, message: str, retryable: bool = False,
              request_id: Optional[str] = None) -> TurbomqError:
    return _BY_CODE.get(code, ServerError)(code, message, retryable, request_id)


def from_reply(msg: dict) -> TurbomqError:
    return error_for(msg["code"], msg["message"], msg["retryable"], msg.get("request_id"))
