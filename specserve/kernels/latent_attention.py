"""Absorbed multi-head latent attention (MLA) over the latent cache, for decode and verify.

The cache holds one head per token, [latent L | k_rot R]; the H absorbed query heads all attend
over it and the values are its first L dims (see model/mla.py). A program takes a block of heads
(times the T query tokens) as the rows of its matrix products, so each key tile is read once
for all of them, and that one tile serves as key (L + R dims) and value (its first L dims).
Flash-decoding as in kernels/attention.py: the keys are split into chunks that run in parallel
and a second kernel merges them; the same write-index, scratch-slot, tree and paging rules.

Rows per program: at most LATENT_MAX_ROWS (heads x tokens), over 8 warps. The float32 value
accumulator is rows x L: at L = 512 and 32 rows that is 64 registers a thread, and with the query
rows (L + R half-precision values each) held as MMA operands and a 32-key tile the program fits
the 255-register limit without spilling on sm_90 (ptxas); 64 rows would spill, and 16 rows over
4 warps already does. The 16-row blocks (few heads or tokens) therefore run on 8 warps too. L and
R must be powers of two (tl.arange) and are loaded as two tiles, since L + R (576) is not.
"""

from __future__ import annotations

import torch

from specserve.kernels import common
from specserve.kernels.attention import key_splits, split_classes
from specserve.kernels.common import interpreted, pdl_args, triton, use_triton
from specserve.kernels.norm import _token_stride, _tokens_even

