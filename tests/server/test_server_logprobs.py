"""logprobs / top_logprobs over HTTP with the real `openai` client: completions and chat,
streaming and not, batches of one and three, against a speculating server; the values are
transformers' log_softmax of the same model's logits for the emitted tokens.

Shares the demo pair and the in-process `Live` server of test_server.py.
"""

from __future__ import annotations

import pytest
import torch

from specserve.engine.llm import LLM, SamplingParams

from serving import NAME, PROMPTS, Live, serve_kwargs

TOL = 1e-4


@pytest.fixture(scope="module")
def kw(pair) -> dict:
    return serve_kwargs(pair, "--max-num-seqs", "4", "--no-adaptive")  # speculating, K = 3


@pytest.fixture(scope="module")
def live(http, kw):
    srv = Live(lambda: LLM(**kw), max_num_seqs=4, max_queue=16)
    srv.wait_ready(300)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def offline(kw) -> LLM:
    return LLM(**kw)


@pytest.fixture(scope="module")
def hf_model(pair):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(pair[0], torch_dtype=torch.float32).eval()


def _reference(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], -1)


def _greedy_ids(offline: LLM, prompt, max_tokens: int, chat: bool = False) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of greedy decoding, as the server runs it."""
    tok = offline.tokenizer
    if chat:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        stops = [tok.end_of_turn_id]  # where the server's chat replies stop
    else:
        ids, stops = tok.encode(prompt), []
    out = offline.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=stops))[0]
    return ids, out.token_ids


def _check_top(entries: list[tuple[str, float]], token: str, logprob: float, k: int) -> None:
    vals = [lp for _, lp in entries]
    assert len(vals) == k and vals == sorted(vals, reverse=True)
    for t, lp in entries:
        if t == token:
            assert lp == logprob


@pytest.mark.parametrize("batch", [1, 3])
def test_completions_logprobs_match_transformers(live, offline, hf_model, batch):
    client = live.client()
    prompts = PROMPTS[:batch]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0, logprobs=3)
    assert live.info()["speculation"]["since_start"]["accepted"] > 0
    for choice in r.choices:
        ids, out = _greedy_ids(offline, prompts[choice.index], 12)
        ref = _reference(hf_model, ids, out)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(out)
        assert "".join(lp.tokens) == choice.text == offline.tokenizer.decode(out)
        assert lp.text_offset == [len(offline.tokenizer.decode(out[:i])) for i in range(len(out))]
        for i, (tok_id, tok, value, top) in enumerate(zip(out, lp.tokens, lp.token_logprobs, lp.top_logprobs)):
            assert abs(value - ref[i, tok_id].item()) < TOL, i
            assert set(top) >= {tok} and len(top) <= 4  # the top 3, and the sampled token always
            assert abs(top[tok] - value) < 1e-9
            best = sorted(top.values(), reverse=True)[:3]
            assert torch.allclose(torch.tensor(best), ref[i].topk(3).values, atol=TOL)


def test_chat_logprobs_streaming_equals_non_streaming(live, offline, hf_model):
    client = live.client()
    messages = [{"role": "user", "content": PROMPTS[1]}]
    args = dict(model=NAME, messages=messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=4)
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    ids, out = _greedy_ids(offline, PROMPTS[1], 16, chat=True)
    ref = _reference(hf_model, ids, out)
    assert len(content) == len(out)
    for i, (tok_id, e) in enumerate(zip(out, content)):
        assert abs(e.logprob - ref[i, tok_id].item()) < TOL, i
        assert bytes(e.bytes) == offline.tokenizer.token_bytes(tok_id)
        _check_top([(t.token, t.logprob) for t in e.top_logprobs], e.token, e.logprob, 4)
        assert e.top_logprobs[0].token == e.token  # greedy emits the most likely token
    text = b"".join(bytes(e.bytes) for e in content).decode()
    assert text.startswith(whole.message.content)

    streamed, pieces = "", []
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed += c.delta.content or ""
            if c.logprobs is not None:
                pieces.extend(c.logprobs.content)
    assert streamed == whole.message.content
    # The two requests may run different K (the adaptive policy follows timings), so a token's logits may
    # come from a one-row decode in one and a verify row in the other: the same tokens, values equal to
    # float32 rounding.
    assert [(p.token, p.bytes) for p in pieces] == [(e.token, e.bytes) for e in content]
    assert [p.logprob for p in pieces] == pytest.approx([e.logprob for e in content], abs=TOL)
    assert [[t.token for t in p.top_logprobs] for p in pieces] == [[t.token for t in e.top_logprobs] for e in content]
    assert [[t.logprob for t in p.top_logprobs] for p in pieces] == [
        pytest.approx([t.logprob for t in e.top_logprobs], abs=TOL) for e in content
    ]


def test_completions_stream_carries_each_chunks_logprobs(live):
    client = live.client()
    args = dict(model=NAME, prompt=PROMPTS[2], max_tokens=20, temperature=0, logprobs=2)
    whole = client.completions.create(**args).choices[0]
    text, tokens, values, offsets = "", [], [], []
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == whole.text
    assert (tokens, offsets) == (whole.logprobs.tokens, whole.logprobs.text_offset)
    assert values == pytest.approx(whole.logprobs.token_logprobs, abs=TOL)  # (see the chat test above)


def test_without_logprobs_the_field_stays_null(live):
    r = live.post("/v1/completions", json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None
    r = live.post(
        "/v1/chat/completions",
        json={"model": NAME, "max_tokens": 4, "logprobs": False, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"logprobs": 6}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 1, "echo": True}, "echo"),
        ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_logprobs_fields_are_400s_naming_the_field(live, path, extra, param):
    body = {"model": NAME, "max_tokens": 2, **extra}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]})
    r = live.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
