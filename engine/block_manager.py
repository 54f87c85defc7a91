"""Paged KV pool: free/used blocks, ref counts and a chained-hash prefix cache."""
from __future__ import annotations

import random
from collections import deque

import numpy as np
import xxhash

from engine.sequence import Sequence


def chain_hash(token_ids: list[int], prefix: int = -1) -> int:
    """xxhash64 of a full block's token ids, chained to the previous block's hash."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def set_hash(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = list(token_ids)

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, shuffle_blocks: int | None = None,
                 enable_prefix_caching: bool = True):
        """``shuffle_blocks``: a seed; the free list then starts in that seeded shuffled order instead of
        0, 1, 2, ... (a teaching switch: slots stop following positions, the slot formula still holds).
        ``enable_prefix_caching`` False: no lookup ever hits (blocks are still hashed), vLLM's
        ``--no-enable-prefix-caching``."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        order = list(range(num_blocks))
        if shuffle_blocks is not None:
            random.Random(shuffle_blocks).shuffle(order)
        self.free_block_ids: deque[int] = deque(order)
        self.used_block_ids: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash (free blocks only keep their data); returns how many were dropped.
        Refused while blocks are in use: their hashes still describe live sequences."""
        if self.used_block_ids:
            raise RuntimeError(f"cannot reset the prefix cache while {len(self.used_block_ids)} blocks are in use")
        dropped = len(self.hash_to_block_id)
        self.hash_to_block_id.clear()
        for block in self.blocks:
            block.hash, block.token_ids = -1, []
        return dropped

    # -- prefix lookup ---------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached full-block prefix of seq.

        Only the first num_blocks - 1 blocks are looked up, so at least one token is always left
        to compute (its logits give the next token): 620 tokens can hit 2 blocks, 512 at most 1.
        """
        hits: list[int] = []
        h = -1
        if not self.enable_prefix_caching:
            return hits
        for i in range(seq.num_blocks - 1):
            token_ids = seq.block(i)
            if len(token_ids) != self.block_size:
                break
            h = chain_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def num_cached_tokens_for(self, seq: Sequence) -> int:
        return len(self.cached_prefix(seq)) * self.block_size

    # -- allocation ------------------------------------------------------
    def can_allocate(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        """Whether seq's blocks fit, given its prefix hits (looked up here when not handed in)."""
        hits = self.cached_prefix(seq) if hits is None else hits
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return seq.num_blocks - len(hits) + revived <= self.num_free_blocks

    def _take_free_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]   # overwritten: its old contents are gone
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _share_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_block_ids.remove(block_id)
            self.used_block_ids.add(block_id)
        block.ref_count += 1

    def allocate(self, seq: Sequence, hits: list[int] | None = None) -> None:
        """Give seq its blocks: the prefix hits shared (the ones can_allocate saw, so the prefix is hashed
        once per admission), the rest fresh."""
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks")
        hits = self.cached_prefix(seq) if hits is None else hits
        for block_id in hits:
            self._share_block(block_id)
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        if seq.num_prefix_hit_tokens is None:          # the first admission's hits (a preempted seq re-admits)
            seq.num_prefix_hit_tokens = seq.num_cached_tokens
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = self.blocks[hits[-1]].hash if hits else -1
        for _ in range(seq.num_blocks - len(hits)):
            seq.block_table.append(self._take_free_block())

    def deallocate(self, seq: Sequence) -> list[int]:
        """Drop seq's references; blocks reaching 0 go back to the free list (hash kept). Returns those."""
        freed = []
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.discard(block_id)
                self.free_block_ids.append(block_id)
                freed.append(block_id)
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0
        seq.last_block_hash = -1
        seq.block_table.clear()
        return freed

    # -- growth during decode ---------------------------------------------
    def blocks_needed_to_append(self, seq: Sequence, ahead: int = 0) -> int:
        """Blocks seq lacks for its tokens plus `ahead` more (a decode step launched before the previous
        step's token is on the host computes one position further)."""
        needed = (seq.num_tokens + ahead + self.block_size - 1) // self.block_size
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, ahead: int = 0) -> bool:
        return self.blocks_needed_to_append(seq, ahead) <= self.num_free_blocks

    def may_append(self, seq: Sequence, ahead: int = 0) -> None:
        """Before a decode step: give seq a new block when its newest token starts one (len % B == 1)."""
        for _ in range(self.blocks_needed_to_append(seq, ahead)):
            seq.block_table.append(self._take_free_block())

    # -- after compute -----------------------------------------------------
    def hash_blocks(self, seq: Sequence) -> None:
        """Register every full block whose KV is now computed, so later requests can reuse it."""
        h = seq.last_block_hash
        for i in range(seq.num_hashed_blocks, seq.num_cached_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = chain_hash(token_ids, h)
            if block.hash != h:
                if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block.block_id:
                    del self.hash_to_block_id[block.hash]
                block.set_hash(h, token_ids)
                self.hash_to_block_id.setdefault(h, block.block_id)
            seq.num_hashed_blocks = i + 1
            seq.last_block_hash = h

    def ref_counts(self, block_ids: list[int]) -> list[int]:
        return [self.blocks[b].ref_count for b in block_ids]

    def block_hashes(self, block_ids: list[int]) -> list[int | None]:
        """The hash each block holds (None: none, e.g. a partial or never-computed block)."""
        return [None if self.blocks[b].hash == -1 else self.blocks[b].hash for b in block_ids]

    def pool_snapshot(self) -> list[dict]:
        """Every block in use or still holding a hash (free but cached), by id: id, ref_count, hashed."""
        return [{"id": b.block_id, "ref_count": b.ref_count, "hashed": b.hash != -1}
                for b in self.blocks if b.ref_count > 0 or b.hash != -1]
