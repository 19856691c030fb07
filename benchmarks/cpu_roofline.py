"""CPU decode speed of a real model against its weight-streaming roofline and transformers.

    PYTHONPATH=. python benchmarks/cpu_roofline.py --out benchmarks/results/cpu-smollm2-roofline.json

Measures, at one torch thread count shared by every part:
- the weight-streaming rate: the fastest of a float32 GEMV by torch, the native panel GEMV and a
  plain sum over a weight far larger than the caches, and from it the roofline (tokens/s if a
  decode step only read the model's weights once at that rate);
- specserve plain decoding, batch 1, greedy, `--new-tokens` tokens;
- transformers `generate()` on the same GGUF (dequantized), static and dynamic cache;
- where a decode step's wall time goes without a profiler: the decoder layers, the LM head, the rest;
- a per-op profile of specserve's decode steps (torch.profiler, self CPU time per op and shape,
  and the time no op accounts for: Python and host bookkeeping; the native kernels' calls are
  not ops to the profiler, so their time shows there too);
- with ``--native-ab``: specserve also without its native CPU kernels (`kernels.cpu_native`:
  the tuner's choice among MKL and oneDNN alone, torch's small ops), interleaved with the runs
  with them.

The machine may be shared, so specserve and transformers runs are interleaved `--repeats` times
and the medians are reported with the load average: ratios measured side by side are the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def streaming_rates(reps: int = 7) -> dict[str, float]:
    """GB/s reading a 256 MiB float32 weight (far past any cache), best of `reps` each: as a GEMV
    by torch (MKL), as the native panel GEMV where it builds, and as a plain sum. The roofline
    takes the fastest: a decode step can stream its weights no faster than the best of these."""
    w = torch.randn(16384, 4096)
    x = torch.randn(1, 4096)
    runs = {"gemv_torch": lambda: F.linear(x, w), "sum": lambda: w.sum()}
    from specserve.kernels import cpu_native

    native = cpu_native.ops()
    if native is not None:
        panels = cpu_native.pack_panels(w)
        runs["gemv_native"] = lambda: native.panel_linear(x, panels, w.shape[0], None)
    rates = {}
    for name, fn in runs.items():
        fn()
        rates[name] = w.numel() * w.element_size() / min(_timed(fn) for _ in range(reps)) / 1e9
    return rates


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads at least once: every parameter, shared ones (a tied head) once."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def specserve_run(llm, ids: list[int], new_tokens: int) -> float:
    """Decode tokens/s (time after the first token), batch 1, greedy."""
    from specserve import SamplingParams

    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    decode_s = out.latency_s - out.ttft_s
    return (len(out.token_ids) - 1) / decode_s


@contextlib.contextmanager
def without_native(llm):
    """specserve as it runs where the native CPU kernels cannot be built: each weight's product
    the tuner's pick among the other kernels from the same timings, torch's small ops."""
    from specserve.kernels import cpu_linear, cpu_native

    report = llm.engine.runner.linear_tuning
    saved_ops, saved = cpu_native._state.get("ops"), {}
    for p in llm.engine.runner.target.parameters():
        plan = getattr(p, "cpu_plan", None)
        if plan is None or cpu_linear.NATIVE not in plan.by_rows:
            continue
        times = report[f"{p.shape[0]}x{p.shape[1]}"]
        by_rows = cpu_linear._choices(
            {r: {k: v for k, v in t.items() if k != cpu_linear.NATIVE} for r, t in times.items()}
        )
        saved[p] = plan
        packed = plan.packed
        if cpu_linear.ONEDNN in by_rows and packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(p.data, 8)
        p.cpu_plan = None if set(by_rows) == {cpu_linear.MKL} else cpu_linear.CpuPlan(by_rows, packed)
    cpu_native._state["ops"] = None
    try:
        yield
    finally:
        cpu_native._state["ops"] = saved_ops
        for p, plan in saved.items():
            p.cpu_plan = plan


def hf_run(model, ids: list[int], new_tokens: int, cache: str) -> float:
    """Decode tokens/s of transformers generate() (first token's time excluded), batch 1, greedy."""
    from transformers import StaticCache, StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    clock = Clock()
    x = torch.tensor([ids])
    extra = {}
    if cache == "static":
        extra["past_key_values"] = StaticCache(config=model.config, max_cache_len=len(ids) + new_tokens + 8)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            top_k=None,
            top_p=None,
            stopping_criteria=StoppingCriteriaList([clock]),
            pad_token_id=0,
            **extra,
        )
    return (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])


