"""Sampling parameters and each request's seeded RNG: plain Python, no torch.

The scheduler, the protocol side of the worker and clients of the engine read
these; the batched sampler that uses them is turbomq.worker.model.sampler
(docs/sampling.md)."""

from __future__ import annotations

import dataclasses
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

# Temperatures below this count as 0: dividing by them overflows float32.
GREEDY_TEMPERATURE = 1e-5


class InvalidParams(ValueError):
    """A request's sampling parameters are malformed; the message names every bad field."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("invalid sampling params: " + "; ".join(self.errors))


def _is_int(v: Any) -> bool:
    # bool is an int subclass, but `max_tokens=True` is a client bug, not 1.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return _is_int(v) or isinstance(v, float)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Names and defaults follow vLLM."""

    max_tokens: int = 16  # new tokens to generate
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 => disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt + generated tokens
    seed: Optional[int] = None
    stop: Union[list[str], tuple[str, ...], str] = ()  # stop strings; applied by the engine
    stop_token_ids: Union[list[int], tuple[int, ...]] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Fail where the object is built; the worker re-validates with its vocab size.
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Check every field, normalize `stop`/`stop_token_ids` to tuples and
        float fields to float. Raises InvalidParams listing all problems."""
        errors: list[str] = []
        self._check_numbers(errors)
        self._check_stops(errors, vocab_size)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if errors:
            raise InvalidParams(errors)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))
        return self

    def _check_numbers(self, errors: list[str]) -> None:
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            errors.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not (_is_number(t) and math.isfinite(t) and t >= 0):
            errors.append(f"temperature must be a finite number >= 0, got {t!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            errors.append(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not (_is_int(self.top_k) and self.top_k >= -1):
            errors.append(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            errors.append(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        r = self.repetition_penalty
        if not (_is_number(r) and math.isfinite(r) and r > 0):
            errors.append(f"repetition_penalty must be a finite number > 0, got {r!r}")
        if not (self.seed is None or _is_int(self.seed)):
            errors.append(f"seed must be an int or None, got {self.seed!r}")

    def _check_stops(self, errors: list[str], vocab_size: Optional[int]) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)):
            errors.append(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        else:
            self.stop = tuple(stop)

        ids = self.stop_token_ids
        if not (isinstance(ids, (list, tuple)) and all(_is_int(i) for i in ids)):
            errors.append(f"stop_token_ids must be a list of ints, got {ids!r}")
            return
        hi = vocab_size if vocab_size is not None else None
        bad = [i for i in ids if i < 0 or (hi is not None and i >= hi)]
        if bad:
            bound = f"[0, {hi})" if hi is not None else ">= 0"
            errors.append(f"stop_token_ids must be within {bound}, got {bad!r}")
            return
        self.stop_token_ids = tuple(ids)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], vocab_size: Optional[int] = None) -> "SamplingParams":
        """Build from a wire-protocol mapping; unknown keys are an error, not ignored,
        so a misspelt `top_P` does not silently fall back to the default."""
        if not isinstance(d, Mapping):
            raise InvalidParams([f"sampling params must be a mapping, got {type(d).__name__}"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise InvalidParams([f"unknown field(s) {unknown}; allowed: {sorted(known)}"])
        return cls(**d).validate(vocab_size)

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (lists, not tuples), ready for msgpack."""
        d = dataclasses.asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d


class SeedRNG:
    """One request's source of randomness: one uniform in [0, 1) per sampled step.

    Owned by the request, not the batch, which is what makes a seeded request
    independent of its neighbours. `draws` counts the uniforms taken, so a
    request moved to another worker can resume with `SeedRNG(seed).advance(n)`.
    """

    def __init__(self, seed: Optional[int] = None):
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        self._random = random.Random(self.seed)
        self.draws = 0

    def uniform(self) -> float:
        self.draws += 1
        return self._random.random()

    def advance(self, n: int) -> "SeedRNG":
        for _ in range(n):
            self.uniform()
        return self
