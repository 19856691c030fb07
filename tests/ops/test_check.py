"""`specserve check`: every mismatch gives its message and exit 1; a good pair passes.

Tiny checkpoints (tests/tiny.py) copied and edited per test; GPUs are faked by
replacing `nvml.query`, so nothing here needs a GPU or loads weights (except the
two tests that compare the estimate with what the engine really allocates).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from specserve.cli import main
from specserve.config import DEMO_DIR
from specserve.ops import check, nvml

from tiny import make_drafter, make_target

LAYERS = 8  # target layers; the sglang drafter's aux ids are [1, 3, 4] -> captured inputs [2, 4, 5]


def write_tokenizer(path: Path, vocab: dict[str, int]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


VOCAB = {f"t{i}": i for i in range(96)}


@pytest.fixture(scope="module")
def base(make_pair) -> Path:
    """The folder holding target/ and draft/ (each test edits a copy: `pair`)."""
    target, _ = make_pair(
        layers=LAYERS,
        tokenizer=_word_tokenizer,  # vocab 96, hidden 64, 4 heads / 2 KV heads
        draft={"layout": "sglang", "draft_vocab": 48, "aux_ids": (1, 3, 4)},
    )
    return target.parent


def _word_tokenizer(target: Path) -> None:
    write_tokenizer(target / "tokenizer.json", VOCAB)


@pytest.fixture
def check_pair(base, tmp_path) -> tuple[Path, Path]:
    shutil.copytree(base, tmp_path / "p")
    return tmp_path / "p" / "target", tmp_path / "p" / "draft"


def edit(model_dir: Path, **changes) -> None:
    p = model_dir / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A header-valid safetensors file with zero data (dtype tags written as given)."""
    header, off = {}, 0
    for name, (tag, shape) in tensors.items():
        n = check.ST_BYTES[tag]
        for s in shape:
            n *= s
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * off)


def retag(draft: Path, **changes: tuple[str, tuple[int, ...]]) -> None:
    st = draft / "model.safetensors"
    tensors = check.read_safetensors_header(st)
    tensors.update(changes)
    write_safetensors(st, tensors)


def cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["check", *argv])
    return rc, capsys.readouterr().out


def run_pair(capsys, check_pair, *extra: str) -> tuple[int, str]:
    target, draft = check_pair
    return cli(capsys, "--model", str(target), "--draft", str(draft), "--device", "cpu", *extra)


def lines(out: str, level: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(level + ":")]


# ------------------------------------------------------------------ good pair
def test_good_pair_passes(capsys, check_pair):
    rc, out = run_pair(capsys, check_pair)
    assert rc == 0, out
    assert not lines(out, "ERROR") and not lines(out, "WARNING")
    assert out.strip().splitlines()[-1] == "check passed: 0 errors, 0 warnings"
    ok = "\n".join(lines(out, "ok"))
    assert "target LlamaForCausalLM: 8 layers" in ok
    assert "captures the inputs of target layers [2, 4, 5] of 0..8" in ok
    assert "draft vocab 48 of 96" in ok
    assert "no GPU: memory check against device memory skipped" in out
    assert "memory estimate per device" in out


