"""The latent-attention kernel (kernels/latent_attention.py) against LatentAttention's SDPA path:
decode, verify chains, trees, slot and paged caches, rows at different lengths, padding queries
(Triton's interpreter on CPU, the kernel itself on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "triton", reason="Triton is not installed (pip install -e '.[kernels]' runs these in its interpreter on CPU)"
)

from specserve.kernels import latent_attention as la  # noqa: E402
from specserve.model import mla  # noqa: E402
from specserve.model.layers import ForwardContext  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel multiplies float32 only in the interpreter (a GPU would round through TF32, and the
# model keeps float32 on SDPA there); half precision everywhere.
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if DEV == "cpu" else [torch.bfloat16, torch.float16]
EXACT = DTYPES[0]


def _case(B, T, H, L, R, length, dtype, g, rows=None, padding=False, block_size=0):
    """A LatentAttention over a filled latent cache (slot, or paged with blocks in a shuffled
    order), queries, and the context of one forward: row b's block of T tokens starts at its
    own length; with `padding` the last row's last token is a padding one (scratch slot)."""
    rows = rows or B + 1
    attn = mla.LatentAttention(H, L, R, (L + R) ** -0.5)
    slot = torch.randn(rows, 1, length, L + R, generator=g).to(DEV, dtype)
    start = torch.randint(0, length - T - 1, (B,), generator=g)
    widx = start.view(B, 1) + torch.arange(T)
    scratch = length - 1
    if padding:
        widx[-1, -1] = scratch
    q = torch.randn(B, T, H, L + R, generator=g).to(DEV, dtype)
    latent = torch.randn(B, T, 1, L + R, generator=g).to(DEV, dtype)
    kv_len = int(widx[widx != scratch].max()) + 1
    table = None
    if block_size:
        n = length // block_size
        order = torch.randperm(rows * n, generator=g)
        table = order.view(rows, n).to(DEV)
        pool = torch.empty(rows * n, 1, block_size, L + R, dtype=dtype, device=DEV)
        pool[order] = slot.view(rows, 1, n, block_size, L + R).transpose(1, 2).reshape(rows * n, 1, block_size, L + R)
        attn.k_cache = pool
    else:
        attn.k_cache = slot
    ctx = ForwardContext(
        1, widx.to(DEV), widx.to(DEV), kv_len if not padding else length, block_table=table, block_size=block_size
    )
    return attn, q, latent, ctx, widx != scratch


def _both(attn, q, latent, ctx, monkeypatch, **kw):
    """(kernel, SDPA) outputs of attn's forward on the same cache."""
    cache = attn.k_cache.clone()
    monkeypatch.setattr(mla, "latent_attention_ok", lambda *a: False)
    want = attn(q, latent, ctx)
    assert la.latent_attention_fits(q, attn.k_cache, ctx.write_idx, attn.latent_dim)
    attn.k_cache = cache
    calls = []

    def fits(*a):
        calls.append(1)
        return la.latent_attention_fits(*a)

    monkeypatch.setattr(mla, "latent_attention_ok", fits)
    monkeypatch.setattr(la.common, "sm_count", lambda device: kw.get("sm_count", 16))
    got = attn(q, latent, ctx)
    assert calls  # the kernel path ran
    return got, want


def _close(got, want, real, dtype):
    B, T = real.shape
    real = real.view(B, T, 1).expand(B, T, got.shape[-1]).to(got.device)
    if dtype == torch.float32:
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float()[real], want.float()[real], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B,T,H,block_size,sm_count",
    [
        (1, 1, 16, 0, 8),  # decode, several key splits
        (3, 4, 4, 0, 16),  # verify chains (K=3), rows at different lengths
        (2, 1, 8, 8, 8),  # paged decode
        (2, 5, 16, 16, 16),  # paged verify over two row blocks (80 rows: the second one partly padded)
        (2, 3, 8, 64, 16),  # blocks of 64 keys: a key tile in one block, one block-table read a tile
        (2, 2, 4, 0, 1),  # one split holds every key: no combine
    ],
)
def test_latent_kernel_equals_sdpa(dtype, B, T, H, block_size, sm_count, monkeypatch):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + H)
    monkeypatch.setattr(la, "LATENT_COMBINE_TILE", 64)  # the combine merges the 32 dims in chunks of 16
    monkeypatch.setattr(la, "LATENT_MIN_CHUNK", 32)  # splits of a few key tiles at this short cache
    attn, q, latent, ctx, real = _case(B, T, H, 32, 16, 192, dtype, g, block_size=block_size)
    got, want = _both(attn, q, latent, ctx, monkeypatch, sm_count=sm_count)
    _close(got, want, real, dtype)


