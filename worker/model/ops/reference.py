"""Pure-PyTorch ops: the CPU backend and the oracle every CUDA kernel is tested
against. Written for clarity; math runs in float32 whatever the storage dtype."""

from __future__ import annotations

from typing import Optional

import torch

from .layer_kv import LayerKV
from .attention_batch import AttentionBatch
from .fp8 import Fp8Weight, fp8_linear_reference

INT8_MAX = 127.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-rotation rotary embedding (pairs j and j + head_dim/2).
    q: [T, nh, d], k: [T, nkv, d]; cos_sin: [max_pos, d] = cat(cos, sin) of d/2 freqs."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions]
    cos = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    return rot(q), rot(k)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor) -> torch.Tensor:
    """rotary on q and k, then write_kv of the rotated k and v; returns the rotated q."""
    q, k = rotary(q, k, positions, cos_sin)
    write_kv(kv, k, v, slot_mapping)
    return q


def qkv_rotary_write_kv(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float],
                        positions: torch.Tensor, cos_sin: torch.Tensor, kv: LayerKV,
                        slot_mapping: torch.Tensor, num_heads: int, *,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention input of a decoder layer: the qkv projection of
    rms_norm(x), rotary on q and k, k and v into the pool. Returns the
    rotated q [T, num_heads, head_dim] (in `out` where given)."""
    t, (nkv, d) = x.shape[0], kv.k.shape[1::2]
    qkv = linear(x, weight, norm=norm)
    q, k, v = qkv.split([num_heads * d, nkv * d, nkv * d], dim=-1)
    q = rotary_write_kv(q.reshape(t, num_heads, d), k.reshape(t, nkv, d),
                        v.reshape(t, nkv, d), positions, cos_sin, kv, slot_mapping)
    return q if out is None else out.copy_(q)


def linear(x: torch.Tensor, weight: torch.Tensor, *,
           norm: Optional[tuple[torch.Tensor, float]] = None, silu: bool = False,
           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight.T (weight [out, in], or an Fp8Weight), as F.linear; with
    `norm` = (weight, eps) of rms_norm(x) instead of x; with `silu`, silu_mul of the product
    (weight stacks gate over up); with `residual`, the product is added into
    it in place and it is returned (the residual stream)."""
    if norm is not None:
        x = rms_norm(x, norm[0], norm[1])
    if isinstance(weight, Fp8Weight):
        y = fp8_linear_reference(x, weight)
    else:
        y = torch.nn.functional.linear(x, weight)
    if silu:
        y = silu_mul(y)
    if residual is not None:
        return residual.add_(y)
    return y


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, *,
                     residual: Optional[torch.Tensor] = None,
                     norm_eps: Optional[float] = None) -> torch.Tensor:
    """x @ weight.T as the batch-invariant GEMM defines it
    (native/cuda/gemm_invariant.cu): every output one float32 accumulation
    over K, rounded once to x's dtype. The order within K is the matmul's
    own, so this agrees with the kernel to float32 noise, not bit for bit.
    With `residual`, the result is added into it in place (residual.add_(y),
    y rounded first) and residual is returned. With `norm_eps`, the folded
    RMSNorm (weight's columns already carry the norm weight,
    ops/invariant.py): each row's total times rsqrt(mean(x^2) + norm_eps)
    before the rounding."""
    if residual is not None:
        return residual.add_(linear_invariant(x, weight, norm_eps=norm_eps))
    k = x.shape[-1]
    xf = x.reshape(-1, k).float()
    total = xf @ weight.float().T
    if norm_eps is not None:
        total = total * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    return total.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization over the last dim: x ~= q * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-8) / INT8_MAX
    q = torch.round(xf / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new tokens' k/v ([T, nkv, d]) into their slots of the pool."""
    bs = kv.block_size
    blocks = slot_mapping // bs
    offsets = slot_mapping % bs
    for cache, scales, x in ((kv.k, kv.k_scale, k), (kv.v, kv.v_scale, v)):
        if scales is None:
            cache[blocks, :, offsets] = x.to(cache.dtype)
        else:
            q, s = quantize_int8(x)
            cache[blocks, :, offsets] = q
            scales[blocks, :, offsets] = s


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor,
            length: int) -> torch.Tensor:
    """One sequence's KV in token order as float32: [nkv, length, d]."""
    x = cache[blocks].float()  # [nb, nkv, bs, d]
    if scales is not None:
        x = x * scales[blocks][..., None]
    nb, nkv, bs, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(nkv, nb * bs, d)[:, :length]


