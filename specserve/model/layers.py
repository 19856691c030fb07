"""Building blocks shared by the target and the drafter.

Linear layers know how to load (and shard, under tensor parallelism) their
Hugging Face weights: each parameter carries a `weight_loader(param, tensor,
shard_id)`. With TP size 1 they are plain linears.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specserve.distributed.parallel_state import all_gather_last_dim, all_reduce, tp_rank, tp_size
from specserve.kernels.attention import cache_attention_ok, cache_attention_triton
from specserve.kernels.cpu_native import fused_ops
from specserve.kernels.linear import linear
from specserve.kernels.norm import apply_rope, rms_norm, rope_store_kv
from specserve.model.rope import rope_attention_factor, rope_inv_freq

# SDPA backends on CUDA: not cuDNN's, which builds an execution plan on the host for every new shape
# (tens of milliseconds to a second), and eager prefill chunks and drafter catch-ups come in ever new lengths.
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}")
    return n // parts


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def pin_attributes(model: nn.Module) -> None:
    """Copy each submodule, parameter and buffer reference into its owner's __dict__, so that reading
    `self.weight` or `self.mlp` skips nn.Module.__getattr__ (a Python call per read, which a CPU
    forward of a small model pays thousands of times, with no graph to hide it). Only for loaded inference models that
    are never moved or re-assigned afterwards: a re-assigned buffer would leave a stale copy here."""
    for m in model.modules():
        for refs in (m._modules, m._parameters, m._buffers):
            m.__dict__.update(refs)  # (None too: a linear without bias reads self.bias on every call)


class HotPathModule(nn.Module):
    """A module run for every token: calling it runs `forward` directly, skipping nn.Module's call
    machinery (hook and tracing checks on every call, a visible share of a small model's CPU decode
    step). Hooks registered on these modules therefore do not run."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


