"""Fused GPU kernels (Triton) for the decode path, each with its PyTorch reference.

A decode step of an 8B model moves ~16 GB of weights in ~4 ms; what else it does
must cost microseconds. In plain PyTorch an RMSNorm is ~7 kernels, rotary
embedding plus the KV-cache write ~16, SwiGLU's activation 3: ~1,400 tiny
kernels per step at 32 layers, each costing a launch slot even inside a CUDA
graph. The kernels here do each of those in one:

- ``rms_norm``       residual add + RMSNorm (one row per program);
- ``rope_store_kv``  rotary embedding of q and k, k and v written into the KV
                     cache at their cache index (one (token, head) per program);
- ``silu_mul``       SwiGLU's silu(gate) * up;
- ``cache_attention_triton``  attention of 1-128 queries per KV head over the
                     cache, reading each row only as far as its last visible
                     key (flash-decoding: chunks in parallel, then merged).

The elementwise kernels reproduce the reference's bf16/fp16 roundings step by step (each product
and sum rounded where PyTorch rounds), so fused and reference agree to the last
bit up to the order of one float32 reduction. Triton runs on CUDA tensors; CPU
tensors take the reference. ``SPECSERVE_FUSED_KERNELS=0`` forces the reference
everywhere (for A/B measurements). Without a GPU, tests run the ``*_triton``
launchers through Triton's interpreter (TRITON_INTERPRET=1, set by conftest).

``linear`` is F.linear or, for 1-64 rows where a startup measurement found it
faster for the weight's shape, a Triton GEMV (see ``tune_linear``); on the CPU (weights
stored column-major, ``column_major_copy``), from the row count where a startup measurement
found it faster, oneDNN with the weight packed once (see ``tune_linear_cpu``). With ``SPECSERVE_FUSED_KERNELS=0`` the engine does not
tune, so F.linear is used.

On Hopper and later every kernel here is launched with programmatic dependent
launch (``_wait_for_previous``): it is scheduled while the kernel before it
drains and waits for it before reading activations or writing anything, so
results are unchanged (the H200 decode graph's logits are bitwise equal with it
on and off) and ~0.2 ms of launch gaps per 8B decode step disappear.
``SPECSERVE_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton < 3.4: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None

log = logging.getLogger(__name__)
FUSED = os.environ.get("SPECSERVE_FUSED_KERNELS", "1") != "0"
# Programmatic dependent launch (Hopper+): each kernel may start while the one before it
# drains, prefetching what does not depend on it (a GEMV's first weight tile), then waits for
# it (`griddepcontrol.wait`) before touching activations. SPECSERVE_PDL=0 turns it off.
PDL = os.environ.get("SPECSERVE_PDL", "1") != "0"


def use_triton(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """The Triton kernels serve CUDA inference only: they have no backward, so where autograd
    records (training a drafter on a GPU) the PyTorch reference runs instead of silently
    cutting the gradient."""
    if not (FUSED and triton is not None and x.is_cuda):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *others)))


def use_pdl(x: torch.Tensor) -> bool:
    """Launch with programmatic dependent launch? (Triton's interpreter has no griddepcontrol.)"""
    return (PDL and gdc_wait is not None and x.is_cuda and _capability(x.device) >= 9
            and os.environ.get("TRITON_INTERPRET", "0") != "1")


@functools.cache
def _capability(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


# ----------------------------------------------------------------------------- references

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor):
    """q [B, T, H, D], k [B, T, Hkv, D]; cos/sin float32 tables [max_pos, D]; positions [B, T]."""
    c = cos[positions].unsqueeze(2).to(q.dtype)
    s = sin[positions].unsqueeze(2).to(q.dtype)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def rope_store_kv_ref(q, k, v, cos, sin, positions, k_cache, v_cache, row_start: int, write_idx):
    q, k = apply_rope(q, k, cos, sin, positions)
    B = q.shape[0]
    b_idx = torch.arange(B, device=q.device).unsqueeze(1) + row_start
    k_cache[b_idx, :, write_idx] = k.to(k_cache.dtype)
    v_cache[b_idx, :, write_idx] = v.to(v_cache.dtype)
    return q


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit
    def _wait_for_previous(PDL: tl.constexpr):
        """Under programmatic dependent launch: wait until the kernel before this one has
        finished (its writes visible), then let the next kernel start launching. Nothing may be
        stored, and no activation read, before this."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        dt = x_ptr.dtype.element_ty
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _wait_for_previous(PDL)
        x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * N + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # rounded as torch's add rounds
            tl.store(sum_ptr + row * N + offs, x, mask=mask)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = (xf * inv).to(dt).to(tl.float32)
        tl.store(out_ptr + row * N + offs, (w * y).to(dt), mask=mask)

    @triton.jit
    def _rotate(base, c1, c2, s1, s2, offs, HALF: tl.constexpr, dt: tl.constexpr):
        x1 = tl.load(base + offs).to(tl.float32)
        x2 = tl.load(base + HALF + offs).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product and the sum rounded to the model dtype
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    # Integers that change from request to request (row, token count, strides of the position
    # buffers) are not specialized on: each new value class would compile again while serving.
    @triton.jit(do_not_specialize=["T", "idx_stride", "row_start"])
    def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, cos_ptr, sin_ptr, pos_ptr, widx_ptr, kc_ptr, vc_ptr,
                        T, H, q_stride, k_stride, v_stride, idx_stride, row_start, c_row, c_head, c_pos,
                        HALF: tl.constexpr, PDL: tl.constexpr):
        tok = tl.program_id(0)
        head = tl.program_id(1)
        dt = q_ptr.dtype.element_ty
        _wait_for_previous(PDL)
        offs = tl.arange(0, HALF)
        idx = (tok // T) * idx_stride + tok % T  # positions/write_idx may be column slices of a wider buffer
        pos = tl.load(pos_ptr + idx)
        # the float32 tables are rounded to the model dtype first, as the reference does
        c1 = tl.load(cos_ptr + pos * 2 * HALF + offs).to(dt).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * 2 * HALF + HALF + offs).to(dt).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * 2 * HALF + offs).to(dt).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * 2 * HALF + HALF + offs).to(dt).to(tl.float32)
        if head < H:
            o1, o2 = _rotate(q_ptr + tok * q_stride + head * 2 * HALF, c1, c2, s1, s2, offs, HALF, dt)
            out = q_out_ptr + (tok * H + head) * 2 * HALF
            tl.store(out + offs, o1)
            tl.store(out + HALF + offs, o2)
        else:
            kh = head - H
            o1, o2 = _rotate(k_ptr + tok * k_stride + kh * 2 * HALF, c1, c2, s1, s2, offs, HALF, dt)
            slot = ((row_start + tok // T) * c_row + kh * c_head + tl.load(widx_ptr + idx) * c_pos).to(tl.int64)
            cdt = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + slot + offs, o1.to(cdt))
            tl.store(kc_ptr + slot + HALF + offs, o2.to(cdt))
            v = v_ptr + tok * v_stride + kh * 2 * HALF
            tl.store(vc_ptr + slot + offs, tl.load(v + offs).to(cdt))
            tl.store(vc_ptr + slot + HALF + offs, tl.load(v + HALF + offs).to(cdt))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
        _wait_for_previous(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        dt = x_ptr.dtype.element_ty
        g = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * I + offs, (s * u).to(dt), mask=mask)


    @triton.jit(do_not_specialize=["T", "n_split", "widx_stride", "anc_stride", "length", "row_start", "scratch"])
    def _attn_partial_kernel(q_ptr, kc_ptr, vc_ptr, widx_ptr, tbase_ptr, anc_ptr, o_ptr, ml_ptr,
                             T, H, G, n_kv, n_split, widx_stride, anc_stride, length, row_start, scratch, scale,
                             c_row, c_head, c_pos,
                             D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                             TREE: tl.constexpr, PDL: tl.constexpr):
        # Program (b, kv head, split): the G*T queries of one KV head of one sequence against keys
        # [split * CHUNK, (split + 1) * CHUNK), cut at the last key any of them may see.
        # TREE: keys at or past the row's tree base are seen only where the query's ancestor bit is set.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        _wait_for_previous(PDL)
        r = tl.arange(0, BLOCK_Q)  # query row r = token * G + group member
        t = r // G
        rmask = r < G * T
        widx = tl.load(widx_ptr + b * widx_stride + t, mask=rmask, other=-1)
        limit = tl.where(widx == scratch, -1, widx)  # padding queries (scratch slot) see nothing
        if TREE:
            anc = tl.load(anc_ptr + b * anc_stride + t, mask=rmask, other=0)
            tbase = tl.load(tbase_ptr + b)
        offs_d = tl.arange(0, D)
        head = (b * T + t) * H + kvh * G + r % G
        q = tl.load(q_ptr + head[:, None] * D + offs_d[None, :], mask=rmask[:, None], other=0.0)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, D], tl.float32)
        base = (row_start + b).to(tl.int64) * c_row + kvh * c_head
        lo = sp * CHUNK
        hi = tl.minimum(tl.minimum(lo + CHUNK, length), tl.max(limit, axis=0) + 1)
        for step in range(0, CHUNK, BLOCK_N):  # blocks past `hi` are skipped
            if lo + step < hi:
                offs_n = lo + step + tl.arange(0, BLOCK_N)
                kmask = offs_n < hi
                kv_off = base + offs_n[:, None] * c_pos + offs_d[None, :]
                k = tl.load(kc_ptr + kv_off, mask=kmask[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k)) * scale
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
                l_i = l_i * alpha + tl.sum(p, axis=1)
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

    @triton.jit(do_not_specialize=["T", "n_split", "widx_stride", "scratch"])
    def _attn_combine_kernel(o_ptr, ml_ptr, out_ptr, widx_ptr, T, H, G, n_kv, n_split, widx_stride, scratch,
                             D: tl.constexpr, BLOCK_Q: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                             PDL: tl.constexpr):
        _wait_for_previous(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.program_id(2)
        if r < G * T:
            widx = tl.load(widx_ptr + b * widx_stride + r // G)
            # splits up to the one holding this query's last key (none for a padding query)
            used = tl.where(widx == scratch, 0, widx // CHUNK + 1)
            sp = tl.arange(0, SPLITS)
            smask = sp < used
            part = ((b * n_kv + kvh) * n_split + sp) * BLOCK_Q + r
            m = tl.load(ml_ptr + part * 2, mask=smask, other=float("-inf"))
            l = tl.load(ml_ptr + part * 2 + 1, mask=smask, other=0.0)
            m_max = tl.max(m, axis=0)
            w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
            total = tl.sum(w * l, axis=0)
            offs_d = tl.arange(0, D)
            acc = tl.load(o_ptr + part[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
            o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
            head = (b * T + r // G) * H + kvh * G + r % G
            tl.store(out_ptr + head * D + offs_d, o.to(out_ptr.dtype.element_ty))

    @triton.jit(do_not_specialize=["V", "S"])
    def _argmax_kernel(x_ptr, part_v, part_i, cnt_ptr, out_ptr, V, S, BLOCK: tl.constexpr, SP: tl.constexpr,
                       PDL: tl.constexpr):
        # Program (row, chunk): the first index of the chunk's maximum; the row's last chunk to
        # finish picks among the chunks' (in chunk order: the first maximum wins, as in torch).
        row = tl.program_id(0)
        c = tl.program_id(1)
        _wait_for_previous(PDL)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = c * BLOCK + tl.argmax(x, axis=0)
        if S == 1:
            tl.store(out_ptr + row, i.to(tl.int64))
        else:
            tl.store(part_v + row * S + c, m)
            tl.store(part_i + row * S + c, i)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
            if done == S - 1:
                j = tl.arange(0, SP)
                vs = tl.load(part_v + row * S + j, mask=j < S, other=float("-inf"), cache_modifier=".cg")
                ix = tl.load(part_i + row * S + j, mask=j < S, other=2147483647, cache_modifier=".cg")
                best = tl.min(tl.where(vs == tl.max(vs, axis=0), ix, 2147483647), axis=0)
                tl.store(out_ptr + row, best.to(tl.int64))
                tl.atomic_xchg(cnt_ptr + row, 0)

    @triton.jit(do_not_specialize=["V"])
    def _tree_expand_kernel(logits_ptr, parent_ptr, child_ptr, cid_ptr, d2t_ptr, V,
                            TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
        # Program = one frontier node: its TOPK best children by log-probability, each scored
        # min(parent + log p, the float just below the parent), as target ids (see tree_level_ref).
        row = tl.program_id(0)
        _wait_for_previous(PDL)
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
    def _tree_front_kernel(child_ptr, cid_ptr, bits_ptr, idx_ptr, score_out, ids_out, node_out, bits_out, idx_out,
                           all_score_ptr, all_ids_ptr, all_par_ptr, all_stride, off,
                           TOPK: tl.constexpr, KK: tl.constexpr, PDL: tl.constexpr):
        # Program = one sequence: record this depth's TOPK*TOPK candidates, keep the TOPK best as
        # the next frontier (with their ids, parent node, ancestor bits and candidate index).
        b = tl.program_id(0)
        _wait_for_previous(PDL)
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

# ----------------------------------------------------------------------------- dispatch

def _pdl_args(x: torch.Tensor) -> dict:
    pdl = use_pdl(x)
    return {"PDL": pdl, "launch_pdl": True} if pdl else {"PDL": False}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x; with ``residual``: (norm(x + residual), x + residual), the sum being the
    new residual stream (one kernel on GPU instead of an add plus ~7)."""
    if use_triton(x, weight, residual) and x.is_contiguous() and (residual is None or residual.is_contiguous()) \
            and x.shape[-1] <= 16384:
        return rms_norm_triton(x, weight, eps, residual)
    total = x if residual is None else x + residual
    if total.dtype == torch.float32 and not total.is_cuda:
        # aten's rms_norm runs the reference's float32 ops in the same order (bit-identical) in one
        # call: on the CPU, where nothing hides Python, that matters.
        y = F.rms_norm(total, weight.shape, weight, eps)
    else:
        y = rms_norm_ref(total, weight, eps)
    return y if residual is None else (y, total)


def rms_norm_triton(x, weight, eps: float, residual=None):
    N = x.shape[-1]
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    block = triton.next_power_of_2(N)
    _rms_norm_kernel[(x.numel() // N,)](x, residual if residual is not None else x, weight, out, total, N, eps,
                                        HAS_RES=residual is not None, BLOCK=block,
                                        num_warps=min(16, max(1, block // 256)), **_pdl_args(x))
    return out if residual is None else (out, total)


def _tokens_strided(t: torch.Tensor) -> bool:
    """[B, T, heads, D] with heads and D packed and tokens evenly strided (e.g. views of a qkv row)."""
    B, T, Hh, D = t.shape
    return t.stride(3) == 1 and t.stride(2) == D and (B == 1 or T == 1 or t.stride(0) == T * t.stride(1))


def _token_stride(t: torch.Tensor) -> int:
    """Elements from token b*T+t to the next (see _tokens_strided). With one token per row, the
    row stride: a view's stride over a size-1 dimension says nothing (a decode step's q/k/v views
    of [B, 1, qkv] have stride(1) = heads * D, not the qkv width)."""
    return t.stride(1) if t.shape[1] > 1 else t.stride(0)


def rope_store_kv(q, k, v, cos, sin, positions, k_cache, v_cache, row_start: int, write_idx) -> torch.Tensor:
    """Rotary embedding of q [B, T, H, D] and k [B, T, Hkv, D]; k and v are written into rows
    row_start.. of the caches [rows, Hkv, len, D] at ``write_idx`` [B, T]. Returns rotated q."""
    D = q.shape[-1]
    if (use_triton(q, k, v) and D % 2 == 0 and triton.next_power_of_2(D // 2) == D // 2
            and all(_tokens_strided(t) for t in (q, k, v)) and k_cache.stride() == v_cache.stride()
            and k_cache.stride(3) == 1 and positions.stride() == write_idx.stride() and write_idx.stride(1) == 1):
        return rope_store_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, row_start, write_idx)
    return rope_store_kv_ref(q, k, v, cos, sin, positions, k_cache, v_cache, row_start, write_idx)


def rope_store_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, row_start: int, write_idx):
    B, T, H, D = q.shape
    q_out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    _rope_kv_kernel[(B * T, H + k.shape[2])](
        q, k, v, q_out, cos, sin, positions, write_idx, k_cache, v_cache,
        T, H, _token_stride(q), _token_stride(k), _token_stride(v), write_idx.stride(0), row_start,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HALF=D // 2, num_warps=1,
        enable_fp_fusion=False, **_pdl_args(q))  # a fused multiply-add would skip the reference's rounding of each product
    return q_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2I] (gate first)."""
    if use_triton(gate_up) and gate_up.is_contiguous():
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    I = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(gate_up.numel() // (2 * I), triton.cdiv(I, block))](gate_up, out, I, BLOCK=block, num_warps=4,
                                                                         **_pdl_args(gate_up))
    return out


ATTN_BLOCK_N = 64
ATTN_MAX_QUERIES = 128  # G * T per KV head; longer blocks (prefill) use SDPA


def cache_attention_ok(q: torch.Tensor, k_cache: torch.Tensor, write_idx: torch.Tensor) -> bool:
    """Can `cache_attention` serve these queries [B, T, H, D]?"""
    B, T, H, D = q.shape
    G = H // k_cache.shape[1]
    return (use_triton(q) and q.dtype in (torch.bfloat16, torch.float16) and q.is_contiguous()
            and write_idx.stride(1) == 1 and k_cache.stride(3) == 1 and 16 <= D <= 256 and triton.next_power_of_2(D) == D
            and G * T <= ATTN_MAX_QUERIES)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def cache_attention_triton(q, k_cache, v_cache, row_start: int, write_idx, scratch: int, scale: float,
                           sm_count: int | None = None, tree_base=None, tree_anc=None) -> torch.Tensor:
    """Attention of q [B, T, H, D] over rows row_start.. of the caches, query (b, t) seeing keys
    0..write_idx[b, t] (flash-decoding: the keys are split into chunks that run in parallel,
    then merged); with a tree, keys from tree_base[b] on only where bit key - tree_base[b] of
    tree_anc[b, t] is set (see ForwardContext). Reads only as far as the longest query of a row
    reaches, not the whole cache."""
    B, T, H, D = q.shape
    n_kv, length = k_cache.shape[1], k_cache.shape[2]
    G = H // n_kv
    sm_count = sm_count or _sm_count(q.device)
    block_q = max(16, triton.next_power_of_2(G * T))
    # enough programs to cover the GPU at small batches; one chunk each at large ones
    n_split = max(1, min(triton.cdiv(length, ATTN_BLOCK_N), triton.cdiv(2 * sm_count, B * n_kv)))
    chunk = triton.cdiv(triton.cdiv(length, n_split), ATTN_BLOCK_N) * ATTN_BLOCK_N
    n_split = triton.cdiv(length, chunk)
    part = torch.empty(B * n_kv * n_split * block_q, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(B * n_kv * n_split * block_q, 2, dtype=torch.float32, device=q.device)
    tree = tree_anc is not None
    _attn_partial_kernel[(B, n_kv, n_split)](
        q, k_cache, v_cache, write_idx, tree_base if tree else write_idx, tree_anc if tree else write_idx, part, ml,
        T, H, G, n_kv, n_split, write_idx.stride(0), tree_anc.stride(0) if tree else 0, length, row_start,
        scratch, scale,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        D=D, BLOCK_Q=block_q, BLOCK_N=ATTN_BLOCK_N, CHUNK=chunk, TREE=tree, num_warps=4, num_stages=2,
        **_pdl_args(q))
    out = torch.empty_like(q)
    _attn_combine_kernel[(B, n_kv, block_q)](part, ml, out, write_idx, T, H, G, n_kv, n_split, write_idx.stride(0),
                                             scratch, D=D, BLOCK_Q=block_q, SPLITS=triton.next_power_of_2(n_split),
                                             CHUNK=chunk, num_warps=1, **_pdl_args(q))
    return out


ARGMAX_BLOCK = 4096  # entries of a row per program
_argmax_counters: dict[torch.device, torch.Tensor] = {}


def _chunk_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per row, how many of its chunks `_argmax_kernel` has finished: zero between calls (each
    row's last chunk resets its own). Made outside CUDA graphs: the runner's warm-up forward
    comes before any capture."""
    got = _argmax_counters.get(device)
    if got is None or got.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("argmax row counters must exist before CUDA graph capture (run a warm-up forward)")
        got = _argmax_counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return got


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1). On GPU one kernel over the rows split into chunks side by side: torch's
    reduction runs a 128k-entry row in one block (~27 us for one row or 32 on an H200, more
    than a whole layer's attention)."""
    if not (use_triton(x) and x.is_contiguous() and x.numel() > 0 and x.shape[-1] < 2 ** 31):
        return x.argmax(-1)
    return argmax_triton(x)


def argmax_triton(x: torch.Tensor) -> torch.Tensor:
    V = x.shape[-1]
    R, S = x.numel() // V, triton.cdiv(V, ARGMAX_BLOCK)
    out = torch.empty(R, dtype=torch.long, device=x.device)
    part_v = torch.empty(R * S, dtype=torch.float32, device=x.device)
    part_i = torch.empty(R * S, dtype=torch.int32, device=x.device)
    _argmax_kernel[(R, S)](x, part_v, part_i, _chunk_counters(x.device, R), out, V, S, BLOCK=ARGMAX_BLOCK,
                           SP=triton.next_power_of_2(S), num_warps=8, **_pdl_args(x))
    return out.view(x.shape[:-1])


# ----------------------------------------------------------------------------- skinny matmul

# Decode multiplies 1-8 token rows by each weight, a verify up to 64, so a step is bound by how
# fast the weights stream from HBM. cuBLAS reaches 60-90% of the copy bandwidth there depending on the shape; a
# plain GEMV (each program owns a few output features over all of K) beats it on some shapes and
# loses on others (benchmarks/gemv_sweep.py). So the choice is measured per weight shape and row
# count when the runner starts (`tune_linear`), inside CUDA graphs over distinct weights of the
# shape (as a decode step reads them, cold in L2), and `linear` follows it.

GEMV_ROWS = (1, 2, 4, 8, 16, 32, 64)  # row counts tuned (r rows use the tuning of the next one up)
# Candidates (BLOCK_N, BLOCK_K, warps, stages) for one row, 2-8 rows and 9-64 rows (verify forwards:
# a tree of 31 nodes is 32 rows): the best of the sweep (benchmarks/gemv_sweep.py, H200) per weight
# shape, plus wider K blocks for long rows (down_proj).
# (A vector-FMA variant for 2-8 rows, each weight tile times every row, never beat cuBLAS there by
# the 3% the tuner asks for on the H200 (third session), so it is not a candidate.)
GEMV_CONFIGS = {1: ((8, 512, 4, 4), (8, 512, 8, 4), (8, 256, 4, 4), (8, 1024, 8, 4)),
                2: ((32, 256, 4, 4), (64, 256, 4, 4), (32, 128, 4, 3)),
                16: ((16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4))}
_gemv_choice: dict[tuple, tuple | None] = {}  # (N, K, dtype, rows bucket) -> Triton config, None = cuBLAS

if triton is not None:

    @triton.jit
    def _gemv_tile(acc, w, x_ptr, offs_m, offs_k, kmask, M, K: tl.constexpr, ONE_ROW: tl.constexpr):
        if ONE_ROW:  # vector FMAs and a row reduction
            x = tl.load(x_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
            return acc + tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        else:  # rows padded to BLOCK_M (at least 16) for the tensor cores
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
            return acc + tl.dot(x, tl.trans(w))

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ONE_ROW: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        # The weights do not depend on the kernel before: the first tile is read while it drains.
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        _wait_for_previous(PDL)
        if ONE_ROW:
            acc = tl.zeros([BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc = _gemv_tile(acc, w, x_ptr, offs_m, offs_k, kmask, M, K, ONE_ROW)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = _gemv_tile(acc, w, x_ptr, offs_m, offs_k, kmask, M, K, ONE_ROW)
        if ONE_ROW:
            tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(offs_m[:, None] < M) & nmask[None, :])


def gemv_triton(x2: torch.Tensor, w: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """x2 [M <= 64, K] (contiguous) @ w [N, K]^T with float32 accumulation."""
    M, K = x2.shape
    N = w.shape[0]
    block_n, block_k, warps, stages = cfg
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x2, w, y, M, N, K, BLOCK_M=max(16, triton.next_power_of_2(M)),
                                             BLOCK_N=block_n, BLOCK_K=block_k, ONE_ROW=M == 1,
                                             num_warps=warps, num_stages=stages, **_pdl_args(x2))
    return y


def gemv_config_group(rows: int) -> int:
    """The GEMV_CONFIGS key for a product of `rows` rows."""
    return 1 if rows == 1 else 2 if rows <= 8 else 16


def _rows_bucket(rows: int) -> int | None:
    return next((b for b in GEMV_ROWS if rows <= b), None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the kernel `tune_linear` (GPU: a GEMV) or `tune_linear_cpu` (oneDNN, packed
    weight) found faster for this weight and row count."""
    if not x.is_cuda:  # (this runs for every product on the CPU: a few attribute reads at most)
        packed = getattr(w, "cpu_packed", None)
        if packed is not None and x.numel() >= packed[1] * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, packed[0], b, "none", [], "")
        return F.linear(x, w, b)
    rows = x.numel() // x.shape[-1]
    bucket = _rows_bucket(rows)
    cfg = _gemv_choice.get((w.shape[0], w.shape[1], x.dtype, bucket)) if bucket else None
    if cfg is None or not use_triton(x, w, b):
        return F.linear(x, w, b)
    y = gemv_triton(x.reshape(rows, -1).contiguous(), w, cfg).view(*x.shape[:-1], w.shape[0])
    return y + b if b is not None else y


def graph_us(fns, reps: int = 10) -> float:
    """Microseconds per call of a CUDA graph that runs each of `fns` once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / reps / len(fns)


@torch.inference_mode()
def tune_linear(weights: list[torch.Tensor], max_rows: int = 8) -> dict:
    """Choose cuBLAS or a GEMV config for each weight shape and row bucket up to `max_rows`.
    `weights`: every weight the model multiplies by (grouped by shape here; up to 8 of a shape
    are timed in turn so the measurement streams from HBM as a real step does). Returns
    {"NxK": {rows: (cuBLAS us, best Triton us, chosen)}} for logging."""
    if not FUSED or triton is None or not weights or not weights[0].is_cuda:
        return {}
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        if w.dim() == 2 and w.is_contiguous() and w.dtype in (torch.bfloat16, torch.float16):
            by_shape.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
    report = {}
    for i, ((N, K, dtype), ws) in enumerate(by_shape.items()):
        # (one line per shape: on a cold Triton cache this phase compiles for a minute or so)
        log.info("tuning linear kernels: shape %d of %d (%dx%d)", i + 1, len(by_shape), N, K)
        ws = ws[:8]
        for rows in (r for r in GEMV_ROWS if r <= max_rows):
            x = torch.randn(rows, K, device=ws[0].device, dtype=dtype)
            ref = F.linear(x, ws[0]).float()
            t_cublas = graph_us([lambda w=w: F.linear(x, w) for w in ws])
            best, t_best = None, t_cublas
            for cfg in GEMV_CONFIGS[gemv_config_group(rows)]:
                try:
                    err = ((gemv_triton(x, ws[0], cfg).float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
                    t = graph_us([lambda w=w, c=cfg: gemv_triton(x, w, c) for w in ws]) if err <= 1e-2 else None
                except Exception as e:  # a config this GPU or Triton cannot run: skip it, keep cuBLAS
                    # (64-row tiles of the widest candidates need more shared memory than a GPU has:
                    # expected, so not worth a warning at every start-up)
                    level = logging.DEBUG if "out of resource" in str(e) else logging.WARNING
                    log.log(level, "GEMV config %s for %dx%d at %d rows skipped: %s", cfg, N, K, rows, e)
                    continue
                if t is not None and t < t_best and t < 0.97 * t_cublas:  # the fastest clear win over cuBLAS
                    best, t_best = cfg, t
            _gemv_choice[(N, K, dtype, rows)] = best
            report.setdefault(f"{N}x{K}", {})[rows] = (round(t_cublas, 1), round(t_best, 1), best)
    # Each timing graph took a cuBLAS workspace in its own pool: hand that memory back now, or
    # it stays reserved and the KV-cache plan (and `specserve check`'s estimate) is off by it.
    torch.cuda.empty_cache()
    return report


# ----------------------------------------------------------------------------- CPU products

# MKL's sgemm (what F.linear runs on the CPU) packs the weight on every call: on the demo's
# shapes 5 rows cost ~3x what 1 row does (4096x128: 102 vs 33 us, one thread), so a verify of
# K+1 rows costs far more than a decode step. oneDNN with the weight packed once at load costs
# nearly the same for 2-9 rows (39 us there), but has ~8 us of fixed cost that loses at 1 row
# and on small weights. So per weight shape the runner measures both at a few row counts and
# `linear` switches to the packed product from the smallest count where it wins from there on.
# Before any of that, CPU weights are stored column by column (`column_major_copy`): the same
# [N, K] matrices, but F.linear's x @ W.T then reads W.T as a plain row-major [K, N], the layout
# MKL streams fastest. With weights coming from memory rather than cache, as in a real forward,
# the demo's 4096x128 head at 1 row takes 73 us instead of 210 (16 copies cycled, one thread), and
# a whole plain decoding step ~25% less (eighth session, 2-core EPYC). The figures above are for
# the row-major layout; with column-major weights the packed product no longer made a 5-row verify
# faster there (2.70-2.90 ms either way), but the tuner keeps choosing per shape.
CPU_ROWS = (1, 2, 4, 8, 16, 64)
CPU_PACK_MAX_BYTES = 2 << 30  # packed copies double those weights' memory: only for small models


def column_major_copy(w: torch.Tensor) -> torch.Tensor:
    """w's values, stored column by column (w.t() is contiguous)."""
    return w.t().contiguous().t()


def _cpu_us(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(5):  # best of 5 rounds: a loaded machine only ever adds time
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times) * 1e6


@torch.inference_mode()
def tune_linear_cpu(weights: list[torch.Tensor]) -> dict:
    """Set `w.cpu_packed` on each of `weights` (CPU tensors): (oneDNN-packed copy, rows from which
    `linear` uses it), or None where MKL wins at every row count measured (or oneDNN is missing).
    Timed once per shape, at the current torch thread count. Returns {"NxK": {rows: (MKL us,
    oneDNN us)}, ...} for logging."""
    weights = [w for w in weights if w.dim() == 2 and not w.is_cuda and w.dtype in (torch.float32, torch.bfloat16)]
    for w in weights:
        w.cpu_packed = None
    if not FUSED or not torch.backends.mkldnn.is_available() or not weights:
        return {}
    if sum(w.numel() * w.element_size() for w in weights) > CPU_PACK_MAX_BYTES:
        log.info("CPU weights over %d GiB: oneDNN packing skipped (it would copy them)", CPU_PACK_MAX_BYTES >> 30)
        return {}
    pack = torch.ops.mkldnn._reorder_linear_weight
    product = torch.ops.mkldnn._linear_pointwise
    report, start_at = {}, {}
    for w in weights:
        key = (tuple(w.shape), w.dtype)
        packed = None
        if key not in start_at:
            try:
                packed = pack(w, 8)
                times = {}
                for rows in CPU_ROWS:
                    x = torch.randn(rows, w.shape[1], dtype=w.dtype)
                    times[rows] = (_cpu_us(lambda: F.linear(x, w)), _cpu_us(lambda: product(x, packed, None, "none", [], "")))
            except RuntimeError as e:  # a oneDNN build that cannot take this shape or dtype
                log.warning("oneDNN product for %s skipped: %s", tuple(w.shape), e)
                start_at[key] = None
                continue
            wins = [rows for rows, (mkl, dnnl) in times.items() if dnnl < 0.95 * mkl]
            # the smallest row count from which oneDNN wins at every larger one measured
            first = next((r for r in CPU_ROWS if all(q in wins for q in CPU_ROWS if q >= r)), None)
            start_at[key] = first
            report[f"{w.shape[0]}x{w.shape[1]}"] = {r: (round(a, 1), round(b, 1)) for r, (a, b) in times.items()}
        first = start_at[key]
        if first is not None:
            # rows between two measured counts use the packed product from just past the last MKL win
            prev = max((r for r in CPU_ROWS if r < first), default=0)
            w.cpu_packed = (packed if packed is not None else pack(w, 8), prev + 1)  # (the timed copy is w's)
    return report


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
    all_score[:, off: off + k * k] = child
    all_ids[:, off: off + k * k] = cid
    all_par[:, off: off + k * k] = front_idx.repeat_interleave(k, 1)
    score, pick = child.topk(k, -1)
    node = pick // k
    return score, cid.gather(1, pick), node, bits.gather(1, node), off + pick


def tree_level(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off: int, d2t):
    """`tree_level_ref` in two kernels on GPU (the reference's ~20 small kernels per depth cost
    ~50 us of launch slots even inside a CUDA graph)."""
    if not (use_triton(logits) and logits.shape[-1] <= TREE_MAX_VOCAB and logits.is_contiguous()
            and all_score.is_contiguous()):
        return tree_level_ref(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off, d2t)
    return tree_level_triton(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off, d2t)


def tree_level_triton(logits, front_score, bits, front_idx, all_score, all_ids, all_par, off: int, d2t):
    B, k, V = logits.shape
    dev = logits.device
    child = torch.empty(B, k * k, dtype=torch.float32, device=dev)
    cid = torch.empty(B, k * k, dtype=torch.long, device=dev)
    block_v = triton.next_power_of_2(V)
    _tree_expand_kernel[(B * k,)](logits, front_score.contiguous(), child, cid, d2t, V, TOPK=k,
                                  KP=triton.next_power_of_2(k), BLOCK_V=block_v,
                                  num_warps=max(1, min(8, block_v // 256)), **_pdl_args(logits))
    score, ids, node, new_bits, idx = (torch.empty(B, k, dtype=t, device=dev)
                                       for t in (torch.float32, torch.long, torch.long, torch.long, torch.long))
    _tree_front_kernel[(B,)](child, cid, bits.contiguous(), front_idx.contiguous(), score, ids, node, new_bits, idx,
                             all_score, all_ids, all_par, all_score.stride(0), off,
                             TOPK=k, KK=triton.next_power_of_2(k * k), num_warps=1, **_pdl_args(logits))
    return score, ids, node, new_bits, idx

