"""Paged KV: block tables equal one block per row, prefix caching equals recomputing, eviction,
preemption by recompute, and the pool's bookkeeping when idle."""

from __future__ import annotations

import random

import pytest

from specserve.config import ConfigError, EngineConfig
from specserve.engine.block_pool import BlockPool
from specserve.engine.engine import Engine
from specserve.engine.sampling import SamplingParams

VOCAB = 12
MODES = {"plain": {}, "chain": dict(spec_steps=3), "tree": dict(spec_steps=3, spec_topk=3, spec_tree_max_batch=8)}


def _engine(small_pair, mode, **kw):
    target, draft = small_pair
    kw.setdefault("max_model_len", 128)
    kw.setdefault("device", "cpu")
    return Engine(EngineConfig(model=str(target), draft=str(draft) if mode != "plain" else None, **MODES[mode], **kw))


def _drain(engine, prompts, params, waves=1):
    """Submit the prompts in `waves` groups, each run to completion before the next."""
    seqs, n = [], -(-len(prompts) // waves)
    for w in range(waves):
        seqs += [engine.add_request(p, sp) for p, sp in zip(prompts[w * n : (w + 1) * n], params[w * n : (w + 1) * n])]
        while engine.has_work():
            engine.step()
    engine.check_idle_integrity()
    return [s.output_ids for s in seqs]


def _prompts(n, seed, lo=1, hi=60):
    g = random.Random(seed)
    return [[g.randrange(VOCAB - 1) for _ in range(g.randrange(lo, hi))] for _ in range(n)]


def _params(n, max_tokens=30):
    """Greedy and seeded sampled requests side by side."""
    kinds = [
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.9, max_tokens=max_tokens, seed=5, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=max_tokens, seed=17, ignore_eos=True),
    ]
    return [kinds[i % 3] for i in range(n)]


@pytest.mark.parametrize("mode", list(MODES))
def test_small_blocks_equal_one_block_per_row(small_pair, mode):
    """Blocks of 4 tokens (many per sequence, every step crossing block edges somewhere) give the
    tokens of one block per sequence (the layout of a slot cache), batch 1 and 8, mixed lengths,
    greedy and seeded sampling."""
    for batch in (1, 8):
        prompts = _prompts(batch, seed=batch)
        params = _params(batch)
        slot = _drain(_engine(small_pair, mode, max_num_seqs=batch, kv_block_size=256), prompts, params)
        paged_engine = _engine(small_pair, mode, max_num_seqs=batch, kv_block_size=4)
        assert paged_engine.runner.kv.max_blocks > 8
        assert _drain(paged_engine, prompts, params) == slot, (mode, batch)


@pytest.mark.parametrize("mode", list(MODES))
def test_prefix_cache_on_equals_off(small_pair, mode):
    """Requests sharing a 40-token prefix (and one repeating a prompt exactly): with the prefix
    cache, the later ones skip the shared blocks (target and drafter) and still emit the same tokens."""
    shared = _prompts(1, seed=3, lo=40, hi=41)[0]
    prompts = [shared + t for t in _prompts(5, seed=4, lo=1, hi=20)] + [shared + [1]]
    prompts.append(prompts[0])
    params = _params(len(prompts))
    off = _drain(_engine(small_pair, mode, max_num_seqs=4, kv_block_size=8), prompts, params, waves=2)
    engine = _engine(small_pair, mode, max_num_seqs=4, kv_block_size=8, prefix_cache=True)
    on = _drain(engine, prompts, params, waves=2)
    assert on == off
    kv = engine.kv_usage()
    # the second wave's three requests find the shared prefix's whole blocks (a block's key holds
    # the token after it, so the prefix's last block serves shared + [1] only if a first-wave prompt went on with 1)
    assert kv["prefix_hit_tokens"] >= 3 * 40 - 8 and kv["prefix_queried_tokens"] == sum(map(len, prompts))
    if mode != "plain":
        assert engine.totals.accepted > 0


def test_hit_rate_is_the_same_with_speculation(small_pair):
    shared = _prompts(1, seed=8, lo=50, hi=51)[0]
    prompts = [shared + t for t in _prompts(8, seed=9, lo=1, hi=10)]
    params = _params(len(prompts), max_tokens=10)
    hits = []
    for mode in MODES:
        engine = _engine(small_pair, mode, max_num_seqs=2, kv_block_size=8, prefix_cache=True)
        _drain(engine, prompts, params, waves=4)
        hits.append(engine.kv_usage()["prefix_hit_tokens"])
    assert hits[0] > 0 and len(set(hits)) == 1, hits


def test_eviction_under_pressure(small_pair):
    """A pool too small to keep every prefix: cached blocks are evicted (least recently used) and
    a later hit still finds only valid blocks."""
    prompts = _prompts(12, seed=11, lo=30, hi=60)
    prompts += prompts[:3]  # come back to early prefixes after the pool has turned over
    params = _params(len(prompts), max_tokens=12)
    kw = dict(max_num_seqs=2, kv_block_size=8, max_model_len=96, kv_cache_tokens=256)
    off = _drain(_engine(small_pair, "chain", **kw), prompts, params, waves=len(prompts))
    engine = _engine(small_pair, "chain", prefix_cache=True, **kw)
    assert _drain(engine, prompts, params, waves=len(prompts)) == off
    kv = engine.kv_usage()
    assert kv["prefix_evictions"] > 0 and kv["blocks_total"] == 32


