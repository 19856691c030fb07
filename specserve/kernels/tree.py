"""One depth of greedy tree drafting: each frontier node's best children, then the next frontier."""

from __future__ import annotations

import torch

from specserve.kernels.common import pdl_args, triton, use_triton

if triton is not None:
    import triton.language as tl

    from specserve.kernels.common import wait_for_previous

    @triton.jit(do_not_specialize=["V"])
    def _tree_expand_kernel(
        logits_ptr,
        parent_ptr,
        child_ptr,
        cid_ptr,
        d2t_ptr,
        V,
        TOPK: tl.constexpr,
        KP: tl.constexpr,
        BLOCK_V: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program = one frontier node: its TOPK best children by log-probability, each scored
        # min(parent + log p, the float just below the parent), as target ids (see tree_level_ref).
        row = tl.program_id(0)
        wait_for_previous(PDL)
        offs = tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
        parent = tl.load(parent_ptr + row)
        pb = parent.to(tl.int32, bitcast=True)
        below = tl.where(parent > 0, pb - 1, tl.where(parent == 0, -2147483647, pb + 1)).to(tl.float32, bitcast=True)
        kr = tl.arange(0, KP)
        vals = tl.full([KP], float("-inf"), tl.float32)
        ids = tl.zeros([KP], tl.int64)
        for r in tl.static_range(TOPK):
            v = tl.max(x, axis=0)
            i = tl.argmax(x, axis=0)
            vals = tl.where(kr == r, v, vals)
            ids = tl.where(kr == r, i.to(tl.int64), ids)
            x = tl.where(offs == i, float("-inf"), x)
        child = tl.minimum(parent + tl.maximum(vals - lse, -1e4), below)
        tl.store(child_ptr + row * TOPK + kr, child, mask=kr < TOPK)
        ids += tl.load(d2t_ptr + ids)
        tl.store(cid_ptr + row * TOPK + kr, ids, mask=kr < TOPK)

    @triton.jit(do_not_specialize=["all_stride", "off"])
    def _tree_front_kernel(
        child_ptr,
        cid_ptr,
        bits_ptr,
        idx_ptr,
        score_out,
        ids_out,
        node_out,
        bits_out,
        idx_out,
        all_score_ptr,
        all_ids_ptr,
        all_par_ptr,
        all_stride,
        off,
        TOPK: tl.constexpr,
        KK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program = one sequence: record this depth's TOPK*TOPK candidates, keep the TOPK best as
        # the next frontier (with their ids, parent node, ancestor bits and candidate index).
        b = tl.program_id(0)
        wait_for_previous(PDL)
        c = tl.arange(0, KK)
        cm = c < TOPK * TOPK
        src = b * TOPK * TOPK + c
        x = tl.load(child_ptr + src, mask=cm, other=float("-inf"))
        cid = tl.load(cid_ptr + src, mask=cm, other=0)
        par = tl.load(idx_ptr + b * TOPK + c // TOPK, mask=cm, other=0)
        dst = b.to(tl.int64) * all_stride + off + c
        tl.store(all_score_ptr + dst, x, mask=cm)
        tl.store(all_ids_ptr + dst, cid, mask=cm)
        tl.store(all_par_ptr + dst, par, mask=cm)
        for r in tl.static_range(TOPK):
            v = tl.max(x, axis=0)
            pick = tl.argmax(x, axis=0)
            x = tl.where(c == pick, float("-inf"), x)
            node = pick // TOPK
            tl.store(score_out + b * TOPK + r, v)
            tl.store(ids_out + b * TOPK + r, tl.load(cid_ptr + b * TOPK * TOPK + pick))
            tl.store(node_out + b * TOPK + r, node.to(tl.int64))
            tl.store(bits_out + b * TOPK + r, tl.load(bits_ptr + b * TOPK + node))
            tl.store(idx_out + b * TOPK + r, (off + pick).to(tl.int64))


# ----------------------------------------------------------------------------- tree drafting

TREE_MAX_VOCAB = 8192  # a draft vocabulary held in one program's registers; larger ones take the reference


def tree_level_ref(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off: int, d2t):
    """One depth of greedy tree drafting. `logits` [B, k, V]: the drafter's next-token logits at
    each of the k frontier nodes (any float dtype; scored in float32) (scores `front_score`
    [B, k], ancestor bits `bits`, candidate indices `front_idx`). Each node offers its k best
    children, scored min(parent + log p, the float just below the parent): finite, and always
    below the parent. A child's token is its target id (draft id + `d2t`[draft id]). The k*k
    candidates go to columns off.. of `all_score`/`all_ids`/`all_par` (score, token, parent's
    candidate index); returns the next frontier: (score, token, frontier node it grows from,
    its bits, its candidate index: off + position among the k*k)."""
    k = front_score.shape[1]
    lp, cid = torch.log_softmax(logits.float(), -1).clamp_min(-1e4).topk(k, -1)
    cid = cid + d2t[cid]
    parent = front_score.unsqueeze(-1)
    child = torch.minimum(parent + lp, torch.nextafter(parent, torch.full_like(parent, -float("inf"))))
    child, cid = child.flatten(1), cid.flatten(1)
    all_score[:, off : off + k * k] = child
    all_ids[:, off : off + k * k] = cid
    all_par[:, off : off + k * k] = front_idx.repeat_interleave(k, 1)
    score, pick = child.topk(k, -1)
    node = pick // k
    return score, cid.gather(1, pick), node, bits.gather(1, node), off + pick


def tree_level(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off: int, d2t):
    """`tree_level_ref` in two kernels on GPU (the reference's ~20 small kernels per depth each
    take a launch slot, even inside a CUDA graph)."""
    if not (
        use_triton(logits)
        and logits.shape[-1] <= TREE_MAX_VOCAB
        and logits.is_contiguous()
        and all_score.is_contiguous()
    ):
        return tree_level_ref(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off, d2t)
    return tree_level_triton(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off, d2t)


def tree_level_triton(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off: int, d2t):
    B, k, V = logits.shape
    dev = logits.device
    child = torch.empty(B, k * k, dtype=torch.float32, device=dev)
    cid = torch.empty(B, k * k, dtype=torch.long, device=dev)
    block_v = triton.next_power_of_2(V)
    _tree_expand_kernel[(B * k,)](
        logits,
        front_score.contiguous(),
        child,
        cid,
        d2t,
        V,
        TOPK=k,
        KP=triton.next_power_of_2(k),
        BLOCK_V=block_v,
        num_warps=max(1, min(8, block_v // 256)),
        **pdl_args(logits),
    )
    score, ids, node, new_bits, idx = (
        torch.empty(B, k, dtype=t, device=dev) for t in (torch.float32, torch.long, torch.long, torch.long, torch.long)
    )
    _tree_front_kernel[(B,)](
        child,
        cid,
        bits.contiguous(),
        front_idx.contiguous(),
        score,
        ids,
        node,
        new_bits,
        idx,
        all_score,
        all_ids,
        all_par,
        all_score.stride(0),
        off,
        TOPK=k,
        KK=triton.next_power_of_2(k * k),
        num_warps=1,
        **pdl_args(logits),
    )
    return score, ids, node, new_bits, idx
