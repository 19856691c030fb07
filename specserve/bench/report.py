"""Bench results: machine/version/model identity, text and Markdown tables,
plots and the JSON file (schema: specserve/bench/schema.json). Torch-free:
the online mode uses this module too."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent / "schema.json"


# ------------------------------------------------------------------ identity
def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in ["specserve", *sys.argv[1:]])


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str | None = None) -> dict:
    """The machine that ran the engine (offline) or the client (online)."""
    cores = os.cpu_count() or 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    info = {
        "device": "cpu",
        "name": cpu_model(),
        "count": usable,
        "cpu": {"model": cpu_model(), "cores": cores, "usable_cores": usable},
        "gpu": None,
        "platform": platform.platform(),
    }
    if device and device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name(torch.device(device))
        count = torch.cuda.device_count()
        info.update(device="cuda", name=name, count=count, gpu={"name": name, "count": count})
    return info


def versions() -> dict:
    from specserve import __version__

    out = {"specserve": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)  # without importing it
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _preset(path: Path, cfg: dict, demo_sub: str = "") -> str | None:
    from specserve.config import DEMO_DIR

    if path.resolve() == (DEMO_DIR / demo_sub).resolve():
        return "demo"
    if cfg.get("grow_preset"):  # written by `specserve grow`
        return f"grown:{cfg['grow_preset']}"
    meta = cfg.get("specserve")
    return meta.get("preset") if isinstance(meta, dict) else None


def _read_cfg(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def model_identity(model_dir: str, dtype: str | None = None) -> dict:
    from specserve.model.gguf import find_gguf, hf_config

    gguf_file = find_gguf(model_dir)  # a GGUF's config is its metadata
    p = gguf_file or Path(model_dir)
    cfg = hf_config(gguf_file) if gguf_file else _read_cfg(p)
    return {
        "path": str(p.resolve()),
        "name": p.resolve().name,
        "preset": _preset(p, cfg),
        "grown_from": cfg.get("grown_from"),
        "architecture": (cfg.get("architectures") or [None])[0],
        "num_layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "dtype": dtype,
    }


def draft_identity(draft_dir: str | None) -> dict | None:
    if not draft_dir:
        return None
    p = Path(draft_dir)
    cfg = _read_cfg(p)
    return {
        "path": str(p.resolve()),
        "name": p.resolve().name,
        "preset": _preset(p, cfg, "draft"),
        "architecture": (cfg.get("architectures") or [None])[0],
        "hidden_size": cfg.get("hidden_size"),
        "draft_vocab_size": cfg.get("draft_vocab_size") or cfg.get("vocab_size"),
    }


def write_json(result: dict, path: str) -> None:
    Path(path).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


# ------------------------------------------------------------------ formatting
def _f(x, fmt: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _yes(x, rate=None) -> str:
    if x is False and rate is not None:  # how far from plain greedy: bf16 near-ties flip a few outputs
        return f"NO ({100 * rate:.0f}% same)"
    return {True: "yes", False: "NO", None: "-"}[x]


def _header(r: dict) -> list[str]:
    m, s = r["machine"], r["settings"]
    la = r.get("load_average") or {}
    lines = [
        f"specserve bench ({r['mode']}) {r['created']}",
        (
            f"machine: {m['name']} x{m['count']} ({m['device']}); 1-min load average "
            f"{_f(la.get('start'), '.2f')} at start, {_f(la.get('end'), '.2f')} at end"
        ),
        "versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
    ]
    if r["mode"] == "offline":
        md, dr = r["model"], r.get("draft")
        lines.append(f"model: {md['path']}" + (f" [{md['preset']}]" if md.get("preset") else "") + f", {md['dtype']}")
        if dr:
            lines.append(f"draft: {dr['path']}" + (f" [{dr['preset']}]" if dr.get("preset") else ""))
        p = s["prompts"]
        cats = ", ".join(f"{k} {v}" for k, v in p["categories"].items())
        lines.append(
            f"workload: {p['count']} prompts ({cats}; {p['mean_prompt_tokens']} tokens mean), "
            f"{s['max_tokens']} new tokens{'' if s.get('ignore_eos', True) else ' at most (to the end of turn or EOS)'}, "
            f"temperature {s['temperature']}, {s['repeats']} repeats, "
            f"{s['warmup']} warm-up, {s.get('torch_threads')} torch threads; load {r.get('load_s')} s, "
            f"run {r['wall_s']} s"
        )
        own = p.get("own_answers")
        if own:
            lines.append(
                f"second turns: {own['count']} asked after the model's own greedy answer to the first turn "
                f"({own['mean_tokens']} tokens mean), generated once before the configs ran; every "
                f"config and peer got the same conversations"
            )
    return lines


def _batch(x: dict) -> str:
    """A row's batch size, with its context where `bench --context` set one."""
    return str(x["batch_size"]) + (f", context {x['context']}" if x.get("context") else "")