@pytest.mark.parametrize("mode", list(MODES))
def test_preemption_recomputes_and_continues_exactly(small_pair, mode):
    """Four long generations in a pool that holds about two: sequences are preempted mid-decode,
    recomputed later, and every one emits the tokens it emits with room to spare."""
    prompts = _prompts(4, seed=13, lo=5, hi=15)
    params = _params(4, max_tokens=45)
    roomy = _drain(_engine(small_pair, mode, max_num_seqs=4, kv_block_size=8, max_model_len=64), prompts, params)
    engine = _engine(
        small_pair, mode, max_num_seqs=4, kv_block_size=8, max_model_len=64, kv_cache_tokens=96, prefix_cache=True
    )
    assert _drain(engine, prompts, params) == roomy
    assert engine.kv_usage()["preemptions"] > 0


def test_random_workload_leaves_the_pool_whole(small_pair):
    """Random arrivals, lengths, aborts and sampling over a small pool with prefix caching: when
    idle no block is referenced and every block is free or cached exactly once (checked by
    check_idle_integrity), and the table points nowhere."""
    g = random.Random(21)
    engine = _engine(
        small_pair, "chain", max_num_seqs=3, kv_block_size=4, max_model_len=64, kv_cache_tokens=160, prefix_cache=True
    )
    base = _prompts(3, seed=22, lo=8, hi=20)
    live = []
    for step in range(120):
        if g.random() < 0.3:
            p = g.choice(base)[: g.randrange(1, 20)] + _prompts(1, seed=step, lo=1, hi=12)[0]
            live.append(engine.add_request(p, _params(3, max_tokens=g.randrange(1, 30))[step % 3]))
        if live and g.random() < 0.05:
            engine.abort(g.choice(live).seq_id)
        if engine.has_work():
            engine.step()
    while engine.has_work():
        engine.step()
    engine.check_idle_integrity()
    kv = engine.kv_usage()
    assert kv["blocks_used"] == 0 and kv["prefix_hit_tokens"] > 0


def test_block_pool_keys_refcounts_and_lru():
    pool = BlockPool(num_blocks=6, block_size=2, prefix_cache=True)
    a = pool.allocate(3)
    tokens = [1, 2, 3, 4, 5, 6]
    pool.register(a, tokens)
    # whole blocks followed by a token: [1,2] (next 3) and [3,4] (next 5); [5,6] has no next token
    assert pool.match(tokens) == a[:2] and pool.match([1, 2, 3, 4, 9]) == a[:1]
    assert pool.match([1, 2, 3, 4]) == a[:1]  # the block [3,4] is keyed with its next token 5
    assert pool.match([7, 2, 3]) == []
    pool.release(a)
    assert pool.available() == 5 and len(pool.evictable) == 2
    pool.acquire(pool.match(tokens))
    assert pool.refs[a[0]] == 1 and len(pool.evictable) == 0
    pool.release(a[:2])
    b = pool.allocate(4)  # 3 free, then the least recently used cached block: the tail [3,4]
    assert a[1] in b and a[0] not in b and pool.evictions == 1
    assert pool.match(tokens) == a[:1]
    pool.release(b)
    pool.check_idle()
    with pytest.raises(AssertionError):
        pool.release([b[0]])


def test_pool_sizes_are_checked(small_pair):
    target, _ = small_pair
    with pytest.raises(ConfigError, match="less than one sequence"):
        Engine(EngineConfig(model=str(target), device="cpu", max_model_len=128, kv_cache_tokens=64))
    with pytest.raises(ConfigError, match="on CPU use --kv-cache-tokens"):
        Engine(EngineConfig(model=str(target), device="cpu", gpu_memory_utilization=0.5))
    with pytest.raises(ConfigError, match="not both"):
        EngineConfig(model=str(target), kv_cache_tokens=4096, gpu_memory_utilization=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_paged_kernels_on_gpu(small_pair, mode):
    """CUDA graphs and the Triton kernels reading block tables (bfloat16): blocks of 4 tokens emit
    one block per row's tokens, and the prefix cache changes nothing."""
    prompts = _prompts(8, seed=31)
    params = _params(8)
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=8)
    slot = _drain(_engine(small_pair, mode, kv_block_size=256, **kw), prompts, params)
    assert _drain(_engine(small_pair, mode, kv_block_size=4, **kw), prompts, params) == slot
    shared = _prompts(1, seed=3, lo=40, hi=41)[0]
    prompts = [shared + t for t in _prompts(6, seed=4, lo=1, hi=20)]
    off = _drain(_engine(small_pair, mode, kv_block_size=8, **kw), prompts, params[:6], waves=2)
    engine = _engine(small_pair, mode, kv_block_size=8, prefix_cache=True, **kw)
    assert _drain(engine, prompts, params[:6], waves=2) == off
    assert engine.kv_usage()["prefix_hit_tokens"] > 0


