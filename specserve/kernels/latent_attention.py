"""Absorbed multi-head latent attention (MLA) over the latent cache, for decode and verify.

The cache holds one head per token, [latent L | k_rot R]; the H absorbed query heads all attend
over it and the values are its first L dims (see model/mla.py). A sequence's query rows (its T
tokens times H heads, token-major) are cut into blocks of LATENT_ROWS, the M dimension of the
tensor-core products, so each key tile is read once for all the rows of a block and serves as key
(L + R dims) and value (its first L dims); the blocks of one sequence and split are neighbouring
programs, so a tile read for one is in L2 for the others.

Split-K: each sequence's keys are cut into up to `n_split` chunks that run in parallel, then a
second kernel merges the chunks' partial sums. The split count is fixed at launch (from the batch,
the row blocks and the multiprocessors, so a CUDA graph holds it); the chunk length is computed in
the kernels from the sequence's own length, so a short sequence in a long cache uses few splits of
at least LATENT_MIN_CHUNK keys and a long one spreads over all of them. Write-index, scratch-slot,
tree and paging rules as in kernels/attention.py.

The float32 value accumulator is LATENT_ROWS x L: 64 x 512 over 8 warps is 128 registers a thread
(one warpgroup's MMA holds 64 rows, the second takes the other half of the value dims). The scores
are computed keys x rows, so the query block is the product's second operand, loaded once into shared
memory, and no register holds it across the key loop. L and R must be powers of two (tl.arange) and
are loaded as two tiles, since L + R (576) is not.
"""

from __future__ import annotations

import torch

from specserve.kernels import common
from specserve.kernels.common import interpreted, pdl_args, triton, use_triton
from specserve.kernels.norm import _token_stride, _tokens_even

