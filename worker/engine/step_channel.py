"""Rank 0's step announcements to the other ranks, through shared memory.

Under tensor parallelism rank 0 tells every other rank the inputs of each
forward before it runs its own (engine/ranks.py). All ranks live on one
host, so a shared-memory segment carries them: rank 0 writes a message and
bumps a sequence number, each reader polls that number, copies the message
out and acknowledges it. One message is a few microseconds each way, where
the two gloo broadcasts it replaces took hundreds of microseconds over
loopback TCP, on the critical path of every prefill (a rank starts its
forward only once it has the inputs; the time to first token waits for the
slowest rank).

The segment is a file in /dev/shm (RAM), mapped by every rank. Layout
(int64 words): [0] sequence number of the last message written,
[1] its length in words, [2 .. 2 + readers) each reader's last acknowledged
sequence number, then the payload. A message longer than the payload area
goes in pieces, each acknowledged before the next overwrites it. The writer
waits for every acknowledgement before it writes again (at most
`timeout` seconds: a reader that is gone); a reader waiting for a message
checks now and then that rank 0's process still exists."""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from typing import Optional

import numpy as np

_SEQ, _LEN, _ACKS = 0, 1, 2
CAPACITY_WORDS = 1 << 16  # payload words of one piece (512 KiB)
# A waiter polls without sleeping for _SPIN_S, then naps _NAP_S between
# polls, and _IDLE_NAP_S once it has waited _IDLE_S (an idle engine, or a
# slow CPU step, should not keep a core busy).
_SPIN_S, _NAP_S = 0.002, 20e-6
_IDLE_S, _IDLE_NAP_S = 0.05, 1e-3


class ChannelClosed(RuntimeError):
    """The other end is gone."""


class StepChannel:
    def __init__(self, path: str, readers: int, reader: Optional[int], owner: bool,
                 writer_pid: int, timeout: float):
        self._path = path
        self._readers = readers
        self._reader = reader  # None: the writer
        self._owner = owner
        self._writer_pid = writer_pid
        self._timeout = timeout
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        words = np.frombuffer(self._map, dtype=np.int64)
        self._control = words[:_ACKS + readers]
        self._payload = words[_ACKS + readers:]
        # the writer: the last message written; a reader: the last it read
        # (it may attach after the first messages were written)
        self._seq = int(self._control[_SEQ] if reader is None else self._control[_ACKS + reader])
        # Taking and releasing a lock is a full memory barrier in C: it keeps
        # the payload's stores before the sequence number's, and the
        # sequence number's load before the payload's, on CPUs that reorder
        # them (x86 does not).
        self._barrier = threading.Lock()

    @classmethod
    def create(cls, readers: int, timeout: float,
               capacity_words: int = CAPACITY_WORDS) -> "StepChannel":
        """Rank 0's end, for `readers` other ranks (a file in /dev/shm, RAM)."""
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="turbomq-steps-", dir=where)
        with os.fdopen(fd, "wb") as f:
            f.truncate(8 * (_ACKS + readers + capacity_words))  # zeros
        return cls(path, readers, None, True, os.getpid(), timeout)

    @classmethod
    def attach(cls, name: str, readers: int, reader: int, writer_pid: int,
               timeout: float) -> "StepChannel":
        """Reader `reader`'s end (rank reader + 1) of the channel `name`."""
        return cls(name, readers, reader, False, writer_pid, timeout)

    @property
    def name(self) -> str:
        return self._path

    def send(self, message: np.ndarray) -> None:
        """Write `message` (int64 words) for every reader; returns once it is
        written, not read (it waits only for the previous one's reading)."""
        message = np.ascontiguousarray(message, dtype=np.int64).reshape(-1)
        cap = self._payload.shape[0]
        for start in range(0, max(len(message), 1), cap):
            piece = message[start:start + cap]
            self._wait(lambda: bool((self._control[_ACKS:] >= self._seq).all()),
                       "a rank stopped reading steps")
            self._payload[:len(piece)] = piece
            self._control[_LEN] = len(message)
            self._seq += 1
            with self._barrier:
                pass
            self._control[_SEQ] = self._seq  # last: readers see the message whole

    def receive(self) -> np.ndarray:
        """The next message (a copy)."""
        parts, total = [], None
        while total is None or sum(len(p) for p in parts) < total:
            want = self._seq + 1
            self._wait(lambda: int(self._control[_SEQ]) >= want, "rank 0 is gone")
            with self._barrier:
                pass
            self._seq = want
            total = int(self._control[_LEN])
            got = sum(len(p) for p in parts)
            parts.append(self._payload[:min(total - got, self._payload.shape[0])].copy())
            self._control[_ACKS + self._reader] = want
            if total == 0:
                break
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _wait(self, ready, gone: str) -> None:
        """Until ready(): polls, then naps between polls; gives up after the
        timeout (the writer) or once rank 0's process is gone (a reader)."""
        if ready():
            return
        start = last_check = time.monotonic()
        while not ready():
            now = time.monotonic()
            if now - start < _SPIN_S:
                continue
            time.sleep(_NAP_S if now - start < _IDLE_S else _IDLE_NAP_S)
            if self._reader is None and now - start > self._timeout:
                raise ChannelClosed(gone)
            if self._reader is not None and now - last_check > 1.0:
                last_check = now
                if not _alive(self._writer_pid):
                    raise ChannelClosed(gone)

    def close(self) -> None:
        """Detach (and, rank 0, remove the file)."""
        if self._map is None:
            return
        self._control = self._payload = None
        self._map.close()
        self._map = None
        if self._owner:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
