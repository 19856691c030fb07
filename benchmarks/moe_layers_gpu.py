"""Per-layer decode cost of DeepSeek-V3 / Kimi-K2.5 MoE layers at full width on one GPU.

    python benchmarks/moe_layers_gpu.py --shape kimi-k2.5 --experts int4 --moe-layers 10 [--hf] [--out DIR]

Builds the target at full width and reduced depth (one dense layer, then --moe-layers MoE layers,
the embedding and the head) with random weights made on the GPU (no checkpoint is written: a
Kimi-K2.5 MoE layer is 34 GB in bf16), plus a random EAGLE-3 drafter so the engine captures its
verify graphs, and measures with CUDA-graph replays at context --context:
  - decode step time at each batch size, for the full model and for one with a single MoE layer:
    their difference over the extra layers is one MoE layer's time;
  - that layer's weight-bytes roofline: attention, router, shared expert and the distinct routed
    experts the batch touched (counted from the routing of the same inputs), plus its latent-cache
    reads, over the device's measured copy bandwidth;
  - verify(K+1) / decode at batch 1 for K = 1..5, with the distinct experts a verify touches (the
    bytes-based limit of that ratio);
  - prefill of one 512-token prompt and of 8 x 64 tokens in one chunk, per layer, against the
    larger of its bytes (every touched expert) and its FLOPs at the measured matmul rate;
  - with --hf, transformers' DeepseekV3 of the same reduced model (bf16 experts) as the peer:
    each MoE layer's time from CUDA events around it, after a prefill of --context tokens.
Writes moe_layers_<shape>_<experts>.json under --out (default $OUT) and prints a table last.
With --sweep-only it builds one MoE layer's model without the engine and runs only the routed
experts' launch-shape sweep (moe_tiles_<shape>_<experts>.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_engine import copy_bandwidth, gpu_ms  # noqa: E402
from benchmarks.random_models import write_eagle3_drafter  # noqa: E402

DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "bos_token_id": 0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
KIMI_K25 = DEEPSEEK_V3 | {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 163586,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
SHAPES = {"deepseek-v3": DEEPSEEK_V3, "kimi-k2.5": KIMI_K25}
PREFILLS = [(1, 512), (8, 64)]  # (prompts, tokens each) of the prefill timings
# Kimi-K2.5's scheme: the routed experts in int4 (symmetric, groups of 32), everything else bf16.
INT4_EXPERTS = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
}
INT4_SCALE = 0.004  # random int4 values in [-8, 7] times this: weights of std ~0.02


def write_config(path: Path, shape: dict, layers: int, int4: bool) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = shape | {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": layers, "first_k_dense_replace": 1}
    if int4:
        cfg["quantization_config"] = INT4_EXPERTS
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def random_target(model_dir, device, dtype, max_positions, allow_pickle=False):
    """load_target's model with random weights made in place: every tensor a checkpoint would
    fill (norms 1, selection biases 0, int4 words uniform, int4 scales INT4_SCALE, others N(0, 0.02))."""
    from specserve.config import ModelConfig
    from specserve.model.loader import _build_on
    from specserve.model.transformer import CausalLM

    with _build_on(device, dtype):
        model = CausalLM(ModelConfig.from_dir(model_dir), max_positions)
    g = torch.Generator(device=device).manual_seed(0)
    seen = set()
    with torch.no_grad():
        for name, (t, _) in model.hf_weight_map().items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            if name.endswith("weight_shape"):
                continue  # (read by the loader's checks only)
            if t.dtype == torch.int32:
                t.random_(-(2**31), 2**31 - 1, generator=g)
            elif name.endswith("weight_scale"):
                t.fill_(INT4_SCALE)
            elif "norm" in name:
                t.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=g)
    model.weights_loaded()
    return model.eval().requires_grad_(False)


def layer_bytes(moe_layer, experts_touched: float) -> dict:
    """Weight bytes one decode of a MoE decoder layer reads: everything but the routed experts,
    plus `experts_touched` experts' share of them."""
    from specserve.model.moe import MoE

    moe = moe_layer.mlp
    assert isinstance(moe, MoE)
    routed = [t for m in (moe.w13, moe.w2) for t in ([m] if isinstance(m, torch.Tensor) else [m.packed, m.scale])]
    routed_ids = {id(t) for t in routed}
    per_expert = sum(t.numel() * t.element_size() for t in routed) / moe.local
    tensors = {id(t): t for t in list(moe_layer.parameters()) + list(moe_layer.buffers())}
    other = sum(
        t.numel() * t.element_size()
        for i, t in tensors.items()
        if i not in routed_ids and t.dim() >= 2 and t.dtype != torch.int64
    )
    return {
        "per_expert": per_expert,
        "other": other,
        "experts": experts_touched,
        "total": other + experts_touched * per_expert,
    }


