"""Offline benchmark: every configuration (and peer) on the same prompts, at
each batch size, in interleaved repeats.

Order of work: for each repeat, batch size and batch of prompts, every unit
(baseline, eagle3 configs, peers) runs that batch in turn. Drift on a shared
machine (other jobs, thermal limits) then hits all units alike, and the
speedup is the median over repeats of the paired ratio to baseline.

A batch is b prompts of one category submitted together (continuous batching
keeps them in one batch); a category with fewer than b prompts is cycled to
fill it. tok/s = generated tokens / wall time of the batches.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from specserve.bench import cost_model, report
from specserve.bench.configs import BenchConfig
from specserve.bench.context import extend_to_context
from specserve.bench.datasets import own_answer_index
from specserve.bench.peers import PeerProcess
from specserve.bench.runs import RunOutput
from specserve.config import SPEC_METHODS, ConfigError, ModelConfig


@dataclass
class Batch:
    index: int
    category: str
    slots: list[int]  # prompt indices, len == batch size


@dataclass
class Run:
    repeat: int
    batch: Batch
    out: RunOutput


def make_batches(categories: list[str], bs: int) -> list[Batch]:
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        by_cat.setdefault(c, []).append(i)
    batches = []
    for cat, idx in by_cat.items():
        for start in range(0, len(idx), bs):
            slots = [idx[(start + j) % len(idx)] for j in range(bs)]
            batches.append(Batch(len(batches), cat, slots))
    return batches


# ------------------------------------------------------------------ engine units
class EngineUnit:
    """One engine configuration. Single-process configs share one engine (`shared`):
    weights and CUDA graphs are loaded once and `Engine.set_spec_steps` switches
    between plain, fixed-K and adaptive runs — an 8B target fits once, not once per config."""

    kind = "engine"

    def __init__(self, cfg: BenchConfig, base_kw: dict, profile: bool, shared=None):
        self.cfg = cfg
        self.shared = shared is not None
        t0 = time.perf_counter()
        if shared is not None:
            self.llm = shared
        else:
            if base_kw.get("tp", 1) > 1:  # one worker process per GPU/rank
                from specserve.distributed.tp_llm import TPLLM as LLM
            else:
                from specserve.engine.llm import LLM

            kw = dict(base_kw)
            if cfg.name == "baseline":
                kw.update(draft=None, spec_steps=0, max_spec_steps=0, adaptive=False)
            else:
                adaptive = bool(cfg.get("adaptive"))
                kw.update(
                    spec_steps=0 if adaptive else cfg.spec_steps,
                    max_spec_steps=cfg.spec_steps,
                    adaptive=adaptive,
                    **_method_kw(cfg.engine_options(), kw),
                )
            self.llm = LLM(profile=profile and cfg.name != "baseline", **kw)
        self.load_s = time.perf_counter() - t0
        self.details: dict = {"load_s": round(self.load_s, 3), "shared_engine": self.shared}
        self.own_policy = None  # adaptive K on a shared engine: its policy (see run)

    @staticmethod
    def shared_llm(configs: list[BenchConfig], base_kw: dict, profile: bool):
        """One engine able to run every config (adaptive-capable, graphs for K = 1..max); the
        configs share one tree setting (`BenchConfig.tree`)."""
        from specserve.engine.llm import LLM

        k_max = max(c.spec_steps for c in configs)
        kw = dict(base_kw)
        if k_max == 0:
            kw.update(draft=None, spec_steps=0, max_spec_steps=0, adaptive=False)
        else:
            method = next(c.engine_options() for c in configs if c.name != "baseline")
            kw.update(spec_steps=0, max_spec_steps=k_max, adaptive=True, **_method_kw(method, kw))
        return LLM(profile=profile, **kw)

    def unavailable(self, bs: int) -> str | None:
        return None

    def run(self, ids: list[list[int]], params: list) -> RunOutput:
        eng = getattr(self.llm, "engine", None)
        shared_policy = None
        if self.shared:
            eng.set_spec_steps(
                0 if self.cfg.name == "baseline" else (None if self.cfg.get("adaptive") else self.cfg.spec_steps)
            )
            if self.cfg.get("adaptive") and eng.policy is not None:
                # adaptive K learns in a policy of its own, as on its own engine: not from the fixed-K runs' timings
                shared_policy = eng.policy
                self.own_policy = self.own_policy or shared_policy.fresh(self.cfg.spec_steps)
                eng.policy = self.own_policy
        before, host0 = _totals(eng), _host(eng)
        policy = getattr(eng, "policy", None)
        chosen = dict(policy.choices) if policy is not None else {}
        n_prof = len(getattr(eng, "profile", []) or [])
        t0 = time.perf_counter()
        try:
            outs = self.llm.generate(ids, params)
            policy = getattr(eng, "policy", None)  # as it stands now (a TP engine view's is a copy)
        finally:
            if shared_policy is not None:
                eng.policy = shared_policy
        wall = time.perf_counter() - t0
        after = _totals(eng)
        spec = None
        if after is not None and self.cfg.name != "baseline":
            spec = {k: _sub(after[k], before[k]) for k in after}
            if policy is not None and self.cfg.get("adaptive"):
                spec["steps_chosen"] = {
                    k: n - chosen.get(k, 0) for k, n in policy.choices.items() if n > chosen.get(k, 0)
                }
                spec["policy"] = policy.snapshot()
        elif self.cfg.name != "baseline":
            spec = _spec_from_outputs(outs)
        ttft = [o.ttft_s or 0.0 for o in outs]
        tpot = [
            (o.latency_s - o.ttft_s) / (len(o.token_ids) - 1) if o.latency_s and len(o.token_ids) > 1 else None
            for o in outs
        ]
        prof = list(eng.profile[n_prof:]) if eng is not None and getattr(eng, "profile", None) else []
        host1 = _host(eng)
        host = {k: host1[k] - host0[k] for k in host1} if host0 and host1 else None
        return RunOutput([list(o.token_ids) for o in outs], wall, ttft, tpot, spec, prof, host)

    def finish(self) -> None:
        if hasattr(self.llm, "close") and not self.shared:  # TP workers
            self.llm.close()


def _method_kw(options: dict, kw: dict) -> dict:
    """A config's method options, with the drafter model dropped where the method drafts without one."""
    return options | ({} if options["spec_method"] == "eagle3" else {"draft": None})


