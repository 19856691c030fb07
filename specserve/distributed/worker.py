"""A tensor-parallel worker process: `python -m specserve.distributed.worker`.

Started by `WorkerGroup` (specserve.distributed.group), or on another node by
that node's launcher (specserve.distributed.multinode), with an explicit
environment and a connection to the driver (a socketpair, or TCP to node 0). In order, before anything else: die with the parent, read the
environment the kernel gave us (/proc/self/environ) and report it. Then, on the
driver's word: join the process group, set up collectives, and run either an
engine (SPMD: every rank runs the same requests in the same order; rank 0
answers) or the all-reduce tuner.

Messages on the driver connection (dicts in specserve.distributed.wire's JSON frames):
  worker -> driver  {"type": "hello" | "progress" | "ready" | "reply" | "error", ...}
  driver -> worker  {"type": "init", ...} then {"op": ..., ...} per command
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from specserve import envs

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the parent dies (prctl), plus a polling watchdog
    as a second belt (prctl is Linux-only and tied to the spawning thread)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def read_environ() -> dict[str, str]:
    """The environment this process was really started with."""
    try:
        raw = open("/proc/self/environ", "rb").read()
    except OSError:
        return dict(os.environ)  # no procfs (macOS): the best we have
    out = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode(errors="replace")] = v.decode(errors="replace")
    return out


class Channel:
    """The driver connection; progress messages say what this rank is doing."""

    def __init__(self, conn, rank: int):
        self.conn, self.rank = conn, rank

    def send(self, msg: dict) -> None:
        self.conn.send(msg)

    def progress(self, phase: str, text: str) -> None:
        self.conn.send({"type": "progress", "phase": phase, "text": text, "time": time.time()})


def _patch_capture_mode(mode: str) -> None:
    """Capture CUDA graphs in `mode` ('thread_local' by default in TP workers):
    NCCL's own threads and torch's NCCL watchdog may make CUDA calls while we
    capture, which the default 'global' mode turns into capture errors.
    (Scoped to this worker process; the runner could take the mode directly.)"""
    import torch

    base = torch.cuda.graph

    class graph(base):  # noqa: N801 - same name as what it replaces
        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode=None, **kw):
            super().__init__(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode or mode, **kw)

    torch.cuda.graph = graph


def probe_graph_capture(ch: Channel, cfg, device, hidden_size: int, dtype, rank: int, size: int) -> bool:
    """Whether this worker captures CUDA graphs: asked for, on CUDA, and an all-reduce captured
    in a probe graph first. Runs in the driver's "graphs" phase, so a rank that stalls here is
    reported and killed after its graph_capture_timeout."""
    from specserve.distributed import comm

    if not (cfg.cuda_graphs and device.type == "cuda"):
        return False
    _patch_capture_mode(envs.CAPTURE_MODE.get())
    ch.progress("graphs", "probe: capturing an all-reduce in a CUDA graph")
    comm.probe_capture(device, hidden_size, dtype, lambda s: ch.progress("graphs", s))
    return True


def run_engine(ch: Channel, rank: int, size: int, msg: dict) -> None:
    import torch

    from specserve.config import EngineConfig, ModelConfig
    from specserve.distributed import comm
    from specserve.distributed import parallel_state as ps
    from specserve.distributed.tp_llm import WorkerLLM, engine_facts, outputs_digest, seq_snapshot

    cfg = EngineConfig.from_kwargs(**msg["engine"])
    device = torch.device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    ch.progress("init", f"joining the process group ({'gloo' if device.type == 'cpu' else 'nccl + gloo'})")
    ps.init_distributed(rank, size, device, msg["timeout_s"], msg["store_prefix"])
    mcfg = ModelConfig.from_dir(cfg.model)
    from specserve.model.loader import resolve_dtype

    dtype = resolve_dtype(cfg.dtype, mcfg.dtype, device)
    backend = comm.install(envs.ALLREDUCE.get(), rank, size, device, dtype, ps._GROUP, ps._CONTROL_GROUP)
    comm.warm_up(device, mcfg.hidden_size, dtype)
    ch.progress("init", f"collectives ready (all-reduce: {backend})")
    graphs = probe_graph_capture(ch, cfg, device, mcfg.hidden_size, dtype, rank, size)
    ch.progress("load", "loading weights (sharded)")
    t0 = time.perf_counter()
    llm = WorkerLLM(cfg)  # built without graphs: capture runs below, under the driver's timeout
    ch.progress("graphs" if graphs else "load", f"weights loaded in {llm.engine.runner.load_seconds:.1f} s")
    if graphs:
        llm.capture_graphs(
            lambda n, total, key, B: ch.send(
                {
                    "type": "progress",
                    "phase": "graphs",
                    "text": f"captured graph {n}/{total} {'/'.join(map(str, key))} batch {B}",
                    "data": {"graph": [n, total, list(key), B]},
                }
            )
        )
    engine = llm.engine
    if engine.policy is not None and cfg.spec.adaptive and size > 1:
        engine.policy.sync_choice = ps.broadcast_int
    if graphs:
        # Replay every graph once, all ranks together: a graph that captured but hangs on
        # replay is caught here, under the driver's timeout, not at the first request.
        for n, g in enumerate(engine.runner.graphs.values()):
            g.graph.replay()
        torch.cuda.synchronize(device)
        ch.progress("graphs", f"replayed {len(engine.runner.graphs)} graphs")
    ch.send(
        {
            "type": "ready",
            "allreduce": backend,
            "startup_seconds": time.perf_counter() - t0,
            **engine_facts(engine),
            "draft_embedding": llm.draft_embedding,
            "stats": llm.light_stats(),
        }
    )

    while True:
        cmd = ch.conn.recv()
        op = cmd["op"]
        try:
            if op == "generate":
                outs = llm.generate(cmd["prompts"], cmd["params"])
                reply = outs if rank == 0 else outputs_digest(outs)
            elif op == "add":
                seq = engine.add_request(cmd["prompt_ids"], cmd["params"], cmd["seq_id"])
                reply = seq.seq_id
            elif op == "step":
                touched = engine.step()
                reply = (
                    [seq_snapshot(s) for s in touched]
                    if rank == 0
                    else outputs_digest([(s.seq_id, s.new_tokens) for s in touched])
                )
            elif op == "abort":
                engine.abort(cmd["seq_id"])
                reply = None
            elif op == "profile":
                reply = list(engine.profile)
            elif op == "policy_snapshot":
                reply = engine.policy.snapshot() if engine.policy is not None else None
            elif op == "profile_summary":
                reply = llm.profile_summary()
            elif op == "set_profile":  # per-cycle timing on/off (read by the engine every step)
                engine.profiling = bool(cmd["on"])
                reply = None
            elif op == "check_idle":
                try:
                    engine.check_idle_integrity()
                    reply = None
                except AssertionError as e:
                    reply = str(e)
            elif op == "shutdown":
                ch.send({"type": "reply", "ok": None})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
        except ValueError as e:  # bad input, found the same way on every rank before any collective
            ch.send({"type": "reply", "value_error": str(e)})
            continue
        ch.send({"type": "reply", "ok": reply, "stats": llm.light_stats() if rank == 0 else None})


def main() -> int:
    rank = envs.TP_RANK.require()
    size = envs.TP_SIZE.require()
    die_with_parent(envs.TP_PARENT_PID.require())
    environ = read_environ()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; we follow it
    from specserve.distributed.wire import Conn  # JSON frames: nothing received can run code

    ch = Channel(Conn(envs.TP_FD.require()), rank)
    ch.send({"type": "hello", "rank": rank, "pid": os.getpid(), "environ": environ})
    try:
        msg = ch.conn.recv()
    except EOFError:
        return 1
    import logging

    logging.basicConfig(level=logging.INFO, format=f"[tp worker {rank}] %(message)s", stream=sys.stderr)
    try:
        if msg["mode"] == "engine":
            run_engine(ch, rank, size, msg)
        elif msg["mode"] == "tune":
            from specserve.distributed.nccl_tune import run_worker

            run_worker(ch, rank, size, msg)
        else:
            raise ValueError(f"unknown worker mode {msg['mode']!r}")
    except (EOFError, BrokenPipeError):
        return 1  # the driver went away
    except BaseException as e:  # noqa: BLE001 - report everything to the driver, then exit
        try:
            ch.send(
                {
                    "type": "error",
                    "kind": type(e).__name__,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
            )
        except (OSError, EOFError):
            pass
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: destroying NCCL state after captured collectives can hang
    # (pytorch/pytorch#115388); the driver has its answer already.
    os._exit(code)
