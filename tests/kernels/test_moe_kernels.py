"""The fused routed experts (specserve/kernels/moe.py), float and int4, against the MoE reference path.

Without a GPU the kernels run in Triton's interpreter (shapes kept tiny: it is slow); on one they
run compiled. The reference is `MoE.forward` on the CPU (its expert loop) or `MoE.experts_ref`.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "triton",
    reason="Triton is not installed (pip install -e '.[kernels]' runs these kernels in its interpreter on CPU)",
)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specserve.config import MoEConfig  # noqa: E402
from specserve.kernels.int4 import dequantize_int4, pack_int4, quantize_int4, tile_experts, untile_experts  # noqa: E402
from specserve.kernels.moe import (  # noqa: E402
    COMBINE_BLOCK,
    INT4_FEW_PAIRS,
    INT4_FEW_TILES,
    INT4_TILES,
    Tiles,
    _combine_kernel,
    _weight_tile,
    align_pairs,
    default_tiles,
    fused_experts,
)
from specserve.kernels.moe_routing import ROUTER_ROWS, fused_align, fused_route, router_logits_triton  # noqa: E402
from specserve.model import moe as moe_module  # noqa: E402
from specserve.model.moe import MoE, route_grouped_sigmoid, route_softmax  # noqa: E402
from specserve.model.quant import Int4Weights, QuantConfig  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 32, 16
# float32 against the CPU reference: sums in another order (on a GPU, other kernels' orders too)
F32 = dict(rtol=1e-5, atol=1e-5) if DEV == "cpu" else dict(rtol=1e-4, atol=1e-4)
# (routing, experts, top_k, groups, groups kept): DeepSeek-style grouped sigmoid with a selection
# bias, Qwen-style softmax; 2 of 8 and 8 of 16 experts
ROUTINGS = {
    "sigmoid-2of8": ("sigmoid", 8, 2, 4, 2),
    "sigmoid-8of16": ("sigmoid", 16, 8, 4, 2),
    "softmax-2of8": ("softmax", 8, 2, 1, 1),
    "softmax-8of16": ("softmax", 16, 8, 1, 1),
}


# int4 schemes, name -> (group size, symmetric): groups of 4, 8 and 16 input columns (gate/up
# has 32, down 16; 4 is narrower than a word) and one per row, with and without zero points
INT4_SCHEMES = {
    "g4-sym": (4, True),
    "g8-sym": (8, True),
    "g8-asym": (8, False),
    "g16-asym": (16, False),
    "channel-sym": (None, True),
    "channel-asym": (None, False),
}


def _moe(
    routing: str, shared: bool = True, seed: int = 0, int4: str | None = None, hidden: int = HIDDEN, inter: int = INTER
) -> MoE:
    """A random MoE; `int4` (an INT4_SCHEMES name) quantizes its routed experts as checkpoints
    store them (`Int4Experts` filled from `quantize_int4` / `pack_int4`; router and shared
    experts stay float, as Kimi-K2.5's)."""
    scoring, E, k, groups, kept = ROUTINGS[routing]
    m = MoEConfig(
        num_experts=E,
        top_k=k,
        intermediate_size=inter,
        scoring=scoring,
        norm_topk_prob=True,
        routed_scaling_factor=2.5 if scoring == "sigmoid" else 1.0,
        n_group=groups,
        topk_group=kept,
        shared_intermediate_size=inter if shared else 0,
        dense_layers=(),
    )
    moe = MoE(hidden, m)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    if int4 is None:
        return moe.requires_grad_(False)
    group, symmetric = INT4_SCHEMES[int4]
    quant = QuantConfig(groups=((("Linear",), Int4Weights(group, symmetric)),), ignore=("re:.*shared_experts.*",))
    q4 = MoE(hidden, m, quant=quant, prefix="model.layers.1.mlp.")
    floats = {n: t for n, t in moe.state_dict().items() if not n.startswith(("w13", "w2"))}
    q4.load_state_dict(floats, strict=False)
    with torch.no_grad():
        for experts, w in ((q4.w13, moe.w13), (q4.w2, moe.w2)):
            q, scale, zero = quantize_int4(w, group, symmetric)
            experts.packed.copy_(pack_int4(q))
            experts.scale.copy_(scale)
            if zero is not None:
                experts.zero.copy_(zero)
    return q4.requires_grad_(False)


def _fused_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward with the routed experts fused (what it runs on CUDA)."""
    weights, ids = moe.route(x)
    return fused_experts(x, weights, ids, moe.w13, moe.w2, moe.first) + moe.shared(x)


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_fused_moe_equals_reference(routing, tokens):
    moe = _moe(routing)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    want = moe(x)  # on the CPU: the reference loop
    got = _fused_forward(moe.to(DEV), x.to(DEV)).cpu()
    torch.testing.assert_close(got, want, **F32)


def test_align_pads_each_chosen_expert_to_whole_blocks_and_skips_empty_ones():
    ids = torch.tensor([[0, 3], [3, 5], [0, 3]])  # experts 1, 2, 4, 6, 7: no pairs
    pairs, block_expert = align_pairs(ids.to(DEV), experts=8, first=0, block_m=16)
    P = ids.numel()
    assert block_expert.shape == (min(P, 8) + 1,) and pairs.shape == (block_expert.numel() * 16,)
    assert block_expert.tolist() == [0, 3, 5, 8, 8, 8, 8]  # 8: no expert, the programs exit
    rows = pairs.view(-1, 16).cpu()
    assert rows[0, :2].tolist() == [0, 4] and rows[1, :3].tolist() == [1, 2, 5] and rows[2, :1].tolist() == [3]
    assert (rows[0, 2:] == P).all() and (rows[1, 3:] == P).all() and (rows[2, 1:] == P).all() and (rows[3:] == P).all()


def test_experts_without_tokens_and_experts_held_elsewhere_contribute_nothing():
    """Routing that leaves most experts idle (one gets every token) equals the reference; with
    experts 4..7 held here (expert parallelism), pairs routed to 0..3 add zero."""
    moe = _moe("sigmoid-2of8", shared=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, HIDDEN, generator=g)
    ids = torch.tensor([[6, 1], [6, 2], [1, 6], [6, 5], [2, 6]])
    weights = torch.rand(5, 2, generator=g)
    want = moe.experts_ref(x, weights, ids)
    w13, w2 = moe.w13.to(DEV), moe.w2.to(DEV)
    got = fused_experts(x.to(DEV), weights.to(DEV), ids.to(DEV), w13, w2).cpu()
    torch.testing.assert_close(got, want, **F32)
    elsewhere = moe.experts_ref(x, weights.masked_fill(ids < 4, 0.0), ids)
    got = fused_experts(x.to(DEV), weights.to(DEV), ids.to(DEV), w13[4:], w2[4:], first=4).cpu()
    torch.testing.assert_close(got, elsewhere, **F32)


def _held(experts, first: int) -> SimpleNamespace:
    """Int4 experts first.. of a stack: what an expert-parallel rank holds."""
    zero = experts.zero[first:] if experts.zero is not None else None
    return SimpleNamespace(packed=experts.packed[first:], scale=experts.scale[first:], zero=zero)


# 17 tokens (the many-pairs launch shape) on one asymmetric and one per-channel scheme in the quick
# subset; the rest of that row is slow (the same shape, other group sizes: covered at 1 token).
INT4_REFERENCE_CASES = [(s, 1) for s in INT4_SCHEMES] + [
    (s, 17) if s in ("g8-asym", "channel-sym") else pytest.param(s, 17, marks=pytest.mark.slow) for s in INT4_SCHEMES
]


@pytest.mark.parametrize("scheme,tokens", INT4_REFERENCE_CASES)
def test_fused_int4_moe_equals_reference(scheme, tokens):
    """The int4 kernels match the reference loop to a float32 sum's order (8 and 136 pairs), and in
    the default launch shape for that pair count each tile is dequantized as the reference
    dequantizes the whole expert, so the result equals the float kernels run on the dequantized
    experts with the same launch shape."""
    moe = _moe("sigmoid-8of16", shared=False, seed=tokens, int4=scheme)
    assert (moe.w13.zero is None) == INT4_SCHEMES[scheme][1]
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    weights, ids = moe.route(x)
    want = moe.experts_ref(x, weights, ids)
    moe.to(DEV)
    args = (x.to(DEV), weights.to(DEV), ids.to(DEV))
    torch.testing.assert_close(fused_experts(*args, moe.w13, moe.w2, moe.first).cpu(), want, **F32)
    tiles = default_tiles(ids.numel(), int4=True)
    got = fused_experts(*args, moe.w13, moe.w2, moe.first, tiles=tiles).cpu()
    torch.testing.assert_close(got, want, **F32)
    as_float = fused_experts(*args, *moe.experts_weights(), moe.first, tiles=tiles).cpu()
    torch.testing.assert_close(got, as_float, rtol=0, atol=0)


def test_int4_experts_held_elsewhere_contribute_nothing():
    """With int4 experts 4..7 held here (expert parallelism), pairs routed to 0..3 add zero."""
    moe = _moe("sigmoid-2of8", shared=False, int4="g8-asym")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, HIDDEN, generator=g)
    ids = torch.tensor([[6, 1], [6, 2], [1, 6], [6, 5], [2, 6]])
    weights = torch.rand(5, 2, generator=g)
    want = moe.experts_ref(x, weights.masked_fill(ids < 4, 0.0), ids)
    moe.to(DEV)
    got = fused_experts(x.to(DEV), weights.to(DEV), ids.to(DEV), _held(moe.w13, 4), _held(moe.w2, 4), first=4)
    torch.testing.assert_close(got.cpu(), want, **F32)


# Launch shapes beyond the defaults, at a width of 64 (gate/up) and 32 (down) input columns:
# BLOCK_K 16 and 64 put a tile inside one group, across whole groups, or past the input's end;
# split_k 2 and 3 cut both kernels' inputs into slices (3: uneven ones); swap multiplies with the
# weight tile on the left; and the two int4 defaults.
WIDE = dict(hidden=64, inter=32)
TILE_VARIANTS = {
    "plain": Tiles(),
    "k16": Tiles(block_k=16),
    "n16": Tiles(block_n=16),
    "split2-k16": Tiles(block_k=16, split_k=2),
    "split3-k16": Tiles(block_k=16, split_k=3),
    "swap": Tiles(swap=True),
    "swap-split2-k16": Tiles(block_k=16, split_k=2, swap=True),
    "int4-few-pairs": INT4_FEW_TILES,
    "int4-many-pairs": INT4_TILES,
}
# (launch shape, experts): each shape with float experts or an int4 scheme, so that every shape
# runs int4 with and without zero points and every scheme's groups meet a tile inside one group
# and one across several (a full product of the two is slow in the interpreter and adds nothing)
LAUNCH_CASES = [
    ("plain", None),
    ("k16", None),
    ("split3-k16", None),
    ("swap-split2-k16", None),
    ("k16", "g4-sym"),
    ("k16", "g16-asym"),
    ("n16", "g8-asym"),
    ("n16", "channel-sym"),
    ("split2-k16", "g16-asym"),
    ("split3-k16", "g4-sym"),
    ("split3-k16", "channel-asym"),
    ("swap", "g8-asym"),
    ("swap-split2-k16", "channel-sym"),
    ("swap-split2-k16", "g4-sym"),
    ("int4-few-pairs", "g8-asym"),
    ("int4-many-pairs", "g16-asym"),
]


@pytest.mark.parametrize("tiles, int4", LAUNCH_CASES)
def test_fused_moe_launch_shapes_equal_reference(tiles, int4):
    """Every launch shape computes the same experts: float32 results match the reference loop to
    a float32 sum's order (the split slices' atomic sums are in any order)."""
    moe = _moe("sigmoid-8of16", shared=False, seed=2, int4=int4, **WIDE)
    x = torch.randn(3, WIDE["hidden"], generator=torch.Generator().manual_seed(11))
    weights, ids = moe.route(x)
    want = moe.experts_ref(x, weights, ids)
    moe.to(DEV)
    got = fused_experts(x.to(DEV), weights.to(DEV), ids.to(DEV), moe.w13, moe.w2, tiles=TILE_VARIANTS[tiles]).cpu()
    torch.testing.assert_close(got, want, **F32)


@pytest.mark.parametrize("tiles", ["k16", "split3-k16", "swap-split2-k16"])
def test_fused_int4_moe_launch_shapes_in_16_bit(tiles):
    """fp16 activations and scales: split slices round their float32 sums once, as the unsplit
    kernels do, so each launch shape stays within a few fp16 steps of the reference loop."""
    moe = _moe("softmax-8of16", shared=False, int4="g8-sym", **WIDE).to(DEV, torch.float16)
    x = torch.randn(3, WIDE["hidden"], generator=torch.Generator().manual_seed(7)).to(DEV, torch.float16)
    weights, ids = moe.route(x)
    want = moe.experts_ref(x, weights, ids).float()
    got = fused_experts(x, weights, ids, moe.w13, moe.w2, tiles=TILE_VARIANTS[tiles]).float()
    step = 2**-10
    torch.testing.assert_close(got, want, rtol=4 * step, atol=4 * step * want.abs().max().item())


@pytest.mark.parametrize("scheme", ["g4-sym", "g8-asym", "channel-asym"])
def test_int4_tiles_are_the_reference_dequantized_weights(scheme):
    """fp16 activations and scales: the kernels round each weight into fp16 as the reference
    does, so the int4 kernels equal the float kernels run on the reference's dequantized
    experts, with the same launch shape, bit for bit."""
    moe = _moe("softmax-8of16", shared=False, int4=scheme, **WIDE).to(DEV, torch.float16)
    x = torch.randn(3, WIDE["hidden"], generator=torch.Generator().manual_seed(4)).to(DEV, torch.float16)
    weights, ids = moe.route(x)
    tiles = TILE_VARIANTS["k16"]
    got = fused_experts(x, weights, ids, moe.w13, moe.w2, tiles=tiles)
    want = fused_experts(x, weights, ids, *moe.experts_weights(torch.float16), tiles=tiles)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@triton.jit
def _tile_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    ROWS: tl.constexpr,
    K: tl.constexpr,
    GROUPS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (n, k): the int4 weight tile the expert kernels multiply, stored into out [ROWS, K].
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    nmask = rows < ROWS
    tile = _weight_tile(
        w_ptr,
        s_ptr,
        z_ptr,
        tl.zeros([], tl.int64),
        rows,
        nmask,
        k0,
        cols,
        ROWS,
        K,
        GROUPS,
        True,
        HAS_ZERO,
        False,
        0,
        out_ptr.dtype.element_ty,
        BLOCK_N,
        BLOCK_K,
    )
    tl.store(out_ptr + rows[None, :] * K + cols[:, None], tile, mask=(cols < K)[:, None] & nmask[None, :])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                DEV == "cpu", reason="Triton's interpreter stores bf16 as uint16 and does integer arithmetic on it"
            ),
        ),
    ],
)
@pytest.mark.parametrize(
    "group, symmetric, K", [(32, True, 256), (128, False, 256), (None, False, 256), (24, False, 96)]
)
def test_int4_weight_tile_is_the_reference_dequantized_weight(dtype, group, symmetric, K):
    """The dequantization by the activations' bits (2^m + nibble, then minus 2^m + 8 + zero)
    gives each dtype the reference's weight bit for bit: groups of 32 span a 64-column tile
    twice, groups of 128 and whole rows hold a tile inside one group, groups of 24 take the
    per-element scales (and the last tile runs past K); 24 rows leave the second row block half
    empty."""
    rows = 24
    w = torch.randn(rows, K, generator=torch.Generator().manual_seed(K + (group or 0)))
    q, scale, zero = quantize_int4(w, group, symmetric)
    assert (zero is None) == symmetric
    packed, scale = pack_int4(q).to(DEV), scale.to(DEV, dtype)
    zero = zero.to(DEV) if zero is not None else None
    out = torch.full((rows, K), float("nan"), dtype=dtype, device=DEV)
    _tile_kernel[(triton.cdiv(rows, 16), triton.cdiv(K, 64))](
        packed,
        scale,
        zero if zero is not None else scale,
        out,
        ROWS=rows,
        K=K,
        GROUPS=scale.shape[-1],
        HAS_ZERO=zero is not None,
        BLOCK_N=16,
        BLOCK_K=64,
    )
    torch.testing.assert_close(out, dequantize_int4(packed, scale, zero, dtype), rtol=0, atol=0)


def test_int4_default_tiles_follow_the_pair_count():
    """Float experts keep one shape; int4 ones take the few-pairs shape up to INT4_FEW_PAIRS pairs."""
    assert default_tiles(1, int4=False) == default_tiles(500, int4=False) == Tiles()
    assert default_tiles(1, int4=True) == default_tiles(INT4_FEW_PAIRS, int4=True) == INT4_FEW_TILES
    assert default_tiles(INT4_FEW_PAIRS + 1, int4=True) == INT4_TILES
    assert INT4_FEW_TILES.split_k > 1 and INT4_FEW_TILES.swap and INT4_TILES.swap


@pytest.mark.parametrize("tiles", [None, "split3-k16"])
@pytest.mark.parametrize("tokens, top_k", [(1, 1), (1, 8), (5, 8)])
def test_fused_int4_moe_pair_counts(tokens, top_k, tiles):
    """1, 8 and 40 (token, expert) pairs over 16 experts (most of them, or some, without one), by
    the default launch shape for that many (a split one with the weight tile on the left up to
    INT4_FEW_PAIRS, an unsplit one past it) and by an unswapped split one: the reference's
    result to a float32 sum's order."""
    moe = _moe("sigmoid-8of16", shared=False, seed=6, int4="g8-asym", **WIDE)
    g = torch.Generator().manual_seed(tokens * top_k)
    x = torch.randn(tokens, WIDE["hidden"], generator=g)
    ids = torch.stack([torch.randperm(16, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    want = moe.experts_ref(x, weights, ids)
    moe.to(DEV)
    got = fused_experts(
        x.to(DEV), weights.to(DEV), ids.to(DEV), moe.w13, moe.w2, tiles=TILE_VARIANTS[tiles] if tiles else None
    ).cpu()
    torch.testing.assert_close(got, want, **F32)


@pytest.mark.parametrize(
    "bad, message",
    [(dict(split_k=0), "Tiles.split_k must be >= 1"), (dict(block_k=48), "Tiles.block_k must be a power of two")],
)
def test_tiles_reject_unknown_options(bad, message):
    with pytest.raises(ValueError, match=message):
        Tiles(**bad)


# float experts and two int4 schemes, for the tests every kind of expert runs
KINDS = [None, "g8-sym", "channel-asym"]


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                DEV == "cpu", reason="Triton's interpreter multiplies bf16 tiles wrongly (tl.dot); checked on the GPU"
            ),
        ),
    ],
)
@pytest.mark.parametrize("int4", KINDS)
def test_fused_moe_in_16_bit(dtype, int4):
    """To within a few 16-bit steps of the reference loop run in that dtype on the same device and
    routing (a router in 16 bits may break near-ties differently on another device): the
    reference adds a token's top_k contributions one at a time in the dtype, the kernel sums them
    in float32. int4 experts' scales are in that dtype too."""
    moe = _moe("softmax-8of16", shared=False, int4=int4).to(DEV, dtype)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
    weights, ids = moe.route(x)
    want = moe.experts_ref(x, weights, ids).float()
    got = fused_experts(x, weights, ids, moe.w13, moe.w2).float()
    step = 2**-7 if dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got, want, rtol=4 * step, atol=4 * step * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("int4", KINDS)
