"""Tensor parallelism on CPU (gloo): TP2 equals TP1, the worker environment is
what we built and is checked, workers die with their parent, nccl-tune runs,
NCCL profiles merge by the documented rules."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from specserve.config import ConfigError
from specserve.distributed import group as group_mod
from specserve.distributed.nccl_profiles import (
    PRESETS,
    Profile,
    build_worker_env,
    load_profile,
    parse_env_args,
    write_profile,
)
from specserve.engine.llm import LLM
from specserve.engine.protocol import ServingEngine, ServingLLM, missing_members
from specserve.engine.sampling import SamplingParams

from tiny import CODE_PROMPTS

ENGINE = dict(device="cpu", max_num_seqs=4, max_model_len=96)
HANGING_WORKER = Path(__file__).with_name("tp_capture_hang.py")  # a worker whose capture phase stalls


def _tp1(target, draft, params, **kw):
    return LLM(model=str(target), draft=str(draft) if draft else None, **ENGINE, **kw).generate(CODE_PROMPTS, params)


@pytest.mark.slow
def test_tp2_plain_equals_tp1_and_env_reaches_both_workers(pair):
    from specserve.distributed.tp_llm import TPLLM

    target, _ = pair
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = [
        SamplingParams(temperature=1.0, max_tokens=12, seed=5 + i, ignore_eos=True) for i in range(len(CODE_PROMPTS))
    ]
    ref_g, ref_s = _tp1(target, None, greedy), _tp1(target, None, sampled)
    with TPLLM(model=str(target), tp=2, env={"SPECSERVE_TEST_MARK": "tp-42"}, **ENGINE) as llm:
        out_g, out_s = llm.generate(CODE_PROMPTS, greedy), llm.generate(CODE_PROMPTS, sampled)
        report = llm.worker_env()
    assert not _worker_children()  # close() stopped both workers
    assert [o.token_ids for o in out_g] == [o.token_ids for o in ref_g]
    assert [o.text for o in out_g] == [o.text for o in ref_g]
    assert all(len(o.token_ids) == 20 for o in out_g)
    assert [o.token_ids for o in out_s] == [o.token_ids for o in ref_s]
    assert [r["rank"] for r in report] == [0, 1]
    assert len({r["pid"] for r in report}) == 2
    for r in report:  # read back by each worker from /proc/self/environ
        assert r["env"]["SPECSERVE_TEST_MARK"] == "tp-42"
        assert r["env"]["NCCL_NVLS_ENABLE"] == "0"


@pytest.mark.slow
@pytest.mark.parametrize("topk", [1, 3])  # a chain, and a tree (at every batch size here)
def test_tp2_speculative_equals_tp1_greedy_and_seeded_sampling(pair, topk):
    from specserve.distributed.tp_llm import TPLLM

    target, draft = pair
    spec = dict(spec_steps=3, spec_topk=topk, spec_tree_max_batch=len(CODE_PROMPTS))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=11 + i, ignore_eos=True)
        for i in range(len(CODE_PROMPTS))
    ]
    ref_g, ref_s = _tp1(target, draft, greedy, **spec), _tp1(target, draft, sampled, **spec)
    with TPLLM(model=str(target), draft=str(draft), tp=2, **ENGINE, **spec) as llm:
        out_g = llm.generate(CODE_PROMPTS, greedy)
        out_s = llm.generate(CODE_PROMPTS, sampled)
        # Step-wise driving (what the server does) gives the same tokens as generate().
        eng = llm.engine
        seqs = [eng.add_request(p, greedy) for p in llm.encode_prompts(CODE_PROMPTS[:2])]
        while eng.has_work():
            eng.step()
        eng.check_idle_integrity()
        # The server reads the view as it reads an in-process engine (`ServingEngine`, nested members too).
        assert missing_members(eng, ServingEngine) == [] and missing_members(llm, ServingLLM) == []
        assert eng.cfg.spec_topk == topk and len(eng.policy.acceptance(True)) == 3
    assert [o.token_ids for o in out_g] == [o.token_ids for o in ref_g]
    assert [o.token_ids for o in out_s] == [o.token_ids for o in ref_s]
    assert [o.spec["accepted_tokens"] for o in out_g] == [o.spec["accepted_tokens"] for o in ref_g]
    assert sum(o.spec["accepted_tokens"] for o in out_g) > 5  # drafts were really accepted ...
    # ... greedy and sampled (a tree checks sampled drafts against one target draw: fewer accepted)
    assert sum(o.spec["accepted_tokens"] for o in out_s) > (5 if topk == 1 else 0)
    assert max(max(o.spec["accept_per_position"][1:]) for o in out_g) > 0  # beyond the first draft
    assert [s.output_ids for s in seqs] == [o.token_ids for o in ref_g[:2]]
    assert all(s.finish_reason == "length" for s in seqs)


@pytest.mark.slow
def test_tp2_step_wise_logprobs_equal_tp1(pair):
    """Driven step by step (as the server drives it), the TP view carries each token's
    log-probabilities from the workers: those of one process, within all-reduce rounding."""
    from specserve.distributed.tp_llm import TPLLM

    target, draft = pair
    spec = dict(spec_steps=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    ref = _tp1(target, draft, params, **spec)[:2]
    with TPLLM(model=str(target), draft=str(draft), tp=2, **ENGINE, **spec) as llm:
        eng = llm.engine
        seqs = [eng.add_request(p, params) for p in llm.encode_prompts(CODE_PROMPTS[:2])]
        while eng.has_work():
            eng.step()
    for s, r in zip(seqs, ref):
        assert s.output_ids == r.token_ids and len(s.logprobs) == len(r.logprobs) == 16
        for a, b in zip(s.logprobs, r.logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.slow
def test_tp2_adaptive_k_is_synchronized(pair):
    """Each rank times its own steps; without rank 0's K broadcast to all, the
    ranks would pick different K, diverge and fail the digest check."""
    from specserve.distributed.tp_llm import TPLLM

    target, draft = pair
    spec = dict(spec_steps=0, max_spec_steps=3, adaptive=True)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = _tp1(target, draft, greedy, **spec)
    with TPLLM(model=str(target), draft=str(draft), tp=2, **ENGINE, **spec) as llm:
        outs = llm.generate(CODE_PROMPTS, greedy)
        choices = llm.engine.policy.choices
        costs = llm.engine.policy.snapshot()  # asked of rank 0 (bench reports it)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]  # greedy output does not depend on K
    assert len(choices) > 1 and sum(choices.values()) > 8
    assert costs and all(
        row["seeded_ms"] is not None or row["live_ms"] is not None
        for by_context in costs.values()
        for ks in by_context.values()
        for row in ks.values()
    )


def test_missing_variable_fails_startup_naming_worker_and_variable(pair, monkeypatch):
    from specserve.distributed.group import WorkerError
    from specserve.distributed.tp_llm import TPLLM

    target, _ = pair

    def drop(env, rank):  # simulate a launcher that loses a variable on its way to worker 1
        return {k: v for k, v in env.items() if not (rank == 1 and k == "NCCL_PROTO")}

    monkeypatch.setattr(group_mod, "worker_env_hook", drop)
    t0 = time.time()
    with pytest.raises(
        WorkerError, match=r"worker 1 \(pid \d+\): NCCL_PROTO should be 'LL' but the worker sees <unset>"
    ):
        TPLLM(model=str(target), tp=2, env={"NCCL_PROTO": "LL"}, **ENGINE)
    assert time.time() - t0 < 60  # fails at the hello, before loading anything


_PARENT = """
import json, sys, time
from specserve.distributed.tp_llm import TPLLM
llm = TPLLM(model=sys.argv[1], tp=2, device="cpu", max_num_seqs=2, max_model_len=64)
print(json.dumps(llm.worker_pids()), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_killing_the_parent_leaves_no_worker_alive(pair):
    target, _ = pair
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(target)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = parent.stdout.readline()
        pids = json.loads(line)
        assert len(pids) == 2
        workers = [psutil.Process(p) for p in pids]
        assert all(w.is_running() and w.ppid() == parent.pid for w in workers)
        parent.send_signal(signal.SIGKILL)  # no cleanup code runs in the parent
        parent.wait(timeout=10)
        gone, alive = psutil.wait_procs(workers, timeout=120)  # (returns once all are gone: generous for a loaded CI)
        alive = [w for w in alive if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]  # (not a reused pid)
        assert not alive, f"orphaned workers: {[w.pid for w in alive]}"
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.slow
def test_nccl_tune_on_cpu_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "best.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "nccl-tune",
            "--tp",
            "2",
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
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "profiles only matter for NCCL" in r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line.strip() and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [128, 1024]  # bytes = hidden x tokens x 2 (bf16)
    assert [int(row[1]) for row in rows] == [64, 512]
    assert all(float(row[5]) > 0 for row in rows)
    prof = load_profile(str(out))
    assert prof.name == "default" and prof.env == {}
    assert json.loads(out.read_text())["measured"]["tp"] == 2


# ------------------------------------------------------------ profiles (no processes)
def test_profile_merge_rules():
    prof = load_profile("pcie-low-latency")
    assert prof.env["NCCL_PROTO"] == "LL" and prof.env["NCCL_ALGO"] == "Ring"
    assert prof.env["NCCL_BUFFSIZE"] == "16777216" and prof.env["NCCL_NTHREADS"] == "512"
    base = {"PATH": "/bin", "NCCL_ALGO": "Tree", "NCCL_DEBUG": "WARN"}
    w = build_worker_env(base, prof, {"NCCL_PROTO": "Simple", "MY_FLAG": "1"})
    assert w.env["NCCL_ALGO"] == "Tree"  # the operator's own value is never overridden by a profile
    assert any("NCCL_ALGO=Tree kept" in n for n in w.notes)
    assert w.env["NCCL_PROTO"] == "Simple"  # --env is the most explicit choice
    assert w.env["NCCL_P2P_LEVEL"] == "SYS" and w.env["PATH"] == "/bin"
    assert w.env["NCCL_NVLS_ENABLE"] == "0"
    assert w.requested["MY_FLAG"] == "1" and w.requested["NCCL_DEBUG"] == "WARN"
    assert "PATH" not in w.requested
    kept = build_worker_env({"NCCL_NVLS_ENABLE": "1"}, Profile("default"), {})
    assert kept.env["NCCL_NVLS_ENABLE"] == "1" and any("warning" in n for n in kept.notes)
    assert set(PRESETS) >= {"default", "pcie-low-latency"}


def test_profile_files_and_bad_input(tmp_path):
    envfile = tmp_path / "mine.env"
    envfile.write_text("# tuned by hand\nexport NCCL_PROTO=LL\nNCCL_MAX_NCHANNELS='8'\n")
    p = load_profile(str(envfile))
    assert p.name == "mine" and p.env == {"NCCL_PROTO": "LL", "NCCL_MAX_NCHANNELS": "8"}
    js = write_profile(tmp_path / "t.json", "tuned", {"NCCL_ALGO": "Ring"}, {"score_us": 1.0})
    assert load_profile(str(js)).env == {"NCCL_ALGO": "Ring"}
    with pytest.raises(ConfigError, match="neither a preset"):
        load_profile("no-such-profile")
    (tmp_path / "bad.json").write_text('{"env": {"1BAD": "x"}}')
    with pytest.raises(ConfigError, match="not a valid environment variable name"):
        load_profile(str(tmp_path / "bad.json"))
    (tmp_path / "bad.env").write_text("NCCL_PROTO\n")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_profile(str(tmp_path / "bad.env"))
    assert parse_env_args(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_env_args(["NOVALUE"])


def test_tp_config_errors(pair):
    from specserve.distributed.tp_llm import TPLLM

    target, _ = pair
    with pytest.raises(ConfigError, match="num_key_value_heads \\(2\\) is not divisible by 4"):
        TPLLM(model=str(target), tp=4, **ENGINE)
    with pytest.raises(ConfigError, match="neither a preset"):
        TPLLM(model=str(target), tp=2, nccl_profile="nope", **ENGINE)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_with_cuda_graphs_equals_tp1_gpu(pair):
    """On 2 GPUs: NCCL (our own communicator), collectives captured in CUDA graphs, float32."""
    from specserve.distributed.tp_llm import TPLLM

    target, draft = pair
    gpu = dict(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=96, spec_steps=3)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=str(target), draft=str(draft), **gpu).generate(CODE_PROMPTS, greedy)
    with TPLLM(model=str(target), draft=str(draft), tp=2, graph_capture_timeout=60, **gpu) as llm:
        outs = llm.generate(CODE_PROMPTS, greedy)
        info, warnings = llm.info, llm.warnings
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert info["graphs"] > 0 and not warnings, (info, warnings)
    assert info["allreduce"] == "nccl"


@pytest.mark.slow
def test_stalled_graph_capture_falls_back_to_eager_instead_of_hanging(pair, monkeypatch, caplog):
    """A rank stuck in CUDA graph capture (simulated on CPU: the last rank reports the
    capture phase and then sleeps) is killed by the driver after graph_capture_timeout;
    the workers restart without graphs, with a warning, and the outputs are right."""
    from specserve.distributed import tp_llm

    target, _ = pair
    monkeypatch.setattr(tp_llm, "graphs_possible", lambda device: True)
    monkeypatch.setattr(group_mod, "WORKER_ARGS", (str(HANGING_WORKER),))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    t0 = time.time()
    with tp_llm.TPLLM(model=str(target), tp=2, graph_capture_timeout=3, **ENGINE) as llm:
        # Only the restarted pair is alive: the stuck workers were killed, not left behind.
        assert sorted(p.pid for p in _worker_children()) == sorted(llm.worker_pids())
        outs = llm.generate(CODE_PROMPTS[:2], params)
        assert llm.info["graphs_enabled"] is False
        assert len(llm.warnings) == 1 and "restarted the TP workers without CUDA graphs" in llm.warnings[0]
        assert "worker 1 made no progress for 3 s" in llm.warnings[0]
    assert time.time() - t0 < 60
    assert not _worker_children()
    assert [o.token_ids for o in outs] == [o.token_ids for o in _tp1(target, None, params)[:2]]


def _worker_children() -> list:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if (
                "specserve.distributed.worker" in cmd or HANGING_WORKER.name in cmd
            ) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
