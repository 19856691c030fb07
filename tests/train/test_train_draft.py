"""`specserve train-draft`: data reading, the training-time-test forward against the
engine's cached drafting, the draft vocabulary, checkpoints/resume, and an end-to-end run
on a tiny target that must raise the acceptance length over an untrained drafter."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.config import ConfigError, DraftConfig, default_aux_layers, resolve_aux_layers
from specserve.model.layers import ForwardContext
from specserve.model.loader import load_drafter
from specserve.train import train_draft as td
from specserve.train.data import DataError, Record, chat_prompt, read_records, split_long, tokenize_records

from scripts import build_demo
from tiny import make_drafter, make_target

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny target with a real (byte-level BPE) tokenizer
# ---------------------------------------------------------------------------------------------


def _stdlib_texts(n: int) -> list[str]:
    return [d.text for d in build_demo.collect_stdlib(max_files=n)]


@pytest.fixture(scope="module")
def texts():
    return _stdlib_texts(30)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, texts):
    """A 2-layer, 32-wide target over a 300-token BPE vocabulary. Its attention output is
    scaled down and its head sharpened, so greedy text is mostly a (random) function of the
    last token with confident logits: learnable in seconds, which is what a CI run needs."""
    root = tmp_path_factory.mktemp("tdpair")
    target = make_target(root / "target", vocab=300, hidden=32, layers=2, heads=4, kv_heads=2)
    w = load_file(str(target / "model.safetensors"))
    for k in w:
        if "o_proj" in k:
            w[k] = w[k] * 0.1
        if k == "lm_head.weight":
            w[k] = w[k] * 8
    save_file(w, str(target / "model.safetensors"), metadata={"format": "pt"})
    tok = build_demo.train_tokenizer(texts[:20], vocab_size=300)
    build_demo.write_tokenizer(tok, target)
    (root / "data.txt").write_text("".join(texts[:10])[:30000])
    prompts = [t[:100] for t in texts[22:28]]  # not in the training text
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return root, target


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------


def test_read_records_formats_and_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "def f(): pass"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    (tmp_path / "b.txt").write_text("x = 1\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.py").write_text("y = 2\n")
    (sub / "skip.bin").write_bytes(b"\x00\x01")
    (sub / "latin1.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: skipped inside a folder
    np.save(sub / "d.npy", np.array([5, 6, 0, 7, 8, 9, 0], dtype=np.uint16))
    recs = read_records(tmp_path, eos_id=0)
    assert [r.text for r in recs if r.text] == ["def f(): pass", "x = 1\n", "y = 2\n"]
    assert [r.messages[1]["content"] for r in recs if r.messages] == ["yo"]
    assert [r.ids for r in recs if r.ids] == [[5, 6, 0], [7, 8, 9, 0]]  # split at EOS, EOS kept

    import gzip

    zipped = tmp_path / "z"
    zipped.mkdir()
    with gzip.open(zipped / "turns.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "zipped"}]}) + "\n")
    for where in (zipped, zipped / "turns.jsonl.gz"):  # a folder holding it, and the file itself
        assert [r.messages[0]["content"] for r in read_records(where)] == ["zipped"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        read_records(bad)
    bad.write_text(json.dumps({"prompt": "no text key"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: record has neither \"text\" nor \"messages\""):
        read_records(bad)
    bad.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"messages\[0\] must be an object"):
        read_records(bad)
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .jsonl, .jsonl.gz, .npy or text files"):
        read_records(tmp_path / "empty")
    np.save(tmp_path / "f.npy", np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(DataError, match="1-D integer"):
        read_records(tmp_path / "f.npy")


def test_tokenize_chat_prompt_and_split(tiny_pair):
    from specserve.engine.tokenizer import Tokenizer

    _, target = tiny_pair
    tok = Tokenizer(target)
    msgs = [{"role": "user", "content": "add"}, {"role": "assistant", "content": "def add(a, b): return a+b"}]
    [ids] = tokenize_records([Record(messages=msgs)], tok, 0)
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nadd<|im_end|>")
    prompt = chat_prompt(Record(messages=msgs), tok)
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert chat_prompt(Record(messages=msgs[1:]), tok) is None  # nothing to answer
    [plain] = tokenize_records([Record(text="x = 1")], tok, 0)
    assert plain[-1] == 0  # documents end with EOS, like the pre-training stream
    assert split_long([list(range(20))], 8, min_len=4) == (
        [list(range(8)), list(range(8, 16)), list(range(16, 20))],
        [0, 0, 0],
    )
    # a sample's scored start follows it into its pieces; a piece of prompt alone is dropped
    assert split_long([list(range(20))], 8, [10], min_len=4) == ([list(range(8, 16)), list(range(16, 20))], [2, 0])


# ---------------------------------------------------------------------------------------------
# the training forward matches the engine's drafting
# ---------------------------------------------------------------------------------------------


def test_ttt_forward_matches_cached_drafting(tmp_path):
    """Step k at position b+k of the unrolled training forward must equal the engine's k-th
    draft step of a chain based at b: extend over feature entries 0..b, then feed back."""
    target_dir = make_target(tmp_path / "t", vocab=96, hidden=64, layers=4)
    draft_dir = make_drafter(tmp_path / "d", target_dir, layout="sglang", draft_vocab=64)
    dcfg = DraftConfig.from_dir(draft_dir)
    tgt = td.FrozenTarget(str(target_dir), CPU, torch.float32, 64, resolve_aux_layers(dcfg, 4))
    dr = load_drafter(draft_dir, tgt.model, CPU, torch.float32, 64)
    torch.manual_seed(0)
    T, steps = 18, 4
    ids = torch.randint(0, 96, (2, T + 1))
    feats, _ = tgt(ids)
    feats = feats[:, :T]
    with torch.no_grad():
        outs = td.ttt_forward(dr, feats, ids[:, 1:], steps)
    attn = dr.midlayer.self_attn.attn
    attn.k_cache = torch.zeros(2, attn.num_kv_heads, 64, attn.head_dim)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    with torch.inference_mode():
        for b in range(T - steps + 1):
            pos = torch.arange(b + 1).expand(2, b + 1)
            g = dr(ids[:, 1 : b + 2], feats[:, : b + 1], ForwardContext(0, pos, pos, b + 1))[:, -1:]
            torch.testing.assert_close(outs[0][:, b], g[:, 0], rtol=1e-4, atol=1e-4)
            for k in range(1, steps):
                p = torch.full((2, 1), b + k)
                g = dr(ids[:, b + k + 1 : b + k + 2], g, ForwardContext(0, p, p, b + k + 1))
                torch.testing.assert_close(outs[k][:, b + k], g[:, 0], rtol=1e-4, atol=1e-4)


def test_engine_drafts_what_the_trainer_predicts(tmp_path, monkeypatch):
    """On the engine's own greedy sequence, the first draft of every cycle (prefill, pending
    entries, draft graph, draft id -> target id) is the token the trainer's step-0 forward
    predicts at that entry: a target with tied embeddings (the drafter reads them) and a draft
    vocabulary that is not the first ids, as a GGUF SmolLM2 pair has."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine
    from specserve.engine.sampling import SamplingParams
    from specserve.spec.proposer import Proposer

    target_dir = make_target(tmp_path / "t", vocab=96, hidden=64, layers=4, tie_word_embeddings=True)
    draft_dir = make_drafter(tmp_path / "d", target_dir, draft_vocab=64)
    drafted: dict[int, int] = {}  # drafter entry (sequence position) -> first drafted token
    draft_batch = Proposer.draft_batch

    def record(self, seqs, K, spec_ok, sampling):
        res = draft_batch(self, seqs, K, spec_ok, sampling)
        drafted.update((s.num_cached - 1, t) for s, t in zip(seqs, res.tokens[:, 0].tolist()))
        return res

    monkeypatch.setattr(Proposer, "draft_batch", record)
    engine = Engine(EngineConfig(model=str(target_dir), draft=str(draft_dir), spec_steps=1, device="cpu"))
    prompt = list(range(3, 60, 4))
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_work():
        engine.step()
    seq = torch.tensor([prompt + req.output_ids])
    dcfg = DraftConfig.from_dir(draft_dir)
    tgt = td.FrozenTarget(str(target_dir), CPU, torch.float32, 64, resolve_aux_layers(dcfg, 4))
    assert tgt.model.lm_head is None  # tied
    dr = load_drafter(draft_dir, tgt.model, CPU, torch.float32, 64)
    with torch.no_grad():
        feats, _ = tgt(seq)
        step0 = td.ttt_forward(dr, feats[:, :-1], seq[:, 1:], 1)[0]
        predicted = td.draft_vocab_ids(dr)[dr.logits(step0).argmax(-1)][0]
    assert len(drafted) >= 8
    assert {t: int(predicted[t]) for t in drafted} == drafted
    assert any(t >= 64 for t in drafted.values())  # ids only the d2t offsets reach


