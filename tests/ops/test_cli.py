"""The command line as a new user meets it: help, flag errors, one-line errors, output."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from specserve.cli import COMMANDS, HelpFormatter, build_parser, main, not_shown

# Deadlines only bound a hang: a loaded 2-core machine needs many times an idle run.
TIMEOUT = 600


def specserve(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specserve", *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd
    )


def command_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_help_of_every_command_does_not_import_torch():
    code = (
        "import sys\nfrom specserve.cli import main\n"
        "try:\n    main([sys.argv[1], '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"
    )
    for name in COMMANDS:
        r = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=TIMEOUT)
        assert f"specserve {name}" in r.stdout, (name, r.stdout, r.stderr)
        assert r.stderr.strip().endswith("NO-TORCH"), f"`specserve {name} --help` imports torch"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(name):
    p = command_parser(name)
    fmt = HelpFormatter(prog="x")
    for action in p._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        flag = action.option_strings[-1]
        assert action.help, f"{name} {flag} has no help text"
        if not not_shown(action.default):
            assert "default" in fmt._get_help_string(action), f"{name} {flag} does not show its default"


def test_a_misspelt_flag_is_named_with_a_suggestion_and_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--promt", "hello"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "unknown flag --promt (did you mean --prompt?)" in err
    assert "usage: specserve generate" in err
    assert "is required" not in err  # the typo is the mistake, not the missing --prompt


def test_an_unknown_flag_after_valid_ones_shows_the_commands_usage(capsys):
    with pytest.raises(SystemExit):
        main(["check", "--json", "--colour"])
    err = capsys.readouterr().err
    assert "usage: specserve check" in err and "unknown flag --colour" in err


def test_a_stray_value_is_reported_under_the_commands_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--json", "out.json"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: specserve bench" in err
    assert "unexpected argument 'out.json' after --json (--json takes no value; --out FILE writes a file)" in err


def test_flag_values_and_launch_commands_are_not_taken_for_flags():
    args = build_parser("generate").parse_args(["generate", "--prompt", "x", "--stop=--end"])
    assert args.stop == ["--end"]
    args = build_parser("launch").parse_args(["launch", "python", "-m", "http.server", "--bind", "::1"])
    assert args.cmd[-2:] == ["--bind", "::1"]


@pytest.mark.parametrize("port", ["70000", "-1", "65536", "eighty"])
def test_serve_refuses_ports_outside_the_tcp_range(port, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", port])
    assert e.value.code == 2
    assert "--port" in capsys.readouterr().err


def test_serve_accepts_the_port_range():
    for port in ("0", "1", "8000", "65535"):
        assert build_parser("serve").parse_args(["serve", "--port", port]).port == int(port)


def test_flags_are_consistent_across_commands(capsys):
    # --json is a switch everywhere; files are written with --out FILE
    for name in ("generate", "check", "gpus", "nccl-tune", "bench"):
        action = next(a for a in command_parser(name)._actions if "--json" in a.option_strings)
        assert action.nargs == 0, f"{name} --json takes a value"
    args = build_parser("bench").parse_args(["bench", "--json", "--out", "r.json"])
    assert args.json is True and args.out == "r.json"
    # serve adapts by default: only the way out is offered
    serve = command_parser("serve")
    assert "--no-adaptive" in serve._option_string_actions and "--adaptive" not in serve._option_string_actions
    # the target is --model for every command
    assert build_parser("train-draft").parse_args(["train-draft", "--model", "m", "--out", "o"]).model == "m"
    with pytest.raises(SystemExit):
        main(["train-draft", "--target", "m", "--out", "o"])
    assert "unknown flag --target" in capsys.readouterr().err


def test_a_bad_device_name_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--device", "tpu"])
    assert e.value.code == 2 and "expected cpu, cuda, cuda:N or auto" in capsys.readouterr().err


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], errors[0]


def test_a_prompt_longer_than_max_model_len_is_one_line():
    r = specserve("generate", "--prompt", "x = 1\n" * 100, "--max-model-len", "64", "--max-tokens", "4")
    _one_line_error(r, "--max-model-len is 64", "tokens")


def test_user_errors_print_one_line(tmp_path):
    _one_line_error(specserve("generate", "--prompt", "x", "--model", str(tmp_path / "nope")), "neither a Hugging Face")
    _one_line_error(specserve("bench", "--prompts", str(tmp_path / "nope.jsonl")), "not found")
    _one_line_error(
        specserve("train-draft", "--model", str(tmp_path / "nope"), "--data", "d", "--out", str(tmp_path / "o")),
        "config.json",
    )


def test_config_errors_raised_by_a_command_are_one_line(monkeypatch, capsys):
    from specserve.config import ConfigError
    from specserve.ops import gpus

    def fail(args):
        raise ConfigError("--devices 9: no such GPU")

    monkeypatch.setattr(gpus, "run", fail)
    assert main(["gpus"]) == 1
    assert capsys.readouterr().err == "error: --devices 9: no such GPU\n"


@pytest.mark.parametrize(
    "flags, module", [(["--plot", "r.png"], "matplotlib"), (["--url", "http://127.0.0.1:9"], "httpx")]
)
def test_a_missing_extra_is_named_before_the_bench_runs(flags, module, monkeypatch, capsys):
    """--plot and --url need the `bench` extra's packages: without one, bench says which extra
    installs it before loading a model (not after a run whose results would then be lost)."""
    from specserve.bench import offline, online

    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    monkeypatch.setattr(offline, "run_offline", lambda *a, **k: pytest.fail("the bench ran"))
    monkeypatch.setattr(online, "run_online", lambda *a, **k: pytest.fail("the bench ran"))
    assert main(["bench", "--device", "cpu", *flags]) == 1
    err = capsys.readouterr().err
    assert f"needs the Python package '{module}'" in err and "pip install 'specserve[bench]'" in err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_max_num_seqs_zero_is_an_error_not_the_default(command, capsys):
    args = [command, "--max-num-seqs", "0", "--device", "cpu"] + (["--prompt", "x"] if command == "generate" else [])
    assert main(args) == 1
    assert "--max-num-seqs must be at least 1, got 0" in capsys.readouterr().err


def test_internal_errors_keep_their_traceback(monkeypatch):
    from specserve.ops import gpus

    def bug(args):
        raise KeyError("a bug")

    monkeypatch.setattr(gpus, "run", bug)
    with pytest.raises(KeyError):
        main(["gpus"])


def test_several_prompts_are_labelled_and_a_length_stop_is_explained():
    r = specserve(
        "generate",
        "--prompt",
        "def add(a, b):",
        "--prompt",
        "import os",
        "--max-tokens",
        "200",
        "--max-model-len",
        "32",
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    assert "[1/2] 'def add(a, b):'" in r.stdout and "[2/2] 'import os'" in r.stdout
    assert r.stdout.index("[1/2]") < r.stdout.index("[2/2]")
    notes = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 2 and all('finish reason "length"' in n and "--max-model-len 32" in n for n in notes)


def test_nccl_tune_writes_nothing_unasked(tmp_path):
    r = specserve(
        "nccl-tune",
        "--tp",
        "2",
        "--hidden",
        "64",
        "--tokens",
        "1",
        "--iters",
        "2",
        "--runs",
        "1",
        "--device",
        "cpu",
        "--profiles",
        "default",
        "--json",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []
    assert "not written (--out FILE" in r.stdout
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["best"]["path"] is None


def test_generate_chat_sends_the_prompt_through_the_chat_template():
    from specserve.config import DEMO_DIR
    from specserve.engine.tokenizer import Tokenizer

    r = specserve("generate", "--prompt", "hi", "--chat", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tok = Tokenizer(DEMO_DIR)
    assert out["prompt_token_ids"] == tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert tok.end_of_turn_id == tok.tok.token_to_id("<|im_end|>") is not None  # the reply's stop token
