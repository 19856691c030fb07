"""Verification: which drafted tokens the target accepts, and the token that follows.

Chains and trees are both verified "target-only": the target's token at every
verified position is its own argmax or seeded draw, exactly as plain decoding draws
it there (`sample_tokens`, keyed by the position the token would fill), and a draft
token is accepted while it equals that token. Every emitted token is then the
target's own, so the output distribution is the target's and a seeded request emits
what plain decoding emits, whatever K, the batch or the drafter. Acceptance comes
from coupling: the drafter samples over the same noise (`sampling.draft_noise`), so
its draw agrees with the target's wherever their distributions are close.

For trees (`accept_tree`) the accepted branch's KV then moves into place
(`move_branch_kv`) and its entries become the drafter's next inputs (`branch_inputs`).
"""

from __future__ import annotations

import torch

from specserve.engine.sampling import BatchSampling, sample_tokens
from specserve.spec.proposer import DraftResult, TreeDraft


def accept_drafts(
    logits: torch.Tensor, draft: DraftResult, s: BatchSampling, pos0: torch.Tensor, enabled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, K+1, V] from the verify forward over [last, d1..dK] at
    positions pos0..pos0+K. Returns (accepted count [B], next token [B]).
    Rows with `enabled` False accept nothing: their next token is the target's at pos0 + 1."""
    B, W, _ = logits.shape
    K = W - 1
    expand = lambda t: t.unsqueeze(1).expand(B, W)  # noqa: E731
    per_pos = BatchSampling(
        expand(s.temperature), expand(s.top_p), expand(s.top_k), expand(s.seed), s.all_greedy, s.filtered
    )
    pred = sample_tokens(logits, per_pos, expand(pos0) + torch.arange(1, W + 1, device=pos0.device))  # [B, K+1]
    ok = (pred[:, :K] == draft.tokens) & enabled.unsqueeze(1)
    n_acc = ok.long().cumprod(1).sum(1)
    return n_acc, pred.gather(1, n_acc.unsqueeze(1)).squeeze(1)


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


def move_branch_kv(
    caches,
    table: torch.Tensor,
    block_size: int,
    pos0: torch.Tensor,
    pad: torch.Tensor,
    n_acc: torch.Tensor,
    path: torch.Tensor,
    K: int,
    scratch: int,
) -> None:
    """Move the accepted branch's KV in every target layer: depth d from index pos0 + path[d-1]
    to pos0 + d (reads before writes). `caches`: the [layer, block, kv_head, offset, dim] K and V
    pools, `table` the batch's block-table rows; pos0 [B, 1]; padding rows (`pad`, pos0 at the
    scratch slot) write only there."""
    dev = pos0.device
    d = torch.arange(1, K + 1, device=dev)
    dst = torch.where(pad, scratch, pos0 + d)
    src = torch.where(d <= n_acc.unsqueeze(1), pos0 + path, dst)
    rows = torch.arange(pos0.shape[0], device=dev).unsqueeze(1)
    dst_block, dst_off = table[rows, dst // block_size], dst % block_size
    src_block, src_off = table[rows, src // block_size], src % block_size
    for cache in caches:
        cache[:, dst_block, :, dst_off] = cache[:, src_block, :, src_off]


def branch_inputs(
    tree: TreeDraft, feats: torch.Tensor, n_acc: torch.Tensor, next_tok: torch.Tensor, path: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's next inputs along the accepted branch: (feature_j, token_j+1) for j = 0..a.
    Returns (tokens [B, K+1]: the branch then the next token, features [B, K+1, 3H]; None without
    features: a draft-free method's)."""
    grid = emitted_tokens(tree.tokens.gather(1, (path - 1).clamp_min(0)), n_acc, next_tok)
    if feats is None:
        return grid, None
    feat_rows = torch.cat([torch.zeros_like(path[:, :1]), path], 1)
    feat = feats.gather(1, feat_rows.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
    return grid, feat