def main_table(r: dict) -> tuple[list[str], list[list[str]]]:
    head = ["config", "batch", "tok/s median [min-max]", "TPOT ms", "accept len", "accept/pos", "speedup", "=greedy"]
    rows = []
    for x in r["results"]:
        if not x["available"]:
            rows.append([x["config"], _batch(x), "n/a (see notes)", "-", "-", "-", "-", "-"])
            continue
        t = x["tok_s"]
        pos = " ".join(_f(a, ".2f") for a in x["accept_per_position"] or [])
        rows.append(
            [
                x["config"],
                _batch(x),
                f"{t['median']:.1f} [{t['min']:.1f}-{t['max']:.1f}]",
                _f(x["tpot_ms"] and x["tpot_ms"]["median"], ".2f"),
                _f(x["accept_length"], ".2f"),
                pos or "-",
                _f(x["speedup"], ".2f") + ("x" if x["speedup"] is not None else ""),
                _yes(x["matches_baseline"], x.get("match_rate")),
            ]
        )
    return head, rows


def category_table(r: dict) -> tuple[list[str], list[list[str]]]:
    head = ["config", "batch", "category", "tok/s median", "accept len", "speedup", "=greedy"]
    rows = [
        [
            x["config"],
            _batch(x),
            x["category"],
            _f(x["tok_s"]["median"]),
            _f(x["accept_length"], ".2f"),
            _f(x["speedup"], ".2f") + ("x" if x["speedup"] is not None else ""),
            _yes(x["matches_baseline"], x.get("match_rate")),
        ]
        for x in r["by_category"]
        if x["available"]
    ]
    return head, rows


def dataset_table(r: dict, names: list[str]) -> dict:
    """The EAGLE-3 paper's table: per config and batch size, speedup and acceptance length (tau) on each
    dataset and their mean over the datasets that have a value."""
    cells = {
        (x["config"], x["batch_size"], x.get("context"), x["category"]): x for x in r["by_category"] if x["available"]
    }
    rows = []
    for x in r["results"]:
        if not x["available"] or x["config"] == "baseline":
            continue
        per = {}
        for name in names:
            c = cells.get(
                (x["config"], x["batch_size"], x.get("context"), Path(name).stem if name.endswith(".jsonl") else name)
            )
            per[name] = {"speedup": c and c["speedup"], "accept_length": c and c["accept_length"]}
        mean = {
            k: (sum(v) / len(v) if v else None)
            for k in ("speedup", "accept_length")
            for v in [[d[k] for d in per.values() if d[k] is not None]]
        }
        rows.append(
            {
                "config": x["config"],
                "batch_size": x["batch_size"],
                "context": x.get("context"),
                "datasets": per,
                "mean": mean,
            }
        )
    return {"names": list(names), "temperature": r["settings"]["temperature"], "rows": rows}


