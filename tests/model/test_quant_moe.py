"""int4 (compressed-tensors pack-quantized) MoE targets: routed experts stacked packed, against
the checkpoints' dequantized float32 twins; speculation on them; what may not be int4; `check`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.config import ConfigError, ModelConfig
from specserve.model.int4_linear import Int4Linear
from specserve.model.layers import ColumnParallelLinear, RowParallelLinear
from specserve.model.loader import load_target
from specserve.model.moe import Int4Experts, MoE
from specserve.ops.check import _count

from tiny import (
    INT_PROMPTS,
    KIMI_IGNORE,
    QWEN3_MOE_IGNORE,
    assert_logits_match,
    generate_greedy,
    make_drafter,
    make_int4_pair,
    make_moe_target,
    with_cache,
)

CPU = torch.device("cpu")
# (architecture, group size, symmetric, ignore): Kimi-K2.5's scheme (routed experts only) on
# DeepSeek-V3, and a Qwen3-MoE with everything but routers and lm_head int4, asymmetric.
SCHEMES = {
    "kimi": ("deepseek_v3", 32, True, KIMI_IGNORE),
    "qwen3_moe": ("qwen3_moe", 32, False, QWEN3_MOE_IGNORE),
}


@pytest.fixture(scope="module", params=list(SCHEMES))
def moe_int4_pair(request, tmp_path_factory):
    """(int4 checkpoint, its dequantized float32 twin, scheme name) of a tiny MoE target."""
    arch, group, symmetric, ignore = SCHEMES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = make_moe_target(root / "src", arch=arch, vocab=12, layers=3)
    q, twin = make_int4_pair(src, root / "int4", root / "twin", group, symmetric, ignore)
    return q, twin, request.param


@torch.inference_mode()
def test_int4_moe_loads_packed_experts_and_equals_its_twin(moe_int4_pair):
    q, twin, scheme = moe_int4_pair
    ours, ref = (
        with_cache(load_target(q, CPU, torch.float32, 64)),
        with_cache(load_target(twin, CPU, torch.float32, 64)),
    )
    moe, ref_moe = ours.layers[1].mlp, ref.layers[1].mlp
    assert isinstance(moe, MoE) and isinstance(moe.w13, Int4Experts) and isinstance(moe.w2, Int4Experts)
    # 8 experts of gate/up [2 x 32, 64] and down [64, 32]: words of eight along the input columns.
    assert moe.w13.packed.shape == (8, 64, 8) and moe.w13.scale.shape == (8, 64, 2)
    assert moe.w2.packed.shape == (8, 64, 4) and moe.w2.scale.shape == (8, 64, 1)
    assert (moe.w13.zero is None) == (scheme == "kimi")
    assert not any(p.dim() == 3 for layer in ours.layers for p in layer.mlp.parameters())  # no float experts
    if scheme == "kimi":  # Kimi's ignore list: attention, shared experts and the dense layer stay float
        assert isinstance(moe.shared.gate_up_proj, ColumnParallelLinear)
        assert isinstance(ours.layers[0].mlp.down_proj, RowParallelLinear)
        assert not any(isinstance(m, Int4Linear) for m in ours.layers[1].self_attn.modules())
    else:
        assert isinstance(ours.layers[1].self_attn.qkv_proj, Int4Linear)
        assert isinstance(ours.layers[0].mlp.gate_up_proj, Int4Linear)
    # The accessor the fused kernel reads: the twin's float weights exactly.
    for ours_w, ref_w in zip(moe.experts_weights(), ref_moe.experts_weights()):
        assert torch.equal(ours_w, ref_w)
    assert all(torch.equal(a, b) for a, b in zip(moe.expert_weights(5), ref_moe.expert_weights(5)))
    assert_logits_match(ours, ref, 11, steps=6)


def test_kimi_k25_wrapped_int4_checkpoint_loads_its_text_model(moe_int4_pair, tmp_path):
    """The Kimi-K2.5 layout: the text model under language_model., a vision tower beside it, the
    quantization_config at the top level naming modules with the prefix: loads as the plain one."""
    from tiny import kimi_k25_config

    q, _, scheme = moe_int4_pair
    if scheme != "kimi":
        pytest.skip("Kimi wraps a DeepSeek-V3 text model")
    tensors = {"language_model." + k: v for k, v in load_file(q / "model.safetensors").items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    text = json.loads((q / "config.json").read_text())
    quant = text.pop("quantization_config")
    quant["ignore"] = ["language_model.lm_head", *quant["ignore"][1:], "re:.*vision_tower.*"]
    (tmp_path / "config.json").write_text(json.dumps({**kimi_k25_config(text), "quantization_config": quant}))
    plain, wrapped = (load_target(d, CPU, torch.float32, 64) for d in (q, tmp_path))
    assert isinstance(wrapped.lm_head, ColumnParallelLinear)  # ignored by its prefixed name
    state = dict(wrapped.named_buffers())
    for n, b in plain.named_buffers():
        assert torch.equal(b, state[n]), n
    for (n, p), (_, w) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(p, w), n


@pytest.mark.slow
def test_int4_moe_greedy_equals_twin_and_speculation_is_lossless(moe_int4_pair, tmp_path):
    q, twin, _ = moe_int4_pair
    base, _ = generate_greedy(q, INT_PROMPTS)
    assert base == generate_greedy(twin, INT_PROMPTS)[0]
    draft = make_drafter(tmp_path / "draft", q, layout="sglang", aux_ids=[0, 1, 2], draft_vocab=8)
    out, engine = generate_greedy(q, INT_PROMPTS, draft, spec_steps=3)
    assert out == base
    assert engine.totals.cycles > 0 and engine.totals.accepted > 0


@pytest.mark.slow
def test_tp2_ep2_int4_moe_equals_tp1(tmp_path):
    """Two gloo ranks, each holding 4 of the 8 int4 experts (zero points too), give TP1's tokens."""
    import shutil

    from specserve.config import DEMO_DIR
    from specserve.distributed.tp_llm import TPLLM
    from specserve.engine.llm import LLM
    from specserve.engine.sampling import SamplingParams

    src = make_moe_target(tmp_path / "src", arch="qwen3_moe", vocab=4096, layers=2)
    q, _ = make_int4_pair(src, tmp_path / "int4", tmp_path / "twin", 32, False, QWEN3_MOE_IGNORE)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # TPLLM takes text prompts
        shutil.copy(DEMO_DIR / f, q / f)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = dict(device="cpu", max_num_seqs=3, max_model_len=96)
    prompts = ["def add(a, b):", "import os\n", "class Stack:"]
    ref = LLM(model=str(q), **engine).generate(prompts, greedy)
    with TPLLM(model=str(q), tp=2, **engine) as llm:
        out = llm.generate(prompts, greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_expert_parallel_ranks_hold_their_slice_of_the_int4_experts(moe_int4_pair, monkeypatch):
    """Under EP 2 rank r's stacked int4 experts are experts 4r..4r+3 of the checkpoint."""
    import specserve.model.int4_linear as int4_linear
    import specserve.model.layers as layers
    import specserve.model.moe as moe_mod

    q, _, _ = moe_int4_pair
    whole = load_target(q, CPU, torch.float32, 64).layers[1].mlp
    for rank in (0, 1):
        for mod in (moe_mod, layers, int4_linear):
            monkeypatch.setattr(mod, "tp_size", lambda: 2, raising=False)
            monkeypatch.setattr(mod, "tp_rank", lambda: rank, raising=False)
        part = load_target(q, CPU, torch.float32, 64).layers[1].mlp
        assert part.local == 4 and part.first == 4 * rank
        for e in range(4):
            for a, b in zip(part.expert_weights(e), whole.expert_weights(4 * rank + e)):
                assert torch.equal(a, b)


@pytest.mark.gpu
def test_int4_moe_on_gpu_dequantizes_to_the_twin_and_speculation_is_lossless(moe_int4_pair, tmp_path):
    """On the GPU the int4 experts dequantize to the twin's bf16 weights exactly. The int4 MoE
    target (the checkpoint's float32) runs its experts on the fused W4A16 kernels and its int4
    linears on the W4A16 GEMV, captured in CUDA graphs: it decodes greedily as its float twin,
    and greedy speculation (graphs too) equals plain decoding."""
    q, twin, _ = moe_int4_pair
    cuda = torch.device("cuda")
    ours, ref = load_target(q, cuda, torch.bfloat16, 64), load_target(twin, cuda, torch.bfloat16, 64)
    for a, b in zip(ours.layers[1].mlp.experts_weights(), ref.layers[1].mlp.experts_weights()):
        assert torch.equal(a, b)
    base, engine = generate_greedy(q, INT_PROMPTS, device="cuda")
    assert engine.runner.target.graph_safe and engine.runner.graphs
    assert base == generate_greedy(twin, INT_PROMPTS, device="cuda")[0]
    draft = make_drafter(tmp_path / "draft", q, layout="sglang", aux_ids=[0, 1, 2], draft_vocab=8)
    out, engine = generate_greedy(q, INT_PROMPTS, draft, spec_steps=3, device="cuda")
    assert out == base and engine.totals.cycles > 0 and engine.runner.graphs


# ------------------------------------------------------------------- refusals
def _cfg(path, arch, ignore):
    src = make_moe_target(path, arch=arch, vocab=12, layers=2)
    cfg = json.loads((src / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": list(ignore),
    }
    return cfg


def test_quantized_latent_attention_is_refused_by_name(tmp_path):
    cfg = _cfg(tmp_path, "deepseek_v3", ["lm_head"])
    with pytest.raises(
        ConfigError,
        match=r"model.layers.0.self_attn.q_a_proj is int4 group 32, symmetric in "
        r"quantization_config; latent-attention projections load as float only",
    ):
        ModelConfig.from_hf_dict(cfg)
    cfg["quantization_config"]["ignore"] = list(KIMI_IGNORE)
    assert ModelConfig.from_hf_dict(cfg).quant is not None


def test_experts_of_a_layer_must_be_quantized_alike(tmp_path):
    cfg = _cfg(tmp_path, "deepseek_v3", list(KIMI_IGNORE) + ["re:.*experts\\.3\\.down_proj"])
    with pytest.raises(
        ConfigError,
        match=r"model.layers.1.mlp.experts: model.layers.1.mlp.experts.0.gate_proj is "
        r"int4 group 32, symmetric but model.layers.1.mlp.experts.3.down_proj is "
        r"float in quantization_config",
    ):
        ModelConfig.from_hf_dict(cfg)


def test_quantized_qwen3_router_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"the router model.layers.1.mlp.gate is int4 group 32, symmetric"):
        ModelConfig.from_hf_dict(_cfg(tmp_path, "qwen3_moe", ["lm_head"]))


def test_bad_int4_expert_tensors_are_named(tmp_path):
    src = make_moe_target(tmp_path / "src", vocab=12, layers=2)
    q, _ = make_int4_pair(src, tmp_path / "int4", tmp_path / "twin", 32, True, KIMI_IGNORE)
    path = q / "model.safetensors"
    good = load_file(path)
    name = "model.layers.1.mlp.experts.6.down_proj"
    cases = [
        (
            {f"{name}.weight_shape": torch.tensor([64, 64])},
            r"weight_shape' does not fit: weight_shape is \[64, 64\], "
            r"the config implies \[64, 32\]",
        ),
        ({f"{name}.weight_packed": good[f"{name}.weight_packed"].to(torch.int64)}, "packed int4 tensors are int32"),
        ({f"{name}.weight_scale": good[f"{name}.weight_scale"][:32].contiguous()}, r"expected shape \(64, 1\)"),
        ({f"{name}.weight_packed": None}, rf"missing tensor\(s\): {name}.weight_packed"),
    ]
    for change, message in cases:
        save_file({k: v for k, v in {**good, **change}.items() if v is not None}, path)
        with pytest.raises(ConfigError, match=message):
            load_target(q, CPU, torch.float32, 64)


# ---------------------------------------------------------------------- check
def test_check_counts_int4_experts_and_how_many_gpus(moe_int4_pair, fake_gpus, monkeypatch):
    """`check`'s weight bytes are what the loaded model holds (packed experts, scales, zero points
    as a byte each); it counts the experts' weights and, on a GPU that fits the int4 target, needs
    no second GPU where the float twin needs two."""
    from specserve.ops import check

    q, twin, scheme = moe_int4_pair
    found = {x.code: x for x in check.run_checks(model=str(q), device="cpu")}
    assert not [x for x in found.values() if x.level == "error" and x.code != "target_tokenizer"], found
    model = load_target(q, CPU, torch.float32, 64)
    held = sum(t.numel() * t.element_size() for t in model.parameters())
    held += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if not n.startswith("rope."))
    assert found["memory_estimate"].data["weights"] == held
    msg = found["target_weights"].message
    projections = 8 * 3 * 2  # experts x projections x MoE layers
    assert f"{_count(projections * 32 * 64)} of them in routed experts" in msg
    assert f"{projections} of them in routed experts" in msg and "int4 linears" in msg

    monkeypatch.setattr(check, "OVERHEAD_BYTES", 0)  # else the fixed allowance dominates these tiny models
    run = dict(device="auto", max_num_seqs=1, max_model_len=64)
    total = {
        d: next(f for f in check.run_checks(str(d), **run) if f.code == "memory_estimate").data["total"]
        for d in (q, twin)
    }
    assert total[q] < total[twin]
    fake_gpus((0, (total[q] + total[twin]) / 2 / 0.9 / 2**20))  # room for the int4 target, not the twin
    (ok,) = [f for f in check.run_checks(str(q), **run) if f.code == "memory"]
    (err,) = [f for f in check.run_checks(str(twin), **run) if f.code == "memory"]
    assert ok.level == "ok" and err.data["gpus_needed"] == 2, (ok.message, err.message)
