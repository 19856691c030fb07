"""Grammar masks on the target's logits, for the rows of constrained sequences only.

The masks are filled on the host from each sequence's matcher and applied to the logits after
the forward (after a CUDA graph's replay), before tokens are drawn: unconstrained rows keep their
path untouched. A speculative cycle masks every verified position with the state the matcher
would reach over the drafted tokens before it (`Matcher.masks_along`), so the target's token at
each position is drawn from its masked distribution, exactly as plain decoding draws it there:
a drafted token the grammar refuses is never accepted, and constrained output with speculation
equals constrained output without it. The matcher itself advances only over emitted tokens.
"""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [..., words] -> bool [..., vocab_size]."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.bool().flatten(-2)[..., :vocab_size]


def new_bitmask(rows: int, width: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, width, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set the logits of tokens the grammar refuses to -inf, in place: logits [B, V] or [B, W, V],
    bitmask [len(rows), W, words] for batch rows `rows`."""
    if not rows:
        return
    flat = logits.dim() == 2
    view = logits.unsqueeze(1) if flat else logits
    idx = torch.tensor(rows, device=logits.device)
    ok = allowed(bitmask, logits.shape[-1]).to(logits.device, non_blocking=True)
    view[idx] = view[idx].masked_fill(~ok, float("-inf"))


def chain_paths(drafts: list[int]) -> list[list[int]]:
    """The drafted tokens before each verified position of a chain: [], [d1], [d1, d2], ..."""
    return [drafts[:i] for i in range(len(drafts) + 1)]


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The drafted tokens before each verify row of a tree: row 0 (the root) none, node j (row
    j + 1) its parent row's path then its own token; parents come before children."""
    paths: list[list[int]] = [[]]
    for tok, parent in zip(tokens, parents):
        paths.append(paths[parent] + [tok])
    return paths


def fill(matchers: list, paths: list[list[list[int]]], vocab_size: int) -> torch.Tensor:
    """The bitmask of each matcher's verify positions: [R, W, words]."""
    out = new_bitmask(len(matchers), len(paths[0]), vocab_size)
    for m, p, row in zip(matchers, paths, out):
        m.masks_along(p, row)
    return out
