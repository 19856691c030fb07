"""KV memory: the one place that allocates and moves attention caches.

Layout: paged. Every attention layer's cache is a pool of fixed-size blocks, [block, kv_head,
block_size, head_dim]; a sequence's row of the block table ([rows, max_blocks], on the device,
an input of every graph) lists its blocks, so index i of row r lives in block table[r, i //
block_size]. The target and the drafter use the same block ids (one table), so a prefix hit
covers the drafter's KV too. Running sequences keep rows 0..B-1 of the table; moving a sequence
to another row copies its table row, not its KV. Block 0 is the null block (see block_pool).

Row length = max_model_len + room + 1 indices rounded up to whole blocks, plus one block whose
entry is always the null block: its last index is the scratch slot that padding tokens write to
and no real query ever reads; room = K_max for chains (tree: the most verify nodes or drafter
tree slots), since a cycle's draft and verify tokens may sit past a sequence's end.

The pool's size: `kv_cache_tokens`, or on a GPU what `gpu_memory_utilization` leaves after
the weights and a warm-up forward (with an allowance for the graphs), or by default room for
every row at max_model_len (`plan_blocks`).

Prefill graphs write a staging cache of one row (contiguous, no table), as long as the longest
prefill bucket plus a scratch slot: one graph then serves every row (the KV is copied into the
sequence's blocks after), and staging costs a prompt's KV, not a whole sequence's.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from specserve.config import ConfigError, prefill_stage_len
from specserve.engine.block_pool import NULL_BLOCK
from specserve.model.layers import KVCacheAttention

log = logging.getLogger("specserve.kv")


def row_blocks(max_model_len: int, room: int, block_size: int) -> int:
    """Block-table columns per row: the sequence and its room, then the null column."""
    return -(-(max_model_len + room + 1) // block_size) + 1


def bytes_per_block(target, drafter, block_size: int, dtype: torch.dtype) -> int:
    mods = list(target.attention_modules()) + (list(drafter.attention_modules()) if drafter is not None else [])
    return sum(a.num_kv_heads * (a.head_dim + a.v_dim) * block_size * torch.finfo(dtype).bits // 8 for a in mods)


def plan_blocks(
    cfg, rows: int, max_model_len: int, room: int, block_bytes: int, device: torch.device, activation_bytes: int = 0
) -> int:
    """Blocks in the pool (the null block included); see the module's doc."""
    bs = cfg.kv_block_size
    if cfg.kv_cache_tokens is not None:
        n = -(-cfg.kv_cache_tokens // bs)
        why = f"--kv-cache-tokens {cfg.kv_cache_tokens}"
        one = (row_blocks(max_model_len, room, bs) - 1) * bs
        if n * bs < one:
            raise ConfigError(
                f"{why} holds less than one sequence of --max-model-len {max_model_len} (with room for "
                f"speculation: {one} tokens); raise --kv-cache-tokens or lower --max-model-len"
            )
    elif cfg.gpu_memory_utilization is not None:
        if device.type != "cuda":
            raise ConfigError("--gpu-memory-utilization sizes the KV pool on a GPU; on CPU use --kv-cache-tokens")
        free, total = torch.cuda.mem_get_info(device)
        graphs = max(activation_bytes, 512 * 2**20) if cfg.cuda_graphs else 0
        held = torch.cuda.memory_allocated(device)
        # The fraction of the whole GPU this process may hold, and never more than is free: memory
        # other processes hold is not ours to plan with.
        budget = min(cfg.gpu_memory_utilization * total - held, free * 0.95) - activation_bytes - graphs
        n = int(budget // block_bytes)
        why = (
            f"--gpu-memory-utilization {cfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB with "
            f"{free / 2**30:.1f} GiB free, after {held / 2**30:.2f} GiB this process holds (weights, and any "
            f"other engine's KV), {activation_bytes / 2**30:.2f} GiB of activations and {graphs / 2**30:.2f} GiB "
            f"for graphs"
        )
        if n < row_blocks(max_model_len, room, bs):
            raise ConfigError(
                f"{why} leaves room for {max(n, 0) * bs} KV tokens, less than one sequence of "
                f"--max-model-len {max_model_len}; raise --gpu-memory-utilization or lower --max-model-len"
            )
    else:
        n = rows * (row_blocks(max_model_len, room, bs) - 1)
        why = f"{rows} sequences x {max_model_len} tokens (--max-num-seqs x --max-model-len)"
    needed = (n + 1) * block_bytes
    if device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * 0.95)
    else:
        import psutil

        budget = int(psutil.virtual_memory().available * 0.5)
    if needed > budget:
        raise ConfigError(
            f"KV cache for {why} needs {needed / 2**30:.2f} GiB, only {budget / 2**30:.2f} GiB is "
            f"available; lower --kv-cache-tokens, --max-num-seqs or --max-model-len"
        )
    log.info("KV pool: %d blocks of %d tokens (%d tokens, %.2f GiB) for %s", n, bs, n * bs, needed / 2**30, why)
    return n + 1


class KVCache:
    """The target's and the drafter's block pools (set into their attention modules), the block
    table, and the prefill graphs' staging caches. `k_all`/`v_all` hold every target layer in one
    tensor ([layer, block, kv_head, offset, dim]), so moving a tree branch is one copy for all
    layers, not one per layer. A module whose `v_dim` is 0 (latent attention: its values are part
    of the cached latent) gets no V cache, and `v_all` is None."""

    def __init__(
        self,
        target,
        drafter,
        rows: int,
        max_model_len: int,
        room: int,
        dtype: torch.dtype,
        device: torch.device,
        stage_tokens: int,
        block_size: int,
        num_blocks: int,
    ):
        self.target_mods = list(target.attention_modules())
        self.drafter_mods = list(drafter.attention_modules()) if drafter is not None else []
        self.rows, self.room, self.dtype, self.device = rows, room, dtype, device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_blocks = row_blocks(max_model_len, room, block_size)
        self.cache_len = self.max_blocks * block_size
        self.scratch = self.cache_len - 1
        t = self.target_mods
        self.k_all, self.v_all = self._pair(t[0], num_blocks, block_size, (len(t),))
        for i, a in enumerate(t):
            a.k_cache, a.v_cache = self.k_all[i], self.v_all[i] if self.v_all is not None else None
        for a in self.drafter_mods:
            a.k_cache, a.v_cache = self._pair(a, num_blocks, block_size)
        self.table = torch.full((rows, self.max_blocks), NULL_BLOCK, dtype=torch.long, device=device)
        # Staging for prompts of up to `stage_tokens` tokens (0: no prefill graphs, no staging).
        self.stage_len = prefill_stage_len(stage_tokens)
        self.stage_scratch = self.stage_len - 1
        self.stage: dict[KVCacheAttention, tuple[torch.Tensor, torch.Tensor]] = {}
        if stage_tokens:
            self.k_stage, self.v_stage = self._pair(t[0], 1, self.stage_len, (len(t),))
            self.stage = {
                a: (self.k_stage[i], self.v_stage[i] if self.v_stage is not None else None) for i, a in enumerate(t)
            }
            self.stage.update({a: self._pair(a, 1, self.stage_len) for a in self.drafter_mods})

    def _pair(self, a: KVCacheAttention, blocks: int, length: int, layers: tuple[int, ...] = ()):
        """Zeroed (K, V) caches of `blocks` blocks of `length` for attention module `a` (V None
        where a.v_dim is 0)."""

        def cache(dim):
            return torch.zeros(*layers, blocks, a.num_kv_heads, length, dim, dtype=self.dtype, device=self.device)

        return cache(a.head_dim), cache(a.v_dim) if a.v_dim else None

    def target_caches(self) -> tuple[torch.Tensor, ...]:
        """The all-layer target pools that exist ([layer, block, kv_head, offset, dim]): K, and V."""
        return tuple(c for c in (self.k_all, self.v_all) if c is not None)

    def nbytes(self) -> int:
        """Bytes of the target's and the drafter's block pools (staging not included)."""
        return sum(
            c.numel() * c.element_size()
            for a in self.target_mods + self.drafter_mods
            for c in (a.k_cache, a.v_cache)
            if c is not None
        )

    def set_row(self, row: int, blocks: list[int]) -> None:
        """Row `row` of the block table lists `blocks`, the null block after them."""
        n = len(blocks)
        if n >= self.max_blocks:
            raise AssertionError(f"{n} blocks do not fit a row of {self.max_blocks - 1}")
        line = torch.full((self.max_blocks,), NULL_BLOCK, dtype=torch.long)
        line[:n] = torch.tensor(blocks, dtype=torch.long)
        if self.device.type == "cuda":  # from pinned memory: a pageable copy would wait for the stream
            line = line.pin_memory()
        self.table[row].copy_(line, non_blocking=True)

    def move_row(self, src: int, dst: int) -> None:
        """A sequence moves to another row: its table row goes with it (its KV stays put)."""
        self.table[dst] = self.table[src]

    def slots(self, row: int, n: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of indices start..start+n-1 of a row."""
        idx = torch.arange(start, start + n, device=self.device)
        return self.table[row, idx // self.block_size], idx % self.block_size

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

    def unstage(self, row: int, T: int, src: int, dst: int, drafter: bool) -> None:
        """Copy T positions of staged KV from index `src` (a packed chunk's first) into `row`'s blocks from index
        `dst`: the target's (all layers at once) and, with `drafter`, the drafter's."""
        block, offset = self.slots(row, T, dst)
        for cache, staged in ((self.k_all, self.k_stage), (self.v_all, self.v_stage)):
            if cache is not None:
                cache[:, block, :, offset] = staged[:, 0, :, src : src + T].permute(2, 0, 1, 3)
        for a in self.drafter_mods if drafter else ():
            k, v = self.stage[a]
            a.k_cache[block, :, offset] = k[0, :, src : src + T].transpose(0, 1)
            if v is not None:  # (latent attention keeps no values)
                a.v_cache[block, :, offset] = v[0, :, src : src + T].transpose(0, 1)
