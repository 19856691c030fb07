"""The fused Triton kernels against their PyTorch references.

On a GPU they run compiled and must match bit for bit in bf16/fp16 (the kernels
replay the reference's roundings). Without one they run in Triton's interpreter,
which is exact for fp32/fp16 but rounds fp32->bf16 by truncation, so bf16 is
checked there to one bf16 step.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip(
    "triton",
    reason="Triton is not installed (pip install -e '.[kernels]' runs these kernels in its interpreter on CPU)",
)
from specserve.kernels import argmax as argmax_k  # noqa: E402
from specserve.kernels import attention, common, cpu_linear, cpu_native, gemv, norm, tree  # noqa: E402
from specserve.kernels import linear as linear_k  # noqa: E402
from specserve.model.layers import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, reduction: bool = False):
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:  # only the order of a float32 sum may differ
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 if reduction else 0)
    elif DEV == "cuda" or dtype == torch.float16:
        if reduction:  # one float32 sum in another order may move a value by one step
            diff = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
            assert (got != want).float().mean() < 0.01 and diff.max() < 1e-2
        else:
            bad = got != want
            assert not bad.any(), (
                f"{int(bad.sum())}/{bad.numel()} differ, max "
                f"{(got.float() - want.float()).abs().max().item():.3g}; first at "
                f"{bad.nonzero()[0].tolist()}: {got[bad][:4].tolist()} vs {want[bad][:4].tolist()}"
            )
    else:  # bf16 in the interpreter: its casts truncate
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 320, generator=g).to(DEV, dtype)  # 320: a block wider than the row
    res = torch.randn(3, 5, 320, generator=g).to(DEV, dtype) if with_residual else None
    w = (torch.rand(320, generator=g) + 0.5).to(DEV, dtype)
    got = norm.rms_norm_triton(x, w, 1e-5, res)
    if with_residual:
        total = x + res
        _check(got[1], total, dtype)
        _check(got[0], norm.rms_norm_ref(total, w, 1e-5), dtype, reduction=True)
    else:
        _check(got, norm.rms_norm_ref(x, w, 1e-5), dtype, reduction=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_slice_of_wider_rows(dtype):
    """A slice of a wider product's rows (MLA's query and kv latents share one product) normalises in
    place of a copy: rows evenly apart take the kernel and equal the packed rows' result; rows that
    are not evenly apart are not offered to it."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 5, 400, generator=g).to(DEV, dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(DEV, dtype)
    part = wide[..., 300:396]
    assert norm._row_stride(part) == 400 and norm._row_stride(wide[:1, :1, :96]) == 96
    assert norm._row_stride(wide[:, ::2, :96]) is None and norm._row_stride(wide.transpose(0, 1)[..., :96]) is None
    got = norm.rms_norm_triton(part, w, 1e-5)
    assert got.is_contiguous() and torch.equal(got, norm.rms_norm_triton(part.contiguous(), w, 1e-5))
    _check(got, norm.rms_norm_ref(part, w, 1e-5), dtype, reduction=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = torch.randn(2, 3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(DEV, dtype) * 4
    _check(norm.silu_mul_triton(x), norm.silu_mul_ref(x), dtype, reduction=True)  # exp may differ by an ulp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T", [(1, 1), (3, 4), (3, 1)])
def test_rope_store_kv(dtype, B, T):
    """q/k/v as views of one qkv row (as the target passes them), rows offset, scattered indices;
    the kernel takes such views (a batched decode step, (3, 1), once fell back to the reference:
    views over a size-1 token dimension have a meaningless token stride)."""
    H, Hkv, D, rows, length = 4, 2, 32, 6, 40
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(DEV, dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.view(B, T, H, D), k.view(B, T, Hkv, D), v.view(B, T, Hkv, D)
    assert all(norm._tokens_strided(t) for t in (q, k, v))
    rope = RotaryEmbedding(
        D,
        128,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ).to(DEV)
    # positions == write_idx, a column slice of a wider buffer (as the runner passes them)
    buf = torch.stack([torch.randperm(length, generator=g)[: T + 3] for _ in range(B)]).to(DEV)
    pos = widx = buf[:, :T]
    caches = [torch.randn(rows, Hkv, length, D, generator=g).to(DEV, dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    got = norm.rope_store_kv_triton(q, k, v, rope.cos, rope.sin, pos, *caches, 2, widx)
    want = norm.rope_store_kv_ref(q, k, v, rope.cos, rope.sin, pos, *ref_caches, 2, widx)
    _check(got, want, dtype)
    _check(caches[0], ref_caches[0], dtype)
    assert torch.equal(caches[1], ref_caches[1])  # v is copied, never rounded


@pytest.mark.gpu
def test_dispatch_uses_kernels_on_cuda(monkeypatch):
    """On CUDA the model's ops go through the kernels (and the references are not called), also
    rope/KV for a batched decode step's q/k/v views (3 rows of one token)."""
    calls = []
    monkeypatch.setattr(norm, "rms_norm_ref", lambda *a: calls.append("rms ref"))
    monkeypatch.setattr(norm, "rope_store_kv_ref", lambda *a: calls.append("rope ref"))
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    norm.rms_norm(x, torch.ones(4096, device="cuda", dtype=torch.bfloat16), 1e-5)
    q, k, v = torch.randn(3, 1, 12 * 64, device="cuda", dtype=torch.bfloat16).split([8 * 64, 2 * 64, 2 * 64], -1)
    rope = RotaryEmbedding(64, 128, 10000.0, None).to("cuda")
    caches = [torch.zeros(3, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    pos = torch.tensor([[5], [9], [0]], device="cuda")
    norm.rope_store_kv(
        q.view(3, 1, 8, 64), k.view(3, 1, 2, 64), v.view(3, 1, 2, 64), rope.cos, rope.sin, pos, *caches, 0, pos
    )
    assert calls == [] and common.FUSED


@pytest.mark.gpu
def test_training_on_cuda_keeps_gradients():
    """Where autograd records, the ops take the differentiable reference path: the forward-only
    kernels once cut the gradient of everything before the drafter's final norm on a GPU."""
    w = torch.randn(256, device="cuda", requires_grad=True)
    x = torch.randn(4, 256, device="cuda", requires_grad=True)
    norm.rms_norm(x, w, 1e-5).square().sum().backward()
    want_x, want_w = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    norm.rms_norm_ref(x, w, 1e-5).square().sum().backward()
    torch.testing.assert_close(x.grad, want_x)
    torch.testing.assert_close(w.grad, want_w)
    gate_up = torch.randn(4, 512, device="cuda", requires_grad=True)
    norm.silu_mul(gate_up).sum().backward()
    assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0
    with torch.inference_mode():
        assert common.use_triton(x.detach(), w.detach())  # inference keeps the kernels


def _sdpa_reference(q, kc, vc, row_start, widx, scale):
    """Plain masked attention in float32: query (b, t) sees keys 0..widx[b, t]."""
    B, T, H, D = q.shape
    G = H // kc.shape[1]
    k = kc[row_start : row_start + B].float().repeat_interleave(G, dim=1)  # [B, H, L, D]
    v = vc[row_start : row_start + B].float().repeat_interleave(G, dim=1)
    s = torch.einsum("bthd,bhld->bhtl", q.float(), k) * scale
    keys = torch.arange(kc.shape[2], device=q.device)
    s = s.masked_fill(~(keys.view(1, 1, 1, -1) <= widx.view(B, 1, T, 1)), float("-inf"))
    return torch.einsum("bhtl,bhld->bthd", s.softmax(-1), v)


def _nan_scratch(monkeypatch):
    """Fresh float32 buffers come filled with NaN: a kernel reading partial results it never
    wrote (the attention's key splits past every query's last key) then fails the test."""
    empty = torch.empty

    def nan_empty(*a, **kw):
        t = empty(*a, **kw)
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t

    monkeypatch.setattr(torch, "empty", nan_empty)


@pytest.mark.parametrize("B,T,length", [(1, 1, 200), (3, 5, 700), (2, 16, 130)])
def test_cache_attention(B, T, length, monkeypatch):
    """Decode (T=1), verify (T=K+1) and draft-extend shapes, GQA 4:1, several key chunks,
    a padding query (scratch slot) and rows offset in the cache."""
    _nan_scratch(monkeypatch)
    H, Hkv, D, rows = 8, 2, 64, 5
    dtype = torch.float16
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(rows, Hkv, length, D, generator=g).to(DEV, dtype)
    vc = torch.randn(rows, Hkv, length, D, generator=g).to(DEV, dtype)
    q = torch.randn(B, T, H, D, generator=g).to(DEV, dtype)
    widx = torch.stack([torch.arange(T) + int(torch.randint(0, length - T - 1, (1,), generator=g)) for _ in range(B)])
    scratch = length - 1
    if B > 1:
        widx[-1, -1] = scratch  # a padding token: its output is unused, it must not break the row
    widx = torch.cat([widx, torch.zeros(B, 2, dtype=widx.dtype)], 1).to(DEV)[:, :T]  # a column slice
    got = attention.cache_attention_triton(q, kc, vc, 1, widx, scratch, D**-0.5, sm_count=4)
    want = _sdpa_reference(q, kc, vc, 1, widx, D**-0.5)
    real = (widx != scratch).view(B, T, 1, 1).expand_as(want)
    torch.testing.assert_close(got.float()[real], want[real], rtol=2e-2, atol=2e-3)
    if B > 1:
        assert torch.all(got[-1, -1] == 0)  # the padding query saw nothing


def _tree_visibility(widx, base, anc, length):
    """Reference rule for tree queries, one key at a time: key <= own index, and keys at or past
    the tree base only where the query's ancestor bit is set."""
    B, T = widx.shape
    vis = torch.zeros(B, T, length, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for key in range(int(widx[b, t]) + 1):
                rel = key - int(base[b])
                vis[b, t, key] = rel < 0 or bool((int(anc[b, t]) >> rel) & 1)
    return vis


def test_cache_attention_tree_mask(monkeypatch):
    """Tree verify: a root at index p and five nodes after it (root -> 1 -> 3, root -> 2 -> 4 -> 5):
    each query sees the context, the root, its ancestors and itself, not its siblings' branches.
    The Triton kernel and the SDPA bias (CPU path) against a key-by-key reference."""
    _nan_scratch(monkeypatch)
    from specserve.model.layers import ForwardContext

    H, Hkv, D, length, B, T = 4, 2, 32, 160, 2, 6
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(B, Hkv, length, D, generator=g).to(DEV, torch.float16)
    vc = torch.randn(B, Hkv, length, D, generator=g).to(DEV, torch.float16)
    q = torch.randn(B, T, H, D, generator=g).to(DEV, torch.float16)
    p = torch.tensor([90, 17])
    widx = p.view(B, 1) + torch.arange(T)
    # nodes 0..4 (verify rows 1..5): parents root, root, 0, 1, 3 -> ancestor-or-self bits
    anc_nodes = [0b1, 0b10, 0b101, 0b1010, 0b11010]
    anc = torch.tensor([[0] + anc_nodes] * B)
    base = p + 1
    vis = _tree_visibility(widx, base, anc, length)
    assert vis[0, 3].tolist()[89:97] == [True, True, True, False, True, False, False, False]  # node 2 sees root, node 0
    ref = torch.zeros(B, T, length).masked_fill(~vis, float("-inf"))
    k = kc.float().repeat_interleave(H // Hkv, dim=1)
    v = vc.float().repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("bthd,bhld->bhtl", q.float(), k) * D**-0.5 + ref.to(DEV).unsqueeze(1)
    want = torch.einsum("bhtl,bhld->bthd", s.softmax(-1), v)
    got = attention.cache_attention_triton(
        q, kc, vc, 0, widx.to(DEV), length - 1, D**-0.5, sm_count=4, tree_base=base.to(DEV), tree_anc=anc.to(DEV)
    )
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-3)
    ctx = ForwardContext(0, widx, widx, length, tree_base=base, tree_anc=anc)
    bias = ctx.attn_bias(1, torch.float32).view(B, T, length)
    assert torch.equal(bias == 0, vis)


def test_runner_compiles_eager_attention_blocks_reading_nothing(monkeypatch):
    """After capturing its graphs the runner runs the cache attention once for every power-of-two query
    block up to ATTN_MAX_QUERIES (the blocks only eager forwards use) at one batch size of each
    power-of-two split count, for each distinct attention shape of target and drafter, with every
    query at the padding slot: outputs zero, no cache touched. (8 multiprocessors: batches of 1, 2, 4
    and 8 rows split the demo's 1056 keys over 2 KV heads 8, 4, 2 and 1 ways; 3 rows also 4.)"""
    from specserve.config import EngineConfig
    from specserve.engine.llm import demo_paths
    from specserve.engine.runner import ModelRunner

    target, draft = demo_paths()
    runner = ModelRunner(
        EngineConfig(model=target, draft=draft, device="cpu", spec_steps=3, dtype="float16", max_num_seqs=8)
    )
    monkeypatch.setattr(common, "sm_count", lambda device: 8)
    caches = [m.k_cache.clone() for m in runner.target.attention_modules()]
    calls = []
    real = attention.cache_attention_triton

    def recording(q, k_cache, v_cache, row_start, write_idx, scratch, *a, **kw):
        out = real(q, k_cache, v_cache, row_start, write_idx, scratch, *a, **kw)
        calls.append((q.shape[0], max(16, triton.next_power_of_2(q.shape[1] * q.shape[2] // k_cache.shape[1]))))
        assert bool((write_idx == scratch).all()) and not out.any()
        return out

    monkeypatch.setattr(attention, "cache_attention_ok", lambda *a: True)
    monkeypatch.setattr(attention, "cache_attention_triton", recording)
    runner._compile_eager_attention()
    modules = runner.target.attention_modules() + runner.drafter.attention_modules()
    shapes = {(m.num_heads, m.num_kv_heads, m.head_dim) for m in modules}
    blocks = [b for b in (16, 32, 64, 128) if b <= attention.ATTN_MAX_QUERIES]
    assert sorted(calls) == sorted([(B, b) for B in (1, 2, 4, 8) for b in blocks] * len(shapes))
    assert all(torch.equal(c, m.k_cache) for c, m in zip(caches, runner.target.attention_modules()))


@pytest.mark.parametrize("rows", [1, 3, 16, 31, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv(rows, dtype):
    """The skinny-matmul kernel against F.linear: one row (vector path), several (tensor cores,
    rows padded to 16, 32 or 64), N not a multiple of the block, K not a multiple of the K block."""
    if DEV == "cpu" and dtype == torch.bfloat16 and rows > 1:
        pytest.skip("Triton's interpreter returns garbage for bf16 tl.dot (numpy has no bf16); GPU runs it")
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(100, 300, generator=g) * 0.05).to(DEV, dtype)
    x = torch.randn(rows, 300, generator=g).to(DEV, dtype)
    want = torch.nn.functional.linear(x.float(), w.float())
    for cfg in gemv.GEMV_CONFIGS[gemv.gemv_config_group(rows)]:
        cfg = (cfg[0], 128) + cfg[2:]  # a K block that leaves a partial last block
        torch.testing.assert_close(gemv.gemv_triton(x, w, cfg).float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_gemv_equals_a_float32_reference_in_every_launch_shape():
    """The one-row CUDA GEMV (kernels/csrc/gemv.cu) against F.linear in float32, for every launch shape the
    sweep tries: N not a multiple of a block's rows, K of 1, 9 and 28 steps of 256 (not a multiple of the
    steps a batch loads, nor of the warps sharing a row). Its float32 sums round once to bf16, so it is
    within one bf16 rounding."""
    if not gemv.gemv_cuda_fits(
        torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16),
        torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16),
    ):
        pytest.skip("the CUDA GEMV needs a Hopper or later GPU and torch.cuda._compile_kernel")
    g = torch.Generator(device="cuda").manual_seed(6)
    for N, K in ((100, 256), (333, 2304), (4096, 7168)):
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
        x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
        want = F.linear(x.float(), w.float())
        for warps, rows, split, unroll in itertools.product((4, 8), (1, 2), (1, 2, 4), (2, 4, 8)):
            got = gemv.gemv_cuda(x, w, ("cuda", warps, rows, split, unroll))
            assert got.shape == (1, N) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_fixed_row_tile_gives_each_row_the_same_result_at_any_row_count(dtype):
    """With BLOCK_M fixed (--batch-invariant) one row and a verify's rows run the same tile, so
    row i's output is bit-identical whether 1, 5, 8 or 40 rows (three tiles) are multiplied."""
    if DEV == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter returns garbage for bf16 tl.dot (numpy has no bf16); GPU runs it")
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(200, 576, generator=g) * 0.05).to(DEV, dtype)
    x = torch.randn(40, 576, generator=g).to(DEV, dtype)
    want = torch.nn.functional.linear(x.float(), w.float())
    for cfg in {gemv.ROW_INVARIANT_GEMV, gemv.GEMV_CONFIGS[2][-1] + (16,)}:
        full = gemv.gemv_triton(x, w, cfg)  # three 16-row tiles
        torch.testing.assert_close(full.float(), want, rtol=2e-2, atol=2e-2)
        for m in (1, 5, 8):
            assert torch.equal(gemv.gemv_triton(x[:m].contiguous(), w, cfg), full[:m]), (cfg, m)


@pytest.mark.gpu
def test_batch_invariant_tuning_gives_every_row_count_the_fixed_config():
    """tune_linear(invariant=True): every row bucket up to 64 holds ROW_INVARIANT_GEMV, chosen by
    no timing, and a 40-row product (three row tiles) gives rows 0..4 the bits of a 5-row one."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ws = [torch.randn(1024, 576, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(2)]
    gemv.tune_linear(ws, max_rows=8, invariant=True)
    cfgs = {r: ws[0].linear_tuning.gemv_config(ws[0], torch.bfloat16, r) for r in (1, 2, 5, 8, 16, 40, 64)}
    assert set(cfgs.values()) == {gemv.ROW_INVARIANT_GEMV}, cfgs
    x = torch.randn(40, 576, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear_k.linear(x, ws[0])[:5], linear_k.linear(x[:5], ws[0]))
    assert torch.equal(linear_k.linear(x, ws[0])[:1], linear_k.linear(x[:1], ws[0]))


def test_cpu_linear_tuning(monkeypatch):
    """The CPU products' tuning: `linear` equals F.linear at every row count, on both sides of
    each weight's switch-overs, with and without bias; a switch-over follows the timings."""
    monkeypatch.setattr(cpu_native, "_state", {"ops": None})  # (the panel GEMV: tests/kernels/test_cpu_native.py)
    g = torch.Generator().manual_seed(7)
    ws = [torch.randn(n, k, generator=g) for n, k in ((512, 64), (64, 64), (96, 192))]
    report = cpu_linear.tune_linear_cpu(ws)
    assert set(report) == {"512x64", "64x64", "96x192"}
    for w in ws:
        assert w.cpu_plan is None or (w.cpu_plan.packed.is_mkldnn and "onednn" in w.cpu_plan.by_rows)
    # Pretend oneDNN wins from 4 rows on: it must take over from 3 rows (past the last MKL win, 2).
    times = iter([1.0, 2.0, 1.0, 2.0] + [2.0, 1.0] * 4)  # (MKL, oneDNN) per row count 1 2 4 8 16 64
    monkeypatch.setattr(cpu_linear, "_cpu_us", lambda fn, reps=20: next(times))
    cpu_linear.tune_linear_cpu(ws[:1])
    assert ws[0].cpu_plan.by_rows[1:5] == ("mkl", "mkl", "onednn", "onednn")
    # An engine whose widest step is 6 rows times up to 8 rows: wider products (prefill) take MKL.
    times = iter([1.0, 2.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0])  # (MKL, oneDNN) at 1 2 4 8 rows only
    cpu_linear.tune_linear_cpu(ws[:1], max_rows=6)
    by_rows = ws[0].cpu_plan.by_rows
    assert by_rows[1:9] == ("mkl",) + ("onednn",) * 7 and set(by_rows[9:]) == {"mkl"}
    assert next(times, None) is None  # every measurement taken, none more
    b = torch.randn(512, generator=g)
    for w in ws:
        for rows in (1, 2, 3, 5, 9, 64):
            x = torch.randn(2, rows, w.shape[1], generator=g)
            torch.testing.assert_close(linear_k.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        linear_k.linear(x[..., :64], ws[0], b), F.linear(x[..., :64], ws[0], b), rtol=1e-5, atol=1e-5
    )
    monkeypatch.setattr(common, "FUSED", False)  # SPECSERVE_FUSED_KERNELS=0: plain F.linear everywhere
    cpu_linear.tune_linear_cpu(ws)
    assert all(w.cpu_plan is None for w in ws)


@pytest.mark.parametrize("k,V", [(3, 50), (8, 2048)])
def test_tree_level(k, V):
    """One depth of tree drafting in two kernels against the reference: children's scores (below
    their parents', also at a parent score of 0), tokens (draft ids mapped to target ids), the
    candidate lists and the next frontier. The small case's logits are bfloat16, as the drafter's
    head gives them (distinct integers: exact in bfloat16, so no ties to break differently)."""
    B, M, off = 2, 4 * k * k, 5
    g = torch.Generator().manual_seed(k)
    if V <= 256:
        logits = torch.stack([torch.randperm(V, generator=g) for _ in range(B * k)]).view(B, k, V) - V / 2
        logits = logits.to(DEV, torch.bfloat16)
    else:
        logits = (torch.randn(B, k, V, generator=g) * 3).to(DEV)
    d2t = torch.randint(0, 1000, (V,), generator=g).to(DEV)
    front = -torch.rand(B, k, generator=g).to(DEV) * 5
    front[0, 0] = 0.0  # a parent scoring 0: its children must still score below it
    bits = torch.randint(0, 1 << 40, (B, k), generator=g).to(DEV)
    idx = torch.randint(0, 100, (B, k), generator=g).to(DEV)
    outs = []
    for fn in (tree.tree_level_ref, tree.tree_level_triton):
        lists = (
            torch.zeros(B, M, device=DEV),
            torch.zeros(B, M, dtype=torch.long, device=DEV),
            torch.zeros(B, M, dtype=torch.long, device=DEV),
        )
        outs.append((fn(logits, front, bits, idx, *lists, off, d2t), lists))
    (want, want_lists), (got, got_lists) = outs
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # scores
    for a, b in zip(got[1:], want[1:]):  # ids, frontier node, bits, candidate index
        assert torch.equal(a, b)
    torch.testing.assert_close(got_lists[0], want_lists[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got_lists[1], want_lists[1]) and torch.equal(got_lists[2], want_lists[2])
    child = got_lists[0][:, off : off + k * k].view(B, k, k)
    assert torch.all(child < front.unsqueeze(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax(dtype):
    """Rows longer than one chunk (the chunks' winners merged by the last to finish), one shorter
    than a chunk, and ties inside a chunk and across chunks: the first maximum wins, as in torch."""
    V = 2 * argmax_k.ARGMAX_BLOCK + 123
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, V, generator=g).to(dtype)
    x[1, [7, 9]] = 50.0  # tie inside the first chunk
    x[2, [argmax_k.ARGMAX_BLOCK + 3, 2 * argmax_k.ARGMAX_BLOCK + 1]] = 50.0  # tie across chunks
    x[3, -1] = 50.0  # in the short last chunk
    x[4] = 0.0  # all equal
    x = x.to(DEV)
    want = x.argmax(-1)
    assert torch.equal(argmax_k.argmax_triton(x), want)
    assert torch.equal(argmax_k.argmax_triton(x.view(5, 1, V)), want.view(5, 1))  # leading dims kept
    assert not argmax_k._chunk_counters(x.device, 5).any()  # each row's last chunk reset its counter
    short = x[:, :100].contiguous()
    assert torch.equal(argmax_k.argmax_triton(short), short.argmax(-1))


def test_linear_tuning_lookup():
    """A tuning's GEMV choice applies to its weight shape, dtype and row bucket only (r rows use
    the bucket of the next tuned count up; past the largest, cuBLAS)."""
    cfg = gemv.GEMV_CONFIGS[2][0]
    tuning = gemv.LinearTuning({(64, 32, torch.bfloat16, 8): cfg, (64, 32, torch.bfloat16, 16): None})
    w = torch.empty(64, 32, dtype=torch.bfloat16)
    assert tuning.gemv_config(w, torch.bfloat16, 5) == cfg and tuning.gemv_config(w, torch.bfloat16, 8) == cfg
    assert tuning.gemv_config(w, torch.bfloat16, 9) is None  # tuned: cuBLAS won
    assert tuning.gemv_config(w, torch.bfloat16, 65) is None  # past every bucket
    assert tuning.gemv_config(w, torch.float16, 5) is None
    assert tuning.gemv_config(torch.empty(32, 64, dtype=torch.bfloat16), torch.bfloat16, 5) is None


@pytest.mark.gpu
def test_linear_follows_the_weights_own_tuning(monkeypatch):
    """`linear` takes the GEMV only for a weight whose own tuning chose it: a weight of the same
    shape without a tuning (another model's) keeps cuBLAS."""
    calls = []
    real = linear_k.gemv
    monkeypatch.setattr(linear_k, "gemv", lambda *a: calls.append(a[2]) or real(*a))
    cfg = gemv.GEMV_CONFIGS[1][0]
    tuned, plain = (torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tuned.linear_tuning = gemv.LinearTuning({(256, 512, torch.bfloat16, 1): cfg})
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(linear_k.linear(x, tuned).float(), F.linear(x, tuned).float(), rtol=2e-2, atol=2e-2)
        linear_k.linear(x, plain)
    assert calls == [cfg]
