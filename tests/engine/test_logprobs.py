"""Log-probabilities of emitted tokens: the target's raw distribution (temperature 1, no
filtering) at each token's position, the same with plain decoding, chain and tree speculation
and work queued ahead, checked against transformers' own logits for the same tokens."""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams

VOCAB = 12  # small: a random drafter agrees often, so cycles accept several tokens
TOL = 1e-4

MODES = {
    "plain": {},
    "plain_ahead": {"launch_ahead": True},
    "chain": {"spec_steps": 3},
    "chain_ahead": {"spec_steps": 3, "launch_ahead": True},
    "tree": {"spec_steps": 3, "spec_topk": 3, "spec_tree_max_batch": 8},
}


@pytest.fixture(scope="module")
def hf_model(small_pair):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(small_pair[0]), torch_dtype=torch.float32).eval()


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB - 1, (4 + 5 * i,), generator=g).tolist() for i in range(n)]


def _run(small_pair, mode: str, prompts, params):
    kw = dict(MODES[mode])
    ahead = kw.pop("launch_ahead", False)
    draft = str(small_pair[1]) if "spec_steps" in kw else None
    engine = Engine(EngineConfig(model=str(small_pair[0]), draft=draft, device="cpu", max_num_seqs=len(prompts), **kw))
    engine.launch_ahead = ahead
    plist = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    if "spec_steps" in kw:
        assert engine.totals.accepted > 0, "no draft was accepted: the speculative paths went untested"
    return seqs


def _reference(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at the position before each output token [n, V]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], -1)


def _check_against_reference(hf_model, seq, k: int) -> None:
    ref = _reference(hf_model, seq.prompt_ids, seq.output_ids)
    assert seq.logprobs is not None and len(seq.logprobs) == len(seq.output_ids)
    for i, (tok, e) in enumerate(zip(seq.output_ids, seq.logprobs)):
        assert e.token == tok
        assert abs(e.logprob - ref[i, tok].item()) < TOL, f"token {i}"
        assert len(e.top) == k
        vals = [lp for _, lp in e.top]
        assert vals == sorted(vals, reverse=True)
        want = ref[i].topk(k)
        assert torch.allclose(torch.tensor(vals), want.values, atol=TOL)
        for t, lp in e.top:
            assert abs(lp - ref[i, t].item()) < TOL
            if t == tok:
                assert lp == e.logprob  # the same number, not a recomputation


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_logprobs_equal_transformers(small_pair, hf_model, mode, batch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    seqs = _run(small_pair, mode, _prompts(batch), params)
    for seq in seqs:
        _check_against_reference(hf_model, seq, 5)
        assert seq.logprobs[0].top[0][0] == seq.output_ids[0]  # greedy emits the most likely token


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_speculation_reports_what_plain_decoding_reports(small_pair, mode):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = _run(small_pair, "plain", _prompts(3), params)
    spec = _run(small_pair, mode, _prompts(3), params)
    for a, b in zip(plain, spec):
        assert a.output_ids == b.output_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-5
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("mode", ["plain", "chain", "tree"])
def test_sampled_requests_report_the_raw_distribution(small_pair, hf_model, mode):
    """Temperature and top-k change what is drawn, not what is reported: the target's own
    distribution at temperature 1."""
    params = SamplingParams(temperature=0.7, top_k=4, seed=11, max_tokens=20, ignore_eos=True, logprobs=2)
    for seq in _run(small_pair, mode, _prompts(2), params):
        _check_against_reference(hf_model, seq, 2)


def test_only_requests_that_ask_get_logprobs(small_pair, hf_model):
    asks = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    silent = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seqs = _run(small_pair, "chain", _prompts(3), [silent, asks, silent])
    assert seqs[0].logprobs is None and seqs[2].logprobs is None
    _check_against_reference(hf_model, seqs[1], 0)


def test_logprobs_out_of_range_is_refused():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="logprobs must be"):
            SamplingParams(logprobs=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [{"spec_steps": 3}, {"spec_steps": 3, "spec_topk": 4, "spec_tree_max_batch": 4}])
def test_gpu_graphs_report_what_plain_graphs_report(demo_pair, spec):
    """On CUDA with graphs and work queued ahead: a speculating engine's log-probabilities equal a
    plain engine's for the same greedy tokens (bf16: small tolerance), batch 1 and 3 mixed with
    requests that do not ask; graphs exist for every step kind used."""
    target, draft = demo_pair
    from specserve.engine.llm import LLM

    prompts = ["def add(a, b):", "import os\n", "class Stack:\n    def __init__(self):"]
    asks = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
    silent = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(target, device="cuda", max_num_seqs=3, max_model_len=512)
    spec_llm = LLM(target, draft, device="cuda", max_num_seqs=3, max_model_len=512, **spec)
    assert plain.engine.runner.graphs and spec_llm.engine.runner.graphs
    for batch in (1, 3):
        params = [asks, silent, asks][:batch]
        a = plain.generate(prompts[:batch], params)
        b = spec_llm.generate(prompts[:batch], params)
        assert spec_llm.engine.totals.accepted > 0
        for x, y, p in zip(a, b, params):
            if p.logprobs is None:
                assert x.logprobs is None and y.logprobs is None
                continue
            n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
            assert n >= 8, "greedy outputs diverge too early to compare"
            assert len(y.logprobs) == len(y.token_ids)
            for i in range(n):
                assert y.logprobs[i].token == y.token_ids[i]
                assert abs(x.logprobs[i].logprob - y.logprobs[i].logprob) < 0.05, i
                vals = [lp for _, lp in y.logprobs[i].top]
                assert vals == sorted(vals, reverse=True) and len(vals) == 5