def matmul_flops(n: int = 8192) -> float:
    """bf16 FLOP/s of one n x n x n matmul on this GPU (the compute side of the prefill roofline)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / (gpu_ms(lambda: a @ a, 20) / 1e3)


def distinct_experts(forward) -> list[int]:
    """Distinct experts each MoE layer routes the tokens of `forward` (an eager call) to."""
    from specserve.model.moe import MoE

    counts: list[int] = []
    route = MoE.route

    def counting(self, x):
        w, ids = route(self, x)
        counts.append(int(ids.unique().numel()))
        return w, ids

    MoE.route = counting
    try:
        forward()
    finally:
        MoE.route = route
    return counts


# Launch shapes the sweep tries besides the defaults (`kernels.moe.default_tiles`, which it
# always times), as `kernels.moe.Tiles` keywords: the float experts' default, then the int4
# winners' neighbours (tile widths, stages, warps, split_k, swap: Hopper's warp-group MMA wants
# 64 rows, so only BLOCK_N >= 64 gains from swap).
_FEW, _MANY = dict(split_k=4, swap=True), dict(block_n=128, swap=True)
TILES = [
    {},
    dict(split_k=4),
    dict(swap=True),
    _FEW,
    _MANY,
    dict(block_n=128, num_stages=4, swap=True),
    dict(block_n=128, num_warps=8, swap=True),
    dict(block_n=64, block_k=128, swap=True),
    dict(block_n=64, block_k=128, num_stages=4, swap=True),
    dict(block_n=64, block_k=128, split_k=4, swap=True),
    dict(block_n=128, block_k=128, swap=True),
    dict(block_n=128, block_k=128, split_k=2, swap=True),
    dict(block_n=128, block_k=128, num_warps=8, swap=True),
]


def tiles_label(t) -> str:
    """A launch shape in the sweep's output: "BLOCK_NxBLOCK_K wWARPS sSTAGES [splitN] [swap]"."""
    split = f" split{t.split_k}" if t.split_k > 1 else ""
    return f"{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}{split}" + " swap" * t.swap


