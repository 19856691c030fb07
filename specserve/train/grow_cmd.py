"""`specserve grow`: the command line of `specserve.train.grow` (torch is imported only to run)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from specserve.config import ConfigError
from specserve.engine.generate_cmd import device_name
from specserve.train.shapes import OUT_DTYPE_NAMES, PRESETS, READ_MODES, Shape


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="small Llama target directory (default: the bundled demo target)")
    p.add_argument("--draft", help="its EAGLE-3 drafter (default with the demo target: the demo drafter, if present)")
    p.add_argument("--no-draft", action="store_true", help="grow the target only")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="target shape (llama3-8b: 4096 x 32 layers, "
        "32 heads of 128, 8 KV heads, MLP 14336; qwen3-moe-30b-a3b: 2048 x 48 layers, 32 heads of 128, "
        "4 KV heads, 128 experts of 768, top-8, as Mixtral); the flags below override its fields",
    )
    for field in ("hidden", "layers", "heads", "kv-heads", "head-dim", "intermediate"):
        p.add_argument(f"--{field}", type=int, help=f"grown {field.replace('-', ' ')}")
    p.add_argument(
        "--moe",
        type=int,
        metavar="E",
        help="grow into a Mixtral model with E routed experts per layer, "
        "each a copy of the grown MLP (0: dense, overriding an MoE preset)",
    )
    p.add_argument("--moe-top-k", type=int, metavar="K", help="experts chosen per token (with --moe)")
    p.add_argument(
        "--moe-intermediate",
        type=int,
        metavar="I",
        help="each expert's MLP width (default: --intermediate; the drafter keeps --intermediate)",
    )
    p.add_argument("--out", required=True, help="output directory (the drafter goes to OUT/draft)")
    p.add_argument("--dtype", default="bfloat16", choices=OUT_DTYPE_NAMES, help="dtype of the grown weights")
    p.add_argument(
        "--device", default="auto", type=device_name, help="where to build the weights: cpu, cuda, cuda:N or auto"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the identity layers' random (unused) weights")
    p.add_argument("--shard-size-gb", type=float, default=5.0, help="largest safetensors shard")
    p.add_argument(
        "--pad-vocab",
        type=int,
        help="pad the vocabulary to this size (128256 = Llama 3) with tokens "
        "that are never chosen, so the embedding and LM head have the real model's bytes",
    )
    p.add_argument(
        "--read",
        default="one",
        choices=READ_MODES,
        help="how a linear reads duplicated units: 'one' = from the first copy (closest numerics to the "
        "small model, default), 'all' = from every copy with power-of-two weights (no zero weights)",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --out directory")


MOE_FLAGS = {"experts": "moe", "top_k": "moe_top_k", "expert_intermediate": "moe_intermediate"}  # Shape field: flag


def shape_from_args(args: argparse.Namespace) -> Shape:
    base = asdict(PRESETS[args.preset]) if args.preset else {}
    for field in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"):
        value = getattr(args, field)
        if value is not None:
            if value < 1:
                raise ConfigError(f"--{field.replace('_', '-')} must be positive, got {value}")
            base[field] = value
    missing = [f for f in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate") if f not in base]
    if missing:
        raise ConfigError(
            "give --preset or all of --hidden --layers --heads --kv-heads --head-dim --intermediate "
            f"(missing: {', '.join('--' + m.replace('_', '-') for m in missing)})"
        )
    if args.moe == 0:  # dense, whatever the preset says
        base.update(experts=0, top_k=0, expert_intermediate=None)
    for field, flag in MOE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None and (value or field != "experts"):
            if value < 1:
                raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
            base[field] = value
    return Shape(**base)


def run(args: argparse.Namespace) -> int:
    from specserve.engine.llm import demo_paths
    from specserve.train.grow import grow  # imports torch

    try:
        shape = shape_from_args(args)
        model, draft = args.model, args.draft
        if model is None:
            model, demo_draft = demo_paths()
            draft = draft or demo_draft
        if args.no_draft:
            draft = None
        summary = grow(
            model,
            args.out,
            shape,
            draft_dir=draft,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            shard_gb=args.shard_size_gb,
            preset=args.preset,
            force=args.force,
            pad_vocab=args.pad_vocab,
            read=args.read,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0
