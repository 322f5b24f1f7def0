"""TensorParallel.argmax_columns on two real gloo ranks: the argmax of the
gathered columns, ties to the lowest id, whichever rank holds the maximum,
without gathering the logits."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from turbomq.worker.model.parallel import ParallelConfig, TensorParallel
from turbomq.worker.model.sampler import argmax_rows

COLS = 50


def full_logits() -> torch.Tensor:
    """Rows whose maximum sits on rank 0, on rank 1, on both (a tie across
    ranks and one within a rank), and a row of equal values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2 * COLS, generator=g)
    x[0, 7] = 9.0                         # rank 0
    x[1, COLS + 3] = 9.0                  # rank 1
    x[2, 11] = x[2, COLS + 2] = 9.0       # tie across ranks: the lower id
    x[3, COLS + 5] = x[3, COLS + 9] = 9.0  # tie within rank 1
    x[4] = 1.0                            # all equal: id 0
    return x.to(torch.bfloat16)


def rank_main(rank: int, init: str, out: dict) -> None:
    tp = TensorParallel(ParallelConfig(2, rank, init), torch.device("cpu"))
    try:
        mine = full_logits()[:, rank * COLS:(rank + 1) * COLS].contiguous()
        out[rank] = tp.argmax_columns(mine).tolist()
        out[f"empty{rank}"] = tp.argmax_columns(mine[:0]).tolist()
    finally:
        tp.leave()


def test_argmax_over_the_ranks_columns_equals_the_gathered_argmax():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with mp.get_context("spawn").Manager() as manager:
        out = manager.dict()
        mp.start_processes(rank_main, args=(init, out), nprocs=2, start_method="spawn")
        want = argmax_rows(full_logits()).tolist()
        assert want[:5] == [7, COLS + 3, 11, COLS + 5, 0]
        assert out[0] == out[1] == want
        assert out["empty0"] == out["empty1"] == []