def profile_decode(llm, ids: list[int], steps: int) -> dict:
    """Per forward (`steps` decode steps and the prompt's prefill): self CPU ms per op (input shapes
    for products), and the wall time per decode step that no op accounts for (Python, bookkeeping)."""
    from torch.profiler import ProfilerActivity, profile

    from specserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([ids], sp)  # warm
    sp = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out = llm.generate([ids], sp)[0]
    wall_ms = (out.latency_s - out.ttft_s) * 1e3 / steps
    # The prefill is profiled with the decode steps (one forward of `steps + 1`): its share is
    # small and shows apart in the product shapes (prompt-length rows).
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.self_cpu_time_total <= 0:
            continue
        shapes = (
            e.input_shapes
            if e.key in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise")
            else ""
        )
        rows.append(
            {
                "op": e.key,
                "shapes": str(shapes) if shapes else "",
                "calls_per_forward": e.count / (steps + 1),
                "self_ms_per_forward": e.self_cpu_time_total / 1e3 / (steps + 1),
            }
        )
    rows.sort(key=lambda r: -r["self_ms_per_forward"])
    in_ops = sum(r["self_ms_per_forward"] for r in rows)
    return {
        "step_wall_ms": round(wall_ms, 3),
        "ops_ms": round(in_ops, 3),
        "outside_ops_ms": round(wall_ms - in_ops, 3),
        "ops": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows[:25]],
    }


def product_split(llm, ids: list[int], steps: int) -> dict:
    """Per decode step, without the profiler's own cost per op: wall ms in the decoder layers (each
    call timed: products, norms, rope, KV, attention, one native call per layer where
    `DecoderLayer._native_step` applies) and in the LM head, and the rest (embedding, final norm,
    sampling, the engine's bookkeeping)."""
    from specserve import SamplingParams

    target = llm.engine.runner.target
    spent = {"layers": 0.0, "head": 0.0}

    def timed(fn, key):
        def call(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            spent[key] += time.perf_counter() - t0
            return out

        return call

    for layer in target.layers:
        layer.forward = timed(layer.forward, "layers")
    target.logits = timed(target.logits, "head")
    try:
        runs = []
        for n in (1, steps + 1):  # the prefill alone, then with `steps` decode steps: the difference is theirs
            spent.update(layers=0.0, head=0.0)
            out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
            runs.append((dict(spent), out.latency_s - out.ttft_s))
    finally:
        for layer in target.layers:
            del layer.forward
        del target.logits
    (pre, _), (full, decode_s) = runs
    ms = {k: (full[k] - pre[k]) * 1e3 / steps for k in spent}
    step = decode_s * 1e3 / steps
    return {
        "step_ms": round(step, 3),
        "layers_ms": round(ms["layers"], 3),
        "lm_head_ms": round(ms["head"], 3),
        "rest_ms": round(step - ms["layers"] - ms["head"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads for every part (default: all cores)"
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--native-ab", action="store_true", help="also run specserve without its native CPU kernels")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = [os.getloadavg()[0]]

    from specserve import LLM
    from specserve.model.gguf import find_gguf

    rate_runs = [streaming_rates()]
    llm = LLM(args.model, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=1)
    nbytes = model_bytes(llm.engine.runner.target)
    ids = llm.tokenizer.encode(PROMPT)
    specserve_run(llm, ids, 8)  # warm-up
    hf = {}
    if not args.no_hf:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        path = find_gguf(args.model)
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        hf = {"static": [], "dynamic": []}
        hf_run(hf_model, ids, 8, "static")
    ours, plain = [], []
    for _ in range(args.repeats):  # interleaved: a load change hits every side alike
        ours.append(specserve_run(llm, ids, args.new_tokens))
        if args.native_ab:
            with without_native(llm):
                plain.append(specserve_run(llm, ids, args.new_tokens))
        for cache in hf:
            hf[cache].append(hf_run(hf_model, ids, args.new_tokens, cache))
        rate_runs.append(streaming_rates(3))
        load.append(os.getloadavg()[0])
    by_kind = {k: round(statistics.median(r[k] for r in rate_runs), 2) for k in rate_runs[0]}
    rate = max(by_kind.values())
    roofline = rate * 1e9 / nbytes
    med = statistics.median(ours)
    result = {
        "model": args.model,
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "batch": 1,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "load_average_1min": load,
        "streaming_gb_s": round(rate, 2),
        "streaming_gb_s_by_kind": by_kind,
        "model_bytes": nbytes,
        "roofline_tok_s": round(roofline, 2),
        "specserve_tok_s": [round(x, 2) for x in ours],
        "specserve_median_tok_s": round(med, 2),
        "specserve_pct_roofline": round(100 * med / roofline, 1),
        "transformers_tok_s": {c: [round(x, 2) for x in v] for c, v in hf.items()},
    }
    for c, v in hf.items():
        result[f"x_transformers_{c}"] = round(med / statistics.median(v), 2)
    if plain:
        result["without_native_tok_s"] = [round(x, 2) for x in plain]
        result["without_native_pct_roofline"] = round(100 * statistics.median(plain) / roofline, 1)
        result["x_without_native"] = round(med / statistics.median(plain), 2)
        with without_native(llm):
            result["split_without_native"] = product_split(llm, ids, args.new_tokens)
    result["split"] = product_split(llm, ids, args.new_tokens)
    result["profile"] = profile_decode(llm, ids, args.profile_steps)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
