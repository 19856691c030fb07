"""EAGLE-3 speculative decoding: lossless greedy, exact sampling distribution, drafter layouts."""

from __future__ import annotations

import itertools
import logging
import time

import pytest
import torch

from specserve.config import ConfigError, DraftConfig, EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.graphs import GraphKey
from specserve.engine.sampling import (
    BatchSampling,
    SamplingParams,
    draft_noise,
    processed_probs,
    sample_from,
)
from specserve.spec.proposer import DraftResult
from specserve.spec.verify import accept_drafts, emitted_tokens

from tiny import engine_with_prefill_graphs, make_drafter

# A small vocabulary makes a random drafter agree with the target often enough
# to exercise partial acceptance, full acceptance and the bonus token.
VOCAB = 12


def _run(target, draft=None, prompts=(), params=None, **kw):
    kw.setdefault("device", "cpu")
    engine = Engine(EngineConfig(model=str(target), draft=str(draft) if draft else None, **kw))
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    return [s.output_ids for s in seqs], engine


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB - 1, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_speculation_is_token_identical(small_pair, batch):
    target, draft = small_pair
    prompts = _prompts(batch, seed=batch)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=batch)
    accepted = 0
    for K in range(1, 7):
        out, engine = _run(target, draft, prompts, GREEDY, spec_steps=K, max_num_seqs=batch)
        assert out == base, f"K={K} batch={batch}"
        accepted += engine.totals.accepted
        assert engine.totals.cycles > 0
    assert accepted > 0  # partial acceptance really happened, not just rejections


def test_adaptive_speculation_is_token_identical(small_pair):
    target, draft = small_pair
    prompts = _prompts(5, seed=7)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=5)
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            spec_steps=0,
            max_spec_steps=4,
            adaptive=True,
            max_num_seqs=5,
        )
    )
    # The policy decides every step, but every third step runs plain and every third K=2 whatever it
    # chose, so both kinds run (and switch) however this machine's timings make it lean.
    choose, steps, picked = engine.policy.choose, itertools.count(), []
    engine.policy.choose = lambda B, remaining=None, stale=False, context=0: (
        picked.append((choose(B, remaining, stale, context), 0, 2)[next(steps) % 3]) or picked[-1]
    )
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    wall = time.perf_counter() - t0
    assert [s.output_ids for s in seqs] == base
    assert picked.count(0) > 5 and engine.totals.cycles > 5  # plain and speculative steps, switching
    assert engine.policy.seeded  # costs came from the start-up measurement, not live exploration
    # Learned offsets are differences of step times: bounded by the run's wall time (a step timed
    # from a wrong clock reading would not be).
    assert any(spec for _, spec in engine.policy.offset)
    assert all(abs(v) < wall for by_context in engine.policy.offset.values() for v in by_context.values())


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_tree_speculation_is_token_identical(small_pair, batch):
    """Greedy tree drafting (top-k branches per depth, the best N nodes verified under an ancestor
    mask, the accepted branch's KV moved into place) emits exactly plain greedy's tokens, and its
    branches accept more than a chain of the same depth."""
    target, draft = small_pair
    prompts = _prompts(batch, seed=20 + batch)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=batch)
    for K, topk, tokens in [(1, 3, None), (3, 2, None), (4, 4, 10), (5, 3, 3), (6, 8, 40)]:
        out, engine = _run(
            target,
            draft,
            prompts,
            GREEDY,
            spec_steps=K,
            spec_topk=topk,
            spec_tokens=tokens,
            max_num_seqs=batch,
            spec_tree_max_batch=8,
        )
        assert out == base, f"K={K} topk={topk} tokens={tokens} batch={batch}"
        if K == 4:
            _, chain = _run(target, draft, prompts, GREEDY, spec_steps=K, max_num_seqs=batch)
            if batch > 1:  # (the one-prompt case repeats a token this drafter never proposes)
                assert engine.totals.accepted > chain.totals.accepted


@pytest.mark.slow
def test_tree_with_adaptive_steps_and_sampled_rows(small_pair):
    """A tree engine under the adaptive policy stays lossless; batches above --spec-tree-max-batch
    switch to chains; sampled requests emit exactly plain sampling's tokens."""
    target, draft = small_pair
    prompts = _prompts(4, seed=31)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=4)
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            spec_steps=0,
            max_spec_steps=4,
            adaptive=True,
            spec_topk=3,
            spec_tree_max_batch=4,
            max_num_seqs=4,
        )
    )
    assert engine.policy.seeded  # tree cycles were timed at start-up
    for K in (3, None):  # fixed depth 3, then the adaptive policy's choice
        engine.set_spec_steps(K)
        seqs = [engine.add_request(p, GREEDY) for p in prompts]
        while engine.has_work():
            engine.step()
        assert [s.output_ids for s in seqs] == base
    assert engine.totals.cycles > 0
    # Batches above --spec-tree-max-batch draft chains: two short requests end early, the batch
    # shrinks from 4 to 2 and the remaining two switch from chains to a tree.
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            spec_steps=3,
            spec_topk=3,
            spec_tree_max_batch=2,
            max_num_seqs=4,
        )
    )
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seqs = [engine.add_request(p, short if i % 2 else GREEDY) for i, p in enumerate(prompts)]
    calls = {"tree": 0, "chain": 0}
    for name, method in (("tree", "draft_tree"), ("chain", "draft")):

        def counted(*a, _f=getattr(engine.runner, method), _n=name):
            calls[_n] += 1
            return _f(*a)

        setattr(engine.runner, method, counted)
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == [b if i % 2 == 0 else b[:8] for i, b in enumerate(base)]
    assert calls["tree"] > 0 and calls["chain"] > 0
    # Sampled requests verify the tree against the target's own seeded draw at every node, keyed
    # by position as plain decoding keys it: the same tokens as plain sampling, whatever the batch.
    for params in (
        SamplingParams(temperature=0.8, max_tokens=30, seed=5, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=6, max_tokens=30, seed=9, ignore_eos=True),
    ):
        plain, _ = _run(target, prompts=prompts, params=params, max_num_seqs=4)
        tree, engine = _run(
            target, draft, prompts, params, spec_steps=3, spec_topk=4, spec_tree_max_batch=4, max_num_seqs=4
        )
        assert tree == plain and engine.totals.accepted > 0
        alone, _ = _run(target, draft, prompts[1:2], params, spec_steps=3, spec_topk=4, max_num_seqs=1)
        assert alone[0] == plain[1]
    # A batch mixing greedy and sampled requests: each emits its plain counterpart's tokens.
    mixed = [GREEDY if i % 2 else params for i in range(len(prompts))]
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            spec_steps=3,
            spec_topk=4,
            spec_tree_max_batch=4,
            max_num_seqs=4,
        )
    )
    seqs = [engine.add_request(p, q) for p, q in zip(prompts, mixed)]
    while engine.has_work():
        engine.step()
    assert [q.output_ids for q in seqs] == [base[i] if i % 2 else plain[i] for i in range(len(prompts))]