def paper_table(r: dict) -> tuple[list[str], list[list[str]]]:
    names = r["datasets"]["names"]
    head = ["config", "batch", *(f"{n} {k}" for n in [*names, "mean"] for k in ("speedup", "tau"))]
    rows = []
    for x in r["datasets"]["rows"]:
        cells = [*(x["datasets"][n] for n in names), x["mean"]]
        rows.append(
            [
                x["config"],
                _batch(x),
                *(
                    v
                    for c in cells
                    for v in (
                        _f(c["speedup"], ".2f") + ("x" if c["speedup"] is not None else ""),
                        _f(c["accept_length"], ".2f"),
                    )
                ),
            ]
        )
    return head, rows


def cost_table(r: dict) -> tuple[list[str], list[list[str]]]:
    head = ["batch", "steps K", "E[tokens/cycle]", "cycle ms", "predicted tok/s", "measured tok/s", ""]
    rows = []
    for c in r.get("cost_model") or []:
        for p in c["predictions"]:
            rows.append(
                [
                    _batch(c),
                    str(p["steps"]),
                    _f(p["expected_tokens_per_cycle"], ".2f"),
                    _f(p["cycle_ms"], ".2f"),
                    _f(p["predicted_tok_s"]),
                    _f(p["measured_tok_s"]),
                    "<- recommended" if p["steps"] == c["recommended_steps"] else "",
                ]
            )
    return head, rows


def context_cost_table(r: dict) -> tuple[list[str], list[list[str]]]:
    """The predicted speedup of each K per context bucket, from the adaptive policy's step costs."""
    entries = r.get("context_cost_model") or []
    ks = sorted({int(K) for e in entries for c in e["contexts"] for K in c["speedup"]})
    head = ["config", "batch", "context bucket (up to)", "plain ms", *(f"K={K}" for K in ks), "best K"]
    rows = [
        [
            e["config"],
            str(e["batch_size"]),
            str(c["context_bucket"]),
            _f(c["step_ms"]["0"], ".2f"),
            *(_f(c["speedup"].get(str(K)), ".2f") + ("x" if str(K) in c["speedup"] else "") for K in ks),
            str(c["best_steps"]),
        ]
        for e in entries
        for c in e["contexts"]
    ]
    return head, rows


def _acceptance_line(r: dict) -> str:
    e = (r.get("context_cost_model") or [{}])[0]
    rates = " ".join(f"{a:.2f}" for a in e.get("acceptance_per_position", []))
    return (
        f"predicted speedup per context from the adaptive policy's step costs (live, else start-up), at "
        f"acceptance per position {rates} ({e.get('acceptance_source')}):"
    )


def online_table(r: dict) -> tuple[list[str], list[list[str]]]:
    o = r["online"]
    head = ["metric", "mean", "p50", "p90", "p99"]
    rows = []
    for key, name in (
        ("ttft_ms", "TTFT ms"),
        ("tpot_ms", "TPOT ms"),
        ("itl_ms", "inter-chunk ms"),
        ("e2e_ms", "end-to-end ms"),
    ):
        s = o[key]
        rows.append([name] + [_f(s and s.get(k), ".2f") for k in ("mean", "p50", "p90", "p99")])
    return head, rows


def _text_table(head, rows) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _md_table(head, rows) -> str:
    esc = lambda c: str(c).replace("|", "\\|")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows])


def _online_summary(r: dict) -> list[str]:
    o = r["online"]
    acc = o.get("acceptance") or {}
    lines = [
        f"server: {o['url']} model {o['model']}; load: {o['load']}",
        (
            f"requests: {o['completed']} ok, {o['failed']} failed in {o['duration_s']:.2f} s; "
            f"output {o['output_tok_s']:.1f} tok/s, {o['request_s']:.2f} req/s; "
            f"{o['output_tokens']} output tokens ({o['tokens_counted_by']})"
        ),
    ]
    if acc.get("source"):
        pos = " ".join(_f(a, ".2f") for a in acc.get("accept_per_position") or [])
        lines.append(
            f"acceptance ({acc['source']}): length {_f(acc.get('accept_length'), '.2f')}, "
            f"rate {_f(acc.get('accept_rate'), '.2f')}"
            + (f", per position {pos}" if pos else "")
            + (f", steps chosen {acc['steps_chosen']}" if acc.get("steps_chosen") else "")
        )
    else:
        lines.append("acceptance: no speculative-decoding counters found in /metrics")
    if o.get("errors"):
        lines.append("first errors: " + "; ".join(o["errors"][:3]))
    return lines