def test_moe_forward_takes_the_fused_path_on_cuda(monkeypatch, int4):
    moe = _moe("sigmoid-8of16", int4=int4).to("cuda")
    assert moe.graph_safe and not _moe("sigmoid-8of16", int4=int4).graph_safe
    monkeypatch.setattr(MoE, "experts_ref", lambda *a: pytest.fail("the reference loop ran on CUDA"))
    x = torch.randn(4, HIDDEN, device="cuda")
    with torch.inference_mode():
        assert moe(x).shape == x.shape


@pytest.mark.gpu
def test_fused_moe_kernels_compile_once_for_every_pair_count():
    """Token counts of both parities (pair counts that are and are not multiples of 16) take one compiled
    variant of each expert kernel and of the alignment: a prefill chunk of a new length compiles nothing
    mid-run."""
    from specserve.kernels.moe import _down_kernel, _gate_up_kernel
    from specserve.kernels.moe_routing import _align_kernel

    def compiled(fn) -> int:
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps no per-device kernel caches to count")
        return sum(len(c[0]) for c in caches.values())

    moe = _moe("softmax-8of16").to("cuda", torch.bfloat16)
    kernels = (_gate_up_kernel, _down_kernel, _align_kernel)
    with torch.inference_mode():
        moe(torch.randn(6, HIDDEN, device="cuda", dtype=torch.bfloat16))  # 48 pairs
        before = [compiled(k) for k in kernels]
        for tokens in (5, 7):  # 40 and 56 pairs: the same blocks of rows and padded sizes, not multiples of 16
            moe(torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16))
    assert [compiled(k) for k in kernels] == before


