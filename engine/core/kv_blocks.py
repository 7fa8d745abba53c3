"""Paged KV cache blocks: a free list, reference counts and a prefix cache.

A block holds the K/V of `block_size` consecutive tokens of one sequence. Full, computed blocks are
registered under a hash of their tokens chained with the hash of everything before them, so a later
sequence whose tokens start the same way (a shared system prompt, the earlier turns of a chat) can
reuse them instead of recomputing. A cached block whose last user freed it stays cached (reference
count 0, "evictable") until a new block is needed and no never-cached free block remains; then the
least recently freed one is evicted. Plain Python over ints: no torch, no numpy.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Iterable

from engine.core.sequence import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """A collision-resistant digest of one full block and everything before it; `extra` is what
    else decides the block's K/V beside its tokens (the content hashes of the images whose tokens
    it holds: the same <|patch|> ids stand for any image).

    Why a cryptographic hash and not Python's `hash`: a collision would serve one request the K/V
    of another's text, and int hashes are easy to collide on purpose."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", token_ids).tobytes())
    if extra:
        digest.update(b"images")
        digest.update(extra)
    return digest.digest()


def lora_root(lora_id: int) -> BlockHash | None:
    """The hash a sequence's first block chains from: None for the base; for an adapter, its engine
    lora id (never reused, a hot-swapped adapter gets a new one), since its K/V differ from the base's."""
    return None if lora_id == 0 else hash_block(None, [-1, lora_id])


def images_in_block(seq: Sequence, start: int, end: int) -> bytes:
    """The content hashes of the images whose token spans overlap tokens [start, end)."""
    return b"".join(p.image.content_hash for p in seq.images if p.offset < end and p.offset + p.length > start)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks  # [num_blocks]
        self._hashes: list[BlockHash | None] = [None] * num_blocks  # [num_blocks] hash a block is cached under
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached; least recently freed first
        self._cached: dict[BlockHash, int] = {}  # hash -> block id
        # prefix-cache accounting, in tokens (the scheduler reports each admission once)
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks no sequence holds: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest run of seq's leading full blocks.

        Never the whole sequence: the last token must be computed to get logits for the next one."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._hash_full_blocks(seq, max_blocks)
        hits: list[int] = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries_tokens += num_queried_tokens
        self.prefix_hits_tokens += num_hit_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose K/V is now computed, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_registered_blocks:
            return
        self._hash_full_blocks(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block_id, block_hash = seq.block_table[i], seq.block_hashes[i]
            # A block that came from the cache is registered already; a duplicate of a block another
            # sequence computed at the same time stays private and goes back to the free list.
            if self._hashes[block_id] is None and block_hash not in self._cached:
                self._cached[block_hash] = block_id
                self._hashes[block_id] = block_hash
        seq.num_registered_blocks = num_full

    def _hash_full_blocks(self, seq: Sequence, num_blocks: int) -> None:
        size = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[i - 1] if i else lora_root(seq.lora_id)
            extra = images_in_block(seq, i * size, (i + 1) * size) if seq.images else b""
            hashes.append(hash_block(parent, seq.token_ids[i * size : (i + 1) * size], extra))

    # ------------------------------------------------------------------ allocation
    def num_blocks_to_allocate(self, seq: Sequence, num_tokens: int, cached_blocks: Iterable[int] = ()) -> int:
        """Free blocks that covering seq's first num_tokens tokens would consume."""
        cached = list(cached_blocks)
        new = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(cached))
        reviving = sum(1 for block_id in cached if self._ref_counts[block_id] == 0)  # leave the evictable set
        return new + reviving

    def can_allocate(self, seq: Sequence, num_tokens: int, cached_blocks: Iterable[int] = ()) -> bool:
        return self.num_blocks_to_allocate(seq, num_tokens, cached_blocks) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: Iterable[int] = ()) -> bool:
        """Grow seq's block table (cached blocks first) to cover its first num_tokens tokens.

        All or nothing: returns False and changes nothing when the blocks do not fit."""
        cached = list(cached_blocks)
        if not self.can_allocate(seq, num_tokens, cached):
            return False
        if cached:
            if seq.block_table:
                raise ValueError("cached prefix blocks go only into an empty block table")
            for block_id in cached:
                self._touch(block_id)
            seq.block_table.extend(cached)
            seq.num_registered_blocks = len(cached)  # they are in the cache already
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on its blocks. Tail blocks go first, so they are evicted before the
        prefix blocks other requests are more likely to share."""
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self._hashes[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past its first num_tokens tokens (speculative decoding allocated room
        for drafts that were rejected). Such blocks hold no committed token, so none is registered."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.appendleft(block_id)  # reused first: the next speculation will want it again

    def _touch(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    def _take(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            del self._cached[self._hashes[block_id]]  # type: ignore[arg-type]
            self._hashes[block_id] = None
            self.num_evictions += 1
        self._ref_counts[block_id] = 1
        return block_id