def test_chain_acceptance_is_what_greedy_verification_accepts(tmp_path):
    """The acceptance the trainer reports must be what the engine accepts: at every base b of a
    target-greedy sequence, draft K tokens feeding back the drafter's own tokens and outputs
    (as a draft cycle does) and count the leading drafts equal to the target's next tokens.
    Teacher-forced per-step accuracy overstates it: a later step can hit after a miss. The
    target has rope theta 1e5 (as SmolLM2), which the drafter's config must carry."""
    target_dir = make_target(tmp_path / "t", vocab=96, hidden=64, layers=4, rope_theta=100000.0)
    draft_dir = make_drafter(tmp_path / "d", target_dir, layout="sglang", draft_vocab=64)
    dcfg = DraftConfig.from_dir(draft_dir)
    assert dcfg.rope_theta == 100000.0
    tgt = td.FrozenTarget(str(target_dir), CPU, torch.float32, 64, resolve_aux_layers(dcfg, 4))
    dr = load_drafter(draft_dir, tgt.model, CPU, torch.float32, 64)
    # Two-way heads: target and drafter each pick token 2 or 4 (draft ids 2 and 4) by the sign of
    # one projection (rows picked so that greedy text mixes both and the two agree about half
    # the time), so chains of every length occur.
    with torch.no_grad():
        for head, r in ((tgt.model.lm_head.weight, 6), (dr.lm_head.weight, 0)):
            row = head[r].clone()
            head.zero_()
            head[2], head[4] = row, -row
    L, K = 48, 3
    ids = torch.tensor([[7]])
    with torch.no_grad():
        while ids.shape[1] < L:
            _, hidden = tgt(ids)
            ids = torch.cat([ids, tgt.logits(hidden[:, -1]).argmax(-1, keepdim=True)], 1)
        feats, hidden = tgt(ids)
        greedy = tgt.logits(hidden[0]).argmax(-1)  # greedy[p]: the target's token after position p
        _, accs, _, (accepted, bases), walked = td.ttt_loss(
            dr, tgt, ids, torch.tensor([L]), torch.tensor([0]), feats, hidden, K, td.draft_vocab_ids(dr)
        )
    attn = dr.midlayer.self_attn.attn
    attn.k_cache = torch.zeros(1, attn.num_kv_heads, 64, attn.head_dim)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    want, n = [0] * K, 0
    run = []  # drafts accepted by the cycle based at each entry
    with torch.inference_mode():
        for b in range(L - K):  # entries 0..L-2; a base counts when its K steps are entries too
            pos = torch.arange(b + 1).view(1, -1)
            g = dr(ids[:, 1 : b + 2], feats[:, : b + 1], ForwardContext(0, pos, pos, b + 1))[:, -1:]
            n += 1
            run.append(0)
            for k in range(K):
                tok = dr.to_target_ids(dr.logits(g[:, 0]).argmax(-1))
                if int(tok) != int(greedy[b + k + 1]):
                    break
                want[k] += 1
                run[-1] += 1
                p = torch.tensor([[b + k + 1]])
                g = dr(tok.view(1, 1), g, ForwardContext(0, p, p, b + k + 2))
    assert (accepted, bases) == (want, n)
    assert 0 < want[K - 1] < want[0] < n, want
    assert accs[1] > want[1] / n and accs[2] > want[2] / n, (accs, want, n)
    assert td.accept_length(want, n) == round(1 + sum(want) / n, 4)
    # The engine's cycles: the first based at entry 0, each next one past the drafts it accepted.
    cycle_want, cycles, b = [0] * K, 0, 0
    while b < len(run):
        for k in range(run[b]):
            cycle_want[k] += 1
        cycles += 1
        b += run[b] + 1
    assert walked == (cycle_want, cycles)
    assert cycles < n and td.accept_length(*walked) != td.accept_length(want, n)


