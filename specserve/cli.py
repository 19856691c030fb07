"""The one entry point: `specserve <command> ...`.

Each command lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; modules are imported only when their command runs, so
`specserve launch` or `specserve gpus` never pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("specserve.engine.generate_cmd", "generate text (optionally with an EAGLE-3 drafter)"),
    "serve": ("specserve.server.serve_cmd", "OpenAI-compatible HTTP server"),
    "bench": ("specserve.bench.bench_cmd", "benchmark speculation vs plain decoding vs peers"),
    "check": ("specserve.ops.check", "preflight checks of a target/draft pair before loading weights"),
    "launch": ("specserve.ops.supervisor", "supervise a server command: readiness, hang detection, cleanup"),
    "gpus": ("specserve.ops.gpus", "GPU memory and the processes holding each device"),
    "nccl-tune": ("specserve.distributed.nccl_tune", "measure all-reduce latency per NCCL profile, write the best"),
    "train-draft": ("specserve.train.train_draft", "train an EAGLE-3 drafter for a target"),
    "grow": ("specserve.train.grow", "widen the demo pair to a larger, function-preserving shape"),
    "convert-gguf": ("specserve.model.gguf", "write a GGUF checkpoint as a Hugging Face folder (safetensors)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    from specserve import __version__

    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = sys.argv[1] if len(sys.argv) > 1 else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen command's module is imported (help lists all names).
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:])
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
