"""Pure-PyTorch ops: the CPU backend and the oracle every CUDA kernel is tested
against. Written for clarity; math runs in float32 whatever the storage dtype."""

from __future__ import annotations

import torch

from ..kv_cache import LayerKV
from .attention_batch import AttentionBatch

INT8_MAX = 127.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


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
                    scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context,
    read through its block table. q: [T, nh, d] -> [T, nh, d].
    The new queries of a sequence sit at the end of its context (Q shorter than K)."""
    out = torch.empty_like(q)
    nh = q.shape[1]
    bs = kv.block_size
    tables = batch.block_tables
    start = 0
    for s, (n, ctx) in enumerate(zip(batch.q_lens_host, batch.context_lens_host)):
        blocks = tables[s, : (ctx + bs - 1) // bs].long()
        k = _gather(kv.k, kv.k_scale, blocks, ctx)
        v = _gather(kv.v, kv.v_scale, blocks, ctx)
        group = nh // k.shape[0]
        k = k.repeat_interleave(group, dim=0)  # [nh, ctx, d]
        v = v.repeat_interleave(group, dim=0)
        qs = q[start:start + n].float().transpose(0, 1)  # [nh, n, d]
        scores = torch.matmul(qs, k.transpose(1, 2)) * scale  # [nh, n, ctx]
        if n > 1:
            # query i sits at position ctx - n + i and sees keys 0 .. ctx - n + i
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            scores.masked_fill_(kpos > qpos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + n] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
        start += n
    return out