def _spec_from_outputs(outs) -> dict:
    """Counters rebuilt from per-request stats where the engine's totals are not reachable
    (exact for a fixed K, where every cycle drafts every position)."""
    spec = {"cycles": 0, "drafted": 0, "accepted": 0, "accepted_per_pos": [], "drafted_per_pos": []}
    for o in outs:
        s = o.spec or {}
        n = s.get("cycles", 0)
        spec["cycles"] += n
        spec["drafted"] += s.get("drafted_tokens", 0)
        spec["accepted"] += s.get("accepted_tokens", 0)
        for i, rate in enumerate(s.get("accept_per_position") or []):
            if i == len(spec["drafted_per_pos"]):
                spec["accepted_per_pos"].append(0)
                spec["drafted_per_pos"].append(0)
            spec["accepted_per_pos"][i] += round(rate * n)
            spec["drafted_per_pos"][i] += n
    return spec


def _totals(eng) -> dict | None:
    t = getattr(eng, "totals", None)
    if t is None:
        return None
    out = {
        "cycles": t.cycles,
        "drafted": t.drafted,
        "accepted": t.accepted,
        "accepted_per_pos": list(t.accepted_per_pos),
        "drafted_per_pos": list(t.drafted_per_pos),
    }
    if hasattr(eng, "drafts_ahead"):  # (a TP engine's view does not count them)
        out["drafts_ahead"] = eng.drafts_ahead
    return out


def _host(eng) -> dict | None:
    """The engine's step count, host seconds inside its steps and of those the waits for device results."""
    if not hasattr(eng, "step_s"):  # (a TP engine's view does not time them)
        return None
    return {"steps": eng.steps_taken, "step_s": eng.step_s, "wait_s": eng.device_waits.seconds}


def _sub(a, b):
    if isinstance(a, list):
        b = b + [0] * (len(a) - len(b))
        return [x - y for x, y in zip(a, b)]
    return a - b


