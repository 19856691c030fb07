"""Work queued on the device ahead of the host.

Reading a step's tokens makes the host wait for the GPU, and the host's bookkeeping after
it leaves the GPU idle. While the batch stays as it is, the next piece of work is queued
before the current one is read: the next plain step (its input is this step's sampled
token, already on the device), or the next speculative cycle's draft (its inputs are this
cycle's accepted entries, also on the device). `Overlap` holds what is queued and decides
whether queueing is safe; the engine consumes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specserve.engine.profiling import Mark
from specserve.spec.policy import batch_context


@dataclass
class Launched:
    """A plain decode step queued on the device: its sampled tokens, and their host copy."""

    seqs: list
    tokens: torch.Tensor  # [B] on the device
    pos: torch.Tensor  # [B] positions of the step's input tokens
    read: Callable[[], list[list[int]]]  # waits for the tokens' host copy (`host_lists`)
    pending_at: torch.Tensor | None = None  # [B] drafter-input slot each token was written to (drafting)
    logprobs: object = None  # engine.logprobs.LogprobBatch of the rows whose requests ask for them

    def token_list(self) -> list[int]:
        return self.read()[0]


@dataclass
class DraftAhead:
    """A speculative cycle's draft queued behind the previous cycle's verify, before its results
    were read: valid for the same batch (serials) and K."""

    serials: list[int]
    K: int
    draft: object  # DraftResult (chain) or TreeDraft
    marks: list | None  # profile marks around it


class Overlap:
    """What is queued ahead: a plain step (`plain`), a cycle's draft (`draft`) and the K chosen for
    it (`chosen`). `enabled` only on CUDA, where the device runs asynchronously (tests switch it on
    elsewhere)."""

    def __init__(self, device: torch.device, max_model_len: int):
        self.device = device
        self.enabled = device.type == "cuda"
        self.max_model_len = max_model_len
        self.plain: Launched | None = None  # a plain step queued before the last one was read
        self.draft: DraftAhead | None = None  # a cycle's draft queued before the last cycle was read
        self.chosen: int | None = None  # K for the next step, when chosen early (with a draft queued ahead)
        self.drafts_used = 0  # speculative cycles whose draft was queued behind the previous verify

    def clear(self) -> None:
        self.plain = self.draft = self.chosen = None

    def may_queue_plain(self, seqs, batch_fixed: bool) -> bool:
        """Queue the next plain step before reading this one's tokens? With nothing waiting to join
        (`batch_fixed`) and no sequence ending by length this step. (Whether the queued step stores
        drafter inputs is the engine's choice: plain steps never feed the drafter.)"""
        if not self.enabled or not batch_fixed:
            return False
        limit = self.max_model_len
        return all(len(s.output_ids) + 1 < s.params.max_tokens and s.total_len + 2 < limit for s in seqs)

    def queue_draft(
        self,
        seqs,
        K: int,
        n_acc: torch.Tensor,
        pos0: torch.Tensor,
        sampling,
        batch_fixed: bool,
        policy,
        proposer,
        profile: bool,
        remaining: list[int] | None = None,
    ) -> int:
        """Choose the next step's K now and, where the batch should stay as it is, queue that cycle's
        draft behind this cycle's verify: the GPU then drafts while the host reads and books this
        cycle's tokens, instead of idling through the cycle's host work. Its inputs are known on the
        device: the entries at pos0 .. pos0 + accepted. A smaller next K first feeds the drafter the
        entries its draft has no room for, on the device too, so cycles after a switch down overlap
        as others do (otherwise the adaptive policy would time such K slower than they run and
        favour larger ones). Not when a sequence may end by length this cycle or new requests wait
        (the batch would change). `remaining`: as for SpecPolicy.choose (budgets before this cycle's
        tokens). Returns how many pending entries each row keeps (K + 1: all)."""
        if not self.enabled or not batch_fixed:
            return K + 1
        if not all(
            len(s.output_ids) + K + 1 < s.params.max_tokens and s.total_len + K + 1 < self.max_model_len for s in seqs
        ):
            return K + 1
        B = len(seqs)
        K2 = self.chosen = policy.choose(B, remaining, context=batch_context(seqs))
        limit = proposer.max_pos
        if K2 == 0 or (limit is not None and any(s.num_cached + K + 1 + K2 > limit for s in seqs)):
            return K + 1
        marks = [Mark(self.device) for _ in range(2)] if profile else None
        if marks:
            marks[0].record()
        last = n_acc
        if K2 < K:  # entries 0 .. a - K2 - 1 go to the drafter now; the rest move to the front
            fed = (n_acc - K2).clamp_min(0)
            proposer.feed(B, K + 1, pos0, fed, K2 + 1)
            pos0, last = pos0 + fed, n_acc - fed
        draft = proposer.draft(B, K2, proposer.entry_positions(K2, pos0, last), last, sampling)
        if marks:
            marks[1].record()
        self.draft = DraftAhead([s.serial for s in seqs], K2, draft, marks)
        return min(K, K2) + 1
