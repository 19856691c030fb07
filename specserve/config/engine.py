"""Settings of one engine: engine-wide options, speculation (`SpecConfig`) and parallelism
(`ParallelConfig`), all frozen once built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specserve.config.files import DEMO_DIR
from specserve.errors import ConfigError

# Tree drafts: each query carries its ancestors as bits of one int64 (bit 63 unused: the sign).
MAX_TREE_NODES = 63
# Prefill CUDA graphs (the engine captures them; `check` counts their memory).
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512)  # prompt lengths (padded up) prefilled by a CUDA graph
# Fresh prompts a prefill graph takes at once, packed one after another (their lengths summed as one prompt's):
# an eager forward of a few short prompts costs the host a launch per op and layer, a graph replay the GPU's time only.
PREFILL_GRAPH_PROMPTS = 16


def prefill_stage_len(longest: int) -> int:
    """Slots of the prefill graphs' one-row staging cache for prompts of up to `longest` tokens:
    those plus a scratch slot for the padding, rounded up to 16."""
    return -(-(longest + 1) // 16) * 16


SPEC_METHODS = ("eagle3", "mtp", "ngram", "suffix")
DRAFT_FREE_METHODS = ("ngram", "suffix")  # drafts come from token history: no drafter forward


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: where drafts come from (`method`), how many tokens to draft per cycle
    and in what shape."""

    method: str = "eagle3"  # eagle3 (--draft), mtp (the target's own MTP layer), ngram or suffix (draft-free)
    steps: int = 0  # K draft tokens per cycle; 0 = plain decoding
    max_steps: int | None = None  # largest K the adaptive policy may use (default: steps)
    adaptive: bool = False
    topk: int = 1  # >1: a tree of drafts (the best `topk` branches kept at each depth)
    tokens: int | None = None  # tree nodes verified per cycle (default: topk * K, at most 63)
    tree_max_batch: int = 2  # larger batches draft chains: verifying a tree per sequence is compute-bound there
    draft_position_extension: bool = False  # draft past the drafter's max_position_embeddings
    ngram_min: int = 2  # ngram: shortest suffix of the text matched against its earlier tokens
    ngram_max: int = 5  # ngram: longest (the longest that matches is used)
    # With a drafter model (eagle3, mtp): also draft from the text by this draft-free method, and use those drafts
    # in cycles where they are likely to do better (spec.draft_free.TextFirst)
    text_drafts: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"--speculative-method must be one of {', '.join(SPEC_METHODS)}, got {self.method!r}")
        if self.text_drafts is not None and (self.text_drafts not in DRAFT_FREE_METHODS or self.draft_free):
            raise ConfigError(
                f"--text-drafts takes {' or '.join(DRAFT_FREE_METHODS)}, beside a drafter model "
                f"(--speculative-method eagle3 or mtp); got {self.text_drafts!r} with {self.method}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError(
                f"--ngram-min / --ngram-max must satisfy 1 <= min <= max <= 64, got {self.ngram_min} / {self.ngram_max}"
            )
        if self.steps < 0 or self.steps > 16:
            raise ConfigError(f"--spec-steps must be in 0..16, got {self.steps}")
        if self.max_steps is None:
            object.__setattr__(self, "max_steps", self.steps)
        if self.max_steps < self.steps:
            raise ConfigError("--max-spec-steps must be at least --spec-steps")
        if not 1 <= self.topk <= 16:
            raise ConfigError(f"--spec-topk must be in 1..16, got {self.topk}")
        if self.topk > 1:
            k_max = self.max_steps
            if self.topk * max(k_max - 1, 0) > MAX_TREE_NODES:
                raise ConfigError(
                    f"--spec-topk {self.topk} with up to {k_max} steps needs "
                    f"{self.topk * (k_max - 1)} drafter tree slots; at most {MAX_TREE_NODES} "
                    f"are supported: lower --spec-topk or --spec-steps"
                )
            if self.tokens is not None and not 1 <= self.tokens <= MAX_TREE_NODES:
                raise ConfigError(f"--spec-tokens must be in 1..{MAX_TREE_NODES}, got {self.tokens}")
            if self.tree_max_batch < 1:
                raise ConfigError(f"--spec-tree-max-batch must be at least 1, got {self.tree_max_batch}")
        elif self.tokens is not None:
            raise ConfigError("--spec-tokens sizes a tree of drafts: it needs --spec-topk > 1")

    @property
    def draft_free(self) -> bool:
        return self.method in DRAFT_FREE_METHODS

    def cache_room(self, k_max: int) -> int:
        """KV slots past a sequence's end that one cycle may write (`k_max`: the largest K, 0
        without a drafter): K verify tokens for a chain; for a tree the most verify nodes or
        drafter frontier slots (top-k per depth after the first)."""
        if self.topk > 1 and k_max:
            return max(k_max, self.tree_nodes(k_max), self.topk * (k_max - 1))
        return k_max

    def drafts_tree(self, B: int) -> bool:
        """Whether a speculative cycle over B sequences drafts a tree (else a chain): small
        batches only, since verifying a tree per sequence makes large batches compute-bound."""
        return self.topk > 1 and B <= self.tree_max_batch

    def tree_nodes(self, K: int) -> int:
        """Draft tokens verified per cycle at depth K: K for a chain (top-k 1), else the best
        `tokens` of the tree's candidates (top-k at depth 1, top-k of each kept branch after)."""
        if self.topk == 1:
            return K
        candidates = self.topk + (K - 1) * self.topk**2
        return min(candidates, self.tokens or self.topk * K, MAX_TREE_NODES)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: how many ranks, their environment and collectives tuning."""

    tp: int = 1
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the TP workers
    nccl_profile: str = "default"
    capture_timeout: float = 300.0  # seconds a worker's graph capture may stall before a restart without graphs
    nnodes: int = 1  # machines the tp ranks are spread over (tp / nnodes workers on each)
    node_rank: int = 0  # this machine's place: 0 drives the step (HTTP, generate, bench), the others are headless
    dist_init_addr: str | None = None  # HOST:PORT of node 0, reachable from every node (PORT and PORT+1 are used)
    dist_timeout: float = 300.0  # seconds for a node to join and for any collective across nodes
    dist_key_file: str | None = None  # the nodes' shared secret (specserve.distributed.dist_key)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"--tp must be at least 1, got {self.tp}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes} "
                f"(0..{self.nnodes - 1}; node 0 drives, the others are headless)"
            )
        if self.dist_timeout <= 0:
            raise ConfigError(f"--dist-timeout must be positive seconds, got {self.dist_timeout}")
        if self.nnodes == 1:
            if self.dist_init_addr is not None:
                raise ConfigError("--dist-init-addr is only used with --nnodes > 1 (one node needs no address)")
            return
        if self.dist_init_addr is None:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT: node 0's address, reachable from every node"
            )
        parse_dist_addr(self.dist_init_addr)
        if self.tp % self.nnodes:
            raise ConfigError(
                f"--tp {self.tp} is not divisible by --nnodes {self.nnodes}: every node runs tp / nnodes workers"
            )

    @property
    def local_tp(self) -> int:
        """Workers on each node."""
        return self.tp // self.nnodes


def parse_dist_addr(text: str) -> tuple[str, int]:
    """`--dist-init-addr HOST:PORT` (IPv6 as [ADDR]:PORT) -> (host, port). PORT is the
    rendezvous store and PORT+1 node 0's channel to the other nodes' launchers."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--dist-init-addr {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29500")
    if not 1 <= int(port) <= 65534:
        raise ConfigError(f"--dist-init-addr {text!r}: port must be 1..65534 (PORT and PORT+1 are used)")
    return host, int(port)


