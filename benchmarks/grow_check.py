"""Grow the demo pair to an 8B shape and check that it still computes the demo's output.

    python benchmarks/grow_check.py [--preset llama3-8b] [--layers L] [--no-float32] [--dtype bfloat16] [--max-tokens 128]
                                    [--work /tmp/specserve-grown] [--out $OUT/grow_check.json]

One GPU (or --device cpu with a small preset such as demo-mid). Steps:
  1. `specserve grow` the demo target (+ drafter, if bundled) into --work (timed);
  2. greedy outputs (ignore_eos, --max-tokens) over the bench prompts of the small and
     the grown target, both in --dtype: free-running agreement per position, first
     divergence, and teacher-forced top-1 agreement (the grown target fed the small
     target's tokens) -> "grown_vs_small";
  3. the same two checkpoints computed in float32 -> "grown_vs_small_float32" (the
     construction without bf16 rounding), and two noise scales: the small target in
     float32 vs --dtype, and the small target one prompt at a time vs batched;
  4. with a drafter: speculative greedy runs of both pairs (K = --spec-steps):
     acceptance lengths per position, and agreement with their plain output.
Exit status 0 when teacher-forced agreement is >= 95%.
Writes one JSON object (to --out, default $OUT/grow_check.json, else stdout).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.config import DEMO_DIR, ModelConfig  # noqa: E402
from specserve.engine.llm import LLM, SamplingParams, demo_paths  # noqa: E402
from specserve.model.layers import ForwardContext  # noqa: E402
from specserve.train.grow import grow  # noqa: E402
from specserve.train.shapes import PRESETS  # noqa: E402


def load_prompts(path: str | None, limit: int) -> tuple[str, list[dict]]:
    candidates = (
        [Path(path)]
        if path
        else [Path(__file__).resolve().parents[1] / "specserve/bench/prompts.jsonl", DEMO_DIR / "heldout_prompts.jsonl"]
    )
    for p in candidates:
        if p.exists():
            rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if r.get("prompt") or r.get("messages")]
            return str(p), rows[:limit]
    raise SystemExit(f"no prompt file found (tried {', '.join(map(str, candidates))})")


def encode(tok, row: dict) -> list[int]:
    if row.get("prompt"):
        return tok.encode(row["prompt"])
    try:
        return tok.encode(tok.apply_chat_template(row["messages"]))
    except Exception:  # no chat template: a plain transcript
        return tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in row["messages"]) + "assistant:")


def free(llm) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def greedy(llm: LLM, prompts: list[list[int]], n: int, K: int = 0):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    secs = time.perf_counter() - t0
    return [o.token_ids for o in outs], outs, secs


@torch.inference_mode()
def teacher_forced(llm: LLM, prompts: list[list[int]], conts: list[list[int]]) -> list[list[int]]:
    """Argmax of the target at every continuation position, fed prompt + the given continuation."""
    runner = llm.engine.runner
    bs = runner.kv.block_size
    out = []
    for p, c in zip(prompts, conts):
        ids = torch.tensor([p + c[:-1]], device=runner.device)
        pos = torch.arange(ids.shape[1], device=runner.device)[None]
        # The paged pool's first blocks, overwritten: the LLM is idle and not used again afterwards.
        table = torch.arange(-(-ids.shape[1] // bs), device=runner.device)[None]
        hidden, _ = runner.target(ids, ForwardContext(0, pos, pos, ids.shape[1], block_table=table, block_size=bs))
        out.append(runner.target.logits(hidden[0, len(p) - 1 :]).argmax(-1).tolist())
    return out


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    pos = sum(sum(a == b for a, b in zip(r, o)) for r, o in zip(ref, other))
    total = sum(len(r) for r in ref)
    first = []
    for r, o in zip(ref, other):
        d = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
        first.append(d)
    return {
        "positions": total,
        "position_agreement": pos / total,
        "identical_sequences": sum(f == len(r) for f, r in zip(first, ref)),
        "sequences": len(ref),
        "mean_first_divergence": sum(first) / len(first),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--model", help="small target (default: the demo target)")
    ap.add_argument("--draft", help="its drafter (default: the demo drafter if bundled)")
    ap.add_argument("--layers", type=int, help="override the preset's layer count (a smaller checkpoint)")
    ap.add_argument(
        "--no-float32",
        action="store_true",
        help="skip the float32 runs (a grown MoE preset's float32 weights do not fit one GPU)",
    )
    ap.add_argument("--pad-vocab", type=int, help="also pad the vocabulary (128256 = Llama 3 size)")
    ap.add_argument("--read", default="one", choices=["one", "all"], help="grow --read mode")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", help="jsonl with a 'prompt' field (default: bench prompts, else held-out prompts)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec-steps", type=int, default=4)
    ap.add_argument("--work", default="/tmp/specserve-grown", help="where the grown pair is written")
    ap.add_argument("--reuse", action="store_true", help="use an existing grown pair in --work")
    ap.add_argument("--out", help="JSON result path (default: $OUT/grow_check.json, else stdout)")
    args = ap.parse_args()

    model, draft = args.model, args.draft
    if model is None:
        model, demo_draft = demo_paths()
        draft = draft or demo_draft
    work = Path(args.work)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    result: dict = {
        "preset": args.preset,
        "read": args.read,
        "pad_vocab": args.pad_vocab,
        "dtype": args.dtype,
        "device": device,
        "small_model": str(model),
        "small_draft": draft,
        "max_tokens": args.max_tokens,
    }
    if torch.cuda.is_available() and device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)

    if not (args.reuse and (work / "config.json").exists()):
        shape = PRESETS[args.preset]
        shape = dataclasses.replace(shape, layers=args.layers) if args.layers else shape
        result["grow"] = grow(
            model,
            work,
            shape,
            draft_dir=draft,
            dtype=args.dtype,
            device=device,
            preset=args.preset,
            force=True,
            pad_vocab=args.pad_vocab,
            read=args.read,
        )
        print(f"grown in {result['grow']['seconds']} s -> {work}", file=sys.stderr)
    grown_draft = str(work / "draft") if (work / "draft" / "config.json").exists() else None

    prompt_file, rows = load_prompts(args.prompts, args.num_prompts)
    result["prompt_file"] = prompt_file
    max_len = min(1024, ModelConfig.from_dir(model).max_position_embeddings)
    common = dict(device=device, max_model_len=max_len)

    def run(path, dtype, draft_dir=None, batch=None, K=0):
        llm = LLM(model=path, draft=draft_dir, spec_steps=K, dtype=dtype, max_num_seqs=batch or len(rows), **common)
        if not prompts:
            prompts.extend(encode(llm.tokenizer, r)[-(max_len - args.max_tokens - 8) :] for r in rows)
        if batch == 1:  # one prompt at a time
            outs = [
                o
                for p in prompts
                for o in llm.generate([p], SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
            ]
            toks = [o.token_ids for o in outs]
        else:
            toks, outs, _ = greedy(llm, prompts, args.max_tokens)
        return llm, toks, outs

    def compare(ref, llm, toks) -> dict:
        return {**agreement(ref, toks), "teacher_forced_top1": _tf(llm, prompts, ref)}

    prompts: list[list[int]] = []
    low = args.dtype
    small, ref, _ = run(model, low)
    result["num_prompts"] = len(prompts)
    free(small)
    big, out, _ = run(str(work), low)
    # The acceptance criterion: the grown target's greedy tokens vs the small target's, same dtype.
    result["grown_vs_small"] = compare(ref, big, out)
    free(big)
    if low != "float32" and not args.no_float32:
        # Construction check without bf16 rounding: the same checkpoints computed in float32.
        small32, ref32, _ = run(model, "float32")
        result["small_float32_vs_small"] = compare(ref, small32, ref32)  # noise scale: dtype alone
        free(small32)
        big32, out32, _ = run(str(work), "float32")
        result["grown_vs_small_float32"] = compare(ref32, big32, out32)
        free(big32)
    # Noise scale: the small target against itself when only the batch (so the kernels) changes.
    small1, ref1, _ = run(model, low, batch=1)
    result["small_batch1_vs_small"] = compare(ref, small1, ref1)
    free(small1)

    if draft and grown_draft and args.spec_steps > 0:
        spec = {}
        for name, m, d, plain in (("small", model, draft, ref), ("grown", str(work), grown_draft, out)):
            llm, toks, outs = run(m, low, draft_dir=d, K=args.spec_steps)
            cycles = sum(o.spec["cycles"] for o in outs)
            accepted = sum(o.spec["accepted_tokens"] for o in outs)
            spec[name] = {
                "accept_length_mean": 1 + accepted / cycles if cycles else None,
                "accept_per_position": [
                    sum(o.spec["accept_per_position"][i] for o in outs) / len(outs) for i in range(args.spec_steps)
                ],
                # vs the same target's plain output (verify and decode kernels may round differently)
                "agreement_with_plain": agreement(plain, toks)["position_agreement"],
            }
            free(llm)
        result["speculative"] = {"spec_steps": args.spec_steps, **spec}

    g = result["grown_vs_small"]
    result["pass"] = {
        "free_running_95": g["position_agreement"] >= 0.95,
        "teacher_forced_95": g["teacher_forced_top1"] >= 0.95,
    }
    if "grown_vs_small_float32" in result:
        result["pass"]["float32_free_running_95"] = result["grown_vs_small_float32"]["position_agreement"] >= 0.95
    text = json.dumps(result, indent=2)
    path = args.out or (str(Path(os.environ["OUT"]) / "grow_check.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text)
    line = (
        f"grown vs small ({low}): free-running {g['position_agreement']:.4f}, teacher-forced "
        f"{g['teacher_forced_top1']:.4f}; small batch 1 vs batched: "
        f"{result['small_batch1_vs_small']['position_agreement']:.4f}"
    )
    if "grown_vs_small_float32" in result:
        line += f"; float32 grown vs small: {result['grown_vs_small_float32']['position_agreement']:.4f}"
    print(line, file=sys.stderr)
    return 0 if g["teacher_forced_top1"] >= 0.95 else 1


def _tf(llm: LLM, prompts, ref) -> float:
    pred = teacher_forced(llm, prompts, ref)
    hits = sum(sum(a == b for a, b in zip(p, r)) for p, r in zip(pred, ref))
    return hits / sum(len(r) for r in ref)


if __name__ == "__main__":
    raise SystemExit(main())
