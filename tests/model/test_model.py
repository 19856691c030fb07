"""The target model against transformers: logits, decode steps, batched greedy, loading errors."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.config import DEMO_DIR, ConfigError, EngineConfig, ModelConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams
from specserve.model.loader import load_target

from tiny import assert_decode_matches, make_target

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
ARCHS = {
    "llama": dict(arch="llama", rope_scaling=dict(LLAMA3_ROPE)),  # a copy: transformers edits it in place
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "qwen3-yarn": dict(
        arch="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ),
}


@pytest.fixture(scope="module", params=[*ARCHS, "bundled-demo"])
def checkpoint(request, tmp_path_factory):
    """Tiny random models of each architecture, and the bundled demo target (bf16 weights, read in float32)."""
    import transformers

    if request.param == "bundled-demo":
        d = DEMO_DIR
    else:
        d = make_target(tmp_path_factory.mktemp(request.param), **ARCHS[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, hf


@pytest.mark.slow
def test_prefill_and_32_decode_steps_match_transformers(checkpoint):
    d, hf = checkpoint
    assert_decode_matches(d, hf, prompt_len=21, steps=32)


@pytest.mark.slow
def test_batched_greedy_equals_transformers_per_prompt(checkpoint):
    d, hf = checkpoint
    torch.manual_seed(1)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(0, vocab - 1, (n,)).tolist() for n in (3, 11, 7, 25, 1)]
    engine = Engine(EngineConfig(model=str(d), device="cpu", max_num_seqs=4, prefill_chunk=16))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]  # 5 prompts, 4 rows: one waits for a free row
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    for p, seq in zip(prompts, seqs):
        # No EOS for transformers either (ignore_eos above): compare 20 raw greedy tokens.
        ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        assert seq.output_ids == ref


def test_rope_config_spellings_agree():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    v4 = ModelConfig.from_hf_dict({**base, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE)})
    v5 = ModelConfig.from_hf_dict({**base, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}})
    assert (v4.rope_theta, v4.rope_scaling) == (v5.rope_theta, v5.rope_scaling) == (500000.0, {**LLAMA3_ROPE})
    with pytest.raises(ConfigError, match="rope type 'longrope' is not supported"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"'MambaForCausalLM' is not supported; supported: LlamaForCausalLM"):
        ModelConfig.from_dir(tmp_path)


def test_missing_and_misshaped_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    d = make_target(tmp_path / "m", layers=2)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_target(d, torch.device("cpu"), torch.float32, 64)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ConfigError, match=r"'model.layers.1.mlp.up_proj.weight' does not fit"):
        load_target(d, torch.device("cpu"), torch.float32, 64)


def test_pickle_checkpoints_need_explicit_permission(tmp_path):
    from safetensors.torch import load_file

    d = make_target(tmp_path / "m", layers=1)
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="only pickle checkpoints.*--allow-pickle"):
        load_target(d, torch.device("cpu"), torch.float32, 64)
    model = load_target(d, torch.device("cpu"), torch.float32, 64, allow_pickle=True)
    assert model.cfg.num_layers == 1


def test_sharded_checkpoint_loads(tmp_path):
    import transformers

    d = make_target(tmp_path / "m", layers=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a = load_target(d, torch.device("cpu"), torch.float32, 64)
    b = load_target(tmp_path / "sharded", torch.device("cpu"), torch.float32, 64)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
