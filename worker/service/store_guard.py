"""Fail fast while the shared session store is down.

Session reads run on the worker's socket thread. A Redis that does not answer
would hold that thread for the client timeout on every session request and
starve its heartbeats, so after a failure calls fail at once for `cooldown`
seconds; the first call after that tries Redis again (and recovery needs
nothing more)."""

from __future__ import annotations

import time
from typing import Optional

from .redis_store import RedisSessionStore
from ..engine.session_store import SessionHistory, SessionStoreError, TurnRecord


class FailFastStore:
    """A SessionStore (plus set_holder) over a RedisSessionStore."""

    def __init__(self, store: RedisSessionStore, cooldown: float = 1.0):
        self.store = store
        self.cooldown = cooldown
        self._failed_at: Optional[float] = None

    @property
    def url(self) -> str:
        return self.store.url

    def _call(self, fn, *args):
        failed_at = self._failed_at
        if failed_at is not None and time.monotonic() - failed_at < self.cooldown:
            raise SessionStoreError(
                f"session store {self.store.url} is unavailable (failed "
                f"{time.monotonic() - failed_at:.1f}s ago; retried every {self.cooldown:g}s)")
        try:
            result = fn(*args)
        except SessionStoreError as e:
            # A session of another model, or a conflict, is the caller's
            # problem, not an outage.
            if type(e) is SessionStoreError:
                self._failed_at = time.monotonic()
            raise
        self._failed_at = None
        return result

    def get_tokens(self, session_id: str) -> Optional[list[int]]:
        return self._call(self.store.get_tokens, session_id)

    def get_session(self, session_id: str) -> Optional[SessionHistory]:
        return self._call(self.store.get_session, session_id)

    def append_tokens(self, session_id: str, tokens: list[int]) -> int:
        return self._call(self.store.append_tokens, session_id, tokens)

    def append_turn(self, session_id: str, tokens: list[int], turn: TurnRecord) -> bool:
        return self._call(self.store.append_turn, session_id, tokens, turn)

    def drop(self, session_id: str) -> bool:
        return self._call(self.store.drop, session_id)

    def set_holder(self, session_id: str, worker_id: Optional[str]) -> None:
        self._call(self.store.set_holder, session_id, worker_id)

    def close(self) -> None:
        self.store.close()
