"""Attention of a few queries per KV head over the KV cache (flash-decoding)."""

from __future__ import annotations

import torch

from specserve.kernels import common
from specserve.kernels.common import pdl_args, triton, use_triton

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

    @triton.jit
    def tree_bits(anc_ptr, tbase_ptr, b, anc_stride, t, rmask, TREE: tl.constexpr):
        """(ancestor bits of each query row, the row's tree base) with a tree, else zeros."""
        if TREE:
            anc = tl.load(anc_ptr + b * anc_stride + t, mask=rmask, other=0)
            tbase = tl.load(tbase_ptr + b)
        else:
            anc = tl.zeros_like(t).to(tl.int64)
            tbase = 0
        return anc, tbase

    @triton.jit
    def key_offsets(bt_ptr, row, bt_stride, offs_n, kmask, c_row, c_pos, BS: tl.constexpr, PAGED: tl.constexpr):
        """Where keys offs_n of cache row `row` start (head 0): paged, in the blocks the row's block
        table names; else in the row itself."""
        if PAGED:
            block = tl.load(bt_ptr + row * bt_stride + offs_n // BS, mask=kmask, other=0).to(tl.int64)
            return block * c_row + (offs_n % BS) * c_pos
        return row * c_row + offs_n * c_pos

    @triton.jit
    def key_range(sp, chunk, length, limit):
        """Keys [lo, hi) of split sp: its chunk, cut at the cache length and at the last key any of
        the program's query rows may see (so a split wholly past them has lo >= hi)."""
        lo = sp * chunk
        return lo, tl.minimum(tl.minimum(lo + chunk, length), tl.max(limit, axis=0) + 1)

    @triton.jit
    def softmax_tile(s, offs_n, kmask, limit, anc, tbase, m_i, l_i, TREE: tl.constexpr):
        """One key tile of the online softmax: scores s [rows, keys] of the keys offs_n, each row
        seeing keys up to its limit and, with a tree, those at or past tbase only where its
        ancestor bit is set -> (probabilities, rescale of the running sums, new max, new sum)."""
        seen = (offs_n[None, :] <= limit[:, None]) & kmask[None, :]
        if TREE:
            rel = offs_n[None, :] - tbase
            bit = (anc[:, None] >> tl.minimum(tl.maximum(rel, 0), 62)) & 1
            seen = seen & ((rel < 0) | ((rel < 63) & (bit == 1)))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit
    def split_weights(ml_ptr, part, smask):
        """Weights of one row's key splits `part` (those in smask) and their total, from the
        splits' (max, sum) pairs."""
        m = tl.load(ml_ptr + part * 2, mask=smask, other=float("-inf"))
        l = tl.load(ml_ptr + part * 2 + 1, mask=smask, other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        return w, tl.sum(w * l, axis=0)

    # The batch size sets the split count and chunk (`key_splits`): run-time values here, so an eager call
    # at any batch size (a drafter's feed or catch-up) needs no kernel of its own; the combine's SPLITS, a
    # power of two, takes a few values (`ModelRunner._compile_eager_attention` compiles them at start-up).
    @triton.jit(
        do_not_specialize=[
            "T",
            "n_split",
            "chunk",
            "widx_stride",
            "anc_stride",
            "length",
            "row_start",
            "scratch",
            "bt_stride",
        ]
    )
    def _attn_partial_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        widx_ptr,
        tbase_ptr,
        anc_ptr,
        bt_ptr,
        o_ptr,
        ml_ptr,
        T,
        H,
        G,
        n_kv,
        n_split,
        chunk,
        widx_stride,
        anc_stride,
        length,
        row_start,
        scratch,
        scale,
        bt_stride,
        c_row,
        c_head,
        c_pos,
        D: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TREE: tl.constexpr,
        BS: tl.constexpr,
        PAGED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (b, kv head, split): the G*T queries of one KV head of one sequence against keys
        # [split * chunk, (split + 1) * chunk), cut at the last key any of them may see.
        # TREE: keys at or past the row's tree base are seen only where the query's ancestor bit is set.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        wait_for_previous(PDL)
        r = tl.arange(0, BLOCK_Q)  # query row r = token * G + group member
        t = r // G
        rmask = r < G * T
        widx = tl.load(widx_ptr + b * widx_stride + t, mask=rmask, other=-1)
        limit = tl.where(widx == scratch, -1, widx)  # padding queries (scratch slot) see nothing
        anc, tbase = tree_bits(anc_ptr, tbase_ptr, b, anc_stride, t, rmask, TREE)
        offs_d = tl.arange(0, D)
        head = (b * T + t) * H + kvh * G + r % G
        q = tl.load(q_ptr + head[:, None] * D + offs_d[None, :], mask=rmask[:, None], other=0.0)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, D], tl.float32)
        row = (row_start + b).to(tl.int64)
        lo, hi = key_range(sp, chunk, length, limit)
        # A loop bound known only at run time: tiles past `hi` are never visited, and the loads of
        # one tile overlap the math of the one before (num_stages), paged or not.
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kmask = offs_n < hi
            kv_off = (key_offsets(bt_ptr, row, bt_stride, offs_n, kmask, c_row, c_pos, BS, PAGED) + kvh * c_head)[
                :, None
            ] + offs_d[None, :]
            k = tl.load(kc_ptr + kv_off, mask=kmask[:, None], other=0.0)
            p, alpha, m_new, l_i = softmax_tile(
                tl.dot(q, tl.trans(k)) * scale, offs_n, kmask, limit, anc, tbase, m_i, l_i, TREE
            )
            v = tl.load(vc_ptr + kv_off, mask=kmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        # Splits wholly past every query's last key (most of them at short contexts: the split count
        # is fixed by the cache length for the graphs) write nothing; the combine skips them.
        if lo < hi:
            part = ((b * n_kv + kvh) * n_split + sp) * BLOCK_Q + r
            tl.store(o_ptr + part[:, None] * D + offs_d[None, :], acc)
            tl.store(ml_ptr + part * 2, m_i)
            tl.store(ml_ptr + part * 2 + 1, l_i)

    @triton.jit(do_not_specialize=["T", "n_split", "chunk", "widx_stride", "scratch"])
    def _attn_combine_kernel(
        o_ptr,
        ml_ptr,
        out_ptr,
        widx_ptr,
        T,
        H,
        G,
        n_kv,
        n_split,
        chunk,
        widx_stride,
        scratch,
        D: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        SPLITS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_previous(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.program_id(2)
        if r < G * T:
            widx = tl.load(widx_ptr + b * widx_stride + r // G)
            # splits up to the one holding this query's last key (none for a padding query)
            used = tl.where(widx == scratch, 0, widx // chunk + 1)
            sp = tl.arange(0, SPLITS)
            smask = sp < used
            part = ((b * n_kv + kvh) * n_split + sp) * BLOCK_Q + r
            w, total = split_weights(ml_ptr, part, smask)
            offs_d = tl.arange(0, D)
            acc = tl.load(o_ptr + part[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
            o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
            head = (b * T + r // G) * H + kvh * G + r % G
            tl.store(out_ptr + head * D + offs_d, o.to(out_ptr.dtype.element_ty))


ATTN_BLOCK_N = 64


def split_classes(length: int, block_n: int, programs: int, rows: int, sm_count: int) -> list[int]:
    """One batch size (the first) of each power-of-two split count `key_splits` gives 1..`rows` sequences
    of `programs` programs a split each: the batch sizes that compile every variant a combine is built for."""
    batches: dict[int, int] = {}
    for B in range(1, rows + 1):
        batches.setdefault(triton.next_power_of_2(key_splits(length, block_n, B * programs, sm_count)[0]), B)
    return list(batches.values())


def compile_eager_variants(
    k_cache, v_cache, num_heads: int, scale: float, scratch: int, block_table, block_size: int, rows: int
) -> None:
    """Compile now the `cache_attention_triton` kernels only eager forwards reach (a drafter's feed of pending
    entries or catch-up, a chunk continuing a prompt, at any of `rows` batch sizes): each query block up to
    ATTN_MAX_QUERIES rows a KV head at one batch size of each power-of-two split count. Every query sits at
    the padding slot (`scratch`), so nothing is read or written."""
    n_kv, D = k_cache.shape[1], k_cache.shape[3]
    G = num_heads // n_kv
    length = block_table.shape[1] * block_size
    sms = common.sm_count(k_cache.device)
    for B in split_classes(length, ATTN_BLOCK_N, n_kv, rows, sms):
        block_q = 16
        while block_q <= ATTN_MAX_QUERIES:
            T = max(1, block_q // G)
            q = torch.zeros(B, T, num_heads, D, dtype=k_cache.dtype, device=k_cache.device)
            at = torch.full((B, T), scratch, dtype=torch.long, device=k_cache.device)
            if cache_attention_ok(q, k_cache, at):
                cache_attention_triton(
                    q, k_cache, v_cache, 0, at, scratch, scale, block_table=block_table, block_size=block_size
                )
            block_q *= 2


ATTN_MAX_QUERIES = 128  # G * T per KV head; longer blocks (prefill) use SDPA


def cache_attention_ok(q: torch.Tensor, k_cache: torch.Tensor, write_idx: torch.Tensor) -> bool:
    """Can `cache_attention` serve these queries [B, T, H, D]?"""
    B, T, H, D = q.shape
    G = H // k_cache.shape[1]
    return (
        use_triton(q)
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.is_contiguous()
        and write_idx.stride(1) == 1
        and k_cache.stride(3) == 1
        and 16 <= D <= 256
        and triton.next_power_of_2(D) == D
        and G * T <= ATTN_MAX_QUERIES
    )


def key_splits(length: int, block_n: int, programs: int, sm_count: int) -> tuple[int, int]:
    """(splits, keys per split, a multiple of block_n) for `programs` programs per split over a
    cache of `length` keys: enough splits to cover the GPU at small batches, one at large ones."""
    n_split = max(1, min(triton.cdiv(length, block_n), triton.cdiv(2 * sm_count, programs)))
    chunk = triton.cdiv(triton.cdiv(length, n_split), block_n) * block_n
    return triton.cdiv(length, chunk), chunk


def cache_attention_triton(
    q,
    k_cache,
    v_cache,
    row_start: int,
    write_idx,
    scratch: int,
    scale: float,
    sm_count: int | None = None,
    tree_base=None,
    tree_anc=None,
    block_table=None,
    block_size: int = 0,
) -> torch.Tensor:
    """Attention of q [B, T, H, D] over rows row_start.. of the caches, query (b, t) seeing keys
    0..write_idx[b, t] (flash-decoding: the keys are split into chunks that run in parallel,
    then merged); with a tree, keys from tree_base[b] on only where bit key - tree_base[b] of
    tree_anc[b, t] is set (see ForwardContext); with a `block_table` the caches are block pools
    (see ForwardContext). Reads only as far as the longest query of a row reaches, not the whole cache."""
    B, T, H, D = q.shape
    paged = block_table is not None
    n_kv = k_cache.shape[1]
    length = block_table.shape[1] * block_size if paged else k_cache.shape[2]
    G = H // n_kv
    sm_count = sm_count or common.sm_count(q.device)
    block_q = max(16, triton.next_power_of_2(G * T))
    n_split, chunk = key_splits(length, ATTN_BLOCK_N, B * n_kv, sm_count)
    part = torch.empty(B * n_kv * n_split * block_q, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * n_kv * n_split * block_q, 2, dtype=torch.float32, device=q.device)
    tree = tree_anc is not None
    _attn_partial_kernel[(B, n_kv, n_split)](
        q,
        k_cache,
        v_cache,
        write_idx,
        tree_base if tree else write_idx,
        tree_anc if tree else write_idx,
        block_table if paged else write_idx,
        part,
        ml,
        T,
        H,
        G,
        n_kv,
        n_split,
        chunk,
        write_idx.stride(0),
        tree_anc.stride(0) if tree else 0,
        length,
        row_start,
        scratch,
        scale,
        block_table.stride(0) if paged else 0,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        D=D,
        BLOCK_Q=block_q,
        BLOCK_N=ATTN_BLOCK_N,
        TREE=tree,
        BS=block_size if paged else 1,
        PAGED=paged,
        num_warps=4,
        num_stages=2,
        **pdl_args(q),
    )
    out = torch.empty_like(q)
    _attn_combine_kernel[(B, n_kv, block_q)](
        part,
        ml,
        out,
        write_idx,
        T,
        H,
        G,
        n_kv,
        n_split,
        chunk,
        write_idx.stride(0),
        scratch,
        D=D,
        BLOCK_Q=block_q,
        SPLITS=triton.next_power_of_2(n_split),
        num_warps=1,
        **pdl_args(q),
    )
    return out