def test_json_output(capsys, check_pair):
    edit(check_pair[1], vocab_size=128)
    rc, out = run_pair(capsys, check_pair, "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["ok"] is False and doc["errors"] >= 1
    codes = {f["code"] for f in doc["findings"] if f["level"] == "error"}
    assert "vocab" in codes
    est = next(f for f in doc["findings"] if f["code"] == "memory_estimate")["data"]
    assert est["total"] == est["weights"] + est["kv"] + est["other"]


def test_target_alone_passes(capsys, check_pair):
    rc, out = cli(capsys, "--model", str(check_pair[0]), "--device", "cpu")
    assert rc == 0, out
    assert "drafter" not in out


# ------------------------------------------------------------- each mismatch
def test_unsupported_architecture(capsys, check_pair):
    edit(check_pair[0], architectures=["MistralForCausalLM"])
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    (err,) = [ln for ln in lines(out, "ERROR") if "Mistral" in ln]
    assert "'MistralForCausalLM' is not supported" in err
    assert "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in err


def test_not_a_drafter(capsys, check_pair):
    rc, out = cli(capsys, "--model", str(check_pair[0]), "--draft", str(check_pair[0]), "--device", "cpu")
    assert rc == 1
    assert any("is not an EAGLE-3 drafter" in ln or "num_hidden_layers 1" in ln for ln in lines(out, "ERROR"))


def test_vocab_size_mismatch(capsys, check_pair):
    edit(check_pair[1], vocab_size=128)
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    assert any("drafter vocab_size 128 differs from the target's 96" in ln for ln in lines(out, "ERROR"))


def test_hidden_size_mismatch(capsys, check_pair):
    edit(check_pair[1], target_hidden_size=80)
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    errs = "\n".join(lines(out, "ERROR"))
    assert "3 x 80 = 240" in errs and "target's hidden size 64 gives 192" in errs
    # The checkpoint's fc.weight still is [64, 192]: the header check says so too.
    assert "fc.weight is [64, 192] in the checkpoint but config.json implies [64, 240]" in errs


def test_fc_header_disagrees_with_config(capsys, check_pair):
    retag(check_pair[1], **{"fc.weight": ("F32", (64, 128))})
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    (err,) = [ln for ln in lines(out, "ERROR") if "fc.weight" in ln]
    assert "fc.weight is [64, 128] in the checkpoint but config.json implies [64, 192]" in err


def test_lm_head_and_d2t_must_match_draft_vocab(capsys, check_pair):
    edit(check_pair[1], draft_vocab_size=40)
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    errs = "\n".join(lines(out, "ERROR"))
    assert "lm_head.weight is [48, 64] in the checkpoint but config.json implies [40, 64]" in errs
    assert "d2t is [48]" in errs


def test_aux_layer_ids_out_of_range(capsys, check_pair):
    edit(check_pair[1], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 8]})
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    (err,) = [ln for ln in lines(out, "ERROR") if "aux" in ln]
    assert "[1, 4, 8]" in err and "[2, 5, 9]" in err and "0..8" in err and "sglang" in err
    assert "they fit under --aux-layer-convention vllm" in err
    # Read as vLLM does (captured as listed), the same ids fit.
    rc, out = run_pair(capsys, check_pair, "--aux-layer-convention", "vllm")
    assert rc == 0, out
    assert "captures the inputs of target layers [1, 4, 8] of 0..8" in out


def test_aux_layer_ids_need_three(capsys, check_pair):
    edit(check_pair[1], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4]})
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    assert any("has 2 ids; EAGLE-3's fc takes exactly 3" in ln for ln in lines(out, "ERROR"))


def test_tokenizer_vocabularies_compared(capsys, check_pair):
    target, draft = check_pair
    write_tokenizer(draft / "tokenizer.json", VOCAB)
    rc, out = run_pair(capsys, check_pair)
    assert rc == 0 and "drafter tokenizer.json matches the target's (96 tokens)" in out
    swapped = dict(VOCAB, t5=6, t6=5)
    write_tokenizer(draft / "tokenizer.json", swapped)
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    (err,) = [ln for ln in lines(out, "ERROR") if "tokenizer" in ln]
    assert "2 tokens differ" in err
    assert "'t5': target id 5, drafter id 6" in err and "'t6': target id 6, drafter id 5" in err


def test_target_tokenizer_larger_than_model_vocab(capsys, check_pair):
    write_tokenizer(check_pair[0] / "tokenizer.json", {f"t{i}": i for i in range(100)})
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    assert any("token ids up to 99 but the model's vocab_size is 96" in ln for ln in lines(out, "ERROR"))


