"""The host-RAM tier of the KV cache, as bookkeeping: which block names it
holds and in which slot, least recently used first. The runner owns the
pinned memory and does the copies; the scheduler decides them.

Tiers, fastest first: the GPU pool (blocks in use, then named free blocks),
this tier (blocks the GPU pool had to give new content), and the session
store's token IDs (re-prefill, on any worker).

The tiers are exclusive: a block loaded back into the GPU pool leaves this
tier (it is copied out again if the pool reuses it). Inclusive tiers would
keep a second copy of everything resident on the GPU, and in a multi-turn
workload that cycles through more conversations than the GPU holds those
copies crowd out exactly the blocks the next turns need."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence


class HostTier:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # stack, lowest on top
        self._slots: "OrderedDict[int, int]" = OrderedDict()  # name -> slot, oldest first
        # Slots taken this step, being loaded: reusable from the next step on
        # (the copies run in step order).
        self._taken: list[int] = []
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

    def take(self, names: Sequence[int]) -> None:
        """The blocks `names` are being loaded into the GPU pool: they leave
        this tier, and their slots are free again after this step."""
        for h in names:
            self._taken.append(self._slots.pop(h))
        self.loaded_blocks += len(names)

    def end_step(self) -> None:
        self._free.extend(self._taken)
        self._taken.clear()

    def store(self, name: int) -> Optional[int]:
        """A slot to copy the block named `name` into (the least recently used
        block's when none is free), or None when it is here already (touched)
        or every slot is being loaded this step."""
        if name in self._slots:
            self._slots.move_to_end(name)
            return None
        if self._free:
            slot = self._free.pop()
        elif self._slots:
            slot = self._slots.popitem(last=False)[1]
        else:
            return None
        self._slots[name] = slot
        self.stored_blocks += 1
        return slot
