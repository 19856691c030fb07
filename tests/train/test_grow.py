"""`specserve grow`: the grown pair must compute what the small pair computes
(logits, greedy tokens, speculative acceptance), in specserve and in transformers."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.config import (
    ConfigError,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    default_aux_layers,
    resolve_aux_layers,
)
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams
from specserve.model.layers import ForwardContext
from specserve.model.loader import load_drafter, load_target
from specserve.train import grow as G
from specserve.train.shapes import PRESETS

from tiny import assert_decode_matches, make_drafter, make_moe_target, make_target

CPU = torch.device("cpu")
# The MoE grow: SHAPE's attention with 6 experts of 160 units (the MLP's 128 copied once or twice), top-2;
# the drafter's MLP keeps SHAPE's 300.
MOE_SHAPE = G.Shape(
    hidden=128,
    layers=12,
    heads=8,
    kv_heads=4,
    head_dim=64,
    intermediate=300,
    experts=6,
    top_k=2,
    expert_intermediate=160,
)
# hidden x3 (non-power-of-two split), heads x2, KV heads x2, head_dim x4 (16 -> 64), layers x2,
# MLP 128 -> 300 (units copied 2 or 3 times).
SHAPE = G.Shape(hidden=192, layers=12, heads=8, kv_heads=4, head_dim=64, intermediate=300)


def useful_drafter(draft_dir, target_dir) -> None:
    """Make a random drafter accept some drafts: read the high tap, predict with the target's
    (tied) head over the draft vocabulary, keep its attention and MLP as small random terms."""
    t = load_file(str(draft_dir / "model.safetensors"))
    emb = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    H = emb.shape[1]
    t["fc.weight"] = torch.cat([torch.zeros(H, 2 * H), torch.eye(H)], 1)
    t["lm_head.weight"] = emb[torch.arange(len(t["d2t"])) + t["d2t"]] * 8
    for k in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        t[k] = t[k] * 0.1
    save_file(t, str(draft_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def grown(make_pair, tmp_path_factory):
    # initializer_range 0.2: layers strong enough that greedy text does not just repeat the last token
    small, draft = make_pair(
        hidden=64,
        layers=6,
        heads=4,
        kv_heads=2,
        tie_word_embeddings=True,
        initializer_range=0.2,
        drafter=_useful_drafter,
    )
    big = tmp_path_factory.mktemp("grow") / "big"
    summary = G.grow(small, big, SHAPE, draft_dir=draft, dtype="float32", device="cpu", shard_gb=0.002)
    return small, big, summary


def _useful_drafter(_out, target):
    """The drafter goes inside the small target's folder (`grow` writes the big one's there too)."""
    draft = target / "draft"
    make_drafter(draft, target, draft_vocab=48)
    useful_drafter(draft, target)
    return draft


def run_target(path, ids: list[int], decode: int = 3, aux=()):
    """Prefill ids[:-decode], then feed the rest one token at a time through the KV cache.
    Returns logits [len(ids), V] and the aux features."""
    m = load_target(path, CPU, torch.float32, 64)
    m.aux_layers = tuple(aux)
    for a in m.attention_modules():
        a.k_cache = torch.zeros(1, a.num_kv_heads, 64, a.head_dim)
        a.v_cache = torch.zeros_like(a.k_cache)
    n0 = len(ids) - decode
    logits, feats = [], []
    for lo, hi in [(0, n0)] + [(i, i + 1) for i in range(n0, len(ids))]:
        pos = torch.arange(lo, hi)[None]
        h, f = m(torch.tensor([ids[lo:hi]]), ForwardContext(0, pos, pos, hi))
        logits.append(m.logits(h)[0])
        feats.append(f[0] if f is not None else None)
    return m, torch.cat(logits), (torch.cat(feats) if aux else None)


def test_shape_and_config(grown):
    small, big, summary = grown
    cfg = ModelConfig.from_dir(big)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        192,
        12,
        8,
        4,
        64,
        300,
    )
    assert not cfg.tie_word_embeddings
    raw = json.loads((big / "config.json").read_text())
    assert raw["grown_from"] == str(small) and raw["grow_preset"] == "custom"
    assert sorted(o for o in raw["grow_layer_map"] if o >= 0) == list(range(6))
    index = json.loads((big / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert summary["target"]["params"] == sum(
        t.numel() for f in summary["target"]["files"] for t in load_file(str(big / f)).values()
    )


@pytest.mark.slow
@pytest.mark.parametrize("read", G.READ_MODES)
def test_target_logits_match_specserve(grown, read, tmp_path):
    small, big, _ = grown
    if read != "one":  # the fixture grew with the default
        big = tmp_path / "big"
        G.grow(small, big, SHAPE, dtype="float32", device="cpu", read=read)
    assert json.loads((big / "config.json").read_text())["grow_read"] == read
    ids = [5, 17, 3, 88, 41, 9, 60, 22, 71, 14, 2, 33]
    _, a, _ = run_target(small, ids)
    _, b, _ = run_target(big, ids)
    assert a.shape == b.shape
    torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_target_logits_match_transformers(grown):
    from transformers import AutoModelForCausalLM

    small, big, _ = grown
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 22, 71, 14]])
    outs = []
    for path in (small, big):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            outs.append(model(ids).logits)
    assert model.config.hidden_size == 192 and model.config.head_dim == 64
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_drafter_logits_match(grown):
    small, big, _ = grown
    ids = [5, 17, 3, 88, 41, 9, 60, 22, 71, 14]
    logits = []
    for path in (small, big):
        dcfg = DraftConfig.from_dir(path / "draft")
        taps = resolve_aux_layers(dcfg, ModelConfig.from_dir(path).num_layers)
        target, _, feats = run_target(path, ids, decode=2, aux=taps)
        d = load_drafter(path / "draft", target, CPU, torch.float32, 64)
        a = d.attention_modules()[0]
        a.k_cache = torch.zeros(1, a.num_kv_heads, 64, a.head_dim)
        a.v_cache = torch.zeros_like(a.k_cache)
        n = len(ids) - 1
        pos = torch.arange(n)[None]
        out = d(torch.tensor([ids[1:]]), feats[None, :n], ForwardContext(0, pos, pos, n))
        # one more draft step feeding back the drafter's own output
        step = torch.tensor([[n]])
        out2 = d(torch.tensor([[7]]), out[:, -1:], ForwardContext(0, step, step, n + 1))
        logits.append(torch.cat([d.logits(out)[0], d.logits(out2)[0]]))
    torch.testing.assert_close(logits[1], logits[0], atol=2e-4, rtol=1e-4)


def engine_trace(model, draft, prompts, K: int, device: str = "cpu"):
    """Greedy outputs and, per sequence, the number of tokens each step produced."""
    eng = Engine(
        EngineConfig(
            model=str(model),
            draft=str(draft) if draft else None,
            device=device,
            dtype="float32",
            spec_steps=K,
            max_model_len=128,
            max_num_seqs=len(prompts),
        )
    )
    seqs = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)) for p in prompts]
    steps = {s.seq_id: [] for s in seqs}
    while eng.has_work():
        for s in eng.step():
            steps[s.seq_id].append(len(s.new_tokens))
    return [s.output_ids for s in seqs], [steps[s.seq_id] for s in seqs], [s.spec.as_dict() for s in seqs]


PROMPTS = [[5, 17, 3, 88, 40], [9, 60, 22, 71, 14, 2, 33, 8], [1, 2, 3, 4], [50, 51, 52]]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["grown", "moe_pair"])
def test_speculative_run_identical(which, request):
    """The grown pair (dense, or with routed experts) drafts and accepts exactly what the small pair does."""
    small, big, _ = request.getfixturevalue(which)
    tok_s, steps_s, spec_s = engine_trace(small, small / "draft", PROMPTS, K=3)
    tok_b, steps_b, spec_b = engine_trace(big, big / "draft", PROMPTS, K=3)
    plain_b, _, _ = engine_trace(big, None, PROMPTS, K=0)
    assert tok_b == tok_s == plain_b
    assert steps_b == steps_s  # accepted drafts per cycle, cycle by cycle
    assert spec_b == spec_s
    accepted = [s["accepted_tokens"] for s in spec_s]
    assert sum(accepted) > 0 and min(accepted) < max(accepted)  # real, varied acceptances are compared


@pytest.mark.slow
def test_padded_vocabulary_is_never_chosen(tmp_path, grown):
    small, _, _ = grown
    big = tmp_path / "big"
    G.grow(small, big, SHAPE, draft_dir=small / "draft", dtype="float32", device="cpu", pad_vocab=300)
    cfg = ModelConfig.from_dir(big)
    assert cfg.vocab_size == 300 and DraftConfig.from_dir(big / "draft").vocab_size == 300
    ids = [5, 17, 3, 88, 41, 9, 60, 22, 71, 14, 2, 33]
    _, a, _ = run_target(small, ids)
    _, b, _ = run_target(big, ids)
    assert b.shape == (len(ids), 300)
    assert b[:, 96:].max() < -1000  # padded tokens: hopeless
    # real logits: the small model's, times one positive factor per position close to 1 (1/(2H') here)
    ratio = b[:, :96] / a
    factor = ratio.median(-1, keepdim=True).values
    assert ((factor > 0.99) & (factor < 1.0)).all()
    torch.testing.assert_close(b[:, :96], a * factor, atol=1e-3, rtol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(big, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(hf, b, atol=1e-2, rtol=1e-4)  # padded logits are ~-1e4
    tok_s, steps_s, _ = engine_trace(small, small / "draft", PROMPTS, K=3)
    tok_b, steps_b, _ = engine_trace(big, big / "draft", PROMPTS, K=3)
    assert tok_b == tok_s and steps_b == steps_s
    with pytest.raises(ConfigError, match="smaller than the source vocabulary"):
        G.grow(small, tmp_path / "x", SHAPE, dtype="float32", device="cpu", pad_vocab=50)
    with pytest.raises(ConfigError, match="grows only 2x"):
        G.grow(small, tmp_path / "x", G.Shape(128, 12, 8, 4, 64, 300), dtype="float32", device="cpu", pad_vocab=300)


@pytest.mark.slow
def test_explicit_aux_ids_when_default_taps_cannot_line_up(tmp_path):
    # 4 layers: taps enter (2, 2, 1); grown to 8 the defaults (2, 4, 5) cannot see those streams in order,
    # so the drafter gets explicit layer ids (SGLang convention) instead.
    small = make_target(tmp_path / "small", hidden=32, layers=4, heads=2, kv_heads=1)
    make_drafter(tmp_path / "small" / "draft", small)
    summary = G.grow(
        small, tmp_path / "big", G.Shape(64, 8, 4, 2, 32, 64), draft_dir=small / "draft", dtype="float32", device="cpu"
    )
    ids = summary["draft"]["aux_layer_ids"]
    assert ids is not None
    dcfg = DraftConfig.from_dir(tmp_path / "big" / "draft")
    assert dcfg.aux_layer_ids == tuple(ids)
    order = summary["layer_map"]
    assert [sum(o >= 0 for o in order[:n]) for n in resolve_aux_layers(dcfg, 8)] == [2, 2, 1]
    tok_s, steps_s, _ = engine_trace(small, small / "draft", PROMPTS, K=2)
    tok_b, steps_b, _ = engine_trace(tmp_path / "big", tmp_path / "big" / "draft", PROMPTS, K=2)
    assert tok_b == tok_s and steps_b == steps_s


def test_llama3_8b_plan():
    order = G.place_layers(16, 32, list(zip(default_aux_layers(32), default_aux_layers(16))))
    assert sorted(o for o in order if o is not None) == list(range(16)) and order.count(None) == 16
    # the grown model's default taps see the streams the small model's taps saw
    assert [sum(o is not None for o in order[:n]) for n in default_aux_layers(32)] == list(default_aux_layers(16))
    counts = G.mlp_counts(384, 14336)
    assert sum(counts) == 14336 and set(counts) == {37, 38}
    for c in (1, 2, 3, 8, 32, 37, 38):
        coef = G.split_coefs(c, "all")
        assert len(coef) == c and coef.sum().item() == 1.0
        assert all(float(x) == 2.0 ** round(float(torch.log2(x))) for x in coef)  # powers of two
        assert G.split_coefs(c, "one").tolist() == [1.0] + [0.0] * (c - 1)
    hm = G.head_map(4, 2, 32, 32, 8, 128)
    assert hm.q_scale == 2.0 and hm.q_rows == 4096 and hm.kv_rows == 1024
    # new q head h reads new KV head h // 4, which copies old KV head h // 16 = old q head (h // 8) // 2
    old_q_head = hm.q_old.view(32, 32)[:, 0] // 32
    old_kv_of_new_kv = hm.kv_old.view(8, 32)[:, 0] // 32
    assert torch.equal(old_kv_of_new_kv[torch.arange(32) // 4], old_q_head // 2)


@pytest.mark.parametrize("read", G.READ_MODES)
def test_bf16_weights_are_exact(tmp_path, read):
    """One-hot or power-of-two coefficients: in bf16 the grown weights hold exactly the small model's values."""
    small = make_target(tmp_path / "small", hidden=32, layers=2, heads=2, kv_heads=1, tie_word_embeddings=True)
    src = load_file(str(small / "model.safetensors"))
    src = {k: v.to(torch.bfloat16) for k, v in src.items()}
    G.grow(small, tmp_path / "big", G.Shape(96, 2, 4, 2, 64, 200), dtype="bfloat16", device="cpu", read=read)
    big = load_file(str(tmp_path / "big" / "model.safetensors"))
    assert big["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    h = G.DimMap.from_counts([3] * 32, read)
    m = G.DimMap.from_counts(G.mlp_counts(64, 200), read)
    if read == "all":  # no zero weights left where the small model had none
        assert torch.count_nonzero(big["lm_head.weight"]) == big["lm_head.weight"].numel()
    # down_proj: summing the copies of each unit (exact in float64) gives back the bf16 original.
    down = big["model.layers.0.mlp.down_proj.weight"].double()[::3]  # one row per original output
    summed = torch.zeros(32, 64, dtype=torch.float64).index_add_(1, m.src, down)
    assert torch.equal(summed, src["model.layers.0.mlp.down_proj.weight"].double())
    lm = big["lm_head.weight"].double()
    assert torch.equal(
        torch.zeros(lm.shape[0], 32, dtype=torch.float64).index_add_(1, h.src, lm),
        src["model.embed_tokens.weight"].double(),
    )
    assert torch.equal(big["model.embed_tokens.weight"][:, ::3], src["model.embed_tokens.weight"])


def test_bad_shapes_and_inputs(tmp_path, grown):
    small, _, _ = grown
    with pytest.raises(ConfigError, match="hidden size 100 is not a multiple of the source's 64"):
        G.grow(small, tmp_path / "x", G.Shape(100, 12, 8, 4, 64, 300), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="intermediate size 64 is smaller"):
        G.grow(small, tmp_path / "x", G.Shape(128, 12, 8, 4, 64, 64), dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="cannot grow 6 layers to fewer"):
        G.grow(small, tmp_path / "x", G.Shape(128, 4, 8, 4, 64, 300), dtype="float32", device="cpu")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty; pass --force"):
        G.grow(small, tmp_path / "full", SHAPE, dtype="float32", device="cpu")
    with pytest.raises(ConfigError, match="would overwrite the source"):
        G.grow(small, small.parent, SHAPE, draft_dir=small / "draft", dtype="float32", device="cpu", force=True)
    qwen = make_target(tmp_path / "qwen", arch="qwen2", hidden=32, layers=2, heads=2, kv_heads=1)
    with pytest.raises(ConfigError, match="Llama targets only"):
        G.grow(qwen, tmp_path / "y", SHAPE, dtype="float32", device="cpu")


def test_cli(tmp_path, grown, capsys):
    small, _, _ = grown
    from specserve.train import grow_cmd

    p = argparse.ArgumentParser()
    grow_cmd.add_arguments(p)
    args = p.parse_args(["--model", str(small), "--no-draft", "--hidden", "128", "--out", str(tmp_path / "o")])
    assert grow_cmd.run(args) == 1
    assert "missing: --layers, --heads, --kv-heads, --head-dim, --intermediate" in capsys.readouterr().err
    args = p.parse_args(
        [
            "--model",
            str(small),
            "--draft",
            str(small / "draft"),
            "--out",
            str(tmp_path / "o"),
            "--hidden",
            "128",
            "--layers",
            "8",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--intermediate",
            "128",
            "--dtype",
            "float32",
            "--device",
            "cpu",
        ]
    )
    assert grow_cmd.run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shape"]["hidden"] == 128 and (tmp_path / "o" / "draft" / "config.json").exists()
    assert ModelConfig.from_dir(tmp_path / "o").num_layers == 8


@pytest.mark.gpu
def test_grow_on_cuda_matches_cpu(tmp_path, grown):
    """Building on the GPU (how llama3-8b is grown) writes the same checkpoint as on the CPU."""
    small, _, _ = grown
    shape = G.Shape(128, 12, 8, 4, 64, 300)
    G.grow(small, tmp_path / "cpu", shape, draft_dir=small / "draft", dtype="bfloat16", device="cpu")
    G.grow(small, tmp_path / "gpu", shape, draft_dir=small / "draft", dtype="bfloat16", device="cuda")
    layer_map = json.loads((tmp_path / "cpu" / "config.json").read_text())["grow_layer_map"]
    # identity layers' q/k/v/gate/up are random data from a device-specific generator
    random = {
        f"model.layers.{i}.{n}.weight"
        for i, o in enumerate(layer_map)
        if o < 0
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    }
    for sub in ("", "draft"):
        a = load_file(str(tmp_path / "cpu" / sub / "model.safetensors"))
        b = load_file(str(tmp_path / "gpu" / sub / "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a.keys() - random:
            assert torch.equal(a[k], b[k]), k


def test_mixtral_matches_transformers(tmp_path):
    """The architecture grown MoE targets use: distinct random experts and a sharpened router, so
    expert naming (w1/w3/w2 = gate/up/down) and routing both show in the logits."""
    import transformers

    d = make_moe_target(tmp_path / "mixtral", arch="mixtral")
    cfg = ModelConfig.from_dir(d)
    assert cfg.moe.hf_block == "block_sparse_moe" and cfg.moe.norm_topk_prob and not cfg.moe.dense_layers
    assert not cfg.qk_norm
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    assert_decode_matches(d, hf, prompt_len=20, steps=16)
    raw = json.loads((d / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"sliding_window=64\) is not supported; set it to null"):
        ModelConfig.from_hf_dict(raw | {"sliding_window": 64}, d / "config.json")


@pytest.fixture(scope="module")
def moe_pair(grown, tmp_path_factory):
    small = grown[0]
    big = tmp_path_factory.mktemp("grow_moe") / "big"
    summary = G.grow(small, big, MOE_SHAPE, draft_dir=small / "draft", dtype="float32", device="cpu")
    return small, big, summary


def test_moe_target_config_and_experts(moe_pair):
    small, big, _ = moe_pair
    cfg = ModelConfig.from_dir(big)
    assert cfg.architecture == "MixtralForCausalLM" and not cfg.qk_norm
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (6, 2, 160)
    assert DraftConfig.from_dir(big / "draft").intermediate_size == 300
    t = load_file(str(big / "model.safetensors"))
    layer_map = json.loads((big / "config.json").read_text())["grow_layer_map"]
    kept, identity = layer_map.index(0), layer_map.index(-1)
    p = f"model.layers.{kept}.block_sparse_moe."
    for e in range(1, 6):  # a kept layer's experts are one MLP; its router is not uniform
        for w in ("w1", "w2", "w3"):
            assert torch.equal(t[f"{p}experts.{e}.{w}.weight"], t[f"{p}experts.0.{w}.weight"])
    assert t[p + "gate.weight"].shape == (6, 128) and t[p + "gate.weight"].std() > 0
    q = f"model.layers.{identity}.block_sparse_moe.experts."
    assert not torch.equal(t[q + "0.w1.weight"], t[q + "1.w1.weight"])  # real, distinct data to read
    assert all(not t[f"{q}{e}.w2.weight"].any() for e in range(6))  # but nothing written to the stream


def test_moe_target_logits_and_greedy_match_the_small_target(moe_pair):
    """Random routing, identical experts: each prompt's logits (prefill and cached decode) are the small model's."""
    small, big, _ = moe_pair
    for ids in ([5, 17, 3, 88, 41, 9, 60, 22, 71, 14, 2, 33], [1, 2, 3, 4, 5, 6], [50, 51, 52, 90, 11, 0, 7]):
        _, a, _ = run_target(small, ids)
        model, b, _ = run_target(big, ids)
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    # the router spreads the tokens over the experts (so a wrong expert would show in the logits)
    x = torch.randn(32, 128)
    chosen = model.layers[json.loads((big / "config.json").read_text())["grow_layer_map"].index(0)].mlp.route(x)[1]
    assert len(chosen.unique()) == 6


def test_moe_target_matches_transformers_mixtral(moe_pair):
    import transformers

    small, big, _ = moe_pair
    hf = transformers.AutoModelForCausalLM.from_pretrained(big, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    assert_decode_matches(big, hf, prompt_len=12, steps=8)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 60, 22, 71, 14]])
    small_hf = transformers.AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, small_hf(ids).logits, atol=2e-4, rtol=1e-4)


def test_moe_presets_and_flags(tmp_path, grown, capsys):
    from specserve.config import DEMO_DIR
    from specserve.train import grow_cmd

    demo = ModelConfig.from_dir(DEMO_DIR)
    shape = PRESETS["qwen3-moe-30b-a3b"]
    G.check_shape(
        "target",
        demo.num_heads,
        demo.num_kv_heads,
        demo.head_dim,
        demo.hidden_size,
        demo.intermediate_size,
        shape,
        shape.target_intermediate,
    )  # the demo grows into it
    assert (shape.experts, shape.top_k, shape.target_intermediate) == (128, 8, 768)
    p = argparse.ArgumentParser()
    grow_cmd.add_arguments(p)
    parse = lambda *a: grow_cmd.shape_from_args(p.parse_args([*a, "--out", "x"]))  # noqa: E731
    assert parse("--preset", "qwen3-moe-30b-a3b", "--moe", "0") == G.Shape(2048, 48, 32, 4, 128, 6144)
    assert parse("--preset", "llama3-8b", "--moe", "8", "--moe-top-k", "2").target_intermediate == 14336
    with pytest.raises(ConfigError, match="--moe-intermediate must be positive"):
        parse("--preset", "llama3-8b", "--moe", "8", "--moe-intermediate", "0")
    small = grown[0]
    base = [
        "--model",
        str(small),
        "--no-draft",
        "--hidden",
        "128",
        "--layers",
        "8",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--intermediate",
        "128",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    for extra, error in (
        (["--moe", "4", "--moe-top-k", "5"], "--moe-top-k 5 must be in 1..4"),
        (["--moe", "4"], "--moe-top-k 0 must be in 1..4"),
        (["--moe-top-k", "2"], "give --moe a positive expert count"),
        (
            ["--moe", "4", "--moe-top-k", "2", "--moe-intermediate", "64"],
            "intermediate size 64 is smaller than the source's 128",
        ),
    ):
        assert grow_cmd.run(p.parse_args([*base, *extra, "--out", str(tmp_path / "o"), "--force"])) == 1
        assert error in capsys.readouterr().err
    assert (
        grow_cmd.run(p.parse_args([*base, "--moe", "4", "--moe-top-k", "2", "--out", str(tmp_path / "o"), "--force"]))
        == 0
    )
    assert json.loads(capsys.readouterr().out)["shape"]["experts"] == 4
    assert ModelConfig.from_dir(tmp_path / "o").moe.num_experts == 4


@pytest.mark.gpu
def test_moe_grow_on_cuda_greedy_and_speculation(tmp_path, grown):
    """Built on the GPU and run there through the MoE path (float32): the small pair's tokens and acceptances."""
    small = grown[0]
    big = tmp_path / "big"
    G.grow(small, big, MOE_SHAPE, draft_dir=small / "draft", dtype="float32", device="cuda")

    plain_small, _, _ = engine_trace(small, None, PROMPTS, K=0, device="cuda")
    plain_big, _, _ = engine_trace(big, None, PROMPTS, K=0, device="cuda")
    spec_small, steps_small, _ = engine_trace(small, small / "draft", PROMPTS, K=3, device="cuda")
    spec_big, steps_big, _ = engine_trace(big, big / "draft", PROMPTS, K=3, device="cuda")
    assert plain_big == plain_small == spec_big == spec_small
    assert steps_big == steps_small and max(map(max, steps_big)) > 1  # the same drafts accepted, some