@pytest.mark.gpu
@pytest.mark.parametrize("int4", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing(int4, dtype):
    """Captured once, the MoE forward (routing, alignment, both kernels) follows new inputs and
    their new routing on every replay: it equals the reference loop on the same device and dtype,
    routed alike."""
    moe = _moe("sigmoid-8of16", int4=int4).to("cuda", dtype)
    x = torch.randn(17, HIDDEN, device="cuda", dtype=dtype)
    with torch.inference_mode():
        moe(x)  # compiles the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x)
        for seed in range(3):
            x.copy_(torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            want = (moe.experts_ref(x, *moe.route(x)) + moe.shared(x)).float()
            if dtype == torch.float32:
                torch.testing.assert_close(out, want, **F32)
            else:  # a few bf16 steps, as test_fused_moe_in_16_bit
                torch.testing.assert_close(out.float(), want, rtol=4 * 2**-7, atol=4 * 2**-7 * want.abs().max().item())


def test_tiled_int4_experts_round_trip_and_dequantize_as_stored():
    """`tile_experts` puts each 16-row x 128-feature tile of an expert in one run (gate/up: 8 gate rows,
    then the same up rows), `untile_experts` gives the stored words and scales back, and tiled
    `Int4Experts` dequantize to the weights they held before."""
    g = torch.Generator().manual_seed(3)
    E, I, H = 3, 32, 256
    packed = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, generator=g)
    scale = torch.rand(E, 2 * I, H // 32, generator=g)
    words, scales = tile_experts(packed, scale, interleave=I)
    assert words.shape == packed.shape and scales.shape == scale.shape
    tiles = words.view(E, 2 * I // 16, H // 128, 16, 16)  # [expert, tile, chunk, row, word]
    assert torch.equal(tiles[2, 3, 1, 5], packed[2, 3 * 8 + 5, 16:32])  # gate row 29
    assert torch.equal(tiles[2, 3, 1, 13], packed[2, I + 3 * 8 + 5, 16:32])  # up row 29
    assert torch.equal(scales.view(E, 2 * I // 16, H // 32, 16)[1, 2, 6, 9], scale[1, I + 2 * 8 + 1, 6])
    for interleave in (I, 0):
        back = untile_experts(*tile_experts(packed, scale, interleave), interleave)
        assert torch.equal(back[0], packed) and torch.equal(back[1], scale)
    with pytest.raises(ValueError, match="do not tile"):
        tile_experts(packed[:, :, :8], scale, 0)
    moe = _moe("softmax-8of16", shared=False, int4="g8-sym", hidden=128, inter=128)
    before = moe.experts_weights()
    want = tile_experts(moe.w13.packed, moe.w13.scale, interleave=128)
    moe.w13.tile()
    moe.w2.tile()
    assert moe.w13.tiled and torch.equal(moe.w13.packed, want[0]) and torch.equal(moe.w13.scale, want[1])
    for a, b in zip(moe.experts_weights(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [1, 9])
def test_fused_int4_moe_on_tiled_experts_equals_the_stored_order(tokens):
    """The Triton expert kernels read tiled int4 experts (their gate/up rows interleaved by eights)
    as they read the stored order: the same result bit for bit, with and without split slices."""
    moe = _moe("softmax-8of16", shared=False, int4="g8-sym", hidden=128, inter=128, seed=tokens)
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens))
    weights, ids = moe.route(x)
    moe.to(DEV)
    args = (x.to(DEV), weights.to(DEV), ids.to(DEV))
    want = {t: fused_experts(*args, moe.w13, moe.w2, tiles=TILE_VARIANTS[t]).cpu() for t in ("k16", "split3-k16")}
    moe.w13.tile()
    moe.w2.tile()
    for t, w in want.items():
        torch.testing.assert_close(
            fused_experts(*args, moe.w13, moe.w2, tiles=TILE_VARIANTS[t]).cpu(), w, rtol=0, atol=0
        )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 16])
def test_int4_default_tiles_equal_reference_at_kimi_width(tokens):
    """Kimi-K2.5's expert widths (hidden 7168, expert intermediate 2048, int4 in symmetric groups
    of 32; 16 experts, 8 a token: the launch shapes depend on the widths and the pair count, not
    the expert count), bf16, experts tiled as loading tiles them: the default path for 8 to 128 pairs
    (the CUDA kernels up to 64) and both Triton int4 launch shapes are within a few bf16 steps of the
    reference loop."""
    m = MoEConfig(
        num_experts=16,
        top_k=8,
        intermediate_size=2048,
        scoring="softmax",
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        shared_intermediate_size=0,
        dense_layers=(),
    )
    quant = QuantConfig(groups=((("Linear",), Int4Weights(32, True)),), ignore=())
    with torch.device("cuda"):
        moe = MoE(7168, m, quant=quant, prefix="model.layers.1.mlp.").to(torch.bfloat16).requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    for w in (moe.w13, moe.w2):
        w.packed.copy_(torch.randint(-(2**31), 2**31, w.packed.shape, dtype=torch.int32, device="cuda", generator=g))
        w.scale.copy_(torch.rand(w.scale.shape, device="cuda", generator=g) * 0.002 + 0.002)
    moe.gate.copy_(torch.randn(moe.gate.shape, device="cuda", generator=g))
    moe.weights_loaded()
    assert moe.w13.tiled and moe.w2.tiled  # (so 8-64 pairs take the CUDA kernels)
    x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.inference_mode():
        weights, ids = moe.route(x)
        want = moe.experts_ref(x, weights, ids).float()
        default = default_tiles(ids.numel(), int4=True)
        other = INT4_TILES if default == INT4_FEW_TILES else INT4_FEW_TILES
        for tiles in (None, default, other):
            got = fused_experts(x, weights, ids, moe.w13, moe.w2, tiles=tiles).float()
            step = 2**-7
            torch.testing.assert_close(
                got,
                want,
                rtol=4 * step,
                atol=4 * step * want.abs().max().item(),
                msg=lambda m: f"{tiles or default}: {m}",
            )


@pytest.mark.parametrize("split", [False, True])
def test_combine_sums_held_rows_only(split):
    """The last step of fused_experts: a token's rows summed in float32 and rounded once; rows of
    pairs held elsewhere (never written, here NaN) are skipped; split sums are rounded to the
    dtype and scaled by their routing weight first; an added tensor (the shared experts') joins
    the rounded sum as `+` would."""
    N, k, H, first, E = 3, 4, COMBINE_BLOCK + 40, 4, 4  # (two column blocks, the second partial)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 8, (N, k), generator=g)
    held = (ids >= first) & (ids < first + E)
    rows = torch.randn(N * k, H, generator=g).to(torch.float32 if split else torch.float16)
    rows[~held.reshape(-1)] = float("nan")
    rw = torch.rand(N, k, generator=g).half()
    parts = (rows.half().float() * rw.reshape(-1, 1).float()).half() if split else rows
    want = parts.float().masked_fill(~held.reshape(-1, 1), 0.0).view(N, k, H).sum(1).half()
    got = torch.empty(N, H, dtype=torch.float16)
    add = torch.randn(N, H, generator=g).half()
    args = [t.to(DEV) for t in (rows, rw, ids, add, got)]
    for added in (False, True):
        _combine_kernel[(N, triton.cdiv(H, COMBINE_BLOCK))](
            *args, first, E, H=H, TOP_K=k, SPLIT=split, ADD=added, BLOCK=COMBINE_BLOCK, PDL=False
        )
        assert torch.equal(args[4].cpu(), want + add if added else want), added


# Routers at real widths and tiny ones: (experts, top_k, groups, groups kept, scaling, scoring, normalised)
ROUTERS = {
    "deepseek-v3": (256, 8, 8, 4, 2.5, "sigmoid", True),
    "kimi-k2.5": (384, 8, 1, 1, 2.827, "sigmoid", True),
    "qwen3-moe": (128, 8, 1, 1, 1.0, "softmax", True),
    "qwen3-moe-raw": (128, 8, 1, 1, 1.0, "softmax", False),
    "tiny-sigmoid": (8, 2, 4, 2, 1.0, "sigmoid", False),
    "tiny-softmax": (8, 2, 1, 1, 1.0, "softmax", True),
}


def _router(name: str) -> MoEConfig:
    E, k, groups, kept, scaling, scoring, norm = ROUTERS[name]
    return MoEConfig(
        num_experts=E,
        top_k=k,
        intermediate_size=16,
        scoring=scoring,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
        n_group=groups,
        topk_group=kept,
        shared_intermediate_size=0,
        dense_layers=(),
    )


def _torch_route(logits, m, bias):
    return route_grouped_sigmoid(logits, bias, m) if m.scoring == "sigmoid" else route_softmax(logits, m)


def _near_tie(logits, m, bias, steps: int = 4) -> bool:
    """Whether torch's k-th and (k+1)-th choice values for one token's logits [E] lie within
    `steps` steps of the logits' dtype (scaled to the values)."""
    if m.scoring == "sigmoid":
        choice = logits.sigmoid().float() + bias
    else:
        choice = logits.softmax(-1, dtype=torch.float32)
    v = choice.sort(descending=True).values
    return (v[m.top_k - 1] - v[m.top_k]).item() <= steps * torch.finfo(logits.dtype).eps * max(
        v[m.top_k - 1].abs().item(), 1.0
    )


def _random_router(name: str, tokens: int, dtype=torch.float32, device=DEV, seed=0):
    """(config, logits [tokens, E] in dtype, float32 selection bias or None) without ties: in
    16 bits each row is a shuffle of distinct multiples of 1/16 (exact in bfloat16 up to 256)."""
    m = _router(name)
    g = torch.Generator().manual_seed(seed + tokens)
    E = m.num_experts
    if dtype == torch.float32:
        logits = torch.randn(tokens, E, generator=g) * 2
    else:
        logits = torch.stack([torch.randperm(E, generator=g) - E // 2 for _ in range(tokens)]) / 16
    logits = logits.to(device, dtype)
    bias = (torch.randn(m.num_experts, generator=g) * 0.5).to(device) if m.scoring == "sigmoid" else None
    return m, logits, bias


# (64 tokens, the bound, on the real widths only: the interpreter runs a program a token)
@pytest.mark.parametrize(
    "router,tokens", [(r, n) for r in ROUTERS for n in (1, 3, 17, 64) if n < 64 or not r.startswith("tiny")]
)
def test_fused_route_equals_torch_routing(router, tokens):
    """The same experts in the same order; weights within 4 float32 epsilons of their value (2 to
    4 ulps): the kernel sums the softmax's E exponentials and the k chosen weights in another
    order than torch, and its exp may differ from torch's in the last bit."""
    m, logits, bias = _random_router(router, tokens)
    want_w, want_ids = _torch_route(logits, m, bias)
    got_w, got_ids = fused_route(logits, m, bias)
    assert got_ids.dtype == want_ids.dtype and torch.equal(got_ids, want_ids)
    assert got_w.dtype == want_w.dtype
    torch.testing.assert_close(got_w, want_w, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                DEV == "cpu", reason="Triton's interpreter stores bf16 as uint16 and does integer arithmetic on it"
            ),
        ),
    ],
)
def test_router_logits_are_float32_products_of_each_row_alone(dtype):
    """A float32 router's logits of 1-8 tokens in one launch: the reference's float32 products and sums (to
    float32's summation order), E not a multiple of the expert block, H not a multiple of the feature step;
    and each row's bits do not depend on the rows beside it."""
    g = torch.Generator().manual_seed(9)
    E, H = 37, 700
    w = (torch.randn(E, H, generator=g) * 0.05).to(DEV)
    x = torch.randn(ROUTER_ROWS, H, generator=g).to(DEV, dtype)
    want = torch.nn.functional.linear(x.float(), w)
    for cfg in (None, (2, 256, 4, 1)):  # the chosen launch shape (one feature step here) and a smaller one
        full = router_logits_triton(x, w, cfg)
        assert full.dtype == torch.float32 and full.shape == (ROUTER_ROWS, E)
        torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)
        for n in (1, 3):
            assert torch.equal(router_logits_triton(x[:n], w, cfg), full[:n])