def test_dtype_mismatch_is_a_warning(capsys, check_pair):
    edit(check_pair[1], torch_dtype="bfloat16")
    rc, out = run_pair(capsys, check_pair)
    assert rc == 0, out
    assert any("drafter dtype bfloat16 differs from the target's float32" in ln for ln in lines(out, "WARNING"))


def test_unsupported_weight_dtype_is_an_error(capsys, check_pair):
    retag(check_pair[1], **{"fc.weight": ("F8_E4M3", (64, 192))})
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    assert any("unsupported dtypes: F8_E4M3 (fc.weight)" in ln for ln in lines(out, "ERROR"))


def test_quantized_target_config(capsys, check_pair):
    edit(check_pair[0], quantization_config={"quant_method": "fp8"})
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    assert any("quant_method 'fp8'" in ln for ln in lines(out, "ERROR"))


# ----------------------------------------------------- the 131072 / 262144 story
def test_draft_positions_story(capsys, check_pair):
    target, draft = check_pair
    edit(target, max_position_embeddings=262144)
    edit(draft, max_position_embeddings=131072)
    small = ("--max-num-seqs", "1")
    # Serving the target's full context: refused, naming both numbers and both ways out.
    rc, out = run_pair(capsys, check_pair, "--max-model-len", "262144", *small)
    assert rc == 1
    (err,) = [ln for ln in lines(out, "ERROR") if "max_position_embeddings" in ln]
    assert "context length 262144" in err and "max_position_embeddings 131072" in err
    assert "--max-model-len 131072" in err and "--allow-draft-position-extension" in err
    # Way out 1: allow extension -> a warning instead.
    rc, out = run_pair(capsys, check_pair, "--max-model-len", "262144", "--allow-draft-position-extension", *small)
    assert rc == 0, out
    assert any("drafting continues past 131072" in ln for ln in lines(out, "WARNING"))
    # Way out 2: cap the served length at the drafter's limit.
    rc, out = run_pair(capsys, check_pair, "--max-model-len", "131072", *small)
    assert rc == 0, out
    # Merely differing limits are fine: the default served length (1024 on CPU) is within both.
    rc, out = run_pair(capsys, check_pair)
    assert rc == 0, out
    assert "context length 1024 (default" in out


def test_eagle3_2048_drafter_against_cuda_default(check_pair, fake_gpus):
    """A typical EAGLE-3 drafter (2048) under the CUDA default length (4096) is refused."""
    target, draft = check_pair
    edit(target, max_position_embeddings=262144)
    edit(draft, max_position_embeddings=2048)
    fake_gpus((0, 140000))
    found = check.run_checks(str(target), str(draft), device="auto", max_num_seqs=4)
    (err,) = [f for f in found if f.code == "draft_positions"]
    assert err.level == "error" and err.data == {"served": 4096, "draft_max": 2048, "target_max": 262144}
    found = check.run_checks(str(target), str(draft), device="auto", max_num_seqs=4, max_model_len=2048)
    assert not check.has_errors(found), check.format_report(found)


# ------------------------------------------------------------------------- TP
def test_tp_divisibility_names_what_does_not_divide(capsys, check_pair):
    rc, out = run_pair(capsys, check_pair, "--tp", "3")
    assert rc == 1
    (err,) = [ln for ln in lines(out, "ERROR") if ln.startswith("ERROR: --tp 3")]
    assert "num_attention_heads 4" in err and "num_key_value_heads 2" in err and "intermediate_size 128" in err
    assert "vocab_size" not in err  # 96 divides by 3
    found = check.run_checks(str(check_pair[0]), str(check_pair[1]), tp=2, device="cpu")
    assert [f.level for f in found if f.code == "tp"] == ["ok"]


