"""Draft-free speculation (`--speculative-method ngram | suffix`): drafts from the text itself,
verified by the same chain and tree paths as EAGLE-3's; greedy output equals plain output."""

from __future__ import annotations

import pytest
import torch

from specserve.config import ConfigError, EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.spec.ngram import NgramProposer
from specserve.spec.suffix import SuffixProposer, SuffixTrie

VOCAB = 12


@pytest.fixture(scope="module")
def target(make_pair):
    return make_pair(vocab=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, draft={"draft_vocab": 8})[0]


def _run(target, prompts, params, **kw):
    engine = Engine(EngineConfig(model=str(target), device="cpu", max_num_seqs=len(prompts), **kw))
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    return [s.output_ids for s in seqs], engine


def _prompts(n, seed=0):
    """Prompts that repeat a piece of themselves, as edits of given text do."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        piece = torch.randint(0, VOCAB - 1, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        out.append(piece + [3] + piece + piece[: len(piece) // 2])
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _seq(tokens, tenant=None):
    return Sequence("s", list(tokens), SamplingParams(tenant=tenant), 0)


def test_ngram_drafts_what_followed_the_last_match():
    p = NgramProposer(2, 3)
    assert p.propose(_seq([1, 2, 3, 4, 1, 2]), 3) == [3, 4, 1]  # "1 2" ended at 2 before: 3 4 1 followed
    assert p.propose(_seq([5, 6, 7]), 3) == []
    seq = _seq([1, 2, 9, 1, 2, 8, 1, 2])
    assert p.propose(seq, 2) == [8, 1]  # the latest occurrence wins
    seq.output_ids += [8, 7]
    assert p.propose(seq, 4) == []  # "8 7" never occurred before: nothing (n_min 2)
    seq.output_ids += [1, 2, 8]
    assert p.propose(seq, 4) == [7, 1, 2, 8]  # the index grew with the text: "1 2 8" ended at 9


def test_suffix_trie_counts_and_takes_back():
    t = SuffixTrie(depth=4)
    t.add([1, 2, 3, 1, 2, 4])
    node, n = t.match([7, 1, 2], 3)
    assert n == 2 and {k: c.count for k, c in node.children.items()} == {3: 1, 4: 1}
    t.add([1, 2, 4])
    node, _ = t.match([1, 2], 3)
    assert node.children[4].count == 2
    t.add([1, 2, 3, 1, 2, 4], sign=-1)
    t.add([1, 2, 4], sign=-1)
    assert not t.root.children  # every count taken back: nothing left


def test_suffix_scores_by_frequency_and_builds_trees():
    p = SuffixProposer()
    seq = _seq([5, 1, 2, 3, 6, 1, 2, 4, 8, 1, 2, 4, 9, 1, 2])
    assert p.propose(seq, 2) == [4, 8]  # 4 followed "1 2" twice, 3 once
    nodes = p.propose_tree(seq, 2, 3)
    assert nodes == [(4, 0, 1), (3, 0, 1), (8, 1, 2)]  # by probability: 2/3, 1/3, 2/3 * 1/2
    assert all(parent <= j for j, (_, parent, _) in enumerate(nodes))  # parents before children


def test_suffix_tenants_are_isolated_and_bounded():
    p = SuffixProposer(tenant_tokens=20, max_tenants=2)
    secret = [9, 8, 7, 6, 5, 4]
    done = _seq([1, 2] + secret, tenant="alice")
    p.propose(done, 4)
    p.finished(done)
    assert p.propose(_seq([0, 1, 2], tenant="alice"), 4) == secret[:4]  # alice's own history drafts for her
    assert p.propose(_seq([0, 1, 2], tenant="bob"), 4) == []  # never another tenant's text
    assert p.propose(_seq([0, 1, 2]), 4) == []  # nor for a request without a tenant
    for i in range(3):  # alice's texts beyond 20 tokens push the oldest out
        p.finished(_seq([10 + i] * 10, tenant="alice"))
    assert p.propose(_seq([0, 1, 2], tenant="alice"), 4) == []
    p.finished(_seq([1, 2, 3], tenant="carol"))
    p.finished(_seq([1, 2, 3], tenant="dave"))
    assert "alice" not in p.tenants and len(p.tenants) == 2  # the least recently used tenant left


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_draft_free_speculation_is_token_identical(target, method, batch):
    prompts = _prompts(batch, seed=batch)
    base, _ = _run(target, prompts, GREEDY)
    for K in (1, 4):
        out, engine = _run(target, prompts, GREEDY, spec_method=method, spec_steps=K)
        assert out == base, f"{method} K={K}"
        assert engine.runner.drafter is None and engine.totals.cycles > 0
        assert engine.totals.accepted > 0


@pytest.mark.parametrize("batch", [1, 2])
def test_suffix_trees_are_token_identical(target, batch):
    prompts = _prompts(batch, seed=10 + batch)
    base, _ = _run(target, prompts, GREEDY)
    out, engine = _run(target, prompts, GREEDY, spec_method="suffix", spec_steps=4, spec_topk=2, spec_tokens=6)
    assert out == base
    assert engine.totals.accepted > 0


def test_draft_free_adaptive_and_seeded_equal_plain(target):
    prompts = _prompts(3, seed=5)
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True)
    for params in (GREEDY, seeded):
        base, _ = _run(target, prompts, params)
        out, engine = _run(target, prompts, params, spec_method="ngram", spec_steps=0, max_spec_steps=3, adaptive=True)
        assert out == base
        assert engine.policy.seeded


def test_method_settings_are_checked(target, tmp_path):
    with pytest.raises(ConfigError, match="speculative-method must be one of"):
        EngineConfig(model=str(target), spec_method="medusa")
    with pytest.raises(ConfigError, match="takes no --draft"):
        EngineConfig(model=str(target), draft=str(tmp_path), spec_method="ngram", spec_steps=2)
    with pytest.raises(ConfigError, match="ngram-min"):
        EngineConfig(model=str(target), spec_method="ngram", spec_steps=2, ngram_min=4, ngram_max=2)


@pytest.mark.parametrize(
    "flags",
    [
        ["--speculative-method", "ngram"],  # serve's default: adaptive K
        ["--speculative-method", "suffix", "--no-adaptive", "--spec-topk", "2"],
    ],
)
def test_served_draft_free_equals_plain_and_keeps_tenants_apart(flags):
    """`serve --speculative-method ...` through the openai client: greedy completions equal plain decoding's,
    and the `user` field sorts finished requests into per-tenant histories (suffix)."""
    import argparse

    from serving import HAVE_HTTP, NAME, PROMPTS, Live

    if not HAVE_HTTP:
        pytest.skip("fastapi, uvicorn, httpx and openai are needed for the HTTP tests")
    from specserve.engine.llm import LLM
    from specserve.server import serve_cmd

    def kwargs(*more):
        p = argparse.ArgumentParser()
        serve_cmd.add_arguments(p)
        return serve_cmd.serve_engine_kwargs(
            p.parse_args(
                ["--spec-steps", "3", "--max-model-len", "384", "--max-num-seqs", "2", "--device", "cpu", *more]
            )
        )

    kw = kwargs(*flags)
    assert kw["draft"] is None and kw["spec_method"] == flags[1]
    plain = LLM(**kwargs("--spec-steps", "0"))
    srv = Live(lambda: LLM(**kw), max_num_seqs=2, max_queue=8)
    try:
        srv.wait_ready()
        client = srv.client()
        # An edit: the answer repeats most of the prompt.
        prompt = PROMPTS[0] + "\n\n# The same function, unchanged:\n" + PROMPTS[0]
        want = plain.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
        for user in ("alice", "bob", None):
            extra = {"user": user} if user else {}
            out = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, **extra)
            assert out.choices[0].text == want.text, user
        engine = srv.loop.llm.engine
        assert engine.totals.cycles > 0
        assert srv.info()["speculation"]["method"] == flags[1]
        if flags[1] == "suffix":
            assert list(engine.text_drafts.tenants) == ["alice", "bob"]  # none kept for the request without a user
    finally:
        srv.close()


@pytest.mark.slow
def test_tp2_draft_free_equals_tp1_plain(make_pair):
    """--tp 2 (gloo): every rank drafts the same text alike, so adaptive ngram and suffix trees equal plain TP1."""
    from specserve.distributed.tp_llm import TPLLM
    from specserve.engine.llm import LLM

    target = make_pair(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2, tokenizer="demo")[0]
    engine = {"device": "cpu", "max_num_seqs": 2, "max_model_len": 128}
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = ["]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(model=str(target), **engine).generate(prompts, greedy)]
    for spec in (
        {"spec_method": "ngram", "spec_steps": 0, "max_spec_steps": 3, "adaptive": True},
        {"spec_method": "suffix", "spec_steps": 3, "spec_topk": 2},
    ):
        with TPLLM(model=str(target), tp=2, **engine, **spec) as llm:
            out = llm.generate(prompts, greedy)
        assert [o.token_ids for o in out] == want, spec
        assert sum(o.spec["cycles"] for o in out) > 0


def test_bench_configs_name_the_drafting_method():
    from specserve.bench import configs

    p = configs.parse_config
    assert p("ngram:steps=4,min=2,max=5").label == "ngram:max=5,min=2,steps=4"
    assert p("ngram:steps=4,min=2,max=5").engine_options() == {
        "spec_method": "ngram",
        "spec_topk": 1,
        "spec_tokens": None,
        "ngram_min": 2,
        "ngram_max": 5,
    }
    assert p("mtp:steps=3").engine_options()["spec_method"] == "mtp"
    assert p("suffix:adaptive,steps=6").spec_steps == 6
    with pytest.raises(ConfigError, match="ngram-min"):
        p("ngram:min=4,max=2")
    with pytest.raises(ConfigError, match="unknown key 'min' for suffix"):
        p("suffix:min=2")


def test_one_bench_run_compares_the_methods(monkeypatch, tmp_path):
    """baseline, eagle3, ngram and suffix in one run on the demo pair: each matches plain output."""
    import json

    from benching import run_cli, validate

    out = tmp_path / "methods.json"
    rc = run_cli(
        monkeypatch,
        [
            "bench",
            "--configs",
            "baseline",
            "eagle3:steps=3",
            "ngram:steps=3,min=1,max=4",
            "suffix:adaptive,steps=3",
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
            "--peers",
            "--no-progress",
            "--out",
            str(out),
        ],
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    validate(doc)
    rows = {r["config"]: r for r in doc["results"]}
    for label in ("eagle3:steps=3", "ngram:max=4,min=1,steps=3", "suffix:adaptive,steps=3"):
        assert rows[label]["matches_baseline"] is True, label


@pytest.mark.parametrize("text", ["ngram", "suffix"])
def test_text_drafts_beside_a_drafter_equal_plain(make_pair, text):
    """eagle3 with --text-drafts: cycles verify the text's drafts where every row has a full one (the drafter fed
    its pending entries meanwhile) and the drafter's elsewhere; greedy output equals plain, both kinds ran."""
    target, draft = make_pair(vocab=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, draft={"draft_vocab": 8})
    prompts = _prompts(3, seed=4)
    base, _ = _run(target, prompts, GREEDY)
    for kw in ({"spec_steps": 3}, {"spec_steps": 0, "max_spec_steps": 3, "adaptive": True}):
        out, engine = _run(target, prompts, GREEDY, draft=str(draft), spec_text_drafts=text, **kw)
        assert out == base, kw
        cycles = engine.text_first.cycles
        if not kw.get("adaptive"):  # (adaptive K may keep to plain steps on this tiny model)
            assert cycles["text"] > 0 and cycles["drafter"] > 0, cycles
    with pytest.raises(ConfigError, match="--text-drafts takes"):
        EngineConfig(model=str(target), spec_method="ngram", spec_steps=2, spec_text_drafts="suffix")


@pytest.mark.gpu
def test_draft_free_on_gpu_replays_the_verify_graphs(target):
    """On CUDA (float32): ngram chains and suffix trees run through the captured verify / tree-verify graphs (no
    draft graphs are captured for them) and equal plain greedy output."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = _prompts(3, seed=8)
    gpu = {"device": "cuda", "dtype": "float32"}
    engine = Engine(EngineConfig(model=str(target), max_num_seqs=3, **gpu))
    base = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    for spec in (
        {"spec_method": "ngram", "spec_steps": 3},
        {"spec_method": "suffix", "spec_steps": 3, "spec_topk": 2, "spec_tree_max_batch": 3},
    ):
        engine = Engine(EngineConfig(model=str(target), max_num_seqs=3, **gpu, **spec))
        kinds = {k.kind for k in engine.runner.graphs}
        assert "verify" in kinds and "draft" not in kinds and "tree_draft" not in kinds
        seqs = [engine.add_request(p, GREEDY) for p in prompts]
        while engine.has_work():
            engine.step()
        assert [s.output_ids for s in seqs] == [s.output_ids for s in base], spec
        assert engine.totals.accepted > 0