def sweep_tiles(moe, batches: list[int]) -> dict:
    """The routed experts alone (`fused_experts` on one layer's experts, alignment included) at
    each batch's decode, per launch shape: GPU ms of a CUDA-graph replay (no launch overhead)
    and the experts' bytes per second; each shape's graph output checked against the default's."""
    from specserve.kernels.gemv import graph_us
    from specserve.kernels.moe import Tiles, default_tiles, fused_experts

    res = {}
    g = torch.Generator(device="cuda").manual_seed(3)
    int4 = not isinstance(moe.w2, torch.Tensor)
    routed = [t for m in (moe.w13, moe.w2) for t in ([m] if not int4 else [m.packed, m.scale])]
    per_expert = sum(t.numel() * t.element_size() for t in routed) / moe.local
    for B in batches:
        x = torch.randn(B, moe.gate.shape[1], device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.inference_mode():
            weights, ids = moe.route(x)
            touched = int(ids.unique().numel())
            want = fused_experts(x, weights, ids, moe.w13, moe.w2, moe.first)
            default = default_tiles(ids.numel(), int4)
            shapes = {tiles_label(t): t for t in [default] + [Tiles(**kw) for kw in TILES]}
            row = {}
            for label, tiles in shapes.items():
                outs = []  # the warm-up call's output, then the captured call's (which the replays refill)
                try:
                    ms = (
                        graph_us(
                            [lambda: outs.append(fused_experts(x, weights, ids, moe.w13, moe.w2, moe.first, tiles))],
                            reps=20,
                        )
                        / 1e3
                    )
                    got = outs[-1]
                    # within a few bf16 steps of the default shape's output, scaled to its size (a
                    # split of K sums in float32 where an unsplit tile rounds to bf16)
                    step = 2**-7
                    torch.testing.assert_close(
                        got.float(), want.float(), rtol=4 * step, atol=4 * step * want.abs().max().item()
                    )
                    row[label] = {"ms": ms, "GBs": touched * per_expert / ms / 1e6}
                except Exception as e:  # (a shape the compiler refuses, or a wrong result: reported, not used)
                    row[label] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    torch.cuda.synchronize()
        ok = {k: v for k, v in row.items() if "ms" in v}
        if not ok:
            raise RuntimeError(f"batch {B}: every launch shape failed: {row}")
        best = min(ok, key=lambda k: ok[k]["ms"])
        label = tiles_label(default)
        res[B] = {"experts": touched, "tiles": row, "best": best, "default": label}
        print(
            f"experts alone, batch {B} ({touched} experts): default {label} "
            f"{row[label].get('ms', float('nan')):.3f} ms, best {best} {ok[best]['ms']:.3f} ms "
            f"({ok[best]['GBs']:.0f} GB/s)",
            flush=True,
        )
        for k, v in sorted(ok.items(), key=lambda kv: kv[1]["ms"]):
            print(f"  {k}: {v['ms']:.3f} ms ({v['GBs']:.0f} GB/s)", flush=True)
        for k, v in row.items():
            if "error" in v:
                print(f"  {k}: {v['error']}", flush=True)
    return res


def kernel_table(runner, B: int = 1, steps: int = 3, top: int = 30) -> list[dict]:
    """The CUDA kernels of `steps` eager decode steps at batch B (the same kernels a graph
    replays), by total GPU time: name, launches and us per step. The gap between a layer's time
    and its roofline is in here (small routing and sorting kernels, attention's ops)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        runner._decode_body(B)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner._decode_body(B)
            torch.cuda.synchronize()
    rows = [
        {"kernel": ev.key[:90], "launches": ev.count / steps, "us": ev.self_device_time_total / steps}
        for ev in prof.key_averages()
        if ev.device_type.name == "CUDA" and ev.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def linear_choices(runner, choices: dict | None = None) -> dict:
    """The GEMV-or-cuBLAS choices of the runner's start-up tuning, {(N, K, dtype, rows): config or None};
    with `choices` (another model's), those replace its own where both have the shape. Two models timed
    for a difference then run the same kernels on the weights they share (the head, the dense layer,
    attention): each start-up tuning may pick otherwise between near-equal candidates, and a 2.3 GB
    head's other kernel would move a layer's figure by as much as the layer's kernels differ."""
    tunings = {id(t): t for p in runner.target.parameters() if (t := getattr(p, "linear_tuning", None)) is not None}
    merged: dict = {}
    for t in tunings.values():
        if choices:
            t.gemv.update({k: v for k, v in choices.items() if k in t.gemv})
        merged |= t.gemv
    return merged


def time_engine(
    model_dir: Path,
    draft_dir: Path,
    batches: list[int],
    context: int,
    k_max: int,
    sweep: bool = False,
    choices: dict | None = None,
) -> dict:
    """Decode, verify and prefill timings of the model in `model_dir` (random weights) in the engine's CUDA
    graphs; `choices`: another model's linear-kernel choices, taken for the shapes both have (`linear_choices`;
    the returned "choices" are this model's)."""
    import specserve.engine.runner as R
    from specserve.config import EngineConfig

    R.load_target = random_target
    cfg = EngineConfig(
        model=str(model_dir),
        draft=str(draft_dir),
        adaptive=True,
        spec_steps=0,
        max_spec_steps=k_max,
        max_num_seqs=max(batches),
        max_model_len=context + 64,
        device="cuda",
        graph_batch_sizes=tuple(batches),
    )
    t0 = time.perf_counter()
    runner = R.ModelRunner(cfg)
    picked = linear_choices(runner, choices)  # (before the graphs capture the kernels)
    runner.reserve_every_row()
    graph_s = runner.capture_graphs(list(range(1, k_max + 1)))
    res = {
        "build_s": time.perf_counter() - t0,
        "graph_s": graph_s,
        "graphs": len(runner.graphs),
        "choices": picked,
        "decode_ms": {},
        "verify_ms": {},
        "experts_decode": {},
        "experts_verify": {},
        "prefill_ms": {},
        "experts_prefill": {},
    }
    g = torch.Generator(device="cuda").manual_seed(1)
    V = runner.model_cfg.vocab_size
    with torch.inference_mode():
        for B in batches:
            ids = torch.randint(0, V, (B,), device="cuda", generator=g)
            pos = torch.full((B,), context, device="cuda")
            res["decode_ms"][B] = gpu_ms(lambda: runner.decode(ids, pos), 30)
            runner.s_ids[:B, 0].copy_(ids)
            runner.s_pos[:B, 0].copy_(pos)
            res["experts_decode"][B] = distinct_experts(lambda: runner._decode_body(B))
        for K in range(1, k_max + 1):
            ids = torch.randint(0, V, (1, K + 1), device="cuda", generator=g)
            pos0 = torch.full((1,), context, device="cuda")
            res["verify_ms"][K] = gpu_ms(lambda: runner.verify(ids, pos0), 30)
            res["experts_verify"][K] = distinct_experts(lambda: runner._verify_body(1, K))
        # Prefill: one prompt (the engine's prefill graph where one fits) and several short prompts in
        # one eager chunk, as continuous batching admits them. Experts counted on an eager forward
        # (start 1: no graph) of the same tokens.
        cpu = torch.Generator().manual_seed(2)
        for m, T in (p for p in PREFILLS if p[0] <= max(batches)):
            chunks = torch.randint(0, V, (m, T), generator=cpu).tolist()
            res["prefill_ms"][f"{m}x{T}"] = gpu_ms(lambda: runner.prefill(0, chunks, [0] * m), 10)
            res["experts_prefill"][f"{m}x{T}"] = distinct_experts(lambda: runner.prefill(0, chunks, [1] * m))
    moe_layers = [layer for layer in runner.target.layers if hasattr(layer.mlp, "w13")]
    res["layer_bytes"] = layer_bytes(moe_layers[0], 0)
    res["kernels_b1"] = kernel_table(runner)
    if sweep:
        res["tiles"] = sweep_tiles(moe_layers[0].mlp, batches)
    k = runner.kv.k_all  # [layer, block, kv_head, offset, dim]
    res["latent_bytes_per_token"] = k.shape[2] * k.shape[4] * k.element_size()  # one layer's
    return res


def time_hf(shape: dict, layers: int, batches: list[int], context: int, impl: str | None) -> dict:
    """transformers' DeepseekV3 of the same reduced model: each MoE layer's time (CUDA events
    around its forward) per decode step after a `context`-token prefill."""
    import transformers

    extra = {"experts_implementation": impl} if impl else {}
    cfg = transformers.DeepseekV3Config(
        **(shape | {"num_hidden_layers": layers, "first_k_dense_replace": 1, "model_type": "deepseek_v3"} | extra)
    )
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    events: list[tuple] = []
    moe_layers = model.model.layers[1:]
    for layer in moe_layers:

        def pre(mod, args, kwargs):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(["start", e])

        def post(mod, args, kwargs, out):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(["end", e])

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)
    res = {
        "impl": impl or "default",
        "chosen": getattr(model.config, "_experts_implementation", None),
        "layer_ms": {},
        "forward_ms": {},
    }
    g = torch.Generator(device="cuda").manual_seed(2)
    with torch.inference_mode():
        for B in batches:
            prompt = torch.randint(0, shape["vocab_size"], (B, context), device="cuda", generator=g)
            cache = transformers.DynamicCache(config=cfg)
            out = model(prompt, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            per_layer, per_forward = [], []
            for step in range(6):
                events.clear()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = model(tok, past_key_values=cache, use_cache=True)
                e.record()
                torch.cuda.synchronize()
                tok = out.logits[:, -1:].argmax(-1)
                if step:  # the first step warms up
                    per_forward.append(s.elapsed_time(e))
                    per_layer += [events[i][1].elapsed_time(events[i + 1][1]) for i in range(0, len(events), 2)]
            res["layer_ms"][B] = statistics.median(per_layer)
            res["forward_ms"][B] = statistics.median(per_forward)
            del cache, out
            print(
                f"hf {res['impl']} batch {B}: MoE layer {res['layer_ms'][B]:.3f} ms, forward "
                f"{res['forward_ms'][B]:.2f} ms",
                flush=True,
            )
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=list(SHAPES), default="deepseek-v3")
    ap.add_argument("--experts", choices=["bf16", "int4"], default="bf16")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--k-max", type=int, default=5)
    ap.add_argument("--hf", action="store_true", help="transformers' DeepseekV3 of the same reduced model as the peer")
    ap.add_argument("--hf-impl", nargs="*", default=[None], help="transformers experts implementations to time")
    ap.add_argument("--no-sweep", action="store_true", help="skip the routed experts' launch-shape sweep")
    ap.add_argument(
        "--sweep-only",
        action="store_true",
        help="only the launch-shape sweep, on a one-MoE-layer model built without the engine (minutes)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = ap.parse_args()
    if args.moe_layers < 2:
        ap.error("--moe-layers must be at least 2 (one layer's time is the difference to a one-MoE-layer model)")
    shape, int4 = SHAPES[args.shape], args.experts == "int4"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": args.shape,
        "experts": args.experts,
        "moe_layers": args.moe_layers,
        "context": args.context,
        "batches": args.batches,
    }
    work = Path(tempfile.mkdtemp(prefix="moe-layers-"))
    if args.sweep_only:
        model = random_target(write_config(work / "one", shape, 2, int4), "cuda", torch.bfloat16, args.context + 64)
        res["tiles"] = sweep_tiles(next(layer.mlp for layer in model.layers if hasattr(layer.mlp, "w13")), args.batches)
        name = out / f"moe_tiles_{args.shape}_{args.experts}.json"
        name.write_text(json.dumps(res, indent=1))
        print("wrote", name)
        return
    bw = copy_bandwidth()
    res["copy_bw_GBs"] = bw / 1e9
    t0 = time.perf_counter()
    draft = write_eagle3_drafter(
        work / "draft",
        {
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": shape["vocab_size"],
        },
    )
    res["drafter_write_s"] = time.perf_counter() - t0
    full = time_engine(
        write_config(work / "full", shape, 1 + args.moe_layers, int4),
        draft,
        args.batches,
        args.context,
        args.k_max,
        sweep=not args.no_sweep,
    )
    print(
        f"full model ({1 + args.moe_layers} layers): built in {full['build_s']:.0f} s, decode ms {full['decode_ms']}",
        flush=True,
    )
    gc.collect()
    torch.cuda.empty_cache()
    base = time_engine(
        write_config(work / "base", shape, 2, int4),
        draft,
        args.batches,
        args.context,
        args.k_max,
        choices=full["choices"],
    )
    print(f"base model (2 layers): decode ms {base['decode_ms']}", flush=True)
    res["full"], res["base"] = full, base
    res["linear_choices"] = {
        f"{N}x{K} {str(dt).split('.')[-1]} rows {r}": c for (N, K, dt, r), c in full.pop("choices").items()
    }
    base.pop("choices")
    extra = args.moe_layers - 1
    lb = full["layer_bytes"]
    rows = []
    res["per_layer"] = {}
    for B in args.batches:
        ms = (full["decode_ms"][B] - base["decode_ms"][B]) / extra
        touched = statistics.mean(full["experts_decode"][B])
        cache = B * args.context * full["latent_bytes_per_token"]
        nbytes = lb["other"] + touched * lb["per_expert"] + cache
        roof_ms = nbytes / bw * 1e3
        entry = {"ms": ms, "experts": touched, "bytes": nbytes, "roofline_ms": roof_ms, "of_roofline": roof_ms / ms}
        if "tiles" in full:  # the layer with the best launch shape for its experts: the saving added back
            t = full["tiles"][B]
            saved = t["tiles"][t["default"]]["ms"] - t["tiles"][t["best"]]["ms"]
            entry |= {
                "best_tiles": t["best"],
                "ms_best_tiles": ms - saved,
                "of_roofline_best_tiles": roof_ms / (ms - saved),
            }
        res["per_layer"][B] = entry
        rows.append((B, ms, touched, nbytes / 1e6, roof_ms, roof_ms / ms, entry.get("of_roofline_best_tiles")))
    res["verify"] = {}
    dec = (full["decode_ms"][1] - base["decode_ms"][1]) / extra
    e1 = statistics.mean(full["experts_decode"][1])
    for K in range(1, args.k_max + 1):
        layer_ms = (full["verify_ms"][K] - base["verify_ms"][K]) / extra
        touched = statistics.mean(full["experts_verify"][K])
        limit = (lb["other"] + touched * lb["per_expert"]) / (lb["other"] + e1 * lb["per_expert"])
        res["verify"][K] = {
            "model_ratio": full["verify_ms"][K] / full["decode_ms"][1],
            "layer_ms": layer_ms,
            "layer_ratio": layer_ms / dec,
            "experts": touched,
            "bytes_limit": limit,
        }
    # Prefill: bytes of every touched expert and the rest, or the products' FLOPs at the measured
    # matmul rate, whichever takes longer.
    res["prefill"] = {}
    flops_s = matmul_flops()
    res["matmul_TFLOPs"] = flops_s / 1e12
    expert_params = 3 * shape["hidden_size"] * shape["moe_intermediate_size"]
    for key, ms_full in full["prefill_ms"].items():
        m, T = map(int, key.split("x"))
        layer_ms = (ms_full - base["prefill_ms"][key]) / extra
        touched = statistics.mean(full["experts_prefill"][key])
        bytes_ms = (lb["other"] + touched * lb["per_expert"]) / bw * 1e3
        flops_ms = 2 * m * T * (lb["other"] / 2 + shape["num_experts_per_tok"] * expert_params) / flops_s * 1e3
        roof = max(bytes_ms, flops_ms)
        res["prefill"][key] = {
            "layer_ms": layer_ms,
            "experts": touched,
            "bytes_ms": bytes_ms,
            "flops_ms": flops_ms,
            "of_roofline": roof / layer_ms,
        }
    if args.hf:
        if int4:
            print("(--hf times bf16 experts: transformers has no int4 path here)", flush=True)
        res["hf"] = []
        for impl in args.hf_impl:
            try:
                res["hf"].append(time_hf(shape, 1 + args.moe_layers, args.batches, args.context, impl))
            except Exception as e:  # (a peer failing leaves our figures standing)
                res["hf"].append({"impl": impl or "default", "error": f"{type(e).__name__}: {e}"})
                print("hf peer failed:", res["hf"][-1]["error"], flush=True)
                gc.collect()
                torch.cuda.empty_cache()
    name = out / f"moe_layers_{args.shape}_{args.experts}.json"
    name.write_text(json.dumps(res, indent=1))
    print(
        f"\n{args.shape}, {args.experts} experts, {1 + args.moe_layers} layers, context {args.context}, "
        f"copy bandwidth {bw / 1e9:.0f} GB/s; one MoE layer:"
    )
    print(
        "| batch | ms | experts | MB read | roofline ms | of roofline | best tiles |" + (" hf ms |" if args.hf else "")
    )
    for B, ms, touched, mb, roof, frac, best in rows:
        hf = "".join(f" {h['layer_ms'][B]:.3f} |" for h in res.get("hf", []) if "layer_ms" in h)
        best = f"{best:.0%}" if best else "-"
        print(f"| {B} | {ms:.3f} | {touched:.1f} | {mb:.1f} | {roof:.3f} | {frac:.0%} | {best} |{hf}")
    print("| prefill (prompts x tokens) | layer ms | experts | bytes ms | FLOPs ms | of roofline |")
    for key, v in res["prefill"].items():
        print(
            f"| {key} | {v['layer_ms']:.3f} | {v['experts']:.1f} | {v['bytes_ms']:.3f} | {v['flops_ms']:.3f} | "
            f"{v['of_roofline']:.0%} |"
        )
    print("| K | verify/decode (model) | (layer) | experts | bytes limit |")
    for K, v in res["verify"].items():
        print(
            f"| {K} | {v['model_ratio']:.3f} | {v['layer_ratio']:.3f} | {v['experts']:.1f} | {v['bytes_limit']:.3f} |"
        )
    layers = 1 + args.moe_layers
    print(f"kernels of one eager decode step at batch 1 ({layers} layers; launches and us per step):")
    for r in full["kernels_b1"][:20]:
        print(f"  {r['us']:9.1f} us {r['launches']:6.1f}x  {r['kernel']}")
    print("wrote", name)


if __name__ == "__main__":
    main()
