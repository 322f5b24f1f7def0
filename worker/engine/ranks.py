"""Tensor parallelism, the engine's side: one process per device, rank 0
schedules.

Rank 0 runs the engine: scheduler, KV manager, sampling. It starts ranks
1.. (`start`), and for every forward it broadcasts the step's inputs (token
ids, query and context lengths, block tables, whether a decode graph runs
it, which rows take their token from the previous step on the device, how
many rows it samples) through shared memory (engine/step_channel.py). The
other ranks (`follow`) build
the same ModelRunner and run the same forward, eagerly or by replaying the
same captured graph (all-reduces inside), discard the logits, and receive
the sampled tokens device to device, so steps overlap the host's work on
every rank as on one.
docs/engine.md, Tensor parallel."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from typing import Optional, Union

import numpy as np
import torch

from ..model.config import ModelConfig
from ..model.parallel import (COLLECTIVE_TIMEOUT, ParallelConfig, TensorParallel, check_divisible,
                              device_for)
from .config import EngineConfig
from .runner import ModelRunner, StepInputs
from .step_channel import ChannelClosed, StepChannel

log = logging.getLogger("turbomq.parallel")

_STOP, _POOL, _FORWARD, _GRAPHED = 0, 1, 2, 3
# kind, sequences, tokens, table width, pool blocks, rows sampled, rows in flight
# given, greedy
_HEADER = 8


class Ranks:
    """Rank 0's handle on the group: it announces every forward to the
    other ranks and stops them."""

    def __init__(self, tp: TensorParallel, followers: list, channel: StepChannel):
        self.tp = tp
        self.followers = followers  # the processes of ranks 1..
        self.channel = channel

    def send_pool(self, num_blocks: int) -> None:
        """How many blocks every rank's pool holds."""
        self.channel.send(np.array([_POOL, 0, 0, 0, num_blocks, 0, 0, 0], dtype=np.int64))

    def send_step(self, step: StepInputs) -> None:
        """The inputs of the forward rank 0 is about to run: one message."""
        tables = np.asarray(step.tables, dtype=np.int64)
        kind = _GRAPHED if step.graphed else _FORWARD
        prev = step.prev_rows or []
        header = [kind, len(step.q_lens), len(step.ids), tables.shape[1], 0, step.sampled,
                  int(step.prev_rows is not None), int(step.greedy)]
        self.channel.send(np.concatenate([
            np.array(header + step.ids + step.q_lens + step.ctx_lens, dtype=np.int64),
            tables.reshape(-1), np.array(prev, dtype=np.int64)]))

    def close(self) -> None:
        """Stop the other ranks, wait for them, leave the group."""
        try:
            self.channel.send(np.array([_STOP, 0, 0, 0, 0, 0, 0, 0], dtype=np.int64))
        finally:
            for p in self.followers:
                p.join(15)
                if p.is_alive():
                    p.kill()
            self.followers = []
            self.channel.close()
            self.tp.leave()


def _receive(channel: StepChannel) -> Optional[Union[int, StepInputs]]:
    """Ranks > 0: the next step's inputs, the pool's block count, or None to stop."""
    message = channel.receive()
    kind, n, t, width, blocks, sampled, in_flight, greedy = message[:_HEADER].tolist()
    if kind == _STOP:
        return None
    if kind == _POOL:
        return blocks
    body = message[_HEADER:]
    end = t + 2 * n + n * width
    return StepInputs(ids=body[:t].tolist(), q_lens=body[t:t + n].tolist(),
                      ctx_lens=body[t + n:t + 2 * n].tolist(),
                      tables=body[t + 2 * n:end].reshape(n, width),
                      graphed=kind == _GRAPHED,
                      prev_rows=body[end:].tolist() if in_flight else None, sampled=sampled,
                      greedy=bool(greedy))


def start(config: EngineConfig, model_config: ModelConfig) -> Ranks:
    """Rank 0, in the engine's process: start ranks 1.. (one process each,
    spawned) and form the group with them."""
    size = config.tensor_parallel
    check_divisible(model_config, size)
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    channel = StepChannel.create(size - 1, COLLECTIVE_TIMEOUT.total_seconds())
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked CUDA or threads
    followers = [ctx.Process(target=follow, args=(config, r, init_method, channel.name,
                                                  os.getpid()),
                             daemon=True, name=f"turbomq-rank{r}") for r in range(1, size)]
    for p in followers:
        p.start()
    try:
        tp = TensorParallel(ParallelConfig(size, 0, init_method), device_for(config.device, 0))
    except BaseException:
        for p in followers:
            p.kill()
        channel.close()
        raise
    log.info("tensor parallel over %d ranks (%s)", size, config.device)
    return Ranks(tp, followers, channel)


def follow(config: EngineConfig, rank: int, init_method: str, channel_name: str,
           rank0_pid: int) -> None:
    """Ranks > 0, in their own process: load this rank's slice, then run every
    forward rank 0 announces until it says stop (or is gone)."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    size = config.tensor_parallel
    channel = StepChannel.attach(channel_name, size - 1, rank - 1, rank0_pid,
                                 COLLECTIVE_TIMEOUT.total_seconds())
    tp = TensorParallel(ParallelConfig(size, rank, init_method), device_for(config.device, rank))
    runner = None
    try:
        runner = ModelRunner(config, tp=tp)
        num_blocks = _receive(channel)
        if num_blocks is None:  # rank 0 gave up before sizing its pool
            return
        runner.allocate_kv(num_blocks)  # the same pool and graphs as rank 0's
        while (step := _receive(channel)) is not None:
            runner.follow(step)
    except ChannelClosed:
        log.warning("rank %d: rank 0 is gone; stopping", rank)
    finally:
        channel.close()
        if runner is not None:
            runner.release_graphs()
    # Gone without tearing the group down: rank 0 is done with it, and NCCL's
    # teardown may wait on what captured graphs held.
    logging.shutdown()
    os._exit(0)