class RMSNorm(HotPathModule):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), fused on GPU."""
        return rms_norm(x, self.weight, self.eps, residual)


class ReplicatedLinear(HotPathModule, nn.Linear):
    """The same weight on every rank. `parts`: checkpoint tensors (name -> output rows) stacked in order
    into this one product, each loaded with its name as the shard."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, parts: dict[str, int] | None = None):
        super().__init__(in_features, out_features, bias=bias)
        if parts is not None and sum(parts.values()) != out_features:
            raise ValueError(f"parts {parts} do not add up to {out_features} output features")
        self.parts = parts
        for p in self.parameters():
            p.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        if shard is None:
            _copy_checked(param, loaded, "replicated")
            return
        names = list(self.parts)
        lo = sum(self.parts[n] for n in names[: names.index(shard)])
        _copy_checked(param.data[lo : lo + self.parts[shard]], loaded, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(HotPathModule):
    """Output features split across ranks; several HF tensors may be stacked
    into one weight (`shard_sizes`, e.g. q/k/v or gate/up) to save launches."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False, gather_output: bool = False):
        super().__init__()
        self.tp = tp_size()
        self.local_sizes = [_divide(s, self.tp, "output features") for s in shard_sizes]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(shard_sizes))]
        out = sum(self.local_sizes)
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.weight.weight_loader = self._load
        if bias:
            self.bias = nn.Parameter(torch.zeros(out))
            self.bias.weight_loader = self._load
        else:
            self.register_parameter("bias", None)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        shard = shard or 0
        size = self.local_sizes[shard]
        piece = loaded.narrow(0, tp_rank() * size, size) if self.tp > 1 else loaded
        target = param.data.narrow(0, self.offsets[shard], size)
        if target.shape != piece.shape:
            raise ValueError(
                f"expected shape {tuple(target.shape)} for shard {shard}, checkpoint gives {tuple(piece.shape)}"
            )
        target.copy_(piece)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return all_gather_last_dim(y) if self.gather_output else y


class RowParallelLinear(HotPathModule):
    """Input features split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp = tp_size()
        self.local_in = _divide(in_features, self.tp, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.weight.weight_loader = self._load
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
            self.bias.weight_loader = lambda p, t, s=None: _copy_checked(p, t, "bias")
        else:
            self.register_parameter("bias", None)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        piece = loaded.narrow(1, tp_rank() * self.local_in, self.local_in) if self.tp > 1 else loaded
        _copy_checked(param, piece, "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(HotPathModule):
    """Embedding rows split across ranks; a rank contributes zeros for ids it
    does not own and the all-reduce assembles the result."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.tp = tp_size()
        self.vocab = vocab
        self.local = _divide(vocab, self.tp, "vocab_size")
        self.start = tp_rank() * self.local
        self.weight = nn.Parameter(torch.empty(self.local, dim))
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: int | None = None) -> None:
        piece = loaded.narrow(0, self.start, self.local) if self.tp > 1 else loaded
        _copy_checked(param, piece, "embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.local)
        out = F.embedding(local.clamp(0, self.local - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class RotaryEmbedding(nn.Module):
    """cos/sin tables (float32) for every position up to `max_positions`, gathered per token."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(torch.float32)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope_attention_factor(scaling)  # YaRN scales the tables themselves
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)
        self._tables: dict = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        # q: [B, T, H, D], positions: [B, T]
        return apply_rope(q, k, self.cos, self.sin, positions)

    def tables_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [B, T, 1, D] in `dtype` at `positions`, for the CPU path. The sin's
        first half is negated so that x * cos + roll(x, D/2) * sin equals the reference's
        x * cos + rotate_half(x) * sin bit for bit (negating a factor is exact). The tables are
        prepared once per dtype, so a forward gathers them with two ops."""
        if dtype not in self._tables:
            half = self.sin.shape[-1] // 2
            signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
            self._tables[dtype] = (self.cos.to(dtype).unsqueeze(1), signed.to(dtype).unsqueeze(1))
        cos, sin = self._tables[dtype]
        return cos[positions], sin[positions]


@dataclass
class ForwardContext:
    """Per-forward attention metadata, shared by every layer of one model.

    Sequences occupy KV-cache rows `row_start .. row_start+B-1` (the running
    batch is kept as a contiguous prefix of rows, so attention reads a view of
    the cache, never a gathered copy). Token t of row b is written at cache
    index `write_idx[b, t]` and sees every key at an index <= its own: that
    positional rule makes rejecting draft tokens free (rewind the length) and
    lets padding tokens write to a scratch region past `max_model_len`.

    With a `block_table` ([rows, blocks] int64) the cache is paged: a cache is a pool of blocks
    [block, kv_head, block_size, dim] and index i of row r lives in block block_table[r, i //
    block_size] at offset i % block_size. Without one, a cache is one block per row
    ([row, kv_head, index, dim]), which is how training and checks use a plain cache.

    Prompts packed into one row (a prefill graph's staging row) add a lower bound: a query sees no
    key below `key_lo[b, t]`, its own prompt's first index.

    A tree of drafts adds a second rule: keys at or past `tree_base[b]` (the tree's first slot)
    are visible only where bit (key - tree_base[b]) of `tree_anc[b, t]` is set, i.e. to the
    query's ancestors in the tree and itself. Rope positions then differ from cache indices
    (a node's position is its depth past the root).
    """

    row_start: int
    positions: torch.Tensor  # [B, T] rope positions
    write_idx: torch.Tensor  # [B, T] cache index
    kv_len: int  # keys [0, kv_len) are read
    full_view: bool = False  # every query sees all kv_len keys: attention needs no mask
    tree_base: torch.Tensor | None = None  # [B] first tree slot of each row
    tree_anc: torch.Tensor | None = None  # [B, T] int64: tree slots the query sees, as bits
    block_table: torch.Tensor | None = None  # [rows, blocks] int64 (paged caches), see above
    block_size: int = 0
    key_lo: torch.Tensor | None = None  # [B, T] the lowest key index each query sees (packed prompts)
    _bias: dict = field(default_factory=dict)
    _at: tuple | None = None
    _rope: dict = field(default_factory=dict)
    _rows: torch.Tensor | None = None
    _slot: tuple[int, int] | None = None
    _blocks: torch.Tensor | None = None
    _row_table: torch.Tensor | None = None

    def attn_bias(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        if self.full_view:
            return None
        key = (group, dtype)
        if key not in self._bias:
            B, T = self.write_idx.shape
            keys = torch.arange(self.kv_len, device=self.write_idx.device)
            visible = keys.view(1, 1, -1) <= self.write_idx.unsqueeze(-1)  # [B, T, L]
            if self.key_lo is not None:
                visible &= keys.view(1, 1, -1) >= self.key_lo.unsqueeze(-1)
            if self.tree_anc is not None:
                rel = keys.view(1, 1, -1) - self.tree_base.view(B, 1, 1)
                bit = (self.tree_anc.unsqueeze(-1) >> rel.clamp(0, 62)) & 1
                visible &= (rel < 0) | ((rel < 63) & (bit == 1))
            bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            bias.masked_fill_(~visible, float("-inf"))
            # Queries are laid out [kv_head, group, token] -> repeat the mask per group.
            self._bias[key] = bias.unsqueeze(1).expand(B, group, T, self.kv_len).reshape(B, 1, group * T, self.kv_len)
        return self._bias[key]

    def rope_tables(self, rope: "RotaryEmbedding", dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope.tables_at(positions)`, gathered once per forward for every layer."""
        key = (id(rope), dtype)
        if key not in self._rope:
            self._rope[key] = rope.tables_at(self.positions, dtype)
        return self._rope[key]

    def cache_rows(self) -> torch.Tensor:
        """[B, 1] KV-cache row of each sequence (for indexed cache writes)."""
        if self._rows is None:
            B = self.write_idx.shape[0]
            self._rows = torch.arange(self.row_start, self.row_start + B, device=self.write_idx.device).unsqueeze(1)
        return self._rows

    def write_at(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) [B, T] where each token's cache index lives (once per forward)."""
        if self._at is None:
            rows = self.cache_rows()
            if self.block_table is None:
                self._at = (rows, self.write_idx)
            else:
                bs = self.block_size
                self._at = (self.block_table[rows, self.write_idx // bs], self.write_idx % bs)
        return self._at

    def write_slot(self) -> tuple[int, int]:
        """(block, offset) of a one-token forward's cache index, as host integers (once per forward)."""
        if self._slot is None:
            w = int(self.write_idx[0, 0])
            if self.block_table is None:
                self._slot = (self.row_start, w)
            else:
                self._slot = (int(self.block_table[self.row_start, w // self.block_size]), w % self.block_size)
        return self._slot

    def store(self, cache: torch.Tensor, values: torch.Tensor) -> None:
        """Write values [B, T, heads, dim] into a cache at each token's cache index. Every attention
        layer writes its cache through here, so the cache layout is known in one place."""
        if values.shape[0] * values.shape[1] == 1 and not cache.is_cuda:
            # One token on the CPU: a plain copy into the slot, a fraction of an index_put's cost
            # there (a GPU keeps the tensor form: reading the slot to the host would sync).
            block, offset = self.write_slot()
            cache[block, :, offset] = values[0, 0]
            return
        block, offset = self.write_at()
        cache[block, :, offset] = values.to(cache.dtype)

    def row_table(self) -> torch.Tensor:
        """[B, blocks] the block table's rows of this forward's sequences (once per forward)."""
        if self._row_table is None:
            self._row_table = self.block_table[self.row_start : self.row_start + self.write_idx.shape[0]]
        return self._row_table

    def read_blocks(self) -> torch.Tensor:
        """[B, n] the blocks holding keys [0, kv_len) of this forward's rows (once per forward)."""
        if self._blocks is None:
            n = -(-self.kv_len // self.block_size)
            B = self.write_idx.shape[0]
            self._blocks = self.block_table[self.row_start : self.row_start + B, :n]
        return self._blocks

    def cached(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache's keys [0, kv_len) of this forward's sequences, [B, heads, kv_len, dim]
        (a view without paging, else the row's blocks gathered)."""
        B = self.write_idx.shape[0]
        if self.block_table is None:
            return cache[self.row_start : self.row_start + B, :, : self.kv_len]
        blocks = self.read_blocks()
        H, D = cache.shape[1], cache.shape[3]
        if B == 1:  # gathered head-major ([heads, n, bs, dim]), the result needs no second copy
            return cache.transpose(0, 1)[:, blocks[0]].reshape(1, H, -1, D)[:, :, : self.kv_len]
        gathered = cache[blocks]  # [B, n, heads, bs, dim]
        return gathered.transpose(1, 2).reshape(B, H, -1, D)[:, :, : self.kv_len]

    def cache_length(self, cache: torch.Tensor) -> int:
        """Indices per row (the last one is the scratch slot padding tokens write to)."""
        if self.block_table is None:
            return cache.shape[2]
        return self.block_table.shape[1] * self.block_size


def _native_ops(heads: torch.Tensor):
    """The native CPU kernels where they take packed heads [B, T, H + 2 Hkv, D] (float32, contiguous, D a
    multiple of 16), else None."""
    ok = heads.dtype == torch.float32 and heads.is_contiguous() and heads.shape[-1] % 16 == 0
    return fused_ops() if ok else None


class KVCacheAttention(HotPathModule):
    """Scaled dot-product attention over the KV cache (paged or one block per row) with GQA."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_dim = head_dim  # dims per token per head of the V cache; 0: the module keeps no V cache
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.k_cache: torch.Tensor | None = None  # [blocks, kv_heads, block_size, head_dim], set by the runner
        self.v_cache: torch.Tensor | None = None  # [blocks, kv_heads, block_size, v_dim]

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding
    ) -> torch.Tensor:
        """Rotates q and k, writes k and v into the cache, attends (q [B, T, H, D], k/v [B, T, Hkv, D])."""
        if q.is_cuda:
            q = rope_store_kv(
                q,
                k,
                v,
                rope.cos,
                rope.sin,
                ctx.positions,
                self.k_cache,
                self.v_cache,
                ctx.row_start,
                ctx.write_idx,
                ctx.block_table,
                ctx.block_size,
            )
            if ctx.key_lo is None and cache_attention_ok(q, self.k_cache, ctx.write_idx):  # decode/verify/draft
                B, T = q.shape[:2]
                scratch = ctx.cache_length(self.k_cache) - 1  # the runner's padding slot
                out = cache_attention_triton(
                    q,
                    self.k_cache,
                    self.v_cache,
                    ctx.row_start,
                    ctx.write_idx,
                    scratch,
                    self.scale,
                    tree_base=ctx.tree_base,
                    tree_anc=ctx.tree_anc,
                    block_table=ctx.block_table,
                    block_size=ctx.block_size,
                )
                return out.view(B, T, self.num_heads * self.head_dim)
            return self._attend(q, ctx)
        q, k = self._rotate(q, ctx, rope), self._rotate(k, ctx, rope)
        self._store(k, v, ctx)
        return self._attend(q, ctx)

    def forward_packed(self, heads: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding) -> torch.Tensor:
        """CPU: `forward` for heads [B, T, H + 2 Hkv, D], the q, k and v heads of one projection
        side by side. q and k are rotated in one go (half the rope ops)."""
        H, Hkv = self.num_heads, self.num_kv_heads
        native = _native_ops(heads) if ctx.tree_anc is None and ctx.key_lo is None else None
        if native is not None:  # one call each for rope + KV write and for attention, the keys read where they lie
            self.write_kv(heads, ctx, rope)  # (q rotated in place too: the projection's output is this call's own)
            blocks = ctx.row_table() if ctx.block_table is not None else None
            return native.cache_attention(
                heads, H, self.k_cache, self.v_cache, blocks, ctx.row_start, ctx.write_idx, ctx.kv_len, self.scale
            )
        qk = self._rotate(heads[:, :, : H + Hkv], ctx, rope)
        self._store(qk[:, :, H:], heads[:, :, H + Hkv :], ctx)
        return self._attend(qk[:, :, :H], ctx)

    def write_kv(self, heads: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding) -> None:
        """The cache writes of `forward_packed` (rotated keys, values) for heads [B, T, H + 2 Hkv, D], attending
        to nothing: entries whose outputs feed nothing (a drafter's prefill)."""
        H, Hkv = self.num_heads, self.num_kv_heads
        q, k, v = heads.split([H, Hkv, Hkv], dim=2)
        if heads.is_cuda:
            rope_store_kv(
                q,
                k,
                v,
                rope.cos,
                rope.sin,
                ctx.positions,
                self.k_cache,
                self.v_cache,
                ctx.row_start,
                ctx.write_idx,
                ctx.block_table,
                ctx.block_size,
            )
            return
        native = _native_ops(heads)
        if native is not None:  # (rotates q in place as well)
            cos, sin = ctx.rope_tables(rope, heads.dtype)
            blocks = ctx.row_table() if ctx.block_table is not None else None
            native.rope_store_(heads, H, cos, sin, self.k_cache, self.v_cache, blocks, ctx.row_start, ctx.write_idx)
            return
        self._store(self._rotate(k, ctx, rope), v, ctx)

    @staticmethod
    def _rotate(x: torch.Tensor, ctx: ForwardContext, rope: RotaryEmbedding) -> torch.Tensor:
        """CPU rope: the reference's arithmetic with tables gathered once per forward."""
        cos, sin = ctx.rope_tables(rope, x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin

    def _store(self, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> None:
        ctx.store(self.k_cache, k)
        ctx.store(self.v_cache, v)

    def _attend(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """SDPA of rotated q [B, T, H, D] over the cached keys [0, kv_len) (keys already written)."""
        return self._sdpa(q, ctx.cached(self.k_cache), ctx.cached(self.v_cache), ctx)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q [B, T, H, D] over keys [B, Hkv, kv_len, D] and values [B, Hkv, kv_len, Dv] -> [B, T, H * Dv]."""
        B, T = q.shape[:2]
        # [B, T, H, D] -> [B, Hkv, G*T, D] so each KV head is read once for its whole group
        # (a plain view for one token).
        Hkv, G, D, Dv = self.num_kv_heads, self.group, q.shape[-1], values.shape[-1]
        if T == 1:
            qg = q.view(B, Hkv, G, D)
        else:
            qg = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        with sdpa_kernel(_CUDA_SDPA) if q.is_cuda else nullcontext():
            out = F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=ctx.attn_bias(G, q.dtype), scale=self.scale
            )
        if T > 1:
            out = out.view(B, Hkv, G, T, Dv).permute(0, 3, 1, 2, 4)
        return out.reshape(B, T, self.num_heads * Dv)
