"""`specserve nccl-tune`: measure all-reduce latency at the sizes the model will
send, for each candidate NCCL profile and all-reduce implementation, eagerly and
inside a CUDA graph; print an nccl-tests-style table; write the best profile.

Message size = hidden x tokens x dtype bytes (tokens = batch x (K+1) per
verify step). The best candidate has the lowest geometric-mean time over the
decode sizes (tokens <= --decode-tokens), in graph mode where its capture
worked (that is how the engine runs), else eager. Each profile needs fresh
worker processes because NCCL reads its environment once, at initialization.
A graph capture that stalls longer than --graph-timeout kills the workers; the
table says "hung" and the remaining candidates are measured in fresh workers.

busbw = algbw * 2(n-1)/n (nccl-tests convention for all-reduce).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from specserve.config import ConfigError

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64)
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specserve.engine.generate_cmd import add_node_arguments  # torch-free

    p.add_argument("--tp", type=int, required=True, help="number of ranks (GPUs), over all nodes")
    p.add_argument("--model", help="read --hidden from this model's config.json")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: from --model, else 4096)")
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=list(DEFAULT_TOKENS),
        help="tokens per all-reduce to measure (batch x (K+1)); default 1 2 4 8 16 32 64",
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=16,
        help="sizes with at most this many tokens decide the best profile (default 16)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPE_NAMES), help="all-reduce element type")
    p.add_argument(
        "--profiles", nargs="+", default=None, help="candidate profiles: preset names or files (default: every preset)"
    )
    p.add_argument(
        "--backends",
        nargs="+",
        default=None,
        choices=["torch", "nccl", "symm_mem"],
        help="all-reduce implementations to try (default: all on GPU, torch on CPU)",
    )
    p.add_argument("--device", default="auto", help="cuda (default when available) or cpu (gloo, for CI)")
    p.add_argument("--iters", type=int, default=100, help="all-reduces per timed run")
    p.add_argument("--runs", type=int, default=7, help="timed runs per size; the median is reported")
    p.add_argument(
        "--graph-timeout",
        type=float,
        default=60.0,
        help="seconds without progress during a CUDA graph capture before giving up on it",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment variable for the workers (repeatable)",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the best profile to FILE (JSON, for --nccl-profile FILE); without it nothing is written",
    )
    p.add_argument("--json", action="store_true", help="also print all measurements as one JSON object")
    add_node_arguments(p)


# ------------------------------------------------------------------ worker side
def _nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()
    if isinstance(v, int):  # older torch: 22809 -> 2.28.9
        v = (v // 10000, v // 100 % 100, v % 100)
    return ".".join(map(str, v))


def _time_eager(ps, x, iters: int, runs: int, device) -> list[float]:
    """Median-able per-op microseconds of `runs` timed loops of `iters` all-reduces."""
    import torch

    out = []
    for _ in range(runs):
        ps.all_ranks_agree(True)  # line the ranks up before each timed loop
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                ps.all_reduce(x)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1000 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                ps.all_reduce(x)
            out.append((time.perf_counter() - t0) * 1e6 / iters)
    return out


def _time_graph(ps, x, iters: int, runs: int, device, step) -> list[float]:
    import torch

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        ps.all_reduce(x)  # warm-up on the capture stream (connections, buffers)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        for _ in range(iters):
            ps.all_reduce(x)
    step("captured")
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize(device)
    out = []
    for _ in range(runs):
        ps.all_ranks_agree(True)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000 / iters)
    del graph
    return out


def run_worker(ch, rank: int, size: int, msg: dict) -> None:
    """Tune mode of a worker: measure every backend in msg, streaming results."""
    import torch

    from specserve.distributed import comm
    from specserve.distributed import parallel_state as ps
    from specserve.model.loader import DTYPES

    device = torch.device(f"cuda:{rank % msg['local']}" if msg["device"] == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ps.init_distributed(rank, size, device, msg["timeout_s"], msg["store_prefix"])
    dtype = DTYPES[msg["dtype"]]
    info = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "nccl_version": _nccl_version() if device.type == "cuda" else None,
        "torch": torch.__version__,
    }
    ch.send(
        {
            "type": "progress",
            "phase": "info",
            "text": f"{info['device_name']}, torch {info['torch']}, NCCL {info['nccl_version']}",
            "data": {"info": info},
        }
    )
    for backend in msg["backends"]:
        used = comm.install(backend, rank, size, device, dtype, ps._GROUP, ps._CONTROL_GROUP)
        comm.warm_up(device, msg["hidden"], dtype)
        for mode in msg["modes"].get(backend, ["eager"]):
            rows = []
            for tokens in msg["tokens"]:
                x = torch.zeros(tokens * msg["hidden"], dtype=dtype, device=device)
                text = f"{backend} {mode} {tokens} tokens"
                if mode == "eager":
                    for _ in range(3):
                        ps.all_reduce(x)  # warm-up
                    times = _time_eager(ps, x, msg["iters"], msg["runs"], device)
                else:
                    ch.send({"type": "progress", "phase": "graphs", "text": f"capturing {text}"})
                    times = _time_graph(
                        ps,
                        x,
                        min(msg["iters"], 50),
                        msg["runs"],
                        device,
                        lambda s: ch.send({"type": "progress", "phase": "graphs", "text": f"{s} {text}"}),
                    )
                rows.append({"tokens": tokens, "us": statistics.median(times)})
            ch.send(
                {
                    "type": "progress",
                    "phase": "result",
                    "text": f"measured {backend} ({used}) {mode}",
                    "data": {"backend": backend, "used": used, "mode": mode, "rows": rows},
                }
            )
    ch.send({"type": "done"})


# ------------------------------------------------------------------ driver side
def _hidden_from(args) -> int:
    if args.hidden:
        return args.hidden
    if args.model:
        from specserve.config import ModelConfig

        return ModelConfig.from_dir(args.model).hidden_size
    return 4096


def _measure_profile(profile, args, device: str, backends: list[str], hidden: int, log, par) -> dict:
    """All measurements for one profile: {(backend, mode): rows | 'hung' | 'failed: ...'}, info."""
    from specserve.distributed.group import PhaseTimeout, WorkerError, WorkerGroup
    from specserve.distributed.nccl_profiles import build_worker_env, parse_env_args

    wenv = build_worker_env(dict(os.environ), profile, parse_env_args(args.env))
    for note in wenv.notes:
        log(f"  note: {note}")
    results: dict = {}
    info: dict = {}
    # Graphs are measured after every eager number, nccl first: a hang then costs the least.
    todo = {b: (["eager", "graph"] if device == "cuda" else ["eager"]) for b in backends}
    while any(todo.values()):
        if par.nnodes > 1:
            from specserve.distributed.multinode import Cluster

            group = WorkerGroup(
                args.tp, wenv, cluster=Cluster.get(par), profile=profile, explicit=parse_env_args(args.env)
            )
        else:
            group = WorkerGroup(args.tp, wenv)
        per_rank: dict = {}

        def on_progress(rank, msg):
            data = msg.get("data")
            if not data:
                return
            if "info" in data:
                info.update(data["info"])
                return
            per_rank.setdefault((data["backend"], data["mode"]), {})[rank] = data
            if len(per_rank[(data["backend"], data["mode"])]) == args.tp:
                ranks = per_rank[(data["backend"], data["mode"])]
                # The collective takes as long as its slowest rank says.
                rows = [
                    {"tokens": r["tokens"], "us": max(ranks[k]["rows"][i]["us"] for k in ranks)}
                    for i, r in enumerate(data["rows"])
                ]
                results[(data["backend"], data["mode"])] = {"rows": rows, "used": data["used"]}
                todo[data["backend"]].remove(data["mode"])

        modes = {b: list(m) for b, m in todo.items() if m}
        order = [b for b in ("nccl", "symm_mem", "torch") if b in modes]
        for conn in group.conns:
            conn.send(
                {
                    "type": "init",
                    "mode": "tune",
                    "device": device,
                    "dtype": args.dtype,
                    "hidden": hidden,
                    "tokens": args.tokens,
                    "iters": args.iters,
                    "runs": args.runs,
                    "backends": order,
                    "modes": modes,
                    "local": group.local,
                    "store_prefix": group.store_prefix,
                    "timeout_s": par.dist_timeout,
                }
            )
        try:
            group.recv_all(
                timeout=900,
                stall_timeout=args.graph_timeout,
                stall_phases=("graphs",),
                what="nccl-tune",
                on_progress=on_progress,
            )
            group.close()
        except PhaseTimeout as e:
            group.kill()
            backend = next(b for b in order if todo[b])  # the worker measures in `order`
            results[(backend, todo[backend].pop(0))] = "hung"
            log(f"  {backend}: CUDA graph capture stalled ({e}); workers killed, continuing")
        except WorkerError as e:
            group.kill()
            pending = [b for b in order if todo[b]]
            b = pending[0]
            results[(b, todo[b][0])] = "failed: " + str(e).splitlines()[0]
            todo[b].pop(0)
            log(f"  {b}: failed ({str(e).splitlines()[0]})")
    return {"results": results, "info": info, "env": wenv.requested}


def _fmt_table(name: str, backend: str, res: dict, hidden: int, dtype: str, n: int) -> list[str]:
    ebytes = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    eager, graph = res.get((backend, "eager")), res.get((backend, "graph"))
    used = eager["used"] if isinstance(eager, dict) else backend
    lines = [
        f"# profile {name}, all-reduce {backend}" + (f" (fell back to {used})" if used != backend else ""),
        f"# {'size':>10} {'count':>10} {'type':>5} {'redop':>5} {'tokens':>6}   "
        f"{'time(us)':>9} {'algbw':>7} {'busbw':>7}   {'graph(us)':>9} {'algbw':>7} {'busbw':>7}",
    ]
    if not isinstance(eager, dict):
        return lines + [f"#   eager: {eager}"]
    for i, row in enumerate(eager["rows"]):
        count = row["tokens"] * hidden
        size = count * ebytes
        cols = []
        for part in (eager, graph):
            if isinstance(part, dict):
                us = part["rows"][i]["us"]
                alg = size / (us * 1e-6) / 1e9
                cols.append(f"{us:9.2f} {alg:7.2f} {alg * 2 * (n - 1) / n:7.2f}")
            else:
                cols.append(f"{(part or '-')[:9]:>9} {'':>7} {'':>7}")
        lines.append(
            f"  {size:>10} {count:>10} {_DTYPE_NAMES[dtype]:>5} {'sum':>5} {row['tokens']:>6}   {cols[0]}   {cols[1]}"
        )
    return lines


def _score(res: dict, backend: str, decode_tokens: int) -> tuple[float, str] | None:
    """Geometric-mean microseconds over decode sizes: graph numbers if captured, else eager."""
    for mode in ("graph", "eager"):
        part = res.get((backend, mode))
        if isinstance(part, dict):
            us = [r["us"] for r in part["rows"] if r["tokens"] <= decode_tokens] or [part["rows"][0]["us"]]
            return math.exp(sum(math.log(max(u, 1e-3)) for u in us) / len(us)), mode
    return None


def run(args: argparse.Namespace) -> int:
    from specserve.config import ParallelConfig
    from specserve.distributed.nccl_profiles import PRESETS, load_profile, parse_env_args, write_profile

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    try:
        if args.tp < 2:
            raise ConfigError("--tp must be at least 2 (an all-reduce needs two ranks)")
        if any(t < 1 for t in args.tokens):
            raise ConfigError("--tokens must be positive")
        par = ParallelConfig(
            tp=args.tp,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            dist_init_addr=args.dist_init_addr,
            dist_timeout=args.dist_timeout,
            dist_key_file=args.dist_key_file,
        )
        if par.node_rank:  # a headless node: its workers measure when node 0 asks
            from specserve.distributed.multinode import run_node

            return run_node(par)
        hidden = _hidden_from(args)
        device = args.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda"):
            import torch

            if torch.cuda.device_count() < par.local_tp:
                where = f" on each of the {par.nnodes} nodes" if par.nnodes > 1 else ""
                raise ConfigError(
                    f"--tp {args.tp} needs {par.local_tp} GPUs{where}, {torch.cuda.device_count()} visible"
                )
            device = "cuda"
        elif device != "cpu":
            raise ConfigError(f"--device must be cuda, cpu or auto, got {device!r}")
        profiles = [load_profile(p) for p in (args.profiles or list(PRESETS))]
        parse_env_args(args.env)  # a bad --env fails here, before any worker starts
        backends = args.backends or (["nccl", "symm_mem", "torch"] if device == "cuda" else ["torch"])
        if device == "cpu":
            log(
                "note: on CPU the workers use gloo; NCCL profiles only matter for NCCL, so only the first "
                "profile is measured (torch.distributed, eager)"
            )
            profiles, backends = profiles[:1], ["torch"]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    t0 = time.time()
    report = {
        "tp": args.tp,
        "hidden": hidden,
        "dtype": args.dtype,
        "device": device,
        "tokens": args.tokens,
        "candidates": [],
    }
    lines = []
    best = None
    for prof in profiles:
        log(
            f"[nccl-tune] profile {prof.name}: {' '.join(f'{k}={v}' for k, v in prof.env.items()) or '(NCCL defaults)'}"
        )
        m = _measure_profile(prof, args, device, backends, hidden, log, par)
        report.setdefault("info", m["info"])
        for b in backends:
            lines += _fmt_table(prof.name, b, m["results"], hidden, args.dtype, args.tp) + [""]
            sc = _score(m["results"], b, args.decode_tokens)
            eager = m["results"].get((b, "eager"))
            used = eager["used"] if isinstance(eager, dict) else b
            cand = {
                "profile": prof.name,
                "backend": b,
                "backend_used": used,
                "env": prof.env,
                "worker_env": m["env"],
                "score_us": sc[0] if sc else None,
                "score_mode": sc[1] if sc else None,
                "measurements": {f"{k[0]}/{k[1]}": v for k, v in m["results"].items() if k[0] == b},
            }
            report["candidates"].append(cand)
            if sc and used == b and (best is None or sc[0] < best["score_us"]):
                best = cand
    info = report.get("info") or {}
    print(
        f"# nccl-tune: {args.tp} ranks, {info.get('device_name', device)}, torch {info.get('torch', '?')}, "
        f"NCCL {info.get('nccl_version') or '-'}, hidden {hidden}, {args.dtype}, {args.iters} ops x {args.runs} runs "
        f"(median)"
    )
    print("\n".join(lines))
    if best is None:
        print("error: no candidate could be measured", file=sys.stderr)
        return 1
    env = dict(best["env"])
    if device == "cuda":
        env["SPECSERVE_ALLREDUCE"] = best["backend"]
    summary = {
        c["profile"] + "/" + c["backend"]: (round(c["score_us"], 2) if c["score_us"] else None)
        for c in report["candidates"]
    }
    name = f"{best['profile']}+{best['backend']}" if device == "cuda" else best["profile"]
    path = None
    if args.out:
        path = write_profile(
            args.out,
            name,
            env,
            {
                "score_us": best["score_us"],
                "mode": best["score_mode"],
                "scores_us": summary,
                "tp": args.tp,
                "hidden": hidden,
                "decode_tokens": args.decode_tokens,
                "device": info.get("device_name"),
                "nccl": info.get("nccl_version"),
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
            },
        )
    print(
        f"# scores (geometric mean us over <= {args.decode_tokens} tokens): "
        + ", ".join(f"{k} {v}" for k, v in summary.items())
    )
    saved = (
        f"wrote {path} -> use: --nccl-profile {path}"
        if path
        else "not written (--out FILE saves it for --nccl-profile FILE)"
    )
    print(f"# best: {name} ({best['score_us']:.2f} us, {best['score_mode']}); {saved}   [{time.time() - t0:.0f} s]")
    if args.json:
        report["best"] = {"name": name, "env": env, "path": str(path) if path else None}
        for c in report["candidates"]:
            c["measurements"] = {k: v for k, v in c["measurements"].items()}
        print(json.dumps(report))
    return 0