# ------------------------------------------------------------------ the run
def run_offline(args, configs: list[BenchConfig], prompts: list[dict]) -> dict:
    import torch

    from specserve.engine.generate_cmd import engine_kwargs
    from specserve.model.loader import resolve_device

    t_begin = time.perf_counter()
    base_kw = engine_kwargs(args, default_max_num_seqs=max(args.batch_sizes))
    base_kw["device"] = str(resolve_device(base_kw["device"]))
    threads = args.threads or (1 if base_kw["device"] == "cpu" else None)
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(args, configs, prompts, base_kw, t_begin)
    finally:
        torch.set_num_threads(saved)  # a library call leaves the process as it found it


def _run(args, configs: list[BenchConfig], prompts: list[dict], base_kw: dict, t_begin: float) -> dict:
    import torch

    from specserve.engine.llm import SamplingParams, default_pair
    from specserve.engine.tokenizer import Tokenizer

    model_dir = base_kw["model"]
    draft_dir = default_pair(args.model, args.draft)[1]
    base_kw["draft"] = draft_dir
    if any(c.name == "eagle3" for c in configs) and not draft_dir:
        where = (
            "the demo drafter (specserve/assets/demo/draft) is not built yet"
            if args.model is None
            else "no drafter given"
        )
        raise ConfigError(f"eagle3 configs need an EAGLE-3 drafter: {where}; pass --draft DIR or --configs baseline")
    base_kw["max_num_seqs"] = max(args.max_num_seqs or 0, max(args.batch_sizes))
    base_kw["graph_batch_sizes"] = tuple(sorted(args.batch_sizes))  # capture only the sizes measured

    tok = Tokenizer(model_dir)
    own = [own_answer_index(p["messages"]) is not None for p in prompts]
    if any(own) and not tok.chat_template:
        raise ConfigError(
            f"--dataset {prompts[own.index(True)]['category']} asks each second turn after the "
            f"model's own first answer, through its chat template, and {model_dir} has none "
            f"(no chat_template in tokenizer_config.json or chat_template.jinja): benchmark a chat "
            f"model, or measure first turns only (--dataset mt-bench)"
        )
    # The model's own answers are written after loading: until then they are empty, and up to --max-tokens long.
    prompt_ids = [_encode(tok, _answered(p, "")) for p in prompts]
    categories = [p["category"] for p in prompts]
    if args.max_model_len is None:
        # Room for the longest prompt and its output (+ the longest draft), no more: attention
        # costs grow with the reserved cache length on CPU, the same for every configuration.
        limit = ModelConfig.from_dir(model_dir).max_position_embeddings
        longest = max([len(p) + args.max_tokens * o for p, o in zip(prompt_ids, own)] + (args.context or []))
        need = longest + args.max_tokens + 1
        if need > limit:
            raise ConfigError(
                f"the longest prompt or --context ({need - args.max_tokens - 1} tokens) plus "
                f"--max-tokens {args.max_tokens} exceeds the model's {limit} positions"
            )
        base_kw["max_model_len"] = min(limit, -(-need // 64) * 64)
    elif args.context and max(args.context) + args.max_tokens >= args.max_model_len:
        raise ConfigError(
            f"--context {max(args.context)} plus --max-tokens {args.max_tokens} does not fit "
            f"--max-model-len {args.max_model_len}: raise it, or leave it out to fit the run"
        )
    # Chat answers end at their end of turn unless --ignore-eos; plain text runs --max-tokens unless --no-ignore-eos.
    chat = bool(tok.chat_template) and all(p["messages"] is not None for p in prompts)
    if args.ignore_eos is None:
        args.ignore_eos = not chat
    eos_ids = set(tok.eos_token_ids)
    stop = [tok.end_of_turn_id] if chat and not args.ignore_eos and tok.end_of_turn_id is not None else []
    eos_ids.update(stop)
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed + i,
            ignore_eos=args.ignore_eos,
            stop_token_ids=stop,
        )
        for i in range(len(prompts))
    ]

    log = lambda m: print(m, file=sys.stderr, flush=True)
    if args.num_prompts is None and args.max_seconds > 0:
        log(
            f"[bench] loading, then a short calibration sizes the run to end within about {args.max_seconds:g} s "
            f"(--max-seconds)"
        )
    t_load = time.perf_counter()
    units: dict[str, object] = {}
    # One engine per drafting method and tree setting (chains are one setting) runs all its configs; baseline
    # joins the first.
    key = lambda c: tuple(sorted(c.engine_options().items()))  # noqa: E731
    first = next((key(c) for c in configs if c.name != "baseline"), ())
    groups: dict[tuple, list] = {}
    for cfg in configs:
        groups.setdefault(key(cfg) if cfg.name != "baseline" else first, []).append(cfg)
    shared_by_cfg: dict[str, object] = {}
    if base_kw.get("tp", 1) == 1 and len(configs) > 1:
        for members in groups.values():
            log(f"[bench] loading one engine for {', '.join(c.label for c in members)} ...")
            llm = EngineUnit.shared_llm(members, base_kw, args.profile)
            shared_by_cfg.update({c.label: llm for c in members})
    for cfg in configs:
        log(f"[bench] loading {cfg.label} ...")
        units[cfg.label] = EngineUnit(cfg, base_kw, args.profile, shared_by_cfg.get(cfg.label))
    if any(own):
        prompts = _answer_own_turns(units["baseline"], tok, prompts, args.max_tokens, log)
        prompt_ids = [_encode(tok, p) for p in prompts]
    from specserve.model.loader import resolve_dtype

    device = base_kw["device"]
    dtype = resolve_dtype(base_kw["dtype"], ModelConfig.from_dir(model_dir).dtype, torch.device(device))
    peer_status: dict[str, str] = {}
    if args.peers:
        for name in args.peers:
            log(f"[bench] loading peer {name} ...")
            try:
                units[name] = PeerProcess(
                    name,
                    model_dir,
                    device,
                    dtype,
                    args.max_tokens,
                    args.temperature,
                    args.ignore_eos,
                    eos_ids,
                    args.peer_draft,
                    base_kw["max_model_len"],
                    torch.get_num_threads(),
                )
            except Exception as e:  # noqa: BLE001 -- a peer that cannot load is reported, not fatal
                peer_status[name] = f"could not load: {type(e).__name__}: {e}"

    load_s = time.perf_counter() - t_load
    live = {bs: [u for u in units if units[u].unavailable(bs) is None] for bs in args.batch_sizes}
    contexts = args.context or [None]  # None: the prompts as they are
    calibration = _calibrate(
        args,
        units,
        live,
        prompts,
        extend_to_context(prompt_ids, max(args.context)) if args.context else prompt_ids,
        params,
        log,
        t_begin,
    )
    keep = calibration.pop("keep")
    prompts, prompt_ids, params = ([xs[i] for i in keep] for xs in (prompts, prompt_ids, params))
    categories = [p["category"] for p in prompts]
    batches = {bs: make_batches(categories, bs) for bs in args.batch_sizes}
    runs: dict[tuple[str, int, int | None], list[Run]] = {
        (u, bs, c): [] for u in units for bs in args.batch_sizes for c in contexts
    }
    total = len(contexts) * sum(
        len(live[bs]) * (args.warmup + args.repeats) * len(batches[bs]) for bs in args.batch_sizes
    )
    bar = _progress(total, args.progress)
    load_avg_start = report.load_average()
    t_start = time.perf_counter()

    def one(label: str, batch: Batch, ids: list[list[int]]) -> RunOutput:
        bar.set_postfix_str(f"{label} b={len(batch.slots)}", refresh=False)
        out = units[label].run([ids[i] for i in batch.slots], [params[i] for i in batch.slots])
        bar.update(1)
        return out

    for ctx in contexts:
        ids = prompt_ids if ctx is None else extend_to_context(prompt_ids, ctx)
        # A warm-up pass runs every batch through every unit: on a GPU the first prefill of each new
        # prompt shape pays one-time costs (kernel selection, lazy module loads) that would otherwise
        # land on whichever unit happened to run it first in repeat 0 (the baseline).
        for _ in range(args.warmup):
            for bs in args.batch_sizes:
                for batch in batches[bs]:
                    for label in live[bs]:
                        one(label, batch, ids)
        for r in range(args.repeats):
            for bs in args.batch_sizes:
                for batch in batches[bs]:
                    for label in live[bs]:
                        runs[(label, bs, ctx)].append(Run(r, batch, one(label, batch, ids)))
    bar.close()
    for u in units.values():
        u.finish()

    cats = list(dict.fromkeys(categories))
    results, by_category, summary, cost = [], [], [], []
    for ctx in contexts:
        at = {(label, bs): rs for (label, bs, c), rs in runs.items() if c == ctx}  # this context's runs
        mine = []
        for bs in args.batch_sizes:
            for label, unit in units.items():
                reason = unit.unavailable(bs)
                for cat in [None, *cats]:
                    row = summarize(label, unit, bs, cat, at, reason, args.temperature)
                    (mine if cat is None else by_category).append(row | {"context": ctx})
        for name, why in peer_status.items():
            for bs in args.batch_sizes:
                mine.append(_na_row(name, bs, why) | {"context": ctx})
        results += mine
        summary += [s | {"context": ctx} for s in _summary(args.batch_sizes, mine)]
        if args.profile:
            cost += [
                c | {"context": ctx}
                for c in (cost_model.from_runs(bs, configs, at, mine) for bs in args.batch_sizes)
                if c is not None
            ]

    own_tokens = [p["own_answer_tokens"] for p in prompts if "own_answer_tokens" in p]
    by_context = _context_cost_model(args.batch_sizes, results, cost)

    return {
        "schema_version": report.SCHEMA_VERSION,
        "mode": "offline",
        "created": report.now_iso(),
        "command": report.command_line(),
        "machine": report.machine_info(device),
        "versions": report.versions(),
        "model": report.model_identity(model_dir, dtype=str(dtype).replace("torch.", "")),
        "draft": report.draft_identity(draft_dir) if any(c.name == "eagle3" for c in configs) else None,
        "settings": {
            "configs": [c.label for c in configs],
            "peers": list(args.peers),
            "batch_sizes": list(args.batch_sizes),
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "max_model_len": base_kw["max_model_len"],
            "device": device,
            "contexts": args.context,
            "profile": bool(args.profile),
            "torch_threads": torch.get_num_threads(),
            "calibration": calibration,
            "prompts": {
                "path": str(args.prompts or ("--dataset" if getattr(args, "dataset", None) else "bundled")),
                "count": len(prompts),
                "datasets": getattr(args, "dataset", None),
                "categories": {c: categories.count(c) for c in cats},
                "mean_prompt_tokens": round(statistics.fmean(len(p) for p in prompt_ids), 1),
                "own_answers": {"count": len(own_tokens), "mean_tokens": round(statistics.fmean(own_tokens), 1)}
                if own_tokens
                else None,
            },
        },
        "load_s": round(load_s, 2),
        "wall_s": round(time.perf_counter() - t_start, 2),
        "load_average": {"start": load_avg_start, "end": report.load_average()},
        "results": results,
        "by_category": by_category,
        "summary": summary,
        "cost_model": cost or None,
        "context_cost_model": by_context or None,
    }


