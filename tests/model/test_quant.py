"""int4 (compressed-tensors pack-quantized) checkpoints: packing against the compressed-tensors
package, models against their dequantized float twins, speculation, refused schemes, `check`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.config import ConfigError, ModelConfig
from specserve.engine.sampling import SamplingParams
from specserve.kernels.int4 import (
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from specserve.model.int4_linear import Int4Linear
from specserve.model.layers import ColumnParallelLinear, RowParallelLinear
from specserve.model.loader import load_target
from specserve.model.quant import Int4Weights, parse_quantization_config

from tiny import (
    INT_PROMPTS,
    assert_logits_match,
    generate_greedy,
    make_drafter,
    make_int4_pair,
    make_target,
    with_cache,
)

CPU = torch.device("cpu")
# (group size, symmetric, ignore): the scheme, an asymmetric one with a `re:` ignore, per channel
SCHEMES = {
    "group32-sym": (32, True, ("lm_head",)),
    "group32-asym": (32, False, ("lm_head", "re:.*self_attn\\.o_proj$")),
    "channel-sym": (None, True, ("lm_head",)),
}


@pytest.fixture(scope="module", params=list(SCHEMES))
def int4_pair(request, tmp_path_factory):
    """(int4 checkpoint, its dequantized float32 twin, scheme name) of one tiny random Llama."""
    group, symmetric, ignore = SCHEMES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = make_target(root / "src", vocab=12, hidden=64, layers=3, heads=4, kv_heads=2)
    q, twin = make_int4_pair(src, root / "int4", root / "twin", group, symmetric, ignore)
    return q, twin, request.param


# --------------------------------------------------------------------- packing
def test_packing_matches_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(0)
    for shape in ((12, 64), (3, 16, 40), (13, 8)):  # a weight, stacked experts, rows not a multiple of 8
        q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
        for dim, packed_dim in ((-1, 1), (-2, 0)):
            if q.dim() == 3 and dim == -2:
                continue  # the package packs 3-D tensors along the last dimension only
            ours, theirs = pack_int4(q, dim=dim), helpers.pack_to_int32(q, 4, packed_dim=packed_dim)
            assert torch.equal(ours, theirs), (shape, dim)
            assert torch.equal(unpack_int4(theirs, q.shape[dim], dim=dim), q)


@pytest.mark.parametrize("group,symmetric", [(32, True), (32, False), (None, True), (None, False)])
def test_dequantize_matches_compressed_tensors(group, symmetric):
    """Our packed tensors, decompressed by the package's own pack-quantized compressor."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, scale, zero = quantize_int4(w, group, symmetric)
    state = {"weight_packed": pack_int4(q), "weight_scale": scale, "weight_shape": torch.tensor(w.shape)}
    if zero is not None:
        state["weight_zero_point"] = pack_int4(zero, dim=-2)
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy="group" if group else "channel", group_size=group
    )
    theirs = PackedQuantizationCompressor.decompress(state, QuantizationScheme(targets=["Linear"], weights=args))
    ours = dequantize_int4(state["weight_packed"], scale, zero)  # in the scales' dtype, as theirs
    assert torch.equal(ours, theirs["weight"])
    assert (ours.float() - w.float()).abs().max() < 0.2 * w.float().abs().max()  # and it is w, roughly