@pytest.mark.slow
def test_tree_up_to_max_model_len(small_pair):
    """Sequences that run into max_model_len mid-tree (verify nodes and drafter tree slots past the
    end land in the cache's extra room): greedy and sampled rows still equal plain decoding."""
    target, draft = small_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 17, 29, 40)]
    params = [GREEDY, GREEDY] + [SamplingParams(temperature=0.7, seed=4, max_tokens=100, ignore_eos=True)] * 2

    def run(**kw):
        engine = Engine(EngineConfig(model=str(target), device="cpu", max_model_len=48, max_num_seqs=4, **kw))
        seqs = [engine.add_request(p, q) for p, q in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        engine.check_idle_integrity()
        return [(q.output_ids, q.finish_reason) for q in seqs]

    base = run()
    assert [r for _, r in base] == ["length"] * 4
    assert run(draft=str(draft), spec_steps=6, spec_topk=8, spec_tokens=40, spec_tree_max_batch=4) == base


def test_accept_tree_follows_the_matching_branch():
    """Hand-built tree: root -> a(5) -> c(7); root -> b(6) -> d(8) -> e(9). The target's argmax
    is 6 at the root, 8 at b, 1 at d: b and d are accepted (2 tokens), the next token is 1, and
    the branch's verify rows are b = 2, d = 4."""
    from specserve.spec.proposer import TreeDraft
    from specserve.spec.verify import accept_tree

    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    parents = torch.tensor([[0, 0, 1, 2, 4]])
    depth = torch.tensor([[1, 1, 2, 2, 3]])
    anc = torch.tensor([[0b1, 0b10, 0b101, 0b1010, 0b11010]])
    argmax = [6, 7, 8, 0, 1, 3]  # per verify row: root, a, b, c, d, e (c matches a, but a is rejected)
    pred = torch.tensor([argmax])
    n_acc, nxt, path = accept_tree(pred, TreeDraft(tokens, parents, depth, anc), 3, torch.tensor([True]))
    assert n_acc.tolist() == [2] and nxt.tolist() == [1] and path.tolist() == [[2, 4, 0]]
    n_acc, nxt, path = accept_tree(pred, TreeDraft(tokens, parents, depth, anc), 3, torch.tensor([False]))
    assert n_acc.tolist() == [0] and nxt.tolist() == [6] and path.tolist() == [[0, 0, 0]]


def test_tree_settings_are_checked(small_pair):
    target, draft = small_pair
    with pytest.raises(ConfigError, match="--spec-tokens"):
        EngineConfig(model=str(target), draft=str(draft), spec_steps=3, spec_tokens=8)
    with pytest.raises(ConfigError, match="tree slots"):
        EngineConfig(model=str(target), draft=str(draft), spec_steps=10, spec_topk=8)
    with pytest.raises(ConfigError, match="draft vocabulary"):
        Engine(EngineConfig(model=str(target), draft=str(draft), device="cpu", spec_steps=2, spec_topk=9))


@pytest.mark.gpu
def test_tree_on_gpu_with_cuda_graphs(small_pair, monkeypatch):
    """On CUDA: float32 with graphs is lossless (mask-built SDPA attention); in bf16 the tree verify
    graph (Triton attention with the ancestor mask) gives the logits SDPA gives for the same tree."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, draft = small_pair
    prompts = _prompts(5, seed=41)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=5, device="cuda", dtype="float32")
    # Trees at every batch size here (spec_tree_max_batch=5).
    tree_kw = dict(spec_steps=4, spec_topk=3, spec_tree_max_batch=5, max_num_seqs=5, device="cuda", dtype="float32")
    out, engine = _run(target, draft, prompts, GREEDY, **tree_kw)
    assert out == base and engine.runner.graphs and engine.totals.accepted > 0
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=3, ignore_eos=True)
    plain, _ = _run(target, prompts=prompts, params=sampled, max_num_seqs=5, device="cuda", dtype="float32")
    tree, engine = _run(target, draft, prompts, sampled, **tree_kw)
    assert tree == plain and engine.totals.accepted > 0  # the sampled tree-verify graphs

    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cuda",
            dtype="bfloat16",
            spec_steps=4,
            spec_topk=3,
            spec_tree_max_batch=5,
            max_num_seqs=5,
        )
    )
    r, K, B = engine.runner, 4, 3
    r.reserve_every_row()  # (driven without the scheduler: every row gets blocks of its own)
    for b in range(B):  # some context to attend to
        r.prefill(b, [list(range(1, 11))[: 6 + b]], [0])
    entry = torch.full((B, K + 1), r.scratch, dtype=torch.long, device="cuda")
    entry[:, 0] = torch.tensor([5, 6, 7])
    last, pos0 = torch.zeros(B, dtype=torch.long, device="cuda"), torch.tensor([6, 7, 8], device="cuda")
    r.draft_tree(K, entry, last)
    got = r.verify_tree(K, last, pos0, torch.ones(B, dtype=torch.bool, device="cuda"))[2].float().clone()
    import specserve.model.layers as layers

    monkeypatch.setattr(layers, "cache_attention_ok", lambda *a: False)
    want = r._tree_verify_body(B, K)[2].float()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


def test_engine_config_groups_flat_options_and_is_frozen():
    """Flat options (the CLI's names) land in their groups and read back under both names; a
    built config cannot change (a running engine reads it): `dataclasses.replace` makes a copy."""
    import dataclasses

    from specserve.config import SpecConfig

    cfg = EngineConfig.from_kwargs(model="x", draft="d", spec_steps=3, spec_topk=2, tp=2, env={"A": "1"})
    assert cfg.spec == SpecConfig(steps=3, topk=2) and cfg.spec.max_steps == 3
    assert cfg.parallel.tp == 2 and cfg.parallel.env == {"A": "1"}
    assert (cfg.spec_steps, cfg.max_spec_steps, cfg.spec_topk, cfg.tp, cfg.env) == (3, 3, 2, 2, {"A": "1"})
    assert cfg.tree_nodes(3) == cfg.spec.tree_nodes(3) == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cuda_graphs = False
    eager = dataclasses.replace(cfg, cuda_graphs=False, spec_tree_max_batch=4)
    assert not eager.cuda_graphs and eager.spec.tree_max_batch == 4 and cfg.cuda_graphs and cfg.spec_tree_max_batch == 2
    assert EngineConfig(**cfg.flat()) == cfg
    assert EngineConfig.spec_tree_max_batch == SpecConfig().tree_max_batch  # class-level defaults (CLI help)
    with pytest.raises(ConfigError, match="unknown engine option"):
        EngineConfig.from_kwargs(spec_stepz=3)
    with pytest.raises(ConfigError, match="needs a drafter"):
        EngineConfig(spec_steps=3)


@pytest.mark.slow
def test_rows_freed_and_reused_mid_batch(small_pair):
    """Sequences of different lengths finish at different steps; later ones keep the right KV."""
    target, draft = small_pair
    prompts = _prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 40, 9, 25, 1, 17)]
    engine = Engine(EngineConfig(model=str(target), device="cpu", max_num_seqs=3))
    base = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    spec = Engine(
        EngineConfig(model=str(target), draft=str(draft), spec_steps=3, device="cpu", max_num_seqs=3, prefill_chunk=8)
    )
    seqs = [spec.add_request(p, sp) for p, sp in zip(prompts, params)]
    while spec.has_work():
        spec.step()
    spec.check_idle_integrity()
    assert [s.output_ids for s in seqs] == [s.output_ids for s in base]
    from specserve.engine.protocol import ServingEngine, missing_members  # what the server reads of any engine

    assert missing_members(spec, ServingEngine) == []


@pytest.mark.slow
def test_drafter_position_limit_falls_back_to_plain_decoding(tmp_path, small_pair):
    target, _ = small_pair
    short = make_drafter(tmp_path / "short", target, draft_vocab=8, max_pos=24)
    prompts = _prompts(3, seed=11)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=3)
    out, engine = _run(target, short, prompts, GREEDY, spec_steps=3, max_num_seqs=3)
    assert out == base
    # Past position 24 no cycle is counted as speculative: far fewer than the plain step count.
    assert engine.totals.cycles < sum(len(o) for o in out)
    out, _ = _run(target, short, prompts, GREEDY, spec_steps=3, max_num_seqs=3, allow_draft_position_extension=True)
    assert out == base


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["specforge", "sglang", "eagle"])
def test_drafter_layouts_load_and_stay_lossless(tmp_path, small_pair, layout):
    target, _ = small_pair
    d = make_drafter(
        tmp_path / layout,
        target,
        layout=layout,
        draft_vocab=8,
        with_embedding=layout == "eagle",
        aux_ids=[0, 1, 2] if layout == "sglang" else None,
    )
    cfg = DraftConfig.from_dir(d)
    assert cfg.layout == layout
    prompts = _prompts(2, seed=5)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=2)
    out, engine = _run(target, d, prompts, GREEDY, spec_steps=2, max_num_seqs=2)
    assert out == base
    if layout == "sglang":  # SGLang ids are layer outputs: captured entering layer id + 1
        assert engine.runner.target.aux_layers == (1, 2, 3)
        _, engine = _run(target, d, [], GREEDY, spec_steps=2, aux_layer_convention="vllm")
        assert engine.runner.target.aux_layers == (0, 1, 2)


def test_drafter_errors_name_the_tensor(tmp_path, small_pair):
    from safetensors.torch import load_file, save_file

    target, _ = small_pair
    d = make_drafter(tmp_path / "bad", target, draft_vocab=8)
    t = load_file(d / "model.safetensors")
    t["fc.weight"] = t["fc.weight"][:, :10].contiguous()
    save_file(t, d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"'fc.weight' does not fit"):
        Engine(EngineConfig(model=str(target), draft=str(d), spec_steps=2, device="cpu"))
    del t["fc.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing tensor\(s\): fc.weight"):
        Engine(EngineConfig(model=str(target), draft=str(d), spec_steps=2, device="cpu"))


@pytest.mark.slow
def test_sampled_speculation_is_reproducible_and_batch_independent(small_pair):
    target, draft = small_pair
    prompts = _prompts(4, seed=9)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=123, ignore_eos=True)
    a, _ = _run(target, draft, prompts, params, spec_steps=3, max_num_seqs=4)
    b, _ = _run(target, draft, prompts[:1], params, spec_steps=3, max_num_seqs=1)
    assert a[0] == b[0]
    c, _ = _run(target, draft, prompts, params, spec_steps=3, max_num_seqs=4)
    assert a == c


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mode", [f"chain-K{K}" for K in range(1, 6)] + ["tree", "adaptive"])
def test_seeded_sampling_equals_plain_decoding(small_pair, mode, batch):
    """A seeded sampled request emits plain seeded decoding's tokens whatever K (chains 1..5, a
    tree, the adaptive policy switching K), alone or beside other requests (other seeds, greedy,
    filtered sampling)."""
    target, draft = small_pair
    prompts = _prompts(batch, seed=41)
    params = [
        SamplingParams(temperature=0.8, max_tokens=40, seed=7, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=6, max_tokens=40, seed=11, ignore_eos=True),
        GREEDY,
        SamplingParams(temperature=1.0, max_tokens=25, seed=-3, ignore_eos=True),
    ][:batch]
    plain = [_run(target, prompts=[p], params=sp)[0][0] for p, sp in zip(prompts, params)]
    kw = dict(max_num_seqs=batch)
    if mode == "tree":
        kw.update(spec_steps=3, spec_topk=3, spec_tree_max_batch=4)
    elif mode == "adaptive":
        kw.update(spec_steps=0, max_spec_steps=5, adaptive=True)
    else:
        kw.update(spec_steps=int(mode.removeprefix("chain-K")))
    engine = Engine(EngineConfig(model=str(target), draft=str(draft), device="cpu", **kw))
    if mode == "adaptive":  # every K, plain steps included, switching between cycles
        steps = iter([5, 1, 0, 3, 2, 4, 4, 0, 1, 5, 2] * 40)
        engine.policy.choose = lambda B, remaining=None, stale=False, context=0: next(steps)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == plain
    assert engine.totals.accepted > 0


@pytest.mark.gpu
def test_batch_invariant_bf16_speculation_equals_plain_on_gpu(small_pair):
    """On CUDA in bf16 with --batch-invariant: one sequence at a time, chains, trees and the
    adaptive policy emit plain decoding's greedy tokens exactly (a decode step's one row and a
    verify's rows run the same product tiles, so no near-tie flips between them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, draft = small_pair
    prompts = _prompts(6, seed=47)
    gpu = dict(max_num_seqs=1, device="cuda", dtype="bfloat16", batch_invariant=True)
    base, _ = _run(target, prompts=prompts, params=GREEDY, **gpu)
    for kw in (
        dict(spec_steps=4),
        dict(spec_steps=4, spec_topk=3),
        dict(spec_steps=0, max_spec_steps=5, adaptive=True),
    ):
        out, engine = _run(target, draft, prompts, GREEDY, **kw, **gpu)
        assert out == base, kw
        assert engine.runner.graphs


@pytest.mark.gpu
def test_seeded_sampling_equals_plain_decoding_on_gpu(small_pair):
    """On CUDA with graphs (float32): the sampled draft graphs (drafts over the target's noise) and
    chain verification emit plain seeded decoding's tokens, at fixed K and under the adaptive policy."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, draft = small_pair
    prompts = _prompts(4, seed=43)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=8, max_tokens=40, seed=3, ignore_eos=True)
    gpu = dict(max_num_seqs=4, device="cuda", dtype="float32")
    plain, _ = _run(target, prompts=prompts, params=params, **gpu)
    for kw in (dict(spec_steps=3), dict(spec_steps=0, max_spec_steps=4, adaptive=True)):
        out, engine = _run(target, draft, prompts, params, **kw, **gpu)
        assert out == plain and engine.runner.graphs, kw
        assert engine.totals.accepted > 0 or kw.get("adaptive")  # (the policy may find plain steps best)


# ---------------------------------------------------------------- distribution
def _speculative_first_tokens(p_logits, q_logits, n, K, vd_to_v, temperature=1.0, top_k=0, top_p=1.0, rule=None):
    """Run the acceptance rule on n independent rows with fixed logits, drafts sampled as the
    drafter samples them (over the target's noise at each position); returns the first and (where
    the first draft was accepted) second emitted tokens, and the accepted counts."""
    V, Vd = p_logits.shape[-1], q_logits.shape[-1]
    s = BatchSampling(
        temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        seed=torch.arange(n) * 7919 + 1,
        all_greedy=False,
        filtered=top_k > 0 or top_p < 1,
    )
    expand = lambda t, w: t.unsqueeze(1).expand(n, w)  # noqa: E731
    q = processed_probs(
        q_logits.expand(n, K, Vd), expand(s.temperature, K), expand(s.top_p, K), expand(s.top_k, K), s.filtered
    )
    pos0 = torch.full((n,), 5)
    draft_ids = torch.stack([sample_from(q[:, i], draft_noise(s.seed, pos0 + 1 + i, vd_to_v)) for i in range(K)], 1)
    draft = DraftResult(vd_to_v[draft_ids])
    logits = p_logits.expand(n, K + 1, V)
    n_acc, nxt = (rule or accept_drafts)(logits, draft, s, pos0, torch.ones(n, dtype=torch.bool))
    emitted = emitted_tokens(draft.tokens, n_acc, nxt)
    return emitted[:, 0], emitted[n_acc >= 1, 1], n_acc


def _tv(samples, probs):
    freq = torch.bincount(samples, minlength=probs.shape[-1]).float() / len(samples)
    return 0.5 * (freq - probs).abs().sum().item()


# With n = 20000 and 8-12 outcomes, the TV distance of an exact sampler is ~0.01;
# a wrong acceptance rule shifts mass by > 0.1 for these distributions.
TV_BOUND = 0.03


@pytest.mark.parametrize("case", ["full-vocab", "draft-subvocab", "top-k+top-p+temperature"])
def test_speculative_sampling_matches_target_distribution(case):
    g = torch.Generator().manual_seed(0)
    V, K, n = 12, 3, 20000
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    if case == "draft-subvocab":  # drafter only proposes 8 of the 12 target tokens
        vd_to_v = torch.tensor([0, 1, 3, 4, 6, 7, 9, 11])
    else:
        vd_to_v = torch.arange(V)
    q_logits = torch.randn(K, len(vd_to_v), generator=g) * 1.5
    kw = dict(temperature=0.7, top_k=6, top_p=0.9) if case == "top-k+top-p+temperature" else {}
    first, second, n_acc = _speculative_first_tokens(p_logits, q_logits, n, K, vd_to_v, **kw)
    t, top_p = torch.full((K + 1,), kw.get("temperature", 1.0)), torch.full((K + 1,), kw.get("top_p", 1.0))
    top_k = torch.full((K + 1,), kw.get("top_k", 0), dtype=torch.long)
    p = processed_probs(p_logits, t, top_p, top_k, bool(kw))
    assert _tv(first, p[0]) < TV_BOUND
    assert len(second) > 2000 and _tv(second, p[1]) < TV_BOUND + 0.01
    # Coupled draws agree at least (1 - TV) / (1 + TV) of the time (TV between draft and target).
    q = torch.zeros(V).scatter(0, vd_to_v, processed_probs(q_logits, t[:K], top_p[:K], top_k[:K], bool(kw))[0])
    tv = 0.5 * (p[0] - q).abs().sum().item()
    assert (n_acc >= 1).float().mean().item() > (1 - tv) / (1 + tv) - 0.02


@pytest.mark.parametrize("subvocab", [False, True])
def test_drafts_drawn_over_the_targets_noise_agree_with_it(subvocab):
    """A drafter whose distribution is the target's (restricted to its draft vocabulary) draws the
    target's own token wherever that token lies in the draft vocabulary: all drafts accepted with
    the full vocabulary; with a sub-vocabulary, exactly the rows whose target draw it holds."""
    g = torch.Generator().manual_seed(1)
    V, K, n = 12, 4, 4000
    p_logits = torch.randn(1, V, generator=g).expand(K + 1, V) * 1.5
    vd_to_v = torch.tensor([0, 1, 3, 4, 6, 7, 9, 11]) if subvocab else torch.arange(V)
    first, _, n_acc = _speculative_first_tokens(p_logits, p_logits[:K, vd_to_v], n, K, vd_to_v)
    if subvocab:
        assert torch.equal(n_acc >= 1, torch.isin(first, vd_to_v))
        assert 0 < (n_acc >= 1).float().mean() < 1
    else:
        assert bool((n_acc == K).all())


def test_distribution_test_catches_a_wrong_rule():
    """Negative control: keeping the first draft unchecked emits the drafter's distribution."""
    g = torch.Generator().manual_seed(0)
    V, K, n = 12, 3, 20000
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q_logits = torch.randn(K, V, generator=g) * 1.5

    def wrong(logits, draft, s, pos0, enabled):
        n_acc, nxt = accept_drafts(logits, draft, s, pos0, enabled)
        return n_acc.clamp_min(1), nxt

    first, _, _ = _speculative_first_tokens(p_logits, q_logits, n, K, torch.arange(V), rule=wrong)
    p0 = processed_probs(p_logits[:1], torch.ones(1), torch.ones(1), torch.zeros(1, dtype=torch.long), False)[0]
    assert _tv(first, p0) > TV_BOUND


@pytest.mark.slow
def test_end_to_end_sampling_distribution(small_pair):
    """The second generated token (the first one produced by a speculative cycle)
    follows the target's exact marginal, computed by enumeration."""
    from specserve.model.layers import ForwardContext

    target, draft = small_pair
    prompt = [3, 1, 4, 1, 5]
    n = 4000
    engine = Engine(EngineConfig(model=str(target), draft=str(draft), spec_steps=3, device="cpu", max_num_seqs=500))
    seconds = []
    for start in range(0, n, 500):
        seqs = [
            engine.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=2, seed=start + i, ignore_eos=True))
            for i in range(500)
        ]
        while engine.has_work():
            engine.step()
        seconds += [s.output_ids[1] for s in seqs]
    model = engine.runner.target
    with torch.inference_mode():

        def probs(ids):
            pos = torch.arange(len(ids)).unsqueeze(0)
            h, _ = model(torch.tensor([ids]), ForwardContext(0, pos, pos, len(ids)))
            return model.logits(h)[0, -1].softmax(-1)

        p1 = probs(prompt)
        marginal = sum(p1[t] * probs(prompt + [t]) for t in range(VOCAB))
    assert _tv(torch.tensor(seconds), marginal) < 0.05  # n = 4000: exact sampler ~0.02