def _context_cost_model(batch_sizes: list[int], results: list[dict], cost: list[dict]) -> list[dict]:
    """Per adaptive config and batch size: the predicted speedup of each K at each context bucket its policy
    timed (`cost_model.from_policy`), at a stated acceptance: the profiled chains' per-position rates (the
    cost model's), else the adaptive config's own."""
    out = []
    for bs in batch_sizes:
        fitted = next(
            (c["acceptance_per_position"] for c in cost if c["batch_size"] == bs and c["acceptance_per_position"]), None
        )
        last = {}  # config -> its row at the last context (the policy after every context ran)
        for x in results:
            if x["batch_size"] == bs and (x.get("details") or {}).get("policy_costs"):
                last[x["config"]] = x
        for config, x in last.items():
            acceptance = fitted or [a for a in x["accept_per_position"] or [] if a is not None]
            entry = cost_model.from_policy(x["details"]["policy_costs"], bs, acceptance)
            if entry is not None:
                out.append(
                    {
                        "config": config,
                        **entry,
                        "acceptance_source": "profiled chains" if fitted else "this config's cycles",
                    }
                )
    return out


def _summary(batch_sizes: list[int], results: list[dict]) -> list[dict]:
    """Per batch size: the speculative config with the best speedup, and its tok/s against the hf peer's."""
    summary = []
    for bs in batch_sizes:
        spec = [
            x for x in results if x["batch_size"] == bs and x["config"].split(":")[0] in SPEC_METHODS and x["speedup"]
        ]
        if not spec:
            continue
        best = max(spec, key=lambda x: x["speedup"])
        hf = next((x for x in results if x["batch_size"] == bs and x["config"] == "hf" and x["available"]), None)
        vs_hf = values = None
        if hf is not None:  # paired per repeat, like the speedup
            values = [a / b for a, b in zip(best["tok_s"]["values"], hf["tok_s"]["values"])]
            vs_hf = statistics.median(values)
        summary.append(
            {
                "batch_size": bs,
                "best_config": best["config"],
                "speedup": best["speedup"],
                "vs_hf": vs_hf,
                "vs_hf_values": values,
            }
        )
    return summary