def _count_prefill_chunks(engine) -> list[int]:
    real, n = engine._prefill_chunk, [0]

    def counted():
        n[0] += 1
        return real()

    engine._prefill_chunk = counted
    return n


@pytest.mark.parametrize("mode", ["plain", "chain"])
def test_admit_wait_prefills_freed_rows_together_and_changes_no_output(small_pair, mode):
    """Twelve requests through four rows, ending at different steps: with --admit-wait the rows they free
    are refilled in fewer prefill chunks, and every request emits the same tokens (greedy and seeded)."""
    prompts = _prompts(12, seed=21, lo=3, hi=12)
    kinds = _params(12)
    params = [
        SamplingParams(
            temperature=k.temperature, top_p=k.top_p, seed=k.seed, max_tokens=4 + 3 * (i % 5), ignore_eos=True
        )
        for i, k in enumerate(kinds)
    ]
    at_once = _engine(small_pair, mode, max_num_seqs=4)
    chunks_at_once = _count_prefill_chunks(at_once)
    want = _drain(at_once, prompts, params)
    together = _engine(small_pair, mode, max_num_seqs=4, admit_wait=6)
    chunks_together = _count_prefill_chunks(together)
    assert _drain(together, prompts, params) == want
    assert chunks_together[0] < chunks_at_once[0], (chunks_together, chunks_at_once)


def test_admit_wait_bounds_the_wait_and_never_holds_an_idle_engine(small_pair):
    """A lone arrival while another request decodes waits exactly --admit-wait steps once a row is free for
    it; with nothing decoding, arrivals start at once; a whole prefill chunk's worth starts at once too."""
    engine = _engine(small_pair, "plain", max_num_seqs=4, admit_wait=3, prefill_chunk=20)
    first = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    assert first.output_ids  # nothing decoded before it: admitted and prefilled at once
    late = engine.add_request([4, 5], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    waited = 0
    while not late.output_ids:
        engine.step()
        waited += 1
    assert waited == 4  # three steps held back, the fourth lets it in (its first token comes from that prefill)
    big = engine.add_request(list(range(1, 11)) * 2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()
    assert big.output_ids  # its 20 prompt tokens fill a prefill chunk: no reason to wait
    with pytest.raises(ConfigError, match="--admit-wait"):
        EngineConfig(model=str(small_pair[0]), admit_wait=-1)


def _preemptions_per_sequence(engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    preempt = engine.scheduler.preempt

    def counted(seq):
        counts[seq.seq_id] = counts.get(seq.seq_id, 0) + 1
        preempt(seq)

    engine.scheduler.preempt = counted
    return counts


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_preemption_hysteresis_and_speculation_keep_plain_output(small_pair, mode, monkeypatch):
    """Eight long generations in a pool that holds about three: with speculation every sequence
    emits exactly what plain decoding emits with room to spare, and the hysteresis after a
    preemption (engine.scheduler) preempts less than readmitting as soon as blocks free up."""
    from specserve.engine import scheduler

    prompts = _prompts(8, seed=13, lo=5, hi=15)
    params = _params(8, max_tokens=45)
    plain = _drain(_engine(small_pair, "plain", max_num_seqs=8, kv_block_size=8, max_model_len=64), prompts, params)
    kw = dict(max_num_seqs=8, kv_block_size=8, max_model_len=64, kv_cache_tokens=128)
    engine = _engine(small_pair, mode, **kw)
    counts = _preemptions_per_sequence(engine)
    assert _drain(engine, prompts, params) == plain
    monkeypatch.setattr(scheduler, "CAUTION_STEPS", 1e-9)  # no hysteresis: readmitted once blocks are free
    eager = _engine(small_pair, mode, **kw)
    eager_counts = _preemptions_per_sequence(eager)
    assert _drain(eager, prompts, params) == plain
    assert 0 < sum(counts.values()) < sum(eager_counts.values()), (counts, eager_counts)


def test_a_request_larger_than_the_free_pool_waits_and_finishes(small_pair):
    """Two requests near --max-model-len in a pool that holds about one and a half: the second
    waits while the first runs (or is preempted), and both emit what they emit with room to spare.
    (A request larger than the whole pool cannot arrive: the pool holds at least one sequence of
    --max-model-len, test_pool_sizes_are_checked, and longer prompts are refused at admission.)"""
    prompts = _prompts(2, seed=21, lo=38, hi=42)
    params = _params(2, max_tokens=20)
    roomy = _drain(_engine(small_pair, "chain", max_num_seqs=2, kv_block_size=8, max_model_len=64), prompts, params)
    engine = _engine(small_pair, "chain", max_num_seqs=2, kv_block_size=8, max_model_len=64, kv_cache_tokens=96)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    waited = False
    while engine.has_work():
        engine.step()
        waited |= bool(engine.waiting) and engine.n_running + engine.n_prefill == 1
    engine.check_idle_integrity()
    assert waited and [s.output_ids for s in seqs] == roomy
    with pytest.raises(ValueError, match="prompt has 64 tokens; max_model_len is 64"):
        engine.add_request([1] * 64, params[0])