def _notes(r: dict) -> list[str]:
    notes = []
    for x in r.get("results", []):
        d = x.get("details") or {}
        if not x["available"]:
            notes.append(f"{x['config']} (batch {_batch(x)}): n/a, {x['reason']}")
        if x["kind"] == "peer" and x["available"] and x["category"] == "all":
            extra = ", ".join(f"{k}={v}" for k, v in d.items() if k in ("cache", "method", "static_cache_error"))
            notes.append(f"{x['config']} (batch {_batch(x)}): {extra}")
        if "steps_chosen" in d:
            notes.append(f"{x['config']} (batch {_batch(x)}): steps chosen {d['steps_chosen']}")
    return notes


QUOTABLE_SPREAD = 1.2  # largest max/min of the per-repeat ratios for a figure worth quoting


def _not_quotable(values: list[float], load: dict) -> str | None:
    """Why a paired ratio over repeats is too unsteady to quote, or None."""
    if len(values) < 3:
        return f"{len(values)} repeat{'s' if len(values) != 1 else ''} (3 or more give a median and a spread)"
    if max(values) > QUOTABLE_SPREAD * min(values):
        busy = ""
        if load.get("start") is not None and load.get("end") is not None:
            busy = f", load average {load['start']:.1f} -> {load['end']:.1f}"
        return (
            f"the repeats differ by more than {QUOTABLE_SPREAD:g}x (other work on the machine?{busy}); "
            f"rerun on an idle machine or with more --repeats"
        )
    return None


def summary_lines(r: dict) -> list[str]:
    out = []
    for b in r.get("summary") or []:
        line = f"batch {_batch(b)}: best {b['best_config']} at {b['speedup']:.2f}x plain decoding"
        if b.get("vs_hf") is not None:
            line += f", {b['vs_hf']:.2f}x transformers generate()"
            values = b.get("vs_hf_values") or []
            if len(values) > 1:
                line += f" (per repeat {min(values):.2f}-{max(values):.2f}x)"
            why = _not_quotable(values, r.get("load_average") or {})
            if why:
                line += f"; not a figure to quote: {why}"
        out.append(line)
    return out


def render_text(r: dict) -> str:
    out = _header(r)
    if r["mode"] == "online":
        out += [""] + _online_summary(r) + ["", _text_table(*online_table(r))]
        return "\n".join(out)
    out += ["", _text_table(*main_table(r)), *summary_lines(r), "", "per category:", _text_table(*category_table(r))]
    if r.get("datasets"):
        out += [
            "",
            f"per dataset (temperature {r['datasets']['temperature']}; tau = acceptance length):",
            _text_table(*paper_table(r)),
        ]
    if r.get("cost_model"):
        out += ["", "cost model (from --profile):", _text_table(*cost_table(r))]
    if r.get("context_cost_model"):
        out += ["", _acceptance_line(r), _text_table(*context_cost_table(r))]
    notes = _notes(r)
    if notes:
        out += [""] + notes
    return "\n".join(out)


