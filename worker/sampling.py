"""Sampling parameters and the batched token sampler.

Per row the sampler applies, in this order:

    repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw

Greedy rows (temperature 0) take the argmax of the penalized logits; ties go to
the lowest token id. Other rows draw one uniform from their request's own
`SeedRNG` and pick a token by inverse CDF over a per-row order (penalized
logits descending, ties by lowest id). Nothing a row computes depends on its
batch neighbours or its row index, so a seeded request is reproducible however
it is batched. docs/sampling.md has the details.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

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


def apply_repetition_penalty(
    logits: torch.Tensor,
    penalties: Sequence[float],
    token_histories: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Return a copy of `logits` [B, V] where, in each row, every token id seen in
    that row's history has its logit divided by the penalty when positive and
    multiplied when negative (HF `RepetitionPenaltyLogitsProcessor`). Ids
    outside [0, V) are ignored, as HF does."""
    out = logits.clone()
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    pens: list[float] = []
    for r, (p, hist) in enumerate(zip(penalties, token_histories)):
        if p == 1.0:
            continue
        ids = sorted({t for t in hist if 0 <= t < vocab})
        rows += [r] * len(ids)
        cols += ids
        pens += [p] * len(ids)
    if not rows:
        return out
    dev = logits.device
    ri = torch.tensor(rows, device=dev)
    ci = torch.tensor(cols, device=dev)
    pen = torch.tensor(pens, device=dev, dtype=logits.dtype)
    vals = out[ri, ci]
    out[ri, ci] = torch.where(vals < 0, vals * pen, vals / pen)
    return out


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    rngs: Sequence[Optional[SeedRNG]],
    token_histories: Optional[Sequence[Sequence[int]]] = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` [B, V]; returns int64 [B] on its device.

    `rngs[i]` may be None only for greedy rows; each sampled row takes exactly
    one uniform from its rng. `token_histories[i]` (prompt + generated ids) is
    needed only for rows with a repetition penalty.
    """
    _check_batch(logits, params, rngs, token_histories)
    x = logits
    penalties = [p.repetition_penalty for p in params]
    if any(p != 1.0 for p in penalties):
        x = apply_repetition_penalty(x.float(), penalties, token_histories)

    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    tokens = argmax_rows(x)
    if not random_rows:
        return tokens
    sub_params = [params[i] for i in random_rows]
    u = [rngs[i].uniform() for i in random_rows]
    idx = torch.tensor(random_rows, device=x.device)
    tokens[idx] = _sample_rows(x[idx].float(), sub_params, u)
    return tokens


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (ties to the lowest id), in two stages on CUDA:
    one reduction over a whole 128k-entry row runs on a single block (27 us
    on an H100), so each row is cut into chunks reduced in parallel; the
    first chunk holding the maximum and the first maximum within it give
    the first maximal index overall."""
    rows, vocab = x.shape
    chunks = _argmax_chunks(vocab) if x.is_cuda else 1
    if chunks == 1:
        return torch.argmax(x, dim=-1)
    width = vocab // chunks
    best, where = x.view(rows, chunks, width).max(dim=-1)
    chunk = torch.argmax(best, dim=-1, keepdim=True)
    return (chunk * width + where.gather(1, chunk)).squeeze(1)


@functools.lru_cache(maxsize=None)
def _argmax_chunks(vocab: int) -> int:
    """The divisor of `vocab` nearest its square root from below (1 for a
    prime or a short vocabulary: a single pass then)."""
    if vocab < 4096:
        return 1
    c = math.isqrt(vocab)
    while vocab % c:
        c -= 1
    return c


def _check_batch(logits, params, rngs, token_histories) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    b = logits.shape[0]
    if len(params) != b or len(rngs) != b:
        raise ValueError(f"batch of {b} rows needs {b} params and rngs, got {len(params)} and {len(rngs)}")
    for i, (p, rng) in enumerate(zip(params, rngs)):
        if rng is None and not p.is_greedy:
            raise ValueError(f"row {i} samples (temperature {p.temperature}) but has no SeedRNG")
    needs_history = any(p.repetition_penalty != 1.0 for p in params)
    if needs_history and (token_histories is None or len(token_histories) != b):
        raise ValueError("repetition_penalty needs token_histories with one entry per row")


def _row_tensor(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _sample_rows(x: torch.Tensor, params: Sequence[SamplingParams], u: Sequence[float]) -> torch.Tensor:
    """Inverse-CDF sampling of float32 rows `x` [R, V] with one uniform per row."""
    vocab = x.shape[-1]
    # Sort before temperature scaling: float32 division may merge close logits
    # into ties, which would reorder them; rounding is monotone, so the order
    # of the raw logits stays valid after scaling.
    sorted_logits, order = torch.sort(x, dim=-1, descending=True, stable=True)
    temps = _row_tensor([p.temperature for p in params], x)
    probs = torch.softmax(sorted_logits / temps, dim=-1)

    keep = _filter_mask(probs, params, vocab)
    weights = probs.masked_fill(~keep, 0.0)
    cdf = torch.cumsum(weights, dim=-1)
    thresholds = _row_tensor(u, x) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, thresholds, right=True)
    # The kept tokens are a prefix of the order; rounding must not step past it.
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    picked = torch.minimum(picked, last_kept)
    return order.gather(1, picked).squeeze(1)


def _filter_mask(probs: torch.Tensor, params: Sequence[SamplingParams], vocab: int) -> torch.Tensor:
    """Tokens kept by top-k, then top-p, then min-p, for rows of `probs` sorted
    descending. The kept set is always a non-empty prefix."""
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    keep = rank < torch.tensor(ks, device=probs.device).unsqueeze(1)

    # top-p on the top-k survivors, renormalized: keep a token while the mass
    # before it is still below top_p, so the kept mass is the smallest >= top_p.
    top_p = _row_tensor([p.top_p for p in params], probs)
    kept = probs.masked_fill(~keep, 0.0)
    cum = torch.cumsum(kept, dim=-1)
    mass_before = (cum - kept) / cum[:, -1:]
    keep &= (mass_before < top_p) | (top_p >= 1.0)

    # min-p compares with the most likely token, which is always kept; the
    # ratio does not change under renormalization, so raw probs suffice.
    min_p = _row_tensor([p.min_p for p in params], probs)
    keep &= probs >= min_p * probs[:, :1]
    keep[:, 0] = True
    return keep