@pytest.mark.parametrize("router", ["deepseek-v3", "qwen3-moe"])
def test_fused_route_in_half_precision(router):
    """float16 logits (Qwen3-MoE routes in the model's dtype): the same experts, weights within a
    float16 step; the grouped sigmoid's choice is float32 (its bias is)."""
    m, logits, bias = _random_router(router, 5, torch.float16)
    want_w, want_ids = _torch_route(logits, m, bias)
    got_w, got_ids = fused_route(logits, m, bias)
    assert torch.equal(got_ids, want_ids) and got_w.dtype == torch.float16
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=2**-10, atol=0)


def test_fused_route_breaks_ties_by_the_lower_index():
    """Exact ties rank the lower index first: among groups (grouped sigmoid, strength the best two
    scores, a repeated best counting twice) and among experts."""
    m = _router("tiny-sigmoid")  # 8 experts in 4 groups of 2, 2 groups kept, 2 experts chosen
    # groups (0 1) (2 3) (4 5) (6 7): strengths 3+1, 3+3, 3+1, 3+3 -> groups 1 and 3 kept, experts 2, 3, 6, 7
    # tied at 3: the two lowest, 2 and 3
    logits = torch.tensor(
        [
            [3.0, 1.0, 3.0, 3.0, 3.0, 1.0, 3.0, 3.0],
            [0.0] * 8,  # all tied: groups 0 and 1, experts 0 and 1
            # strengths 3, 3, 4, 0: groups 2 and 0; experts 1, 4, 5 tied: 1 and 4
            [1.0, 2.0, 2.0, 1.0, 2.0, 2.0, 0.0, 0.0],
        ]
    )
    _, ids = fused_route(logits.to(DEV), m, torch.zeros(8, device=DEV))
    assert ids.tolist() == [[2, 3], [0, 1], [1, 4]]
    soft = _router("tiny-softmax")
    _, ids = fused_route(torch.tensor([[1.0, 5.0, 2.0, 5.0, 5.0, 0.0, 1.0, 2.0]], device=DEV), soft)
    assert ids.tolist() == [[1, 3]]


