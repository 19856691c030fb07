"""n-gram speculation ("prompt lookup"): draft the tokens that followed the last earlier
occurrence of the text's current ending, matched over the request's own prompt and output.

No model runs: the draft comes from the token history on the host, and the target verifies it
as it verifies any chain (`spec.verify.accept_drafts`). Each sequence keeps an index from every
n-gram (n in min..max) to where it last ended, grown as tokens arrive, so a lookup costs
max - min + 1 dictionary reads however long the text is.
"""

from __future__ import annotations


class _Index:
    """The n-grams of one sequence's tokens that end before its last token, by their last end."""

    def __init__(self):
        self.ends: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending at indices < upto are indexed


class NgramProposer:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[int, _Index] = {}  # Sequence.serial -> its index

    def propose(self, seq, K: int) -> list[int]:
        """Up to K tokens that followed the latest earlier occurrence of the longest n-gram
        (n_max down to n_min) the text ends with; [] where none occurred before."""
        toks = seq.prompt_ids + seq.output_ids
        L = len(toks)
        idx = self.index.get(seq.serial)
        if idx is None:
            idx = self.index[seq.serial] = _Index()
        # Index the n-grams ending (exclusive) at upto+1 .. L-1: all but the text's current ending.
        for end in range(max(idx.upto, 1), L):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                idx.ends[tuple(toks[end - n : end])] = end
        idx.upto = max(idx.upto, L)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            end = idx.ends.get(tuple(toks[L - n :]))
            if end is not None:
                return toks[end : end + K]
        return []

    def forget(self, seq) -> None:
        self.index.pop(seq.serial, None)

    def finished(self, seq) -> None:
        self.forget(seq)