if triton is not None:
    import triton.language as tl

    from specserve.kernels.attention import (
        key_offsets,
        key_range,
        softmax_tile,
        split_weights,
        tree_bits,
    )
    from specserve.kernels.common import wait_for_previous
    from specserve.kernels.norm import _cache_slot, _rope_tables, _rotate

    @triton.jit
    def latent_chunk(
        widx_ptr,
        b,
        widx_stride,
        T,
        scratch,
        n_split,
        T_BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_CHUNK: tl.constexpr,
    ):
        """Keys per split of sequence b: its length (past its last real query's key) over n_split, in
        whole key tiles, at least MIN_CHUNK. The partial and combine kernels compute it alike."""
        t = tl.arange(0, T_BLOCK)
        widx = tl.load(widx_ptr + b * widx_stride + t, mask=t < T, other=-1)
        length = tl.max(tl.where(widx == scratch, -1, widx), axis=0) + 1
        per_split = tl.cdiv(tl.cdiv(tl.maximum(length, 1), n_split), BLOCK_N) * BLOCK_N
        return tl.maximum(per_split, MIN_CHUNK)

    # The split count, token count and strides are run-time values: an eager call at any batch size or
    # context meets a compiled kernel (T_BLOCK and the combine's SPLITS, powers of two, take a few values).
    @triton.jit(
        do_not_specialize=["T", "n_split", "widx_stride", "anc_stride", "length", "row_start", "scratch", "bt_stride"]
    )
    def _latent_partial_kernel(
        q_ptr,
        c_ptr,
        widx_ptr,
        tbase_ptr,
        anc_ptr,
        bt_ptr,
        o_ptr,
        ml_ptr,
        out_ptr,
        T,
        H,
        n_split,
        widx_stride,
        anc_stride,
        length,
        row_start,
        scratch,
        scale,
        bt_stride,
        c_row,
        c_pos,
        L: tl.constexpr,
        R: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        T_BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_CHUNK: tl.constexpr,
        TREE: tl.constexpr,
        BS: tl.constexpr,
        PAGED: tl.constexpr,
        ONE_SPLIT: tl.constexpr,
        F32_DOT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (row block, split, b): query rows g = token * H + head of block rb against the keys
        # of split sp, cut at the last key any of the rows may see.
        rb = tl.program_id(0)
        sp = tl.program_id(1)
        b = tl.program_id(2)
        wait_for_previous(PDL)
        r = tl.arange(0, BLOCK_Q)
        g = rb * BLOCK_Q + r
        t = g // H
        rmask = g < T * H
        widx = tl.load(widx_ptr + b * widx_stride + t, mask=rmask, other=-1)
        # padding queries (scratch slot) see nothing; 32-bit positions keep the key masks small
        limit = tl.where(widx == scratch, -1, widx).to(tl.int32)
        chunk = latent_chunk(widx_ptr, b, widx_stride, T, scratch, n_split, T_BLOCK, BLOCK_N, MIN_CHUNK)
        lo, hi = key_range(sp, chunk, length, limit)
        lo, hi = lo.to(tl.int32), hi.to(tl.int32)  # (a 32-bit loop counter)
        anc, tbase = tree_bits(anc_ptr, tbase_ptr, b, anc_stride, t, rmask, TREE)
        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        head = b * T * H + g
        q_lat = tl.load(q_ptr + head[:, None] * (L + R) + offs_l[None, :], mask=rmask[:, None], other=0.0)
        q_rot = tl.load(q_ptr + head[:, None] * (L + R) + L + offs_r[None, :], mask=rmask[:, None], other=0.0)
        if F32_DOT:
            q_lat, q_rot = q_lat.to(tl.float32), q_rot.to(tl.float32)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, L], tl.float32)
        row = (row_start + b).to(tl.int64)
        # (the loop at the kernel's top level, no branch around it: its key loads are pipelined)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kmask = offs_n < hi
            # keys past hi are read at hi - 1 (in bounds, no load masks) and masked out of the softmax
            if PAGED and BS >= BLOCK_N:  # the tile lies in one block (start is a multiple of BLOCK_N)
                block = tl.load(bt_ptr + row * bt_stride + start // BS).to(tl.int64)
                pos = block * c_row + (tl.minimum(offs_n, hi - 1) % BS) * c_pos
            else:
                pos = key_offsets(bt_ptr, row, bt_stride, tl.minimum(offs_n, hi - 1), kmask, c_row, c_pos, BS, PAGED)
            c = tl.load(c_ptr + pos[:, None] + offs_l[None, :])
            k_rot = tl.load(c_ptr + pos[:, None] + L + offs_r[None, :])
            if F32_DOT:
                c, k_rot = c.to(tl.float32), k_rot.to(tl.float32)
            # Scores as keys x rows, transposed back: the query block is then the products' second
            # operand, which the tensor cores read from shared memory (loaded once), not registers.
            # (Each product accumulates into the one before: no second tile in registers.)
            s = tl.trans(tl.dot(k_rot, tl.trans(q_rot), tl.dot(c, tl.trans(q_lat)))) * scale
            p, alpha, m_new, l_i = softmax_tile(s, offs_n, kmask, limit, anc, tbase, m_i, l_i, TREE)
            acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None])
            m_i = m_new
        if ONE_SPLIT:  # the whole row in this program: normalise and write the output (zeros: no key), no combine
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + head[:, None] * L + offs_l[None, :], o.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
        elif lo < hi:  # splits past every row's last key write nothing; the combine skips them
            part = ((b * n_split + sp) * tl.num_programs(0) + rb) * BLOCK_Q + r
            tl.store(o_ptr + part[:, None] * L + offs_l[None, :], acc, mask=rmask[:, None])
            tl.store(ml_ptr + part * 2, m_i, mask=rmask)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=rmask)

    @triton.jit(do_not_specialize=["T", "n_split", "widx_stride", "scratch"])
    def _latent_combine_kernel(
        o_ptr,
        ml_ptr,
        out_ptr,
        widx_ptr,
        T,
        H,
        n_split,
        widx_stride,
        scratch,
        L: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        T_BLOCK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_CHUNK: tl.constexpr,
        SPLITS: tl.constexpr,
        DC: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (query row g, b, value chunk): DC of the row's L output dims, from its splits' partials.
        wait_for_previous(PDL)
        g = tl.program_id(0)
        b = tl.program_id(1)
        widx = tl.load(widx_ptr + b * widx_stride + g // H)
        chunk = latent_chunk(widx_ptr, b, widx_stride, T, scratch, n_split, T_BLOCK, BLOCK_N, MIN_CHUNK)
        # splits up to the one holding this query's last key (none for a padding query)
        used = tl.where(widx == scratch, 0, widx // chunk + 1)
        sp = tl.arange(0, SPLITS)
        smask = sp < used
        n_rb = tl.cdiv(T * H, BLOCK_Q)
        part = ((b * n_split + sp) * n_rb + g // BLOCK_Q) * BLOCK_Q + g % BLOCK_Q
        w, total = split_weights(ml_ptr, part, smask)
        offs_d = tl.program_id(2) * DC + tl.arange(0, DC)
        acc = tl.load(o_ptr + part[:, None] * L + offs_d[None, :], mask=smask[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + (b * T * H + g) * L + offs_d, o.to(out_ptr.dtype.element_ty))


if triton is not None:
    # Program (token, head): heads 0..H-1 build the absorbed query [latent | rotated rope] of one head,
    # head H writes the token's cache entry [normed latent | rotated k_rot]. (Token counts, strides and
    # rows change from call to call: not specialized on.)
    @triton.jit(do_not_specialize=["T", "qr_tok", "c_tok", "kr_tok", "idx_stride", "row_start", "bt_stride"])
    def _rope_latent_kernel(
        ql_ptr,
        qr_ptr,
        c_ptr,
        kr_ptr,
        q_out_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        widx_ptr,
        cache_ptr,
        bt_ptr,
        T,
        H,
        qr_tok,
        qr_head,
        c_tok,
        kr_tok,
        idx_stride,
        row_start,
        bt_stride,
        c_row,
        c_pos,
        L: tl.constexpr,
        HALF: tl.constexpr,
        BS: tl.constexpr,
        PAGED: tl.constexpr,
        PDL: tl.constexpr,
    ):
        tok = tl.program_id(0)
        head = tl.program_id(1)
        dt = q_out_ptr.dtype.element_ty
        wait_for_previous(PDL)
        offs = tl.arange(0, HALF)
        lat = tl.arange(0, L)
        idx = (tok // T) * idx_stride + tok % T  # positions/write_idx may be column slices of a wider buffer
        c1, c2, s1, s2 = _rope_tables(cos_ptr, sin_ptr, tl.load(pos_ptr + idx), offs, HALF, dt)
        if head < H:
            out = q_out_ptr + (tok * H + head) * (L + 2 * HALF)
            tl.store(out + lat, tl.load(ql_ptr + (tok * H + head) * L + lat))
            o1, o2 = _rotate(qr_ptr + tok * qr_tok + head * qr_head, c1, c2, s1, s2, offs, HALF, dt)
            tl.store(out + L + offs, o1)
            tl.store(out + L + HALF + offs, o2)
        else:
            o1, o2 = _rotate(kr_ptr + tok * kr_tok, c1, c2, s1, s2, offs, HALF, dt)
            slot = _cache_slot(
                bt_ptr, row_start + tok // T, tl.load(widx_ptr + idx), bt_stride, c_row, c_pos, BS, PAGED
            )
            cdt = cache_ptr.dtype.element_ty
            tl.store(cache_ptr + slot + lat, tl.load(c_ptr + tok * c_tok + lat).to(cdt))
            tl.store(cache_ptr + slot + L + offs, o1.to(cdt))
            tl.store(cache_ptr + slot + L + HALF + offs, o2.to(cdt))


LATENT_ROWS = 64  # query rows (tokens x heads) a program, the tensor cores' M (see the module docstring)
LATENT_MAX_TOKENS = 32  # query tokens a sequence takes (longer blocks, prefill, use SDPA)
# Launch shape (benchmarks/mla_attention_gpu.py --sweep times the others): 32-key tiles keep the program
# within the register file without spilling on sm_90; 64-key tiles spill and run slower.
LATENT_BLOCK_N = 32  # keys per tile: 32 x (512 + 64) bf16 is 36 KB of shared memory a stage
LATENT_WARPS = 8
LATENT_STAGES = 3  # key tiles in flight a program
# Keys a split at least: at short contexts a sequence's keys spread over many multiprocessors (a program's
# tiles run one after another), at the price of more partial sums for the combine.
LATENT_MIN_CHUNK = 64
# programs a launch aims at, per multiprocessor (one resident at a time: registers and shared memory): the
# splits of a sequence fill the GPU at small batches and long contexts
LATENT_WAVES = 1
# partial results a combine program holds, [splits, output dims] (32 float32 registers a thread
# on 4 warps): more splits, fewer dims per program
LATENT_COMBINE_TILE = 4096


if triton is not None:

    @triton.jit(do_not_specialize=["M", "a_stride_m"])
    def _head_product_kernel(
        a_ptr,
        w_ptr,
        out_ptr,
        M,
        a_stride_m,
        a_stride_h,
        H,
        w_stride_h,
        w_stride_k,
        K: tl.constexpr,
        N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        F32_DOT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (h, n): out[m, h, n..] = sum_k a[m, h, k] W_h[k, n..] for the M tokens, each weight tile
        # read once for all of them (W_h rows w_stride_k apart).
        h = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        mmask, nmask = offs_m < M, offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        wait_for_previous(PDL)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            a = tl.load(
                a_ptr + offs_m[:, None] * a_stride_m + h * a_stride_h + offs_k[None, :],
                mask=mmask[:, None] & kmask[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + h * w_stride_h + offs_k[:, None] * w_stride_k + offs_n[None, :],
                mask=kmask[:, None] & nmask[None, :],
                other=0.0,
            )
            if F32_DOT:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        tl.store(
            out_ptr + offs_m[:, None] * (H * N) + h * N + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=mmask[:, None] & nmask[None, :],
        )


# The absorbed query's product at decode and verify sizes (H200, Kimi-K2.5 width, 64 heads of [128, 512]:
# 4.1-4.9 us against einsum's 4.9-5.1 up to 32 tokens; benchmarks/mla_router_sweep.py). The values' product
# (W_UV read transposed) is einsum's, which beat every launch shape tried there.
HEAD_PRODUCT_MAX_TOKENS = 32
HEAD_PRODUCT_CONFIG = (128, 128, 8, 1)  # BLOCK_N, BLOCK_K, warps, stages


def head_product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head h, a[.., h, :] @ w[h] for a [B, T, H, K] (unit-stride features, tokens evenly strided) and
    weights w [H, K, N] with unit-stride rows (MLA's absorbed query: q_nope times W_UK, a slice of kv_b_proj)
    -> [B, T, H, N] in a's dtype, float32 sums. On the GPU up to HEAD_PRODUCT_MAX_TOKENS tokens take one
    launch (cuBLAS's batched product of one-row matrices streams the weights slower there); else
    torch.einsum."""
    B, T, H, K = a.shape
    fits = (
        use_triton(a, w)
        and a.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == a.dtype
        and B * T <= HEAD_PRODUCT_MAX_TOKENS
        and a.stride(3) == 1
        and _tokens_even(a)
        and w.stride(2) == 1
        and w.shape[0] == H
        and w.shape[1] == K
    )
    if not fits:
        return torch.einsum("bthk,hkn->bthn", a, w)
    return head_product_triton(a, w)


def head_product_triton(a: torch.Tensor, w: torch.Tensor, cfg: tuple | None = None) -> torch.Tensor:
    """`head_product`'s kernel, for inputs it accepts; `cfg` as HEAD_PRODUCT_CONFIG."""
    B, T, H, K = a.shape
    N = w.shape[2]
    M = B * T
    block_n, block_k, warps, stages = cfg or HEAD_PRODUCT_CONFIG
    out = torch.empty(B, T, H, N, dtype=a.dtype, device=a.device)
    _head_product_kernel[(H, triton.cdiv(N, block_n))](
        a,
        w,
        out,
        M,
        _token_stride(a),
        a.stride(2),
        H,
        w.stride(0),
        w.stride(1),
        K=K,
        N=N,
        BLOCK_M=max(16, triton.next_power_of_2(M)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        F32_DOT=_interpreted_bf16(a),
        num_warps=warps,
        num_stages=stages,
        **pdl_args(a),
    )
    return out


def _interpreted_bf16(q: torch.Tensor) -> bool:
    """Triton's interpreter multiplies bfloat16 tiles as their int16 bits in tl.dot, so there the
    kernel multiplies in float32 (after loading, and before storing, in bfloat16 as on a GPU)."""
    return q.dtype == torch.bfloat16 and interpreted()


def latent_attention_fits(q: torch.Tensor, cache: torch.Tensor, write_idx: torch.Tensor, latent_dim: int) -> bool:
    """Do queries [B, T, H, L + R] and a latent cache [.., 1, .., L + R] have shapes the kernel takes?
    (Decode and verify blocks; prefill, whose T is longer, uses SDPA.)"""
    T, D = q.shape[1], q.shape[3]
    L, R = latent_dim, D - latent_dim
    pow2 = triton is not None and triton.next_power_of_2(L) == L and triton.next_power_of_2(R) == R
    return (
        pow2
        and 16 <= R
        and 16 <= L <= 512
        and cache.shape[1] == 1
        and cache.shape[3] == D
        and q.is_contiguous()
        and cache.stride(3) == 1
        and write_idx.stride(1) == 1
        and T <= LATENT_MAX_TOKENS
    )


def latent_attention_ok(q: torch.Tensor, cache: torch.Tensor, write_idx: torch.Tensor, latent_dim: int) -> bool:
    """Can `latent_attention_triton` serve these queries on this device? (Half precision only: a
    float32 tl.dot on a GPU would round through TF32.)"""
    return (
        use_triton(q)
        and q.dtype in (torch.bfloat16, torch.float16)
        and latent_attention_fits(q, cache, write_idx, latent_dim)
    )


def latent_splits(length: int, batch: int, tokens: int, heads: int, sm_count: int) -> int:
    """Splits of each sequence's keys for `batch` sequences of `tokens` x `heads` query rows over a cache
    of `length` keys: enough that batch x row blocks x splits fill LATENT_WAVES programs a multiprocessor,
    no more than chunks of LATENT_MIN_CHUNK keys make (one: no combine)."""
    programs = batch * triton.cdiv(tokens * heads, LATENT_ROWS)
    return max(1, min(triton.cdiv(length, LATENT_MIN_CHUNK), LATENT_WAVES * sm_count // programs))


def latent_attention_triton(
    q,
    cache,
    latent_dim: int,
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
    """Absorbed attention of q [B, T, H, L + R] over rows row_start.. of the latent cache
    ([rows, 1, length, L + R], or a block pool with `block_table`), values its first L dims ->
    [B, T, H, L]. Query (b, t) sees keys 0..write_idx[b, t], a padding query (scratch index)
    none, a tree query only its ancestors past tree_base[b] (the rules of ForwardContext)."""
    B, T, H, D = q.shape
    L, R = latent_dim, D - latent_dim
    paged = block_table is not None
    length = block_table.shape[1] * block_size if paged else cache.shape[2]
    n_rb = triton.cdiv(T * H, LATENT_ROWS)
    n_split = latent_splits(length, B, T, H, sm_count or common.sm_count(q.device))
    t_block = max(2, triton.next_power_of_2(T))
    out = torch.empty(B, T, H, L, dtype=q.dtype, device=q.device)
    one = n_split == 1
    rows = 1 if one else B * n_split * n_rb * LATENT_ROWS  # no partials when one split holds every key
    part = torch.empty(rows, L, dtype=torch.float32, device=q.device)
    ml = torch.empty(rows, 2, dtype=torch.float32, device=q.device)
    tree = tree_anc is not None
    _latent_partial_kernel[(n_rb, n_split, B)](
        q,
        cache,
        write_idx,
        tree_base if tree else write_idx,
        tree_anc if tree else write_idx,
        block_table if paged else write_idx,
        part,
        ml,
        out,
        T,
        H,
        n_split,
        write_idx.stride(0),
        tree_anc.stride(0) if tree else 0,
        length,
        row_start,
        scratch,
        scale,
        block_table.stride(0) if paged else 0,
        cache.stride(0),
        cache.stride(2),
        L=L,
        R=R,
        BLOCK_Q=LATENT_ROWS,
        T_BLOCK=t_block,
        BLOCK_N=LATENT_BLOCK_N,
        MIN_CHUNK=LATENT_MIN_CHUNK,
        TREE=tree,
        BS=block_size if paged else 1,
        PAGED=paged,
        ONE_SPLIT=one,
        F32_DOT=_interpreted_bf16(q),
        num_warps=LATENT_WARPS,
        num_stages=LATENT_STAGES,
        **pdl_args(q),
    )
    if not one:
        splits = triton.next_power_of_2(n_split)
        dc = min(L, max(16, LATENT_COMBINE_TILE // splits))
        _latent_combine_kernel[(T * H, B, L // dc)](
            part,
            ml,
            out,
            write_idx,
            T,
            H,
            n_split,
            write_idx.stride(0),
            scratch,
            L=L,
            BLOCK_Q=LATENT_ROWS,
            T_BLOCK=t_block,
            BLOCK_N=LATENT_BLOCK_N,
            MIN_CHUNK=LATENT_MIN_CHUNK,
            SPLITS=splits,
            DC=dc,
            num_warps=4,
            **pdl_args(q),
        )
    return out


def latent_variants(length: int, heads: int, rows: int, sm_count: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(T_BLOCK, combine SPLITS or 0 for none) -> one (batch, tokens) that launches it, for every batch of
    1..`rows` sequences and every query length up to LATENT_MAX_TOKENS: the kernels an eager call may need."""
    variants: dict[tuple[int, int], tuple[int, int]] = {}
    for T in range(1, LATENT_MAX_TOKENS + 1):
        for B in range(1, rows + 1):
            n_split = latent_splits(length, B, T, heads, sm_count)
            combine = 0 if n_split == 1 else triton.next_power_of_2(n_split)
            variants.setdefault((max(2, triton.next_power_of_2(T)), combine), (B, T))
    return variants


def compile_eager_latent_variants(
    cache: torch.Tensor,
    num_heads: int,
    latent_dim: int,
    scale: float,
    scratch: int,
    block_table,
    block_size: int,
    rows: int,
) -> None:
    """Compile now the latent kernels only eager forwards reach (a catch-up or a chunk continuing a prompt of
    up to LATENT_MAX_TOKENS tokens a row, at any of `rows` batch sizes): each `latent_variants` launch. Every
    query sits at the padding slot (`scratch`), so nothing is read and only zeros are written."""
    D = cache.shape[3]
    length = block_table.shape[1] * block_size
    for B, T in latent_variants(length, num_heads, rows, common.sm_count(cache.device)).values():
        q = torch.zeros(B, T, num_heads, D, dtype=cache.dtype, device=cache.device)
        at = torch.full((B, T), scratch, dtype=torch.long, device=cache.device)
        if latent_attention_ok(q, cache, at, latent_dim):
            latent_attention_triton(
                q, cache, latent_dim, 0, at, scratch, scale, block_table=block_table, block_size=block_size
            )


def rope_store_latent_fits(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    cache: torch.Tensor,
    write_idx: torch.Tensor,
    positions: torch.Tensor,
    latent_dim: int,
) -> bool:
    """Do the rope parts q_rot [B, T, H, R] and k_rot [B, T, 1, R] and a latent cache have the layout
    `rope_store_latent_triton` takes?"""
    R = q_rot.shape[-1]
    return (
        triton is not None
        and R % 2 == 0
        and triton.next_power_of_2(R // 2) == R // 2
        and triton.next_power_of_2(latent_dim) == latent_dim
        and cache.shape[3] == latent_dim + R
        and cache.stride(3) == 1
        and q_rot.stride(3) == 1
        and k_rot.stride(3) == 1
        and _tokens_even(q_rot)
        and _tokens_even(k_rot)
        and positions.stride() == write_idx.stride()
        and write_idx.stride(1) == 1
    )


def rope_store_latent_ok(
    q_rot: torch.Tensor,
    k_rot: torch.Tensor,
    cache: torch.Tensor,
    write_idx: torch.Tensor,
    positions: torch.Tensor,
    latent_dim: int,
) -> bool:
    """Can `rope_store_latent_triton` serve these on this device?"""
    return use_triton(q_rot, k_rot) and rope_store_latent_fits(q_rot, k_rot, cache, write_idx, positions, latent_dim)


def rope_store_latent_triton(
    q_latent,
    q_rot,
    c,
    k_rot,
    cos,
    sin,
    positions,
    cache,
    row_start: int,
    write_idx,
    block_table=None,
    block_size: int = 0,
) -> torch.Tensor:
    """MLA's step between the projections and the attention, in one launch: the absorbed query
    [q_latent | rope(q_rot)] [B, T, H, L + R] is returned, and each token's cache entry
    [c | rope(k_rot)] is written for rows row_start.. at cache index `write_idx` [B, T] (cache
    [rows, 1, len, L + R], or with a `block_table` a pool [blocks, 1, block_size, L + R]). The
    rotations round as the reference's (`KVCacheAttention._rotate`); q_latent [B, T, H, L],
    c [B, T, L] (the normed latent)."""
    B, T, H, L = q_latent.shape
    R = q_rot.shape[-1]
    q_latent = q_latent.contiguous()
    c = c.contiguous()
    q_out = torch.empty(B, T, H, L + R, dtype=q_rot.dtype, device=q_rot.device)
    paged = block_table is not None
    _rope_latent_kernel[(B * T, H + 1)](
        q_latent,
        q_rot,
        c,
        k_rot,
        q_out,
        cos,
        sin,
        positions,
        write_idx,
        cache,
        block_table if paged else write_idx,
        T,
        H,
        _token_stride(q_rot),
        q_rot.stride(2),
        c.shape[-1],
        _token_stride(k_rot),
        write_idx.stride(0),
        row_start,
        block_table.stride(0) if paged else 0,
        cache.stride(0),
        cache.stride(2),
        L=L,
        HALF=R // 2,
        BS=block_size if paged else 1,
        PAGED=paged,
        num_warps=2,
        enable_fp_fusion=False,
        **pdl_args(q_rot),
    )  # (no fused multiply-add: the reference rounds each product)
    return q_out