def test_fused_route_refuses_sizes_past_its_bound():
    m, logits, bias = _random_router("tiny-softmax", 65, device="cpu")
    with pytest.raises(ValueError, match="up to 64 tokens.*got 65 tokens"):
        fused_route(logits, m)
    with pytest.raises(ValueError, match="float32/float16/bfloat16 logits"):
        fused_route(logits[:2].double(), m)
    grouped, logits, bias = _random_router("tiny-sigmoid", 2, device="cpu")  # 2 kept groups of 2 experts
    with pytest.raises(ValueError, match=r"8 experts in 4 groups \(2 kept\) cannot route top_k 5"):
        fused_route(logits, dataclasses.replace(grouped, top_k=5), bias)


# (tokens, top_k, experts held, first held, global experts, block_m): one rank, expert-parallel
# slices (first, middle, last), a few experts with many pairs each, the 512-pair bound
ALIGNS = [
    (1, 8, 256, 0, 256, 16),
    (3, 2, 8, 0, 8, 16),
    (17, 8, 32, 64, 256, 16),
    (64, 8, 384, 0, 384, 16),
    (64, 8, 128, 128, 256, 32),
    (5, 2, 4, 4, 8, 32),
    (6, 4, 4, 0, 16, 16),
    (64, 8, 16, 0, 16, 64),
]


