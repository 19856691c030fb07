"""GPU benchmark of the engine core and speculative step costs (issues 2 and 3).

    python benchmarks/gpu_engine.py [--out DIR] [--skip-hf]

On one GPU: builds a Llama-3.1-8B-shaped bf16 model with random weights and a
random EAGLE-3 drafter, then measures in one process
  - device copy bandwidth and the decode roofline (weight bytes / bandwidth);
  - specserve plain decoding, batch 1, 128-token prompt, 256 new tokens, CUDA graphs;
  - the pure GPU time of one decode step, one verify of K+1 tokens and one
    K-step draft (graph replays), K = 1..6: the verify/decode cost ratio;
  - greedy speculative output == plain output (random drafter: acceptance ~0,
    so this checks the machinery, not the speed-up);
  - plain decode tok/s at batch 1, 4, 16, 64;
  - transformers generate() with a static cache on the same model and prompt;
  - where one eager decode step's GPU time goes (kernel groups, from the profiler),
    and the fused kernels' logits against the PyTorch reference path.
SPECSERVE_FUSED_KERNELS=0 runs the whole benchmark on the reference path (A/B).
Writes engine.json under --out (default $OUT) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.config import EngineConfig  # noqa: E402
from specserve.engine.engine import Engine  # noqa: E402
from specserve.engine.sampling import BatchSampling, SamplingParams  # noqa: E402

from benchmarks.random_models import write_eagle3_drafter, write_llama  # noqa: E402


def copy_bandwidth() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        b.copy_(a)
    e.record()
    e.synchronize()
    return 2 * n * 10 / (s.elapsed_time(e) / 1000)


def gpu_ms(fn, iters=50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def kernel_groups(prof) -> dict:
    """CUDA kernel time of a profiled region, grouped: GEMMs, attention, fused Triton, other."""
    groups: dict[str, list] = {}
    for ev in prof.key_averages():
        if ev.device_type.name != "CUDA" or ev.self_device_time_total <= 0:
            continue
        n = ev.key.lower()
        if any(t in n for t in ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "splitk")):
            g = "gemm"
        elif any(t in n for t in ("fmha", "attention", "flash", "sdpa")):
            g = "attention"
        elif n.startswith(("_rms_norm", "_rope_kv", "_silu_mul", "_skinny")):
            g = "fused_triton"
        else:
            g = "other"
        acc = groups.setdefault(g, [0, 0.0])
        acc[0] += ev.count
        acc[1] += ev.self_device_time_total
    return {g: {"kernels": c, "us": round(t, 1)} for g, (c, t) in groups.items()}


def decode_breakdown(runner, steps: int = 5) -> dict:
    """Profile `steps` eager decode steps at batch 1; per-step kernel counts and GPU us by group."""
    from torch.profiler import ProfilerActivity, profile

    runner.s_ids[:1, 0] = 5
    runner.s_pos[:1, 0] = 200
    with torch.inference_mode():
        runner._decode_body(1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner._decode_body(1)
            torch.cuda.synchronize()
    out = kernel_groups(prof)
    for v in out.values():
        v["kernels"] //= steps
        v["us"] = round(v["us"] / steps, 1)
    return out


def fused_vs_reference(runner) -> dict:
    """Decode logits (eager, batch 1) with the fused kernels and with the PyTorch reference."""
    from specserve.kernels import common as kernels

    res = {}
    with torch.inference_mode():
        logits = {}
        for fused in (True, False):
            kernels.FUSED = fused
            runner.s_ids[:1, 0] = 5
            runner.s_pos[:1, 0] = 200
            logits[fused] = runner._decode_body(1)[0].float()
        kernels.FUSED = True
    a, b = logits[True], logits[False]
    res["max_abs_logit_diff"] = (a - b).abs().max().item()
    res["logit_scale"] = b.abs().max().item()
    res["argmax_equal"] = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    return res


def pdl_ab(runner) -> dict:
    """The batch-1 decode step captured with and without programmatic dependent launch: GPU time
    per replay (20 back to back) and whether the logits are bitwise equal (they must be: the same
    kernels, only allowed to start early; a missing wait would show up as a difference)."""
    from specserve.kernels import common as kernels

    res, logits = {}, {}
    runner.s_ids[:1, 0] = 5
    runner.s_pos[:1, 0] = 200
    with torch.inference_mode():
        for pdl in (False, True):
            kernels.PDL = pdl
            runner._decode_body(1)  # compile this variant outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = runner._decode_body(1)
            res[f"pdl_{pdl}_ms"] = gpu_ms(lambda: [graph.replay() for _ in range(20)], 10) / 20
            graph.replay()
            logits[pdl] = out[0].float().clone()
            del graph
    kernels.PDL = True
    res["bitwise_equal"] = bool(torch.equal(logits[False], logits[True]))
    return res


def greedy_margins(runner, prompt: list[int], out_ids: list[int]) -> dict:
    """Teacher-forced: the target scores prompt + greedy output in one forward (a prefill, other
    kernels than decode). Where its argmax differs from the decoded token, the two candidates'
    logits are within bf16 noise of each other; random weights give near-flat logits, so greedy
    paths computed with different kernels (decode vs verify) can part at such a near-tie."""
    from specserve.model.layers import ForwardContext

    seq = torch.tensor([prompt + out_ids], device="cuda")
    pos = torch.arange(seq.shape[1], device="cuda").unsqueeze(0)
    with torch.inference_mode():
        hidden, _ = runner.target(seq, ForwardContext(0, pos, pos, seq.shape[1]))
        logits = runner.target.logits(hidden[0, len(prompt) - 1 : -1])
    top = logits.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    chosen = logits.gather(1, torch.tensor(out_ids, device="cuda").unsqueeze(1))[:, 0]
    differ = (logits.argmax(-1) != torch.tensor(out_ids, device="cuda")).nonzero()[:, 0]
    return {
        "positions": len(out_ids),
        "argmax_differs_at": differ.tolist()[:20],
        "max_shortfall_where_differs": (top[differ, 0] - chosen[differ]).max().item() if len(differ) else 0.0,
        "median_top2_gap": gap.median().item(),
        "logit_std": logits.std().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/tmp/specserve-models")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--name", default="engine", help="JSON file name under --out")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    from specserve.kernels import common as kernels

    res: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": "llama3-8b (random)",
        "fused_kernels": kernels.FUSED,
    }
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    target, draft = work / "llama8b", work / "llama8b-eagle3"
    if not (target / "config.json").exists():
        write_llama(target)
        write_eagle3_drafter(draft)
    res["write_s"] = time.perf_counter() - t0
    weight_bytes = sum(f.stat().st_size for f in target.glob("*.safetensors"))
    res["copy_bw_GBs"] = bw / 1e9
    res["roofline_tok_s"] = bw / weight_bytes

    t0 = time.perf_counter()
    eng = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            adaptive=True,
            spec_steps=0,
            max_spec_steps=6,
            max_num_seqs=64,
            max_model_len=512,
            device="cuda",
            profile=True,
        )
    )
    runner = eng.runner
    res["load_s"], res["graph_capture_s"] = runner.load_seconds, eng.graph_seconds
    res["startup_s"] = time.perf_counter() - t0
    print(
        f"startup {res['startup_s']:.1f}s (load {runner.load_seconds:.1f}s, graphs {eng.graph_seconds:.1f}s)",
        flush=True,
    )

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128000, (128,), generator=g).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)

    def timed(prompts, K):
        """Generate with a fixed K (0 = plain); returns sequences and wall seconds."""
        eng.policy.fixed = K
        eng.profile.clear()
        t = time.perf_counter()
        seqs = [eng.add_request(p, greedy) for p in prompts]
        while eng.has_work():
            eng.step()
        return seqs, time.perf_counter() - t

    def profile_ms():
        return {part: statistics.median(p[part] for p in eng.profile) for part in ("draft", "verify", "accept")}

    res["decode_breakdown"] = decode_breakdown(runner)
    print("eager decode step, GPU time by kernel group:", res["decode_breakdown"], flush=True)
    if kernels.FUSED:
        res["fused_vs_reference"] = fused_vs_reference(runner)
        print("fused vs reference:", res["fused_vs_reference"], flush=True)
        res["pdl"] = pdl_ab(runner)
        print("programmatic dependent launch A/B:", res["pdl"], flush=True)
        res["linear_tuning"] = runner.linear_tuning  # {"NxK": {rows: (cuBLAS us, best Triton us, config)}}
    timed([prompt], 0)  # warm-up
    outs, sec = timed([prompt], 0)
    plain_ids = outs[0].output_ids
    res["plain_b1_tok_s"] = 256 / sec
    eng.launch_ahead = False  # the same tokens without queueing plain steps ahead?
    outs, sec = timed([prompt], 0)
    eng.launch_ahead = True
    res["plain_b1_no_ahead_tok_s"] = 256 / sec
    res["ahead_same_tokens"] = outs[0].output_ids == plain_ids
    res["greedy_margins"] = greedy_margins(runner, prompt, plain_ids)
    print("queued-ahead plain == plain:", res["ahead_same_tokens"], "| margins:", res["greedy_margins"], flush=True)

    # Pure GPU step costs (graph replays at batch 1).
    ids1, pos1 = torch.tensor([5], device="cuda"), torch.tensor([200], device="cuda")
    res["decode_step_ms"] = gpu_ms(lambda: runner.decode(ids1, pos1))
    s = BatchSampling.build([greedy], [0], torch.device("cuda"))
    res["spec"] = {}
    for K in range(1, 7):
        ids = torch.randint(0, 1000, (1, K + 1), device="cuda")
        verify = gpu_ms(lambda: runner.verify(ids, pos1))
        entry = torch.full((1, K + 1), runner.scratch, device="cuda")
        entry[0, 0] = 199
        last = torch.zeros(1, dtype=torch.long, device="cuda")
        draft_ms = gpu_ms(lambda: runner.draft(K, entry, last, s))
        outs, sec = timed([prompt], K)
        res["spec"][K] = {
            "verify_ms": verify,
            "verify_over_decode": verify / res["decode_step_ms"],
            "draft_ms": draft_ms,
            "draft_per_step_ms": draft_ms / K,
            "greedy_equal_plain": outs[0].output_ids == plain_ids,
            "tok_s": 256 / sec,
            "greedy_common_prefix": _common_prefix(outs[0].output_ids, plain_ids),
            "accept_length": outs[0].spec.accept_length,
            "profile_median_ms": profile_ms(),
        }
        print(
            f"K={K} verify {verify:.3f} ms ({verify / res['decode_step_ms']:.3f}x decode) draft {draft_ms:.3f} ms "
            f"equal={outs[0].output_ids == plain_ids}",
            flush=True,
        )

    # Where a step's wall time goes: host work vs GPU (profiler, 8 steps at batch 4).
    from torch.profiler import ProfilerActivity, profile

    prompts4 = [torch.randint(0, 128000, (128,), generator=g).tolist() for _ in range(4)]
    eng.policy.fixed = 0
    for p in prompts4:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(20):
        eng.step()
    step_ms = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            t = time.perf_counter()
            eng.step()
            step_ms.append((time.perf_counter() - t) * 1000)
    while eng.has_work():
        eng.step()
    res["b4_step_wall_ms"] = step_ms
    print("batch-4 step wall ms:", [round(x, 2) for x in step_ms])
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=50))

    res["plain_batch_tok_s"] = {}
    for B in (1, 4, 16, 64):
        prompts = [torch.randint(0, 128000, (128,), generator=g).tolist() for _ in range(B)]
        timed(prompts[:1], 0)
        outs, sec = timed(prompts, 0)
        res["plain_batch_tok_s"][B] = sum(len(o.output_ids) for o in outs) / sec
        ids_b = torch.full((B,), 5, device="cuda")
        pos_b = torch.full((B,), 200, device="cuda")
        res.setdefault("decode_step_ms_by_batch", {})[B] = gpu_ms(lambda: runner.decode(ids_b, pos_b), 20)

    del eng, runner
    torch.cuda.empty_cache()
    if not args.skip_hf:
        try:
            import transformers

            hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16, device_map="cuda")
            x = torch.tensor([prompt], device="cuda")
            kw = dict(max_new_tokens=256, min_new_tokens=256, do_sample=False, cache_implementation="static")
            hf.generate(x, **kw)
            torch.cuda.synchronize()
            t = time.perf_counter()
            y = hf.generate(x, **kw)
            torch.cuda.synchronize()
            res["hf_static_tok_s"] = 256 / (time.perf_counter() - t)
            res["hf_greedy_equal"] = y[0, 128:].tolist() == plain_ids
        except Exception as e:  # report, don't lose the rest
            res["hf_error"] = repr(e)[:500]

    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    print("\n| metric | value |\n|---|---|")
    print(f"| copy bandwidth | {res['copy_bw_GBs']:.0f} GB/s |")
    print(f"| roofline (batch 1) | {res['roofline_tok_s']:.0f} tok/s |")
    print(
        f"| specserve plain b1 | {res['plain_b1_tok_s']:.1f} tok/s ({res['plain_b1_tok_s'] / res['roofline_tok_s']:.0%}); "
        f"not queued ahead {res['plain_b1_no_ahead_tok_s']:.1f} |"
    )
    print(f"| decode step (graph) | {res['decode_step_ms']:.3f} ms |")
    if "pdl" in res:
        print(
            f"| decode step, 20 replays: PDL on / off | {res['pdl']['pdl_True_ms']:.3f} / {res['pdl']['pdl_False_ms']:.3f} ms "
            f"(bitwise equal: {res['pdl']['bitwise_equal']}) |"
        )
    for K, v in res["spec"].items():
        print(
            f"| K={K} verify/decode | {v['verify_over_decode']:.3f} (draft {v['draft_ms']:.2f} ms, same first "
            f"{v['greedy_common_prefix']}/256 tokens, {v['tok_s']:.0f} tok/s) |"
        )
    for B, v in res["plain_batch_tok_s"].items():
        print(f"| plain batch {B} | {v:.0f} tok/s |")
    print(f"| transformers static | {res.get('hf_static_tok_s', res.get('hf_error'))} |")


if __name__ == "__main__":
    main()
