"""The shared-memory channel that carries rank 0's step inputs to the other
ranks (engine/step_channel.py): real processes, real shared memory."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from turbomq.worker.engine.step_channel import ChannelClosed, StepChannel


def _messages() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    sizes = [7, 0, 1, 300, 64, 7, 1000, 64, 2]  # past 64 words: in pieces
    return [rng.integers(-2**40, 2**40, size=n, dtype=np.int64) for n in sizes]


def _reader(name: str, readers: int, reader: int, writer_pid: int, out) -> None:
    channel = StepChannel.attach(name, readers, reader, writer_pid, timeout=30)
    try:
        got = [channel.receive() for _ in range(len(_messages()))]
        out.put([m.tolist() for m in got])
    finally:
        channel.close()


@pytest.mark.parametrize("readers", [1, 3])
def test_every_reader_gets_every_message_in_order(readers):
    channel = StepChannel.create(readers, timeout=30, capacity_words=64)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_reader, args=(channel.name, readers, r, os.getpid(), out))
             for r in range(readers)]
    try:
        for p in procs:
            p.start()
        for m in _messages():
            channel.send(m)
        results = [out.get() for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        channel.close()
    want = [m.tolist() for m in _messages()]
    assert all(r == want for r in results)
    assert not os.path.exists(channel.name)  # rank 0 removes the segment


def test_a_reader_stops_waiting_once_rank_0_is_gone():
    gone = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
    gone.start()
    gone.join()
    channel = StepChannel.create(1, timeout=30)
    reader = StepChannel.attach(channel.name, 1, 0, gone.pid, timeout=30)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelClosed):
            reader.receive()
        assert time.monotonic() - t0 < 10
    finally:
        reader.close()
        channel.close()


def test_rank_0_gives_up_on_a_reader_that_stopped_reading():
    channel = StepChannel.create(2, timeout=0.3)
    reader = StepChannel.attach(channel.name, 2, 0, os.getpid(), timeout=30)
    try:
        channel.send(np.arange(5))
        assert reader.receive().tolist() == list(range(5))  # reader 1 never reads
        with pytest.raises(ChannelClosed):
            channel.send(np.arange(3))
    finally:
        reader.close()
        channel.close()
