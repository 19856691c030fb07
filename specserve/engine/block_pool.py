"""Which KV blocks are free, who holds each, and the prefix cache (host-side bookkeeping only;
the memory itself is `kv_cache.KVCache`'s).

Block 0 is the null block: unused block-table entries and the scratch slot point at it, so
padding tokens write there and no real query reads it. It is never handed out.

Prefix cache: a full block of prompt KV is found again by its content. Its key is (the key id
of the block before it, its tokens, the token after it): the chain makes a block's key stand
for the whole prefix up to it, and the token after it is part of the key because the drafter's
KV at a block's last index is computed from the target's feature there and the next token (an
EAGLE entry pairs feature t with token t + 1). Keys are compared exactly (tuples in a dict), so
two prompts never share a block unless their tokens are equal. A cached block nobody holds
stays filled and is evicted least recently used first when a block is needed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool):
        if num_blocks < 2:
            raise ValueError("a block pool needs the null block and at least one more")
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody; oldest use first
        self.block_of: dict[tuple, int] = {}
        self.key_of: dict[int, tuple] = {}
        self.key_id: dict[int, int] = {}  # block -> id of its key, the next block's parent
        self._ids = itertools.count(1)
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.evictions = 0

    @property
    def usable(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1

    def available(self) -> int:
        """Blocks an allocation can take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    def used(self) -> int:
        return self.usable - self.available()

    def _key(self, parent: int, tokens: list[int], j: int) -> tuple:
        bs = self.block_size
        return parent, tuple(tokens[j * bs : (j + 1) * bs]), tokens[(j + 1) * bs]

    def match(self, tokens: list[int]) -> list[int]:
        """The cached blocks holding the longest prefix of `tokens` (whole blocks, each followed by
        at least one more token). Changes nothing."""
        if not self.prefix_cache:
            return []
        out, parent = [], 0
        for j in range(self.full_blocks(len(tokens))):
            block = self.block_of.get(self._key(parent, tokens, j))
            if block is None:
                break
            out.append(block)
            parent = self.key_id[block]
        return out

    def full_blocks(self, n_tokens: int) -> int:
        """Whole blocks of an n-token prefix that are followed by at least one more token."""
        return max(n_tokens - 1, 0) // self.block_size

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in blocks:
            if self.refs[b] == 0:
                self.evictable.pop(b, None)
            self.refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks, evicting cached ones nobody holds (least recently used) when none are
        free. The caller checks `available()` first."""
        if n > self.available():
            raise RuntimeError(f"{n} KV blocks asked, {self.available()} available")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._forget(b)
                self.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference per block; cached blocks nobody holds become evictable, others free."""
        for b in reversed(blocks):  # the tail first: the prefix's head is the most shared, evicted last
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise AssertionError(f"KV block {b} released more often than taken")
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def register(self, blocks: list[int], tokens: list[int]) -> None:
        """Make the full blocks of `tokens` (KV computed, held in `blocks`) findable by content.
        A block whose content is already cached under another block stays private."""
        if not self.prefix_cache:
            return
        parent = 0
        for j in range(min(self.full_blocks(len(tokens)), len(blocks))):
            key = self._key(parent, tokens, j)
            have = self.block_of.get(key)
            if have is None and blocks[j] not in self.key_of:
                have = blocks[j]
                self.block_of[key], self.key_of[have], self.key_id[have] = have, key, next(self._ids)
            if have is None:
                return
            parent = self.key_id[have]

    def _forget(self, b: int) -> None:
        key = self.key_of.pop(b, None)
        if key is not None:
            del self.block_of[key]
            del self.key_id[b]

    def clear_cache(self) -> None:
        """Forget every cached block nobody holds (their KV would no longer be valid)."""
        while self.evictable:
            b, _ = self.evictable.popitem(last=False)
            self._forget(b)
            self.free.append(b)
        for b in list(self.key_of):
            self._forget(b)

    def check_idle(self) -> None:
        """When no sequence holds blocks: every reference count is zero and every block is either
        free or cached-evictable, exactly once. Raises AssertionError naming what is wrong."""
        held = [b for b in range(1, self.num_blocks) if self.refs[b]]
        if held:
            raise AssertionError(f"KV blocks still referenced while idle: {held[:16]}")
        seen = list(self.free) + list(self.evictable)
        if len(seen) != len(set(seen)) or set(seen) != set(range(1, self.num_blocks)):
            raise AssertionError(
                f"KV block lists broken: {len(seen)} listed, {len(set(seen))} distinct, {self.usable} blocks"
            )
        if set(self.evictable) != set(self.key_of) or len(self.block_of) != len(self.key_of):
            raise AssertionError("prefix cache index out of step with the evictable blocks")

    def stats(self) -> dict:
        return {
            "blocks_total": self.usable,
            "blocks_used": self.used(),
            "blocks_free": len(self.free),
            "blocks_cached": len(self.key_of),
            "block_size": self.block_size,
            "prefix_cache": self.prefix_cache,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_queried_tokens": self.queried_tokens,
            "prefix_evictions": self.evictions,
        }