@pytest.mark.slow
def test_one_engine_switches_between_plain_fixed_and_adaptive(small_pair):
    """bench reuses one engine's weights and graphs for every setting."""
    target, draft = small_pair
    prompts = _prompts(3, seed=21)
    base, _ = _run(target, prompts=prompts, params=GREEDY, max_num_seqs=3)
    engine = Engine(
        EngineConfig(model=str(target), draft=str(draft), adaptive=True, max_spec_steps=3, device="cpu", max_num_seqs=3)
    )
    for K in (0, 2, None, 3, 0):
        engine.set_spec_steps(K)
        cycles = engine.totals.cycles
        seqs = [engine.add_request(p, GREEDY) for p in prompts]
        while engine.has_work():
            engine.step()
        assert [s.output_ids for s in seqs] == base, f"K={K}"
        if K is not None:  # (adaptive picks by measured cost: plain alone is a valid choice here)
            assert (engine.totals.cycles == cycles) == (K == 0)
    with pytest.raises(ValueError, match="K=5 has no captured graphs"):
        engine.set_spec_steps(5)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_steps_queued_ahead_change_nothing(small_pair, temperature):
    """Plain decoding with the next step queued before the last is read (as on CUDA): the same
    tokens, also when sequences end mid-batch at data-dependent points (stop ids) or by length,
    and rows move; then a new request joins the idle engine."""
    target, _ = small_pair
    prompts = _prompts(7, seed=11)
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=n, stop_token_ids=[3, 17])
        for i, n in enumerate((30, 4, 30, 12, 30, 1, 30))
    ]

    def run(ahead: bool):
        engine = Engine(EngineConfig(model=str(target), device="cpu", max_num_seqs=3))
        engine.launch_ahead = ahead
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        late = engine.add_request(prompts[0], params[0])
        while engine.has_work():
            engine.step()
        engine.check_idle_integrity()
        return [(s.output_ids, s.finish_reason) for s in seqs + [late]]

    base = run(False)
    assert {r for _, r in base} >= {"stop", "length"}  # both kinds of ending happen mid-batch
    assert run(True) == base


