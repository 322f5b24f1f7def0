"""Per-step attention metadata: which new tokens belong to which sequence and
where every sequence's KV lives in the paged pool.

Built on the host once per step by the engine and moved to the device once;
every attention op (reference or CUDA) reads the same fields."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host values (a list or an array) as a `dtype` tensor on `device`,
    without waiting for it: through pinned memory, asynchronously on the
    current stream. A plain copy from pageable memory would first wait for
    everything queued on the stream, such as the step in flight."""
    if isinstance(values, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    else:
        t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class AttentionBatch:
    # Tokens of this step are flattened sequence by sequence: sequence s owns
    # rows cu_q_lens[s] : cu_q_lens[s + 1] of q/k/v.
    q_lens: torch.Tensor  # [S] int32, new tokens per sequence (1 for decode)
    cu_q_lens: torch.Tensor  # [S + 1] int32, prefix sums of q_lens
    context_lens: torch.Tensor  # [S] int32, KV length after this step's write
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with -1
    slot_mapping: torch.Tensor  # [T] int64, block * block_size + offset per new token
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    # Host copies for ops that loop over sequences (the reference backend).
    q_lens_host: list[int]
    context_lens_host: list[int]
    max_q_len: int
    max_context_len: int
    # per-step derived data a backend computes once and every layer reuses
    backend_cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_q_len == 1

    @staticmethod
    def build(q_lens: list[int], context_lens: list[int], block_tables: np.ndarray,
              block_size: int, device: torch.device | str = "cpu") -> "AttentionBatch":
        """q_lens[s] new tokens of sequence s occupy positions
        context_lens[s] - q_lens[s] .. context_lens[s] - 1."""
        q = np.asarray(q_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        if np.any(q < 1) or np.any(ctx < q):
            raise ValueError("every sequence needs 1 <= q_len <= context_len")
        cu = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        # position of each new token: start of its sequence's new part + index
        seq_of_token = np.repeat(np.arange(len(q)), q)
        positions = (ctx - q)[seq_of_token] + (np.arange(cu[-1]) - cu[:-1][seq_of_token])
        tables = np.asarray(block_tables, dtype=np.int64)
        blocks = tables[seq_of_token, positions // block_size]
        if np.any(blocks < 0):
            raise ValueError("a block table does not cover its sequence's context")
        slots = blocks * block_size + positions % block_size

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return to_device(a, dtype, device)

        return AttentionBatch(
            q_lens=dev(q, torch.int32), cu_q_lens=dev(cu, torch.int32),
            context_lens=dev(ctx, torch.int32), block_tables=dev(tables, torch.int32),
            slot_mapping=dev(slots, torch.int64), positions=dev(positions, torch.int64),
            q_lens_host=q.tolist(), context_lens_host=ctx.tolist(),
            max_q_len=int(q.max()), max_context_len=int(ctx.max()))
