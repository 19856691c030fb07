"""The one entry point: `specserve <command> ...`.

Each command lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; these modules import torch only inside `run`, and only the
chosen command's module is imported, so `--help` and torch-free commands
(`launch`, `gpus`, `bench --url`) never pay for importing torch.

Exit status: 0 success, 1 a mistake in what was asked (one line on stderr:
what was wrong), 2 a command line argparse rejects. Internal errors keep their
traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from specserve.config import ConfigError

COMMANDS = {
    "generate": ("specserve.engine.generate_cmd", "generate text (optionally with an EAGLE-3 drafter)"),
    "serve": ("specserve.server.serve_cmd", "OpenAI-compatible HTTP server"),
    "bench": ("specserve.bench.bench_cmd", "benchmark speculation vs plain decoding vs peers"),
    "check": ("specserve.ops.check", "preflight checks of a target/draft pair before loading weights"),
    "launch": ("specserve.ops.supervisor", "supervise a server command: readiness, hang detection, cleanup"),
    "gpus": ("specserve.ops.gpus", "GPU memory and the processes holding each device"),
    "nccl-tune": ("specserve.distributed.nccl_tune", "measure all-reduce latency per NCCL profile, write the best"),
    "train-draft": ("specserve.train.train_draft_cmd", "train an EAGLE-3 drafter for a target"),
    "grow": ("specserve.train.grow_cmd", "widen the demo pair to a larger, function-preserving shape"),
    "dist-key": ("specserve.distributed.dist_key", "make the secret the nodes of a multi-node run share"),
    "convert-gguf": ("specserve.model.gguf", "write a GGUF checkpoint as a Hugging Face folder (safetensors)"),
}


def port_number(text: str) -> int:
    """argparse type of every TCP port flag: 0 (any free port) or 1..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 1-65535 (0 = any free port)")
    return port


def not_shown(default) -> bool:
    """A default with nothing to show: no value, a switch that is off, an empty list (`is`: 0 is shown)."""
    return default is None or default is False or default is argparse.SUPPRESS or default == []


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default after its help, unless the help already names it or there is
    none to show (no value, a switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or not_shown(default) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".lstrip()


class CommandParser(argparse.ArgumentParser):
    """A command's parser: an unknown or misspelt flag is named (with the closest known flag)
    before any other complaint, such as a required flag that the typo left out."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        flags = {s: a for a in self._actions for s in a.option_strings}
        # With a REMAINDER positional (launch's CMD ...) the first positional starts text that is not ours.
        remainder = any(a.nargs == argparse.REMAINDER for a in self._actions)
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--" or (remainder and not token.startswith("-")):
                break
            flag = token.split("=", 1)[0]
            if flag.startswith("--"):
                if flag not in flags:
                    close = difflib.get_close_matches(flag, list(flags), n=1)
                    self.error(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
                if "=" not in token and flags[flag].nargs is None:
                    i += 1  # its value, which may itself start with "--"
            i += 1
        known, extras = super().parse_known_args(args, namespace)
        if extras:  # stray values would otherwise be reported under the top-level usage
            where = args.index(extras[0])
            after = f" after {args[where - 1]}" if where > 0 and args[where - 1].startswith("--") else ""
            hint = " (--json takes no value; --out FILE writes a file)" if after == " after --json" else ""
            self.error(f"unexpected argument {extras[0]!r}{after}{hint}")
        return known, extras


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; `command`'s own flags are added only for that command (the others
    would import their modules)."""
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    from specserve import __version__

    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for name, (module, help_text) in COMMANDS.items():
        # allow_abbrev=False: one spelling per flag, and a prefix is not silently taken for a flag.
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter, allow_abbrev=False
        )
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:  # reports record the command line from sys.argv
        sys.argv = [sys.argv[0], *argv]
    argv = sys.argv[1:]
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:  # a setting or checkpoint that cannot be used: the message says what to do
        print(f"error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:  # a path given on the command line
        print(f"error: {e.filename or e}: no such file or directory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
