"""KV memory: the one place that allocates and moves attention caches.

Layout: one slot ("row") per sequence, [rows, kv_heads, cache_len, head_dim] per layer (V:
v_dim last; a module declaring v_dim 0, latent attention, gets no V cache),
with running sequences kept in rows 0..B-1 so every graph reads a plain view of the
cache (no gather). Fixed slots rather than paged blocks: without paged-attention kernels
SDPA needs contiguous keys, static shapes suit CUDA graphs, and rewinding rejected drafts
is just not advancing the length. The cost is memory reserved for max_model_len per slot,
which the budget check here accounts for up front.

cache_len = max_model_len + room + 1 (rounded up), room = K_max for chains (tree: the
most verify nodes or drafter tree slots): draft and verify tokens of a sequence near its
end may sit past max_model_len, and the last index is a scratch slot that padding tokens
write to and no real query ever reads.

Prefill graphs write a staging cache of one row, as long as the longest prefill bucket
plus a scratch slot: one graph then serves every row (the KV is copied to the sequence's
row after), and staging costs a prompt's KV, not a whole sequence's.
"""

from __future__ import annotations

import contextlib

import torch

from specserve.config import ConfigError, prefill_stage_len
from specserve.model.layers import KVCacheAttention


def cache_length(max_model_len: int, room: int) -> int:
    """KV slots per row: the sequence, `room` slots a cycle may write past its end, the scratch slot."""
    return -(-(max_model_len + room + 1) // 16) * 16


class KVCache:
    """The target's and the drafter's KV caches (set into their attention modules) and the
    prefill graphs' staging caches. `k_all`/`v_all` hold every target layer in one tensor
    ([layer, row, kv_head, index, dim]), so moving a row or a tree branch is one copy for all
    layers, not one per layer. `v_all` is None when the target's attention keeps no V cache."""

    def __init__(self, target, drafter, rows: int, max_model_len: int, room: int, dtype: torch.dtype,
                 device: torch.device, stage_tokens: int):
        self.target_mods = list(target.attention_modules())
        self.drafter_mods = list(drafter.attention_modules()) if drafter is not None else []
        self.rows, self.room, self.dtype, self.device = rows, room, dtype, device
        self.cache_len = cache_length(max_model_len, room)
        self.scratch = self.cache_len - 1
        self._check_budget(max_model_len)
        t = self.target_mods
        self.k_all, self.v_all = self._pair(t[0], rows, self.cache_len, (len(t),))
        for i, a in enumerate(t):
            a.k_cache, a.v_cache = self.k_all[i], self.v_all[i] if self.v_all is not None else None
        for a in self.drafter_mods:
            a.k_cache, a.v_cache = self._pair(a, rows, self.cache_len)
        # Staging for prompts of up to `stage_tokens` tokens (0: no prefill graphs, no staging).
        self.stage_len = prefill_stage_len(stage_tokens)
        self.stage_scratch = self.stage_len - 1
        self.stage: dict[KVCacheAttention, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if stage_tokens:
            self.k_stage, self.v_stage = self._pair(t[0], 1, self.stage_len, (len(t),))
            self.stage = {a: (self.k_stage[i], self.v_stage[i] if self.v_stage is not None else None)
                          for i, a in enumerate(t)}
            self.stage.update({a: self._pair(a, 1, self.stage_len) for a in self.drafter_mods})

    def _pair(self, a: KVCacheAttention, rows: int, length: int, layers: tuple[int, ...] = ()):
        """Zeroed (K, V) caches shaped for attention module `a` (V None where a.v_dim is 0)."""
        def cache(dim):
            return torch.zeros(*layers, rows, a.num_kv_heads, length, dim, dtype=self.dtype, device=self.device)

        return cache(a.head_dim), cache(a.v_dim) if a.v_dim else None

    def target_caches(self) -> tuple[torch.Tensor, ...]:
        """The all-layer target caches ([layer, row, kv_head, index, dim]) that exist: K, and V."""
        return tuple(c for c in (self.k_all, self.v_all) if c is not None)

    def _check_budget(self, max_model_len: int) -> None:
        needed = 0
        for a in self.target_mods + self.drafter_mods:
            per_token = a.num_kv_heads * (a.head_dim + a.v_dim) * torch.finfo(self.dtype).bits // 8
            needed += self.rows * self.cache_len * per_token
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.9)
        else:
            import psutil

            budget = int(psutil.virtual_memory().available * 0.5)
        if needed > budget:
            raise ConfigError(
                f"KV cache for {self.rows} sequences x {max_model_len} tokens needs {needed / 2**30:.2f} GiB, "
                f"only {budget / 2**30:.2f} GiB is available; lower --max-num-seqs or --max-model-len"
            )

    def nbytes(self) -> int:
        """Bytes of the target's and the drafter's KV caches (staging not included)."""
        return sum(c.numel() * c.element_size() for a in self.target_mods + self.drafter_mods
                   for c in (a.k_cache, a.v_cache) if c is not None)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's KV (its first `length` positions and the room a cycle writes past them)
        to another row, target and drafter."""
        n = min(length + self.room + 1, self.cache_len)
        for cache in self.target_caches():  # every target layer at once
            cache[:, dst, :, :n] = cache[:, src, :, :n]
        for a in self.drafter_mods:
            a.k_cache[dst, :, :n] = a.k_cache[src, :, :n]
            a.v_cache[dst, :, :n] = a.v_cache[src, :, :n]

    @contextlib.contextmanager
    def staged(self, mods):
        """The attention modules `mods` read and write their staging caches meanwhile (a graph
        captured inside keeps doing so)."""
        saved = [(a.k_cache, a.v_cache) for a in mods]
        for a in mods:
            a.k_cache, a.v_cache = self.stage[a]
        try:
            yield
        finally:
            for a, (k, v) in zip(mods, saved):
                a.k_cache, a.v_cache = k, v

    def unstage_target(self, row: int, T: int) -> None:
        """Copy a staged prompt's first T positions of target KV to `row` (all layers at once)."""
        for cache, staged in ((self.k_all, self.k_stage), (self.v_all, self.v_stage)):
            if cache is not None:
                cache[:, row, :, :T] = staged[:, 0, :, :T]

    def unstage_drafter(self, row: int, T: int) -> None:
        """Copy a staged prompt's first T positions of drafter KV to `row`."""
        for a in self.drafter_mods:
            k, v = self.stage[a]
            a.k_cache[row, :, :T] = k[0, :, :T]
            a.v_cache[row, :, :T] = v[0, :, :T]
