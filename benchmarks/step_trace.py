"""Where the wall time of generation goes, step by step: plain decoding, adaptive K, and
adaptive K forced to plain decoding (a drafting engine whose policy always answers 0), on one
engine, in alternating rounds.

    python benchmarks/step_trace.py --model M --draft D --prompts A.jsonl [B.jsonl] [--batch B] [--out FILE.json]

Each `Engine.step()` is timed on the host with the K it ran and whether it prefilled; the drafter's
catch-up after plain stretches is timed apart, and the switches from plain decoding to speculation (each one
catch-up) are counted, the run of K values kept (`k_runs`). Per config: wall, steps per K with their median, mean
and total milliseconds, prefill steps (and of the target's prefill forwards, those a prefill graph served), and
decode steps slower than 3x their K's median (count, total, the slowest). The adaptive config's choices of K > 0 are logged with the rates the policy ranked them by
(explorations apart), and each exploration timing the policy judged, with whether it ended the back-off. `--cprofile` adds each config's top functions by own time (one more round, profiled).
Prompt files: JSON lines with "messages" (chat) or "prompt"; `--batch` runs them in groups of B (as one
`generate` call each, cycling through the prompts to fill the last group); `--in-flight C` serves them
instead, as `specserve serve` would: C requests at a time, each replaced as soon as it ends.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specserve.engine.llm import LLM  # noqa: E402
from specserve.engine.sampling import SamplingParams  # noqa: E402

CONFIGS = ("baseline", "adaptive", "adaptive-plain")


def encode(tok, row: dict) -> list[int]:
    if row.get("messages") and tok.chat_template:
        return tok.encode(tok.apply_chat_template(row["messages"]))
    return tok.encode(row.get("prompt") or row["messages"][0]["content"])


DECISIONS: list[dict] = []  # the adaptive config's choices of K > 0, with the rates the policy saw
WINS: list[dict] = []  # explorations' timings the policy judged (`_would_win`): a win ends the back-off


def logged_choose(policy, choose):
    """`choose`, recording each K > 0 it returns: the batch size, whether the drafter was stale, the K the
    rates alone rank first (else the choice was an exploration), and each K's rate and cost (ms)."""
    from specserve.spec.policy import _bucket, context_bucket

    def wrapped(B, remaining=None, stale=False, context=0):
        shape = (_bucket(B), context_bucket(context))
        switch = policy._switch_cost(shape) if stale else 0.0
        rates = policy._rates(shape, policy.tree(B), remaining, B, switch=switch)
        K = choose(B, remaining, stale, context)
        if K:
            DECISIONS.append(
                {
                    "B": B,
                    "context": context,
                    "K": K,
                    "stale": stale,
                    "best": max(rates, key=rates.get) if rates else None,
                    "job": bool(remaining),
                    "switch_ms": round(1e3 * switch, 2),
                    "rates": {k: round(r / 1e3, 4) for k, r in rates.items()},
                    "cost_ms": {k: round(1e3 * (policy.predicted_cost(shape[0], k, context) or 0), 3) for k in rates},
                }
            )
        return K

    return wrapped


def logged_would_win(policy):
    """`_would_win`, recording each exploration timing it judges: K, the timing (ms), its live cost before, and
    whether it ended the back-off (one lucky cycle doing so brings the next exploration 24 choices closer)."""
    would_win = policy._would_win

    def wrapped(shape, B, K, seconds):
        won = would_win(shape, B, K, seconds)
        live = policy.cost.get((*shape, K))
        WINS.append(
            {
                "B": B,
                "K": K,
                "ms": round(1e3 * seconds, 3),
                "won": won,
                "live_ms": None if live is None else round(1e3 * live, 3),
            }
        )
        return won

    return wrapped


def set_config(eng, name: str, choose) -> None:
    eng.set_spec_steps(0 if name == "baseline" else None)
    eng.policy.choose = (
        (lambda B, remaining=None, stale=False, context=0: 0)
        if name == "adaptive-plain"
        else logged_choose(eng.policy, choose)
    )


COMPILED: list[str] = []  # Triton kernels compiled so far (names), appended by the hook below


def log_triton_compiles() -> None:
    """Record every Triton compilation (a JIT cache miss costs 0.1-1 s of host time) in COMPILED."""
    try:
        import gc

        import triton.compiler.compiler as cc
        from triton.runtime.jit import JITFunction
    except ImportError:
        return
    orig = cc.compile

    def logged(src, *a, **k):
        fn = getattr(src, "fn", None)
        COMPILED.append(getattr(fn, "__name__", None) or getattr(src, "name", "?"))
        return orig(src, *a, **k)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("triton") and getattr(mod, "compile", None) is orig:
            mod.compile = logged
    for obj in gc.get_objects():
        if isinstance(obj, JITFunction) and obj.__dict__.get("compile") is orig:
            obj.compile = logged


