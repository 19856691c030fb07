"""`specserve train-draft`: the command line of `specserve.train.train_draft` (torch is imported
only to run)."""

from __future__ import annotations

import argparse

from specserve.engine.generate_cmd import device_name


def _int_pair(s: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {s!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {s!r}")
    return lo, hi


def _int_list(s: str, least: int = 1) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}") from None
    if not out or min(out) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target model directory (Hugging Face layout)")
    p.add_argument("--data", help='.jsonl ("text" or chat "messages"), .txt, .npy token stream, or a folder')
    p.add_argument("--out", required=True, help="drafter output directory (config.json + model.safetensors)")
    p.add_argument("--val-data", help="held-out data for the per-step agreement report (same formats as --data)")
    p.add_argument(
        "--val-samples",
        type=int,
        default=0,
        metavar="N",
        help="hold the last N training samples out (regenerated ones: the target's own answers) "
        "and report agreement and acceptance length on them at the end",
    )
    p.add_argument("--from", dest="from_dir", help="fine-tune this existing drafter instead of starting fresh")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="draft vocabulary size: the N most frequent target tokens (default min(32000, vocab))",
    )
    p.add_argument(
        "--draft-intermediate",
        type=int,
        default=None,
        help="drafter MLP width (default: the target's intermediate size)",
    )
    p.add_argument("--ttt-steps", type=int, default=5, help="unrolled training-time-test steps (default 5)")
    p.add_argument(
        "--aux-layer-ids",
        type=lambda s: _int_list(s, least=0),
        default=None,
        metavar="I,J,K",
        help="the 3 target layers whose outputs feed the drafter (0-based, as eagle_aux_hidden_state_"
        "layer_ids; default EAGLE-3's 1, L/2-1, L-4)",
    )
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the training data")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall-clock budget for regeneration + training (the lr schedule follows it)",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3 fresh, 5e-5 with --from)")
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--max-len", type=int, default=512, help="longest training sample; longer ones are cut")
    p.add_argument(
        "--regenerate",
        action="store_true",
        help="let the target write the responses/continuations first and train on those",
    )
    p.add_argument(
        "--regen-prompts", type=int, default=None, help="number of prompts to regenerate (default: from data size)"
    )
    p.add_argument("--regen-max-tokens", type=int, default=256, help="new tokens per regenerated sample, at most")
    p.add_argument("--regen-temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--regen-prompt-len",
        type=_int_pair,
        default=(32, 192),
        metavar="LO,HI",
        help="prompt prefix length range in tokens for plain-text data",
    )
    p.add_argument(
        "--regen-share",
        type=float,
        default=0.35,
        help="share of --max-minutes that regeneration may answer for, counted from when it "
        "starts (after the data is read and tokenized)",
    )
    p.add_argument("--regen-batch", type=int, default=64, help="sequences generated at once")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints in OUT/checkpoint")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUT/checkpoint: its drafter (fresh or --from), vocabulary, taps and lr come "
        "from the checkpoint, so --from may be repeated or left out; contradicting flags are refused",
    )
    p.add_argument(
        "--keep-checkpoint",
        action="store_true",
        help="keep OUT/checkpoint after finishing (a run its time budget ends saves one there)",
    )
    p.add_argument(
        "--lr-minutes",
        type=float,
        default=None,
        help="training minutes the lr schedule spans, over all --resume calls of a run (default: to "
        "the end of this call's --max-minutes)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of data order, initial weights and sampling")
    p.add_argument("--device", default="auto", type=device_name, help="cpu, cuda, cuda:N or auto")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: switch between 1 and all, whichever is faster now)",
    )
    p.add_argument(
        "--bf16",
        dest="bf16",
        action="store_true",
        default=None,
        help="bf16 autocast for the drafter (default: on GPU, and on CPUs with AVX512-BF16/AMX)",
    )
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train the drafter in float32")
    p.add_argument(
        "--feature-cache-gb",
        type=float,
        default=None,
        help="RAM for caching target features across epochs (default on CPU: 1/4 of free RAM, max 8)",
    )
    p.add_argument(
        "--eval-prompts",
        help="after training, measure greedy acceptance length on these prompts "
        '(.jsonl with "prompt", or one prompt per line)',
    )
    p.add_argument(
        "--eval-spec-steps",
        type=_int_list,
        default=(4,),
        metavar="K[,K...]",
        help="draft lengths K at which --eval-prompts measures acceptance",
    )
    p.add_argument("--eval-max-tokens", type=int, default=128, help="new tokens per --eval-prompts prompt")
    p.add_argument("--eval-only", action="store_true", help="only measure the drafter already in --out")


def run(args: argparse.Namespace) -> int:
    from specserve.train import train_draft  # imports torch

    return train_draft.run(args)
