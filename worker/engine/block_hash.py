"""Names of full KV blocks for prefix caching: a hash chained over the token
IDs of every block up to and including the block, seeded with what else
decides the block's contents (the model, the KV dtype) and with a salt that
keeps tenants' caches apart. Equal names mean equal KV, so any sequence may
reuse a block another one wrote. No torch: scheduler bookkeeping."""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

# 64-bit names: blake2b is fast, keyed and well mixed; a collision between
# two real prefixes (2^-64 per pair) would need ~4e9 blocks to be likely.
_DIGEST = 8


def hash_seed(*parts: str) -> int:
    """A seed from the things every block's KV depends on."""
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=_DIGEST).digest()
    return int.from_bytes(digest, "little")


def salted(seed: int, salt: str) -> int:
    """The chain's start for one tenant (salt "": the shared default)."""
    return seed if not salt else hash_seed(str(seed), salt)


def extend_block_hashes(hashes: list[int], tokens: Sequence[int], block_size: int,
                        num_blocks: int, start: int) -> None:
    """Append names until `hashes` covers the first `num_blocks` full blocks
    of `tokens`; `start` names the empty prefix."""
    prev = hashes[-1] if hashes else start
    for b in range(len(hashes), num_blocks):
        block = array("q", tokens[b * block_size:(b + 1) * block_size])
        h = hashlib.blake2b(block.tobytes(), digest_size=_DIGEST,
                            key=prev.to_bytes(_DIGEST, "little"))
        prev = int.from_bytes(h.digest(), "little")
        hashes.append(prev)