def _calibrate(
    args, units: dict, live: dict, prompts: list[dict], prompt_ids: list[list[int]], params: list, log, t_begin: float
) -> dict:
    """Without --num-prompts: time one batch per unit and batch size (run twice: the first pays one-time
    costs), estimate the warm-up and timed passes from it, and keep the most prompts per category whose
    estimate fits what is left of --max-seconds since `t_begin`. Returns the figures, and the prompt
    indices to keep under "keep". A run with --num-prompts (scripted, often with a timeout of its own)
    is not lengthened by the calibration."""
    from specserve.bench.datasets import select_prompts

    sized = args.num_prompts is None and args.max_seconds > 0
    if not sized:
        args.warmup = 1 if args.warmup is None else args.warmup
        return {
            "seconds": 0.0,
            "estimate_s": None,
            "max_seconds": args.max_seconds,
            "elapsed_before_s": round(time.perf_counter() - t_begin, 2),
            "prompts_per_category": args.num_prompts,
            "keep": list(range(len(prompts))),
        }

    t0 = time.perf_counter()
    cost: dict[tuple[str, int], float] = {}
    for bs in args.batch_sizes:
        batch = make_batches([p["category"] for p in prompts], bs)[0]
        for label in live[bs]:
            for _ in range(2):
                t = time.perf_counter()
                units[label].run([prompt_ids[i] for i in batch.slots], [params[i] for i in batch.slots])
                cost[(label, bs)] = time.perf_counter() - t
    seconds = time.perf_counter() - t0
    budget = args.max_seconds - (time.perf_counter() - t_begin)

    def chosen(n: int | None) -> list[int]:
        picked = {id(p) for p in select_prompts(prompts, n)}
        return [i for i, p in enumerate(prompts) if id(p) in picked]

    def estimate(keep: list[int], warmup: int) -> float:
        cats = [prompts[i]["category"] for i in keep]
        per_context = sum(
            len(make_batches(cats, bs)) * (warmup + args.repeats) * sum(cost[(u, bs)] for u in live[bs])
            for bs in args.batch_sizes
        )
        return len(args.context or [None]) * per_context  # (timed at the longest --context)

    largest = max(sum(p["category"] == c for p in prompts) for c in {p["category"] for p in prompts})
    warmups = [args.warmup] if args.warmup is not None else [1, 0]
    per_category, warmup = next(
        ((n, w) for w in warmups for n in range(largest, 0, -1) if estimate(chosen(n), w) <= budget), (1, warmups[-1])
    )
    if per_category == largest:
        per_category = None  # every prompt fits
    args.warmup = warmup
    keep = chosen(per_category)
    est = estimate(keep, warmup)
    how = f", sized to --max-seconds {args.max_seconds:g} (--num-prompts N to choose)"
    if est > budget:
        how = f"; more than --max-seconds {args.max_seconds:g} even with one prompt per category"
    log(
        f"[bench] calibration took {seconds:.1f} s; measuring {len(keep)} of {len(prompts)} prompts x "
        f"{warmup} warm-up + {args.repeats} timed passes: about {est:.0f} s more, done near "
        f"{time.strftime('%H:%M:%S', time.localtime(time.time() + est))}{how}"
    )
    return {
        "seconds": round(seconds, 2),
        "estimate_s": round(est, 1),
        "max_seconds": args.max_seconds,
        "elapsed_before_s": round(time.perf_counter() - t_begin, 2),
        "prompts_per_category": per_category,
        "keep": keep,
    }