def test_ttt_loss_scores_only_the_response(tmp_path):
    """With a sample's response starting at token s, the loss and the acceptance figures read
    only chains based at entries >= s - 1: what the target predicts at the prompt's earlier
    positions changes nothing, what it predicts at the first drafted response token does."""
    target_dir = make_target(tmp_path / "t", vocab=96, hidden=64, layers=4)
    draft_dir = make_drafter(tmp_path / "d", target_dir, layout="sglang", draft_vocab=64)
    tgt = td.FrozenTarget(
        str(target_dir), CPU, torch.float32, 64, resolve_aux_layers(DraftConfig.from_dir(draft_dir), 4)
    )
    dr = load_drafter(draft_dir, tgt.model, CPU, torch.float32, 64)
    torch.manual_seed(0)
    L, s, K = 24, 10, 3
    ids = torch.randint(0, 96, (1, L))
    feats, hidden = tgt(ids)
    args = (torch.tensor([L]), torch.tensor([s]))

    def loss(h):
        with torch.no_grad():
            out, _, counts, (_, bases), _ = td.ttt_loss(dr, tgt, ids, *args, feats, h, K, td.draft_vocab_ids(dr))
        return float(out), counts, bases

    base, counts, bases = loss(hidden)
    assert counts == [L - s - k for k in range(K)] and bases == L - s - K + 1
    prompt_changed = hidden.clone()
    prompt_changed[:, 1:s] = torch.randn_like(prompt_changed[:, 1:s]) * 5  # entries 0..s-2
    assert loss(prompt_changed)[0] == pytest.approx(base, abs=1e-6)
    reply_changed = hidden.clone()
    reply_changed[:, s] = torch.randn_like(reply_changed[:, s]) * 5  # entry s-1: the first chain
    assert abs(loss(reply_changed)[0] - base) > 1e-4


def test_chat_template_compiled_once(tiny_pair, monkeypatch):
    """Regeneration renders every conversation of the data: the template is compiled once per
    tokenizer, not once per render (which cost ~6 ms a conversation, minutes over ShareGPT)."""
    import jinja2

    from specserve.engine.tokenizer import Tokenizer

    _, target = tiny_pair
    tok = Tokenizer(target)
    compiled = []
    real = jinja2.Environment.from_string
    monkeypatch.setattr(jinja2.Environment, "from_string", lambda env, src: compiled.append(src) or real(env, src))
    texts = [tok.apply_chat_template([{"role": "user", "content": f"q{i}"}]) for i in range(3)]
    assert len(compiled) == 1 and [t.count("q") for t in texts] == [1, 1, 1] and "q2" in texts[2]


def test_eval_prompts_chat_records(tiny_pair, tmp_path):
    """--eval-prompts: a "messages" line is a chat turn, answered through the target's chat
    template and stopped at its end of turn; a "prompt" line is continued as it is."""
    from specserve.engine.tokenizer import Tokenizer

    root, target = tiny_pair
    f = tmp_path / "p.jsonl"
    msgs = [{"role": "user", "content": "def f(x):"}]
    f.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"prompt": "import os"}) + "\n")
    assert td.read_prompts(f) == [msgs, "import os"]
    f.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: messages\[0\] must be an object with string"):
        td.read_prompts(f)
    d = root / "d-eval"
    td.train_draft(
        td.TrainConfig(
            str(target), str(d), str(root / "data.txt"), max_steps=0, draft_vocab=200, device="cpu", progress=False
        )
    )
    tok = Tokenizer(target)
    r = td.measure_acceptance(str(target), str(d), [msgs, "def f(x):"], 3, 16, "cpu")
    assert r["prompt_tokens"] == len(tok.encode(tok.apply_chat_template(msgs))) + len(tok.encode("def f(x):"))