if triton is not None:
    import triton.language as tl

    from specserve.kernels.attention import key_offsets, key_range, softmax_tile, split_weights, tree_bits
    from specserve.kernels.common import wait_for_previous
    from specserve.kernels.norm import _cache_slot, _rope_tables, _rotate

    # The split count and chunk are run-time values, as in `kernels.attention`.
    @triton.jit(do_not_specialize=["T", "n_split", "chunk", "widx_stride", "anc_stride", "length", "row_start",
                                   "scratch", "bt_stride"])
    def _latent_partial_kernel(q_ptr, c_ptr, widx_ptr, tbase_ptr, anc_ptr, bt_ptr, o_ptr, ml_ptr, out_ptr,
                               T, H, n_split, chunk, widx_stride, anc_stride, length, row_start, scratch, scale,
                               bt_stride, c_row, c_pos,
                               L: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BLOCK_Q: tl.constexpr,
                               BLOCK_N: tl.constexpr, TREE: tl.constexpr, BS: tl.constexpr,
                               PAGED: tl.constexpr, ONE_SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
                               PDL: tl.constexpr):
        # Program (b, head block, split): rows r = token * BH + head-in-block against keys
        # [split * chunk, (split + 1) * chunk), cut at the last key any row may see.
        b = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        wait_for_previous(PDL)
        r = tl.arange(0, BLOCK_Q)
        t = r // BH
        h = hb * BH + r % BH
        rmask = (t < T) & (h < H)
        widx = tl.load(widx_ptr + b * widx_stride + t, mask=rmask, other=-1)
        limit = tl.where(widx == scratch, -1, widx)  # padding queries (scratch slot) see nothing
        anc, tbase = tree_bits(anc_ptr, tbase_ptr, b, anc_stride, t, rmask, TREE)
        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        head = (b * T + t) * H + h
        q_lat = tl.load(q_ptr + head[:, None] * (L + R) + offs_l[None, :], mask=rmask[:, None], other=0.0)
        q_rot = tl.load(q_ptr + head[:, None] * (L + R) + L + offs_r[None, :], mask=rmask[:, None], other=0.0)
        if F32_DOT:
            q_lat, q_rot = q_lat.to(tl.float32), q_rot.to(tl.float32)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, L], tl.float32)
        row = (row_start + b).to(tl.int64)
        lo, hi = key_range(sp, chunk, length, limit)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kmask = offs_n < hi
            pos = key_offsets(bt_ptr, row, bt_stride, offs_n, kmask, c_row, c_pos, BS, PAGED)
            c = tl.load(c_ptr + pos[:, None] + offs_l[None, :], mask=kmask[:, None], other=0.0)
            k_rot = tl.load(c_ptr + pos[:, None] + L + offs_r[None, :], mask=kmask[:, None], other=0.0)
            if F32_DOT:
                c, k_rot = c.to(tl.float32), k_rot.to(tl.float32)
            s = (tl.dot(q_lat, tl.trans(c)) + tl.dot(q_rot, tl.trans(k_rot))) * scale
            p, alpha, m_new, l_i = softmax_tile(s, offs_n, kmask, limit, anc, tbase, m_i, l_i, TREE)
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
            m_i = m_new
        if ONE_SPLIT:  # the whole row in this program: normalise and write the output, no combine
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + head[:, None] * L + offs_l[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=rmask[:, None])
        elif lo < hi:  # splits past every row's last key write nothing; the combine skips them
            part = ((b * tl.num_programs(1) + hb) * n_split + sp) * BLOCK_Q + r
            tl.store(o_ptr + part[:, None] * L + offs_l[None, :], acc)
            tl.store(ml_ptr + part * 2, m_i)
            tl.store(ml_ptr + part * 2 + 1, l_i)

    @triton.jit(do_not_specialize=["T", "n_split", "chunk", "widx_stride", "scratch"])
    def _latent_combine_kernel(o_ptr, ml_ptr, out_ptr, widx_ptr, T, H, n_split, chunk, widx_stride, scratch,
                               L: tl.constexpr, BH: tl.constexpr, BLOCK_Q: tl.constexpr, SPLITS: tl.constexpr,
                               DC: tl.constexpr, PDL: tl.constexpr):
        # Program (b, head block * BLOCK_Q + row, value chunk): DC of the row's L output dims.
        wait_for_previous(PDL)
        b = tl.program_id(0)
        hb = tl.program_id(1) // BLOCK_Q
        r = tl.program_id(1) % BLOCK_Q
        t = r // BH
        h = hb * BH + r % BH
        if (t < T) & (h < H):
            widx = tl.load(widx_ptr + b * widx_stride + t)
            # splits up to the one holding this query's last key (none for a padding query)
            used = tl.where(widx == scratch, 0, widx // chunk + 1)
            sp = tl.arange(0, SPLITS)
            smask = sp < used
            part = ((b * (tl.num_programs(1) // BLOCK_Q) + hb) * n_split + sp) * BLOCK_Q + r
            w, total = split_weights(ml_ptr, part, smask)
            offs_d = tl.program_id(2) * DC + tl.arange(0, DC)
            acc = tl.load(o_ptr + part[:, None] * L + offs_d[None, :], mask=smask[:, None], other=0.0)
            o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
            tl.store(out_ptr + ((b * T + t) * H + h) * L + offs_d, o.to(out_ptr.dtype.element_ty))


if triton is not None:
    # Program (token, head): heads 0..H-1 build the absorbed query [latent | rotated rope] of one head,
    # head H writes the token's cache entry [normed latent | rotated k_rot]. (Token counts, strides and
    # rows change from call to call: not specialized on.)
    @triton.jit(do_not_specialize=["T", "qr_tok", "c_tok", "kr_tok", "idx_stride", "row_start", "bt_stride"])
    def _rope_latent_kernel(ql_ptr, qr_ptr, c_ptr, kr_ptr, q_out_ptr, cos_ptr, sin_ptr, pos_ptr, widx_ptr,
                            cache_ptr, bt_ptr, T, H, qr_tok, qr_head, c_tok, kr_tok, idx_stride, row_start,
                            bt_stride, c_row, c_pos, L: tl.constexpr, HALF: tl.constexpr, BS: tl.constexpr,
                            PAGED: tl.constexpr, PDL: tl.constexpr):
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
            slot = _cache_slot(bt_ptr, row_start + tok // T, tl.load(widx_ptr + idx), bt_stride, c_row, c_pos, BS,
                               PAGED)
            cdt = cache_ptr.dtype.element_ty
            tl.store(cache_ptr + slot + lat, tl.load(c_ptr + tok * c_tok + lat).to(cdt))
            tl.store(cache_ptr + slot + L + offs, o1.to(cdt))
            tl.store(cache_ptr + slot + L + HALF + offs, o2.to(cdt))


LATENT_BLOCK_N = 32  # keys per tile: 32 x (512 + 64) bf16 is 36 KB of shared memory a stage
LATENT_MAX_ROWS = 32  # heads x tokens per program (see the module docstring)
# partial results a combine program holds, [splits, output dims] (32 float32 registers a thread
# on 4 warps): more splits, fewer dims per program
LATENT_COMBINE_TILE = 4096


if triton is not None:

    @triton.jit(do_not_specialize=["M", "a_stride_m"])
    def _head_product_kernel(a_ptr, w_ptr, out_ptr, M, a_stride_m, a_stride_h, H, w_stride_h, w_stride_k,
                             K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr):
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
            a = tl.load(a_ptr + offs_m[:, None] * a_stride_m + h * a_stride_h + offs_k[None, :],
                        mask=mmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + h * w_stride_h + offs_k[:, None] * w_stride_k + offs_n[None, :],
                        mask=kmask[:, None] & nmask[None, :], other=0.0)
            if F32_DOT:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        tl.store(out_ptr + offs_m[:, None] * (H * N) + h * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


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
    fits = (use_triton(a, w) and a.dtype in (torch.bfloat16, torch.float16) and w.dtype == a.dtype
            and B * T <= HEAD_PRODUCT_MAX_TOKENS and a.stride(3) == 1 and _tokens_even(a) and w.stride(2) == 1
            and w.shape[0] == H and w.shape[1] == K)
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
        a, w, out, M, _token_stride(a), a.stride(2), H, w.stride(0), w.stride(1), K=K, N=N,
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=_interpreted_bf16(a),
        num_warps=warps, num_stages=stages, **pdl_args(a))
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
    return (pow2 and 16 <= R and 16 <= L <= 512 and cache.shape[1] == 1 and cache.shape[3] == D
            and q.is_contiguous() and cache.stride(3) == 1 and write_idx.stride(1) == 1
            and triton.next_power_of_2(T) <= LATENT_MAX_ROWS)


def latent_attention_ok(q: torch.Tensor, cache: torch.Tensor, write_idx: torch.Tensor, latent_dim: int) -> bool:
    """Can `latent_attention_triton` serve these queries on this device? (Half precision only: a
    float32 tl.dot on a GPU would round through TF32.)"""
    return (use_triton(q) and q.dtype in (torch.bfloat16, torch.float16)
            and latent_attention_fits(q, cache, write_idx, latent_dim))


def latent_attention_triton(q, cache, latent_dim: int, row_start: int, write_idx, scratch: int, scale: float,
                            sm_count: int | None = None, tree_base=None, tree_anc=None, block_table=None,
                            block_size: int = 0) -> torch.Tensor:
    """Absorbed attention of q [B, T, H, L + R] over rows row_start.. of the latent cache
    ([rows, 1, length, L + R], or a block pool with `block_table`), values its first L dims ->
    [B, T, H, L]. Query (b, t) sees keys 0..write_idx[b, t], a padding query (scratch index)
    none, a tree query only its ancestors past tree_base[b] (the rules of ForwardContext)."""
    B, T, H, D = q.shape
    L, R = latent_dim, D - latent_dim
    paged = block_table is not None
    length = block_table.shape[1] * block_size if paged else cache.shape[2]
    t_pow2 = triton.next_power_of_2(T)
    bh = min(triton.next_power_of_2(H), LATENT_MAX_ROWS // t_pow2)  # heads per program
    block_q = max(16, triton.next_power_of_2(bh * T))
    n_hb = triton.cdiv(H, bh)
    sm_count = sm_count or common.sm_count(q.device)
    n_split, chunk = key_splits(length, LATENT_BLOCK_N, B * n_hb, sm_count)
    out = torch.empty(B, T, H, L, dtype=q.dtype, device=q.device)
    one = n_split == 1
    rows = 1 if one else B * n_hb * n_split * block_q  # no partials when one split holds every key
    part = torch.empty(rows, L, dtype=torch.float32, device=q.device)
    ml = torch.empty(rows, 2, dtype=torch.float32, device=q.device)
    tree = tree_anc is not None
    _latent_partial_kernel[(B, n_hb, n_split)](
        q, cache, write_idx, tree_base if tree else write_idx, tree_anc if tree else write_idx,
        block_table if paged else write_idx, part, ml, out,
        T, H, n_split, chunk, write_idx.stride(0), tree_anc.stride(0) if tree else 0, length, row_start, scratch,
        scale, block_table.stride(0) if paged else 0, cache.stride(0), cache.stride(2),
        L=L, R=R, BH=bh, BLOCK_Q=block_q, BLOCK_N=LATENT_BLOCK_N, TREE=tree,
        BS=block_size if paged else 1, PAGED=paged, ONE_SPLIT=one, F32_DOT=_interpreted_bf16(q), num_warps=8,
        num_stages=2, **pdl_args(q))
    if not one:
        splits = triton.next_power_of_2(n_split)
        dc = min(L, max(16, LATENT_COMBINE_TILE // splits))
        _latent_combine_kernel[(B, n_hb * block_q, L // dc)](
            part, ml, out, write_idx, T, H, n_split, chunk, write_idx.stride(0), scratch,
            L=L, BH=bh, BLOCK_Q=block_q, SPLITS=splits, DC=dc,
            num_warps=4, **pdl_args(q))
    return out


def compile_eager_latent_variants(cache: torch.Tensor, num_heads: int, latent_dim: int, scale: float, scratch: int,
                                  block_table, block_size: int, rows: int) -> None:
    """Compile now the latent kernels only eager forwards reach (a catch-up or a chunk continuing a prompt of
    up to LATENT_MAX_ROWS tokens a row, at any of `rows` batch sizes): each power-of-two query length (its
    heads per program) at one batch size of each split count the combine is built for (one split: no
    combine). Every query sits at the padding slot (`scratch`), so nothing is read or written."""
    D = cache.shape[3]
    length = block_table.shape[1] * block_size
    sms = common.sm_count(cache.device)
    T = 1
    while T <= LATENT_MAX_ROWS:
        n_hb = triton.cdiv(num_heads, min(triton.next_power_of_2(num_heads), LATENT_MAX_ROWS // T))
        for B in split_classes(length, LATENT_BLOCK_N, n_hb, rows, sms):
            q = torch.zeros(B, T, num_heads, D, dtype=cache.dtype, device=cache.device)
            at = torch.full((B, T), scratch, dtype=torch.long, device=cache.device)
            if latent_attention_ok(q, cache, at, latent_dim):
                latent_attention_triton(q, cache, latent_dim, 0, at, scratch, scale, block_table=block_table,
                                        block_size=block_size)
        T *= 2


def rope_store_latent_fits(q_rot: torch.Tensor, k_rot: torch.Tensor, cache: torch.Tensor, write_idx: torch.Tensor,
                           positions: torch.Tensor, latent_dim: int) -> bool:
    """Do the rope parts q_rot [B, T, H, R] and k_rot [B, T, 1, R] and a latent cache have the layout
    `rope_store_latent_triton` takes?"""
    R = q_rot.shape[-1]
    return (triton is not None and R % 2 == 0 and triton.next_power_of_2(R // 2) == R // 2
            and triton.next_power_of_2(latent_dim) == latent_dim and cache.shape[3] == latent_dim + R
            and cache.stride(3) == 1 and q_rot.stride(3) == 1 and k_rot.stride(3) == 1
            and _tokens_even(q_rot) and _tokens_even(k_rot)
            and positions.stride() == write_idx.stride() and write_idx.stride(1) == 1)


def rope_store_latent_ok(q_rot: torch.Tensor, k_rot: torch.Tensor, cache: torch.Tensor, write_idx: torch.Tensor,
                         positions: torch.Tensor, latent_dim: int) -> bool:
    """Can `rope_store_latent_triton` serve these on this device?"""
    return use_triton(q_rot, k_rot) and rope_store_latent_fits(q_rot, k_rot, cache, write_idx, positions, latent_dim)


def rope_store_latent_triton(q_latent, q_rot, c, k_rot, cos, sin, positions, cache, row_start: int, write_idx,
                             block_table=None, block_size: int = 0) -> torch.Tensor:
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
        q_latent, q_rot, c, k_rot, q_out, cos, sin, positions, write_idx, cache,
        block_table if paged else write_idx, T, H, _token_stride(q_rot), q_rot.stride(2), c.shape[-1],
        _token_stride(k_rot), write_idx.stride(0), row_start, block_table.stride(0) if paged else 0,
        cache.stride(0), cache.stride(2), L=L, HALF=R // 2, BS=block_size if paged else 1, PAGED=paged,
        num_warps=2, enable_fp_fusion=False, **pdl_args(q_rot))  # (no fused multiply-add: the reference rounds each product)
    return q_out