@pytest.mark.parametrize("tokens,top_k,experts,first,total,block_m", ALIGNS)
def test_fused_align_equals_align_pairs(tokens, top_k, experts, first, total, block_m):
    g = torch.Generator().manual_seed(tokens * total + first)
    ids = torch.stack([torch.randperm(total, generator=g)[:top_k] for _ in range(tokens)]).to(DEV)
    want = align_pairs(ids, experts, first, block_m)
    got = fused_align(ids, experts, first, block_m)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)


def test_fused_align_with_experts_repeated_within_tokens():
    """Ids drawn with repeats (a token naming one expert twice, most experts crowded): pairs keep
    their order within each expert, on one rank and on a slice."""
    ids = torch.randint(0, 8, (40, 8), generator=torch.Generator().manual_seed(2)).to(DEV)
    for experts, first, block_m in ((8, 0, 16), (3, 2, 32)):
        for a, b in zip(fused_align(ids, experts, first, block_m), align_pairs(ids, experts, first, block_m)):
            assert torch.equal(a, b), (experts, first)


@pytest.mark.parametrize("routing", ["sigmoid-8of16", "softmax-2of8"])
def test_moe_forward_fused_path_equals_torch_path(monkeypatch, routing):
    """MoE.forward as it runs on CUDA (fused routing, alignment and experts; here in the
    interpreter) equals its torch path (routing functions and the reference loop)."""
    moe = _moe(routing)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    want = moe(x)
    monkeypatch.setattr(moe_module, "use_triton", lambda *a: True)
    monkeypatch.setattr(moe_module, "fused_experts_supported", lambda *a: True)
    monkeypatch.setattr(MoE, "experts_ref", lambda *a: pytest.fail("the reference loop ran on the fused path"))
    monkeypatch.setattr(moe_module, "route_softmax", lambda *a: pytest.fail("torch routing ran on the fused path"))
    monkeypatch.setattr(moe_module, "route_grouped_sigmoid", lambda *a: pytest.fail("torch routing ran"))
    torch.testing.assert_close(moe(x), want, **F32)