def test_sequence_ending_with_its_first_token(small_pair):
    """max_tokens=1 (and a first token that is a stop id) end at prefill: no decode step adds more."""
    target, _ = small_pair
    prompts = _prompts(3, seed=5)
    out, _ = _run(target, prompts=prompts, params=SamplingParams(temperature=0, max_tokens=1), max_num_seqs=2)
    assert [len(o) for o in out] == [1, 1, 1]
    first = out[0][0]
    out, _ = _run(
        target,
        prompts=prompts[:1] * 2,
        params=SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[first]),
        max_num_seqs=2,
    )
    assert out == [[first], [first]]


def test_policy_with_seeded_costs_needs_no_exploration():
    """Start-up costs: the best K is chosen at once; acceptance and the learned offset move it."""
    from specserve.spec.policy import SpecPolicy

    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=3)
    policy.seed_costs({(1, 0): 1.0, (1, 1): 1.1, (1, 2): 1.2, (1, 3): 1.3})
    assert policy.choose(1) == 3  # prior acceptance 2/3: 2.41 tokens per 1.3 s beats the rest
    for _ in range(30):
        policy.observe_acceptance(3, [0], 1)  # every first draft rejected
    assert policy.choose(1) == 0
    policy.observe_cost(1, 0, 1.5)  # plain steps cost 0.5 s more than seeded (host work) ...
    assert policy.predicted_cost(1, 0) == 1.5 and policy.predicted_cost(1, 2) == 1.2  # ... spec unaffected
    policy.observe_cost(1, 2, 1.0)  # a cycle came in 0.2 s under its seed: K=2 is now known live,
    assert policy.predicted_cost(1, 2) == 1.0 and policy.predicted_cost(1, 3) == pytest.approx(1.1)  # K=3 shifted
    # Tree cycles (small batches of a --spec-topk engine) keep their own acceptance statistics.
    trees = SpecPolicy(EngineConfig(model="x", draft="d", adaptive=True, spec_topk=4, max_spec_steps=3), k_max=3)
    trees.seed_costs({(B, K): 1.0 + 0.1 * K for B in (1, 8) for K in range(4)})
    for _ in range(30):
        trees.observe_acceptance(3, [0], 8)  # chains (batch 8) reject everything ...
        trees.observe_acceptance(3, [3], 1)  # ... trees (batch 1) accept everything
    assert trees.choose(8) == 0 and trees.choose(1) == 3
    unseeded = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=2)
    assert [unseeded.choose(4) for _ in range(1)] == [0]  # without seeds: exploration first
    assert unseeded.predicted_cost(4, 0) is None


def test_a_switch_waits_for_the_device_outside_the_step_timing(small_pair, monkeypatch):
    """A speculative cycle that drops a plain step queued ahead waits for the device to finish it;
    that wait (and any work run untimed, such as the drafter's catch-up) moves the step's start
    later, so the policy does not charge it to K. The device's wait is faked as a 50 ms sleep."""
    import time

    target, draft = small_pair
    engine = Engine(EngineConfig(model=str(target), draft=str(draft), device="cpu", spec_steps=2))
    waits = iter([0.05])
    monkeypatch.setattr(engine.runner, "sync", lambda: time.sleep(next(waits, 0.0)))
    engine._timing = (1, 2, 300, 100.0)  # (batch size, K, context, start)
    engine._untimed(lambda: None)  # the dropped step: only the device's wait
    assert engine._timing[:3] == (1, 2, 300) and engine._timing[3] >= 100.05
    start = engine._timing[3]
    engine._untimed(lambda: time.sleep(0.02))  # untimed work
    assert engine._timing[3] >= start + 0.02


def test_policy_skips_a_first_live_timing_that_is_warm_up():
    """The grown MoE pair at batch 64: K=1 at bucket 32 was first run at a batch size start-up never
    timed and took 728 ms (a kernel compiled) against ~5 ms predicted; learned as its cost, it kept
    K=1 out of that bucket for good. The first such outlier is skipped; a second slow timing counts."""
    from specserve.spec.policy import CONTEXT_MIN, WARMUP_OUTLIER, SpecPolicy

    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=1)
    policy.seed_costs({(32, 0): 0.003, (32, 1): 0.005})
    policy.observe_cost(27, 1, 0.728)
    assert policy.predicted_cost(32, 1) == pytest.approx(0.005) and policy.tries[(32, CONTEXT_MIN, 1)] == 1
    policy.observe_cost(27, 1, 0.006)  # the next cycle of that shape runs at its true cost
    assert policy.predicted_cost(32, 1) == pytest.approx(0.006)
    # A K that is truly slow is learned from its second timing on, however far above its seed.
    slow = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=1)
    slow.seed_costs({(1, 0): 0.001, (1, 1): 0.001})
    for _ in range(2):
        slow.observe_cost(1, 1, 2 * WARMUP_OUTLIER * 0.001)
    assert slow.predicted_cost(1, 1) == pytest.approx(0.008)


def test_policy_is_not_moved_by_one_slow_step():
    """H200, SmolLM2 at batch 1: plain decoding is best (0.59 ms a step against 1.45 ms for K=2's
    ~1.75 tokens). One plain step timed slow (a host pause) priced plain decoding out for dozens of
    steps under a moving average; the trimmed mean of recent timings ignores it, and follows a lasting change."""
    from specserve.spec.policy import LIVE_WINDOW, SpecPolicy

    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=2)
    policy.seed_costs({(1, 0): 0.6e-3, (1, 1): 1.0e-3, (1, 2): 1.1e-3})
    for _ in range(50):
        policy.observe_acceptance(2, [1], 1)
    for K, sec in ((0, 0.59e-3), (1, 1.40e-3), (2, 1.45e-3)):
        for _ in range(LIVE_WINDOW):
            policy.observe_cost(1, K, sec)
    policy.observe_cost(1, 0, 5e-3)  # the one slow plain step
    assert policy.predicted_cost(1, 0) == pytest.approx(0.59e-3)
    assert [policy.choose(1) for _ in range(20)] == [0] * 20
    for _ in range(LIVE_WINDOW // 2 + 1):  # plain steps that stay slow are learned
        policy.observe_cost(1, 0, 5e-3)
    assert policy.predicted_cost(1, 0) > 3e-3 and policy.choose(1) > 0


def test_policy_prices_the_long_tail_of_speculative_cycles():
    """H200, SmolLM2 at batch 16: K=2 cycles timed 1.4-2.4 ms (median 1.54, mean 1.72: the host does much of
    a cycle on a 135M model) for ~1.46 tokens a row, plain steps a steady 1.08 ms. By the median K=2 looked
    3% faster and ran 33 of 51 steps; adaptive came out at 0.86x plain. The cost a step pays is its mean."""
    from specserve.spec.policy import SpecPolicy

    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=2)
    policy.seed_costs({(16, 0): 1.0e-3, (16, 1): 1.15e-3, (16, 2): 1.29e-3})
    uncond = [0.36, 0.10]  # P(A >= 1), P(A >= 2): 1.46 tokens a cycle at K=2
    policy.acc_hits[False] = [1000.0 * u for u in uncond]
    policy.acc_seen[False] = [1000.0] + [1000.0 * u for u in uncond[:-1]]
    assert policy.expected_tokens(2) == pytest.approx(1.46)
    timings = {
        0: [1.083e-3] * 9,
        1: [1.56e-3] * 9,
        2: [t * 1e-3 for t in (1.40, 1.45, 1.50, 1.52, 1.535, 1.60, 1.9, 2.2, 2.4)],
    }
    for K, ts in timings.items():
        for t in ts:
            policy.observe_cost(16, K, t)
    assert 1.6e-3 < policy.predicted_cost(16, 2) < 1.7e-3  # the slowest dropped, the tail kept
    assert [policy.choose(16) for _ in range(10)] == [0] * 10


def test_policy_keeps_plain_decoding_on_a_near_tie():
    """The same pair, the bench at batch 16: K=1 cycles of 1.56 ms for 1.48 tokens a row rate 3% above plain
    steps of 1.083 ms, and adaptive chose K=1 in 111 of 462 steps at 0.83x plain: the drafter's upkeep, its
    catch-ups and explorations are not in a K's rate. Speculation must win by SPEC_MARGIN; a clear win still
    takes it."""
    from specserve.spec.policy import SPEC_MARGIN, SpecPolicy

    def policy(k1_ms: float) -> SpecPolicy:
        p = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=1)
        p.seed_costs({(16, 0): 1.083e-3, (16, 1): k1_ms * 1e-3})
        p.acc_hits[False], p.acc_seen[False] = [480.0], [1000.0]
        for K, ms in ((0, 1.083), (1, k1_ms)):
            for _ in range(9):
                p.observe_cost(16, K, ms * 1e-3)
        return p

    near = policy(1.56)
    assert 1.0 < near.expected_tokens(1) / 1.56 / (1 / 1.083) < 1 + SPEC_MARGIN
    assert [near.choose(16) for _ in range(10)] == [0] * 10
    clear = policy(1.40)  # 1.48 tokens in 1.40 ms: 14% above plain
    assert [clear.choose(16) for _ in range(10)] == [1] * 10


