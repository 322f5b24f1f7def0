"""Where every session's token IDs live, so an evicted or moved session can be
re-prefilled. The in-process store is for single-process use (not shared
between processes).

Each session also remembers its last committed turn (`TurnRecord`), and a
turn is committed only onto the history it was computed from: a turn sent
again (its client lost the broker before the final reached it) is answered
from the record instead of being appended twice, and two workers can never
both extend one session (docs/sessions.md, "Turns")."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional, Protocol


class SessionStoreError(RuntimeError):
    """The store could not be read or written (e.g. Redis is down)."""


class SessionModelMismatch(SessionStoreError):
    """The session was created for another model; its token IDs mean nothing here."""


class SessionFull(SessionStoreError):
    """The session would grow past the store's bound on one session's tokens."""


class TenantQuotaExceeded(SessionStoreError):
    """The session's tenant keeps as many sessions or tokens in the store as it may."""


class SessionConflict(SessionStoreError):
    """The session grew since this turn read it (another turn was committed)."""


@dataclass(frozen=True)
class TurnRecord:
    turn_id: str  # the client's request id: the same however often the turn is sent
    start: int  # the session's length before the turn
    prompt_len: int  # the turn's own prompt tokens; the rest of it was generated
    finish_reason: str


@dataclass(frozen=True)
class SessionHistory:
    tokens: list[int]
    last_turn: Optional[TurnRecord]  # None for sessions written without turns


class SessionStore(Protocol):
    def get_tokens(self, session_id: str) -> Optional[list[int]]:
        """The session's token IDs in order, or None if the session is unknown."""

    def get_session(self, session_id: str) -> Optional[SessionHistory]:
        """The session's token IDs and last turn, or None if it is unknown."""

    def append_tokens(self, session_id: str, tokens: list[int]) -> int:
        """Append to the session (creating it); returns its new length."""

    def append_turn(self, session_id: str, tokens: list[int], turn: TurnRecord) -> bool:
        """Commit a turn (`tokens`: its prompt and output) if the session still
        has `turn.start` tokens; False if this turn (the same id on the same
        history) is committed already. Raises SessionConflict if the session
        grew otherwise."""

    def drop(self, session_id: str) -> bool:
        """Forget the session; True if it existed."""


class InMemorySessionStore:
    def __init__(self) -> None:
        self._tokens: dict[str, list[int]] = {}
        self._turns: dict[str, TurnRecord] = {}
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

    def get_session(self, session_id: str) -> Optional[SessionHistory]:
        with self._lock:
            tokens = self._tokens.get(session_id)
            if tokens is None:
                return None
            return SessionHistory(list(tokens), self._turns.get(session_id))

    def append_turn(self, session_id: str, tokens: list[int], turn: TurnRecord) -> bool:
        with self._lock:
            stored = self._tokens.get(session_id, [])
            last = self._turns.get(session_id)
            if last is not None and (last.turn_id, last.start) == (turn.turn_id, turn.start):
                return False
            if len(stored) != turn.start:
                raise SessionConflict(f"session {session_id!r} has {len(stored)} tokens, "
                                      f"not the {turn.start} this turn was computed on")
            self._tokens[session_id] = stored + [int(t) for t in tokens]
            self._turns[session_id] = turn
            return True

    def drop(self, session_id: str) -> bool:
        with self._lock:
            self._turns.pop(session_id, None)
            return self._tokens.pop(session_id, None) is not None