def test_thread_tuner_keeps_the_faster_thread_count():
    """ThreadTuner tries the other thread count after `trial` steps and keeps it when its median step
    is clearly faster; a slower trial sends it back."""
    from specserve.train.thread_tuner import ThreadTuner

    before = torch.get_num_threads()
    try:
        tuner = ThreadTuner([1, 2], every_s=0.0, trial=2)
        assert tuner.active == 2
        assert tuner.record(1.0) is None and tuner.record(1.0) is None  # the trial of 1 thread starts
        assert tuner.active == 1 and torch.get_num_threads() == 1
        assert tuner.record(0.5) is None and tuner.record(0.5) is None  # (the first step after a switch: discarded)
        assert tuner.record(0.5) == "threads 2 -> 1 (median step 1.00s -> 0.50s)"
        assert tuner.current == 1 and torch.get_num_threads() == 1
        tuner.record(0.5)  # the trial of 2 threads starts, and its second step is clearly slower: it ends
        assert tuner.active == 2
        assert tuner.record(2.0) is None and tuner.record(2.0) is None
        assert tuner.current == 1 and tuner.trying is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_draft_vocab_selection():
    docs = [[5, 5, 5, 9, 9, 2], [7, 5, 9]]
    ids = td.select_draft_vocab(docs, vocab_size=12, n=3, always={0})
    assert ids.tolist() == [0, 5, 9]  # EOS forced in, then the two most frequent; sorted
    assert td.select_draft_vocab(docs, 12, 50, set()).numel() == 12  # capped at the vocabulary


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_draft_raises_acceptance(tiny_pair):
    """The CI run: regenerate, pick the vocabulary, train with TTT, save, load in the
    engine. Greedy acceptance at K=3 on unseen prompts must clearly beat the untrained
    (warm-started) drafter of the same pipeline."""
    root, target = tiny_pair
    prompts = td.read_prompts(root / "prompts.jsonl")
    t0 = time.time()
    td.train_draft(
        td.TrainConfig(
            str(target),
            str(root / "d0"),
            str(root / "data.txt"),
            max_steps=0,
            draft_vocab=200,
            device="cpu",
            progress=False,
        )
    )
    res = td.train_draft(
        td.TrainConfig(
            str(target),
            str(root / "d1"),
            str(root / "data.txt"),
            regenerate=True,
            regen_prompts=48,
            regen_max_tokens=48,
            regen_prompt_len=(8, 32),
            draft_vocab=200,
            ttt_steps=3,
            lr=2e-2,
            warmup=3,
            max_steps=32,
            batch_tokens=1536,
            max_len=128,
            device="cpu",
            progress=False,
        )
    )
    train_s = time.time() - t0
    assert res.regenerated == 48 and res.steps == 32 and res.draft_vocab == 200
    before = td.measure_acceptance(str(target), str(root / "d0"), prompts, 3, 32, "cpu")["accept_length_mean"]
    after = td.measure_acceptance(str(target), str(root / "d1"), prompts, 3, 32, "cpu")["accept_length_mean"]
    print(f"acceptance length K=3: untrained {before:.3f} -> trained {after:.3f}; training {train_s:.1f}s")
    assert before < 1.1 and after > before + 0.5, (before, after)

    # The output is a SpecForge/SGLang-layout drafter that specserve reads with the same taps.
    cfg = json.loads((root / "d1" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 200
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in default_aux_layers(2)]
    assert resolve_aux_layers(DraftConfig.from_dir(root / "d1"), 2) == default_aux_layers(2)
    w = load_file(str(root / "d1" / "model.safetensors"))
    assert "embed_tokens.weight" not in w and w["lm_head.weight"].dtype == torch.bfloat16
    assert w["lm_head.weight"].shape == (200, 32) and w["fc.weight"].shape == (32, 96)
    vocab = torch.arange(200) + w["d2t"]
    assert w["d2t"].dtype == torch.int64 and bool((vocab[1:] > vocab[:-1]).all())
    assert w["t2d"].dtype == torch.bool and w["t2d"].sum() == 200 and bool(w["t2d"][vocab].all())
    assert bool(w["t2d"][0])  # EOS is always in the draft vocabulary
    assert not (root / "d1" / "checkpoint").exists()  # removed after a finished run
    summary = json.loads((root / "d1" / "training_summary.json").read_text())
    assert summary["steps"] == 32 and len(summary["final_acc"]) == 3


def test_resume_reproduces_an_uninterrupted_run(tiny_pair):
    """Stopping after a checkpoint and resuming gives the same weights as one run, with the
    run's own target taps even when --aux-layer-ids is not repeated (a different list is refused)."""
    root, target = tiny_pair
    kw = {
        "draft_vocab": 100,
        "ttt_steps": 2,
        "lr": 3e-3,
        "warmup": 2,
        "max_steps": 4,
        "batch_tokens": 512,
        "max_len": 64,
        "device": "cpu",
        "progress": False,
        "checkpoint_every": 2,
        "keep_checkpoint": True,
    }
    data = str(root / "data.txt")
    td.train_draft(td.TrainConfig(str(target), str(root / "full"), data, aux_layer_ids=(0, 1, 0), **kw))
    # An interrupted run: the same job killed right after its step-2 checkpoint.
    state = torch.load(root / "full" / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 2 and state["aux_layers"] == [1, 2, 1]
    shutil.copytree(root / "full" / "checkpoint", root / "part" / "checkpoint")
    with pytest.raises(ConfigError, match="differ from the checkpoint's"):
        td.train_draft(
            td.TrainConfig(str(target), str(root / "part"), None, resume=True, aux_layer_ids=(1, 1, 1), **kw)
        )
    td.train_draft(td.TrainConfig(str(target), str(root / "part"), None, resume=True, **kw))
    cfg = json.loads((root / "part" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 0]
    a = load_file(str(root / "full" / "model.safetensors"))
    b = load_file(str(root / "part" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_resume_of_a_fine_tune_rebuilds_its_drafter(tiny_pair, tmp_path):
    """A fine-tune (--from, here a drafter that ships its own embedding) stopped after a checkpoint
    resumes to the weights of one uninterrupted run, from the checkpoint alone (without --from) and
    with --from repeated; its default fine-tune lr goes on. A different --from or shape is refused."""
    root, target = tiny_pair
    src = make_drafter(
        tmp_path / "src", target, layout="sglang", draft_vocab=150, aux_ids=[0, 1, 0], with_embedding=True
    )
    kw = {
        "ttt_steps": 2,
        "warmup": 1,
        "max_steps": 4,
        "batch_tokens": 512,
        "max_len": 64,
        "device": "cpu",
        "progress": False,
        "checkpoint_every": 2,
        "keep_checkpoint": True,
    }
    data = str(root / "data.txt")
    td.train_draft(td.TrainConfig(str(target), str(tmp_path / "full"), data, from_dir=str(src), **kw))
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    shipped = load_file(str(src / "model.safetensors"))["embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(full["embed_tokens.weight"], shipped)  # a shipped embedding is not trained
    for name, from_dir in (("bare", None), ("again", str(src))):
        shutil.copytree(tmp_path / "full" / "checkpoint", tmp_path / name / "checkpoint")
        res = td.train_draft(
            td.TrainConfig(str(target), str(tmp_path / name), None, resume=True, from_dir=from_dir, **kw)
        )
        assert res.steps == 4 and res.draft_vocab == 150
        assert json.loads((tmp_path / name / "config.json").read_text()) == json.loads(
            (tmp_path / "full" / "config.json").read_text()
        )
        b = load_file(str(tmp_path / name / "model.safetensors"))
        assert full.keys() == b.keys()
        for k in full:
            torch.testing.assert_close(full[k], b[k], rtol=0, atol=0, msg=f"{name}: {k}")
    part = str(tmp_path / "bare")
    other = make_drafter(tmp_path / "other", target, layout="sglang", draft_vocab=150, aux_ids=[0, 1, 0])
    with pytest.raises(ConfigError, match="--from .*other differs from the checkpoint's --from .*src"):
        td.train_draft(td.TrainConfig(str(target), part, None, resume=True, from_dir=str(other), **kw))
    with pytest.raises(ConfigError, match="--draft-intermediate 96 differs from the checkpoint's 64"):
        td.train_draft(td.TrainConfig(str(target), part, None, resume=True, draft_intermediate=96, **kw))
    with pytest.raises(ConfigError, match="--draft-vocab 99 differs from the checkpoint's 150"):
        td.train_draft(td.TrainConfig(str(target), part, None, resume=True, draft_vocab=99, **kw))
    with pytest.raises(ConfigError, match="--lr 0.01 differs from the checkpoint's 5e-05"):
        td.train_draft(td.TrainConfig(str(target), part, None, resume=True, lr=1e-2, **kw))
    # a fresh run's checkpoint is not turned into a fine-tune
    td.train_draft(td.TrainConfig(str(target), str(tmp_path / "fresh"), data, draft_vocab=100, **kw))
    with pytest.raises(ConfigError, match="the checkpoint's run trains a fresh drafter"):
        td.train_draft(td.TrainConfig(str(target), str(tmp_path / "fresh"), None, resume=True, from_dir=str(src), **kw))


@pytest.mark.parametrize("fine_tune", [False, True])
def test_a_run_cut_by_its_budget_resumes_on_one_lr_schedule(tiny_pair, tmp_path, monkeypatch, fine_tune):
    """Calls of a run too long for one (each with its own --max-minutes): the time budget ends the
    first at some step, which its kept checkpoint holds; --resume goes on from there, and with
    --lr-minutes the learning rate follows one cosine over both calls' training time. A fine-tune's
    (--from, its default lr) goes on from the checkpoint alone."""
    root, target = tiny_pair
    src = make_drafter(tmp_path / "src", target, layout="sglang", draft_vocab=100, aux_ids=[0, 1, 0])
    peak = 5e-5 if fine_tune else 1e-2
    now = [1e9]

    class Clock:  # every reading advances 0.5 s: a budget ends after a fixed number of readings
        perf_counter, strftime = staticmethod(time.perf_counter), staticmethod(time.strftime)

        @staticmethod
        def time():
            now[0] += 0.5
            return now[0]

    monkeypatch.setattr(td, "time", Clock)
    lrs: list[list[float]] = []
    step = torch.optim.AdamW.step

    def record(self, *a, **k):
        lrs[-1].append(self.param_groups[0]["lr"])
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", record)
    kw = {
        "draft_vocab": 100,
        "ttt_steps": 2,
        "lr": None if fine_tune else peak,
        "warmup": 1,
        "epochs": 1000.0,
        "batch_tokens": 512,
        "max_len": 64,
        "device": "cpu",
        "threads": 1,
        "progress": False,
        "keep_checkpoint": True,
        "minutes": 1.0,
        "lr_minutes": 2.0,
    }
    out = str(tmp_path / "d")
    lrs.append([])
    first = td.train_draft(
        td.TrainConfig(str(target), out, str(root / "data.txt"), from_dir=str(src) if fine_tune else None, **kw)
    )
    state = torch.load(tmp_path / "d" / "checkpoint" / "state.pt", weights_only=True)
    assert 5 < first.steps == state["step"] == len(lrs[0])
    lrs.append([])
    second = td.train_draft(td.TrainConfig(str(target), out, None, resume=True, **kw))
    assert second.steps == first.steps + len(lrs[1]) and len(lrs[1]) > 5
    lr = lrs[0][1:] + lrs[1]  # after the one warm-up step
    assert all(b < a for a, b in zip(lr, lr[1:])), lr  # one decreasing cosine across the two calls
    assert lr[0] < peak and lr[-1] > 0.1 * peak  # 2 schedule minutes are more than both calls trained
    with pytest.raises(ConfigError, match="--val-samples 2 differs from the checkpoint's 0"):
        td.train_draft(td.TrainConfig(str(target), out, None, resume=True, **{**kw, "val_samples": 2}))
    with pytest.raises(ConfigError, match="--lr-minutes must be positive"):
        td.train_draft(td.TrainConfig(str(target), out, None, resume=True, **{**kw, "lr_minutes": 0.0}))


def test_val_samples_are_held_out_and_scored(tiny_pair, tmp_path):
    """--val-samples N: the run trains on all but the last N samples and reports agreement and
    acceptance length on those N (as --val-data does on a file of its own)."""
    root, target = tiny_pair
    kw = {
        "draft_vocab": 100,
        "ttt_steps": 2,
        "max_steps": 2,
        "batch_tokens": 512,
        "max_len": 64,
        "device": "cpu",
        "progress": False,
    }
    data = str(root / "data.txt")
    every = td.train_draft(td.TrainConfig(str(target), str(tmp_path / "a"), data, **kw))
    held = td.train_draft(td.TrainConfig(str(target), str(tmp_path / "b"), data, val_samples=3, **kw))
    assert held.samples == every.samples - 3 and every.val_acc is None
    assert len(held.val_acc) == 2 and 0 <= held.val_acc[0] <= 1 and held.val_accept_length >= 1
    other = td.train_draft(td.TrainConfig(str(target), str(tmp_path / "v"), data, val_data=data, **kw))  # --val-data
    assert other.samples == every.samples and len(other.val_acc) == 2 and other.val_accept_length >= 1
    with pytest.raises(ConfigError, match="--val-samples 9999 leaves nothing to train on"):
        td.train_draft(td.TrainConfig(str(target), str(tmp_path / "c"), data, val_samples=9999, **kw))
    with pytest.raises(ConfigError, match="one of --val-data and --val-samples"):
        td.train_draft(td.TrainConfig(str(target), str(tmp_path / "c"), data, val_samples=3, val_data=data, **kw))


def test_fine_tune_from_existing_drafter(tiny_pair, tmp_path):
    root, target = tiny_pair
    src = make_drafter(tmp_path / "src", target, layout="sglang", draft_vocab=150, aux_ids=[0, 0, 0])
    res = td.train_draft(
        td.TrainConfig(
            str(target),
            str(tmp_path / "ft"),
            str(root / "data.txt"),
            from_dir=str(src),
            max_steps=2,
            lr=1e-3,
            batch_tokens=512,
            max_len=64,
            device="cpu",
            progress=False,
            checkpoint_every=1,
            keep_checkpoint=True,
        )
    )
    assert res.draft_vocab == 150
    # the drafter reads the target's embedding and trains only its own weights (the checkpoint holds those)
    state = torch.load(tmp_path / "ft" / "checkpoint" / "state.pt", weights_only=True)
    assert state["trainable"] == [n for n in state["drafter"] if n not in ("d2t", "t2d")]
    assert "fc.weight" in state["trainable"] and not any(n.startswith("target_embed") for n in state["drafter"])
    cfg = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 0, 0]  # taps kept
    before, after = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "ft" / "model.safetensors"))
    assert torch.equal(before["d2t"], after["d2t"])
    assert not torch.equal(before["fc.weight"].to(torch.bfloat16), after["fc.weight"])
    with pytest.raises(ConfigError, match="--draft-vocab 99 differs"):
        td.train_draft(
            td.TrainConfig(
                str(target),
                str(tmp_path / "ft2"),
                str(root / "data.txt"),
                from_dir=str(src),
                draft_vocab=99,
                max_steps=1,
                device="cpu",
                progress=False,
            )
        )
    with pytest.raises(ConfigError, match="--draft-intermediate 65 differs"):
        td.train_draft(
            td.TrainConfig(
                str(target),
                str(tmp_path / "ft2"),
                str(root / "data.txt"),
                from_dir=str(src),
                draft_intermediate=65,
                max_steps=1,
                device="cpu",
                progress=False,
            )
        )


def test_wider_drafter_mlp(tiny_pair, tmp_path):
    """--draft-intermediate and --aux-layer-ids: a fresh drafter with its own MLP width and taps;
    it loads and drafts in the engine."""
    from specserve.engine.llm import LLM, SamplingParams

    root, target = tiny_pair
    td.train_draft(
        td.TrainConfig(
            str(target),
            str(tmp_path / "w"),
            str(root / "data.txt"),
            draft_intermediate=96,
            draft_vocab=200,
            aux_layer_ids=(1, 0, 1),
            max_steps=2,
            batch_tokens=512,
            max_len=64,
            device="cpu",
            progress=False,
        )
    )
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    assert cfg["intermediate_size"] == 96 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 0, 1]
    assert load_file(str(tmp_path / "w" / "model.safetensors"))["midlayer.mlp.down_proj.weight"].shape[1] == 96
    llm = LLM(model=str(target), draft=str(tmp_path / "w"), spec_steps=2, device="cpu")
    plain = LLM(model=str(target), device="cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.generate(["def f("], params)[0].token_ids == plain.generate(["def f("], params)[0].token_ids
    with pytest.raises(ConfigError, match="--draft-intermediate must be positive"):
        td.train_draft(
            td.TrainConfig(
                str(target),
                str(tmp_path / "w0"),
                str(root / "data.txt"),
                draft_intermediate=0,
                max_steps=1,
                device="cpu",
                progress=False,
            )
        )
    with pytest.raises(ConfigError, match=r"--aux-layer-ids needs 3 layer ids in 0\.\.1"):
        td.train_draft(
            td.TrainConfig(
                str(target),
                str(tmp_path / "w0"),
                str(root / "data.txt"),
                aux_layer_ids=(0, 2, 1),
                max_steps=1,
                device="cpu",
                progress=False,
            )
        )


def test_a_parameter_without_gradient_stops_training(tiny_pair, tmp_path, monkeypatch):
    """A forward-only op inside training (as the CUDA kernels once were) cuts the gradient of what
    lies before it; the first step says so instead of training only the layers after it."""
    import specserve.model.layers as layers

    root, target = tiny_pair
    real = layers.rms_norm
    monkeypatch.setattr(
        layers,
        "rms_norm",
        lambda x, w, eps, residual=None: real(
            x.detach(), w.detach(), eps, None if residual is None else residual.detach()
        ),
    )
    with pytest.raises(RuntimeError, match="no gradient reached .* drafter parameter"):
        td.train_draft(
            td.TrainConfig(
                str(target),
                str(tmp_path / "d"),
                str(root / "data.txt"),
                max_steps=2,
                draft_vocab=200,
                batch_tokens=512,
                max_len=64,
                device="cpu",
                progress=False,
            )
        )


def test_regenerate_equals_engine_greedy(tiny_pair, texts, tmp_path, monkeypatch):
    """The lockstep regenerator (prompts of different lengths in one batch, a last batch that is
    not full, EOS ends a row, a batch's prefill split into row groups) writes exactly what the
    engine's greedy decoding writes; an interrupted run resumes from its file without redoing
    finished prompts."""
    from specserve.engine.llm import LLM, SamplingParams
    from specserve.engine.tokenizer import Tokenizer

    _, target = tiny_pair
    tok = Tokenizer(target)
    eos = set(tok.eos_token_ids)
    prompts = [tok.encode(t[: 20 + 37 * i]) for i, t in enumerate(texts[2:11])]
    assert len({len(p) for p in prompts}) > 5
    llm = LLM(model=str(target), device="cpu", max_num_seqs=4)
    ref = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))]
    save = tmp_path / "regen.jsonl"
    got, starts = td.regenerate_samples(str(target), prompts, 40, 0.0, 0, "cpu", 4, None, eos, save)
    assert got == [p + r for p, r in zip(prompts, ref)]
    assert starts == [len(p) for p in prompts]
    with monkeypatch.context() as m:  # about two rows per prefill call
        m.setattr(td, "REGEN_PREFILL_TOKENS", 2 * max(len(p) for p in prompts))
        assert td.regenerate_samples(str(target), prompts, 40, 0.0, 0, "cpu", 4, None, eos)[0] == got
    # resume: drop two finished records; only those two are generated again
    lines = save.read_text().splitlines()
    save.write_text("\n".join(lines[:-2]) + "\n")
    again = td.regenerate_samples(str(target), prompts, 40, 0.0, 0, "cpu", 4, None, eos, save)
    assert again == (got, starts) and len(save.read_text().splitlines()) == len(prompts)
    # EOS ends a row: with the most frequent first token declared EOS, rows stop right after it
    stop = max(set(x[0] for x in ref), key=[x[0] for x in ref].count)
    cut, _ = td.regenerate_samples(str(target), prompts, 40, 0.0, 0, "cpu", 4, None, {stop})
    assert cut == [p + (r[: r.index(stop) + 1] if stop in r else r) for p, r in zip(prompts, ref)]


def test_regeneration_cut_by_its_deadline_keeps_prompts_of_every_length(tiny_pair, texts, monkeypatch):
    """Batches run in a seeded random order, not shortest first: a run that its deadline stops
    after one batch keeps one batch of about equally long prompts, and over a few seeds not
    always the shortest (length order would train the drafter on the shortest prompts only)."""
    from types import SimpleNamespace

    from specserve.engine.runner import ModelRunner
    from specserve.engine.tokenizer import Tokenizer

    _, target = tiny_pair
    tok = Tokenizer(target)
    prompts = [tok.encode(t[: 12 + 9 * i]) for i, t in enumerate(texts[2:10])]
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups = [set(by_length[i : i + 2]) for i in range(0, len(prompts), 2)]
    now = [0.0]
    monkeypatch.setattr(td, "time", SimpleNamespace(time=lambda: now[0], perf_counter=time.perf_counter))
    prefill = ModelRunner.prefill

    def prefill_then_time_is_up(self, *args):
        now[0] = 100.0
        return prefill(self, *args)

    monkeypatch.setattr(ModelRunner, "prefill", prefill_then_time_is_up)
    kept = []
    for seed in range(4):
        now[0] = 0.0
        # 12 new tokens: the decode loop's own deadline check (every 16 steps) never runs
        got, starts = td.regenerate_samples(str(target), prompts, 12, 0.0, seed, "cpu", 2, 50.0, set())
        kept.append({prompts.index(s[:b]) for s, b in zip(got, starts)})
    assert all(k in groups for k in kept), (kept, groups)
    assert any(k != groups[0] for k in kept), "every cut run kept only the shortest prompts"


def test_regeneration_time_counts_from_when_it_starts(tiny_pair, tmp_path, monkeypatch):
    """--regen-share is the share of --max-minutes regeneration may answer for, counted from when it
    starts: reading and tokenizing the data before it (a minute for 30,000 chat records on a GPU
    machine's host) once took most of a small share, and the run answered 1,889 of 33,826 prompts."""
    from types import SimpleNamespace

    root, target = tiny_pair
    now = [1e9]
    monkeypatch.setattr(
        td, "time", SimpleNamespace(time=lambda: now[0], perf_counter=time.perf_counter, strftime=time.strftime)
    )
    read = td.read_records

    def slow_read(*args):
        now[0] += 30.0  # reading the data takes 30 s
        return read(*args)

    class Started(Exception):
        pass

    def regenerate(target_dir, prompts, max_new, temperature, seed, device, batch, deadline, *rest):
        raise Started(deadline)

    monkeypatch.setattr(td, "read_records", slow_read)
    monkeypatch.setattr(td, "regenerate_samples", regenerate)
    t_start = now[0]
    cfg = dict(regenerate=True, regen_prompts=8, regen_share=0.5, device="cpu", progress=False)
    with pytest.raises(Started) as got:
        td.train_draft(td.TrainConfig(str(target), str(tmp_path / "d"), str(root / "data.txt"), minutes=2.0, **cfg))
    assert got.value.args[0] - t_start == pytest.approx(30.0 + 60.0)  # 60 s from its start, not from the run's
    now[0] = t_start = 2e9
    with pytest.raises(Started) as got:  # never past the run's own deadline
        td.train_draft(
            td.TrainConfig(
                str(target), str(tmp_path / "e"), str(root / "data.txt"), minutes=0.6, **{**cfg, "regen_share": 0.9}
            )
        )
    assert got.value.args[0] - t_start == pytest.approx(36.0)


def test_regenerate_chat_records(tiny_pair, tmp_path):
    """Chat data: the target rewrites each last assistant turn; those samples are trained on."""
    from specserve.engine.tokenizer import Tokenizer

    _, target = tiny_pair
    convs = [
        [{"role": "user", "content": f"write function {i}"}, {"role": "assistant", "content": "pass"}] for i in range(5)
    ] + [[{"role": "assistant", "content": "no user turn"}]]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    res = td.train_draft(
        td.TrainConfig(
            str(target),
            str(tmp_path / "d"),
            str(data),
            regenerate=True,
            regen_max_tokens=12,
            max_steps=1,
            batch_tokens=512,
            max_len=64,
            device="cpu",
            progress=False,
            keep_checkpoint=True,
        )
    )
    assert res.regenerated == 5
    tok = Tokenizer(target)
    samples, starts = td._load_samples(tmp_path / "d" / "checkpoint" / "regenerated.jsonl")
    texts = [tok.decode(x, skip_special_tokens=False) for x in samples]
    assert all(t.startswith("<|im_start|>user\nwrite function") and "<|im_start|>assistant\n" in t for t in texts)
    assert all(len(x) > len(tok.encode(tok.apply_chat_template(c[:1]))) for x, c in zip(samples, convs))
    # the loss starts at each reply: the prompt's rendering ends right before it
    assert [
        tok.decode(x[:b], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        for x, b in zip(samples, starts)
    ] == [True] * 5


def test_cli_errors(tiny_pair, capsys):
    from specserve.cli import main

    root, target = tiny_pair
    rc = main(["train-draft", "--model", str(target), "--data", str(root / "nope.jsonl"), "--out", str(root / "x")])
    assert rc == 1 and "no such file" in capsys.readouterr().err
    rc = main(["train-draft", "--model", str(target), "--out", str(root / "x")])
    assert rc == 1 and "--data is required" in capsys.readouterr().err
    rc = main(
        [
            "train-draft",
            "--model",
            str(target),
            "--data",
            str(root / "data.txt"),
            "--out",
            str(root / "x"),
            "--ttt-steps",
            "0",
        ]
    )
    assert rc == 1 and "--ttt-steps must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train-draft", "--model", str(target), "--out", "x", "--regen-prompt-len", "9,3"])


@pytest.mark.gpu
def test_train_draft_on_gpu(tiny_pair):
    """A few steps on CUDA (bf16 target, autocast drafter); the result loads in the engine."""
    root, target = tiny_pair
    res = td.train_draft(
        td.TrainConfig(
            str(target),
            str(root / "gpu"),
            str(root / "data.txt"),
            regenerate=True,
            regen_prompts=32,
            regen_max_tokens=32,
            draft_vocab=200,
            ttt_steps=3,
            lr=1e-2,
            warmup=2,
            max_steps=20,
            batch_tokens=2048,
            max_len=128,
            device="cuda",
            progress=False,
        )
    )
    assert res.steps == 20 and res.final_acc[0] > 0
    r = td.measure_acceptance(str(target), str(root / "gpu"), td.read_prompts(root / "prompts.jsonl"), 3, 32, "cuda")
    assert r["accept_length_mean"] > 1.0


def test_cli_flags_map_onto_train_config():
    """`train-draft` flags and TrainConfig agree: the flags' defaults are the config's, and each
    flag reaches its field."""
    import argparse

    from specserve.train.train_draft_cmd import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert td.TrainConfig.from_args(p.parse_args(["--model", "T", "--out", "O"])) == td.TrainConfig("T", "O")
    got = td.TrainConfig.from_args(
        p.parse_args(
            [
                "--model",
                "T",
                "--out",
                "O",
                "--data",
                "D",
                "--max-minutes",
                "3",
                "--regen-prompt-len",
                "8,16",
                "--aux-layer-ids",
                "0,1,2",
                "--no-bf16",
                "--eval-spec-steps",
                "2,5",
                "--from",
                "F",
                "--lr-minutes",
                "12",
                "--val-samples",
                "5",
            ]
        )
    )
    assert (
        got.data,
        got.minutes,
        got.regen_prompt_len,
        got.aux_layer_ids,
        got.bf16,
        got.eval_spec_steps,
        got.from_dir,
        got.lr_minutes,
        got.val_samples,
    ) == ("D", 3.0, (8, 16), (0, 1, 2), False, (2, 5), "F", 12.0, 5)
