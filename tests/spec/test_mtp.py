"""DeepSeek-V3's multi-token-prediction layer as a drafter (`--speculative-method mtp`): loaded from a
checkpoint in the published layout, used recursively for K > 1, its latent KV in the paged cache;
greedy speculative output equals plain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.config import ConfigError, EngineConfig, ModelConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams

from tiny import make_moe_target

VOCAB = 24


def add_mtp_layer(model_dir: Path, seed: int = 1) -> Path:
    """Append one MTP layer as DeepSeek-V3 publishes it (`num_nextn_predict_layers: 1`, tensors under
    `model.layers.{L}`): `enorm`, `hnorm`, `eh_proj`, a full latent-attention + MoE block (here the
    last decoder layer's weights, perturbed), `shared_head.norm`, and the copies of the embedding and
    head the checkpoint carries (`embed_tokens`, `shared_head.head`). eh_proj passes the hidden half
    through, so the layer drafts near the target's own distribution: real acceptance on a random model."""
    cfg = json.loads((model_dir / "config.json").read_text())
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    w = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    src = f"model.layers.{L - 1}."
    mtp = f"model.layers.{L}."
    for name, t in list(w.items()):
        if name.startswith(src):
            noise = torch.randn(t.shape, generator=g) * 0.02 if t.is_floating_point() else 0
            w[mtp + name[len(src) :]] = (t + noise).contiguous() if t.is_floating_point() else t.clone()
    w[mtp + "enorm.weight"] = torch.ones(H)
    w[mtp + "hnorm.weight"] = torch.ones(H)
    w[mtp + "eh_proj.weight"] = torch.cat([torch.randn(H, H, generator=g) * 0.01, torch.eye(H)], 1)
    w[mtp + "shared_head.norm.weight"] = torch.ones(H)
    w[mtp + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    w[mtp + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in w.items()}, str(model_dir / "model.safetensors"))
    cfg["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp") / "deepseek"
    return add_mtp_layer(make_moe_target(out, vocab=VOCAB, hidden=64, layers=2))


def _run(target, prompts, params, **kw):
    kw.setdefault("device", "cpu")
    engine = Engine(EngineConfig(model=str(target), max_num_seqs=len(prompts), **kw))
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    return [s.output_ids for s in seqs], engine


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB - 1, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_checkpoint_reports_its_mtp_layer(mtp_target):
    assert ModelConfig.from_dir(mtp_target).mtp_layers == 1


@pytest.mark.parametrize("batch", [1, 3])
def test_mtp_greedy_speculation_equals_plain(mtp_target, batch):
    prompts = _prompts(batch, seed=batch)
    base, _ = _run(mtp_target, prompts, GREEDY)
    accepted = 0
    for K in (1, 3):  # one step, and the layer run recursively
        out, engine = _run(mtp_target, prompts, GREEDY, spec_method="mtp", spec_steps=K)
        assert out == base, f"K={K}"
        assert type(engine.runner.drafter).__name__ == "MTPDrafter" and engine.totals.cycles > 0
        # its latent KV sits in the paged pool beside the target's
        assert engine.runner.kv.drafter_mods[0].k_cache.shape[0] == engine.runner.kv.num_blocks
        accepted += engine.totals.accepted
    assert accepted > 0


def test_mtp_trees_adaptive_and_prefix_cache_equal_plain(mtp_target):
    prompts = _prompts(2, seed=9)
    prompts[1] = prompts[0][:16] + prompts[1]  # a shared prefix for the cache
    base, _ = _run(mtp_target, prompts, GREEDY)
    out, _ = _run(mtp_target, prompts, GREEDY, spec_method="mtp", spec_steps=3, spec_topk=2)
    assert out == base
    out, _ = _run(
        mtp_target,
        prompts,
        GREEDY,
        spec_method="mtp",
        spec_steps=0,
        max_spec_steps=3,
        adaptive=True,
        prefix_cache=True,
        kv_block_size=4,
    )
    assert out == base


def test_mtp_without_the_layer_is_refused(tmp_path):
    plain = make_moe_target(tmp_path / "plain", vocab=VOCAB, hidden=64, layers=2)
    with pytest.raises(ConfigError, match="needs a checkpoint with a multi-token-prediction layer"):
        Engine(EngineConfig(model=str(plain), device="cpu", max_num_seqs=1, spec_method="mtp", spec_steps=2))


def test_check_reports_the_mtp_layer(mtp_target, tmp_path):
    from specserve.ops.check import run_checks

    def mtp_finding(model, **kw):
        found = [x for x in run_checks(str(model), device="cpu", **kw) if x.code == "mtp"]
        assert len(found) == 1
        return found[0]

    ok = mtp_finding(mtp_target, spec_method="mtp")
    assert ok.level == "ok" and "1 MTP layer(s) (model.layers.2" in ok.message
    plain = make_moe_target(tmp_path / "plain", vocab=VOCAB, hidden=64, layers=2)
    assert mtp_finding(plain).level == "ok" and "no MTP layer" in mtp_finding(plain).message
    assert mtp_finding(plain, spec_method="mtp").level == "error"


@pytest.mark.gpu
def test_mtp_on_gpu_with_cuda_graphs_equals_plain(mtp_target):
    """On CUDA (float32): the MTP layer's draft graphs (chains) and the verify graphs give plain greedy output."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = _prompts(2, seed=3)
    gpu = {"device": "cuda", "dtype": "float32"}
    base, _ = _run(mtp_target, prompts, GREEDY, **gpu)
    out, engine = _run(mtp_target, prompts, GREEDY, spec_method="mtp", spec_steps=3, **gpu)
    assert out == base and engine.totals.cycles > 0


def test_mtp_layer_with_int4_experts_as_the_target(mtp_target, tmp_path):
    """A checkpoint whose routed experts are int4 (compressed-tensors, Kimi's ignore list): the MTP layer's
    experts load int4 as the decoder's do, and MTP speculation still equals plain greedy output."""
    from tiny import KIMI_IGNORE, make_int4_pair

    q, _ = make_int4_pair(mtp_target, tmp_path / "int4", tmp_path / "twin", 32, True, KIMI_IGNORE + ("re:.*eh_proj",))
    prompts = _prompts(2, seed=6)
    base, _ = _run(q, prompts, GREEDY)
    out, engine = _run(q, prompts, GREEDY, spec_method="mtp", spec_steps=3)
    assert out == base and engine.totals.cycles > 0
    names = {n for n, _ in engine.runner.drafter.named_parameters()} | {
        n for n, _ in engine.runner.drafter.named_buffers()
    }
    assert any("packed" in n for n in names), sorted(names)[:12]  # the MTP layer's experts are int4