def serve(eng, ids, params, in_flight: int, requests: int) -> None:
    """As a server runs: `requests` requests, `in_flight` at a time, each replaced as soon as it ends."""
    live, sent = set(), 0
    while sent < requests or eng.has_work():
        while sent < requests and len(live) < in_flight:
            live.add(eng.add_request(ids[sent % len(ids)], params[sent % len(ids)]).seq_id)
            sent += 1
        for s in eng.step():
            if s.finish_reason is not None:
                live.discard(s.seq_id)


def run_round(
    llm, ids, params, batch: int = 1, in_flight: int = 0, requests: int = 0
) -> tuple[float, list[tuple], float, dict]:
    """(wall seconds, [(K, prefilled, seconds, kernels compiled) per step], catch-up seconds, prefill forwards
    and how many the prefill graphs served) over the prompts, `batch` at a time (a `generate` call each), or
    served (`in_flight` > 0: `requests` of them, replaced as they end)."""
    eng = llm.engine
    steps: list[tuple] = []
    catch = [0.0]
    pr = eng.proposer
    real_catch_up = pr.catch_up

    def timed_catch_up(*a, **k):
        t = time.perf_counter()
        real_catch_up(*a, **k)
        eng.runner.sync()
        catch[0] += time.perf_counter() - t

    pr.catch_up = timed_catch_up
    # prefill forwards, and how many of them the prefill graphs served (the rest: eager, bound by the host)
    prefills = {"forwards": 0, "graphed": 0}
    runner = eng.runner
    real_prefill, real_graph_prefill = runner.prefill, runner._graph_prefill
    graphed = [False]

    def counted_prefill(*a, **k):
        graphed[0] = False
        out = real_prefill(*a, **k)
        prefills["forwards"] += 1
        prefills["graphed"] += graphed[0]
        return out

    def counted_graph_prefill(*a, **k):
        graphed[0] = True
        return real_graph_prefill(*a, **k)

    runner.prefill, runner._graph_prefill = counted_prefill, counted_graph_prefill
    real_step = eng.step

    def timed_step():
        prefill = bool(eng.n_prefill or eng.waiting)
        n = len(COMPILED)
        t = time.perf_counter()
        out = real_step()
        steps.append((eng.last_k if eng.n_running or out else -1, prefill, time.perf_counter() - t, COMPILED[n:]))
        return out

    eng.step = timed_step
    t0 = time.perf_counter()
    try:
        if in_flight:
            serve(eng, ids, params, in_flight, requests)
        for i in range(0, len(ids) if not in_flight else 0, batch):
            group = [(i + j) % len(ids) for j in range(batch)]
            llm.generate([ids[g] for g in group], [params[g] for g in group])
    finally:
        eng.step = real_step
        pr.catch_up = real_catch_up
        runner.prefill, runner._graph_prefill = real_prefill, real_graph_prefill
    return time.perf_counter() - t0, steps, catch[0], prefills


