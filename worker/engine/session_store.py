"""Where every session's token IDs live, so an evicted or moved session can be
re-prefilled. The engine only needs three calls; the in-process store is for
single-process use (not shared between processes)."""

from __future__ import annotations

import threading
from typing import Optional, Protocol


class SessionStoreError(RuntimeError):
    """The store could not be read or written (e.g. Redis is down)."""


class SessionModelMismatch(SessionStoreError):
    """The session was created for another model; its token IDs mean nothing here."""


class SessionStore(Protocol):
    def get_tokens(self, session_id: str) -> Optional[list[int]]:
        """The session's token IDs in order, or None if the session is unknown."""

    def append_tokens(self, session_id: str, tokens: list[int]) -> int:
        """Append to the session (creating it); returns its new length."""

    def drop(self, session_id: str) -> bool:
        """Forget the session; True if it existed."""


class InMemorySessionStore:
    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def get_tokens(self, session_id: str) -> Optional[list[int]]:
        with self._lock:
            tokens = self._tokens.get(session_id)
            return None if tokens is None else list(tokens)

    def append_tokens(self, session_id: str, tokens: list[int]) -> int:
        with self._lock:
            stored = self._tokens.setdefault(session_id, [])
            stored.extend(int(t) for t in tokens)
            return len(stored)

    def drop(self, session_id: str) -> bool:
        with self._lock:
            return self._tokens.pop(session_id, None) is not None
