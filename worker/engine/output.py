"""Per-request text output: streaming detokenization plus stop strings.
Text that could still grow into a stop string is held back, so a client
never sees any part of the stop string."""

from __future__ import annotations

from typing import Optional, Sequence

from .tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Optional[Tokenizer], prompt_ids: Sequence[int],
                 stop: Sequence[str]):
        # Without a tokenizer the request streams token IDs only.
        self._detok = IncrementalDetokenizer(tokenizer, list(prompt_ids)) if tokenizer else None
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        self.text = ""  # everything released so far

    def push(self, token_id: int) -> tuple[str, bool]:
        """Feed one generated token; returns (newly released text, stop string hit)."""
        if self._detok is None:
            return "", False
        return self._release(self._held + self._detok.push(token_id), final=False)

    def finish(self) -> str:
        """Release what is left at the end of the request."""
        if self._detok is None:
            return ""
        delta, _ = self._release(self._held + self._detok.flush(), final=True)
        return delta

    def _release(self, buffer: str, final: bool) -> tuple[str, bool]:
        # Every occurrence that could start in released text was already inside
        # a searched buffer (we hold back len(longest stop) - 1 chars), so
        # searching the buffer alone is enough.
        hits = [i for i in (buffer.find(s) for s in self._stop) if i >= 0]
        if hits:
            delta, self._held = buffer[:min(hits)], ""
            self.text += delta
            return delta, True
        cut = len(buffer) if final else max(len(buffer) - self._hold, 0)
        delta, self._held = buffer[:cut], buffer[cut:]
        self.text += delta
        return delta, False
