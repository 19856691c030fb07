"""MoE targets against transformers: DeepSeek-V3 (latent attention, grouped sigmoid routing,
shared experts, YaRN) and Qwen3-MoE; speculation on them; Kimi configs; quantized latent attention refused."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.config import ConfigError, EngineConfig, ModelConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams
from specserve.model.loader import load_target

from tiny import assert_decode_matches, engine_with_prefill_graphs, kimi_k25_config, make_drafter, make_moe_target

VARIANTS = {
    "deepseek_v3": dict(arch="deepseek_v3"),
    # q as one projection, rope dims not interleaved, a single expert group
    "deepseek_v3-plain-q": dict(arch="deepseek_v3", q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1),
    "qwen3_moe": dict(arch="qwen3_moe"),
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    import transformers

    d = make_moe_target(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return d, transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_prefill_and_32_decode_steps_match_transformers(checkpoint):
    d, hf = checkpoint
    assert_decode_matches(d, hf, prompt_len=20, steps=32)


def test_packed_prefill_graph_equals_eager_prefill(checkpoint):
    """Prompts prefilled together through one prefill graph (played eagerly here), packed one after another in
    the staging row, give each row the logits and KV (MLA: the latent cache) of the eager prefill of the rows."""
    r = engine_with_prefill_graphs((16, 64), model=str(checkpoint[0]), device="cpu", max_num_seqs=3).runner
    r.reserve_every_row()
    lens = (7, 1, 30)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 95, (n,), generator=g).tolist() for n in lens]

    def run():
        logits, _ = r.prefill(0, prompts, [0, 0, 0])
        kv = []
        for i, n in enumerate(lens):
            block, offset = r.kv.slots(i, n)
            kv += [c[:, block, :, offset].clone() for c in (r.kv.k_all, r.kv.v_all) if c is not None]
        return [logits.clone()] + kv

    got = run()
    for c in (r.kv.k_all, r.kv.v_all):
        if c is not None:
            c.zero_()
    graphs, r.graphs = r.graphs, {}
    want = run()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Chunks past a history (a prefix-cache hit): the graph computes it again, the eager prefill reads its KV.
    chunks = [torch.randint(0, 95, (n,), generator=g).tolist() for n in (5, 9, 2)]
    results = []
    for use in (graphs, {}):
        r.graphs = use
        assert r.graph_prefill_tokens() == (64 if use else 0)  # (38 + 16 tokens: the graph of 64 takes them)
        logits, _ = r.prefill(0, chunks, list(lens), prompts if use else None)
        out = [logits.clone()]
        for i, (s0, c) in enumerate(zip(lens, chunks)):
            block, offset = r.kv.slots(i, len(c), s0)
            out += [kv[:, block, :, offset].clone() for kv in (r.kv.k_all, r.kv.v_all) if kv is not None]
        results.append(out)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_latent_attention_caches_only_the_latent(checkpoint):
    d, _ = checkpoint
    cfg = ModelConfig.from_dir(d)
    engine = Engine(EngineConfig(model=str(d), device="cpu", max_num_seqs=2, max_model_len=64))
    kv = engine.runner.kv
    if cfg.mla is None:
        assert kv.v_all is not None and kv.k_all.shape[2:] == (2, kv.block_size, 16)
        return
    # blocks of one head of kv_lora_rank 32 + rope 16 dims per token per layer, no V cache
    assert kv.k_all.shape == (4, kv.num_blocks, 1, kv.block_size, 48) and kv.v_all is None
    assert kv.nbytes() == kv.k_all.numel() * 4


def test_batched_greedy_equals_transformers_per_prompt(checkpoint):
    d, hf = checkpoint
    torch.manual_seed(1)
    prompts = [torch.randint(0, hf.config.vocab_size - 1, (n,)).tolist() for n in (4, 17, 9)]
    engine = Engine(EngineConfig(model=str(d), device="cpu", max_num_seqs=3, prefill_chunk=8))
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    for p, seq in zip(prompts, seqs):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        assert seq.output_ids == ref


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    """A tiny DeepSeek-V3 target (small vocabulary: a random drafter then agrees often enough to
    accept drafts) and a random EAGLE-3 drafter fed the outputs of its MoE layers 1, 2 and 3."""
    root = tmp_path_factory.mktemp("moe_pair")
    target = make_moe_target(root / "target", vocab=12)
    return target, make_drafter(root / "draft", target, layout="sglang", aux_ids=[1, 2, 3])


def _generate(target, draft, prompts, **kw):
    kw.setdefault("device", "cpu")
    engine = Engine(
        EngineConfig(model=str(target), draft=str(draft) if draft else None, max_num_seqs=len(prompts), **kw)
    )
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    return [s.output_ids for s in seqs], engine


@pytest.mark.parametrize("spec", [dict(spec_steps=3), dict(spec_steps=3, spec_topk=2)], ids=["chain", "tree"])
def test_speculative_greedy_equals_plain_on_an_moe_target(moe_pair, spec):
    target, draft = moe_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (5, 13, 2)]
    base, _ = _generate(target, None, prompts)
    out, engine = _generate(target, draft, prompts, **spec)
    assert engine.runner.target.aux_layers == (2, 3, 4)
    assert out == base
    assert engine.totals.cycles > 0 and engine.totals.accepted > 0


KIMI_TEXT = {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-5,
    "eos_token_id": 163586,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        }
    },
    "ignore": ["lm_head"],
}


def test_kimi_k25_nested_config_is_parsed(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(kimi_k25_config(KIMI_TEXT)))
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.max_position_embeddings) == (
        "DeepseekV3ForCausalLM",
        61,
        7168,
        262144,
    )
    assert cfg.tensor_prefix == "language_model." and "vision_tower." in cfg.skip_prefixes
    assert cfg.kv_cache_dims() == (1, 576, 0)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 50000.0
    mscale = 0.1 * torch.log(torch.tensor(64.0)).item() + 1.0
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.scoring, m.shared_intermediate_size, m.dense_layers) == (
        384,
        8,
        "sigmoid",
        2048,
        (0,),
    )
    assert m.routed_scaling_factor == 2.827
    (tmp_path / "config.json").write_text(json.dumps({**KIMI_TEXT, "architectures": ["DeepseekV3ForCausalLM"]}))
    assert ModelConfig.from_dir(tmp_path).moe == m  # Kimi-K2: the text config alone


def test_kimi_k25_checkpoint_loads_its_text_model(tmp_path, checkpoint):
    """A Kimi-K2.5-style checkpoint (text model under language_model., a vision tower beside it)
    loads into the same model as the plain text checkpoint."""
    from safetensors.torch import load_file, save_file

    d, _ = checkpoint
    if ModelConfig.from_dir(d).mla is None:
        pytest.skip("Kimi wraps a DeepSeek-V3 text model")
    tensors = {"language_model." + k: v for k, v in load_file(d / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    text = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(kimi_k25_config(text)))
    plain, wrapped = (load_target(p, torch.device("cpu"), torch.float32, 64) for p in (d, tmp_path))
    for (n, p), (_, q) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(p, q), n


def test_a_misshapen_part_of_the_fused_latent_projection_is_named(tmp_path, checkpoint):
    """q_a_proj and kv_a_proj_with_mqa load into one product; a checkpoint tensor of the wrong shape is
    refused by its own name and shapes, not the fused weight's."""
    from safetensors.torch import load_file, save_file

    d, _ = checkpoint
    if ModelConfig.from_dir(d).mla is None:
        pytest.skip("latent attention only")
    tensors = load_file(d / "model.safetensors")
    name = next(k for k in tensors if k.endswith("kv_a_proj_with_mqa.weight"))
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(Exception, match=r"kv_a_proj_with_mqa: expected (shape|\d+ rows)"):
        load_target(tmp_path, torch.device("cpu"), torch.float32, 64)


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_quantized_latent_attention_is_refused_wherever_the_config_sits(tmp_path, where):
    text = dict(KIMI_TEXT)
    cfg = kimi_k25_config(text)
    (cfg if where == "top" else text)["quantization_config"] = INT4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError, match="q_a_proj is int4 group 32, symmetric in quantization_config; latent-attention"
    ):
        ModelConfig.from_dir(tmp_path)