# ------------------------------------------------------------- W4A16 kernel
KERNEL_CASES = [  # (rows, N, K, group, symmetric, bias, config): in the default launch shape, one row, the dot
    # path, per channel, ragged blocks; then SmolLM2's K of 576 and 1536 cut into slices of whole
    # BLOCK_K steps, the last one short: one row, the tensor cores, fixed 16-row tiles
    (1, 24, 96, 32, True, False, None),
    (1, 40, 320, 32, False, True, None),
    (5, 72, 64, None, False, True, None),
    (17, 20, 272, 16, True, False, None),
    (64, 8, 32, None, True, True, None),
    (1, 24, 384, 128, False, False, None),
    (9, 40, 256, 128, False, True, None),
    (3, 16, 160, 32, False, False, None),
    (1, 16, 96, None, False, False, None),
    (1, 24, 576, 32, True, True, (16, 256, 4, 2)),
    (1, 40, 1536, 128, False, False, (16, 256, 4, 4)),
    (1, 20, 576, None, False, True, (32, 128, 4, 3)),
    (2, 24, 1536, 32, False, True, (32, 128, 4, 5)),
    (16, 40, 576, 128, True, False, (64, 128, 4, 4)),
    (64, 24, 1536, None, True, True, (32, 128, 4, 8)),
    (20, 72, 576, 32, True, False, (32, 128, 4, 3, 16)),
    (1, 16, 1536, 32, False, True, (64, 256, 4, 6, 16)),
]
BF16_ON_GPU = pytest.param(torch.bfloat16, marks=pytest.mark.gpu)  # (the interpreter stores bf16 as uint16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_ON_GPU])
@pytest.mark.parametrize(
    "case",
    KERNEL_CASES,
    ids=lambda c: "x".join(map(str, c[:3])) + f"-g{c[3]}-{'sym' if c[4] else 'asym'}" + (f"-{c[6]}" if c[6] else ""),
)
def test_int4_gemv_kernel_equals_the_reference(case, dtype):
    """The Triton W4A16 kernel (on CPU: Triton's interpreter) against `int4_linear`; where K is
    cut into slices, a second kernel adds up their float32 partials (and biases)."""
    pytest.importorskip("triton")
    from specserve.kernels.int4 import int4_gemv_triton, int4_linear, k_slices

    rows, N, K, group, symmetric, bias, cfg = case
    assert cfg is None or k_slices(K, cfg[1], cfg[3])[1] > 1  # (each given config does split)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(rows * N + K)
    q, scale, zero = quantize_int4(torch.randn(N, K, generator=g), group, symmetric)
    packed, scale = pack_int4(q).to(dev), scale.to(dev, dtype)
    zero = zero.to(dev) if zero is not None else None
    x = torch.randn(rows, K, generator=g).to(dev, dtype)
    b = torch.randn(N, generator=g).to(dev, dtype) if bias else None
    got, want = int4_gemv_triton(x, packed, scale, zero, b, cfg), int4_linear(x, packed, scale, zero, b)
    assert got.shape == want.shape and got.dtype == dtype
    # Only the order of the float32 sum differs (then, in float16, one rounding step at most).
    tol = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-7}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_ON_GPU])
