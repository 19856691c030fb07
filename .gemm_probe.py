# temporary probe (not committed): skinny GEMM variants at 32 rows on the 8B verify shapes
import itertools, json, os, sys, time
import torch, torch.nn.functional as F
import triton, triton.language as tl
sys.path.insert(0, os.getcwd())
from specserve.model.kernels import gemv_triton, graph_us, GEMV_CONFIGS

CPU = not torch.cuda.is_available()
DEV = "cpu" if CPU else "cuda"


@triton.jit
def probe_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, K_SPLIT: tl.constexpr,
                 SWAP: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    nmask = offs_n < N
    mmask = offs_m < M
    k_lo = tl.program_id(1) * K_SPLIT if SPLIT > 1 else 0
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in range(0, K_SPLIT // BLOCK_K):
        offs_k = k_lo + i * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if SWAP:
            xt = tl.load(x_ptr + offs_m[None, :] * K + offs_k[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)
            acc += tl.dot(w, xt)
        else:
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
    if SWAP:
        out_offs = offs_m[None, :] * N + offs_n[:, None]
        out_mask = mmask[None, :] & nmask[:, None]
    else:
        out_offs = offs_m[:, None] * N + offs_n[None, :]
        out_mask = mmask[:, None] & nmask[None, :]
    if SPLIT > 1:
        piece = BLOCK_M * N
        tl.store(part_ptr + tl.program_id(1) * piece + out_offs, acc, mask=out_mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            acc = tl.load(part_ptr + out_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT):
                acc += tl.load(part_ptr + j * piece + out_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid, 0)
    else:
        tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


PART = {}


def probe(x, w, cfg):
    bn, bk, warps, stages, split, swap = cfg
    M, K = x.shape
    N = w.shape[0]
    bm = max(16, triton.next_power_of_2(M))
    ks = triton.cdiv(triton.cdiv(K, split), bk) * bk
    tiles = triton.cdiv(N, bn)
    key = x.device
    if key not in PART:
        PART[key] = (torch.zeros(8 * 64 * 30000, dtype=torch.float32, device=x.device),
                     torch.zeros(8192, dtype=torch.int32, device=x.device))
    part, cnt = PART[key]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    probe_kernel[(tiles, split)](x, w, y, part, cnt, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                                 K_SPLIT=ks, SWAP=swap, num_warps=warps, num_stages=stages)
    return y


def main():
    if CPU:  # correctness in the interpreter
        g = torch.Generator().manual_seed(0)
        w = torch.randn(100, 300, generator=g).half() * 0.05
        x = torch.randn(31, 300, generator=g).half()
        want = F.linear(x.float(), w.float())
        for cfg in [(16, 64, 4, 3, 1, False), (16, 64, 4, 3, 3, False), (64, 64, 4, 3, 1, True), (64, 64, 4, 3, 4, True)]:
            got = probe(x, w, cfg).float()
            print(cfg, (got - want).abs().max().item())
        return
    out = os.environ.get("OUT", "/tmp/out")
    res = {}
    M = 32
    shapes = [(4096, 4096), (6144, 4096), (4096, 14336)]
    cands = [(bn, bk, 4, 4, s, False) for bn, bk, s in itertools.product((64, 128), (128, 256), (2, 4, 8))]
    cands += [(bn, bk, 4, 4, s, True) for bn, bk, s in itertools.product((64, 128), (128, 256), (1, 2, 4, 8))]
    t0 = time.time()
    for N, K in shapes:
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        gb = N * K * 2 / 1e3
        row = {"cublas": gb / graph_us([lambda w=w: F.linear(x, w) for w in ws], reps=20)}
        for cfg in GEMV_CONFIGS[16]:
            try:
                row[str(("gemv",) + cfg)] = gb / graph_us([lambda w=w: gemv_triton(x, w, cfg) for w in ws], reps=20)
            except Exception:
                pass
        for cfg in cands:
            try:
                err = ((probe(x, ws[0], cfg).float() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    row[str(cfg)] = f"err {err:.2e}"
                    continue
                row[str(cfg)] = gb / graph_us([lambda w=w: probe(x, w, cfg) for w in ws], reps=20)
            except Exception as e:
                row[str(cfg)] = repr(e)[:80]
        res[f"{N}x{K}"] = row
        good = sorted(((v, k) for k, v in row.items() if isinstance(v, float)), reverse=True)
        print(f"{N}x{K} M={M} cublas {row['cublas']:.0f} GB/s; top: " + "; ".join(f"{k} {v:.0f}" for v, k in good[:6]),
              f"({time.time() - t0:.0f} s)", flush=True)
        del ws
    os.makedirs(out, exist_ok=True)
    json.dump(res, open(f"{out}/gemm_probe.json", "w"), indent=1)


main()
