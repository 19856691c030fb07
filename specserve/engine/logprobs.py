"""Log-probabilities of emitted tokens, for the requests that ask for them.

The values are the target's raw distribution: log_softmax of its logits at the position
that produced the token, at temperature 1 with no top-k / top-p, whatever the request
samples with (what evaluation harnesses score against). For a request constrained by a
grammar it is that distribution after the grammar's mask (renormalized over the tokens the
grammar allows there, as vLLM reports it), with and without speculation alike. Plain steps, prefills, chain and
tree verifies all hold the target's logits for every emitted token, so speculation
reports exactly what plain decoding would. Only the rows of requests that ask are
computed, after the step's forward (graph replays stay as they are), and their host copy
is queued like the tokens' (`host_lists`), so a step without such requests pays nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.engine.readback import host_lists
from specserve.engine.sampling import to_device


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the most likely tokens at its position
    (most likely first; `top` has the request's number of alternatives)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogprobBatch:
    """Log-probabilities for some rows of one step, computed on the device now (before any
    later replay reuses the logits' memory) and read on the host later.

    logits [B, V] or [B, W, V]; tokens [B] or [B, W] (the emitted tokens, leftovers allowed
    past each row's accepted count: column w came from logits column w); rows: the batch rows
    to compute; k: alternatives per token (the largest any row asks for). Tree verifies give
    `path` [B, K], the accepted branch's verify rows by depth (`accept_tree`): the token at
    depth d then came from the logits of the branch node at depth d - 1, the root for d = 0."""

    def __init__(
        self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int, path: torch.Tensor | None = None
    ):
        if logits.dim() == 2:
            logits, tokens = logits.unsqueeze(1), tokens.unsqueeze(1)
        idx = to_device(rows, logits.device)
        sel = logits[idx]
        if path is not None:
            cols = torch.cat([torch.zeros_like(path[idx, :1]), path[idx]], 1)
            sel = sel.gather(1, cols.unsqueeze(-1).expand(-1, -1, sel.shape[-1]))
        lp = torch.log_softmax(sel.float(), -1)  # [R, W, V]
        chosen = lp.gather(-1, tokens[idx].unsqueeze(-1)).squeeze(-1)
        top_lp, top_ids = lp.topk(k, -1)
        self.rows = rows
        self._read = host_lists(logits.device, tokens[idx], chosen, top_lp, top_ids)

    def read(self, ks: list[int]) -> dict[int, list[TokenLogprob]]:
        """Batch row -> one entry per column (ks: each row's number of alternatives)."""
        tokens, chosen, top_lp, top_ids = self._read()
        out = {}
        for i, (row, k) in enumerate(zip(self.rows, ks)):
            # Tokens a grammar refuses (-inf) are no alternatives: fewer than k may be listed.
            out[row] = [
                TokenLogprob(t, lp, tuple((i, v) for i, v in zip(ids[:k], lps[:k]) if v != -math.inf))
                for t, lp, ids, lps in zip(tokens[i], chosen[i], top_ids[i], top_lp[i])
            ]
        return out
