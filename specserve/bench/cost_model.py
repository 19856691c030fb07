"""A cost model of chain speculation, fitted from `--profile` figures.

Per batch size b, with N new tokens per request:

    plain:   wall(0) = P0 + (N - 1) * c                   c = measured plain step time
    K > 0:   wall(K) = P  + s * (N - 1) / E(K) * cycle(K)
             cycle(K) = draft(K) + verify(K) + accept + overhead
             E(K)     = 1 + sum_{i<K} p_i                 expected tokens per cycle and sequence
    tok/s(K) = b * N / wall(K)

- draft(K) = d0 + d1*K and verify(K) = v0 + v1*K: least-squares fits of the mean
  per-cycle draft and verify times of each K, weighted by cycles (from fixed-K
  configs, and from the K values an adaptive config ran at least MIN_CYCLES times).
  With a single K measured, draft is taken as proportional to K and verify as the
  line from the plain step (a forward of one row per sequence) to the measured
  verify: a forward's cost grows with the rows it checks, it does not vanish;
- p_i: measured probability that draft position i is accepted, pooled over configs
  (a chain's first K drafts do not depend on K), non-increasing in i;
- overhead: host work of a cycle outside the profiled parts (scheduling, token
  bookkeeping), the median over speculative batches of
  (wall - P - profiled time) / cycles;
- s: cycles a batch needs over (N - 1) / E, as measured (>= 1: a batch runs until
  its slowest sequence is done; about 1 at batch size 1);
- P, P0: measured times to first token of the batch.

overhead and s are calibrated on the measured configs and assumed the same for
every K, so the model interpolates between and extrapolates beyond them (up to
the longest draft measured); the measured K values show how far to trust it.
Tree configurations (topk > 1) are left out: their acceptance per depth and cost
per node follow other rules; the bench reports them as measured.

By context (`speedup_by_context`): a verify's attention reads the whole cache, so a K-cycle's cost
against a plain step's grows with the context. From step costs measured per context (an adaptive
policy's, `from_policy`, which `bench --context` reports; or any, through `python -m
specserve.bench.cost_model`) and a stated acceptance, the speedup of K is E(K) * plain / cycle(K).
"""

from __future__ import annotations

import statistics

MIN_CYCLES = 10  # K values profiled fewer times (an adaptive policy's exploration) stay out of the fit


def linear_fit(xs: list[float], ys: list[float], ws: list[float] | None = None) -> tuple[float, float]:
    """Weighted least-squares (intercept, slope); with one distinct x: (0, y/x), i.e. proportional."""
    ws = ws or [1.0] * len(xs)
    W = sum(ws)
    mx, my = sum(w * x for w, x in zip(ws, xs)) / W, sum(w * y for w, y in zip(ws, ys)) / W
    if len(set(xs)) < 2:
        return 0.0, (my / mx if mx else 0.0)
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    slope = sxy / sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    return my - slope * mx, slope


def expected_tokens(p: list[float], K: int) -> float:
    return 1.0 + sum(p[:K])


def predict(
    b: int,
    n_tokens: float,
    plain_step_s: float,
    prefill_plain_s: float,
    prefill_spec_s: float,
    draft_fit: tuple[float, float],
    verify_fit: tuple[float, float],
    accept_s: float,
    overhead_s: float,
    straggle: float,
    p: list[float],
    k_max: int,
) -> list[dict]:
    """Predicted tok/s for K = 0..k_max (times in seconds)."""
    out = [
        {
            "steps": 0,
            "expected_tokens_per_cycle": 1.0,
            "cycle_ms": 1000 * plain_step_s,
            "predicted_tok_s": b * n_tokens / (prefill_plain_s + (n_tokens - 1) * plain_step_s),
        }
    ]
    for K in range(1, k_max + 1):
        cycle = draft_fit[0] + draft_fit[1] * K + verify_fit[0] + verify_fit[1] * K + accept_s + overhead_s
        E = expected_tokens(p, K)
        wall = prefill_spec_s + straggle * (n_tokens - 1) / E * cycle
        out.append(
            {
                "steps": K,
                "expected_tokens_per_cycle": E,
                "cycle_ms": 1000 * cycle,
                "predicted_tok_s": b * n_tokens / wall,
            }
        )
    return out


