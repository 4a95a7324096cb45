"""BlockManager: fixed-size KV blocks, reference counts and the prefix cache.

Block ids index the main and the draft cache alike: a sequence's block table
addresses both. A full block whose entries are final is registered under the
chained hash of every token up to its end; a later request with the same
prefix reuses it. Freed blocks keep their hash until they are handed out
again, so a recently finished prompt can still be hit.

With an MTP draft the draft entry at a block's last position was computed
from the NEXT token too (and from the main hidden state there, which is not
kept). So the key of a block also covers the one token after it
(`lookahead=1`): a hit then serves only entries computed from exactly the
request's tokens, and the draft's first uncached position gets its hidden
state from this step's main forward instead of a stale or missing one.

Adaptive depth's steps at k = 0 write no draft keys (ModelRunner._fill_draft_keys writes them at the
next step that drafts), so a block is published with whether its draft keys were all written then:
a hit on blocks that hold them all needs no fill; one that does not fills from the first such block.
"""

from __future__ import annotations

from collections import OrderedDict

from mtp_runtime.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chain_hash(prev_hash: int, token_ids: list[int]) -> int:
    return hash((prev_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "draft_keys")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not registered in the prefix cache
        self.token_ids: tuple[int, ...] = ()
        self.draft_keys = True  # (registered) the draft's keys at its every position were written


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = False,
                 lookahead: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.lookahead = lookahead  # tokens after a block that its key covers (1 with MTP)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_hit_tokens = 0  # tokens served from the prefix cache so far

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_slots: int) -> int:
        return cdiv(num_slots, self.block_size)

    # prefix cache ---------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            j = len(hashes)
            prev = hashes[-1] if hashes else -1
            hashes.append(chain_hash(prev, self._key_tokens(seq, j)))
        return hashes[:num_full_blocks]

    def _key_tokens(self, seq: Sequence, j: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(seq.token_ids[j * bs:(j + 1) * bs + self.lookahead])

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached block ids for the leading full blocks of `seq` (at least one token stays uncached)."""
        if not self.enable_prefix_cache or seq.block_table:
            return []
        bs = self.block_size
        hits: list[int] = []
        # (len - 1) // bs: the last token always stays uncached, so the step has logits to sample.
        for j, h in enumerate(self._block_hashes(seq, (len(seq) - 1) // bs)):
            block_id = self.hash_to_block_id.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self._key_tokens(seq, j):
                break
            hits.append(block_id)
        return hits

    def register_full_blocks(self, seq: Sequence, num_valid_tokens: int) -> None:
        """Publish the blocks whose every entry is final (computed from accepted tokens)."""
        if not self.enable_prefix_cache:
            return
        bs = self.block_size
        num_full = min(num_valid_tokens, len(seq) - self.lookahead) // bs
        hashes = self._block_hashes(seq, num_full)
        gap = seq.draft_keys_from  # the first position whose draft key a step at k = 0 left out (None: none)
        for j in range(num_full):
            block = self.blocks[seq.block_table[j]]
            if block.hash != -1:
                continue
            if hashes[j] in self.hash_to_block_id:
                continue  # same prefix already published by another block: keep that one
            block.hash = hashes[j]
            block.token_ids = self._key_tokens(seq, j)
            block.draft_keys = gap is None or gap >= (j + 1) * bs
            self.hash_to_block_id[block.hash] = block.block_id

    # allocation -----------------------------------------------------------

    def free_blocks_needed(self, seq: Sequence, num_slots: int, hits: list[int] = ()) -> int:
        """Free-list blocks consumed to give `seq` `num_slots` cache slots (after taking `hits`)."""
        have = len(seq.block_table) + len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return max(0, self.blocks_for(num_slots) - have) + revived

    def can_reserve(self, seq: Sequence, num_slots: int, hits: list[int] = ()) -> bool:
        return self.free_blocks_needed(seq, num_slots, hits) <= self.num_free_blocks

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Share the hit blocks with `seq`; their entries count as cached."""
        assert not seq.block_table, "take_prefix is only for a sequence without blocks"
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_hit_tokens += seq.num_cached_tokens
        # steps at adaptive depth's k = 0 may have left some blocks' draft keys out: the next step that
        # drafts writes them from the first such block on (a hit on blocks that hold them all fills none)
        missing = next((j for j, block_id in enumerate(hits) if not self.blocks[block_id].draft_keys), None)
        if missing is not None:
            seq.draft_keys_from = missing * self.block_size

    def reserve(self, seq: Sequence, num_slots: int) -> None:
        """Grow the block table of `seq` to at least `num_slots` slots."""
        need = self.blocks_for(num_slots) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq!r} needs {need}, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash != -1:
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash = -1
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        # Tail blocks go to the free list first so they are reused first and
        # the shared prefix blocks survive longest.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
