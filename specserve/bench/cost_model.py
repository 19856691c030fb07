"""A cost model of chain speculation, fitted from `--profile` figures.

Per batch size b, with N new tokens per request:

    plain:   wall(0) = P0 + (N - 1) * c                   c = measured plain step time
    K > 0:   wall(K) = P  + (N - 1) / E(K) * cycle(K)
             cycle(K) = draft(K) + verify(K) + accept + overhead
             E(K)     = 1 + sum_{i<K} p_i                 expected tokens per cycle
    tok/s(K) = b * N / wall(K)

draft(K) = d0 + d1*K and verify(K) = v0 + v1*K are least-squares fits over the
profiled cycles grouped by K (profile: per-cycle draft/verify/accept ms, from
fixed-K configs and from the K values an adaptive config tried);
p_i is the measured probability that draft position i is accepted (pooled over
configs: with chain drafting the first K drafts do not depend on K);
overhead = c - v0 is the host work of a step beyond the target forward, taken
from plain decoding; P, P0 are the measured times to first token. So the model
predicts every K from 0 to the longest measured draft, and the measured K
values show how far to trust it.
"""

from __future__ import annotations

import statistics


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope); with one distinct x: (0, y/x), i.e. proportional."""
    if len(set(xs)) < 2:
        x, y = statistics.fmean(xs), statistics.fmean(ys)
        return 0.0, (y / x if x else 0.0)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def expected_tokens(p: list[float], K: int) -> float:
    return 1.0 + sum(p[:K])


def predict(b: int, n_tokens: float, plain_step_s: float, prefill_plain_s: float, prefill_spec_s: float,
            draft_fit: tuple[float, float], verify_fit: tuple[float, float], accept_s: float,
            p: list[float], k_max: int) -> list[dict]:
    """Predicted tok/s for K = 0..k_max (times in seconds)."""
    overhead = max(plain_step_s - verify_fit[0], 0.0)
    out = [{"steps": 0, "expected_tokens_per_cycle": 1.0, "cycle_ms": 1000 * plain_step_s,
            "predicted_tok_s": b * n_tokens / (prefill_plain_s + (n_tokens - 1) * plain_step_s)}]
    for K in range(1, k_max + 1):
        cycle = draft_fit[0] + draft_fit[1] * K + verify_fit[0] + verify_fit[1] * K + accept_s + overhead
        E = expected_tokens(p, K)
        wall = prefill_spec_s + (n_tokens - 1) / E * cycle
        out.append({"steps": K, "expected_tokens_per_cycle": E, "cycle_ms": 1000 * cycle,
                    "predicted_tok_s": b * n_tokens / wall})
    return out


def from_runs(bs: int, configs, runs: dict, results: list[dict]) -> dict | None:
    """Fit and predict for one batch size from the offline runs; None without profile data.

    Every eagle3 config contributes: cycles are grouped by the K they ran with (an adaptive
    config explores several), and acceptance counts per position are pooled (the i-th draft is
    accepted with the same probability whatever K is, as drafting is a chain)."""
    spec_cfgs = [c for c in configs if c.name == "eagle3"]
    base = runs.get(("baseline", bs), [])
    if not spec_cfgs or not base:
        return None
    by_k: dict[int, list[dict]] = {}
    acc, dra, prefill_spec = [], [], []
    for c in spec_cfgs:
        rs = runs[(c.label, bs)]
        prof = [p for r in rs for p in r.out.profile]
        full = [p for p in prof if p["batch"] == bs] or prof  # cycles of the full batch if any
        for p in full:
            by_k.setdefault(p["K"], []).append(p)
        prefill_spec += [max(r.out.ttft) for r in rs]
        for r in rs:
            s = r.out.spec or {}
            for i, (a, d) in enumerate(zip(s.get("accepted_per_pos", []), s.get("drafted_per_pos", []))):
                while len(acc) <= i:
                    acc.append(0)
                    dra.append(0)
                acc[i] += a
                dra[i] += d
    ks = sorted(by_k)
    if not ks:
        return None
    mean = lambda K, part: statistics.fmean(p[part] for p in by_k[K]) / 1000
    drafts, verifies = [mean(K, "draft") for K in ks], [mean(K, "verify") for K in ks]
    accept_s = statistics.fmean(p["accept"] for K in ks for p in by_k[K]) / 1000
    p = [a / d for a, d in zip(acc, dra) if d]
    n_tokens = statistics.fmean(len(t) for r in base for t in r.out.tokens)
    # Plain step time: the decode part of each baseline batch over its N-1 steps.
    steps = [(r.out.wall - max(r.out.ttft)) / max(max(len(t) for t in r.out.tokens) - 1, 1) for r in base]
    plain_step = statistics.median(steps)
    prefill_plain = statistics.median(max(r.out.ttft) for r in base)
    draft_fit, verify_fit = linear_fit(ks, drafts), linear_fit(ks, verifies)
    preds = predict(bs, n_tokens, plain_step, prefill_plain, statistics.median(prefill_spec), draft_fit,
                    verify_fit, accept_s, p, len(p))
    measured = {r["config"]: r["tok_s"]["median"] for r in results
                if r["batch_size"] == bs and r["category"] == "all" and r["tok_s"]}
    fixed = {c.spec_steps: c.label for c in spec_cfgs if not c.get("adaptive")}
    for row in preds:
        label = "baseline" if row["steps"] == 0 else fixed.get(row["steps"])
        row["config"] = label
        row["measured_tok_s"] = measured.get(label) if label else None
    best = max(preds, key=lambda r: r["predicted_tok_s"])
    return {
        "batch_size": bs, "tokens_per_request": n_tokens,
        "plain_step_ms": 1000 * plain_step, "prefill_ms": {"plain": 1000 * prefill_plain,
                                                            "spec": 1000 * statistics.median(prefill_spec)},
        "draft_ms": {"base": 1000 * draft_fit[0], "per_step": 1000 * draft_fit[1]},
        "verify_ms": {"base": 1000 * verify_fit[0], "per_token": 1000 * verify_fit[1]},
        "accept_ms": 1000 * accept_s,
        "overhead_ms": 1000 * max(plain_step - verify_fit[0], 0.0),
        "acceptance_per_position": p,
        "profiled_steps": {str(K): len(by_k[K]) for K in ks},
        "predictions": preds,
        "recommended_steps": best["steps"],
    }
