"""Drafting: the drafter's pending inputs and the chain or tree draft of a cycle.

The drafter reads (feature_t, token_t+1) entries: the target's EAGLE features at a
position and the token that follows it. Entries the drafter has not yet seen wait in
per-row pending buffers (`PendingInputs`): written by prefill, plain steps and verify,
consumed by the next draft's extend. Plain steps in adaptive mode store theirs only while
the buffers have room and feed none to the drafter; past that they store nothing, and the
first cycle after them recomputes the missing features (`Proposer.catch_up`), so a long
stretch of plain decoding costs what plain decoding costs. `Proposer` is what the engine
calls: it turns a batch's bookkeeping into entry positions and queues the draft (a tree at
batch sizes that draft trees, else a chain) through the runner's graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.sampling import BatchSampling, to_device
from specserve.spec.policy import EXPLORE_EVERY

# Drafter inputs buffered per sequence while speculation is paused: enough for the plain steps
# between two explorations of speculation at a batch bucket, after which catching up is one
# drafter forward over them; past that a catch-up recomputes the target's features (a prefill:
# on the 2-core CPU, batch 4, about a third of what the decode steps it covers took).
PENDING_WIDTH = 2 * EXPLORE_EVERY


@dataclass
class TreeDraft:
    """N draft nodes per sequence, parents before children. Verify row 0 is the root (the last
    accepted token); node j sits in verify row j + 1."""

    tokens: torch.Tensor  # [B, N] target ids
    parents: torch.Tensor  # [B, N] verify row of each node's parent (0 = the root)
    depth: torch.Tensor  # [B, N] 1..K
    anc: torch.Tensor  # [B, N] int64, bit i set: node i is the node itself or one of its ancestors

    def head(self, B: int, N: int) -> "TreeDraft":
        """Views of the first B rows and N nodes."""
        return TreeDraft(self.tokens[:B, :N], self.parents[:B, :N], self.depth[:B, :N], self.anc[:B, :N])


@dataclass
class DraftResult:
    tokens: torch.Tensor  # [B, K] target ids


class PendingInputs:
    """Per row, the drafter entries not yet fed to it: tokens [rows, width] and features
    [rows, width, 3H], entry i of a row at sequence position (num_cached - pending + i). The
    last `stale` of a sequence's pending entries are not stored (`Proposer.catch_up`)."""

    def __init__(self, rows: int, width: int, feat_dim: int, dtype: torch.dtype, device: torch.device):
        self.width = width
        self.tok = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.feat = torch.zeros(rows, width, feat_dim, dtype=dtype, device=device)

    def move_row(self, src: int, dst: int, n: int) -> None:
        """Copy a row's first `n` entries to another row."""
        self.tok[dst, :n] = self.tok[src, :n]
        self.feat[dst, :n] = self.feat[src, :n]

    def set_first(self, row: int, tok: torch.Tensor, feat: torch.Tensor) -> None:
        """A prompt's last entry, left for its first cycle."""
        self.tok[row, 0] = tok
        self.feat[row, 0] = feat

    def set_at(self, rows: torch.Tensor, at: torch.Tensor, tok: torch.Tensor, feat: torch.Tensor) -> None:
        """A plain step's entries: row rows[b] at slot at[b] (device tensors, nothing read back)."""
        self.tok[rows, at] = tok
        self.feat[rows, at] = feat

    def set_cycle(self, B: int, tok: torch.Tensor, feat: torch.Tensor) -> None:
        """A chain cycle's entries for the next one: the first K + 1 slots of rows 0..B-1."""
        W = tok.shape[1]
        self.tok[:B, :W] = tok
        self.feat[:B, :W] = feat

    def set_cycle_except(self, B: int, pad: torch.Tensor, tok: torch.Tensor, feat: torch.Tensor) -> None:
        """As `set_cycle`, leaving padding rows (`pad` [B, 1]) untouched: in a graph padded to its
        batch bucket they may belong to sequences still in prefill."""
        W = tok.shape[1]
        self.tok[:B, :W] = torch.where(pad, self.tok[:B, :W], tok)
        self.feat[:B, :W] = torch.where(pad.unsqueeze(-1), self.feat[:B, :W], feat)