# --------------------------------------------------------------------- memory
def test_a_driver_without_nvidia_ml_py_is_judged_as_a_gpu(check_pair, monkeypatch):
    """On a GPU machine without the `ops` extra (no pynvml), `auto` still means CUDA: the memory
    checks are skipped with a warning naming the extra, never run against the host's RAM."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(nvml, "query", lambda processes=True: nvml.GpuQuery(False, "pynvml not importable"))
    monkeypatch.setattr(nvml, "driver_without_package", lambda: True)
    found = check.run_checks(str(check_pair[0]), str(check_pair[1]), device="auto", max_num_seqs=4)
    (warn,) = [f for f in found if f.code == "device"]
    assert warn.level == "warning" and "pip install 'specserve[ops]'" in warn.message
    assert not [f for f in found if f.code == "kv_capacity"]  # the CPU's RAM was not consulted
    monkeypatch.setattr(nvml, "driver_without_package", lambda: False)  # no driver: the CPU, as before
    assert not [
        f for f in check.run_checks(str(check_pair[0]), str(check_pair[1]), device="auto") if f.code == "device"
    ]


def test_memory_fits(check_pair, fake_gpus):
    fake_gpus((500, 81920))
    found = check.run_checks(str(check_pair[0]), str(check_pair[1]), device="auto")
    mem = [f for f in found if f.code == "memory"]
    assert [f.level for f in mem] == ["ok"] and "GPU 0 (FakeGPU)" in mem[0].message
    assert not check.has_errors(found)


def test_memory_too_small_suggests_what_fits(check_pair, fake_gpus):
    fake_gpus((0, 4096))  # 4 GiB GPU: usable 0.9 * 4 GiB = 3.6 GiB
    found = check.run_checks(
        str(check_pair[0]), str(check_pair[1]), device="auto", max_num_seqs=4000, max_model_len=512
    )
    (err,) = [f for f in found if f.code == "memory"]
    assert err.level == "error" and "GPU 0 (FakeGPU)" in err.message
    fit = err.data["max_num_seqs_fit"]
    assert 1 <= fit < 4000 and f"lower --max-num-seqs to {fit}" in err.message
    ok = check.run_checks(str(check_pair[0]), str(check_pair[1]), device="auto", max_num_seqs=fit, max_model_len=512)
    assert not check.has_errors(ok), check.format_report(ok)
    bad = check.run_checks(
        str(check_pair[0]), str(check_pair[1]), device="auto", max_num_seqs=fit + 1, max_model_len=512
    )
    assert check.has_errors(bad)


def test_memory_names_how_many_gpus_the_model_needs(check_pair, fake_gpus, monkeypatch):
    monkeypatch.setattr(check, "OVERHEAD_BYTES", 0)  # else the fixed allowance, the same on every GPU, dominates
    fake_gpus((0, 81920))
    run = dict(device="auto", max_num_seqs=1, max_model_len=512)
    total = {
        tp: next(
            f
            for f in check.run_checks(str(check_pair[0]), str(check_pair[1]), tp=tp, **run)
            if f.code == "memory_estimate"
        ).data["total"]
        for tp in (1, 2)
    }
    assert total[2] < total[1]
    fake_gpus((0, (total[1] + total[2]) / 2 / 0.9 / 2**20))  # room for TP 2's share, not for the whole model
    (err,) = [f for f in check.run_checks(str(check_pair[0]), str(check_pair[1]), **run) if f.code == "memory"]
    assert err.level == "error" and err.data["gpus_needed"] == 2
    assert "it needs at least 2 GPUs of this size (--tp 2)" in err.message


def test_memory_busy_gpu_and_visible_devices(check_pair, fake_gpus, monkeypatch):
    fake_gpus((0, 81920), (81000, 81920))  # GPU 1 almost full (another process)
    assert not check.has_errors(check.run_checks(str(check_pair[0]), device="auto"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    found = check.run_checks(str(check_pair[0]), device="auto")
    (err,) = [f for f in found if f.level == "error"]
    assert "GPU 1" in err.message and "weights and overhead alone do not fit" in err.message
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    found = check.run_checks(str(check_pair[0]), device="auto", tp=2)
    assert [f.data["gpu"] for f in found if f.code == "memory"] == [0, 1]
    found = check.run_checks(str(check_pair[0]), device="cuda:1", tp=2)
    assert any("TP workers use cuda:0..cuda:1" in f.message for f in found if f.level == "error")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-1")  # UUIDs select too
    found = check.run_checks(str(check_pair[0]), device="auto")
    assert [f.data["gpu"] for f in found if f.code == "memory"] == [1]


def test_tp_needs_enough_gpus(capsys, check_pair, fake_gpus):
    fake_gpus((0, 81920))
    rc, out = cli(capsys, "--model", str(check_pair[0]), "--tp", "2")
    assert rc == 1
    assert "ERROR: --tp 2 needs 2 GPUs; 1 visible" in out
    # Spread over two machines, each needs tp / nnodes GPUs.
    rc, out = cli(capsys, "--model", str(check_pair[0]), "--tp", "2", "--nnodes", "2", "--dist-init-addr", "h:29500")
    assert rc == 0 and "GPUs; " not in out
    rc, out = cli(capsys, "--model", str(check_pair[0]), "--tp", "4", "--nnodes", "2", "--dist-init-addr", "h:29500")
    assert rc == 1 and "ERROR: --tp 4 needs 2 GPUs on each of the 2 nodes; 1 visible" in out


def test_memory_cli_error_line(capsys, check_pair, fake_gpus):
    fake_gpus((81000, 81920))
    rc, out = cli(
        capsys, "--model", str(check_pair[0]), "--draft", str(check_pair[1]), "--gpu-memory-utilization", "0.95"
    )
    assert rc == 1
    (err,) = [ln for ln in lines(out, "ERROR")]
    assert err.startswith("ERROR: GPU 0 (FakeGPU): needs ~") and "--gpu-memory-utilization 0.95" in err


# --------------------------------------------------------------- missing files
def test_missing_config(capsys, tmp_path):
    rc, out = cli(capsys, "--model", str(tmp_path), "--device", "cpu")
    assert rc == 1
    assert "config.json not found" in out and "has no tokenizer.json" in out


def test_pickle_only_weights(capsys, check_pair):
    target = check_pair[0]
    (target / "model.safetensors").rename(target / "pytorch_model.bin")
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1
    assert any(
        "only pickle checkpoints (pytorch_model.bin)" in ln and "--allow-pickle" in ln for ln in lines(out, "ERROR")
    )
    rc, out = run_pair(capsys, check_pair, "--allow-pickle")
    assert rc == 0, out
    assert any("pickle" in ln for ln in lines(out, "WARNING"))


def test_no_weights_and_missing_shard(capsys, check_pair):
    target, draft = check_pair
    (draft / "model.safetensors").unlink()
    rc, out = run_pair(capsys, check_pair)
    assert rc == 1 and "has no weights" in out
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    rc, out = cli(capsys, "--model", str(target), "--device", "cpu")
    assert rc == 1 and "lists shard(s) that do not exist: model-00002.safetensors" in out


def test_truncated_safetensors(capsys, check_pair):
    st = check_pair[0] / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) - 100])
    rc, out = cli(capsys, "--model", str(check_pair[0]), "--device", "cpu")
    assert rc == 1 and "is truncated" in out
    st.write_bytes(b"\xff" * 16)
    rc, out = cli(capsys, "--model", str(check_pair[0]), "--device", "cpu")
    assert rc == 1 and "not a valid safetensors file" in out


def test_bad_settings(capsys, check_pair):
    rc, out = run_pair(capsys, check_pair, "--gpu-memory-utilization", "1.5")
    assert rc == 1 and "--gpu-memory-utilization must be in (0, 1]" in out
    rc, out = run_pair(capsys, check_pair, "--max-model-len", "4096")
    assert rc == 1 and "--max-model-len 4096 exceeds the target's max_position_embeddings 512" in out


# ------------------------------------------------- agreement with the engine
def test_dtype_rules_match_the_loader():
    import torch

    from specserve.model import loader

    for cfg_dtype in ("float32", "bfloat16", "float16", "float8_e4m3fn"):
        for dev in ("cpu", "cuda"):
            for asked in ("auto", "float32", "float16", "bfloat16"):
                ours = check._compute_dtype(asked, cfg_dtype, dev)
                theirs = loader.resolve_dtype(asked, cfg_dtype, torch.device(dev))
                assert loader.DTYPES[ours] == theirs


@pytest.mark.slow
@pytest.mark.parametrize("tree", [{}, {"spec_topk": 4, "spec_tokens": 40}])
def test_estimate_matches_what_the_engine_allocates(check_pair, tree):
    """KV bytes and target weight bytes equal the real runner's on CPU (tiny pair), with a chain
    and with a tree (whose cache keeps room for its verify nodes)."""
    from specserve.config import EngineConfig
    from specserve.engine.runner import ModelRunner

    target, draft = check_pair
    cfg = EngineConfig(
        model=str(target),
        draft=str(draft),
        device="cpu",
        spec_steps=3,
        max_num_seqs=3,
        max_model_len=100,
        cuda_graphs=False,
        **tree,
    )
    runner = ModelRunner(cfg)
    found = check.run_checks(
        str(target),
        str(draft),
        device="cpu",
        spec_steps=3,
        max_num_seqs=3,
        max_model_len=100,
        cuda_graphs=False,
        **tree,
    )
    est = next(f for f in found if f.code == "memory_estimate").data
    assert est["kv"] == runner.kv.nbytes()
    assert est["cache_len"] == runner.cache_len
    target_bytes = sum(p.numel() * p.element_size() for p in runner.target.parameters())
    # The drafter borrows the target's embedding (a submodule it does not own) and holds d2t/t2d as buffers.
    drafter_bytes = sum(
        p.numel() * p.element_size()
        for n, p in runner.drafter.named_parameters(remove_duplicate=False)
        if not n.startswith("target_embed.")
    )
    drafter_bytes += sum(b.numel() * b.element_size() for n, b in runner.drafter.named_buffers() if n in ("d2t", "t2d"))
    assert est["weights"] == target_bytes + drafter_bytes


@pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").exists(), reason="demo target not built yet")
def test_demo_pair_passes(capsys):
    rc, out = cli(capsys, "--device", "cpu")  # no --model: the bundled demo pair
    assert rc == 0, out


@pytest.mark.gpu
def test_estimate_bounds_real_gpu_memory(tmp_path):
    """On a real GPU: the check passes, and its per-device estimate covers what the engine
    really takes (weights, KV, CUDA graphs, verify buffers) for a vocab-32000 model.
    Prints both numbers: they calibrate OVERHEAD_BYTES."""
    import torch

    from specserve.engine.llm import LLM, SamplingParams

    target = make_target(tmp_path / "t", vocab=32000, hidden=512, layers=6, heads=8, kv_heads=4)
    write_tokenizer(target / "tokenizer.json", {f"t{i}": i for i in range(32000)})
    draft = make_drafter(tmp_path / "d", target, layout="sglang", draft_vocab=8000, aux_ids=[1, 2, 2])
    kw = dict(spec_steps=4, max_num_seqs=32, max_model_len=512)
    found = check.run_checks(str(target), str(draft), device="cuda", **kw)
    print(check.format_report(found))
    assert not check.has_errors(found)
    est = next(f for f in found if f.code == "memory_estimate").data
    torch.cuda.init()
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()  # after the CUDA context exists
    llm = LLM(model=str(target), draft=str(draft), device="cuda", **kw)
    llm.generate([[1, 2, 3, 4, 5]] * 32, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    used = free0 - free1
    print(
        f"measured {used / 2**20:.0f} MiB (without the CUDA context), estimated {est['total'] / 2**20:.0f} MiB "
        f"(weights {est['weights'] / 2**20:.0f}, KV {est['kv'] / 2**20:.0f}, other {est['other'] / 2**20:.0f})"
    )
    assert used > est["weights"] + est["kv"]  # the measurement sees the real allocations
    assert est["total"] >= used
