"""Tensor parallelism across nodes, on CPU: two "nodes" on 127.0.0.1, each its own
launcher process (`specserve generate|serve --nnodes 2 --node-rank R`) with its own
worker, joined in one gloo group. Output equals one process; every worker of both
nodes reports the environment; a node that dies or never joins ends the other."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
import torch

from specserve.config import ConfigError, ParallelConfig
from specserve.engine.llm import LLM
from specserve.engine.sampling import SamplingParams

from nodes import ENGINE, WAIT, finish, free_port_pair, generate_args, start_node
from tiny import CODE_PROMPTS  # prompts on which the lagging drafter is accepted


# ------------------------------------------------------------------ flags (no processes)
def test_bad_node_flags_are_one_line_errors():
    cases = [
        (dict(tp=2, nnodes=2), "--nnodes 2 needs --dist-init-addr HOST:PORT"),
        (dict(tp=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "--node-rank 2 is out of range for --nnodes 2"),
        (dict(tp=3, nnodes=2, dist_init_addr="h:1"), "--tp 3 is not divisible by --nnodes 2"),
        (dict(tp=2, nnodes=2, dist_init_addr="10.0.0.1"), "expected HOST:PORT"),
        (dict(tp=2, nnodes=2, dist_init_addr="h:65535"), "port must be 1..65534"),
        (dict(tp=2, nnodes=2, dist_init_addr=":29500"), "expected HOST:PORT"),
        (dict(tp=2, dist_init_addr="h:1"), "only used with --nnodes > 1"),
        (dict(tp=2, nnodes=0), "--nnodes must be at least 1"),
        (dict(tp=2, nnodes=2, dist_init_addr="h:1", dist_timeout=0), "--dist-timeout must be positive"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace("+", r"\+")) as e:
            ParallelConfig(**kw)
        assert "\n" not in str(e.value)
    assert ParallelConfig(tp=4, nnodes=2, node_rank=1, dist_init_addr="[::1]:29500").local_tp == 2


def test_cli_reports_a_bad_address_before_loading(capsys):
    from specserve.cli import main

    assert main(["generate", "--prompt", "x", "--tp", "2", "--nnodes", "2", "--dist-init-addr", "nohost"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --dist-init-addr 'nohost': expected HOST:PORT, e.g. 10.0.0.1:29500"


# ------------------------------------------------------------------ two nodes
@pytest.mark.slow
def test_two_nodes_equal_one_process_and_every_worker_reports_env(pair):
    target, draft = pair
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(
        model=str(target), draft=str(draft), spec_steps=3, device="cpu", max_model_len=96, max_num_seqs=4
    ).generate(CODE_PROMPTS, greedy)
    port = free_port_pair()
    args = generate_args(target, draft, ["--env", "SPECSERVE_TEST_MARK=mn-7"])
    node1 = start_node("generate", 1, port, args)
    node0 = start_node("generate", 0, port, [*args, "--nccl-profile", "pcie-low-latency"])  # node 0's choice only
    (c0, out0, err0), (c1, _, err1) = finish(node0, node1)
    assert c0 == 0, err0
    assert c1 == 0, err1  # the headless node exits by itself when node 0 is done
    outs = [json.loads(line) for line in out0.splitlines()]
    assert [o["token_ids"] for o in outs] == [o.token_ids for o in ref]
    assert [o["stats"]["accepted_tokens"] for o in outs] == [o.spec["accepted_tokens"] for o in ref]
    assert sum(o["stats"]["accepted_tokens"] for o in outs) > 5  # drafts really were accepted across nodes
    # Each worker read its environment from /proc/self/environ and reported it to node 0.
    lines = [line for line in err0.splitlines() if " env: " in line]
    for rank, node in ((0, 0), (1, 1)):
        mine = [line for line in lines if f"worker {rank}{' (node 1)' if node else ' (node 0)'} (pid" in line]
        assert len(mine) == 1, lines
        assert "SPECSERVE_TEST_MARK=mn-7" in mine[0] and "NCCL_NVLS_ENABLE=0" in mine[0]
        assert "NCCL_PROTO=LL" in mine[0] and "NCCL_ALGO=Ring" in mine[0]  # node 0's profile, on both nodes
    assert "node 0 finished" in err1


@pytest.mark.slow
def test_an_nccl_variable_only_on_node_1_fails_start_up_naming_node_worker_and_variable(pair):
    target, _ = pair
    port = free_port_pair()
    args = generate_args(target, None)
    node1 = start_node("generate", 1, port, args, env={"NCCL_ALGO": "Tree"})
    node0 = start_node("generate", 0, port, args)
    (c0, _, err0), (c1, _, err1) = finish(node0, node1)
    assert c0 == 1 and c1 == 1
    assert "node 0 ended after an error (start-up failed on node 0: the nodes' environments differ" in err1
    assert "node 1 worker 1 (pid" in err0 and "NCCL_ALGO='Tree' is set there but not on node 0's workers" in err0


@pytest.mark.slow
def test_nodes_started_with_different_tp_both_refuse(pair):
    target, _ = pair
    port = free_port_pair()
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specserve",
            "generate",
            "--tp",
            "4",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--dist-init-addr",
            f"127.0.0.1:{port}",
            "--dist-timeout",
            "60",
            *ENGINE,
            "--prompt",
            "x",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    node0 = start_node("generate", 0, port, generate_args(target, None))
    (c0, _, err0), (c1, _, err1) = finish(node0, node1)
    want = "node 1 was started with --tp 4 --nnodes 2, node 0 with --tp 2 --nnodes 2"
    assert c0 == 1 and want in err0
    assert c1 == 1 and f"node 0 refused this node: {want}" in err1


@pytest.mark.slow
def test_bench_runs_one_group_per_config_on_the_same_nodes(pair, tmp_path):
    """bench starts a group per config: node 1 starts its workers again for each."""
    target, draft = pair
    port = free_port_pair()
    args = [
        "--model",
        str(target),
        "--draft",
        str(draft),
        "--configs",
        "baseline",
        "eagle3:steps=2",
        "--batch-sizes",
        "1",
        "--num-prompts",
        "1",
        "--max-tokens",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]
    node1 = start_node("bench", 1, port, args)
    node0 = start_node("bench", 0, port, [*args, "--out", str(tmp_path / "b.json")])
    (c0, _, err0), (c1, _, err1) = finish(node0, node1)
    assert c0 == 0, err0
    assert c1 == 0, err1
    assert "started workers [1] for group 1" in err1 and "started workers [1] for group 2" in err1
    result = json.loads((tmp_path / "b.json").read_text())
    assert [r["config"] for r in result["results"]] == ["baseline", "eagle3:steps=2"]


@pytest.mark.slow
def test_a_node_that_never_joins_fails_within_the_timeout():
    port = free_port_pair()
    t0 = time.monotonic()
    ((c0, _, err0),) = finish(start_node("generate", 0, port, ["--prompt", "x"], timeout=4))
    assert c0 == 1 and "node(s) [1] did not join within --dist-timeout 4 s" in err0
    ((c1, _, err1),) = finish(start_node("generate", 1, port, ["--prompt", "x"], timeout=4))
    assert c1 == 1 and f"cannot reach node 0 at 127.0.0.1:{port + 1}" in err1
    assert time.monotonic() - t0 < WAIT


def _wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError("node 0 never became healthy")


def _assert_all_gone(members: list) -> None:
    gone, alive = psutil.wait_procs(members, timeout=WAIT)  # (returns once all are gone; a loaded CI took > 30 s)
    # (is_running: false for a pid the kernel has since reused, e.g. for a kworker thread)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[p.pid for p in alive]}"


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_killing_one_node_ends_the_other_with_no_process_left(pair, killed):
    target, _ = pair
    port, http = free_port_pair(), free_port_pair()
    args = ["--model", str(target), "--max-num-seqs", "2", "--skip-check"]
    node1 = start_node("serve", 1, port, args, timeout=60)
    node0 = start_node("serve", 0, port, [*args, "--port", str(http)], timeout=60)
    try:
        _wait_healthy(f"http://127.0.0.1:{http}", node0, time.monotonic() + WAIT)
        # What the nodes started, taken while each is still a descendant of its node (a session-wide view, as
        # ProcessTree has, would also count whatever else this test's session runs meanwhile).
        nodes = [psutil.Process(node0.pid), psutil.Process(node1.pid)]
        members = nodes + [c for n in nodes for c in n.children(recursive=True)]
        workers = [p for p in members if "specserve.distributed.worker" in " ".join(p.cmdline())]
        assert len(workers) == 2  # one worker on each node
        victim, other = (node1, node0) if killed == 1 else (node0, node1)
        victim.send_signal(signal.SIGKILL)  # no cleanup code runs on the killed node
        _, err = other.communicate(timeout=WAIT)
        assert other.returncode == 1
        if killed == 1:
            assert "node 1 (" in err and "went away" in err
        else:
            assert "error: node 1: lost node 0 at 127.0.0.1" in err and "stopped this node's workers" in err
        _assert_all_gone(members)
    finally:
        _kill(node0, node1)


@pytest.mark.slow
def test_nccl_tune_across_two_nodes(tmp_path):
    port = free_port_pair()
    out = tmp_path / "best.json"
    tune = [
        sys.executable,
        "-m",
        "specserve",
        "nccl-tune",
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{port}",
        "--dist-timeout",
        "60",
        "--hidden",
        "64",
        "--tokens",
        "1",
        "8",
        "--iters",
        "10",
        "--runs",
        "3",
        "--device",
        "cpu",
    ]
    node1 = subprocess.Popen([*tune, "--node-rank", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen(
        [*tune, "--node-rank", "0", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    (c0, out0, err0), (c1, _, err1) = finish(node0, node1)
    assert c0 == 0, err0
    assert c1 == 0, err1
    rows = [line.split() for line in out0.splitlines() if line.strip() and not line.startswith("#")]
    assert [int(row[1]) for row in rows] == [64, 512] and all(float(row[5]) > 0 for row in rows)
    assert json.loads(out.read_text())["measured"]["tp"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nodes_on_two_gpus_with_nccl_and_graphs_equal_one_gpu(pair):
    """Two "nodes" of one GPU each (CUDA_VISIBLE_DEVICES 0 and 1): NCCL across them, CUDA graphs."""
    target, draft = pair
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(
        model=str(target),
        draft=str(draft),
        spec_steps=3,
        device="cuda",
        dtype="float32",
        max_model_len=96,
        max_num_seqs=4,
    ).generate(CODE_PROMPTS, greedy)
    port = free_port_pair()
    args = generate_args(target, draft)
    gpu = ["--device", "cuda", "--dtype", "float32", "--max-model-len", "96"]
    procs = []
    for rank in (1, 0):
        cmd = [
            sys.executable,
            "-m",
            "specserve",
            "generate",
            "--tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--dist-init-addr",
            f"127.0.0.1:{port}",
            *gpu,
            *args,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)},
            )
        )
    (c1, _, err1), (c0, out0, err0) = finish(*procs)
    assert c0 == 0, err0
    assert c1 == 0, err1
    assert [json.loads(line)["token_ids"] for line in out0.splitlines()] == [o.token_ids for o in ref]
    assert re.search(r"workers ready: all-reduce nccl, [1-9]\d* CUDA graphs", err0), err0


def _stream(url: str, prompt: str, lines: list[str], first) -> None:
    """One greedy completion stream; its SSE lines, until the server closes it."""
    import httpx

    body = {"model": "x", "prompt": prompt, "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=WAIT) as c, c.stream("POST", url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
                    first.set()
    except httpx.HTTPError as e:  # a connection cut without [DONE] is what the test must not see
        lines.append(f"transport error: {e}")


@pytest.mark.slow
def test_losing_node_1_mid_stream_ends_every_stream_with_an_error_and_exits_non_zero(pair):
    import threading

    import httpx

    target, _ = pair
    port, http = free_port_pair(), free_port_pair()
    dist_timeout = 60
    args = [
        "--model",
        str(target),
        "--max-num-seqs",
        "2",
        "--skip-check",
        "--served-model-name",
        "x",
        "--max-model-len",
        "512",
    ]  # (after ENGINE's 96: long streams, still in flight at the kill)
    node1 = start_node("serve", 1, port, args, timeout=dist_timeout)
    node0 = start_node("serve", 0, port, [*args, "--port", str(http)], timeout=dist_timeout)
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_healthy(url, node0, time.monotonic() + WAIT)
        nodes = [psutil.Process(node0.pid), psutil.Process(node1.pid)]
        members = nodes + [c for n in nodes for c in n.children(recursive=True)]
        streams = [([], threading.Event()) for _ in range(2)]
        threads = [
            threading.Thread(target=_stream, args=(url, p, lines, first), daemon=True)
            for p, (lines, first) in zip(CODE_PROMPTS, streams)
        ]
        for t in threads:
            t.start()
        for _, first in streams:
            assert first.wait(WAIT), "a stream produced nothing"
        node1.send_signal(signal.SIGKILL)
        health = []
        while node0.poll() is None:  # what /health says until node 0 is gone
            try:
                health.append(httpx.get(url + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                health.append("closed")
            time.sleep(0.2)
        for t in threads:
            t.join(WAIT)
        _, err = node0.communicate(timeout=dist_timeout)  # it exited within --dist-timeout of the kill
        assert node0.returncode == 1, err
        assert "node 1 (" in err and "went away" in err
        for lines, _ in streams:
            assert lines[-1] == "data: [DONE]", lines[-3:]
            errors = [json.loads(x[6:])["error"] for x in lines if x.startswith("data: {") and '"error"' in x]
            assert len(errors) == 1 and "node 1" in errors[0]["message"], lines[-3:]
        assert 200 not in health[1:], health  # (the first probe may precede node 0 noticing the loss)
        _assert_all_gone(members)
    finally:
        _kill(node0, node1)