class Proposer:
    """The engine's side of drafting: entry positions, feeding pending entries to the drafter and
    queueing a cycle's draft. Every method takes and leaves device tensors (nothing read back), so
    each can be queued ahead of the host (`overlap`)."""

    def __init__(self, runner):
        self.runner = runner
        self.device = runner.device
        self.pending: PendingInputs = runner.pending
        self.width = runner.pending.width
        self.scratch = runner.scratch
        # Drafting is skipped (acceptance forced to 0) where the drafter would pass its trained positions.
        self.max_pos: int | None = runner.drafter_max_pos
        self.drafts_tree = runner.cfg.spec.drafts_tree

    def entry_positions(self, K: int, start: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """[B, K + 1] positions of each row's drafter entries: start .. start + last (none where
        last is -1), the scratch slot after them."""
        j = torch.arange(K + 1, device=self.device)
        return torch.where(j <= last.unsqueeze(1), start.unsqueeze(1) + j, self.scratch)

    def feed(self, B: int, width: int, start: torch.Tensor, fed: torch.Tensor, keep: int) -> None:
        """Feed the drafter the first fed[b] of row b's pending entries (at positions start[b]..),
        then move the `keep` entries after them to the front: one drafter forward and one gather
        for all rows, since per-row copies cost two kernel launches per sequence."""
        j = torch.arange(width, device=self.device)
        pos = torch.where(j < fed.unsqueeze(1), start.unsqueeze(1) + j, self.scratch)
        p = self.pending
        self.runner.drafter_extend(0, p.tok[:B, :width], p.feat[:B, :width], pos)
        src = (fed.unsqueeze(1) + j[:keep]).clamp(max=width - 1)  # rows with nothing fed keep theirs in place
        p.tok[:B, :keep] = p.tok[:B, :width].gather(1, src)
        feat = p.feat[:B, :width]
        p.feat[:B, :keep] = feat.gather(1, src.unsqueeze(-1).expand(-1, -1, feat.shape[-1]))

    def flush(self, seqs, keep: int) -> None:
        """Feed the drafter all but the last `keep` pending entries of each row, then move those
        `keep` entries to the front."""
        start = to_device([s.num_cached - s.pending for s in seqs], self.device)
        fed = to_device([max(s.pending - keep, 0) for s in seqs], self.device)
        self.feed(len(seqs), max(s.pending for s in seqs), start, fed, keep)
        for s in seqs:
            s.pending = min(s.pending, keep)

    def catch_up(self, seqs, budget: int) -> None:
        """Bring stale sequences back to one pending entry, as after a prefill: feed the drafter the
        entries their buffers hold, then recompute the target's features at the positions whose
        entries were not stored (a prefill over known tokens, in pieces of at most `budget` tokens;
        it rewrites those positions' target KV with the values decoding wrote, up to rounding as a
        verify's, in blocks only this sequence holds, since plain steps wrote them) and write the
        drafter's KV for those entries."""
        held = [s.pending - s.stale if s.stale else 0 for s in seqs]
        if any(held):
            start = to_device([s.num_cached - s.pending for s in seqs], self.device)
            self.feed(len(seqs), max(held), start, to_device(held, self.device), keep=0)
        left = [s.stale for s in seqs]
        per_row = max(1, budget // len(seqs))  # every row's chunk is padded to the longest
        while any(left):
            chunks, starts, done = [], [], []
            for i, seq in enumerate(seqs):
                take = min(left[i], per_row)
                starts.append(seq.num_cached - left[i])
                chunks.append(seq.tokens(starts[-1], starts[-1] + take))
                left[i] -= take
                if take and not left[i]:
                    done.append(i)
            ends = [bool(c) and not left[i] for i, c in enumerate(chunks)]
            _, feats = self.runner.prefill(
                0,
                chunks,
                starts,
                self.runner.prefill_history(seqs, chunks, starts),
                self.after(seqs, chunks, starts, ends),
            )
            self.prefilled(seqs, done, [seqs[i].token_at(starts[i] + len(chunks[i])) for i in done], feats)
        for seq in seqs:
            if seq.stale:
                seq.pending, seq.stale = 1, 0

    def draft(self, B: int, K: int, entry_pos: torch.Tensor, last_idx: torch.Tensor, sampling: BatchSampling):
        """Queue a cycle's draft: a tree at batch sizes that draft trees, else a chain."""
        if self.drafts_tree(B):
            return self.runner.draft_tree(K, entry_pos, last_idx)
        return self.runner.draft(K, entry_pos, last_idx, sampling)

    def draft_batch(self, seqs, K: int, spec_ok: list[bool], sampling: BatchSampling):
        """The draft of a cycle from the batch's bookkeeping: each row's pending entries, none for
        rows past the drafter's positions (`spec_ok` False). Pending entries beyond K + 1 must be
        flushed first."""
        start = to_device([s.num_cached - s.pending for s in seqs], self.device)
        last_idx = to_device([s.pending - 1 for s in seqs], self.device)
        entries = to_device([s.pending - 1 if ok else -1 for s, ok in zip(seqs, spec_ok)], self.device)
        return self.draft(len(seqs), K, self.entry_positions(K, start, entries), last_idx, sampling)

    @staticmethod
    def after(seqs, chunks, starts, ends: list[bool]) -> list[int]:
        """The runner's `prefill(after=...)`: each row's token after its chunk, -1 where the chunk ends the
        row's prefill (that last entry is left pending for the first cycle: `prefilled`)."""
        return [-1 if end or not c else seq.token_at(s + len(c)) for seq, c, s, end in zip(seqs, chunks, starts, ends)]

    def prefilled(self, seqs, done: list[int], tokens: list[int], feats: torch.Tensor) -> None:
        """Rows `done` (indices into seqs) ended their prefill: each one's last entry (its last chunk
        token's features `feats[i]`, and the token after it, `tokens`) waits for the first cycle."""
        if not done:
            return
        rows = to_device([seqs[i].row for i in done], self.device)
        at = torch.zeros_like(rows)
        self.pending.set_at(rows, at, to_device(tokens, self.device), feats[to_device(done, self.device)])
