"""Adaptive K prices a step by its batch size and its context: costs kept per context bucket."""

from types import SimpleNamespace

import pytest

from specserve.config import EngineConfig
from specserve.spec.policy import (
    CONTEXT_MIN,
    SpecPolicy,
    batch_context,
    context_bucket,
    context_buckets,
    interpolate_contexts,
    startup_contexts,
)

# A verify reads the whole latent cache: at 512 tokens a K-cycle costs little more than a plain step,
# at 128k each drafted token adds more than a plain step does.
SHORT = {(1, K): 1.0 + 0.05 * K for K in range(5)}
LONG = {(1, K): 2.0 + 3.0 * K for K in range(5)}


def _policy() -> SpecPolicy:
    p = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=4)
    p.seed_costs(SHORT, 512)
    p.seed_costs(LONG, 131072)
    return p


def test_context_buckets():
    assert [context_bucket(n) for n in (0, 1, CONTEXT_MIN, CONTEXT_MIN + 1, 500, 512, 513)] == [
        CONTEXT_MIN,
        CONTEXT_MIN,
        CONTEXT_MIN,
        2 * CONTEXT_MIN,
        512,
        512,
        1024,
    ]
    assert context_buckets(1000) == [64, 128, 256, 512, 1024]
    assert context_buckets(10) == [CONTEXT_MIN]
    rows = [SimpleNamespace(total_len=n) for n in (100, 300)]
    assert batch_context(rows) == 200 and batch_context([]) == 0
    # Where a step is cheap to time (a GPU): the shortest bucket, the longest context held and one between.
    assert startup_contexts(131071, cheap=True) == [64, 2896, 131071]
    assert startup_contexts(1000, cheap=False) == [256] and startup_contexts(100, cheap=True) == [50]


def test_k4_pays_at_short_context_and_loses_at_long_context():
    p = _policy()
    assert p.choose(1, context=500) == 4  # ~2.6 tokens per 1.2 s against 1 per 1.0 s
    assert p.choose(1, context=120_000) == 0  # ~2.6 tokens per 14 s against 1 per 2 s
    # Live timings as seeded: speculation never runs at long context (never slower than plain decoding) ...
    long_run = []
    for _ in range(200):
        K = p.choose(1, context=120_000)
        p.observe_cost(1, K, LONG[(1, K)], context=120_000)
        long_run.append(K)
    assert set(long_run) == {0}
    # ... and at short context it keeps drafting K=4.
    short_run = []
    for _ in range(200):
        K = p.choose(1, context=500)
        p.observe_cost(1, K, SHORT[(1, K)], context=500)
        short_run.append(K)
    assert short_run.count(4) > 0.9 * len(short_run)


def test_live_timings_land_in_their_context_bucket():
    p = _policy()
    p.seed_costs(SHORT, 1024)
    for _ in range(3):
        p.observe_cost(1, 4, 1.4, context=500)
    assert p.predicted_cost(1, 4, 500) == pytest.approx(1.4)  # live at 512
    # Elsewhere the seed, plus the offset of the nearest bucket that has one (0.2 s of host work that
    # start-up did not see, at 512): a bucket's live timings are not taken for another's.
    assert p.predicted_cost(1, 4, 131072) == pytest.approx(14.2)
    p.observe_cost(1, 0, 1.5, context=500)
    assert p.predicted_cost(1, 0, 1000) == pytest.approx(1.5)
    assert p.predicted_cost(1, 0, 131072) == pytest.approx(2.5)  # (the only offset of plain steps)
    assert p.predicted_cost(1, 0, 4096) is None  # neither seeded nor timed there
    snap = p.snapshot()
    assert snap["1"]["512"]["4"]["live_ms"] == pytest.approx(1400.0) and snap["1"]["512"]["4"]["timed"] == 3
    assert snap["1"]["131072"]["4"] == {"seeded_ms": 14000.0, "live_ms": None, "predicted_ms": 14200.0, "timed": 0}


def test_costs_interpolate_between_timed_contexts():
    filled = interpolate_contexts({512: SHORT, 131072: LONG}, [64, 512, 65792, 131072, 262144])
    assert filled[64] == SHORT and filled[512] == SHORT  # the nearest timed context past the ends
    assert filled[262144] == LONG
    assert filled[65792][(1, 4)] == pytest.approx((SHORT[(1, 4)] + LONG[(1, 4)]) / 2)  # linear in the context
    p = SpecPolicy(EngineConfig(model="x", adaptive=True), k_max=4)
    for c, costs in filled.items():
        p.seed_costs(costs, c)
    assert p.choose(1, context=400) == 4 and p.choose(1, context=200_000) == 0


def test_startup_times_each_context_the_pool_holds(small_pair):
    """Start-up timing at several contexts on dummy rows of their own blocks: a shape the KV pool cannot
    hold is timed only at the smallest batch, and the rows' block tables are left empty afterwards."""
    from specserve.engine.block_pool import NULL_BLOCK
    from specserve.engine.engine import Engine

    target, draft = small_pair
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cpu",
            spec_steps=2,
            max_num_seqs=4,
            max_model_len=256,
            kv_cache_tokens=512,
        )
    )
    costs = engine.runner.measure_step_costs([1, 4], [1, 2], [32, 200], reps=1)
    assert set(costs) == {32, 200}
    assert set(costs[32]) == {(B, K) for B in (1, 4) for K in (0, 1, 2)}
    assert set(costs[200]) == {(1, K) for K in (0, 1, 2)}  # 4 rows of 200 tokens do not fit 512 tokens
    assert all(sec > 0 for by_shape in costs.values() for sec in by_shape.values())
    assert bool((engine.runner.kv.table == NULL_BLOCK).all())


@pytest.mark.gpu
def test_gpu_startup_seeds_every_context_bucket_from_several_timed_contexts(small_pair):
    """On a GPU start-up times the shortest bucket, the longest context held and one between, and seeds
    every context bucket up to max_model_len from them."""
    from specserve.engine.engine import Engine

    target, draft = small_pair
    engine = Engine(
        EngineConfig(
            model=str(target),
            draft=str(draft),
            device="cuda",
            spec_steps=0,
            max_spec_steps=2,
            adaptive=True,
            max_num_seqs=4,
            max_model_len=512,
        )
    )
    seeded = engine.policy.seeded
    assert {c for _, c, _ in seeded} == set(context_buckets(512))
    assert len(startup_contexts(511, cheap=True)) == 3