def render_markdown(r: dict) -> str:
    out = ["# specserve bench", "", "```", *_header(r), "```", ""]
    if r["mode"] == "online":
        out += _online_summary(r) + ["", _md_table(*online_table(r)), ""]
        return "\n".join(out)
    out += [
        "## Results",
        "",
        _md_table(*main_table(r)),
        "",
        *[f"- {x}" for x in summary_lines(r)],
        "",
        (
            "tok/s: generated tokens / wall time per repeat (median, min, max). TPOT: time per output token "
            "after the first, per request. speedup: median over repeats of the paired ratio to baseline at "
            "the same batch size. =greedy: every output token-identical to plain greedy decoding (else the share of outputs that are)."
        ),
        "",
        "## Per category",
        "",
        _md_table(*category_table(r)),
        "",
    ]
    if r.get("datasets"):
        out += [
            "## Per dataset",
            "",
            f"temperature {r['datasets']['temperature']}; speedup over plain decoding and "
            "acceptance length tau (tokens per target forward) on each dataset, and their mean.",
            "",
            _md_table(*paper_table(r)),
            "",
        ]
    if r.get("cost_model"):
        out += ["## Cost model", "", _md_table(*cost_table(r)), ""]
    if r.get("context_cost_model"):
        out += ["## Cost model by context", "", _acceptance_line(r), "", _md_table(*context_cost_table(r)), ""]
    notes = _notes(r)
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    out += ["Command:", "", "```", r["command"], "```", ""]
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    """Speedup and acceptance length against draft steps (one line per batch size),
    and speedup against batch size (one line per config)."""
    from specserve.extras import require

    matplotlib = require("matplotlib", "bench", "plotting a bench report")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if r["mode"] != "offline":
        raise ValueError("--plot applies to the offline mode")
    shown = (r["settings"].get("contexts") or [None])[0]  # (with --context, the first context's figures)
    rows = [x for x in r["results"] if x["available"] and x.get("context") == shown]
    fixed = [
        x
        for x in rows
        if x["config"] == "baseline" or (x["config"].startswith("eagle3:") and "adaptive" not in x["config"])
    ]
    from specserve.bench.configs import parse_config

    parsed = {x["config"]: parse_config(x["config"]) for x in fixed}
    topks = sorted({c.tree[0] for c in parsed.values()})  # one line per batch size and tree width
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    cost = {c["batch_size"]: c for c in r.get("cost_model") or [] if c.get("context") == shown}
    for bs, topk in ((bs, k) for bs in r["settings"]["batch_sizes"] for k in topks):
        pts = sorted(
            (parsed[x["config"]].spec_steps, x["speedup"], x["accept_length"] or 1.0)
            for x in fixed
            if x["batch_size"] == bs and (x["config"] == "baseline" or parsed[x["config"]].tree[0] == topk)
        )
        name = f"batch {bs}" + (f", tree top-{topk}" if topk > 1 else "")
        line = ax[0].plot([p[0] for p in pts], [p[1] for p in pts], "o-" if topk == 1 else "s:", label=name)[0]
        ax[1].plot([p[0] for p in pts], [p[2] for p in pts], "o-" if topk == 1 else "s:", label=name)
        if bs in cost and topk == 1:  # the cost model's prediction, relative to its own plain-decoding figure
            pr = cost[bs]["predictions"]
            ax[0].plot(
                [q["steps"] for q in pr],
                [q["predicted_tok_s"] / pr[0]["predicted_tok_s"] for q in pr],
                "--",
                color=line.get_color(),
                alpha=0.6,
                label=f"batch {bs} predicted",
            )
    for c in r["settings"]["configs"] + r["settings"]["peers"]:
        pts = sorted((x["batch_size"], x["speedup"]) for x in rows if x["config"] == c and x["speedup"] is not None)
        if pts:
            ax[2].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=c)
    ax[0].set(xlabel="draft steps K (0 = plain)", ylabel="speedup vs plain", title="speedup vs steps")
    ax[1].set(xlabel="draft steps K", ylabel="acceptance length", title="acceptance length vs steps")
    ax[2].set(xlabel="batch size", ylabel="speedup vs plain", title="speedup vs batch size")
    ax[2].set_xscale("log", base=2)
    ax[2].set_xticks(r["settings"]["batch_sizes"], [str(b) for b in r["settings"]["batch_sizes"]])
    for a in ax[:2]:
        a.xaxis.get_major_locator().set_params(integer=True)
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
        a.axhline(1.0, color="grey", lw=0.8, ls="--") if a is not ax[1] else None
    fig.suptitle(f"{r['model']['name']} on {r['machine']['name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
