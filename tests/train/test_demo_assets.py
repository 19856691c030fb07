"""The bundled demo tokenizer and target (specserve/assets/demo): fast CPU checks."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest

import specserve

from scripts import build_demo

DEMO = Path(specserve.__file__).parent / "assets" / "demo"
MAX_ASSET_BYTES = 12 * 1024 * 1024

# Python source with the awkward parts: tabs, trailing blanks, CRLF, non-ASCII, deep indent.
TRICKY = (
    "# -*- coding: utf-8 -*-\n"
    "def f(x):\r\n"
    "\tif x:   \n"
    "        return {'ключ': \"värde\", 'emoji': '\U0001f40d'}  # snake\n"
    "                    pass\n"
    "\n\n\n"
    "class   A :  ...\n"
    "s = '''<|not special|>'''\n"
)


def _stdlib_sample() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "".join((root / name).read_text(encoding="utf-8") for name in ("json/decoder.py", "textwrap.py"))


@pytest.fixture(scope="module")
def raw_tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO))


@pytest.fixture(scope="module")
def config():
    return json.loads((DEMO / "config.json").read_text())


def test_tokenizer_vocab_and_special_ids(raw_tok, config):
    assert raw_tok.get_vocab_size() == 4096 == config["vocab_size"]
    assert raw_tok.token_to_id("<|endoftext|>") == 0 == config["eos_token_id"]
    assert raw_tok.token_to_id("<|im_start|>") == 1
    assert raw_tok.token_to_id("<|im_end|>") == 2
    gen = json.loads((DEMO / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [config["eos_token_id"], 2]  # <|endoftext|>, and <|im_end|> ends a chat turn
    assert config.get("bos_token_id") is None
    # pad must not be set in the model config: it would freeze the separator's embedding row
    assert config.get("pad_token_id") is None


@pytest.mark.parametrize("text", ["tricky", "stdlib"])
def test_tokenizer_round_trips_python(raw_tok, hf_tok, text):
    s = TRICKY if text == "tricky" else _stdlib_sample()
    ids = raw_tok.encode(s, add_special_tokens=False).ids
    assert raw_tok.decode(ids, skip_special_tokens=False) == s
    hf_ids = hf_tok(s, add_special_tokens=False).input_ids
    assert hf_ids == ids
    assert hf_tok.decode(hf_ids) == s
    if text == "stdlib":
        assert len(s.encode()) / len(ids) > 2.5  # the BPE actually compresses code


def test_autotokenizer_config(hf_tok):
    assert hf_tok.eos_token == "<|endoftext|>" and hf_tok.eos_token_id == 0
    assert hf_tok.pad_token_id == 0
    assert hf_tok.bos_token is None
    assert hf_tok.model_max_length == 2048
    assert hf_tok("x = 1\n").input_ids[0] != 0  # no BOS/EOS added around text
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 1 and 2 in ids


def test_target_loads_and_is_trained(hf_tok, config):
    import torch
    from transformers import LlamaForCausalLM

    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["intermediate_size"],
    ) == (16, 128, 4, 2, 32, 384)
    assert config["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(DEMO / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    model = LlamaForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    ids = torch.tensor([hf_tok(_stdlib_sample()[:1500]).input_ids[:256]])
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], 4096)
    # uniform guessing is ln(4096) = 8.3 nats; a trained target is far below that on stdlib code
    assert out.loss.item() < 3.0
    # and on code it never saw (the held-out prompts: jinja2, click, tqdm)
    prompts = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    held = torch.tensor([hf_tok("".join(prompts))["input_ids"][:512]])
    with torch.no_grad():
        assert model(input_ids=held, labels=held).loss.item() < 4.5


def test_assets_fit_the_size_budget():
    files = [p for p in DEMO.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    for required in (
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "heldout_prompts.jsonl",
        "README.md",
    ):
        assert required in names
    assert sum(p.stat().st_size for p in files) <= MAX_ASSET_BYTES


def test_bundled_drafters_fit_and_are_the_defaults():
    """Each known model's bundled drafter: a SpecForge-layout EAGLE-3 folder with its model card,
    at most 16 MB, shipped as package data, and the drafter a run with that model defaults to."""
    import tomllib

    from specserve.config import DraftConfig
    from specserve.engine.llm import default_pair
    from specserve.model.catalog import KNOWN_MODELS, bundled_draft

    package_data = tomllib.loads((Path(specserve.__file__).parents[1] / "pyproject.toml").read_text())
    globs = package_data["tool"]["setuptools"]["package-data"]["specserve"]
    assert "assets/demo/draft/*" in globs
    for name, known in KNOWN_MODELS.items():
        folder = Path(bundled_draft(name))
        assert folder.name == known.draft and f"assets/{known.draft}/*" in globs
        assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in folder.iterdir()}
        assert sum(p.stat().st_size for p in folder.iterdir()) <= 16 * 1024 * 1024
        assert DraftConfig.from_dir(str(folder)).draft_vocab_size > 0
        assert default_pair(name, None) == (name, str(folder))
        assert default_pair(name, "/elsewhere") == (name, "/elsewhere")  # a drafter given wins
    assert default_pair(None, None) == (str(DEMO), str(DEMO / "draft"))
    assert default_pair("/some/model", None) == ("/some/model", None)


def test_heldout_prompts_are_not_stdlib(raw_tok):
    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    assert 24 <= len(rows) <= 64
    stdlib_names = set(sys.stdlib_module_names)
    for r in rows:
        assert set(r) >= {"prompt", "category", "source"}
        assert r["category"] == "code"
        pkg, _, rest = r["source"].partition("/")
        path, _, line = rest.rpartition(":")
        assert path.endswith(".py") and int(line) >= 1
        assert pkg in build_demo.HELDOUT_PACKAGES and pkg not in stdlib_names
        n = len(raw_tok.encode(r["prompt"]).ids)
        assert build_demo.HELDOUT_MIN_TOKENS <= n <= build_demo.HELDOUT_MAX_TOKENS
        assert r["prompt"].endswith("\n")  # cut at a line boundary


def test_corpus_selection_excludes_tests_and_site_packages():
    docs = build_demo.collect_stdlib(max_files=40)
    names = [d.name for d in docs]
    assert names == sorted(names) and len(names) == 40
    assert not any(
        part in build_demo.TEST_DIR_NAMES or part == "site-packages" for n in names for part in n.split("/")[:-1]
    )
    train, val = build_demo.split_train_val(docs)
    assert train and val and not {d.name for d in train} & {d.name for d in val}
    assert build_demo.split_train_val(docs) == (train, val)  # deterministic


def test_tokenizer_stage_smoke(tmp_path):
    from transformers import AutoTokenizer

    docs = build_demo.collect_stdlib(max_files=6)
    tok = build_demo.train_tokenizer([d.text for d in docs], vocab_size=600)
    build_demo.write_tokenizer(tok, tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token_id == 0 and hf.convert_tokens_to_ids("<|im_end|>") == 2
    assert hf.decode(hf(TRICKY).input_ids) == TRICKY
    stream = build_demo.encode_stream(tok, docs[:2])
    assert (stream == 0).sum() == 2 and stream[-1] == 0  # one separator after each document