@pytest.mark.parametrize(
    "group, symmetric, K", [(32, False, 320), (128, False, 384), (128, True, 256), (None, False, 96)]
)
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("cfg", [None, (16, 32, 4, 3)], ids=["default", "split"])
def test_int4_gemv_kernel_multiplies_the_reference_weight(cfg, rows, group, symmetric, K, dtype):
    """Rows of the identity pick columns of the kernel's weight out exactly (one product by 1, the
    rest by 0), so the weight it dequantizes is `dequantize_int4`'s bit for bit: one row (three
    launches) and the tensor-core path (the last 64 columns, whose tile runs past K), groups of
    32 and 128 spanning a tile or holding it, and per channel; 24 output features leave the
    last feature block part empty. Also with K in three slices of 32-column steps, one group
    per step or a part of one."""
    pytest.importorskip("triton")
    from specserve.kernels.int4 import int4_gemv_triton

    N = 24
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, scale, zero = quantize_int4(torch.randn(N, K, generator=torch.Generator().manual_seed(K)), group, symmetric)
    packed, scale = pack_int4(q).to(dev), scale.to(dev, dtype)
    zero = zero.to(dev) if zero is not None else None
    want = dequantize_int4(packed, scale, zero, dtype)
    picks = [[0], [K // 2 + 1], [K - 1]] if rows == 1 else [list(range(K - 64, K))]
    for cols in picks:
        x = torch.eye(K, dtype=dtype, device=dev)[cols]
        torch.testing.assert_close(int4_gemv_triton(x, packed, scale, zero, None, cfg), want[:, cols].T, rtol=0, atol=0)


def test_int4_k_slices_cover_k_once():
    """Slices of whole steps tile 0..K: none empty, the last one reaching K."""
    from specserve.kernels.int4 import k_slices

    for K, block_k, splits in (
        (576, 256, 2),
        (576, 128, 8),
        (1536, 128, 5),
        (7168, 256, 32),
        (96, 32, 7),
        (64, 256, 4),
    ):
        span, n = k_slices(K, block_k, splits)
        assert span % block_k == 0 and n <= splits and (n - 1) * span < K <= n * span, (K, block_k, splits)


@pytest.mark.parametrize("dtype", [torch.float16, BF16_ON_GPU])
def test_int4_gemv_fixed_row_tile_gives_each_row_the_same_result_at_any_row_count(dtype):
    """--batch-invariant's launch shape (16-row tiles, K slices fixed by the shape): row i of the
    product is bit-identical whether 1, 5 or 40 rows (three tiles) are multiplied."""
    pytest.importorskip("triton")
    from specserve.kernels.int4 import int4_gemv_triton, int4_linear, invariant_config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    q, scale, zero = quantize_int4(torch.randn(40, 576, generator=g), 32, False)
    packed, scale, zero = pack_int4(q).to(dev), scale.to(dev, dtype), zero.to(dev)
    x = torch.randn(40, 576, generator=g).to(dev, dtype)
    for cfg in (invariant_config(40, 576, torch.device(dev)), (32, 128, 4, 3, 16)):
        full = int4_gemv_triton(x, packed, scale, zero, None, cfg)
        want = int4_linear(x, packed, scale, zero).float()
        torch.testing.assert_close(full.float(), want, rtol=2e-2, atol=2e-2)
        for m in (1, 5):
            assert torch.equal(int4_gemv_triton(x[:m].contiguous(), packed, scale, zero, None, cfg), full[:m]), (cfg, m)


def test_int4_default_config_fills_the_gpu(monkeypatch):
    """Untuned, on a 132-SM GPU: one row of each issue-28 shape (Llama-3-8B, Kimi-K2.5) runs at
    least two programs per SM, or each K step in a program of its own where there are too few
    (a 576-feature weight is 9 output blocks of 64), and at any row
    count the float32 partials stay under a quarter of the int4 weight's bytes."""
    import specserve.kernels.int4 as k

    monkeypatch.setattr(k.common, "sm_count", lambda device: 132)
    shapes = [
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
        (1536, 7168),
        (576, 7168),
        (7168, 8192),
        (4096, 7168),
        (7168, 2048),
    ]
    for N, K in shapes:
        for rows in (1, 2, 16, 64):
            block_n, block_k, _, splits = k.default_config(N, K, rows, None)
            assert splits == k.k_slices(K, block_k, splits)[1], (N, K, rows)  # (as launched)
            assert splits * rows * N * 4 <= N * K // 2 // 4, (N, K, rows, splits)
            if rows == 1:
                assert -(-N // block_n) * splits >= 2 * 132 or splits == -(-K // block_k), (N, K, splits)


def test_int4_matmul_follows_the_tuned_config(monkeypatch):
    """`int4_matmul` launches the config `tune_int4` left on the packed words for the row
    bucket (r rows: the next tuned count up), and `default_config` where there is none."""
    pytest.importorskip("triton")
    import specserve.kernels.int4 as k

    calls = []
    monkeypatch.setattr(k, "use_triton", lambda *t: True)
    monkeypatch.setattr(k, "int4_gemv_triton", lambda *a: calls.append(a[5]) or torch.zeros(a[0].shape[0], 24))
    packed, scale = pack_int4(torch.zeros(24, 64, dtype=torch.int8)), torch.ones(24, 2)
    for rows in (1, 3, 40):
        k.int4_matmul(torch.randn(rows, 64), packed, scale)
    assert calls == [None, None, None]
    packed.int4_configs = {1: (16, 64, 4, 1), 4: (32, 32, 4, 2)}
    for rows in (1, 3, 4, 40):
        k.int4_matmul(torch.randn(rows, 64), packed, scale)
    assert calls[3:] == [(16, 64, 4, 1), (32, 32, 4, 2), (32, 32, 4, 2), None]


@pytest.mark.gpu
def test_int4_tuning_on_gpu():
    """`tune_int4` on CUDA: each row bucket up to max_rows' (8 for 6) holds a config that ran,
    the ones past it none; the tuned product equals the reference at every row count, replayed
    in a CUDA graph too (partials and all). Under `invariant` every bucket holds
    `invariant_config`, and a 40-row product gives its first rows the bits of a 1- and 5-row one."""
    from specserve.kernels.gemv import GEMV_ROWS
    from specserve.kernels.int4 import (
        int4_linear,
        int4_matmul,
        invariant_config,
        tune_int4,
    )

    dev, dt = torch.device("cuda"), torch.bfloat16
    layers = []
    for _ in range(2):
        q, scale, zero = quantize_int4(torch.randn(576, 1536, device=dev) * 0.05, 32, False)
        layers.append((pack_int4(q), scale.to(dt), zero))
    packed, scale, zero = layers[0]
    report = tune_int4(layers, max_rows=6)
    assert set(packed.int4_configs) == {1, 2, 4, 8} and layers[1][0].int4_configs is packed.int4_configs, report
    for rows in (1, 3, 8, 17, 64):
        x = torch.randn(rows, 1536, device=dev, dtype=dt)
        want = int4_linear(x, packed, scale, zero).float()
        torch.testing.assert_close(int4_matmul(x, packed, scale, zero).float(), want, rtol=2e-2, atol=2e-2)
        graph = torch.cuda.CUDAGraph()
        int4_matmul(x, packed, scale, zero)  # (compiled before the capture)
        with torch.cuda.graph(graph):
            y = int4_matmul(x, packed, scale, zero)
        graph.replay()
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
    tune_int4(layers, invariant=True)
    assert set(packed.int4_configs.values()) == {invariant_config(576, 1536, dev)}
    assert set(packed.int4_configs) == set(GEMV_ROWS)
    x = torch.randn(40, 1536, device=dev, dtype=dt)
    full = int4_matmul(x, packed, scale, zero)
    assert torch.equal(int4_matmul(x[:5], packed, scale, zero), full[:5])
    assert torch.equal(int4_matmul(x[:1], packed, scale, zero), full[:1])


def test_int4_linear_runs_the_kernel_for_decode_rows_only(monkeypatch):
    """Int4Linear's product goes through the kernel where Triton serves (forced here on the CPU,
    in the interpreter) for up to 64 rows; more rows run the dequantizing reference."""
    pytest.importorskip("triton")
    import specserve.kernels.int4 as k

    calls = []
    kernel = k.int4_gemv_triton
    monkeypatch.setattr(k, "use_triton", lambda *t: True)
    monkeypatch.setattr(k, "int4_gemv_triton", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    g = torch.Generator().manual_seed(5)
    layer = Int4Linear(64, [48], Int4Weights(group_size=32, symmetric=False), "column", bias=True)
    q, scale, zero = quantize_int4(torch.randn(48, 64, generator=g), 32, symmetric=False)
    layer.weight_packed.copy_(pack_int4(q))
    layer.weight_scale.copy_(scale)
    layer.weight_zero_point.copy_(zero)
    layer.bias.data.normal_(generator=g)
    for shape in ((2, 3, 64), (1, 65, 64)):
        x = torch.randn(*shape, generator=g)
        want = k.int4_linear(x, layer.weight_packed, layer.weight_scale, layer.weight_zero_point, layer.bias)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert calls == [6]  # the 65-row product did not launch it


# ---------------------------------------------------------------- the models
@torch.inference_mode()
def test_int4_checkpoint_loads_packed_and_equals_its_twin(int4_pair):
    q, twin, scheme = int4_pair
    ours, ref = (
        with_cache(load_target(q, CPU, torch.float32, 64)),
        with_cache(load_target(twin, CPU, torch.float32, 64)),
    )
    layer = ours.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and isinstance(layer.mlp.down_proj, Int4Linear)
    assert isinstance(ours.lm_head, ColumnParallelLinear)  # ignored: stays float
    o_proj = RowParallelLinear if scheme == "group32-asym" else Int4Linear  # the `re:` ignore
    assert isinstance(layer.self_attn.o_proj, o_proj)
    # Kept packed: 1/8 of the weight's elements as int32 words, no float copy.
    gate_up = layer.mlp.gate_up_proj
    assert gate_up.weight_packed.dtype == torch.int32 and gate_up.weight_packed.shape == (256, 8)
    assert not any(p.dim() == 2 and p.shape == (256, 64) for p in ours.parameters())
    assert_logits_match(ours, ref, 11)


@pytest.mark.slow
def test_int4_greedy_equals_twin_and_speculation_is_lossless(int4_pair, tmp_path):
    q, twin, _ = int4_pair
    base, _ = generate_greedy(q, INT_PROMPTS)
    assert base == generate_greedy(twin, INT_PROMPTS)[0]
    draft = make_drafter(tmp_path / "draft", q, draft_vocab=8)
    accepted = 0
    for K in (1, 3):
        out, engine = generate_greedy(q, INT_PROMPTS, draft, spec_steps=K)
        assert out == base, f"K={K}"
        accepted += engine.totals.accepted
    assert accepted > 0  # drafts were really accepted, not only rejected


def test_int4_shards_add_up_to_the_whole_product(monkeypatch):
    """Under TP 2, the column shards' outputs side by side and the row shards' partial sums
    are the unsplit layer's product (stacked shards, zero points, biases and all)."""
    import specserve.model.int4_linear as mod

    g = torch.Generator().manual_seed(4)
    fmt = Int4Weights(group_size=32, symmetric=False)
    sizes, K = [64, 32, 32], 128
    ckpt = []
    for n in sizes:
        q, scale, zero = quantize_int4(torch.randn(n, K, generator=g), 32, symmetric=False)
        ckpt.append(
            {
                "weight_packed": pack_int4(q),
                "weight_scale": scale,
                "weight_zero_point": pack_int4(zero, dim=-2),
                "weight_shape": torch.tensor([n, K]),
                "bias": torch.randn(n, generator=g),
            }
        )

    def build(split, tp, rank):
        monkeypatch.setattr(mod, "tp_size", lambda: tp)
        monkeypatch.setattr(mod, "tp_rank", lambda: rank)
        shards = sizes if split == "column" else sizes[:1]
        m = Int4Linear(K, shards, fmt, split, bias=True)
        for shard, tensors in enumerate(ckpt[: len(shards)]):
            for name, (t, s) in m.hf_tensors("x", shard).items():
                t.weight_loader(t, tensors[name[2:]], s)
        return m

    x = torch.randn(3, K, generator=g)
    monkeypatch.setattr(mod, "all_reduce", lambda y: y)
    whole = build("column", 1, 0)(x)
    parts = [build("column", 2, r)(x) for r in (0, 1)]  # each rank: its half of q, of k and of v
    halves = [torch.cat([p.split([32, 16, 16], -1)[i] for p in parts], -1) for i in range(3)]
    torch.testing.assert_close(torch.cat(halves, -1), whole)
    whole = build("row", 1, 0)(x)
    rows = [build("row", 2, r) for r in (0, 1)]
    partial = sum(m(x[:, r * 64 : (r + 1) * 64]) - m.bias for r, m in enumerate(rows))
    torch.testing.assert_close(partial + rows[0].bias, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tp2_int4_equals_tp1(tmp_path):
    import shutil

    from specserve.config import DEMO_DIR
    from specserve.distributed.tp_llm import TPLLM
    from specserve.engine.llm import LLM

    src = make_target(tmp_path / "src", vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2)
    q, _ = make_int4_pair(src, tmp_path / "int4", tmp_path / "twin", 32, False)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # TPLLM needs one
        shutil.copy(DEMO_DIR / f, q / f)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = dict(device="cpu", max_num_seqs=4, max_model_len=96)
    ref = LLM(model=str(q), **engine).generate(INT_PROMPTS, greedy)
    with TPLLM(model=str(q), tp=2, **engine) as llm:
        out = llm.generate(INT_PROMPTS, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


@pytest.mark.gpu
def test_int4_on_gpu_equals_twin_and_speculation_is_lossless(int4_pair, tmp_path):
    """bf16 on the GPU: the reference product's dequantized weights are the twin's bf16 weights
    exactly; greedy speculation with CUDA graphs equals plain decoding on the int4 target."""
    q, twin, _ = int4_pair
    cuda = torch.device("cuda")
    ours, ref = load_target(q, cuda, torch.bfloat16, 64), load_target(twin, cuda, torch.bfloat16, 64)
    for (name, m), (_, r) in zip(ours.named_modules(), ref.named_modules()):
        if isinstance(m, Int4Linear):
            assert torch.equal(dequantize_int4(m.weight_packed, m.weight_scale, m.weight_zero_point), r.weight), name
    base, _ = generate_greedy(q, INT_PROMPTS, device="cuda")
    draft = make_drafter(tmp_path / "draft", q, draft_vocab=8)
    out, engine = generate_greedy(q, INT_PROMPTS, draft, spec_steps=3, device="cuda")
    assert out == base and engine.totals.cycles > 0


def test_transformers_reads_our_checkpoint_as_we_do(tmp_path):
    """transformers (through compressed-tensors) decompresses our checkpoint to our dequantized weights."""
    pytest.importorskip("compressed_tensors")
    import transformers

    src = make_target(tmp_path / "src", vocab=12, hidden=64, layers=1)
    q, _ = make_int4_pair(src, tmp_path / "int4", tmp_path / "twin", 32, False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        q, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    ours = load_target(q, CPU, torch.bfloat16, 64)  # bf16: the dequantization rounds as theirs does
    mlp, hf_mlp = ours.layers[0].mlp, hf.model.layers[0].mlp
    w = dequantize_int4(
        mlp.gate_up_proj.weight_packed, mlp.gate_up_proj.weight_scale, mlp.gate_up_proj.weight_zero_point
    )
    torch.testing.assert_close(w.float(), torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]), rtol=0, atol=0)
    d = mlp.down_proj
    torch.testing.assert_close(
        dequantize_int4(d.weight_packed, d.weight_scale, d.weight_zero_point).float(),
        hf_mlp.down_proj.weight,
        rtol=0,
        atol=0,
    )


# ------------------------------------------------------------------- refusals
BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 16,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
}
INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}


def _ct(weights=INT4, fmt="pack-quantized", **group):
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, **group}},
        "ignore": ["lm_head"],
    }