def from_runs(bs: int, configs, runs: dict, results: list[dict]) -> dict | None:
    """Fit and predict for one batch size from the offline runs; None without profile data."""
    spec_cfgs = [c for c in configs if c.name == "eagle3" and c.tree[0] == 1]  # chains (trees: measured only)
    base = runs.get(("baseline", bs), [])
    if not spec_cfgs or not base:
        return None
    by_k: dict[int, list[dict]] = {}
    acc, dra, prefill_spec, overheads, straggles = [], [], [], [], []
    for c in spec_cfgs:
        for r in runs[(c.label, bs)]:
            prof, s = r.out.profile, r.out.spec or {}
            if not prof or not s.get("cycles"):
                continue
            for p in prof:
                if p["batch"] == bs:  # full-batch cycles (not the tail where some rows are done)
                    by_k.setdefault(p["K"], []).append(p)
            first = max(r.out.ttft)
            prefill_spec.append(first)
            if not c.get("adaptive"):  # an adaptive config's K=0 steps are not profiled cycles
                profiled = sum(p["draft"] + p["verify"] + p["accept"] for p in prof) / 1000
                overheads.append((r.out.wall - first - profiled) / len(prof))
                n = statistics.fmean(len(t) for t in r.out.tokens)
                per_seq = 1 + s["accepted"] / s["cycles"]  # this batch's tokens per cycle and sequence
                straggles.append(len(prof) * per_seq / max(n - 1, 1))
            for i, (a, d) in enumerate(zip(s.get("accepted_per_pos", []), s.get("drafted_per_pos", []))):
                while len(acc) <= i:
                    acc.append(0)
                    dra.append(0)
                acc[i] += a
                dra[i] += d
    if not by_k:
        return None
    n_tokens = statistics.fmean(len(t) for r in base for t in r.out.tokens)
    # Plain step time: the decode part of each baseline batch over its N-1 steps.
    steps = [(r.out.wall - max(r.out.ttft)) / max(max(len(t) for t in r.out.tokens) - 1, 1) for r in base]
    plain_step = statistics.median(steps)
    ks = sorted(K for K in by_k if len(by_k[K]) >= MIN_CYCLES) or sorted(by_k)
    # Means per K (as throughput sees them, preemptions included), weighted by cycles.
    mean = lambda K, part: statistics.fmean(p[part] for p in by_k[K]) / 1000
    weights = [len(by_k[K]) for K in ks]
    draft_fit = linear_fit(ks, [mean(K, "draft") for K in ks], weights)
    if len(ks) > 1:
        verify_fit = linear_fit(ks, [mean(K, "verify") for K in ks], weights)
    else:  # anchor at K = 0: verifying nothing is a plain step
        verify_fit = linear_fit([0, ks[0]], [plain_step, mean(ks[0], "verify")])
    accept_s = statistics.fmean(p["accept"] for K in ks for p in by_k[K]) / 1000
    overhead = max(statistics.median(overheads), 0.0) if overheads else 0.0
    straggle = max(statistics.median(straggles), 1.0) if straggles else 1.0
    # Positions drafted too rarely to estimate are dropped; a chain accepts position i only
    # after all before it, so the rates cannot rise with i.
    p: list[float] = []
    for a, d in zip(acc, dra):
        if d < MIN_CYCLES:
            break
        p.append(min(a / d, p[-1]) if p else a / d)
    prefill_plain = statistics.median(max(r.out.ttft) for r in base)
    preds = predict(
        bs,
        n_tokens,
        plain_step,
        prefill_plain,
        statistics.median(prefill_spec),
        draft_fit,
        verify_fit,
        accept_s,
        overhead,
        straggle,
        p,
        len(p),
    )
    measured = {
        r["config"]: r["tok_s"]["median"]
        for r in results
        if r["batch_size"] == bs and r["category"] == "all" and r["tok_s"]
    }
    fixed = {c.spec_steps: c.label for c in spec_cfgs if not c.get("adaptive")}
    for row in preds:
        label = "baseline" if row["steps"] == 0 else fixed.get(row["steps"])
        row["config"] = label
        row["measured_tok_s"] = measured.get(label) if label else None
    best = max(preds, key=lambda r: r["predicted_tok_s"])
    return {
        "batch_size": bs,
        "tokens_per_request": n_tokens,
        "plain_step_ms": 1000 * plain_step,
        "prefill_ms": {"plain": 1000 * prefill_plain, "spec": 1000 * statistics.median(prefill_spec)},
        "draft_ms": {"base": 1000 * draft_fit[0], "per_step": 1000 * draft_fit[1]},
        "verify_ms": {"base": 1000 * verify_fit[0], "per_token": 1000 * verify_fit[1]},
        "accept_ms": 1000 * accept_s,
        "overhead_ms": 1000 * overhead,
        "straggle": straggle,
        "acceptance_per_position": p,
        "profiled_cycles": {str(K): len(v) for K, v in sorted(by_k.items())},
        "fitted_steps": ks,
        "predictions": preds,
        "recommended_steps": best["steps"],
    }