def summarize(wall: float, steps, catch: float, prefills: dict, tokens: int) -> dict:
    by_k: dict[int, list[float]] = {}
    prefill = [dt for _, pf, dt, _ in steps if pf]
    for k, pf, dt, _ in steps:
        if not pf:
            by_k.setdefault(k, []).append(dt)
    compiled = [(k, pf, round(1e3 * dt, 1), names) for k, pf, dt, names in steps if names]
    runs: list[list[int]] = []  # the K of successive decode steps, run-length encoded
    for k, _, _, _ in steps:
        if k < 0:
            continue
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    switches = sum(1 for a, b in zip(runs, runs[1:]) if a[0] == 0 and b[0] > 0)
    out = {
        "wall_s": round(wall, 4),
        "tok_s": round(tokens / wall, 1),
        "steps": len(steps),
        "switches_to_speculation": switches,
        "k_runs": runs,
        "compiling_steps": [{"K": k, "prefill": pf, "ms": ms, "kernels": names} for k, pf, ms, names in compiled],
        "prefill_steps": len(prefill),
        "prefill_ms": round(1e3 * sum(prefill), 2),
        "catch_up_ms": round(1e3 * catch, 2),
        "prefill_forwards": prefills,
        "by_k": {},
    }
    for k, xs in sorted(by_k.items()):
        med = statistics.median(xs)
        slow = sorted((x for x in xs if x > 3 * med), reverse=True)
        out["by_k"][str(k)] = {
            "n": len(xs),
            "median_ms": round(1e3 * med, 4),
            "mean_ms": round(1e3 * statistics.fmean(xs), 4),
            "total_ms": round(1e3 * sum(xs), 2),
            "slow_n": len(slow),
            "slow_ms": round(1e3 * sum(slow), 2),
            "slowest_ms": [round(1e3 * x, 2) for x in slow[:8]],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", nargs="+", required=True)
    ap.add_argument("--num-prompts", type=int, default=8, help="per file")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="largest K of adaptive")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="serve instead: this many requests in flight, each replaced as it ends (no batch job)",
    )
    ap.add_argument("--requests", type=int, default=256, help="requests a round with --in-flight")
    ap.add_argument("--admit-wait", type=int, default=0, help="the engine's --admit-wait (steps)")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()

    llm = LLM(
        args.model,
        args.draft,
        spec_steps=0,
        max_spec_steps=args.steps,
        adaptive=True,
        max_num_seqs=max(args.batch, args.in_flight, 8),
        admit_wait=args.admit_wait,
    )
    rows = []
    for f in args.prompts:
        with open(f) as fh:
            rows += [json.loads(line) for line in fh if line.strip()][: args.num_prompts]
    ids = [encode(llm.tokenizer, r) for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True) for _ in ids]
    tokens = (args.requests if args.in_flight else -(-len(ids) // args.batch) * args.batch) * args.max_tokens
    serving = dict(in_flight=args.in_flight, requests=args.requests)
    eng = llm.engine
    choose = eng.policy.choose
    eng.policy._would_win = logged_would_win(eng.policy)
    log_triton_compiles()
    for name in CONFIGS:  # warm-up
        set_config(eng, name, choose)
        run_round(llm, ids[:2], params[:2], args.batch, args.in_flight, min(args.requests, 2 * args.in_flight))
    result: dict = {
        "model": args.model,
        "draft": args.draft,
        "prompts": len(ids),
        "batch": args.batch,
        **serving,
        "max_tokens": args.max_tokens,
        "rounds": {name: [] for name in CONFIGS},
    }
    for _ in range(args.rounds):
        for name in CONFIGS:
            set_config(eng, name, choose)
            result["rounds"][name].append(summarize(*run_round(llm, ids, params, args.batch, **serving), tokens))
    if args.cprofile:
        result["cprofile"] = {}
        for name in CONFIGS:
            set_config(eng, name, choose)
            prof = cProfile.Profile()
            prof.enable()
            run_round(llm, ids, params, args.batch, **serving)
            prof.disable()
            st = pstats.Stats(prof)
            top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
            result["cprofile"][name] = [
                {
                    "fn": f"{Path(f).name}:{line}:{fn}",
                    "calls": v[1],
                    "own_ms": round(1e3 * v[2], 2),
                    "cum_ms": round(1e3 * v[3], 2),
                }
                for (f, line, fn), v in top
            ]
    set_config(eng, "adaptive", choose)
    result["policy_choices"] = dict(eng.policy.choices)
    result["policy_costs"] = eng.policy.snapshot()
    explored = [d for d in DECISIONS if d["best"] != d["K"]]
    result["spec_decisions"] = {
        "n": len(DECISIONS),
        "explorations": len(explored),
        "first": DECISIONS[:40],
        "best_not_explored": [d for d in DECISIONS if d["best"] == d["K"]][:40],
        "exploration_timings": WINS[:200],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"{'config':<16}{'round':>6}{'tok/s':>9}{'K0 med':>9}{'K0 mean':>9}{'K>0 n':>7}{'K>0 ms':>9}"
        f"{'slow K0':>9}{'catch':>8}{'switch':>7}{'prefill':>9}{'graphed':>9}"
    )
    for name, rs in result["rounds"].items():
        for i, r in enumerate(rs):
            k0 = r["by_k"].get("0", {})
            spec = [v for k, v in r["by_k"].items() if k not in ("0", "-1")]
            print(
                f"{name:<16}{i:>6}{r['tok_s']:>9.1f}{k0.get('median_ms', 0):>9.3f}{k0.get('mean_ms', 0):>9.3f}"
                f"{sum(v['n'] for v in spec):>7}{sum(v['total_ms'] for v in spec):>9.1f}"
                f"{k0.get('slow_ms', 0):>9.1f}{r['catch_up_ms']:>8.1f}{r['switches_to_speculation']:>7}"
                f"{r['prefill_ms']:>9.1f}{r['prefill_forwards']['graphed']:>4}/{r['prefill_forwards']['forwards']:<4}"
            )
    print(f"K > 0 chosen {len(DECISIONS)} times, {len(explored)} of them explorations; the others by their rates:")
    for d in result["spec_decisions"]["best_not_explored"][:12]:
        print(
            f"  B={d['B']} K={d['K']} stale={d['stale']} job={d['job']} tokens/ms {d['rates']} cost ms {d['cost_ms']}"
        )
    won = [w for w in WINS if w["won"]]
    print(
        f"exploration timings judged {len(WINS)}, {len(won)} ended the back-off"
        + "".join(f"; K={w['K']} at B={w['B']}: {w['ms']} ms (live {w['live_ms']})" for w in won[:6])
    )
    for name, rs in result["rounds"].items():
        for i, r in enumerate(rs):
            for c in r["compiling_steps"]:
                print(
                    f"{name} round {i}: a step of K={c['K']}{' (prefill)' if c['prefill'] else ''} took {c['ms']} ms "
                    f"compiling {', '.join(c['kernels'])}"
                )


if __name__ == "__main__":
    main()