def _answered(p: dict, text: str) -> dict:
    """The row with its open assistant turn (`own_answer_index`), if any, answered by `text`."""
    i = own_answer_index(p["messages"])
    if i is None:
        return p
    return {**p, "messages": [*p["messages"][:i], {"role": "assistant", "content": text}, *p["messages"][i + 1 :]]}


def _answer_own_turns(baseline: EngineUnit, tok, prompts: list[dict], max_tokens: int, log) -> list[dict]:
    """Answer each open assistant turn (MT-Bench second turns) with the target model's own reply to the
    conversation before it, as FastChat and EAGLE-3 do: plain greedy decoding, to EOS or the end of the turn,
    at most --max-tokens. Answered once, before any configuration runs, so every config and peer measures
    the same conversations."""
    from specserve.engine.llm import SamplingParams

    todo = [i for i, p in enumerate(prompts) if own_answer_index(p["messages"]) is not None]
    log(
        f"[bench] the target answers {len(todo)} first turns (greedy, up to {max_tokens} tokens) to ask the "
        f"second turns ..."
    )
    heads = [
        _encode(tok, {**prompts[i], "messages": prompts[i]["messages"][: own_answer_index(prompts[i]["messages"])]})
        for i in todo
    ]
    stop = [tok.end_of_turn_id] if tok.end_of_turn_id is not None else []
    out = baseline.run(
        heads, [SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop) for _ in todo]
    )
    answered = list(prompts)
    for i, ids in zip(todo, out.tokens):
        answered[i] = {**_answered(prompts[i], tok.decode(ids).strip()), "own_answer_tokens": len(ids)}
    return answered