@pytest.mark.parametrize(
    "length,min_chunk,sm_count,splits",
    [
        (4096, 256, 132, 16),  # short context: chunks of the minimum length
        (131072, 256, 132, 132),  # long context: every multiprocessor streams a split
        (192, 32, 16, 6),
    ],
)
def test_split_count_follows_context_and_batch(length, min_chunk, sm_count, splits, monkeypatch):
    """Splits fill the multiprocessors (batch x row blocks x splits) where the cache is long enough
    for chunks of LATENT_MIN_CHUNK keys; a batch or a verify block whose row blocks already fill
    them takes one split (no combine)."""
    monkeypatch.setattr(la, "LATENT_MIN_CHUNK", min_chunk)
    assert la.latent_splits(length, 1, 1, 64, sm_count) == splits
    assert la.latent_splits(length, 4, 5, 128, sm_count) == max(1, min(splits, sm_count // 40))
    assert la.latent_splits(length, 2 * sm_count, 1, 8, sm_count) == 1


@pytest.mark.parametrize("lengths", [(40, 900), (1000, 1000)])
def test_latent_kernel_short_rows_in_a_long_cache(lengths, monkeypatch):
    """Each sequence cuts its own keys into chunks (from its length, in the kernel), so a short row
    next to a long one in a long cache uses few splits and both equal SDPA (decode and K=2 verify)."""
    g = torch.Generator().manual_seed(sum(lengths))
    monkeypatch.setattr(la, "LATENT_MIN_CHUNK", 32)
    for T in (1, 3):
        attn, q, latent, ctx, real = _case(2, T, 4, 32, 16, 1024, EXACT, g, block_size=16)
        widx = (torch.tensor(lengths).view(2, 1) - T + torch.arange(T)).to(DEV)
        ctx = ForwardContext(1, widx, widx, max(lengths), block_table=ctx.block_table, block_size=16)
        got, want = _both(attn, q, latent, ctx, monkeypatch, sm_count=16)
        _close(got, want, real, EXACT)


@pytest.mark.parametrize("H,T,block_size", [(16, 2, 0), (64, 2, 16)])
def test_latent_kernel_at_deepseek_widths(H, T, block_size, monkeypatch):
    """Latent 512 and rope 64 (the two tiles of a 576-dim key); 16 heads (128 over TP 8) and 64
    (Kimi-K2.5, two row blocks at a verify block of 2), over several key splits."""
    g = torch.Generator().manual_seed(13 + H)
    monkeypatch.setattr(la, "LATENT_MIN_CHUNK", 32)
    attn, q, latent, ctx, real = _case(2, T, H, 512, 64, 96, EXACT, g, block_size=block_size)
    got, want = _both(attn, q, latent, ctx, monkeypatch, sm_count=8)
    _close(got, want, real, EXACT)


def test_latent_kernel_padding_query_sees_nothing(monkeypatch):
    """A padding token (written to the scratch slot) gives zeros and leaves its row's other
    queries as they are."""
    g = torch.Generator().manual_seed(7)
    monkeypatch.setattr(la, "LATENT_MIN_CHUNK", 32)
    attn, q, latent, ctx, real = _case(3, 3, 4, 32, 16, 160, EXACT, g, padding=True)
    got, want = _both(attn, q, latent, ctx, monkeypatch)
    _close(got, want, real, EXACT)
    assert torch.all(got[-1, -1] == 0)


@pytest.mark.parametrize("block_size", [0, 8])
def test_latent_kernel_tree_mask(block_size, monkeypatch):
    """Tree verify: a root and five nodes (root -> 0 -> 2, root -> 1 -> 3 -> 4); each query sees
    the context, its ancestors and itself, as the SDPA bias does."""
    g = torch.Generator().manual_seed(11)
    monkeypatch.setattr(la, "LATENT_MIN_CHUNK", 32)
    B, T = 2, 6
    attn, q, latent, ctx, real = _case(B, T, 4, 32, 16, 128, EXACT, g, block_size=block_size)
    base = ctx.write_idx[:, 0] + 1
    anc = torch.tensor([[0, 0b1, 0b10, 0b101, 0b1010, 0b11010]] * B, device=DEV)
    ctx = ForwardContext(
        1,
        ctx.write_idx,
        ctx.write_idx,
        ctx.kv_len,
        tree_base=base,
        tree_anc=anc,
        block_table=ctx.block_table,
        block_size=block_size,
    )
    got, want = _both(attn, q, latent, ctx, monkeypatch)
    _close(got, want, real, EXACT)
    chain = ForwardContext(
        1, ctx.write_idx, ctx.write_idx, ctx.kv_len, block_table=ctx.block_table, block_size=block_size
    )
    attn.k_cache = attn.k_cache.clone()
    assert not torch.allclose(attn(q, latent, chain), want)  # the tree bits change the answer


def test_shapes_the_kernel_does_not_take():
    """Non-power-of-two halves, several cache heads and prefill-length blocks stay on SDPA."""
    widx = torch.zeros(1, 1, dtype=torch.long)
    cache = torch.zeros(2, 1, 64, 576)
    assert la.latent_attention_fits(torch.zeros(1, 1, 8, 576), cache, widx, 512)
    assert not la.latent_attention_fits(torch.zeros(1, 1, 8, 576), cache, widx, 500)
    assert not la.latent_attention_fits(torch.zeros(1, 1, 8, 576), torch.zeros(2, 2, 64, 576), widx, 512)
    assert not la.latent_attention_fits(torch.zeros(1, 64, 8, 576), cache, torch.zeros(1, 64, dtype=torch.long), 512)
    assert not la.latent_attention_ok(torch.zeros(1, 1, 8, 576), cache, widx, 512)  # CPU tensors: SDPA


@pytest.mark.gpu
@pytest.mark.parametrize("H,T,block_size", [(128, 1, 0), (64, 4, 0), (128, 2, 64), (16, 8, 64)])
def test_latent_kernel_on_gpu_at_real_width(H, T, block_size, monkeypatch):
    """DeepSeek-V3 widths (latent 512, rope 64, 128 or 64 heads after TP), context ~1000, bf16,
    batch 4 at mixed lengths and a padding query: the kernel path equals SDPA."""
    g = torch.Generator().manual_seed(H + T)
    B, L, R = 4, 512, 64
    attn, q, latent, ctx, real = _case(B, T, H, L, R, 1024, torch.bfloat16, g, padding=True, block_size=block_size)
    cache = attn.k_cache.clone()
    want = attn(q, latent, ctx)  # CUDA bf16: the kernel path by default
    assert mla.latent_attention_ok(q, attn.k_cache, ctx.write_idx, L)
    attn.k_cache = cache
    monkeypatch.setattr(mla, "latent_attention_ok", lambda *a: False)
    sdpa = attn(q, latent, ctx)
    _close(want, sdpa, real, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T, block_size", [(1, 1, 0), (3, 1, 16), (2, 4, 16), (2, 3, 0)])
def test_rope_store_latent_equals_the_reference_steps(dtype, B, T, block_size):
    """One launch for MLA's rotations, query concatenation and cache write gives the reference's query
    and cache bit for bit (strided views of the projections as the model passes them; YaRN-scaled
    tables; slot and paged caches, a padding token; bfloat16 in the interpreter to its truncating casts)."""
    from specserve.model.layers import KVCacheAttention, RotaryEmbedding

    g = torch.Generator().manual_seed(B * 10 + T)
    H, nope, L, R = 4, 8, 32, 16
    attn, _, _, ctx, _ = _case(B, T, H, L, R, 96, dtype, g, padding=B > 1, block_size=block_size)
    ctx.positions = ctx.write_idx.clone()
    rope = RotaryEmbedding(
        R, 128, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    ).to(DEV)
    q = torch.randn(B, T, H * (nope + R), generator=g).to(DEV, dtype)
    kv = torch.randn(B, T, L + R, generator=g).to(DEV, dtype)
    q_rot = q.view(B, T, H, nope + R)[..., nope:]
    c, k_rot = kv[..., :L] * 2, kv[..., L:].unsqueeze(2)
    q_latent = torch.randn(B, T, H, L, generator=g).to(DEV, dtype)
    assert la.rope_store_latent_fits(q_rot, k_rot, attn.k_cache, ctx.write_idx, ctx.positions, L)
    cache = attn.k_cache.clone()
    got = la.rope_store_latent_triton(
        q_latent,
        q_rot,
        c,
        k_rot,
        rope.cos,
        rope.sin,
        ctx.positions,
        cache,
        1,
        ctx.write_idx,
        ctx.block_table,
        ctx.block_size,
    )
    want = torch.cat([q_latent, KVCacheAttention._rotate(q_rot, ctx, rope)], dim=-1)
    ctx.store(attn.k_cache, torch.cat([c.unsqueeze(2), KVCacheAttention._rotate(k_rot, ctx, rope)], dim=-1))
    for a, b in ((got, want), (cache, attn.k_cache)):
        if DEV == "cpu" and dtype == torch.bfloat16:  # the interpreter's bfloat16 casts truncate
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-6)
        else:
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """A tiny DeepSeek-V3 target (4 heads, latent 32, rope 16) and a random EAGLE-3 drafter."""
    from tiny import make_drafter, make_moe_target

    root = tmp_path_factory.mktemp("mla_pair")
    target = make_moe_target(root / "target", vocab=12)
    return target, make_drafter(root / "draft", target, layout="sglang", aux_ids=[1, 2, 3])


@pytest.mark.slow  # (about 40 s a mode in the interpreter)
@pytest.mark.skipif(DEV == "cuda", reason="CPU tensors through the kernel need the interpreter (no CUDA)")
@pytest.mark.parametrize(
    "spec", [{}, dict(spec_steps=3), dict(spec_steps=3, spec_topk=2)], ids=["plain", "chain", "tree"]
)
def test_tiny_deepseek_decodes_the_same_through_the_kernel(moe_pair, spec, monkeypatch):
    """Greedy decoding, and speculation (chain and tree verify blocks), of a tiny DeepSeek-V3
    target give the same tokens with every latent attention through the kernel and the rotations
    and cache writes through their one-launch kernel (interpreter, float32, paged blocks of 8) as
    through SDPA and the reference steps."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine
    from specserve.engine.sampling import SamplingParams

    target, draft = moe_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (5, 13)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def generate():
        engine = Engine(
            EngineConfig(
                model=str(target),
                draft=str(draft) if spec else None,
                device="cpu",
                max_num_seqs=2,
                max_model_len=64,
                kv_block_size=8,
                **spec,
            )
        )
        seqs = [engine.add_request(p, greedy) for p in prompts]
        while engine.has_work():
            engine.step()
        return [s.output_ids for s in seqs], engine

    base, _ = generate()
    calls = []

    def kernel(q, *a, **kw):
        calls.append((q.shape[1], kw["tree_anc"] is not None))
        return la.latent_attention_triton(q, *a, **kw)

    monkeypatch.setattr(mla, "latent_attention_ok", lambda *a: la.latent_attention_fits(*a))
    monkeypatch.setattr(mla, "latent_attention_triton", kernel)
    fused = []

    def rope_store(*a, **kw):
        fused.append(1)
        return la.rope_store_latent_triton(*a, **kw)

    monkeypatch.setattr(mla, "rope_store_latent_ok", lambda *a: la.rope_store_latent_fits(*a))
    monkeypatch.setattr(mla, "rope_store_latent_triton", rope_store)
    monkeypatch.setattr(la.common, "sm_count", lambda device: 4)
    out, engine = generate()
    assert out == base and fused
    if not spec:
        assert (1, False) in calls  # decode steps
    elif "spec_topk" in spec:
        assert any(tree for _, tree in calls)  # tree verify blocks
    else:
        assert (4, False) in calls and engine.totals.accepted > 0  # chain verify blocks of K + 1


@pytest.mark.slow  # (about 40 s in the interpreter)
def test_runner_compiles_eager_latent_blocks_reading_nothing(moe_pair, monkeypatch):
    """After capturing its graphs the runner also runs the latent kernel once for every launch constant an
    eager latent attention (a catch-up, a chunk continuing a prompt) may meet at 1..rows sequences of up to
    LATENT_MAX_TOKENS tokens (power-of-two token block, combine split count); every query sits at the
    padding slot (outputs zero, cache untouched)."""
    import triton

    from specserve.config import EngineConfig
    from specserve.engine.runner import ModelRunner
    from specserve.kernels import common

    target, draft = moe_pair
    rows = 6
    runner = ModelRunner(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            spec_steps=3,
            dtype="float16",
            max_num_seqs=rows,
            max_model_len=256,
            kv_block_size=8,
        )
    )
    monkeypatch.setattr(common, "sm_count", lambda device: 8)
    monkeypatch.setattr(la, "LATENT_MIN_CHUNK", 32)  # several split counts at this short cache
    latent = [m for m in runner.target.attention_modules() if isinstance(m, mla.LatentAttention)]
    caches = [m.k_cache.clone() for m in latent]
    compiled = set()
    real = la.latent_attention_triton

    def variant(length, B, T, H):  # the launch constants: token block, combine splits (0: none)
        n_split = la.latent_splits(length, B, T, H, 8)
        return max(2, triton.next_power_of_2(T)), 0 if n_split == 1 else triton.next_power_of_2(n_split)

    def recording(q, cache, latent_dim, row_start, write_idx, scratch, *a, **kw):
        out = real(q, cache, latent_dim, row_start, write_idx, scratch, *a, **kw)
        B, T, H = q.shape[:3]
        length = kw["block_table"].shape[1] * kw["block_size"]
        compiled.add(variant(length, B, T, H))
        assert bool((write_idx == scratch).all()) and not out.any()
        return out

    monkeypatch.setattr(la, "latent_attention_ok", lambda q, *a: q.dtype == torch.float16)
    monkeypatch.setattr(la, "latent_attention_triton", recording)
    runner._compile_eager_attention()
    H = latent[0].num_heads
    length = runner.kv.table.shape[1] * runner.block_size
    splits = set()
    for B in range(1, rows + 1):
        for T in range(1, la.LATENT_MAX_TOKENS + 1):
            splits.add(la.latent_splits(length, B, T, H, 8))
            assert variant(length, B, T, H) in compiled, (B, T)
    assert len(splits) > 2
    assert all(torch.equal(c, m.k_cache) for c, m in zip(caches, latent))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, T", [(1, 1), (3, 1), (2, 5)])
def test_head_products_equal_einsum(dtype, B, T):
    """The absorbed query (q_nope . W_UK, q_nope a slice of the query heads) per head in one launch equals
    torch.einsum over MLA's kv_b slice, for a decode step's one token a row and a verify's several; 40 latent
    dims: a partial output block; 32 features in one partial step of 128 or two of 16. `head_product`
    (the kernel where it serves, else einsum) equals einsum too."""
    g = torch.Generator().manual_seed(B * 10 + T)
    H, nope, rope, v, L = 3, 32, 16, 24, 40
    kv_b = (torch.randn(H, nope + v, L, generator=g) * 0.1).to(DEV, dtype)
    q = torch.randn(B, T, H * (nope + rope), generator=g).to(DEV, dtype).view(B, T, H, nope + rope)
    q_nope = q[..., :nope]  # (heads nope + rope apart: a strided view, as in the model)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    want = torch.einsum("bthn,hnl->bthl", q_nope.float(), kv_b[:, :nope].float())
    for cfg in (None, (16, 16, 4, 2)):
        got = la.head_product_triton(q_nope, kv_b[:, :nope], cfg)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, **tol)
    torch.testing.assert_close(la.head_product(q_nope, kv_b[:, :nope]).float(), want, **tol)
