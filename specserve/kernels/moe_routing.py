"""MoE routing and pair alignment for decode and verify sizes, as two Triton programs.

At a decode's few tokens the torch routing (`model.moe.route_grouped_sigmoid` / `route_softmax`)
and alignment (`kernels.moe.align_pairs`) are some thirty tiny kernels, each a few microseconds
of a graph replay; here they are two launches:

- ``fused_route``  one program a token: scores, group selection, top-k and the routing weights
                   of router logits [N, E], with the torch functions' roundings.
- ``fused_align``  one program for all N x top_k pairs: the same (pairs, block_expert) as
                   `align_pairs`, from a histogram of the experts, a sort of (expert, pair)
                   keys and a scatter.

and before them ``router_logits``: a float32 router's logits of 2 to ROUTER_ROWS tokens in 16-bit
activations, the cast and the product in one launch, where it beats the cast plus cuBLAS's float32
product; one row stays with the cast and cuBLAS's GEMV, which is faster there (BENCHMARKS.md,
benchmarks/mla_router_sweep.py).

Both have fixed output sizes and never wait on the host, so a CUDA graph captures them. They
serve up to `MAX_TOKENS` tokens, `MAX_TOP_K` experts a token and `MAX_EXPERTS` experts
(`fused_routing_fits`); prefill takes the torch path.

Tie rule of every top-k here (group ranking, experts in groups, experts overall): of equal
values the lower index ranks first. (torch.topk leaves the order of exact ties unspecified.)
"""

from __future__ import annotations

import torch

from specserve.config import MoEConfig
from specserve.kernels.common import pdl_args, triton, use_triton
from specserve.kernels.linear import linear