def _encode(tok, p: dict) -> list[int]:
    # A row may carry both (HumanEval): chat models get the turn, others the raw prompt.
    if p["messages"] is not None and tok.chat_template:
        ids = tok.encode(tok.apply_chat_template(p["messages"]))
    elif p["prompt"] is not None:
        ids = tok.encode(p["prompt"])
    else:  # no template: a plain transcript
        ids = tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in p["messages"]) + "assistant:")
    if not ids:
        raise ConfigError("a prompt encodes to zero tokens")
    return ids


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s, refresh=True):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a nicety
        return _NoBar()
    # disable=None: no bar when stderr is not a terminal (CI logs would fill with redraws)
    return tqdm(
        total=total,
        desc="bench",
        unit="batch",
        disable=None if enabled else True,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )


# ------------------------------------------------------------------ statistics
def _stats(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def _na_row(label: str, bs: int, reason: str, category: str | None = None) -> dict:
    return {
        "config": label,
        "kind": "peer" if label in ("hf", "hf-assisted") else "engine",
        "batch_size": bs,
        "category": category or "all",
        "available": False,
        "reason": reason,
        "tok_s": None,
        "tpot_ms": None,
        "ttft_ms": None,
        "tokens_per_repeat": None,
        "accept_length": None,
        "accept_per_position": None,
        "speedup": None,
        "speedup_values": None,
        "matches_baseline": None,
        "match_rate": None,
        "details": {},
    }


def summarize(label: str, unit, bs: int, category: str | None, runs, reason: str | None, temperature: float) -> dict:
    if reason is not None:
        return _na_row(label, bs, reason, category)
    mine = [r for r in runs[(label, bs)] if category is None or r.batch.category == category]
    base = [r for r in runs[("baseline", bs)] if category is None or r.batch.category == category]
    repeats = sorted({r.repeat for r in mine})

    def per_repeat(rs, rep):
        sel = [r for r in rs if r.repeat == rep]
        return sum(len(t) for r in sel for t in r.out.tokens), sum(r.out.wall for r in sel), sel

    tok_s, ratios, tpot, ttft, ntok = [], [], [], [], []
    for rep in repeats:
        n, wall, sel = per_repeat(mine, rep)
        bn, bwall, _ = per_repeat(base, rep)
        tok_s.append(n / wall)
        if bn and bwall:
            ratios.append((n / wall) / (bn / bwall))
        ntok.append(n)
        tp = [x for r in sel for x in r.out.tpot if x is not None]
        if tp:
            tpot.append(1000 * statistics.fmean(tp))
        ttft.append(1000 * statistics.fmean(x for r in sel for x in r.out.ttft))

    matches = match_rate = None
    if temperature == 0:
        ref = {r.batch.index: r.out.tokens for r in base if r.repeat == 0}
        same = [a == b for r in mine for a, b in zip(r.out.tokens, ref.get(r.batch.index, []))]
        match_rate = sum(same) / len(same) if same else None
        matches = all(same) if same else None

    accept_len = per_pos = None
    details = dict(getattr(unit, "details", {}))
    hosts = [r.out.host for r in mine if r.out.host]
    if hosts and sum(h["steps"] for h in hosts):
        # Per engine step, the host's time inside it and of that the wait for the device: a loop that
        # barely waits is bound by the host, and the device idles between its steps.
        steps = sum(h["steps"] for h in hosts)
        details["host_ms_per_step"] = {
            "in_step": round(1e3 * sum(h["step_s"] for h in hosts) / steps, 4),
            "waiting_for_device": round(1e3 * sum(h["wait_s"] for h in hosts) / steps, 4),
        }
    specs = [r.out.spec for r in mine if r.out.spec]
    if specs and "drafted_per_pos" in specs[0]:
        cycles = sum(s["cycles"] for s in specs)
        accepted = sum(s["accepted"] for s in specs)
        width = max(len(s["drafted_per_pos"]) for s in specs)
        acc = [sum(s["accepted_per_pos"][i] for s in specs if i < len(s["accepted_per_pos"])) for i in range(width)]
        dra = [sum(s["drafted_per_pos"][i] for s in specs if i < len(s["drafted_per_pos"])) for i in range(width)]
        accept_len = 1 + accepted / cycles if cycles else None
        per_pos = [a / d if d else None for a, d in zip(acc, dra)]
        while per_pos and per_pos[-1] is None:  # a shared engine's counters are as wide as its largest K
            per_pos.pop()
        details.update(cycles=cycles, drafted_tokens=sum(s["drafted"] for s in specs), accepted_tokens=accepted)
        if any("drafts_ahead" in s for s in specs):  # cycles whose draft was queued behind the last verify
            details["cycles_drafted_ahead"] = sum(s.get("drafts_ahead", 0) for s in specs)
        chosen: dict[str, int] = {}
        for s in specs:
            for k, n in (s.get("steps_chosen") or {}).items():
                chosen[str(k)] = chosen.get(str(k), 0) + n
        if chosen:
            details["steps_chosen"] = dict(sorted(chosen.items(), key=lambda kv: int(kv[0])))
            if specs[-1].get("policy"):  # the adaptive policy's cost table after the last repeat
                details["policy_costs"] = specs[-1]["policy"]
    elif specs:  # assisted peer: tokens per target forward
        cycles = sum(s["cycles"] for s in specs)
        accept_len = sum(s["tokens"] for s in specs) / cycles if cycles else None
        details["accept_length_note"] = "tokens per assisted-generation cycle (from transformers' step count)"

    return {
        "config": label,
        "kind": unit.kind,
        "batch_size": bs,
        "category": category or "all",
        "available": True,
        "reason": None,
        "tok_s": _stats(tok_s),
        "tpot_ms": _stats(tpot),
        "ttft_ms": _stats(ttft),
        "tokens_per_repeat": statistics.fmean(ntok) if ntok else None,
        "accept_length": accept_len,
        "accept_per_position": per_pos,
        "speedup": statistics.median(ratios) if ratios else None,
        "speedup_values": ratios or None,
        "matches_baseline": matches,
        "match_rate": match_rate,
        "details": details,
    }
