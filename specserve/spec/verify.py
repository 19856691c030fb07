"""Verification: which drafted tokens the target accepts, and the token that follows.

Standard speculative rejection sampling (Leviathan et al. / Chen et al.): draft
token d with draft probability q(d) is accepted with probability
min(1, p(d) / q(d)); at the first rejection the next token is drawn from
normalize(max(0, p - q)); if all K are accepted a bonus token is drawn from p.
The output distribution is exactly the target's. Greedy requests use one-hot
p and q, which reduces the rule to "accept while argmax matches".

Trees (`accept_tree`) are verified against the target's own token at every node
(its argmax, or its seeded draw): a branch is accepted while its tokens equal
those, which keeps greedy and sampled output exactly plain decoding's. The accepted
branch's KV then moves into place (`move_branch_kv`) and its entries become the drafter's
next inputs (`branch_inputs`).
"""

from __future__ import annotations

import torch

from specserve.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_TARGET,
    BatchSampling,
    processed_probs,
    sample_from,
    uniform,
)
from specserve.kernels.argmax import argmax
from specserve.spec.proposer import DraftResult, TreeDraft


def accept_drafts(logits: torch.Tensor, draft: DraftResult, s: BatchSampling, pos0: torch.Tensor,
                  enabled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, K+1, V] from the verify forward over [last, d1..dK] at
    positions pos0..pos0+K. Returns (accepted count [B], next token [B]).
    Rows with `enabled` False accept nothing: their next token comes from p."""
    B, W, V = logits.shape
    K = W - 1
    d = draft.tokens  # [B, K] target ids
    if s.all_greedy:
        pred = argmax(logits)  # [B, K+1]
        ok = (pred[:, :K] == d) & enabled.unsqueeze(1)
        n_acc = ok.long().cumprod(1).sum(1)
        return n_acc, pred.gather(1, n_acc.unsqueeze(1)).squeeze(1)

    expand = lambda t: t.unsqueeze(1).expand(B, W)  # noqa: E731
    p = processed_probs(logits, expand(s.temperature), expand(s.top_p), expand(s.top_k), s.filtered)  # [B, K+1, V]
    q_d = draft.probs.gather(-1, draft.draft_ids.unsqueeze(-1)).squeeze(-1)  # [B, K]
    p_d = p[:, :K].gather(-1, d.unsqueeze(-1)).squeeze(-1)
    positions = pos0.unsqueeze(1) + torch.arange(1, K + 1, device=pos0.device)  # where each d_i would sit
    u = uniform(s.seed.unsqueeze(1).expand(B, K), positions, STREAM_ACCEPT, 1).squeeze(-1)
    ok = (u * q_d <= p_d) & enabled.unsqueeze(1)
    n_acc = ok.long().cumprod(1).sum(1)

    # Residual at the first rejection (or p itself for the bonus / disabled rows).
    rows = torch.arange(B, device=logits.device)
    p_at = p[rows, n_acc]  # [B, V]
    idx = n_acc.clamp(max=K - 1)
    q_at = torch.zeros_like(p_at).scatter_add_(1, draft.vocab_map.expand(B, -1), draft.probs[rows, idx])
    rejected = (n_acc < K) & enabled
    residual = torch.where(rejected.unsqueeze(1), (p_at - q_at).clamp_min(0), p_at)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_at)
    u_next = uniform(s.seed, pos0 + n_acc + 1, STREAM_TARGET, V)
    return n_acc, sample_from(residual, u_next)


def emitted_tokens(drafts: torch.Tensor, n_acc: torch.Tensor, next_tok: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: the first n_acc drafts of each row, then the next token (later columns: leftovers).
    Also the tokens of the drafter's next inputs (feature_j, token_j+1), j = 0..n_acc."""
    return torch.cat([drafts, drafts[:, :1]], 1).scatter(1, n_acc.unsqueeze(1), next_tok.unsqueeze(1))


def accept_tree(pred: torch.Tensor, tree: TreeDraft, K: int, enabled: torch.Tensor):
    """Verification of a draft tree against the target's token at every node, pred [B, N+1]
    (root first): its argmax, or its draw keyed by the position it would fill, exactly as plain
    decoding draws there (`sample_tokens`). A node is accepted when its token is the target's
    token at its parent and its parent is accepted; siblings carry distinct tokens, so the
    accepted nodes form one branch. Lossless for any drafts ("target-only" verification): each
    emitted token is the target's own draw, so a seeded request emits what plain decoding emits.
    Returns (accepted count [B], next token [B], verify rows of the accepted branch by depth
    [B, K], rows past the count being 0)."""
    B, N = tree.tokens.shape
    ok = (tree.tokens == pred.gather(1, tree.parents)) & enabled.unsqueeze(1)
    bits = 1 << torch.arange(N, device=pred.device)
    ok_bits = (ok.long() * bits).sum(1, keepdim=True)  # distinct powers of two: the sum is the OR
    accepted = (tree.anc & ~ok_bits) == 0  # the node and all its ancestors match
    n_acc, best = torch.where(accepted, tree.depth, 0).max(1)
    best_row = torch.where(n_acc > 0, best + 1, 0)
    next_tok = pred.gather(1, best_row.unsqueeze(1)).squeeze(1)
    on_branch = ((tree.anc.gather(1, best.unsqueeze(1)) & bits) != 0) & (n_acc > 0).unsqueeze(1)  # [B, N]
    levels = torch.arange(1, K + 1, device=pred.device)
    at_level = on_branch.unsqueeze(1) & (tree.depth.unsqueeze(1) == levels.view(1, K, 1))  # [B, K, N]
    path_rows = torch.where(at_level.any(-1), at_level.int().argmax(-1) + 1, 0)
    return n_acc, next_tok, path_rows


def move_branch_kv(caches, pos0: torch.Tensor, pad: torch.Tensor, n_acc: torch.Tensor, path: torch.Tensor,
                   K: int, scratch: int) -> None:
    """Move the accepted branch's KV in every target layer: depth d from index pos0 + path[d-1]
    to pos0 + d (reads before writes). `caches`: the [layer, row, kv_head, index, dim] K and V
    tensors; pos0 [B, 1]; padding rows (`pad`, pos0 at the scratch slot) write only there."""
    dev = pos0.device
    d = torch.arange(1, K + 1, device=dev)
    dst = torch.where(pad, scratch, pos0 + d)
    src = torch.where(d <= n_acc.unsqueeze(1), pos0 + path, dst)
    rows = torch.arange(pos0.shape[0], device=dev).unsqueeze(1)
    for cache in caches:
        cache[:, rows, :, dst] = cache[:, rows, :, src]


def branch_inputs(tree: TreeDraft, feats: torch.Tensor, n_acc: torch.Tensor, next_tok: torch.Tensor,
                  path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's next inputs along the accepted branch: (feature_j, token_j+1) for j = 0..a.
    Returns (tokens [B, K+1]: the branch then the next token, features [B, K+1, 3H])."""
    grid = emitted_tokens(tree.tokens.gather(1, (path - 1).clamp_min(0)), n_acc, next_tok)
    feat_rows = torch.cat([torch.zeros_like(path[:, :1]), path], 1)
    feat = feats.gather(1, feat_rows.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
    return grid, feat
