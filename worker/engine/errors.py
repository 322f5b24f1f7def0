"""Typed errors of the engine. Each carries a stable `code` that the service
maps onto the wire protocol's error replies."""

from __future__ import annotations


class EngineError(Exception):
    code = "internal"
    retryable = False


class InvalidRequest(EngineError, ValueError):
    code = "invalid_request"


class PromptTooLong(InvalidRequest):
    code = "prompt_too_long"


class UnknownSession(EngineError, KeyError):
    code = "unknown_session"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownRequest(EngineError, KeyError):
    code = "unknown_request"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SessionBusy(EngineError):
    code = "session_busy"
    retryable = True


class SessionStoreUnavailable(EngineError):
    code = "session_store_unavailable"
    retryable = True


class RateLimited(EngineError):
    """The session's tenant is at one of its limits (e.g. its sessions or tokens in the store)."""
    code = "rate_limited"
    retryable = True
