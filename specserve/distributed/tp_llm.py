"""Tensor parallelism for the Python API, `generate`, `bench` and `serve`.

    llm = TPLLM(model=..., draft=..., spec_steps=4, tp=2, env={"NCCL_DEBUG": "WARN"},
                nccl_profile="pcie-low-latency")
    outs = llm.generate(["def f(x):"], SamplingParams(temperature=0))
    llm.worker_env()   # per-worker NCCL_* and requested variables, as each worker saw them
    llm.close()

SPMD design: the driver (this process) spawns one worker per GPU (rank r uses
cuda:r; gloo on CPU). Every worker loads its shard of the target (column/row
parallel linears, vocab-parallel embedding and head) and a full copy of the
drafter (replicated: one layer, so sharding would add two collectives per draft
step for little memory), and runs an ordinary Engine. The driver sends every
command to all workers; they take identical decisions because the engine is
deterministic given the same requests and seeds (the driver gives each request
an explicit seed) and the one timing-based decision, the adaptive K, is rank
0's choice broadcast to all (SpecPolicy.sync_choice). Rank 0 answers; the
others send a digest of their results, which must match. With `nnodes` > 1 the
ranks are spread over machines (specserve.distributed.multinode): this process
is node 0's driver, worker r runs on node r // (tp / nnodes) as cuda:r % (tp /
nnodes), and everything else is the same.

CUDA graphs with collectives are guarded: a capture probe, the engine's
captures and one replay of every graph run while the driver watches each
worker's progress; no progress for `graph_capture_timeout` seconds (or an error
in that phase) kills the workers, logs a warning and restarts them without CUDA
graphs. A hung NCCL call cannot be interrupted inside its process, which is why
the timeout is the driver's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import random
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

from specserve import envs
from specserve.config import ConfigError, EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.llm import LLM, RequestOutput, attach_grammars, default_pair, prepare_requests
from specserve.engine.protocol import ServingEngine, SpeculationPolicy
from specserve.engine.sampling import SamplingParams
from specserve.engine.sequence import Sequence, SpecStats, Status
from specserve.engine.tokenizer import Tokenizer
from specserve.model.gguf import find_gguf, require_model

log = logging.getLogger("specserve.tp")


# ------------------------------------------------------------------ worker side
class WorkerLLM(LLM):
    """An LLM inside a TP worker: built without CUDA graphs so that the worker
    can report "weights loaded" before capturing (under the driver's timeout)."""

    def __init__(self, cfg: EngineConfig):
        self.config = cfg
        self.tokenizer = Tokenizer(cfg.model)
        eager = dataclasses.replace(cfg, cuda_graphs=False)  # graphs come later, from `capture_graphs`
        self.engine = Engine(eager, eos_token_ids=self.tokenizer.eos_token_ids, stop_checker=self._stop_hit)
        attach_grammars(self.engine, self.tokenizer)
        self.draft_embedding = self._replicate_draft_embedding()

    def _replicate_draft_embedding(self) -> str:
        """A drafter without its own embedding reads the target's, which is vocab-parallel
        under TP: one all-reduce per draft step. Give it a full local copy instead (vocab x
        hidden, 1 GB for a 128k x 4096 bf16 table); SPECSERVE_TP_DRAFT_EMBED=shared keeps
        the sharded one to save that memory."""
        r = self.engine.runner
        d = r.drafter
        if d is None:
            return "none"
        if d.embed_tokens is not None:
            return "own"
        from specserve.distributed.parallel_state import tp_size

        if tp_size() == 1 or envs.TP_DRAFT_EMBED.get() == "shared":
            return "shared (vocab-parallel)"
        import torch
        from safetensors import safe_open

        from specserve.model.loader import checkpoint_files

        name = "model.embed_tokens.weight"
        for f in checkpoint_files(Path(self.config.model), self.config.allow_pickle):
            if f.suffix != ".safetensors":
                return "shared (vocab-parallel)"  # pickles: not worth a second full read
            with safe_open(str(f), framework="pt", device="cpu") as st:
                if name in st.keys():
                    w = st.get_tensor(name).to(device=r.device, dtype=r.dtype)
                    d.target_embed = torch.nn.Embedding.from_pretrained(w, freeze=True)
                    return "replicated"
        return "shared (vocab-parallel)"

    def capture_graphs(self, on_progress) -> None:
        """The graph families Engine.__init__ captures, for an engine built without them."""
        e = self.engine
        e.graph_seconds = e.runner.capture_graphs(e.spec_values, on_progress, enabled=self.config.cuda_graphs)

    def light_stats(self) -> dict:
        """Counters attached to every reply of rank 0 (cheap; no per-cycle profile)."""
        e = self.engine
        return {
            "totals": dataclasses.asdict(e.totals),
            "tokens_generated": e.tokens_generated,
            "last_k": e.last_k,
            "policy": policy_facts(e.policy),
            "kv_usage": e.kv_usage(),
            "n_running": e.n_running,
            "waiting_ids": [s.seq_id for s in e.waiting],
            "free_rows": e.free_rows,
        }


def policy_facts(policy: SpeculationPolicy | None) -> dict | None:
    """Everything `SpeculationPolicy` offers, as plain data for the driver's `_PolicyView`."""
    if policy is None:
        return None
    return {
        "k_max": policy.k_max,
        "choices": dict(policy.choices),
        "acceptance": policy.acceptance(),
        "acceptance_tree": policy.acceptance(True),
    }


def engine_facts(engine: Engine) -> dict:
    """A worker's engine as its driver's `TPEngineView` presents it (fixed after start-up)."""
    r = engine.runner
    return {
        "graphs": len(r.graphs),
        "graph_seconds": engine.graph_seconds,
        "load_seconds": r.load_seconds,
        "max_model_len": engine.max_model_len,
        "rows": r.rows,
        "device": str(engine.device),
        "dtype": str(r.dtype),
        "kv_bytes": r.kv.nbytes(),
        "has_drafter": r.drafter is not None,
    }


def outputs_digest(obj) -> str:
    """A short hash of what a rank produced (token ids), to check that ranks agree."""
    if isinstance(obj, list) and obj and isinstance(obj[0], RequestOutput):
        obj = [(o.request_id, o.token_ids, o.finish_reason) for o in obj]
    return hashlib.sha256(repr(obj).encode()).hexdigest()[:16]


def seq_snapshot(s: Sequence) -> dict:
    new_logprobs = s.logprobs[len(s.output_ids) - len(s.new_tokens) :] if s.logprobs is not None else None
    return {
        "seq_id": s.seq_id,
        "new_tokens": list(s.new_tokens),
        "new_logprobs": new_logprobs,
        "finish_reason": s.finish_reason,
        "spec": dataclasses.asdict(s.spec),
    }


# ------------------------------------------------------------------ driver side
def _ensure_log_handler() -> None:
    """Start-up lines (worker environments, capture progress) must be visible even
    when the embedding program configured no logging."""
    root = logging.getLogger()
    if not root.handlers and not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def graphs_possible(device) -> bool:
    """CUDA graphs need a CUDA device (elsewhere the workers run eagerly, with no capture phase)."""
    return device.type == "cuda"


class TPLLM:
    """Same interface as `LLM` (generate, profile_summary, tokenizer, config,
    engine), backed by `tp` worker processes. Extra: worker_env(), worker_pids(),
    info (start-up facts), warnings (e.g. the CUDA graph fallback), close()."""

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = None,
        env: dict | None = None,
        nccl_profile: str | None = None,
        on_graph_progress=None,
        start_timeout: float = 3600.0,
        on_group_lost=None,
        **engine_kwargs,
    ):
        from specserve.distributed.group import PhaseTimeout, WorkerError
        from specserve.distributed.nccl_profiles import build_worker_env, load_profile
        from specserve.model.loader import resolve_device

        _ensure_log_handler()
        model, draft = default_pair(model, draft, speculating=bool(engine_kwargs.get("spec_steps", 0)))
        if find_gguf(str(model)) is not None:
            raise ConfigError(
                f"--tp shards safetensors checkpoints; convert {model} first "
                "(specserve convert-gguf IN.gguf OUT_DIR) and pass --model OUT_DIR"
            )
        require_model(str(model))
        kw = dict(engine_kwargs, env=dict(env or {}), nccl_profile=nccl_profile or "default")
        self.config = cfg = EngineConfig.from_kwargs(model=str(model), draft=draft, **kw)
        par = cfg.parallel
        if par.tp < 2:
            raise ConfigError("TPLLM needs tp >= 2; use LLM for a single process")
        if par.node_rank != 0:
            raise ConfigError(
                f"--node-rank {par.node_rank} runs headless (specserve.distributed.multinode.run_node); "
                "only node 0 drives the workers"
            )
        self.device = device = resolve_device(cfg.device)
        if device.type == "cuda":
            import torch

            local = par.local_tp
            if device.index not in (None, 0):
                raise ConfigError(
                    f"--device {cfg.device} with --tp {par.tp}: TP workers use cuda:0..cuda:{local - 1}; "
                    "select GPUs with CUDA_VISIBLE_DEVICES instead"
                )
            if torch.cuda.device_count() < local:
                where = f" on each of the {par.nnodes} nodes" if par.nnodes > 1 else ""
                raise ConfigError(f"--tp {par.tp} needs {local} GPUs{where}, {torch.cuda.device_count()} visible")
        self.model_cfg = self._check_divisible()
        self.tokenizer = Tokenizer(cfg.model)
        self.nccl_profile = load_profile(cfg.parallel.nccl_profile)
        self.wenv = build_worker_env(dict(os.environ), self.nccl_profile, cfg.parallel.env)
        for note in self.wenv.notes:
            log.warning("[tp] %s", note)
        self.warnings: list[str] = []
        self.group = None
        self._on_graph = on_graph_progress
        self._on_group_lost = on_group_lost
        self._broken: str | None = None
        self._seqs: dict[str, Sequence] = {}
        self._ids = 0
        self._stats: dict = {}
        # The workers' engines are single-process engines inside the group: no node or profile settings.
        base = {
            k: v
            for k, v in cfg.flat().items()
            if k not in ("env", "nccl_profile", "nnodes", "node_rank", "dist_init_addr", "dist_timeout")
        }
        graphs = cfg.cuda_graphs and graphs_possible(device)
        try:
            self._start(base, graphs, start_timeout)
        except (PhaseTimeout, WorkerError) as e:
            if not graphs or e.phase != "graphs":
                raise
            msg = (
                f"CUDA graph capture with collectives failed or stalled ({str(e).splitlines()[0]}); restarted "
                f"the TP workers without CUDA graphs (eager collectives, slower decoding). --disable-cuda-graph "
                f"skips the attempt; another all-reduce can be tried with --env SPECSERVE_ALLREDUCE=torch|nccl|symm_mem"
            )
            log.warning("[tp] warning: %s", msg)
            self.warnings.append(msg)
            self._start(base, False, start_timeout)
        self._finalizer = weakref.finalize(self, _close_group, self.group)  # also runs at interpreter exit

    def _check_divisible(self):
        from specserve.config import ModelConfig

        m, tp = ModelConfig.from_dir(self.config.model), self.config.parallel.tp
        for what, n in (
            ("num_attention_heads", m.num_heads),
            ("num_key_value_heads", m.num_kv_heads),
            ("intermediate_size", m.intermediate_size),
            ("vocab_size", m.vocab_size),
        ):
            if n % tp:
                raise ConfigError(f"--tp {tp}: the target's {what} ({n}) is not divisible by {tp}")
        return m

    def _start(self, base: dict, graphs: bool, timeout: float) -> None:
        from specserve.distributed.group import WorkerGroup

        par = self.config.parallel
        if par.nnodes > 1:
            from specserve.distributed.multinode import Cluster

            cluster = Cluster.get(par)  # the other nodes join here (bounded by --dist-timeout)
            self.group = group = WorkerGroup(
                par.tp, self.wenv, cluster=cluster, profile=self.nccl_profile, explicit=par.env
            )
            pg_timeout = par.dist_timeout
        else:
            self.group = group = WorkerGroup(par.tp, self.wenv)
            pg_timeout = min(timeout, 600.0)
        group.on_lost = self._group_lost

        def on_progress(rank, msg):
            g = (msg.get("data") or {}).get("graph")
            if g and rank == 0 and self._on_graph is not None:
                self._on_graph(g[0], g[1], tuple(g[2]), g[3])

        try:
            for rank, conn in enumerate(group.conns):
                dev = f"cuda:{rank % group.local}" if self.device.type == "cuda" else "cpu"
                conn.send(
                    {
                        "type": "init",
                        "mode": "engine",
                        "engine": dict(base, cuda_graphs=graphs, device=dev),
                        "timeout_s": pg_timeout,
                        "store_prefix": group.store_prefix,
                    }
                )
            ready = group.recv_all(
                timeout=timeout,
                stall_timeout=self.config.parallel.capture_timeout if graphs else None,
                what="start-up",
                on_progress=on_progress,
            )
        except BaseException:
            group.kill()
            raise
        self.info = {k: v for k, v in ready[0].items() if k not in ("type", "stats")}
        self.info.update(graphs_enabled=graphs, nccl_profile=self.nccl_profile.name, env_notes=list(self.wenv.notes))
        self._stats = ready[0]["stats"]
        group.watch()  # a worker that dies while serving ends the group at once, also when idle
        log.info(
            "[tp] %d workers ready: all-reduce %s, %d CUDA graphs, max_model_len %d",
            self.config.parallel.tp,
            self.info["allreduce"],
            self.info["graphs"],
            self.info["max_model_len"],
        )

    def _group_lost(self, reason: str) -> None:
        """A node or worker went away (monitor or watch thread): the group is over; the caller may end
        the process."""
        self._broken = reason
        if self._on_group_lost is not None:
            self._on_group_lost(reason)

    # ------------------------------------------------------------------ API
    def worker_env(self) -> list[dict]:
        """Per worker: {"rank", "pid", "env": {NCCL_*, TORCH_NCCL_* and requested variables}} as the
        worker read them from /proc/self/environ at start (for logs and /server_info)."""
        return [dict(r, env=dict(r["env"])) for r in self.group.env_reports]

    def worker_pids(self) -> list[int]:
        return self.group.pids()

    def encode_prompts(self, prompts) -> list[list[int]]:
        return prepare_requests(self.tokenizer, prompts, None)[0]

    @staticmethod
    def _seeded(p: SamplingParams) -> SamplingParams:
        # Every rank must draw the same noise: the driver picks the seed, not each worker.
        return p if p.seed is not None else dataclasses.replace(p, seed=random.getrandbits(31))

    def _request(self, msg: dict, what: str, bounded: bool = True) -> list:
        """`msg` to every worker, their replies. `bounded`: a worker silent for --dist-timeout is
        stuck (one step or command never takes that long), which ends the group like a dead one;
        `generate` runs a whole batch and is not bounded."""
        from specserve.distributed.group import WorkerError

        if self._broken:
            raise RuntimeError(f"the TP workers failed earlier and were stopped: {self._broken}")
        try:
            replies = self.group.request(msg, what=what, timeout=self.config.parallel.dist_timeout if bounded else None)
        except WorkerError as e:
            self._broken = str(e).splitlines()[0]
            self.group.kill()
            raise
        if replies[0].get("stats") is not None:
            self._stats = replies[0]["stats"]
        errs = [r["value_error"] for r in replies if "value_error" in r]
        if errs:
            raise ValueError(errs[0])
        return [r["ok"] for r in replies]

    def _check_agree(self, first, others: list[str], what: str) -> None:
        want = outputs_digest(first)
        bad = [i + 1 for i, d in enumerate(others) if d != want]
        if bad:
            self._broken = f"rank(s) {bad} produced different {what} than rank 0"
            self.group.kill()
            raise RuntimeError(f"TP ranks diverged: {self._broken} (a nondeterministic decision was not synchronized)")

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, progress: bool = False
    ) -> list[RequestOutput]:
        """Like LLM.generate (the batch runs to completion inside the workers)."""
        ids, params = prepare_requests(self.tokenizer, prompts, sampling_params)
        replies = self._request(
            {"op": "generate", "prompts": ids, "params": [self._seeded(p) for p in params]}, "generate", bounded=False
        )
        self._check_agree(replies[0], replies[1:], "outputs")
        return replies[0]

    def profile_summary(self) -> dict:
        return self._request({"op": "profile_summary"}, "profile_summary")[0]

    def set_profile(self, on: bool) -> None:
        """Turn per-cycle draft/verify/accept timing on or off in every worker."""
        self._request({"op": "set_profile", "on": bool(on)}, "set_profile")

    @property
    def engine(self) -> "TPEngineView":
        return TPEngineView(self)

    def close(self) -> None:
        """Stop the workers (also done at interpreter exit)."""
        if self.group is not None:
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------- step-wise driving (server)
    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None) -> Sequence:
        if seq_id is None:
            seq_id = f"seq-{self._ids}"
            self._ids += 1
        if seq_id in self._seqs:
            raise ValueError(f"request id {seq_id!r} is already in use")
        params = self._seeded(params)
        self._request({"op": "add", "prompt_ids": list(prompt_ids), "params": params, "seq_id": seq_id}, "add_request")
        seq = Sequence(seq_id, list(prompt_ids), params, params.seed)
        if params.logprobs is not None:
            seq.logprobs = []
        self._seqs[seq_id] = seq
        return seq

    def step(self) -> list[Sequence]:
        """One engine step on every rank; returns the touched sequences (driver-side mirrors
        whose timestamps are taken here, when their tokens reach the driver)."""
        for s in self._seqs.values():
            s.new_tokens = []
        replies = self._request({"op": "step"}, "step")
        snaps = replies[0]
        self._check_agree([(s["seq_id"], s["new_tokens"]) for s in snaps], replies[1:], "steps")
        now, out = time.perf_counter(), []
        for snap in snaps:
            seq = self._seqs.get(snap["seq_id"])
            if seq is None:
                continue
            seq.new_tokens = snap["new_tokens"]
            seq.output_ids.extend(seq.new_tokens)
            if seq.logprobs is not None:
                seq.logprobs.extend(snap["new_logprobs"])
            if seq.new_tokens and seq.first_token_time is None:
                seq.first_token_time = now
            seq.spec = SpecStats(**snap["spec"])
            seq.status = Status.RUNNING
            if snap["finish_reason"] is not None:
                seq.finish_reason, seq.finish_time, seq.status = snap["finish_reason"], now, Status.FINISHED
                del self._seqs[seq.seq_id]
            out.append(seq)
        return out

    def abort(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._request({"op": "abort", "seq_id": seq_id}, "abort")
        seq.finish_reason, seq.finish_time, seq.status = "abort", time.perf_counter(), Status.FINISHED

    def has_work(self) -> bool:
        return bool(self._seqs)


class _PolicyView(SpeculationPolicy):
    """Rank 0's policy as of its last reply (`policy_facts`); `snapshot()` asks the workers."""

    def __init__(self, facts: dict, llm: TPLLM):
        self.k_max = facts["k_max"]
        self.choices = {int(k): v for k, v in facts["choices"].items()}
        self._acc = {False: facts["acceptance"], True: facts["acceptance_tree"]}
        self._llm = llm

    def acceptance(self, tree: bool = False) -> list[float]:
        return list(self._acc[tree])

    def snapshot(self) -> dict:
        return self._llm._request({"op": "policy_snapshot"}, "policy_snapshot")[0]


class TPEngineView(ServingEngine):
    """The `ServingEngine` over TP workers: counters from rank 0 as of the last reply (no extra
    round trip); add_request/step/abort/has_work drive the workers; `profile` and
    `check_idle_integrity()` ask them."""

    def __init__(self, llm: TPLLM):
        self._llm = llm
        self.cfg = llm.config
        self.add_request, self.step, self.abort, self.has_work = llm.add_request, llm.step, llm.abort, llm.has_work
        info = llm.info
        self.max_model_len = info["max_model_len"]
        self.graph_seconds = info["graph_seconds"]
        self.device = llm.device
        import torch

        self.runner = SimpleNamespace(
            model_cfg=llm.model_cfg,
            dtype=getattr(torch, info["dtype"].split(".")[-1]),
            rows=info["rows"],
            load_seconds=info["load_seconds"],
            drafter=True if info["has_drafter"] else None,
        )

    @property
    def _s(self) -> dict:
        return self._llm._stats

    @property
    def totals(self) -> SpecStats:
        return SpecStats(**self._s["totals"])

    @property
    def tokens_generated(self) -> int:
        return self._s["tokens_generated"]

    @property
    def last_k(self) -> int:
        return self._s["last_k"]

    @property
    def policy(self) -> _PolicyView | None:
        return _PolicyView(self._s["policy"], self._llm) if self._s["policy"] is not None else None

    @property
    def waiting(self) -> list[Sequence]:
        return [self._llm._seqs[i] for i in self._s["waiting_ids"] if i in self._llm._seqs]

    @property
    def n_running(self) -> int:
        return self._s["n_running"]

    @property
    def free_rows(self) -> int:
        return self._s["free_rows"]

    def kv_usage(self) -> dict:
        return dict(self._s["kv_usage"])

    @property
    def profile(self) -> list[dict]:
        return self._llm._request({"op": "profile"}, "profile")[0]

    def check_idle_integrity(self) -> None:
        problems = [p for p in self._llm._request({"op": "check_idle"}, "check_idle") if p]
        if problems or self._llm.has_work():
            raise AssertionError(problems[0] if problems else f"driver still tracks {len(self._llm._seqs)} sequences")


def _close_group(group) -> None:
    if group is not None:
        group.close()
