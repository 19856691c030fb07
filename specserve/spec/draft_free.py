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
    """The proposer of a draft-free method; None for methods with a drafter model."""
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method == "suffix":
        return SuffixProposer()
    return None


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