_GROUP_CLASSES = {"spec": SpecConfig, "parallel": ParallelConfig}


class _Grouped:
    """A flat name of a grouped setting, read through the group: `cfg.spec_steps` is
    `cfg.spec.steps`; on the class, the group's default (`EngineConfig.spec_tree_max_batch`)."""

    def __init__(self, group: str, key: str):
        self.group, self.key = group, key

    def __get__(self, obj, owner=None):
        if obj is None:
            default = _GROUP_CLASSES[self.group].__dataclass_fields__[self.key].default
            return None if default is dataclasses.MISSING else default
        return getattr(getattr(obj, self.group), self.key)


def check_max_num_seqs(n: int) -> None:
    """Every engine needs a KV row: a count below 1 is refused, never replaced by a default."""
    if n < 1:
        raise ConfigError(f"--max-num-seqs must be at least 1, got {n}")


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Settings of one engine instance, frozen once built: engine-wide fields here, speculation in
    `spec`, tensor parallelism in `parallel`. Built from the flat option names (as the CLI and
    `LLM(**kwargs)` give them: `spec_steps`, `tp`, ...), which also read back (`cfg.spec_steps`);
    `dataclasses.replace` makes a changed copy, flat names included."""

    model: str = str(DEMO_DIR)
    draft: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    prefill_chunk: int = 512
    admit_wait: int = 0  # steps free rows may wait for more arrivals to prefill together (Engine._admission_deferred)
    kv_block_size: int = 16  # tokens per KV block
    kv_cache_tokens: int | None = None  # KV pool size in tokens (None: see gpu_memory_utilization)
    gpu_memory_utilization: float | None = (
        None  # GPU: size the pool to this fraction of memory (None: max_num_seqs x max_model_len)
    )
    prefix_cache: bool = False  # share full prompt blocks across requests by content
    cuda_graphs: bool = True
    batch_invariant: bool = False  # GPU products of 1-64 rows take one fixed GEMV shape (tune_linear, tune_int4)
    graph_batch_sizes: tuple[int, ...] | None = None
    aux_layer_convention: str = "sglang"
    allow_pickle: bool = False
    profile: bool = False  # per-cycle timing from the start (`Engine.profiling` switches it at run time)
    seed: int = 0
    spec: SpecConfig = SpecConfig()
    parallel: ParallelConfig = ParallelConfig()

    # The grouped settings under their flat option names (CLI flags, `LLM(**kwargs)`), read through the group.
    spec_method = _Grouped("spec", "method")
    ngram_min = _Grouped("spec", "ngram_min")
    ngram_max = _Grouped("spec", "ngram_max")
    spec_text_drafts = _Grouped("spec", "text_drafts")
    spec_steps = _Grouped("spec", "steps")
    max_spec_steps = _Grouped("spec", "max_steps")
    adaptive = _Grouped("spec", "adaptive")
    spec_topk = _Grouped("spec", "topk")
    spec_tokens = _Grouped("spec", "tokens")
    spec_tree_max_batch = _Grouped("spec", "tree_max_batch")
    allow_draft_position_extension = _Grouped("spec", "draft_position_extension")
    tp = _Grouped("parallel", "tp")
    env = _Grouped("parallel", "env")
    nccl_profile = _Grouped("parallel", "nccl_profile")
    graph_capture_timeout = _Grouped("parallel", "capture_timeout")
    nnodes = _Grouped("parallel", "nnodes")
    node_rank = _Grouped("parallel", "node_rank")
    dist_init_addr = _Grouped("parallel", "dist_init_addr")
    dist_timeout = _Grouped("parallel", "dist_timeout")
    dist_key_file = _Grouped("parallel", "dist_key_file")
    # Speculation's methods, also read as `cfg.tree_nodes(K)`.
    cache_room = _Grouped("spec", "cache_room")
    drafts_tree = _Grouped("spec", "drafts_tree")
    tree_nodes = _Grouped("spec", "tree_nodes")

    def __init__(self, spec: SpecConfig | None = None, parallel: ParallelConfig | None = None, **options: Any):
        groups = {"spec": {}, "parallel": {}}
        for name in [n for n in options if n in _GROUPED]:
            group, key = _GROUPED[name]
            groups[group][key] = options.pop(name)
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"EngineConfig got unknown option(s): {', '.join(unknown)}")
        for f in dataclasses.fields(self):
            if f.name in ("spec", "parallel"):
                continue
            object.__setattr__(self, f.name, options.get(f.name, f.default))
        spec = dataclasses.replace(spec, **groups["spec"]) if spec is not None else SpecConfig(**groups["spec"])
        parallel = (
            dataclasses.replace(parallel, **groups["parallel"])
            if parallel is not None
            else ParallelConfig(**groups["parallel"])
        )
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "parallel", parallel)
        self._validate()

    def _validate(self) -> None:
        method = self.spec.method
        if self.spec.steps and method == "eagle3" and not self.draft:
            raise ConfigError(
                "--spec-steps > 0 needs a drafter: pass --draft DIR (or a draft-free "
                "--speculative-method ngram / suffix, or mtp for a checkpoint with an MTP layer)"
            )
        if self.draft and method != "eagle3":
            raise ConfigError(
                f"--speculative-method {method} takes no --draft: "
                + ("the target's own MTP layer drafts" if method == "mtp" else "it drafts from the text itself")
            )
        check_max_num_seqs(self.max_num_seqs)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be at least 2, got {self.max_model_len}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be at least 1, got {self.prefill_chunk}")
        if not isinstance(self.admit_wait, int) or self.admit_wait < 0:
            raise ConfigError(f"--admit-wait must be a whole number of steps >= 0, got {self.admit_wait!r}")
        if not 1 <= self.kv_block_size <= 4096:
            raise ConfigError(f"--kv-block-size must be 1..4096 tokens, got {self.kv_block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ConfigError(f"--kv-cache-tokens must be at least 1, got {self.kv_cache_tokens}")
        if self.gpu_memory_utilization is not None and not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ConfigError(f"--gpu-memory-utilization must be within 0.05..0.99, got {self.gpu_memory_utilization}")
        if self.kv_cache_tokens is not None and self.gpu_memory_utilization is not None:
            raise ConfigError("give --kv-cache-tokens or --gpu-memory-utilization, not both")

    def flat(self) -> dict[str, Any]:
        """Every setting under its flat option name: `EngineConfig(**cfg.flat()) == cfg`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("spec", "parallel")}
        out.update({name: getattr(self, name) for name in _GROUPED})
        return out

    @classmethod
    def option_names(cls) -> set[str]:
        """The flat option names `from_kwargs` takes."""
        return {f.name for f in dataclasses.fields(cls) if f.name not in ("spec", "parallel")} | set(_GROUPED)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        unknown = sorted(set(kwargs) - cls.option_names())
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)


# Flat option name -> (group attribute, field name) of the grouped settings (the methods left out).
_GROUPED = {
    name: (d.group, d.key)
    for name, d in vars(EngineConfig).items()
    if isinstance(d, _Grouped) and d.key in _GROUP_CLASSES[d.group].__dataclass_fields__
}
