"""Admission and KV blocks: which waiting sequences start, the blocks each running sequence
holds, and preemption when blocks run out.

Policy: first come, first served. A sequence is admitted when a row is free and the pool can
give the blocks of its whole prompt plus one cycle's room (`margin`), after whatever the prefix
cache already holds, and still keep a block per running sequence for its growth. While decoding, each sequence holds blocks up to its length plus the margin
(two cycles' writes, since a draft may be queued behind a verify), taken just before the step;
a cycle's rejected drafts were written inside that margin, so they cost no blocks. When a
running sequence needs a block and none is left, the most recently arrived running sequence
is preempted: its blocks are released (its full prompt blocks stay in the prefix cache when it
is on) and it waits at the head of the queue to be prefilled again over all its tokens but the
last, then continues exactly where it stopped (the tokens it already produced are kept, sampled
draws depend only on the seed and the position).

Hysteresis: a preemption raises `caution` to 1, and while it is above 0 an admission also keeps
free that fraction of the blocks every running sequence and the newcomer may still grow into
(up to its max_tokens); it relaxes to 0 over CAUTION_STEPS steps. So a preempted sequence comes
back when it can run to its end rather than to be preempted again at once, and a pool whose
sequences end early (EOS) soon admits as eagerly as before.
"""

from __future__ import annotations

from specserve.engine.block_pool import BlockPool
from specserve.engine.sequence import Sequence

CAUTION_STEPS = 32


class Scheduler:
    def __init__(self, kv, prefix_cache: bool, margin: int):
        self.kv = kv
        self.pool = BlockPool(kv.num_blocks, kv.block_size, prefix_cache)
        self.margin = margin
        self.max_len = (kv.max_blocks - 1) * kv.block_size  # indices a row can hold (before its null column)
        self.preemptions = 0
        self.caution = 0.0  # see the module doc

    def blocks_for(self, n_tokens: int) -> int:
        return -(-min(n_tokens, self.max_len) // self.kv.block_size)

    def step(self) -> None:
        """Once per engine step, before admissions."""
        self.caution = max(0.0, self.caution - 1 / CAUTION_STEPS)

    def final_blocks(self, seq: Sequence) -> int:
        """The blocks `seq` holds when it has produced all its max_tokens."""
        return self.blocks_for(len(seq.prompt_ids) + seq.params.max_tokens + self.margin)

    def admit(self, seq: Sequence, row: int, running: list[Sequence]) -> bool:
        """Give `seq` its prefix-cache hit and the blocks for the rest of its prefill; False (nothing
        changed) when the pool cannot. One block per running sequence stays free for their growth,
        so an admission does not at once preempt a sequence already decoding; more after a
        preemption (see the module doc)."""
        tokens = seq.tokens(0, seq.prefill_len)
        hit = self.pool.match(tokens)
        full = self.blocks_for(seq.prefill_len + self.margin)
        need = full - len(hit)
        reserve = len(running)
        if self.caution:
            growth = sum(max(self.final_blocks(s) - len(s.blocks), 0) for s in running)
            growth += max(self.final_blocks(seq) - full, 0)
            reserve = max(reserve, int(self.caution * growth))
        idle_hits = sum(1 for b in hit if self.pool.refs[b] == 0)  # counted in available() but not takeable
        if need + reserve > self.pool.available() - idle_hits:
            return False
        self.pool.acquire(hit)
        seq.blocks = hit + self.pool.allocate(need)
        if self.pool.prefix_cache and not seq.resumed:
            self.pool.queried_tokens += seq.prefill_len
            self.pool.hit_tokens += len(hit) * self.kv.block_size
        seq.prefilled = seq.num_cached = len(hit) * self.kv.block_size
        self.kv.set_row(row, seq.blocks)
        return True

    def prefilled(self, seq: Sequence) -> None:
        """After a prefill chunk: the blocks it completed become findable by content (those whose
        next token is in the prefill too), so a long prompt's blocks serve later arrivals at once."""
        self.pool.register(seq.blocks, seq.tokens(0, min(seq.prefilled + 1, seq.prefill_len)))

    def grow(self, seq: Sequence) -> bool:
        """Blocks up to the sequence's length plus the margin; False when the pool has too few."""
        need = self.blocks_for(seq.num_cached + self.margin) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.pool.available():
            return False
        seq.blocks += self.pool.allocate(need)
        self.kv.set_row(seq.row, seq.blocks)
        return True

    def release(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and reset it to be prefilled again (see the module doc)."""
        self.release(seq)
        self.preemptions += 1
        self.caution = 1.0
        seq.prefill_len = seq.total_len - 1
        seq.prefilled = seq.num_cached = seq.pending = seq.stale = 0