def test_policy_judges_a_batch_job_by_its_last_sequence():
    """The grown MoE pair, 64 sequences of 64 tokens in one static batch (H200): plain 2.82 ms a step,
    K-cycles 5.6 + 0.62 K ms, K=5 8.72 ms for 3.54 tokens a row (acceptance by position 0.72 0.55
    0.49 0.41 0.36). Per step K=5
    yields 23% more tokens a second, yet the batch took 37% more cycles than the mean row needs and
    plain decoding finished first. A batch job with nothing waiting is judged by its last row."""
    from specserve.spec.policy import CONTEXT_MIN, SpecPolicy

    def policy() -> SpecPolicy:
        p = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=5)
        p.seed_costs({(B, K): (2.82e-3 if K == 0 else 5.6e-3 + 0.624e-3 * K) for B in (1, 64) for K in range(6)})
        uncond = [0.72, 0.55, 0.49, 0.41, 0.36]
        p.acc_hits[False] = [1000.0 * u for u in uncond]  # conditional rates a_j = P(A >= j) / P(A >= j - 1)
        p.acc_seen[False] = [1000.0] + [1000.0 * u for u in uncond[:-1]]
        return p

    p = policy()
    assert p.expected_tokens(5) == pytest.approx(3.53, abs=0.01)
    assert p.tokens_variance(5) == pytest.approx(4.53, abs=0.01)
    assert p.choose(64) == 5  # served (finished rows replaced): tokens a second
    assert policy().choose(64, remaining=[63] * 64) == 0  # a batch job: the last row decides
    assert policy().choose(1, remaining=[63]) == 5  # one row: the same rule as tokens a second
    # One row far behind the rest is a race of its own: its expected cycles alone decide.
    assert policy().choose(64, remaining=[63] + [2] * 63) == 5
    # While the job's longest rows are still in prefill (past the B decoding ones), a step is off the
    # critical path: the cheapest K (plain), where tokens a second would take K=5.
    assert policy().choose(1, remaining=[60] + [64] * 63) == 0
    # An exploration timing K=5 at its 8.72 ms wins per step but not for the batch: by the rule of the
    # bucket's last choice it keeps the back-off going (judged by tokens a second it ended the wait,
    # and the batch explored every 24 choices).
    p = policy()
    p.choose(64)
    shape = (64, CONTEXT_MIN)  # (batch bucket, context bucket)
    assert p._would_win(shape, 64, 5, 8.72e-3)
    p.choose(64, remaining=[63] * 64)
    assert not p._would_win(shape, 64, 5, 8.72e-3)


def test_startup_times_a_bounded_grid_and_logs_progress(small_pair, caplog):
    """Adaptive start-up times a few (batch bucket, K) points, logging each, and seeds every
    (bucket, K) pair from them."""
    from specserve.spec.policy import context_buckets

    target, draft = small_pair
    caplog.set_level(logging.INFO, logger="specserve.runner")
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            spec_steps=0,
            max_spec_steps=5,
            adaptive=True,
            max_num_seqs=64,
        )
    )
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("timing step costs: ")]
    total = int(lines[0].split("/")[1].split()[0])
    assert [int(m.split()[3].split("/")[0]) for m in lines] == list(range(1, total + 1))
    assert total <= 12  # 3 buckets x (K = 0 and 3 K values); every pair would be 7 x 6
    contexts = context_buckets(engine.max_model_len)  # (one timed on a CPU, the same cost at every bucket)
    assert set(engine.policy.seeded) == {
        (b, c, K) for b in (1, 2, 4, 8, 16, 32, 64) for c in contexts for K in range(6)
    }


def test_startup_grid_and_interpolation():
    from specserve.spec.policy import interpolate_costs, startup_grid

    buckets = [1, 2, 4, 8, 16, 32, 64]
    assert startup_grid(buckets, [1, 2, 3, 4], lambda B: False) == ([1, 8, 64], [1, 3, 4])
    assert startup_grid(buckets, [1, 2, 3, 4], lambda B: B <= 2)[0] == [1, 2, 8, 64]  # the largest tree bucket too
    cost = lambda B, K: 1.0 + 0.5 * K + 0.01 * B * (K + 1)  # noqa: E731  bilinear: interpolation is exact
    tb, tk = startup_grid(buckets, [1, 2, 3, 4], lambda B: False)
    timed = {(B, K): cost(B, K) for B in tb for K in [0] + tk}
    filled = interpolate_costs(timed, buckets, [0, 1, 2, 3, 4])
    assert filled.keys() == {(B, K) for B in buckets for K in range(5)}
    assert all(abs(filled[(B, K)] - cost(B, K)) < 1e-9 for B, K in filled)
    # Tree buckets are interpolated among themselves: a chain bucket's cycle cost is not theirs.
    tree = lambda B: B <= 2  # noqa: E731
    timed = {(B, K): (10.0 if tree(B) and K else 1.0) * (1 + K) for B in (1, 2, 8, 64) for K in (0, 1, 3, 4)}
    filled = interpolate_costs(timed, buckets, [0, 1, 2, 3, 4], tree)
    assert filled[(4, 2)] == 3.0 and filled[(2, 2)] == 30.0 and filled[(4, 0)] == 1.0


def _run_policy(policy, B: int, real: dict[int, float], choices: int = 40 * 24) -> list[int]:
    """The policy's choices at batch B over `choices` steps, each timed at its K's `real` cost."""
    picks = []
    for _ in range(choices):
        K = policy.choose(B)
        picks.append(K)
        policy.observe_cost(B, K, real[K])
    return picks


def test_policy_explores_out_of_a_bad_estimate():
    """The H200 batch-64 lock-in: seeds call K=2 cheap, live K=2 cycles are very slow, and the shared
    speculative offset then makes every K look worse than plain. Periodic exploration of the
    near-best K still finds K=1, whose live cost is fine, and the policy settles there."""
    from specserve.spec.policy import CONTEXT_MIN, EXPLORE_EVERY, SpecPolicy

    real = {0: 1.0, 1: 1.3, 2: 3.0, 3: 3.2}  # seconds per step/cycle as the engine would time them
    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=3)
    policy.seed_costs({(64, 0): 1.0, (64, 1): 1.25, (64, 2): 1.05, (64, 3): 1.35})  # K=2 timed too cheap
    for _ in range(50):
        policy.observe_acceptance(3, [1], 64)  # the first draft accepted, the second rejected
    assert policy.choose(64) == 2
    policy.observe_cost(64, 2, real[2])
    policy.observe_cost(64, 2, real[2])
    assert policy.choose(64) == 0  # the offset (+1.95 s) now makes every K look worse than plain
    tail = _run_policy(policy, 64, real)[-240:]
    assert tail.count(1) > 0.9 * len(tail)  # K=1: ~1.98 tokens per 1.3 s beats plain's 1 per 1.0 s
    assert policy.snapshot()["64"][str(CONTEXT_MIN)]["1"]["live_ms"] == pytest.approx(1300.0)
    # Without a near-best alternative, no exploration: plain stays when speculation is hopeless.
    lone = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=1)
    lone.seed_costs({(1, 0): 1.0, (1, 1): 10.0})
    assert {lone.choose(1) for _ in range(3 * EXPLORE_EVERY)} == {0}


def test_policy_explores_back_to_plain_after_one_slow_plain_step():
    """The CPU batch-4 lock-in: one plain step timed slow live (2 s against 1 s), speculative
    cycles seeded cheap and slower live. Exploration judges plain by the lower of its live and
    start-up cost, re-times it, and the policy settles on plain decoding, the fastest here."""
    from specserve.spec.policy import CONTEXT_MIN, SpecPolicy

    real = {0: 1.0, 1: 2.6, 2: 3.2}  # K=1: ~2 tokens per 2.6 s; K=2: ~2.3 per 3.2 s; plain 1 per 1.0 s
    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=2)
    policy.seed_costs({(4, 0): 1.0, (4, 1): 1.3, (4, 2): 1.6})
    for _ in range(50):
        policy.observe_acceptance(2, [1], 4)
    policy.observe_cost(4, 0, 2.0)  # the one slow plain step
    tail = _run_policy(policy, 4, real)[-240:]
    assert tail.count(0) > 0.9 * len(tail)
    assert policy.snapshot()["4"][str(CONTEXT_MIN)]["0"]["live_ms"] == pytest.approx(1000.0)


def test_policy_judges_each_k_by_its_own_cycles():
    """H200 batch 16: K=8 cycles accept less per position than K=4 cycles (a cycle starts after the
    last rejection, harder text, more often with long drafts). Rates pooled from mostly-K=8 cycles
    made K=4 look worse than K=8 (2.8 vs 3.3 tokens) though it ran faster (1.93x vs 2.18x plain)."""
    from specserve.spec.policy import SpecPolicy

    k8 = [0] * 37 + [1] * 17 + [2] * 6 + [3] * 7 + [4] * 5 + [5] * 3 + [7] + [8] * 24  # 3.84 tokens per cycle
    k4 = [0] * 25 + [1] * 18 + [2] * 7 + [3] * 6 + [4] * 44  # 3.26 tokens per cycle
    policy = SpecPolicy(EngineConfig(model="x", adaptive=True, max_spec_steps=8, spec_steps=0), k_max=8)
    policy.seed_costs({(16, K): 0.0064 + (0.0016 * (K - 4) / 4 if K >= 4 else -0.0005 * (4 - K)) for K in range(9)})
    policy.seed_costs({(16, 0): 0.0063})
    for _ in range(3):
        policy.observe_acceptance(8, k8, 16)
    policy.observe_acceptance(4, k4, 16)
    assert policy.expected_tokens(8) == pytest.approx(3.84, abs=0.05)
    assert policy.expected_tokens(4) > 3.1  # its own 3.26 per cycle, barely pulled to the pooled 2.8
    assert policy.choose(16) == 4  # 3.2 tokens / 6.4 ms beats 3.84 / 8.0 ms


