"""Draft-free speculation (`--speculative-method ngram | suffix`): drafts taken from the text
on the host (`spec.ngram`, `spec.suffix`), packed into the tensors the verify path reads, the
same chain verify (`spec.verify.accept_drafts`) or tree verify graph as EAGLE-3's drafts.

Drafts may be shorter than K, or missing: a chain is padded with -1 (no target token equals
it, so acceptance stops there; the verify forward embeds it as token 0), a tree with -1 nodes
hanging from the root.
"""

from __future__ import annotations

import torch

from specserve.config import SpecConfig
from specserve.spec.ngram import NgramProposer
from specserve.spec.suffix import SuffixProposer

PAD = -1


def text_proposer(spec: SpecConfig) -> NgramProposer | SuffixProposer | None:
    """The proposer of a draft-free method, or of the text drafts beside a drafter model (`text_drafts`); None
    where neither is configured."""
    name = spec.method if spec.draft_free else spec.text_drafts
    if name == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if name == "suffix":
        return SuffixProposer()
    return None


class TextFirst:
    """Beside a drafter model: a chain cycle takes the text's drafts instead of the drafter's where every row
    has a full-length one and text drafts have lately been accepted at least as well as the drafter's, so
    the drafter's K sequential steps are skipped where the text already holds the answer (an edit, a
    repeated block). Text drafts are scored on every cycle: on a drafter cycle their acceptance is read off
    the tokens the target emitted (their common prefix), with no verify of their own."""

    RATE = 0.2  # weight of a cycle in the moving averages of accepted drafts per row

    def __init__(self, proposer):
        self.proposer = proposer
        self.accepted = {"text": float("inf"), "drafter": 0.0}  # per row and cycle; text is tried first
        self.drafts: list[list[int]] = []
        self.cycles = {"text": 0, "drafter": 0}  # cycles that verified each one's drafts

    def draft(self, seqs, K: int, device: torch.device) -> torch.Tensor | None:
        """[B, K] text drafts for this cycle, or None: the drafter's turn."""
        self.drafts = [self.proposer.propose(s, K) for s in seqs]
        if all(len(d) == K for d in self.drafts) and self.accepted["text"] >= self.accepted["drafter"]:
            return torch.tensor(self.drafts, dtype=torch.long).to(device)
        return None

    def observe(self, used_text: bool, accepted: list[int], emitted: list[list[int]]) -> None:
        """A cycle's accepted counts and emitted tokens per row (`used_text`: it verified the text's drafts)."""
        text = (
            accepted
            if used_text
            else [
                next((i for i, (d, e) in enumerate(zip(drafts, row[: a + 1])) if d != e), min(len(drafts), a + 1))
                for drafts, row, a in zip(self.drafts, emitted, accepted)
            ]
        )
        self.cycles["text" if used_text else "drafter"] += 1
        self._update("text", sum(text) / len(text))
        if not used_text:
            self._update("drafter", sum(accepted) / len(accepted))

    def _update(self, key: str, value: float) -> None:
        old = self.accepted[key]
        self.accepted[key] = value if old in (0.0, float("inf")) else (1 - self.RATE) * old + self.RATE * value


def chain_drafts(proposer, seqs, K: int, device: torch.device) -> tuple[torch.Tensor, list[int]] | None:
    """[B, K] draft tokens (padded with PAD) and each row's draft length; None where no row has one."""
    drafts = [proposer.propose(s, K) for s in seqs]
    if not any(drafts):
        return None
    rows = torch.tensor([d + [PAD] * (K - len(d)) for d in drafts], dtype=torch.long)
    return rows.to(device), [len(d) for d in drafts]


def tree_drafts(proposer, seqs, K: int, N: int) -> tuple[list[torch.Tensor], list[int]] | None:
    """A tree per row as the verify graph reads it (host tensors [B, N]: tokens, parent rows, depths,
    ancestor-or-self bits) and each row's node count; None where no row has a node. Trees need a
    proposer that ranks several candidates (suffix); others give their chain as a one-branch tree."""
    B = len(seqs)
    tokens = torch.full((B, N), PAD, dtype=torch.long)
    parents = torch.zeros(B, N, dtype=torch.long)
    depth = torch.ones(B, N, dtype=torch.long)
    anc = (1 << torch.arange(N, dtype=torch.long)).repeat(B, 1)
    counts = []
    for b, seq in enumerate(seqs):
        if hasattr(proposer, "propose_tree"):
            nodes = proposer.propose_tree(seq, K, N)
        else:
            nodes = [(t, j, j + 1) for j, t in enumerate(proposer.propose(seq, min(K, N)))]
        counts.append(len(nodes))
        bits = [0]  # ancestor-or-self bits by verify row (row 0, the root: none)
        for j, (tok, parent, d) in enumerate(nodes):
            bits.append(bits[parent] | 1 << j)
            tokens[b, j], parents[b, j], depth[b, j], anc[b, j] = tok, parent, d, bits[-1]
    return ([tokens, parents, depth, anc], counts) if any(counts) else None
