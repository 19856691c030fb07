"""The Kimi-K2.5-shaped repository (tests/kimi_repo.py: wrapper config, vision tensors, int4 routed experts,
tiktoken tokenizer, chat template with tools and thinking) and its EAGLE-3 drafter: `check` passes and names the
drafter's context limit, logits equal transformers' DeepseekV3 on the dequantized weights, and served with its
drafter the real `openai` client chats and streams, reasoning_content apart from content with thinking on and
none with thinking off, the speculative greedy replies equal plain decoding's."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.llm import LLM, SamplingParams
from specserve.server.reasoning import ReasoningSplitter

from kimi_repo import build
from serving import HAVE_HTTP, NAME, Live
from tiny import assert_decode_matches

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]  # the tiny model closes its reasoning
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return build(tmp_path_factory.mktemp("kimi"))


def test_check_passes_and_names_the_drafters_context_limit(kimi):
    from specserve.ops import check

    target, draft, _ = kimi
    found = check.run_checks(str(target), str(draft), device="cpu", max_num_seqs=1, max_model_len=128)
    assert not check.has_errors(found), check.format_report(found)
    by = {f.code: f for f in found}
    assert by["target_tokenizer"].message.startswith("tiktoken.model: 712 tokens")
    tmpl = by["chat_template"]
    assert tmpl.data == {
        "tools": True,
        "thinking_switch": "thinking",
        "reasoning_parser": "think",
        "tool_calls": "kimi_k2",
    }
    assert "'<|im_end|>'" in tmpl.message and "'[EOS]'" in tmpl.message
    assert "4 layers" in by["target_config"].message and "int4" in by["target_weights"].message
    too_long = check.run_checks(str(target), str(draft), device="cpu", max_num_seqs=1, max_model_len=256)
    (err,) = [f for f in too_long if f.level == "error"]
    assert err.code == "draft_positions" and err.data == {"served": 256, "draft_max": 128, "target_max": 256}


def test_logits_equal_transformers_deepseek_v3_on_the_dequantized_weights(kimi):
    import transformers

    target, _, twin = kimi
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    assert_decode_matches(target, hf, prompt_len=13, steps=8)


@pytest.fixture(scope="module")
def served(kimi):
    if not HAVE_HTTP:
        pytest.skip("fastapi, uvicorn, httpx and openai are needed for the HTTP tests")
    target, draft, _ = kimi
    engine = dict(model=str(target), device="cpu", max_model_len=128, max_num_seqs=2)
    plain = LLM(**engine)
    srv = Live(lambda: LLM(**engine, draft=str(draft), spec_steps=3), max_num_seqs=2, max_queue=8)
    srv.wait_ready()
    yield srv, plain
    srv.close()


def test_served_with_its_drafter_chats_streams_and_splits_reasoning(served):
    srv, plain = served
    assert srv.loop.llm.engine.policy is not None  # speculation on
    client = srv.client()
    tok = plain.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for thinking in (True, False):
        prompt = tok.apply_chat_template(QUESTION, thinking=thinking)
        want = plain.generate([prompt], greedy)[0]  # plain decoding: the speculative server must equal it
        reasoning, content = ReasoningSplitter("think", prompt).split(want.text)
        extra = {"chat_template_kwargs": {"thinking": thinking}}
        reply = client.chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        msg = reply.choices[0].message
        assert (getattr(msg, "reasoning_content", None), msg.content) == (reasoning, content)
        assert reply.usage.completion_tokens == len(want.token_ids)
        if thinking:
            assert reasoning and content and "</think>" not in reasoning  # both parts, split at the first marker
        else:
            assert reasoning is None and content == want.text
        chunks = list(
            client.chat.completions.create(
                model=NAME, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=extra
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed_reasoning = [getattr(d, "reasoning_content", None) for d in deltas]
        assert all(not (r and d.content) for r, d in zip(streamed_reasoning, deltas))  # each part its own deltas
        assert "".join(r or "" for r in streamed_reasoning) == (reasoning or "")
        assert "".join(d.content or "" for d in deltas) == content
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert srv.info()["speculation"]["since_start"]["cycles"] > 0


def test_bad_chat_template_kwargs_are_named(served):
    import openai

    srv, _ = served
    client = srv.client()
    for kwargs, words in (
        ({"thinking": "yes"}, "chat_template_kwargs.thinking must be a boolean"),
        ({"messages": []}, "may not set messages"),
        ([1], "must be an object"),
    ):
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(
                model=NAME, messages=QUESTION, max_tokens=2, extra_body={"chat_template_kwargs": kwargs}
            )


@pytest.mark.slow
def test_served_tp2_with_its_drafter_equals_tp1_plain(kimi, served):
    """The founding user's setup: tensor parallel (two gloo ranks, routed int4 experts sharded), speculation on,
    over HTTP: the thinking reply's parts equal plain single-process decoding's."""
    from specserve.distributed.tp_llm import TPLLM

    target, draft, _ = kimi
    _, plain = served
    prompt = plain.tokenizer.apply_chat_template(QUESTION)
    want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    engine = dict(model=str(target), device="cpu", max_model_len=128, max_num_seqs=2)
    srv = Live(lambda: TPLLM(**engine, tp=2, draft=str(draft), spec_steps=3), max_num_seqs=2, max_queue=8)
    try:
        srv.wait_ready()
        msg = (
            srv.client()
            .chat.completions.create(model=NAME, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
            .choices[0]
            .message
        )
        assert (msg.reasoning_content, msg.content) == ReasoningSplitter("think", prompt).split(want.text)
    finally:
        srv.close()


def test_generate_chat_with_template_kwargs(kimi, served, capsys):
    """`specserve generate --chat --chat-template-kwargs` on the repository, with its drafter: plain decoding's reply."""
    import json

    from specserve.cli import main

    target, draft, _ = kimi
    _, plain = served
    prompt = plain.tokenizer.apply_chat_template(QUESTION, thinking=False)
    want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert (
        main(
            [
                "generate",
                "--model",
                str(target),
                "--draft",
                str(draft),
                "--device",
                "cpu",
                "--max-model-len",
                "128",
                "--chat",
                "--prompt",
                QUESTION[0]["content"],
                "--max-tokens",
                str(MAX_TOKENS),
                "--chat-template-kwargs",
                '{"thinking": false}',
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["text"] == want.text
