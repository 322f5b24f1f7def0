"""The host-RAM tier of the KV cache, as bookkeeping: which block names it
holds and in which slot, least recently used first. The runner owns the
pinned memory and does the copies; the scheduler decides them.

Tiers, fastest first: the GPU pool (blocks in use, then named free blocks),
this tier (blocks the GPU pool had to give new content), and the session
store's token IDs (re-prefill, on any worker)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Collection, Optional, Sequence


class HostTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # stack, lowest on top
        self._slots: "OrderedDict[int, int]" = OrderedDict()  # name -> slot, oldest first
        self.stored_blocks = 0  # copies in (GPU -> host)
        self.loaded_blocks = 0  # copies out (host -> GPU)

    def __len__(self) -> int:
        return len(self._slots)

    def stats(self) -> dict:
        return {"host_tier_blocks_total": self.num_slots, "host_tier_blocks_used": len(self),
                "host_tier_stored_blocks": self.stored_blocks,
                "host_tier_loaded_blocks": self.loaded_blocks}

    def lookup_chain(self, hashes: Sequence[int]) -> list[int]:
        """Slots of the leading `hashes` this tier holds (touched: most recent)."""
        slots = []
        for h in hashes:
            slot = self._slots.get(h)
            if slot is None:
                break
            self._slots.move_to_end(h)
            slots.append(slot)
        return slots

    def store(self, name: int, pinned: Collection[int] = ()) -> Optional[int]:
        """A slot to copy the block named `name` into, or None when it is
        already here (touched) or every slot is pinned (in use this step)."""
        if name in self._slots:
            self._slots.move_to_end(name)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
        self._slots[name] = slot
        self.stored_blocks += 1
        return slot