def paged_attention(q: torch.Tensor, kv: LayerKV, batch: AttentionBatch,
                    scale: float, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context,
    read through its block table. q: [T, nh, d] -> [T, nh, d] (into `out`
    where given). The new queries of a sequence sit at the end of its
    context (Q shorter than K)."""
    out = torch.empty_like(q) if out is None else out
    decode_rows = [s for s, n in enumerate(batch.q_lens_host) if n == 1]
    if decode_rows:
        _decode_attention(q, kv, batch, scale, decode_rows, out)
    if len(decode_rows) == batch.num_seqs:
        return out
    bs = kv.block_size
    nh = q.shape[1]
    start = 0
    for s, (n, ctx) in enumerate(zip(batch.q_lens_host, batch.context_lens_host)):
        if n == 1:
            start += 1
            continue
        blocks = batch.block_tables[s, : (ctx + bs - 1) // bs].long()
        k = _gather(kv.k, kv.k_scale, blocks, ctx)
        v = _gather(kv.v, kv.v_scale, blocks, ctx)
        group = nh // k.shape[0]
        k = k.repeat_interleave(group, dim=0)  # [nh, ctx, d]
        v = v.repeat_interleave(group, dim=0)
        qs = q[start:start + n].float().transpose(0, 1)  # [nh, n, d]
        scores = torch.matmul(qs, k.transpose(1, 2)) * scale  # [nh, n, ctx]
        # query i sits at position ctx - n + i and sees keys 0 .. ctx - n + i
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        scores.masked_fill_(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + n] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
        start += n
    return out


def _decode_attention(q: torch.Tensor, kv: LayerKV, batch: AttentionBatch, scale: float,
                      rows: list[int], out: torch.Tensor) -> None:
    """All one-query sequences at once: gather their blocks padded to the
    longest context and mask the padding."""
    bs = kv.block_size
    idx = torch.tensor(rows, device=q.device)
    token_rows = batch.cu_q_lens[idx].long()
    ctx = batch.context_lens[idx].long()  # [S]
    max_ctx = max(batch.context_lens_host[r] for r in rows)
    nblocks = (max_ctx + bs - 1) // bs
    tables = batch.block_tables[idx, :nblocks].long().clamp_min(0)  # padding reads block 0, masked

    def gather(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        x = cache[tables].float()  # [S, nb, nkv, bs, d]
        if scales is not None:
            x = x * scales[tables][..., None]
        S, nb, nkv, _, d = x.shape
        return x.permute(0, 2, 1, 3, 4).reshape(S, nkv, nb * bs, d)[:, :, :max_ctx]

    k = gather(kv.k, kv.k_scale)  # [S, nkv, L, d]
    v = gather(kv.v, kv.v_scale)
    S, nkv, L, d = k.shape
    nh = q.shape[1]
    qs = q[token_rows].float().reshape(S, nkv, nh // nkv, d)  # query heads grouped by kv head
    scores = torch.matmul(qs, k.transpose(2, 3)) * scale  # [S, nkv, group, L]
    pad = torch.arange(L, device=q.device)[None, :] >= ctx[:, None]  # [S, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out[token_rows] = torch.matmul(probs, v).reshape(S, nh, d).to(q.dtype)