def test_unsupported_routing_is_named():
    cfg = {
        **KIMI_TEXT,
        "architectures": ["DeepseekV3ForCausalLM"],
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
    }
    with pytest.raises(ConfigError, match="scoring_func 'softmax' with topk_method 'group_limited_greedy' is not"):
        ModelConfig.from_hf_dict(cfg)


def _kimi_pair(root, moe_pair):
    """moe_pair's target rewritten as a Kimi-K2.5 checkpoint (text model under language_model., a
    vision tower beside it) allowing 262144 positions, and a drafter trained to 131072: the seeds' case."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, models

    target, _ = moe_pair
    kimi = root / "kimi"
    kimi.mkdir()
    tensors = {"language_model." + k: v for k, v in load_file(target / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(64, 3)
    save_file(tensors, kimi / "model.safetensors")
    text = json.loads((target / "config.json").read_text()) | {"max_position_embeddings": 262144}
    (kimi / "config.json").write_text(json.dumps(kimi_k25_config(text)))
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(12)}, unk_token="t0")).save(str(kimi / "tokenizer.json"))
    return kimi, make_drafter(root / "draft", target, layout="sglang", aux_ids=[1, 2, 3], max_pos=131072)


def test_check_reports_the_seeds_case_before_reading_weights(tmp_path, moe_pair, monkeypatch):
    import safetensors

    from specserve.model import loader
    from specserve.ops import check

    kimi, draft = _kimi_pair(tmp_path, moe_pair)

    def no_weights(*a, **k):
        raise AssertionError("check read tensor data")

    monkeypatch.setattr(safetensors, "safe_open", no_weights)
    monkeypatch.setattr(loader, "iter_tensors", no_weights)
    found = check.run_checks(str(kimi), str(draft), device="cpu", max_num_seqs=1, max_model_len=262144)
    errors = [f for f in found if f.level == "error"]
    assert [f.code for f in errors] == ["draft_positions"], check.format_report(found)
    (err,) = errors
    assert err.data == {"served": 262144, "draft_max": 131072, "target_max": 262144}
    assert "context length 262144" in err.message and "max_position_embeddings 131072" in err.message
    assert "--max-model-len 131072" in err.message and "--allow-draft-position-extension" in err.message
    ok = {f.code: f.message for f in check.run_checks(str(kimi), str(draft), device="cpu", max_num_seqs=1)}
    assert "the target allows 262144: past 131072" in ok["draft_positions"]
    assert "8 routed experts (3 per token, sigmoid routing, shared experts) in 3 layers" in ok["target_config"]
    assert "in routed experts, all loaded" in ok["target_weights"]


def test_check_estimate_matches_what_the_engine_allocates(moe_pair):
    """Weights (every expert) and the latent KV cache as the runner really holds them."""
    from specserve.engine.runner import ModelRunner
    from specserve.ops import check

    target, draft = moe_pair
    kw = dict(device="cpu", spec_steps=3, max_num_seqs=2, max_model_len=100, cuda_graphs=False)
    runner = ModelRunner(EngineConfig(model=str(target), draft=str(draft), **kw))
    found = check.run_checks(str(target), str(draft), **kw)
    est = next(f for f in found if f.code == "memory_estimate").data
    assert est["kv"] == runner.kv.nbytes()
    target_bytes = sum(p.numel() * p.element_size() for p in runner.target.parameters())
    drafter_bytes = sum(
        p.numel() * p.element_size()
        for n, p in runner.drafter.named_parameters(remove_duplicate=False)
        if not n.startswith("target_embed.")
    )
    drafter_bytes += sum(b.numel() * b.element_size() for n, b in runner.drafter.named_buffers() if n in ("d2t", "t2d"))
    assert est["weights"] == target_bytes + drafter_bytes


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_tp2_ep2_equals_tp1(tmp_path, arch):
    """Two gloo ranks (attention heads split, routed experts sharded 4 + 4) give TP1's greedy
    tokens, plain and speculative."""
    import shutil

    from specserve.config import DEMO_DIR
    from specserve.distributed.tp_llm import TPLLM
    from specserve.engine.llm import LLM

    target = make_moe_target(tmp_path / "target", arch=arch, vocab=4096)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # text prompts, as TPLLM takes them
        shutil.copy(DEMO_DIR / f, target / f)
    draft = make_drafter(tmp_path / "draft", target, layout="sglang", aux_ids=[1, 2, 3])
    prompts = ["def add(a, b):", "import os\n", "class Stack:"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = dict(device="cpu", max_num_seqs=3, max_model_len=96)
    for spec in ({}, {"draft": str(draft), "spec_steps": 3}):
        ref = LLM(model=str(target), **engine, **spec).generate(prompts, greedy)
        with TPLLM(model=str(target), tp=2, **engine, **spec) as llm:
            out = llm.generate(prompts, greedy)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], spec


def test_check_tp_names_the_experts(moe_pair):
    from specserve.ops import check

    target, _ = moe_pair
    (ok,) = [f for f in check.run_checks(str(target), device="cpu", tp=2) if f.code == "tp"]
    assert ok.level == "ok" and "routed experts" in ok.message and "num_key_value_heads" not in ok.message
    (err,) = [f for f in check.run_checks(str(target), device="cpu", tp=3) if f.code == "tp"]
    assert err.level == "error" and "routed experts 8" in err.message


@pytest.mark.gpu
def test_moe_target_on_gpu_greedy_and_speculation(moe_pair):
    """On CUDA the tiny DeepSeek-V3 target runs its experts fused and is captured in CUDA graphs;
    in float32 it decodes as on the CPU and as eagerly, speculation (chain and tree, graphs
    too) equals plain decoding, and bf16 runs."""
    target, draft = moe_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (5, 13, 2)]
    base, engine = _generate(target, None, prompts, device="cuda", dtype="float32")
    assert engine.runner.target.graph_safe and engine.runner.graphs
    assert base == _generate(target, None, prompts)[0]
    assert _generate(target, None, prompts, device="cuda", dtype="float32", cuda_graphs=False)[0] == base
    for spec in (dict(spec_steps=3), dict(spec_steps=3, spec_topk=2)):
        out, engine = _generate(target, draft, prompts, device="cuda", dtype="float32", **spec)
        assert engine.runner.graphs and out == base, spec
        assert engine.totals.accepted > 0
    out, _ = _generate(target, draft, prompts, device="cuda", dtype="bfloat16", spec_steps=3)
    assert [len(o) for o in out] == [GREEDY.max_tokens] * 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefix_cache_hits_take_the_prefill_graphs_on_an_moe_target(moe_pair, device, monkeypatch):
    """Prompts whose first blocks the prefix cache holds go through the prefill graphs (on the CPU played
    eagerly) with their cached tokens computed again: outputs equal those without the cache, plain and
    speculative, on the tiny DeepSeek-V3 target (float32)."""
    target, draft = moe_pair
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(0, 11, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 11, (n,), generator=g).tolist() for n in (3, 9, 1)]
    base, _ = _generate(target, None, prompts, device=device, dtype="float32")
    for d in (None, draft):
        config = dict(
            model=str(target),
            draft=str(d) if d else None,
            device=device,
            dtype="float32",
            max_num_seqs=3,
            prefix_cache=True,
            kv_block_size=8,
            **({"spec_steps": 3} if d else {}),
        )
        engine = (
            engine_with_prefill_graphs((16, 64, 128), **config) if device == "cpu" else Engine(EngineConfig(**config))
        )
        histories = []
        real = engine.runner.prefill
        monkeypatch.setattr(
            engine.runner,
            "prefill",
            lambda row, chunks, starts, history=None, after=None: (
                histories.append(history is not None),
                real(row, chunks, starts, history, after),
            )[1],
        )
        for _ in range(2):  # the second time round, the shared blocks are cached
            seqs = [engine.add_request(p, GREEDY) for p in prompts]
            while engine.has_work():
                engine.step()
            engine.check_idle_integrity()
            assert [s.output_ids for s in seqs] == base, d
        assert any(histories) and engine.kv_usage()["prefix_hit_tokens"] > 0