def test_plain_steps_queued_ahead_while_drafting(small_pair):
    """Adaptive mode switching between plain steps (queued ahead, drafter inputs written on the
    device) and speculative cycles (which drop a queued step): the same tokens as without
    queueing, also across the drafter-input flush and sequences ending mid-batch."""
    target, draft = small_pair
    prompts = _prompts(5, seed=13)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (60, 9, 45, 60, 20)]
    pattern = [0] * 20 + [2, 0, 0, 3, 0, 0, 0, 1] * 20  # long plain runs force flushes of the pending inputs

    def run(ahead: bool):
        engine = Engine(
            EngineConfig(
                model=str(target), draft=str(draft), adaptive=True, max_spec_steps=3, device="cpu", max_num_seqs=3
            )
        )
        engine.launch_ahead = ahead
        steps = iter(pattern * 10)
        engine.policy.choose = lambda B, remaining=None, stale=False, context=0: next(steps)
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        engine.check_idle_integrity()
        return [s.output_ids for s in seqs], engine.totals.cycles

    base, cycles = run(False)
    assert cycles > 0
    assert run(True) == (base, cycles)
    plain, _ = _run(target, prompts=prompts[:1], params=params[0])
    assert base[0] == plain[0]


# Plain stretches longer than the drafter's pending buffer (48 entries), short ones, and
# speculative cycles of each K between them.
ALTERNATING = (
    [3, 2] + [0] * 70 + [3, 2, 3, 3, 1, 3] + [0] * 5 + [3, 3, 1, 2, 3] + [0] * 30 + [2, 3] + [0] * 130 + [1, 3]
)


