"""What generate returns: Delta / Final events when streaming, a Result otherwise."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # session history + this turn's prompt
    cached_tokens: int  # of those, served from resident KV
    completion_tokens: int

    @classmethod
    def from_wire(cls, d: dict) -> "Usage":
        return cls(d["prompt_tokens"], d["cached_tokens"], d["completion_tokens"])


@dataclass(frozen=True)
class Delta:
    request_id: str
    seq: int  # 0, 1, 2, ... per request
    index: int  # position of token_ids[0] in the completion
    token_ids: list
    text: str


@dataclass(frozen=True)
class Final:
    request_id: str
    finish_reason: str  # stop | length | cancelled
    usage: Usage


@dataclass
class Result:
    request_id: str
    token_ids: list
    text: str
    finish_reason: str
    usage: Usage