MAX_TOKENS, MAX_TOP_K, MAX_EXPERTS = 64, 8, 512
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
ROUTER_ROWS = 8  # tokens `router_logits`' kernel serves (a short verify's); more, or one, take the cast and cuBLAS
# (experts a program, features a step, warps, pipeline stages): fixed, so every row sums in one order
ROUTER_CONFIG = (1, 2048, 8, 2)

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

    @triton.jit
    def _round(v, DT: tl.constexpr):
        """float32 v rounded to DT (where torch would hold it in DT), back in float32."""
        return v.to(DT).to(tl.float32)

    @triton.jit
    def _scores(x, SIGMOID: tl.constexpr, SCORE_DT: tl.constexpr, peak, total):
        """Routing scores of float32 logits x: sigmoid in SCORE_DT, or the float32 softmax given
        the row's largest logit and its sum of exp(logit - peak). (Divisions round to nearest,
        as torch's do; Triton's `/` is approximate on the GPU.)"""
        if SIGMOID:
            return _round(tl.math.div_rn(1.0, 1.0 + tl.exp(-x)), SCORE_DT)
        else:
            return tl.math.div_rn(tl.exp(x - peak), total)

    @triton.jit
    def _route_kernel(
        logits_ptr,
        bias_ptr,
        w_ptr,
        ids_ptr,
        E: tl.constexpr,
        TOP_K: tl.constexpr,
        GROUPS: tl.constexpr,
        KEPT: tl.constexpr,
        G_PAD: tl.constexpr,
        PER_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
        SIGMOID: tl.constexpr,
        NORM: tl.constexpr,
        SCALE: tl.constexpr,
        SCORE_DT: tl.constexpr,
        CHOICE_DT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program n: token n's logits as a [group, expert in group] tile (one group unless
        # grouped sigmoid routing), padded to powers of two; padding ranks below everything.
        n = tl.program_id(0).to(tl.int64)
        PER: tl.constexpr = E // GROUPS
        g = tl.arange(0, G_PAD)
        j = tl.arange(0, PER_PAD)
        e = g[:, None] * PER + j[None, :]
        valid = (g < GROUPS)[:, None] & (j < PER)[None, :]
        wait_for_previous(PDL)
        x = tl.load(logits_ptr + n * E + e, mask=valid, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            peak = 0.0
            total = 1.0
            bias = tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
            choice = tl.where(valid, _round(_scores(x, True, SCORE_DT, peak, total) + bias, CHOICE_DT), float("-inf"))
            if GROUPS > 1:
                # a group's strength: its best two biased scores (the first best taken out once)
                best, at = tl.max(choice, axis=1, return_indices=True, return_indices_tie_break_left=True)
                second = tl.max(tl.where(j[None, :] == at[:, None], float("-inf"), choice), axis=1)
                strength = tl.where(g < GROUPS, _round(best + second, CHOICE_DT), float("-inf"))
                kept = g < 0
                for _ in tl.static_range(KEPT):
                    _, pick = tl.max(
                        tl.where(kept, float("-inf"), strength),
                        axis=0,
                        return_indices=True,
                        return_indices_tie_break_left=True,
                    )
                    kept = kept | (g == pick)
                choice = tl.where(kept[:, None], choice, float("-inf"))
        else:
            peak = tl.max(x)
            total = tl.sum(tl.exp(x - peak))
            choice = tl.where(valid, _scores(x, False, SCORE_DT, peak, total), float("-inf"))
        # top-k: k rounds of the best left, its flat index (g * PER_PAD + j) turned into the
        # expert's; the weights are recomputed from the chosen logits exactly as the tile's.
        flat = tl.reshape(choice, [G_PAD * PER_PAD])
        spots = tl.arange(0, G_PAD * PER_PAD)
        kk = tl.arange(0, K_PAD)
        ids = tl.zeros([K_PAD], tl.int32)
        for r in tl.static_range(TOP_K):
            _, spot = tl.max(flat, axis=0, return_indices=True, return_indices_tie_break_left=True)
            ids = tl.where(kk == r, spot // PER_PAD * PER + spot % PER_PAD, ids)
            flat = tl.where(spots == spot, float("-inf"), flat)  # (k <= E: a real expert is always left)
        out = kk < TOP_K
        w = tl.load(logits_ptr + n * E + ids, mask=out, other=0.0).to(tl.float32)
        w = tl.where(out, _scores(w, SIGMOID, SCORE_DT, peak, total), 0.0)
        if SIGMOID:
            if NORM:
                w = _round(tl.math.div_rn(w, _round(_round(tl.sum(w), SCORE_DT) + 1e-20, SCORE_DT)), SCORE_DT)
            w = w * SCALE
        elif NORM:
            w = tl.math.div_rn(w, tl.sum(w))
        tl.store(w_ptr + n * TOP_K + kk, w.to(w_ptr.dtype.element_ty), mask=out)
        tl.store(ids_ptr + n * TOP_K + kk, ids.to(tl.int64), mask=out)

    @triton.jit(do_not_specialize=["first", "P", "BLOCKS"])
    def _align_kernel(
        ids_ptr,
        pairs_ptr,
        block_expert_ptr,
        first,
        P,
        BLOCKS,
        E: tl.constexpr,
        BLOCK_M: tl.constexpr,
        P_PAD: tl.constexpr,
        BINS: tl.constexpr,
        ROWS_PAD: tl.constexpr,
        BLOCKS_PAD: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # One program. Bucket E collects the pairs of experts another rank holds (and padding).
        # (P and BLOCKS are arguments, not constants: one compile serves every batch up to P_PAD.)
        p = tl.arange(0, P_PAD)
        wait_for_previous(PDL)
        local = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int32) - first
        held = (local >= 0) & (local < E) & (p < P)
        bucket = tl.where(held, local, E)
        counts = tl.histogram(bucket, BINS)
        experts = tl.arange(0, BINS)
        padded = tl.where(experts < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        # An expert's first row, less its first pair's place in the sorted order: the keys
        # sort by bucket, then pair index, so within an expert pairs keep their order.
        shift = tl.cumsum(padded, 0) - padded - (tl.cumsum(counts, 0) - counts)
        key = tl.sort(bucket * P_PAD + p)
        expert = key // P_PAD
        dest = tl.arange(0, P_PAD) + tl.gather(shift, expert, 0)
        mine = expert < E
        rows = tl.arange(0, ROWS_PAD)
        tl.store(pairs_ptr + rows, P, mask=rows < BLOCKS * BLOCK_M)
        blocks = tl.arange(0, BLOCKS_PAD)
        tl.store(block_expert_ptr + blocks, E, mask=blocks < BLOCKS)
        tl.debug_barrier()  # the fills land before the scatters overwrite them
        tl.store(pairs_ptr + dest, key % P_PAD, mask=mine)
        # every used block starts with a pair of its expert (runs start on block boundaries)
        tl.store(block_expert_ptr + dest // BLOCK_M, expert, mask=mine & (dest % BLOCK_M == 0))

    @triton.jit(do_not_specialize=["N"])
    def _router_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        N,
        E,
        H: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program e: experts e*BLOCK_E.. for every token, each weight tile read once for all of them.
        # Float32 products of the activations (exact in float32) and the weights, summed per step
        # over BLOCK_K features, then across steps: the same order for a row whatever N is.
        offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_m = tl.arange(0, BLOCK_M)
        emask, mmask = offs_e < E, offs_m < N
        acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        # (the router does not depend on the kernel before: its first tile is read while that one drains)
        w = tl.load(
            w_ptr + offs_e[:, None] * H + offs_k[None, :], mask=emask[:, None] & (offs_k < H)[None, :], other=0.0
        )
        wait_for_previous(PDL)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < H
            if k0 > 0:
                w = tl.load(
                    w_ptr + offs_e[:, None] * H + offs_k[None, :], mask=emask[:, None] & kmask[None, :], other=0.0
                )
            x = tl.load(
                x_ptr + offs_m[:, None] * H + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0
            ).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        tl.store(out_ptr + offs_m[:, None] * E + offs_e[None, :], acc, mask=mmask[:, None] & emask[None, :])


def _router_kernel_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `_router_kernel` serves tokens x [N, H] and router w [E, H]: a float32 router on the GPU,
    2 to ROUTER_ROWS tokens."""
    return (
        use_triton(x, w)
        and w.dtype == torch.float32
        and x.dtype in FLOATS
        and x.dim() == 2
        and 1 < x.shape[0] <= ROUTER_ROWS
        and w.is_contiguous()
    )


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Router logits x @ w.T in the router's dtype for tokens x [N, H] (cast to it first, as the reference
    casts). A float32 router of 2 to ROUTER_ROWS tokens on the GPU takes one launch: the activations
    multiplied in float32 without a cast kernel, float32 sums (in another order than cuBLAS's); else
    `linear`."""
    if not _router_kernel_fits(x, w):
        return linear(x.to(w.dtype), w)
    return router_logits_triton(x, w)


def router_logits_triton(x: torch.Tensor, w: torch.Tensor, cfg: tuple | None = None) -> torch.Tensor:
    """`router_logits`' kernel, for inputs it accepts; `cfg` as ROUTER_CONFIG."""
    N, H = x.shape
    E = w.shape[0]
    block_e, block_k, warps, stages = cfg or ROUTER_CONFIG
    x = x.contiguous()
    out = torch.empty(N, E, dtype=torch.float32, device=x.device)
    # (one tile of 8 rows whatever N is (ROUTER_ROWS <= 8): a row's sums add in one order in every batch)
    _router_kernel[(triton.cdiv(E, block_e),)](
        x,
        w,
        out,
        N,
        E,
        H=H,
        BLOCK_M=8,
        BLOCK_E=block_e,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **pdl_args(x),
    )
    return out


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def aligned_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Blocks of an alignment of `pairs` pairs over `experts` held experts: the worst case, each
    chosen expert wasting under one block."""
    return min(pairs, experts) + -(-pairs // block_m)


def fused_routing_fits(tokens: int, top_k: int, experts: int) -> bool:
    """Whether `fused_route` / `fused_align` serve this many tokens, experts a token and experts."""
    return triton is not None and tokens <= MAX_TOKENS and top_k <= MAX_TOP_K and experts <= MAX_EXPERTS


def fused_route(
    logits: torch.Tensor, m: MoEConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_grouped_sigmoid(logits, bias, m)` when `bias` is given (sigmoid scoring), else
    `route_softmax(logits, m)`, for router logits [N, E] within `fused_routing_fits`: (weights
    [N, k] in the logits' dtype, expert ids [N, k] int64). Roundings follow the torch functions
    (scores and weights in the logits' dtype, the biased choice in their promoted dtype, the
    softmax in float32); its sums (the softmax's over E, the normalisation's over k) may add in
    another order than torch's (an ulp or two)."""
    N, E = logits.shape
    k = m.top_k
    if logits.dtype not in FLOATS:
        raise ValueError(f"fused_route takes float32/float16/bfloat16 logits, got {logits.dtype}")
    if not fused_routing_fits(N, k, E):
        raise ValueError(
            f"fused_route serves up to {MAX_TOKENS} tokens, top_k {MAX_TOP_K} and {MAX_EXPERTS} "
            f"experts, got {N} tokens, top_k {k}, {E} experts: route these with the torch functions"
        )
    sigmoid = bias is not None
    groups = m.n_group if sigmoid else 1
    kept = m.topk_group if groups > 1 else 1
    if E % groups or (groups > 1 and E // groups < 2) or not 1 <= k <= E // groups * kept:
        raise ValueError(
            f"{E} experts in {groups} groups ({kept} kept) cannot route top_k {k}: the groups must "
            f"be equal, of two experts or more, and the kept ones hold at least top_k"
        )
    logits = logits.contiguous()
    weights = torch.empty(N, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    if N:
        choice = torch.promote_types(logits.dtype, bias.dtype) if sigmoid else torch.float32
        _route_kernel[(N,)](
            logits,
            bias.contiguous() if sigmoid else logits,
            weights,
            ids,
            E=E,
            TOP_K=k,
            GROUPS=groups,
            KEPT=kept,
            G_PAD=_pow2(groups),
            PER_PAD=_pow2(E // groups),
            K_PAD=_pow2(k),
            SIGMOID=sigmoid,
            NORM=m.norm_topk_prob,
            SCALE=float(m.routed_scaling_factor) if sigmoid else 1.0,
            SCORE_DT=_tl_dtype(logits.dtype),
            CHOICE_DT=_tl_dtype(choice),
            num_warps=1,
            **pdl_args(logits),
        )
    return weights, ids


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def fused_align(ids: torch.Tensor, experts: int, first: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.moe.align_pairs` in one program, for ids [N, top_k] within `fused_routing_fits`
    (`experts`: those held here): the same (pairs, block_expert), element for element."""
    N, k = ids.shape
    if not fused_routing_fits(N, k, experts):
        raise ValueError(
            f"fused_align serves up to {MAX_TOKENS} tokens, top_k {MAX_TOP_K} and {MAX_EXPERTS} "
            f"experts, got {N} tokens, top_k {k}, {experts} experts: use align_pairs"
        )
    P = N * k
    blocks = aligned_blocks(P, experts, block_m)
    pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    if P:
        _align_kernel[(1,)](
            ids.contiguous(),
            pairs,
            block_expert,
            first,
            P,
            blocks,
            E=experts,
            BLOCK_M=block_m,
            P_PAD=_pow2(P),
            BINS=_pow2(experts + 1),
            ROWS_PAD=_pow2(blocks * block_m),
            BLOCKS_PAD=_pow2(blocks),
            **pdl_args(ids),
        )
    return pairs, block_expert
