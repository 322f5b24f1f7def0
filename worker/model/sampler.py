"""The batched token sampler (the parameters are turbomq.worker.engine.sampling_params).

Per row the sampler applies, in this order:

    repetition penalty -> temperature -> top-k -> top-p -> min-p -> draw

Greedy rows (temperature 0) take the argmax of the penalized logits; ties go to
the lowest token id. Other rows draw one uniform from their request's own
`SeedRNG` and pick a token by inverse CDF over a per-row order (penalized
logits descending, ties by lowest id). Nothing a row computes depends on its
batch neighbours or its row index, so a seeded request is reproducible however
it is batched. The per-row values go to the device through pinned memory,
asynchronously (ops.attention_batch.to_device): a plain copy would first
wait for the step in flight, and the next step could not be queued ahead.
docs/sampling.md has the details.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Protocol, Sequence

import torch

from .ops.attention_batch import to_device


class SamplingParams(Protocol):
    """The fields of engine.sampling_params.SamplingParams a row is sampled by
    (a protocol, so the model layer does not import the engine's)."""
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float

    @property
    def is_greedy(self) -> bool: ...


class SeedRNG(Protocol):
    def uniform(self) -> float: ...


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
    ri = to_device(rows, torch.long, dev)
    ci = to_device(cols, torch.long, dev)
    pen = to_device(pens, logits.dtype, dev)
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
    idx = to_device(random_rows, torch.long, x.device)
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
    return to_device(values, like.dtype, like.device).unsqueeze(1)


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
    keep = rank < to_device(ks, torch.long, probs.device).unsqueeze(1)

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