@pytest.mark.parametrize(
    "quant,named",
    [
        ({"quant_method": "fp8", "fmt": "e4m3"}, "quant_method 'fp8', format 'e4m3'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "quant_method 'awq', bits 4, format 'gemm'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq', bits 4"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        (_ct({**INT4, "type": "float", "num_bits": 8}, fmt="float-quantized"), "format 'float-quantized' (float 8-bit"),
        (_ct({**INT4, "num_bits": 8}, fmt="naive-quantized"), "format 'naive-quantized' (int 8-bit"),
        (_ct(fmt="marlin-24"), "format 'marlin-24'"),
        (_ct({**INT4, "num_bits": 8}), "int 8-bit weights"),
        (_ct(input_activations={"num_bits": 8, "type": "int"}), "activation quantization"),
        (_ct({**INT4, "strategy": "block"}), "strategy 'block'"),
        (_ct({**INT4, "group_size": 20}), "group size 20"),
        (_ct({**INT4, "actorder": "group"}), "actorder 'group'"),
        (_ct({**INT4, "actorder": "dynamic"}), "actorder 'dynamic'"),
        (_ct(targets=None), "targets None"),
        (
            {**_ct(), "sparsity_config": {"format": "sparse-24-bitmask"}},
            "sparse compression (sparsity_config 'sparse-24-bitmask')",
        ),
        ({**_ct(), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "quantized KV cache"),
    ],
)
def test_unsupported_schemes_are_named(quant, named):
    with pytest.raises(ConfigError, match="is not supported") as e:
        ModelConfig.from_hf_dict({**BASE, "quantization_config": quant})
    assert named in str(e.value)


def test_static_activation_order_loads_as_plain_groups():
    """actorder "static" ("weight") only changed the calibration order: no permutation is stored."""
    cfg = ModelConfig.from_hf_dict({**BASE, "quantization_config": _ct({**INT4, "actorder": "static"})})
    assert cfg.quant.linear("model.layers.0.mlp.up_proj") == Int4Weights(group_size=32, symmetric=True)


def test_targets_and_ignore_match_as_compressed_tensors_does():
    match = pytest.importorskip("compressed_tensors.utils.match")
    ignore = ["lm_head", "re:.*self_attn.*", "re:model\\.layers\\.1\\..*", "model.layers.2.mlp.up_proj"]
    cfg = parse_quantization_config({**_ct(), "ignore": ignore}, "config.json")
    names = [
        "lm_head",
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.2.mlp.up_proj",
        "model.layers.2.mlp.gate_proj",
        "model.layers.12.mlp.up_proj",
    ]
    for n in names:
        ignored = any(match.match_name(n, p) for p in ignore)
        assert (cfg.linear(n) is None) == ignored, n
    assert cfg.linear("model.layers.0.mlp.down_proj") == Int4Weights(group_size=32, symmetric=True)


def test_fused_projections_must_be_quantized_alike():
    from specserve.model.transformer import CausalLM

    cfg = ModelConfig.from_hf_dict({**BASE, "quantization_config": {**_ct(), "ignore": ["lm_head", "re:.*k_proj"]}})
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn: q_proj int4 group 32, symmetric, k_proj float"):
        CausalLM(cfg, 16)


def test_bad_int4_tensors_are_named(tmp_path):
    src = make_target(tmp_path / "src", vocab=12, hidden=64, layers=1)
    q, _ = make_int4_pair(src, tmp_path / "int4", tmp_path / "twin")
    path = q / "model.safetensors"
    good = load_file(path)
    name = "model.layers.0.mlp.down_proj"
    cases = [
        ({f"{name}.weight_shape": torch.tensor([64, 64])}, r"weight_shape' does not fit: weight_shape is \[64, 64\]"),
        ({f"{name}.weight_packed": good[f"{name}.weight_packed"].to(torch.int64)}, "packed int4 tensors are int32"),
        (
            {f"{name}.weight_scale": good[f"{name}.weight_scale"][:, :2].contiguous()},
            r"weight_scale' does not fit: expected shape",
        ),
        ({f"{name}.weight_scale": None}, rf"missing tensor\(s\): {name}.weight_scale"),
    ]
    for change, message in cases:
        t = {k: v for k, v in {**good, **change}.items() if v is not None}
        save_file(t, path)
        with pytest.raises(ConfigError, match=message):
            load_target(q, CPU, torch.float32, 64)


# ---------------------------------------------------------------------- check
def test_check_counts_int4_bytes_and_scales(tmp_path, capsys):
    from specserve.ops.check import run_checks

    src = make_target(tmp_path / "src", vocab=12, hidden=64, layers=2)
    q, twin = make_int4_pair(src, tmp_path / "int4", tmp_path / "twin")
    found = {x.code: x for x in run_checks(model=str(q), device="cpu")}
    assert not [x for x in found.values() if x.level == "error" and x.code != "target_tokenizer"], found
    est, est_twin = (
        found["memory_estimate"].data["weights"],
        {x.code: x for x in run_checks(model=str(twin), device="cpu")}["memory_estimate"].data["weights"],
    )
    tensors = load_file(q / "model.safetensors")
    packed = sum(t.numel() * 4 for n, t in tensors.items() if n.endswith("weight_packed"))
    scales = sum(t.numel() * 4 for n, t in tensors.items() if n.endswith("weight_scale"))  # float32 on the CPU
    floats = sum(
        t.numel() * 4
        for n, t in tensors.items()
        if n.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight"))
    )
    shapes = sum(t.numel() * 8 for n, t in tensors.items() if n.endswith("weight_shape"))
    assert est == packed + scales + floats + shapes
    assert est < est_twin
    assert "int4" in found["target_weights"].message