def _greedy_and_sampled(lengths):
    """Greedy and seeded sampled requests by turns (sampled text does not settle into a loop
    the drafter never guesses, so drafts get accepted), of the given lengths."""
    return [
        SamplingParams(temperature=0.9 if i % 2 else 0, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]


def _plain_alone(target, prompts, params, **kw):
    return [_run(target, prompts=[p], params=sp, max_num_seqs=1, **kw)[0][0] for p, sp in zip(prompts, params)]


def _alternating(target, draft, prompts, params, ahead=False, prefill_graphs=(), **kw):
    """Run an adaptive engine whose policy follows ALTERNATING; returns the outputs, the engine
    and what happened: drafter forwards run inside plain steps (`plain_forwards`), plain steps
    run from a step queued ahead while stale (`queued_stale`), the most stale entries of each
    catch-up (`caught_up`) and each cycle's draft tokens (`drafts`). `prefill_graphs`: buckets of
    prefill graphs, played eagerly."""
    config = dict(model=str(target), draft=str(draft), adaptive=True, max_spec_steps=3, device="cpu", **kw)
    engine = engine_with_prefill_graphs(prefill_graphs, **config) if prefill_graphs else Engine(EngineConfig(**config))
    engine.launch_ahead = ahead
    steps = iter(ALTERNATING * 20)
    engine.policy.choose = lambda B, remaining=None, stale=False, context=0: next(steps)
    seen = {"plain_forwards": 0, "queued_stale": 0, "caught_up": [], "drafts": [], "graph_catch_ups": 0}
    in_plain, in_catch_up = [False], [False]

    def plain_step(seqs, _f=engine._plain_step):
        seen["queued_stale"] += engine.overlap.plain is not None and any(s.stale for s in seqs)
        in_plain[0] = True
        try:
            return _f(seqs)
        finally:
            in_plain[0] = False

    def drafter_extend(*a, _f=engine.runner.drafter_extend):
        seen["plain_forwards"] += in_plain[0]
        return _f(*a)

    def catch_up(seqs, budget, _f=engine.proposer.catch_up):
        seen["caught_up"].append(max(s.stale for s in seqs))
        in_catch_up[0] = True
        try:
            return _f(seqs, budget)
        finally:
            in_catch_up[0] = False

    def graph_prefill(*a, _f=engine.runner._graph_prefill):
        seen["graph_catch_ups"] += in_catch_up[0]
        return _f(*a)

    engine.runner._graph_prefill = graph_prefill

    def draft(*a, _f=engine.proposer.draft):
        out = _f(*a)
        seen["drafts"].append(out.tokens.tolist())
        return out

    engine._plain_step, engine.runner.drafter_extend = plain_step, drafter_extend
    engine.proposer.catch_up, engine.proposer.draft = catch_up, draft
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    return [s.output_ids for s in seqs], engine, seen


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_plain_stretches_skip_drafter_upkeep(small_pair, monkeypatch, batch, tree):
    """Adaptive mode held on plain decoding for long stretches: plain steps run no drafter forward
    (they store drafter inputs only while the buffer has room, then none), and the next cycle
    catches the drafter up by recomputing the target's features. Output (greedy and seeded
    sampling) equals plain decoding's, with sequences of different lengths joining and leaving
    and plain steps queued ahead, and the drafts equal those of an engine whose buffer stores
    every plain step's inputs (wrong drafter KV would change the drafts, not the tokens)."""
    target, draft = small_pair
    prompts = _prompts(batch + 2, seed=40 + batch)
    params = _greedy_and_sampled((150, 35, 90, 120, 60))
    kw = dict(max_num_seqs=batch, max_model_len=256, prefill_chunk=16)
    if tree:
        kw.update(spec_topk=3, spec_tree_max_batch=4)
    base = _plain_alone(target, prompts, params, max_model_len=256)
    out, engine, seen = _alternating(target, draft, prompts, params, **kw)
    assert out == base
    assert seen["plain_forwards"] == 0
    assert max(seen["caught_up"]) > kw["prefill_chunk"]  # a catch-up recomputed in several pieces
    assert sum(map(len, seen["drafts"])) == engine.totals.cycles > 10
    # Queued ahead, all sequences admitted at once (plain steps are queued only while none waits).
    ahead, _, queued = _alternating(target, draft, prompts, params, ahead=True, **{**kw, "max_num_seqs": len(prompts)})
    assert ahead == base and queued["plain_forwards"] == 0 and queued["queued_stale"] > 0
    # Catch-ups through prefill graphs (their rows' tokens before computed again): the same tokens and drafts.
    graphed, engine, seen_g = _alternating(target, draft, prompts, params, prefill_graphs=(16, 64, 128, 256), **kw)
    assert graphed == base and seen_g["drafts"] == seen["drafts"] and engine.runner.graph_prefill_tokens() == 256
    if batch == 1:  # (3 rows of up to 256 tokens are past two graphs' worth: eager)
        assert seen_g["graph_catch_ups"] > 0
    monkeypatch.setattr("specserve.engine.runner.PENDING_WIDTH", 512)
    _, _, stored = _alternating(target, draft, prompts, params, **kw)
    assert not stored["caught_up"] and stored["drafts"] == seen["drafts"]


def test_plain_stretches_with_preemption_and_prefix_cache(small_pair):
    """Long plain stretches in a pool too small for every sequence, with prefix caching: stale
    sequences are preempted and recomputed, and output still equals plain decoding's, with the
    prefill graphs too (prefix hits, recomputed sequences and catch-ups going through them)."""
    target, draft = small_pair
    shared = _prompts(1, seed=50)[0] * 3
    prompts = [shared + p for p in _prompts(4, seed=51)]
    params = _greedy_and_sampled((100, 70, 100, 40))
    kw = dict(max_num_seqs=4, kv_block_size=8, max_model_len=192)
    base = _plain_alone(target, prompts, params, max_model_len=192)
    for graphs in ((), (16, 64, 128, 256)):  # (prefill graphs played eagerly: hits and recomputes take them)
        out, engine, seen = _alternating(
            target, draft, prompts, params, kv_cache_tokens=320, prefix_cache=True, prefill_graphs=graphs, **kw
        )
        assert out == base, graphs
        kv = engine.kv_usage()
        assert kv["preemptions"] > 0 and kv["prefix_hit_tokens"] > 0 and seen["caught_up"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree", "sampled", "adaptive", "position-limit"])
def test_drafts_queued_ahead_change_nothing(small_pair, tmp_path, mode):
    """Each cycle's draft queued behind the previous verify, from entries computed on the device
    (as on CUDA): the same tokens as drafting after the host read the results, with sequences
    ending mid-batch (stop ids, lengths), rows moving, K changing between cycles, sampled rows
    and a drafter position limit (also the same drafts: acceptance per position is equal); and
    queued drafts were really used."""
    target, draft = small_pair
    prompts = _prompts(5, seed=17)
    temperature = 0.8 if mode == "sampled" else 0.0
    params = [
        SamplingParams(
            temperature=temperature, seed=i, max_tokens=n, stop_token_ids=[5] if i % 2 else [], ignore_eos=True
        )
        for i, n in enumerate((50, 9, 33, 50, 20))
    ]
    kw = dict(spec_steps=3)
    if mode == "tree":
        kw.update(spec_topk=3, spec_tree_max_batch=4)
    if mode == "adaptive":
        kw = dict(spec_steps=0, max_spec_steps=3, adaptive=True)
    if mode == "position-limit":
        draft = make_drafter(tmp_path / "short", target, draft_vocab=8, max_pos=60)

    def run(ahead: bool):
        engine = Engine(EngineConfig(model=str(target), draft=str(draft), device="cpu", max_num_seqs=3, **kw))
        engine.launch_ahead = ahead
        if mode == "adaptive":  # K rising, falling and 0 between cycles
            steps = iter([3, 3, 2, 3, 1, 1, 0, 3, 2, 2, 3] * 40)
            engine.policy.choose = lambda B, remaining=None, stale=False, context=0: next(steps)
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_work():
            engine.step()
        engine.check_idle_integrity()
        return [(s.output_ids, s.finish_reason) for s in seqs], engine

    base, engine = run(False)
    assert engine.drafts_ahead == 0 and engine.totals.cycles > 0
    assert {r for _, r in base} == {"stop", "length"}
    drafts = engine.totals.as_dict()
    out, engine = run(True)
    assert out == base
    assert engine.drafts_ahead > 0
    # The same drafts too (a wrong drafter input would change acceptance, not the tokens).
    assert engine.totals.as_dict() == drafts


@pytest.mark.gpu
def test_drafts_queued_ahead_on_gpu(small_pair):
    """On CUDA with graphs (float32): drafts queued behind the previous verify give the tokens that
    drafting after the host read gives, for chains and trees, greedy and sampled."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, draft = small_pair
    prompts = _prompts(4, seed=43)
    sampled = SamplingParams(temperature=0.9, max_tokens=40, seed=3, ignore_eos=True)
    for params in (GREEDY, sampled):
        for kw in (dict(spec_steps=3), dict(spec_steps=4, spec_topk=3, spec_tree_max_batch=4)):
            outs = []
            for ahead in (False, True):
                engine = Engine(
                    EngineConfig(
                        model=str(target), draft=str(draft), device="cuda", dtype="float32", max_num_seqs=4, **kw
                    )
                )
                engine.launch_ahead = ahead
                seqs = [engine.add_request(p, params) for p in prompts]
                while engine.has_work():
                    engine.step()
                outs.append([s.output_ids for s in seqs])
                assert (engine.drafts_ahead > 0) == ahead
            assert outs[0] == outs[1], (params, kw)


@pytest.mark.slow
def test_prefill_through_the_staging_cache(small_pair, monkeypatch):
    """The prompt prefill that CUDA graphs run, played eagerly on the CPU: target and drafter
    write a one-row staging cache (the same graph serves every row), the KV is copied to the
    sequence's row, and generation equals that of the ordinary prefill, chains and trees, at
    rows other than 0 and prompt lengths padded within a bucket; so do the drafts (acceptance)."""
    target, draft = small_pair
    prompts = [list(range(1, VOCAB - 1)) * 5] + _prompts(3, seed=21)  # lengths 50 (bucket 64) and 1-29
    for kw in (dict(spec_steps=3), dict(spec_steps=3, spec_topk=2, spec_tree_max_batch=4)):
        ref = Engine(EngineConfig(model=str(target), draft=str(draft), device="cpu", max_num_seqs=3, **kw))
        engine = engine_with_prefill_graphs(
            (16, 64), model=str(target), draft=str(draft), device="cpu", max_num_seqs=3, **kw
        )
        r = engine.runner
        assert r.kv.stage_len == 80 and r.kv.k_stage.shape[1] == 1 and r.kv.table.shape[0] == 3
        staged = []  # (row, tokens) of each graph prefill
        real = r._graph_prefill
        monkeypatch.setattr(r, "_graph_prefill", lambda *a: (staged.append((a[0], len(a[1][0]))), real(*a))[1])
        outs = []
        for e in (ref, engine):
            seqs = []
            for p in prompts:  # arriving one by one: each prefilled alone, at the next free row
                seqs.append(e.add_request(p, GREEDY))
                e.step()
            while e.has_work():
                e.step()
            e.check_idle_integrity()
            outs.append(([s.output_ids for s in seqs], e.totals.as_dict()))
        assert outs[0] == outs[1] and outs[1][1]["accepted_tokens"] > 0, kw
        assert len(staged) == len(prompts) and {row for row, _ in staged} == {0, 1, 2} and staged[0] == (0, 50), staged


@pytest.mark.slow
def test_prompts_arriving_together_share_one_prefill_graph(small_pair, monkeypatch):
    """Prompts admitted together are packed one after another into one prefill graph (each query seeing
    only its own prompt's keys, rope positions restarting at each prompt), their KV copied to their rows,
    and into consecutive graphs where one is too short: generation equals the ordinary prefill's, greedy
    and seeded, chains and trees, drafts included. Where the graphs would replay more than two of the
    largest's tokens, the eager prefill serves."""
    target, draft = small_pair
    prompts = _prompts(3, seed=21) + [list(range(1, VOCAB - 1)) * 3]  # 11, 11, 22 and 30 tokens
    seeded = SamplingParams(temperature=0.8, max_tokens=16, seed=3)
    for kw in (dict(spec_steps=3), dict(spec_steps=3, spec_topk=2, spec_tree_max_batch=4)):
        ref = Engine(EngineConfig(model=str(target), draft=str(draft), device="cpu", max_num_seqs=4, **kw))
        engine = engine_with_prefill_graphs(
            (16, 64), model=str(target), draft=str(draft), device="cpu", max_num_seqs=4, **kw
        )
        r = engine.runner
        packed = []
        real = r._graph_prefill
        monkeypatch.setattr(r, "_graph_prefill", lambda *a: (packed.append(len(a[1])), real(*a))[1])
        # 44 tokens: one graph of 64; 74: two (44 + 30); 3 x 60: three graphs of 64, past two: eager
        for batch in (prompts[:3], prompts, [list(range(1, VOCAB - 1)) * 6] * 3):
            for params in (GREEDY, seeded):
                outs = []
                for e in (ref, engine):
                    seqs = [e.add_request(p, params) for p in batch]  # all at once: one prefill chunk
                    while e.has_work():
                        e.step()
                    e.check_idle_integrity()
                    outs.append([s.output_ids for s in seqs])
                assert outs[0] == outs[1], (kw, params)
        assert engine.totals.as_dict()["accepted_tokens"] > 0
        assert packed == [3] * 2 + [3, 1] * 2, packed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafter_write_kv_writes_what_its_forward_writes(small_pair, dtype):
    """A prompt's prefill and a catch-up need only the drafter's KV: `write_kv` skips its attention, output
    projection and MLP and writes, bit for bit, the keys and values its forward writes (float32 through the
    native CPU kernels, bfloat16 through torch)."""
    target, draft = small_pair
    r = Engine(EngineConfig(model=str(target), draft=str(draft), device="cpu", dtype=dtype, max_num_seqs=2)).runner
    r.reserve_every_row()
    attn = r.drafter.attention_modules()[0]
    g = torch.Generator().manual_seed(4)
    T = 13
    tok = torch.randint(0, VOCAB - 1, (2, T), generator=g)
    feat = torch.randn(2, T, 3 * r.model_cfg.hidden_size, generator=g).to(r.dtype)
    pos = torch.arange(T).repeat(2, 1)
    pos[1, 9:] = r.scratch  # a shorter row: padding at the scratch slot
    written = []
    for run in (lambda ctx: r.drafter(tok, feat, ctx), lambda ctx: r.drafter.write_kv(tok, feat, ctx)):
        attn.k_cache.zero_()
        attn.v_cache.zero_()
        with torch.inference_mode():
            run(r._context(pos, pos, 0))
        written.append((attn.k_cache.clone(), attn.v_cache.clone()))
    assert written[0][0].abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(*written))


@pytest.mark.slow
def test_graph_prefill_results_outlive_the_next_replay(small_pair):
    """A graph's outputs are refilled by its next replay; what `prefill` returns is the caller's to keep (the
    drafter's regeneration concatenates the logits of several calls)."""
    target, _ = small_pair
    r = engine_with_prefill_graphs((16, 64), model=str(target), device="cpu", max_num_seqs=2).runner
    r.reserve_every_row()
    prompts = _prompts(4, seed=5)
    first = r.prefill(0, prompts[:2], [0, 0])[0]
    kept = first.clone()
    second = r.prefill(0, prompts[2:], [0, 0])[0]
    assert torch.equal(first, kept) and not torch.equal(first, second)


@pytest.mark.slow
def test_prefix_cache_hits_take_the_prefill_graph_with_their_history(small_pair, monkeypatch):
    """A prompt whose first blocks the prefix cache holds starts its chunk past them: a prefill graph takes it
    with its tokens before the chunk computed again (their cached KV left as it is), packed with the other
    arrivals; generation equals that without graphs and without the cache, drafts included."""
    target, draft = small_pair
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (22, 35, 18)]
    outs = []
    for cache, graphs in ((False, False), (True, False), (True, True)):
        config = dict(
            model=str(target),
            draft=str(draft),
            device="cpu",
            max_num_seqs=3,
            spec_steps=3,
            prefix_cache=cache,
            kv_block_size=16,
        )
        e = engine_with_prefill_graphs((16, 64, 128), **config) if graphs else Engine(EngineConfig(**config))
        calls = []
        if graphs:
            real = e.runner.prefill
            monkeypatch.setattr(
                e.runner,
                "prefill",
                lambda row, chunks, starts, history=None, after=None: (
                    calls.append((tuple(starts), history is not None, e.runner.graph_prefill_tokens())),
                    real(row, chunks, starts, history, after),
                )[1],
            )
        got = []
        for _ in range(2):  # the second time round, the prompts' full blocks are cached
            seqs = [e.add_request(p, GREEDY) for p in prompts]
            while e.has_work():
                e.step()
            e.check_idle_integrity()
            got.append([s.output_ids for s in seqs])
        outs.append(got)
        if graphs:
            assert calls[0][:2] == ((0, 0, 0), False) and calls[-1] == ((16, 32, 16), True, 128), calls
            assert e.totals.as_dict()["accepted_tokens"] > 0
    assert outs[0] == outs[1] == outs[2]


def _graph_prefill_equals_eager(r, graphs, tol):
    """Prefill graphs (`graphs`: GraphKey -> Graph) against the eager prefill of the same rows: logits, each
    row's last EAGLE features, the target's KV and the drafter's KV of the entries given their next token
    (`after`: a row's last entry without one is not written), for prompts packed into one graph, a prompt
    alone at a row other than 0, prompts past one graph's tokens (consecutive groups), and chunks past a
    history (the graph computes the history again; its KV stays as the eager prefill left it)."""
    r.reserve_every_row()
    g = torch.Generator().manual_seed(7)
    drafter_kv = r.drafter.attention_modules()[0]

    def rand(n):
        return torch.randint(0, VOCAB - 1, (n,), generator=g).tolist()

    def kv(row, start, n):
        block, offset = r.kv.slots(row, n, start)
        return [c[:, block, :, offset].clone() for c in (r.kv.k_all, r.kv.v_all)] + [
            c[block, :, offset].clone() for c in (drafter_kv.k_cache, drafter_kv.v_cache)
        ]

    def run(row, chunks, starts, history, after, use):
        r.graphs = graphs if use else {}
        out = [t.clone() for t in r.prefill(row, chunks, starts, history if use else None, after)]
        for i, (s0, c) in enumerate(zip(starts, chunks)):
            n = len(c) if after[i] >= 0 else len(c) - 1  # (no entry written at the last index: left as it was)
            out += kv(row + i, s0, n)
        return out

    cases = [
        (0, [rand(n) for n in (5, 40, 17)], None),
        (1, [rand(100)], None),
        (0, [rand(n) for n in (1, 2, 3, 50)], None),
        (0, [rand(n) for n in (60, 56)], None),
        (0, [rand(n) for n in (30, 20, 1)], [rand(n) for n in (16, 9, 40)]),
    ]
    for row, chunks, history in cases:
        starts = [len(h) for h in history] if history else [0] * len(chunks)
        after = [rand(1)[0] if i % 2 else -1 for i in range(len(chunks))]
        if history:  # the history's KV, eagerly (the drafter's with its tokens)
            r.graphs = {}
            r.prefill(row, history, [0] * len(history), None, [c[0] for c in chunks])
        got = run(row, chunks, starts, history, after, True)
        for c in (r.kv.k_all, r.kv.v_all, drafter_kv.k_cache, drafter_kv.v_cache):  # the chunks' KV again
            for i, (s0, ch) in enumerate(zip(starts, chunks)):
                block, offset = r.kv.slots(row + i, len(ch), s0)
                if c.dim() == 5:
                    c[:, block, :, offset] = 0
                else:
                    c[block, :, offset] = 0
        want = run(row, chunks, starts, history, after, False)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    r.graphs = graphs


@pytest.mark.slow
def test_graph_prefill_writes_the_target_and_drafter_kv_of_the_eager_prefill(small_pair):
    """The prefill graph (played eagerly on the CPU) writes what the eager prefill writes, the drafter's
    entries included (`_graph_prefill_equals_eager`)."""
    target, draft = small_pair
    r = engine_with_prefill_graphs(
        (16, 64, 128), model=str(target), draft=str(draft), device="cpu", max_num_seqs=4
    ).runner
    _graph_prefill_equals_eager(r, r.graphs, 1e-5)


@pytest.mark.gpu
def test_prefill_graphs_equal_eager_prefill_on_gpu(small_pair):
    """On CUDA: the captured prefill graphs (the Triton and SDPA attention paths) write and return what the
    eager prefill does (`_graph_prefill_equals_eager`)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target, draft = small_pair
    r = Engine(EngineConfig(model=str(target), draft=str(draft), device="cuda", dtype="float32", max_num_seqs=4)).runner
    assert GraphKey("prefill", 1, tokens=64) in r.graphs
    _graph_prefill_equals_eager(r, r.graphs, 1e-4)


@pytest.mark.gpu
def test_no_reference_fallbacks_on_gpu(small_pair, monkeypatch):
    """On CUDA every step of plain, chain and tree decoding at batch 1 and 3 runs the fused
    kernels: the PyTorch references (kept for CPU and odd layouts) are never called. A layout the
    kernels refuse falls back silently and slowly (a batched decode step once did, 45% slower)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specserve.kernels import norm, tree

    target, draft = small_pair
    calls = []
    for mod, name in (
        (norm, "rms_norm_ref"),
        (norm, "rope_store_kv_ref"),
        (norm, "silu_mul_ref"),
        (tree, "tree_level_ref"),
    ):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    for kw in (dict(), dict(spec_steps=3), dict(spec_steps=4, spec_topk=3, spec_tree_max_batch=3)):
        for n in (1, 3):
            _run(
                target,
                draft if kw else None,
                _prompts(n, seed=9),
                GREEDY,
                max_num_seqs=3,
                device="cuda",
                dtype="bfloat16",
                **kw,
            )
            assert calls == [], (kw, n, sorted(set(calls)))


@pytest.mark.slow
def test_generate_cli_with_a_tree(capsys):
    """`specserve generate --spec-topk/--spec-tokens` on the bundled pair: the same text as plain
    decoding, tree statistics in --json; inconsistent tree flags fail with a clear message."""
    import json

    from specserve.cli import main

    common = ["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "24", "--json", "--device", "cpu"]
    assert main([*common, "--spec-steps", "0"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--spec-steps", "5", "--spec-topk", "4", "--spec-tokens", "12"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["token_ids"] == plain["token_ids"] and tree["stats"]["cycles"] > 0
    assert main([*common, "--spec-steps", "3", "--spec-tokens", "8"]) == 1
    assert "--spec-tokens sizes a tree of drafts: it needs --spec-topk > 1" in capsys.readouterr().err
    assert main([*common, "--spec-steps", "9", "--spec-topk", "16"]) == 1
    assert "at most 63" in capsys.readouterr().err


def test_step_costs_include_the_handling_of_their_own_tokens(small_pair):
    """The adaptive policy charges each step from its start to the start of the next one, so the
    caller's handling of a step's tokens (which grows with them: a speculative cycle emits several)
    lands on that step, not on whichever K runs next. Here the caller spends a fixed pause after
    each speculative cycle and none after a plain step, and K alternates 0, 2, 0, 2, ...: every
    cycle's recorded cost includes its pause (a lower bound, whatever the machine's load; charged
    to the next step instead, it would land on a plain step)."""
    target, draft = small_pair
    engine = Engine(
        EngineConfig(model=str(target), draft=str(draft), device="cpu", adaptive=True, spec_steps=2, max_num_seqs=2)
    )
    policy = engine.policy
    picks, costs = iter([0, 2] * 100), []
    policy.choose = lambda B, remaining=None, stale=False, context=0: next(picks)
    observe = policy.observe_cost
    policy.observe_cost = lambda B, K, seconds, context=0: (costs.append((K, seconds)), observe(B, K, seconds, context))
    pause = 0.05
    for p in _prompts(2, seed=3):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while engine.has_work():
        engine.step()
        if engine.last_k:
            time.sleep(pause)
    spec = [c for K, c in costs if K]
    assert len(spec) >= 5 and all(c >= pause for c in spec)


def test_policy_backs_off_exploring_speculation_that_keeps_losing():
    """Held on plain decoding (speculation seeded cheap, slow live: its seeds keep it within reach),
    each exploration of a K > 0 costs a drafter catch-up after the plain steps before it, so while
    plain stays best speculation is explored ever more rarely (the gap, shared by every K > 0,
    doubles to EXPLORE_MAX_GAP), not every EXPLORE_EVERY-th decision; a K that turns out cheap is
    soon chosen for good."""
    from specserve.spec.policy import EXPLORE_EVERY, EXPLORE_MAX_GAP, SpecPolicy

    real = {0: 1.0, 1: 3.0, 2: 4.0}
    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=2)
    policy.seed_costs({(4, 0): 1.0, (4, 1): 1.3, (4, 2): 1.6})
    for _ in range(50):
        policy.observe_acceptance(2, [1], 4)
    picks = _run_policy(policy, 4, real, choices=200 * EXPLORE_EVERY)
    explored = sum(1 for k in picks if k)
    assert 0 < explored <= 2 * (len(picks) // EXPLORE_MAX_GAP + 6)  # every 24th would be 200
    assert len(picks) - max(i for i, k in enumerate(picks) if k) <= 2 * EXPLORE_MAX_GAP  # still explored late on
    real[1] = 0.5  # K=1 became cheap: its next exploration makes it the best, and it stays
    tail = _run_policy(policy, 4, real, choices=4 * EXPLORE_MAX_GAP)[-EXPLORE_MAX_GAP:]
    assert tail.count(1) > 0.9 * len(tail)


def test_policy_spaces_explorations_by_what_a_switch_costs():
    """An exploration from plain decoding first catches the drafter up, an eager forward that can cost
    dozens of graph-replayed plain steps (a small model on a GPU). Where it does, explorations are
    spaced so those catch-ups take at most EXPLORE_SHARE of the time, past EXPLORE_MAX_GAP."""
    from specserve.spec.policy import EXPLORE_MAX_GAP, EXPLORE_SHARE, SpecPolicy

    real = {0: 1.0, 1: 3.0, 2: 4.0}
    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=2)
    policy.seed_costs({(4, 0): 1.0, (4, 1): 1.3, (4, 2): 1.6})
    for _ in range(50):
        policy.observe_acceptance(2, [1], 4)
    policy.observe_switch(4, 40.0)  # a catch-up costs 40 plain steps
    wait = 40.0 / EXPLORE_SHARE
    assert wait > EXPLORE_MAX_GAP
    picks = _run_policy(policy, 4, real, choices=int(6 * wait))
    at = [i for i, k in enumerate(picks) if k]
    assert len(at) >= 3  # still explored
    assert all(b - a >= wait for a, b in zip(at[1:], at[2:]))  # once backing off, a catch-up's worth apart


def test_batch_job_charges_a_switch_from_plain_its_catch_up():
    """A batch job's last row has 40 tokens left, and K=1 would finish them in ~26 s (2 tokens a 1.3 s
    cycle) against 40 s of plain steps: chosen while the drafter is current, but not coming from plain
    decoding once catching the drafter up has been timed at 20 s; with 400 tokens left it earns that back."""
    from specserve.spec.policy import SpecPolicy

    policy = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=1)
    policy.seed_costs({(1, 0): 1.0, (1, 1): 1.3})
    for _ in range(200):
        policy.observe_acceptance(1, [1], 1)  # every draft accepted
    assert policy.choose(1, [40]) == 1 and policy.choose(1, [40], stale=True) == 1  # no catch-up timed yet
    policy.observe_switch(1, 20.0)
    assert policy.choose(1, [40], stale=False) == 1
    assert policy.choose(1, [40], stale=True) == 0
    assert policy.choose(1, [400], stale=True) == 1
