"""`specserve bench --context N`: each prompt extended to about N tokens of context, so speculation is
measured at the context a user's requests run at (a verify's attention reads the whole cache, and its cost
grows with it)."""

from __future__ import annotations

# Prompt i's prefix starts this many tokens further into the prompt set than prompt i - 1's: rows of a batch
# then hold different caches (a shared prefix would be one cache hit, its prefill skipped).
STRIDE = 97


def extend_to_context(prompt_ids: list[list[int]], context: int) -> list[list[int]]:
    """Each prompt preceded by the prompt set's own tokens (every prompt's, in order, repeated), cut so that
    prefix and prompt are `context` tokens; prompts already that long are kept as they are. Deterministic:
    every configuration and repeat reads the same tokens."""
    pool = [t for ids in prompt_ids for t in ids]
    out = []
    for i, ids in enumerate(prompt_ids):
        need = context - len(ids)
        start = i * STRIDE
        out.append([pool[(start + j) % len(pool)] for j in range(need)] + list(ids))
    return out
