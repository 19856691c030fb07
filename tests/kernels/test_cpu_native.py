"""The native CPU kernels (specserve/kernels/cpu_native.py) against torch, the tuner's choice
among MKL, oneDNN and the panel GEMV, and the torch path where the kernels cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import cpu_linear, cpu_native, norm
from specserve.kernels import linear as linear_k
from specserve.model.layers import ForwardContext, KVCacheAttention, RotaryEmbedding


@pytest.fixture(scope="module")
def ops():
    module = cpu_native.ops()  # built once per machine (torch's extension cache), loaded once per session
    if module is None:
        pytest.skip("the native CPU kernels cannot be built here")
    return module


@pytest.fixture
def no_native(monkeypatch):
    """A machine where the build fails: `ops()` must report it and every caller keep torch's path."""

    def fail():
        raise RuntimeError("Error building extension 'specserve_cpu_kernels'")

    monkeypatch.setattr(cpu_native, "_build", fail)
    monkeypatch.setattr(cpu_native, "_state", {})


@pytest.mark.parametrize("n,k", [(37, 13), (16, 16), (100, 577), (960, 576), (200, 1536)])
def test_panel_linear_equals_f_linear(ops, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    panels = cpu_native.pack_panels(cpu_linear.column_major_copy(w))  # (the layout the runner stores)
    assert panels.shape == (-(-n // 16), k, 16)
    b = torch.randn(n, generator=g)
    for rows in list(range(1, 13)) + [40]:
        x = torch.randn(rows, k, generator=g)
        torch.testing.assert_close(ops.panel_linear(x, panels, n, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ops.panel_linear(x, panels, n, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_panel_linear_rejects_bad_input(ops):
    w = torch.randn(40, 24)
    panels = cpu_native.pack_panels(w)
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.panel_linear(torch.randn(24, 3).t(), panels, 40, None)
    with pytest.raises(RuntimeError, match="panels must be"):
        ops.panel_linear(torch.randn(2, 25), panels, 40, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.panel_linear(torch.randn(2, 24, dtype=torch.float64), panels, 40, None)


def test_tuned_linear_takes_each_kernel_and_equals_f_linear(ops, monkeypatch):
    """With timings that make the panel GEMV win at 1-2 rows, oneDNN at 4-8 and MKL beyond, `linear`
    routes each row count there (3 rows: 4's choice) and equals F.linear everywhere, with bias and
    for a non-contiguous input."""
    g = torch.Generator().manual_seed(3)
    w = cpu_linear.column_major_copy(torch.randn(70, 48, generator=g))
    fake = {1: (3, 2, 1), 2: (3, 2, 1), 4: (3, 1, 2), 8: (3, 1, 2), 16: (1, 2), 64: (1, 2)}
    times = iter(t for rows in cpu_linear.CPU_ROWS for t in fake[rows])  # (MKL, oneDNN[, native]) per count
    monkeypatch.setattr(cpu_linear, "_cpu_us", lambda fn, reps=20: next(times))
    cpu_linear.tune_linear_cpu([w])
    plan = w.cpu_plan
    assert [plan.by_rows[r] for r in (1, 2, 3, 4, 8, 9, 64)] == [
        "native",
        "native",
        "onednn",
        "onednn",
        "onednn",
        "mkl",
        "mkl",
    ]
    assert plan.panels is not None and plan.packed is not None
    b = torch.randn(70, generator=g)
    for rows in (1, 2, 3, 5, 9, 64):
        x = torch.randn(2, rows, 48, generator=g)
        torch.testing.assert_close(linear_k.linear(x[:1], w), F.linear(x[:1], w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear_k.linear(x[:1], w, b), F.linear(x[:1], w, b), rtol=1e-5, atol=1e-5)
    x = torch.randn(48, 2, generator=g).t()  # rows of stride 1, elements of stride 2
    torch.testing.assert_close(linear_k.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [576, 13])
def test_add_rms_norm_matches_the_reference(ops, n):
    g = torch.Generator().manual_seed(n)
    x, res, w = torch.randn(3, n, generator=g), torch.randn(3, n, generator=g), torch.randn(n, generator=g)
    with torch.inference_mode():
        y, total = norm.rms_norm(x, w, 1e-5, res)
        alone = norm.rms_norm(x, w, 1e-5)
    assert torch.equal(total, x + res)
    torch.testing.assert_close(y, norm.rms_norm_ref(x + res, w, 1e-5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone, norm.rms_norm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-6)


def test_silu_mul_matches_the_reference(ops):
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(2, 2 * 1539, generator=g) * 8  # (odd width: the scalar tail too)
    gate_up[0, :6] = torch.tensor([-100.0, -88.0, -30.0, 0.0, 30.0, 100.0])
    with torch.inference_mode():
        got = norm.silu_mul(gate_up)
    torch.testing.assert_close(got, norm.silu_mul_ref(gate_up), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("paged", [False, True])
def test_forward_packed_matches_the_torch_path(ops, paged, monkeypatch):
    """forward_packed with the kernels (rope + KV write in place, attention over the cache) against
    the torch ops: two rows of different lengths, three tokens each, the last of row 0 a padding
    token writing to the scratch slot; the same output, caches and (v untouched) heads."""
    H, Hkv, D, T, bs = 6, 2, 64, 3, 4
    rope = RotaryEmbedding(D, 64, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    heads = torch.randn(2, T, H + 2 * Hkv, D, generator=g)
    write_idx = torch.tensor([[4, 5, 15], [9, 10, 11]])  # 15: the scratch slot past max_model_len
    positions = torch.tensor([[4, 5, 0], [9, 10, 11]])
    if paged:
        table = torch.tensor([[6, 1, 3, 8], [2, 7, 5, 4]])
        shape = (9, Hkv, bs, D)
    else:
        shape = (3, Hkv, 16, D)
    caches = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(cpu_native, "_state", {"ops": None})
        attn = KVCacheAttention(H, Hkv, D)
        attn.k_cache, attn.v_cache = caches[0].clone(), caches[1].clone()
        ctx = (
            ForwardContext(0, positions, write_idx, 12, block_table=table, block_size=bs)
            if paged
            else ForwardContext(1, positions, write_idx, 12)
        )
        x = heads.clone()
        with torch.inference_mode():
            out = attn.forward_packed(x, ctx, rope)
        results.append((out[:, :2], out[1], attn.k_cache, attn.v_cache, x[:, :, H + Hkv :]))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_the_kernels_everything_keeps_torchs_path(no_native, caplog):
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.ops() is None
        assert cpu_native.ops() is None  # (asked again: decided once)
    assert [r.message for r in caplog.records if "native CPU kernels unavailable" in r.message] != []
    assert len(caplog.records) == 1 and "build failed" in caplog.records[0].message
    w = cpu_linear.column_major_copy(torch.randn(64, 32))
    report = cpu_linear.tune_linear_cpu([w])
    assert all("native" not in t for per_rows in report.values() for t in per_rows.values())
    assert w.cpu_plan is None or "native" not in w.cpu_plan.by_rows
    x, weight = torch.randn(2, 32), torch.randn(32)
    with torch.inference_mode():
        torch.testing.assert_close(linear_k.linear(x, w), F.linear(x, w))
        assert torch.equal(norm.rms_norm(x, weight, 1e-5), norm.rms_norm_ref(x, weight, 1e-5))
        gate_up = torch.randn(2, 64)
        assert torch.equal(norm.silu_mul(gate_up), norm.silu_mul_ref(gate_up))


@pytest.mark.parametrize("paged", [False, True])
def test_cache_attention_matches_sdpa(ops, paged):
    """The native attention over the cache equals SDPA over the gathered keys with the causal mask:
    two rows of different lengths, three tokens each, a paged pool with scattered blocks or a
    cache of one block per row (rows 1-2 of three)."""
    H, Hkv, D, T, bs = 6, 2, 64, 3, 4
    g = torch.Generator().manual_seed(5)
    attn = KVCacheAttention(H, Hkv, D)
    write_idx = torch.tensor([[4, 5, 6], [9, 10, 11]])
    if paged:
        table = torch.tensor([[6, 1, 3, 0], [2, 7, 5, 4]])
        shape = (8, Hkv, bs, D)
        ctx = ForwardContext(0, write_idx, write_idx, 12, block_table=table, block_size=bs)
    else:
        shape = (3, Hkv, 16, D)
        ctx = ForwardContext(1, write_idx, write_idx, 12)
    attn.k_cache, attn.v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    heads = torch.randn(2, T, H + 2 * Hkv, D, generator=g)
    want = attn._attend(heads[:, :, :H], ctx)
    got = ops.cache_attention(
        heads,
        H,
        attn.k_cache,
        attn.v_cache,
        ctx.read_blocks() if paged else None,
        ctx.row_start,
        write_idx,
        ctx.kv_len,
        attn.scale,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec_steps", [0, 3])
def test_native_layer_step_equals_the_layer_op_by_op(ops, spec_steps, monkeypatch):
    """A decode or verify step's layers in one native call each (`DecoderLayer._native_step`) give the
    tokens and log-probabilities of the same layers run op by op, for three rows of a paged batch,
    plain and speculative (verify steps of 4 rows each), and the native call is what ran. (No prefix
    cache: the second run computes its own KV.)"""
    from specserve import LLM, SamplingParams
    from specserve.model import transformer

    prompts = ["def fib(n):", "The capital of France is", "import numpy as np\n"]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True)
    llm = LLM(spec_steps=spec_steps, device="cpu", max_num_seqs=3)
    step = transformer.DecoderLayer._native_step
    ran = []
    monkeypatch.setattr(
        transformer.DecoderLayer, "_native_step", lambda self, *a: ran.append(step(self, *a)) or ran[-1]
    )
    native = llm.generate(prompts, params)
    assert ran and all(r is not None for r in ran[-len(llm.engine.runner.target.layers) :])
    monkeypatch.setattr(transformer.DecoderLayer, "_native_step", lambda self, *a: None)
    op_by_op = llm.generate(prompts, params)
    for a, b in zip(native, op_by_op):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            [t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs], rtol=1e-4, atol=1e-4
        )


def test_a_build_lock_left_by_a_killed_build_is_removed_not_waited_for(tmp_path, caplog):
    """torch's extension builder waits, silently and forever, while its directory's `lock` file exists;
    a build killed part-way leaves that file behind. Holding the OS lock that every specserve builder
    takes, such a file is a dead build's: it is removed (with a warning), and the OS lock is free again
    once the builder is done, also for a second builder."""
    import fcntl
    import os

    build = tmp_path / "specserve_cpu_kernels"
    build.mkdir()
    (build / "lock").touch()  # what a killed build leaves
    with caplog.at_level(logging.WARNING, logger="specserve.kernels.cpu_native"):
        with cpu_native.builder_lock(build):
            assert not (build / "lock").exists()
    assert any("did not finish" in r.getMessage() for r in caplog.records)
    fd = os.open(build / "specserve.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (raises if the builder still held it)
    finally:
        os.close(fd)
    with cpu_native.builder_lock(build):  # a clean directory: nothing to remove
        assert not (build / "lock").exists()
