"""Grow the demo pair to an 8B shape and check that it still computes the demo's output.

    python benchmarks/grow_check.py [--preset llama3-8b] [--dtype bfloat16] [--max-tokens 128]
                                    [--work /tmp/specserve-grown] [--out $OUT/grow_check.json]

One GPU (or --device cpu with a small preset such as demo-mid). Steps:
  1. `specserve grow` the demo target (+ drafter, if bundled) into --work (timed);
  2. greedy outputs (ignore_eos, --max-tokens) of the small target and of the grown
     target over the bench prompts, both in --dtype;
  3. agreement: per-position free-running agreement (the acceptance criterion: >= 95%),
     mean first divergence, and teacher-forced top-1 agreement (the grown target fed
     the small target's tokens); for scale, the same numbers for the small target
     in float32 against itself in --dtype;
  4. with a drafter: speculative greedy runs of both pairs (K = --spec-steps):
     acceptance lengths, and whether the grown pair's output equals its plain output.
Writes one JSON object (to --out, default $OUT/grow_check.json, else stdout).
"""

from __future__ import annotations

import argparse
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
from specserve.train.grow import PRESETS, grow  # noqa: E402


def load_prompts(path: str | None, limit: int) -> tuple[str, list[dict]]:
    candidates = [Path(path)] if path else [Path(__file__).resolve().parents[1] / "specserve/bench/prompts.jsonl",
                                            DEMO_DIR / "heldout_prompts.jsonl"]
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
    out = []
    for p, c in zip(prompts, conts):
        ids = torch.tensor([p + c[:-1]], device=runner.device)
        pos = torch.arange(ids.shape[1], device=runner.device)[None]
        hidden, _ = runner.target(ids, ForwardContext(0, pos, pos, ids.shape[1]))
        out.append(runner.target.logits(hidden[0, len(p) - 1:]).argmax(-1).tolist())
    return out


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict:
    pos = sum(sum(a == b for a, b in zip(r, o)) for r, o in zip(ref, other))
    total = sum(len(r) for r in ref)
    first = []
    for r, o in zip(ref, other):
        d = next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r))
        first.append(d)
    return {"positions": total, "position_agreement": pos / total, "identical_sequences": sum(f == len(r) for f, r in
            zip(first, ref)), "sequences": len(ref), "mean_first_divergence": sum(first) / len(first)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--model", help="small target (default: the demo target)")
    ap.add_argument("--draft", help="its drafter (default: the demo drafter if bundled)")
    ap.add_argument("--pad-vocab", type=int, help="also pad the vocabulary (128256 = Llama 3 size)")
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
    result: dict = {"preset": args.preset, "pad_vocab": args.pad_vocab, "dtype": args.dtype, "device": device, "small_model": str(model),
                    "small_draft": draft, "max_tokens": args.max_tokens}
    if torch.cuda.is_available() and device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(0)

    if not (args.reuse and (work / "config.json").exists()):
        result["grow"] = grow(model, work, PRESETS[args.preset], draft_dir=draft, dtype=args.dtype, device=device,
                              preset=args.preset, force=True, pad_vocab=args.pad_vocab)
        print(f"grown in {result['grow']['seconds']} s -> {work}", file=sys.stderr)
    grown_draft = str(work / "draft") if (work / "draft" / "config.json").exists() else None

    prompt_file, rows = load_prompts(args.prompts, args.num_prompts)
    result["prompt_file"] = prompt_file
    max_len = min(1024, ModelConfig.from_dir(model).max_position_embeddings)
    common = dict(device=device, max_num_seqs=len(rows), max_model_len=max_len)

    small = LLM(model=model, dtype=args.dtype, **common)
    prompts = [encode(small.tokenizer, r)[-(max_len - args.max_tokens - 8):] for r in rows]
    result["num_prompts"] = len(prompts)
    ref, _, secs = greedy(small, prompts, args.max_tokens)
    result["small_plain_seconds"] = round(secs, 3)
    free(small)
    if args.dtype != "float32":  # scale: what the dtype alone does to the small model
        small32 = LLM(model=model, dtype="float32", **common)
        ref32, _, _ = greedy(small32, prompts, args.max_tokens)
        result["small_float32_vs_small"] = agreement(ref, ref32)
        result["small_float32_vs_small"]["teacher_forced_top1"] = _tf(small32, prompts, ref)
        free(small32)

    big = LLM(model=str(work), dtype=args.dtype, **common)
    out, _, secs = greedy(big, prompts, args.max_tokens)
    result["grown_plain_seconds"] = round(secs, 3)
    result["grown_vs_small"] = agreement(ref, out)
    result["grown_vs_small"]["teacher_forced_top1"] = _tf(big, prompts, ref)
    free(big)

    if draft and grown_draft and args.spec_steps > 0:
        spec = {}
        for name, m, d in (("small", model, draft), ("grown", str(work), grown_draft)):
            llm = LLM(model=m, draft=d, spec_steps=args.spec_steps, dtype=args.dtype, **common)
            toks, outs, secs = greedy(llm, prompts, args.max_tokens)
            cycles = sum(o.spec["cycles"] for o in outs)
            accepted = sum(o.spec["accepted_tokens"] for o in outs)
            # vs the same target's plain output (in bf16 verify/decode kernels may round differently)
            vs_plain = agreement(ref if name == "small" else out, toks)["position_agreement"]
            spec[name] = {"accept_length_mean": 1 + accepted / cycles if cycles else None, "seconds": round(secs, 3),
                          "agreement_with_plain": vs_plain}
            free(llm)
        result["speculative"] = {"spec_steps": args.spec_steps, **spec}

    agree = result["grown_vs_small"]["position_agreement"]
    result["pass"] = agree >= 0.95
    text = json.dumps(result, indent=2)
    path = args.out or (str(Path(os.environ["OUT"]) / "grow_check.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
    print(text)
    print(f"greedy position agreement grown vs small: {agree:.4f} ({'PASS' if result['pass'] else 'FAIL'} >= 0.95)",
          file=sys.stderr)
    return 0 if result["pass"] else 1


def _tf(llm: LLM, prompts, ref) -> float:
    pred = teacher_forced(llm, prompts, ref)
    hits = sum(sum(a == b for a, b in zip(p, r)) for p, r in zip(pred, ref))
    return hits / sum(len(r) for r in ref)


if __name__ == "__main__":
    raise SystemExit(main())