@pytest.mark.gpu
@pytest.mark.parametrize("router", ["deepseek-v3", "kimi-k2.5", "qwen3-moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_route_and_align_equal_torch_on_cuda(router, dtype):
    """At real widths, compiled, for 1 to 64 tokens: the routing's experts and (within a few ulps
    of the dtype) weights equal the torch functions' on the same GPU, the alignment align_pairs'."""
    for tokens in (1, 2, 5, 8, 16, 33, 64):
        m, logits, bias = _random_router(router, tokens, dtype, "cuda")
        want_w, want_ids = _torch_route(logits, m, bias)
        got_w, got_ids = fused_route(logits, m, bias)
        same = (got_ids == want_ids).all(-1)
        # In bf16 the kernel's sigmoid may round a score one step from torch's: only a token whose
        # k-th and next choices lie within a few such steps may then pick differently.
        for t in (~same).nonzero().flatten().tolist():
            assert dtype != torch.float32 and _near_tie(logits[t], m, bias), (tokens, t)
        torch.testing.assert_close(got_w[same].float(), want_w[same].float(), rtol=8 * torch.finfo(dtype).eps, atol=0)
        for first, held in ((0, m.num_experts), (m.num_experts // 4, m.num_experts // 8)):
            block_m = 16 if tokens < 64 else 32
            for a, b in zip(fused_align(got_ids, held, first, block_m), align_pairs(got_ids, held, first, block_m)):
                assert torch.equal(a, b), (tokens, first)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,group,H", [(1, 32, 256), (3, 32, 256), (8, 32, 256), (3, 128, 256), (2, 32, 384)])
def test_cuda_int4_experts_equal_the_dequantized_reference(tokens, group, H):
    """bf16 tokens on symmetric int4 experts in groups of 32 (Kimi-K2.5's scheme) or 128 take the CUDA
    kernels up to CUDA_MAX_PAIRS pairs: 8, 24 and 64 pairs over 16 experts (some with several pairs) give
    the dequantized experts' result to bf16 rounding (hidden 384: three chunks of 128 features, split
    unevenly between a block's slices)."""
    from specserve.kernels.moe import CUDA_MAX_PAIRS, int4_cuda_experts, int4_cuda_fits, int4_cuda_layout_fits

    I, E, top_k = 256, 16, 8
    g = torch.Generator().manual_seed(tokens)
    stacks = []
    for rows, K in ((2 * I, H), (H, I)):
        q, scale, _ = quantize_int4(torch.randn(E, rows, K, generator=g) * 0.2, group, True)
        stacks.append(
            SimpleNamespace(packed=pack_int4(q).cuda(), scale=scale.to("cuda", torch.bfloat16), zero=None, tiled=False)
        )
    w13, w2 = stacks
    assert int4_cuda_layout_fits(w13, w2)
    t13, t2 = (
        SimpleNamespace(packed=p, scale=s, zero=None, tiled=True)
        for p, s in (tile_experts(w13.packed, w13.scale, I), tile_experts(w2.packed, w2.scale))
    )
    x = torch.randn(tokens, H, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)]).cuda()
    weights = torch.rand(tokens, top_k, generator=g).to("cuda", torch.bfloat16)
    assert tokens * top_k <= CUDA_MAX_PAIRS and int4_cuda_fits(x, t13, t2, tokens * top_k)
    assert not int4_cuda_fits(x.float(), t13, t2, tokens * top_k) and not int4_cuda_fits(x, w13, w2, tokens * top_k)

    def dequantized(w, e):
        return dequantize_int4(w.packed[e], w.scale[e], None, torch.bfloat16).double().cpu()

    want = torch.zeros(tokens, H, dtype=torch.float64)
    for t in range(tokens):
        for k in range(top_k):
            e = int(ids[t, k])
            gu = x[t].double().cpu() @ dequantized(w13, e).T
            want[t] += float(weights[t, k]) * ((torch.nn.functional.silu(gu[:I]) * gu[I:]) @ dequantized(w2, e).T)
    got = int4_cuda_experts(x, weights, ids, t13, t2).double().cpu()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert torch.equal(fused_experts(x, weights, ids, t13, t2).cpu(), got.to(torch.bfloat16).cpu())


def test_cuda_int4_kernels_fall_back_with_a_warning_when_they_cannot_be_built(monkeypatch, caplog):
    """Where NVRTC cannot build the CUDA int4 expert kernels, the Triton ones serve, and the log says why
    (and how to skip the attempt), once a process."""
    from specserve.kernels import moe as moe_kernels

    def broken(src, name, **kw):
        raise RuntimeError("CUDA error: NVRTC_ERROR_BUILTIN_OPERATION_FAILURE")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken, raising=False)
    moe_kernels._cuda_kernels.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="specserve.kernels"):
            assert moe_kernels._cuda_kernels(32) is None
            assert moe_kernels._cuda_kernels(32) is None
        warnings = [r.getMessage() for r in caplog.records if "CUDA int4 expert kernels" in r.getMessage()]
        assert len(warnings) == 1 and "NVRTC_ERROR" in warnings[0] and "SPECSERVE_INT4_MOE_CUDA=0" in warnings[0]
    finally:
        moe_kernels._cuda_kernels.cache_clear()