def speedup_by_context(step_ms: dict[int, dict[int, float]], acceptance: list[float]) -> dict[int, dict[int, float]]:
    """Predicted speedup over plain decoding of each K at each context, from measured step costs
    {context: {K: ms}} (K = 0 a plain step, K > 0 a whole cycle: drafts and verify) and a stated
    acceptance (the share of cycles whose i-th draft is accepted): a cycle's E(K) tokens against the
    E(K) plain steps they replace. Decode rates only: prefill and the drafter's catch-ups are left out.
    K values past the stated acceptance are not predicted."""
    return {
        ctx: {
            K: expected_tokens(acceptance, K) * costs[0] / costs[K] for K in sorted(costs) if 0 < K <= len(acceptance)
        }
        for ctx, costs in sorted(step_ms.items())
        if costs.get(0)
    }


def from_policy(policy_costs: dict, batch_size: int, acceptance: list[float]) -> dict | None:
    """The predicted speedup per context (`speedup_by_context`) at `batch_size` from an adaptive policy's
    cost table (`SpecPolicy.snapshot`): the cost of each K it chooses by (live where K ran there, else
    start-up plus what it learned live), at every context bucket the run timed live. None where it timed
    none or no acceptance is known."""
    bucket = next((b for b in sorted(policy_costs, key=int) if int(b) >= batch_size), None)
    if bucket is None or not acceptance:
        return None
    step_ms = {
        int(c): {int(K): row["predicted_ms"] for K, row in ks.items() if row["predicted_ms"] is not None}
        for c, ks in policy_costs[bucket].items()
        if any(row["live_ms"] is not None for row in ks.values())
    }
    speedups = speedup_by_context(step_ms, acceptance)
    if not speedups:
        return None
    contexts = []
    for c, by_k in speedups.items():
        best = max(by_k, key=by_k.get, default=0)
        contexts.append(
            {
                "context_bucket": c,
                "step_ms": {str(K): ms for K, ms in sorted(step_ms[c].items())},
                "speedup": {str(K): x for K, x in by_k.items()},
                "best_steps": best if by_k.get(best, 0.0) > 1.0 else 0,
            }
        )
    return {
        "batch_size": batch_size,
        "policy_bucket": int(bucket),
        "acceptance_per_position": list(acceptance),
        "contexts": contexts,
    }


def main(argv: list[str] | None = None) -> None:
    """`python -m specserve.bench.cost_model --steps 512:1,1.2,1.3 32768:1,1.7,2.8 --acceptance 0.8 0.6`:
    the predicted speedup table from step costs measured elsewhere (e.g. benchmarks/moe_layers_gpu.py)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m specserve.bench.cost_model", description=main.__doc__)
    ap.add_argument(
        "--steps",
        nargs="+",
        required=True,
        metavar="CONTEXT:C0,C1,...",
        help="per context, the cost of a plain step (C0) and of a K-cycle, drafts and verify, for "
        "K = 1, 2, ... (any one unit)",
    )
    ap.add_argument(
        "--acceptance",
        nargs="+",
        type=float,
        required=True,
        metavar="A",
        help="the share of cycles whose i-th draft is accepted, i = 1, 2, ...",
    )
    args = ap.parse_args(argv)
    if not all(0 <= a <= 1 for a in args.acceptance):
        ap.error(f"--acceptance takes shares between 0 and 1, got {args.acceptance}")
    step_ms = {}
    for item in args.steps:
        ctx, _, costs = item.partition(":")
        try:
            step_ms[int(ctx)] = dict(enumerate(float(c) for c in costs.split(",")))
        except ValueError:
            ap.error(f"--steps {item!r}: expected CONTEXT:C0,C1,... (e.g. 512:1,1.17,1.32)")
    print(f"predicted speedup over plain decoding at acceptance per position {args.acceptance}")
    for ctx, by_k in speedup_by_context(step_ms, args.acceptance).items():
        print(f"context {ctx:>7}: " + "  ".join(f"K={K} {x:.2f}x" for K, x in by_k.items()))


if __name__ == "__main__":
    main()
