"""The model runner: owns the weights, the KV caches, the drafter's pending
inputs and the CUDA graphs, and runs the four kinds of forward pass:

- prefill   (eager)  a chunk of prompt tokens for newly admitted sequences;
- decode    (graph)  one token per running sequence;
- draft     (graph)  the drafter's extend over pending target features plus
                     K-1 single-token steps, choosing K draft tokens;
- verify    (graph)  the target over [last token, K drafts] per sequence.

With --spec-topk > 1 small batches draft a tree instead of a chain (`draft_tree`:
the best top-k branches by cumulative log-probability at each depth, then the best
`spec_tokens` nodes overall, left in static buffers), and `verify_tree` is one graph
that checks every node in one forward under an ancestor mask, keeps the longest
branch that matches the target's own token (argmax or seeded draw) at each node,
moves its KV into place and writes the drafter's next inputs: a cycle is two graph
replays and one read of the results.

KV layout: one slot ("row") per sequence, [rows, kv_heads, cache_len, head_dim]
per layer, with running sequences kept in rows 0..B-1 so every graph reads a
plain view of the cache (no gather). Fixed slots rather than paged blocks:
without paged-attention kernels (no flash-attn/flashinfer on our GPUs) SDPA
needs contiguous keys, static shapes suit CUDA graphs, and rewinding rejected
drafts is just not advancing the length. The cost is memory reserved for
max_model_len per slot, which `plan_kv` accounts for up front.

cache_len = max_model_len + room + 1 (rounded up), room = K_max for chains (tree: the
most verify nodes or drafter tree slots): draft and verify tokens of a sequence near
its end may sit past max_model_len, and the last index is a scratch slot that padding
tokens write to and no real query ever reads.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from dataclasses import dataclass

import torch

from specserve.config import (
    MAX_TREE_NODES,
    PREFILL_GRAPH_TOKENS,
    ConfigError,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    default_max_model_len,
    prefill_stage_len,
    resolve_aux_layers,
)
from specserve.engine.sampling import (
    STREAM_DRAFT,
    BatchSampling,
    SamplingParams,
    processed_probs,
    sample_from,
    sample_tokens,
    uniform,
)
from specserve.kernels.tree import tree_level
from specserve.model.layers import ForwardContext, KVCacheAttention, pin_attributes
from specserve.model.loader import load_drafter, load_target, resolve_device, resolve_dtype

log = logging.getLogger("specserve.runner")

PENDING_WIDTH = 16  # drafter inputs buffered per sequence while speculation is paused


def default_graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256) if b < max_num_seqs]
    return tuple(sizes + [max_num_seqs])


@dataclass
class TreeDraft:
    """N draft nodes per sequence, parents before children. Verify row 0 is the root (the last
    accepted token); node j sits in verify row j + 1."""

    tokens: torch.Tensor  # [B, N] target ids
    parents: torch.Tensor  # [B, N] verify row of each node's parent (0 = the root)
    depth: torch.Tensor  # [B, N] 1..K
    anc: torch.Tensor  # [B, N] int64, bit i set: node i is the node itself or one of its ancestors

    def head(self, B: int, N: int) -> "TreeDraft":
        """Views of the first B rows and N nodes."""
        return TreeDraft(self.tokens[:B, :N], self.parents[:B, :N], self.depth[:B, :N], self.anc[:B, :N])


@dataclass
class DraftResult:
    tokens: torch.Tensor  # [B, K] target ids
    draft_ids: torch.Tensor | None  # [B, K] draft-vocab ids (sampling only)
    probs: torch.Tensor | None  # [B, K, Vd] draft distributions (sampling only)
    vocab_map: torch.Tensor | None = None  # [Vd] target id of each draft id


class _Graph:
    def __init__(self, graph, outputs):
        self.graph, self.outputs = graph, outputs


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model_cfg = ModelConfig.from_dir(cfg.model)
        self.draft_cfg = DraftConfig.from_dir(cfg.draft) if cfg.draft else None
        self.dtype = resolve_dtype(cfg.dtype, self.model_cfg.dtype, self.device)
        self.max_model_len = cfg.max_model_len or default_max_model_len(self.model_cfg, self.device.type)
        if self.max_model_len > self.model_cfg.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} exceeds the target's max_position_embeddings "
                f"{self.model_cfg.max_position_embeddings}"
            )
        self.k_max = cfg.max_spec_steps if self.draft_cfg else 0
        self.topk = cfg.spec_topk if self.draft_cfg else 1
        self.pending_width = max(PENDING_WIDTH, self.k_max + 1)
        self.room = cfg.cache_room(self.k_max)  # slots past a sequence's end that a cycle may write
        self.cache_len = -(-(self.max_model_len + self.room + 1) // 16) * 16
        self.scratch = self.cache_len - 1
        self.rows = cfg.max_num_seqs
        self.drafter_max_pos = None
        if self.draft_cfg is not None:
            self.drafter_max_pos = None if cfg.allow_draft_position_extension else self.draft_cfg.max_position_embeddings

        t0 = time.perf_counter()
        self.target = load_target(cfg.model, self.device, self.dtype, self.cache_len, cfg.allow_pickle)
        self.drafter = None
        if self.draft_cfg is not None:
            self.target.aux_layers = resolve_aux_layers(self.draft_cfg, self.model_cfg.num_layers, cfg.aux_layer_convention)
            self.drafter = load_drafter(cfg.draft, self.target, self.device, self.dtype, self.cache_len, cfg.allow_pickle)
            if self.draft_cfg.target_hidden_size != self.model_cfg.hidden_size:
                raise ConfigError(
                    f"drafter expects target hidden size {self.draft_cfg.target_hidden_size} (fc input "
                    f"{3 * self.draft_cfg.target_hidden_size}), target has {self.model_cfg.hidden_size}"
                )
            if self.topk > self.draft_cfg.draft_vocab_size:
                raise ConfigError(f"--spec-topk {self.topk} exceeds the drafter's draft vocabulary "
                                  f"({self.draft_cfg.draft_vocab_size} tokens)")
            if self.draft_cfg.vocab_size != self.model_cfg.vocab_size:
                raise ConfigError(
                    f"drafter vocab_size {self.draft_cfg.vocab_size} differs from the target's {self.model_cfg.vocab_size}"
                )
        self.load_seconds = time.perf_counter() - t0
        if self.drafter is not None:
            self.drafter.fuse_projections(column_major=self.device.type == "cpu")
        if self.device.type == "cpu":  # eager Python on every forward there
            for m in (self.target, self.drafter):
                if m is not None:
                    pin_attributes(m)
        self.linear_tuning = self._tune_linear()
        self._allocate()
        self._tree_const: dict[int, dict[str, torch.Tensor]] = {}
        self.graphs: dict[tuple, _Graph] = {}
        self.graph_batch_sizes: tuple[int, ...] = ()
        self.graph_pool = None

    def _tune_linear(self) -> dict:
        """Per weight shape and row count, the fastest product here: on GPU cuBLAS or the GEMV
        kernel, on CPU (weights stored column-major first) MKL or oneDNN with a packed weight."""
        from specserve.kernels.cpu_linear import column_major_copy, tune_linear_cpu
        from specserve.kernels.gemv import GEMV_ROWS, tune_linear

        t0 = time.perf_counter()
        tensors = list(self.target.parameters()) + (self.drafter.product_weights() if self.drafter is not None else [])
        seen, weights = set(), []
        for p in tensors:
            if p is not None and p.dim() == 2 and p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                weights.append(p)
        if self.device.type == "cuda":  # up to the widest product a step runs: all rows, each verifying room + 1
            report = tune_linear(weights, max_rows=min(GEMV_ROWS[-1], self.rows * (self.room + 1)))
        else:
            for w in weights:  # (the drafter's stacked weights already are)
                if w.is_contiguous():
                    w.data = column_major_copy(w.data)
            report = tune_linear_cpu(weights)
        if report:
            log.info("linear kernels tuned in %.1fs: %s", time.perf_counter() - t0, report)
        return report

    # ------------------------------------------------------------------ memory
    def kv_bytes(self) -> int:
        return sum(a.k_cache.numel() * 2 * a.k_cache.element_size() for a in self._attn_modules())

    def _attn_modules(self):
        mods = list(self.target.attention_modules())
        if self.drafter is not None:
            mods += self.drafter.attention_modules()
        return mods

    def _prefill_graph_buckets(self) -> tuple[int, ...]:
        """Prompt lengths (padded up to these) prefilled by a CUDA graph: run eagerly, an 8B model's
        ~450 kernel launches cost ~10 ms of host time, twice the GPU's work."""
        if not (self.device.type == "cuda" and self.cfg.cuda_graphs):
            return ()
        return tuple(b for b in PREFILL_GRAPH_TOKENS if b <= self.max_model_len and b // 2 < self.cfg.prefill_chunk)

    def _prefill_bucket(self, T: int) -> int | None:
        """The prefill graph length a T-token prompt is padded to (None: longer than any)."""
        return next((b for b in self.prefill_buckets if T <= b), None)

    def _allocate(self) -> None:
        self.prefill_buckets = self._prefill_graph_buckets()
        needed = 0
        for a in self._attn_modules():
            needed += 2 * self.rows * a.num_kv_heads * self.cache_len * a.head_dim * torch.finfo(self.dtype).bits // 8
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.9)
        else:
            import psutil

            budget = int(psutil.virtual_memory().available * 0.5)
        if needed > budget:
            raise ConfigError(
                f"KV cache for {self.rows} sequences x {self.max_model_len} tokens needs {needed / 2**30:.2f} GiB, "
                f"only {budget / 2**30:.2f} GiB is available; lower --max-num-seqs or --max-model-len"
            )
        # The target's layers share one K and one V tensor ([layer, row, kv_head, index, dim]), so
        # moving a tree branch's KV into place is one copy for all layers, not one per layer.
        t = list(self.target.attention_modules())
        shape = (len(t), self.rows, t[0].num_kv_heads, self.cache_len, t[0].head_dim)
        self.k_all = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, a in enumerate(t):
            a.k_cache, a.v_cache = self.k_all[i], self.v_all[i]
        for a in self._attn_modules()[len(t):]:
            shape = (self.rows, a.num_kv_heads, self.cache_len, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            a.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # Prefill graphs write a staging cache of one row, as long as the longest bucket plus a
        # scratch slot: one graph then serves every row (the KV is copied to the sequence's row
        # after), and staging costs a prompt's KV, not a whole sequence's.
        self.stage_len = prefill_stage_len(max(self.prefill_buckets, default=0))
        self.stage_scratch = self.stage_len - 1
        self.stage: dict[KVCacheAttention, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.prefill_buckets:
            def staging(a, layers=()):
                return torch.zeros(*layers, 1, a.num_kv_heads, self.stage_len, a.head_dim, dtype=self.dtype,
                                   device=self.device)

            self.k_stage, self.v_stage = staging(t[0], (len(t),)), staging(t[0], (len(t),))
            self.stage = {a: (self.k_stage[i], self.v_stage[i]) for i, a in enumerate(t)}
            self.stage.update({a: (staging(a), staging(a)) for a in self._attn_modules()[len(t):]})
        if self.drafter is not None:
            H3 = 3 * self.model_cfg.hidden_size
            self.pending_tok = torch.zeros(self.rows, self.pending_width, dtype=torch.long, device=self.device)
            self.pending_feat = torch.zeros(self.rows, self.pending_width, H3, dtype=self.dtype, device=self.device)
        # Static inputs shared by all graphs (largest shapes; graphs read prefixes).
        W = max(self.room + 1, 1)
        self.s_ids = torch.zeros(self.rows, W, dtype=torch.long, device=self.device)
        P = max(self.prefill_buckets, default=0)
        self.s_pf_ids = torch.zeros(1, P, dtype=torch.long, device=self.device)
        self.s_pf_pos = torch.zeros(1, P, dtype=torch.long, device=self.device)
        self.s_pf_last = torch.zeros(1, dtype=torch.long, device=self.device)
        self.s_pf_tok = torch.zeros(1, P, dtype=torch.long, device=self.device)  # the drafter's next tokens
        self._graph_prefilled: tuple[int, int] | None = None  # (row, tokens) of the last graph prefill
        self.s_pos = torch.zeros(self.rows, W, dtype=torch.long, device=self.device)
        # Trees: the drafted tree (written by the draft graph, read by the verify graph) and the
        # verify inputs staged by the host.
        N = self.cfg.tree_nodes(self.k_max) if self.topk > 1 else 0
        self.tree = TreeDraft(*(torch.zeros(self.rows, N, dtype=torch.long, device=self.device) for _ in range(4)))
        self.s_root = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_pos0 = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_enabled = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        self.s_last = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_temp = torch.zeros(self.rows, dtype=torch.float32, device=self.device)
        self.s_top_p = torch.ones(self.rows, dtype=torch.float32, device=self.device)
        self.s_top_k = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_seed = torch.zeros(self.rows, dtype=torch.long, device=self.device)

    def move_row(self, src: int, dst: int, length: int, pending: int) -> None:
        """Copy a sequence's KV (first `length` positions) and pending drafter inputs to another row."""
        if src == dst:
            return
        n = min(length + self.room + 1, self.cache_len)
        for cache in (self.k_all, self.v_all):  # every target layer at once
            cache[:, dst, :, :n] = cache[:, src, :, :n]
        for a in self.drafter.attention_modules() if self.drafter is not None else ():
            a.k_cache[dst, :, :n] = a.k_cache[src, :, :n]
            a.v_cache[dst, :, :n] = a.v_cache[src, :, :n]
        if self.drafter is not None and pending:
            self.pending_tok[dst, :pending] = self.pending_tok[src, :pending]
            self.pending_feat[dst, :pending] = self.pending_feat[src, :pending]

    # ----------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(self, row_start: int, chunks: list[list[int]], starts: list[int]):
        """Run the target over one chunk per row (rows row_start..). Returns the
        logits at each row's last chunk token [m, V] and the features [m, T, 3H]
        (None without a drafter)."""
        m, T = len(chunks), max(len(c) for c in chunks)
        Tb = self._prefill_bucket(T)
        graph = self.graphs.get(("prefill", Tb, 1))
        self._graph_prefilled = None
        if m == 1 and starts[0] == 0 and graph is not None:
            ids = torch.zeros(1, Tb, dtype=torch.long)
            ids[0, :T] = torch.tensor(chunks[0])
            pos = torch.full((1, Tb), self.stage_scratch, dtype=torch.long)
            pos[0, :T] = torch.arange(T)
            self.s_pf_ids[:, :Tb].copy_(ids, non_blocking=True)
            self.s_pf_pos[:, :Tb].copy_(pos, non_blocking=True)
            self.s_pf_last.fill_(T - 1)
            graph.graph.replay()
            for cache, staged in ((self.k_all, self.k_stage), (self.v_all, self.v_stage)):  # all layers at once
                cache[:, row_start, :, :T] = staged[:, 0, :, :T]
            self._graph_prefilled = (row_start, T)
            logits, feats = graph.outputs
            return logits, (feats[:, :T] if feats is not None else None)
        ids = torch.zeros(m, T, dtype=torch.long)
        pos = torch.full((m, T), self.scratch, dtype=torch.long)
        last = torch.zeros(m, dtype=torch.long)
        for i, (c, s) in enumerate(zip(chunks, starts)):
            ids[i, : len(c)] = torch.tensor(c)
            pos[i, : len(c)] = torch.arange(s, s + len(c))
            last[i] = max(len(c) - 1, 0)
        ids, pos, last = ids.to(self.device), pos.to(self.device), last.to(self.device)
        kv_len = max(s + len(c) for c, s in zip(chunks, starts))
        ctx = ForwardContext(row_start, self._rope_pos(pos), pos, kv_len)
        hidden, feats = self.target(ids, ctx)
        h_last = hidden[torch.arange(m, device=self.device), last]
        return self.target.logits(h_last), feats

    @contextlib.contextmanager
    def _staged(self, mods):
        """The attention modules `mods` read and write their staging caches meanwhile (a graph
        captured inside keeps doing so)."""
        saved = [(a.k_cache, a.v_cache) for a in mods]
        for a in mods:
            a.k_cache, a.v_cache = self.stage[a]
        try:
            yield
        finally:
            for a, (k, v) in zip(mods, saved):
                a.k_cache, a.v_cache = k, v

    def _prefill_body(self, Tb: int):
        """One prompt's first Tb tokens (padding at the staging scratch slot) in the staging cache;
        keys past the prompt are never seen (each query sees indices up to its own)."""
        ids, pos = self.s_pf_ids[:, :Tb], self.s_pf_pos[:, :Tb]
        with self._staged(self.target.attention_modules()):
            hidden, feats = self.target(ids, ForwardContext(0, self._rope_pos(pos), pos, Tb))
        return self.target.logits(hidden[0, self.s_pf_last]), feats

    def _drafter_prefill_body(self, Tb: int):
        """The drafter's KV for a graph-prefilled prompt (staging cache), from that graph's features."""
        feats = self.graphs[("prefill", Tb, 1)].outputs[1]
        pos = self._drafter_positions(self.s_pf_pos[:, :Tb], self.stage_scratch)
        with self._staged(self.drafter.attention_modules()):
            self.drafter(self.s_pf_tok[:, :Tb], feats, ForwardContext(0, pos, pos, Tb))
        return ()

    @torch.inference_mode()
    def drafter_prefill(self, row: int, tok: torch.Tensor) -> bool:
        """After the graph prefill of a prompt at `row`: the drafter's KV for its entries (feature t,
        token t+1: `tok` [T] on the device) by graph, copied to the row. False (nothing done) when
        the last prefill was not that one or no graph fits."""
        T = tok.shape[0]
        graph = self.graphs.get(("drafter_prefill", self._prefill_bucket(T), 1))
        if self._graph_prefilled != (row, T) or graph is None:
            return False
        self.s_pf_tok[0, :T].copy_(tok)
        graph.graph.replay()
        for a in self.drafter.attention_modules():
            k, v = self.stage[a]
            a.k_cache[row, :, :T] = k[0, :, :T]
            a.v_cache[row, :, :T] = v[0, :, :T]
        return True

    def _rope_pos(self, pos: torch.Tensor) -> torch.Tensor:
        return pos  # outside trees, rope position == cache index

    @torch.inference_mode()
    def _drafter_positions(self, pos: torch.Tensor, scratch: int) -> torch.Tensor:
        """Entry positions with those past the drafter's trained positions turned into padding."""
        if self.drafter_max_pos is None:
            return pos
        return torch.where(pos >= self.drafter_max_pos, scratch, pos)

    def drafter_extend(self, row_start: int, tok: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor) -> None:
        """Eagerly write the drafter's KV for (feature, next token) entries; padding at scratch
        positions, and at positions past the drafter's."""
        pos = self._drafter_positions(pos, self.scratch)
        self.drafter(tok, feat, self._context(pos, pos, row_start))

    # ------------------------------------------------------------- graph parts
    def _bucket(self, B: int) -> int:
        for b in self.graph_batch_sizes:
            if b >= B:
                return b
        return B

    def _set_sampling(self, B: int, s: BatchSampling | None) -> None:
        if s is None:
            return
        self.s_temp[:B].copy_(s.temperature)
        self.s_top_p[:B].copy_(s.top_p)
        self.s_top_k[:B].copy_(s.top_k)
        self.s_seed[:B].copy_(s.seed)

    def _context(self, pos: torch.Tensor, rope_pos: torch.Tensor, row_start: int = 0,
                 tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardContext:
        """Attention metadata for rows row_start.. at cache indices `pos` (`tree`: (tree_base,
        tree_anc), see ForwardContext). CUDA: every cache position is read (graphs need static
        shapes; the Triton kernel stops at each row's end by itself). CPU: up to the furthest real
        position, since SDPA there reads every key it is given; the positions are host memory, so
        a Python pass over them is cheaper than tensor ops. When every query sits at the last key
        read (decode, draft steps), no mask is built."""
        base, anc = tree if tree is not None else (None, None)
        if self.device.type == "cuda":
            return ForwardContext(row_start, rope_pos, pos, self.cache_len, tree_base=base, tree_anc=anc)
        flat = pos.reshape(-1).tolist()
        kv_len = max((p for p in flat if p != self.scratch), default=0) + 1
        return ForwardContext(row_start, rope_pos, pos, kv_len, full_view=tree is None and min(flat) >= kv_len - 1,
                              tree_base=base, tree_anc=anc)

    def _decode_body(self, B: int):
        ids, pos = self.s_ids[:B, :1], self.s_pos[:B, :1]
        hidden, feats = self.target(ids, self._context(pos, self._rope_pos(pos)))
        return self.target.logits(hidden[:, 0]), feats

    def _verify_body(self, B: int, K: int):
        ids, pos = self.s_ids[:B, : K + 1], self.s_pos[:B, : K + 1]
        hidden, feats = self.target(ids, self._context(pos, self._rope_pos(pos)))
        return self.target.logits(hidden), feats

    def _pick_draft(self, logits: torch.Tensor, entry_pos: torch.Tensor, sampling: bool, filtered: bool):
        if not sampling:
            return logits.argmax(-1), None
        probs = processed_probs(logits, self.s_temp[: logits.shape[0]], self.s_top_p[: logits.shape[0]],
                                self.s_top_k[: logits.shape[0]], filtered)
        u = uniform(self.s_seed[: logits.shape[0]], entry_pos + 2, STREAM_DRAFT, logits.shape[-1])
        return sample_from(probs, u), probs

    def _draft_body(self, B: int, K: int, sampling: bool, filtered: bool):
        """Extend over the pending entries (width K+1, padded), then K-1 steps.
        s_pos[:, :K+1] holds the entries' positions, s_last the index of each
        row's last real entry."""
        d = self.drafter
        pos = self.s_pos[:B, : K + 1]
        out = d(self.pending_tok[:B, : K + 1], self.pending_feat[:B, : K + 1], self._context(pos, pos))
        rows = torch.arange(B, device=self.device)
        last = self.s_last[:B]
        g = out[rows, last].unsqueeze(1)  # [B, 1, H]
        # Position of the last real entry, then of each draft step (padding rows stay at the scratch index).
        p = pos[rows, last].unsqueeze(1) + torch.arange(K, device=self.device)
        p = p.clamp(max=self.scratch)
        tokens, draft_ids, probs = [], [], []
        for i in range(K):
            # The draft chosen now is the token at sequence position p + 2 (entry p predicts p + 2).
            did, q = self._pick_draft(d.logits(g[:, 0], upcast=sampling), p[:, i], sampling, filtered)
            tid = d.to_target_ids(did)
            tokens.append(tid)
            draft_ids.append(did)
            probs.append(q)
            if i + 1 < K:
                step_pos = p[:, i + 1: i + 2]
                g = d(tid.unsqueeze(1), g, self._context(step_pos, step_pos))
        toks = torch.stack(tokens, 1)
        if not sampling:
            return (toks,)
        return toks, torch.stack(draft_ids, 1), torch.stack(probs, 1)

    def _tree_draft_body(self, B: int, K: int):
        """Greedy tree drafting (EAGLE-2 style). Extend over the pending entries as a chain does;
        its top-k tokens are the depth-1 candidates. Each later step runs the k best branches so far
        (the frontier) through the drafter side by side, each seeing the context and its own
        ancestors, and offers the top-k children of each: k*k candidates scored by cumulative
        log-probability, the k best becoming the next frontier. Of all candidates the best N are
        verified. A child scores strictly below its parent, so the best N always include every
        selected node's ancestors."""
        d, k, N = self.drafter, self.topk, self.cfg.tree_nodes(K)
        dev, scratch = self.device, self.scratch
        c = self._tree_constants(K)
        pos = self.s_pos[:B, : K + 1]
        out = d(self.pending_tok[:B, : K + 1], self.pending_feat[:B, : K + 1], self._context(pos, pos))
        rows = torch.arange(B, device=dev)
        last = self.s_last[:B]
        p_last = pos[rows, last]  # the last real entry; drafter tree slots follow it
        pad = (p_last == scratch).unsqueeze(1)
        g = out[rows, last].unsqueeze(1)  # [B, 1, H]
        # Candidates: k at depth 1, then k*k per depth; their score, token (target id) and parent candidate.
        M = k + (K - 1) * k * k
        all_score = torch.empty(B, M, dtype=torch.float32, device=dev)
        all_ids = torch.empty(B, M, dtype=torch.long, device=dev)
        all_par = torch.empty(B, M, dtype=torch.long, device=dev)
        # finite log-probabilities, so a child's score can always be made smaller than its parent's
        score, ids = torch.log_softmax(d.logits(g[:, 0]), -1).clamp_min(-1e4).topk(k, -1)  # [B, k]
        ids = d.to_target_ids(ids)
        all_score[:, :k], all_ids[:, :k], all_par[:, :k] = score, ids, -1
        front_g = g.expand(B, k, g.shape[-1]).contiguous()
        front_idx = c["front_idx"].expand(B, k)
        front_bits = c["front_bits"].expand(B, k)
        base = torch.where(pad[:, 0], scratch, p_last + 1)
        # Per depth i (1..K-1): the frontier's drafter slots, its own ancestor bits and rope
        # position (laid out like the slots: the rope kernel reads both with one stride).
        slots = torch.where(pad.unsqueeze(-1), scratch, p_last.view(B, 1, 1) + 1 + c["own"])  # [B, K-1, k]
        rope = (p_last.view(B, 1, 1) + c["depth_of_slot"]).clamp(max=scratch)  # [B, K-1, k]
        for i in range(1, K):
            bits = front_bits | c["own_bits"][i - 1]
            ctx = self._context(slots[:, i - 1], rope[:, i - 1], tree=(base, bits))
            g = d(ids, front_g, ctx)  # [B, k, H]
            off = k + (i - 1) * k * k
            score, ids, node, front_bits, front_idx = tree_level(
                d.logits(g, upcast=False), score, bits, front_idx, all_score, all_ids, all_par, off, d.d2t)
            front_g = g.gather(1, node.unsqueeze(-1).expand(-1, -1, g.shape[-1]))
        sel = all_score.topk(N, -1).indices.sort(-1).values  # [B, N], parents before children
        tokens = all_ids.gather(1, sel)
        depth = c["cand_depth"].expand(B, -1).gather(1, sel)
        parent_cand = all_par.gather(1, sel)
        row_of = torch.zeros_like(all_ids).scatter(1, sel, c["node_rows"][:N].expand(B, N))
        parent_row = torch.where(parent_cand < 0, 0, row_of.gather(1, parent_cand.clamp_min(0)))
        # Ancestor-or-self bits by pointer jumping (column 0 = the root: no bits, its own parent):
        # after round t each node holds itself and its 2^t - 1 nearest ancestors.
        anc = c["node_bits"][: N + 1].expand(B, N + 1)
        up = torch.cat([c["node_bits"][:1].expand(B, 1), parent_row], 1)
        for _ in range(max(1, (K - 1).bit_length())):
            anc = anc | anc.gather(1, up)
            up = up.gather(1, up)
        out = self.tree.head(B, N)
        for buf, val in zip((out.tokens, out.parents, out.depth, out.anc), (tokens, parent_row, depth, anc[:, 1:])):
            buf.copy_(val)
        return ()

    def _tree_constants(self, K: int) -> dict[str, torch.Tensor]:
        """Index tables of a depth-K tree draft that depend only on K and top-k: made once, outside
        any CUDA graph (the capture's warm-up run makes them), so a replay does not rebuild them."""
        got = self._tree_const.get(K)
        if got is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("tree draft constants must be made before graph capture (warm-up run)")
            k, dev = self.topk, self.device
            own = torch.arange((K - 1) * k, device=dev).view(K - 1, k)  # drafter slot of each frontier node, per depth
            cand = torch.arange(k + (K - 1) * k * k, device=dev)
            N = MAX_TREE_NODES
            got = self._tree_const[K] = {
                "own": own, "own_bits": 1 << own,
                "depth_of_slot": torch.arange(1, K, device=dev).view(K - 1, 1).expand(K - 1, k).contiguous(),
                "front_idx": torch.arange(k, device=dev), "front_bits": torch.zeros(k, dtype=torch.long, device=dev),
                "cand_depth": torch.where(cand < k, 1, 2 + (cand - k).div(k * k, rounding_mode="floor")),
                "node_rows": torch.arange(1, N + 1, device=dev),  # verify row of the j-th selected node
                # root column 0 (no bits), then node j's own bit 1 << j
                "node_bits": torch.cat([torch.zeros(1, dtype=torch.long, device=dev), 1 << torch.arange(N, device=dev)]),
            }
        return got

    def _tree_verify_body(self, B: int, K: int, sampling: bool = False, filtered: bool = False):
        """The target over [root, tree nodes] (node j at cache index pos0 + 1 + j, rope position
        pos0 + its depth, seeing the context and its ancestors); the target's token at every node
        (argmax, or with `sampling` its seeded draw, as `sample_tokens` draws) and `accept_tree`;
        the accepted branch's KV moved to indices pos0 + 1.. in every layer; the drafter's next
        inputs (feature, token) along the branch. Padding rows (pos0 at the scratch slot) write
        only there. Returns (accepted count, the branch's tokens then the next token, logits: float32
        when sampling, else the model's dtype)."""
        from specserve.engine.speculative import accept_tree, emitted_tokens

        N, dev, scratch = self.cfg.tree_nodes(K), self.device, self.scratch
        tree = self.tree.head(B, N)
        pos0 = self.s_pos0[:B].unsqueeze(1)
        pad = pos0 == scratch
        write = torch.where(pad, scratch, pos0 + torch.arange(N + 1, device=dev))
        rope = torch.cat([pos0, pos0 + tree.depth], 1).clamp(max=scratch)
        anc = torch.cat([torch.zeros_like(pos0), tree.anc], 1)
        ids = torch.cat([self.s_root[:B].unsqueeze(1), tree.tokens], 1)
        hidden, feats = self.target(ids, self._context(write, rope, tree=((pos0 + 1)[:, 0], anc)))
        # Greedy picks read the head's own dtype (an argmax needs no float32 copy of 32 x vocab).
        logits = self.target.logits(hidden, upcast=sampling)
        per_node = lambda t: t[:B].unsqueeze(1).expand(-1, N + 1)  # noqa: E731
        s = BatchSampling(per_node(self.s_temp), per_node(self.s_top_p), per_node(self.s_top_k),
                          per_node(self.s_seed), all_greedy=not sampling, filtered=filtered)
        pred = sample_tokens(logits, s, rope + 1)  # each node's token, keyed by the position it would fill
        n_acc, next_tok, path = accept_tree(pred, tree, K, self.s_enabled[:B])
        # Move the branch's KV: depth d from index pos0 + path[d-1] to pos0 + d (reads before writes).
        d = torch.arange(1, K + 1, device=dev)
        dst = torch.where(pad, scratch, pos0 + d)
        src = torch.where(d <= n_acc.unsqueeze(1), pos0 + path, dst)
        rows = torch.arange(B, device=dev).unsqueeze(1)
        for cache in (self.k_all, self.v_all):
            cache[:, rows, :, dst] = cache[:, rows, :, src]
        # Drafter inputs for the next cycle: (feature_j, token_j+1) for j = 0..a along the branch.
        grid = emitted_tokens(tree.tokens.gather(1, (path - 1).clamp_min(0)), n_acc, next_tok)
        feat_rows = torch.cat([torch.zeros_like(path[:, :1]), path], 1)
        feat = feats.gather(1, feat_rows.unsqueeze(-1).expand(-1, -1, feats.shape[-1]))
        keep = pad.unsqueeze(-1)  # padding rows may belong to sequences still in prefill: untouched
        self.pending_tok[:B, : K + 1] = torch.where(pad, self.pending_tok[:B, : K + 1], grid)
        self.pending_feat[:B, : K + 1] = torch.where(keep, self.pending_feat[:B, : K + 1], feat)
        return n_acc, grid, logits

    def _run(self, key: tuple, B: int, body):
        """Replay the captured graph for this key's batch bucket, or run eagerly."""
        g = self.graphs.get((*key, self._bucket(B)))
        if g is None:
            return body(B)
        g.graph.replay()
        return tuple(o[:B] if o is not None else None for o in g.outputs)

    def _fill_padding(self, B: int, width: int) -> None:
        Bb = self._bucket(B)
        if Bb > B:
            self.s_ids[B:Bb, :width] = 0
            self.s_pos[B:Bb, :width] = self.scratch
            self.s_last[B:Bb] = 0

    # --------------------------------------------------------------- the steps
    @torch.inference_mode()
    def decode(self, ids: torch.Tensor, pos: torch.Tensor):
        B = ids.shape[0]
        self.s_ids[:B, 0].copy_(ids)
        self.s_pos[:B, 0].copy_(pos)
        self._fill_padding(B, 1)
        return self._run(("decode",), B, self._decode_body)

    @torch.inference_mode()
    def draft(self, K: int, entry_pos: torch.Tensor, last_idx: torch.Tensor, s: BatchSampling) -> DraftResult:
        B = entry_pos.shape[0]
        self.s_pos[:B, : K + 1].copy_(entry_pos)
        self.s_last[:B].copy_(last_idx)
        self._fill_padding(B, K + 1)
        sampling = not s.all_greedy
        if sampling:  # (greedy drafting reads no sampling parameters)
            self._set_sampling(B, s)
        # Sampling batches always take the filtering path: top-k 0 / top-p 1 rows pass through unchanged.
        key = ("draft", K, sampling, sampling)
        out = self._run(key, B, lambda b: self._draft_body(b, K, sampling, sampling))
        if self.graphs:
            # All graphs share one memory pool, so the verify replay that follows may reuse
            # this graph's output memory: take the (small) draft outputs out first.
            out = tuple(o.clone() for o in out)
        if not sampling:
            return DraftResult(out[0], None, None)
        vocab_map = torch.arange(self.drafter.d2t.shape[0], device=self.device) + self.drafter.d2t
        return DraftResult(out[0], out[1], out[2], vocab_map)

    @torch.inference_mode()
    def verify(self, ids: torch.Tensor, pos0: torch.Tensor):
        B, W = ids.shape
        self.s_ids[:B, :W].copy_(ids)
        self.s_pos[:B, :W].copy_(pos0.unsqueeze(1) + torch.arange(W, device=self.device))
        self._fill_padding(B, W)
        return self._run(("verify", W - 1), B, lambda b: self._verify_body(b, W - 1))

    @torch.inference_mode()
    def draft_tree(self, K: int, entry_pos: torch.Tensor, last_idx: torch.Tensor) -> TreeDraft:
        """Greedy tree of draft tokens (see _tree_draft_body) into `self.tree`; entries as for `draft`.
        Returns views of the first B rows."""
        B = entry_pos.shape[0]
        self.s_pos[:B, : K + 1].copy_(entry_pos)
        self.s_last[:B].copy_(last_idx)
        self._fill_padding(B, K + 1)
        self._run(("tree_draft", K), B, lambda b: self._tree_draft_body(b, K))
        return self.tree.head(B, self.cfg.tree_nodes(K))

    @torch.inference_mode()
    def verify_tree(self, K: int, root: torch.Tensor, pos0: torch.Tensor, enabled: torch.Tensor,
                    s: BatchSampling | None = None):
        """Verify the tree `draft_tree` left, rooted at token `root` at index `pos0` per row, and
        keep its accepted branch (see _tree_verify_body); rows not `enabled` accept nothing; `s`:
        the batch's sampling (None or all greedy: argmax). Returns (accepted count [B], the branch
        then the next token [B, K+1], logits)."""
        B = root.shape[0]
        sampling = s is not None and not s.all_greedy
        if sampling:
            self._set_sampling(B, s)
        self.s_root[:B].copy_(root)
        self.s_pos0[:B].copy_(pos0)
        self.s_enabled[:B].copy_(enabled)
        Bb = self._bucket(B)
        if Bb > B:
            self.s_pos0[B:Bb] = self.scratch
            self.s_enabled[B:Bb] = False
        filtered = sampling and s.filtered
        return self._run(("tree_verify", K, sampling, filtered), B,
                         lambda b: self._tree_verify_body(b, K, sampling, filtered))

    @torch.inference_mode()
    def measure_step_costs(self, batch_sizes: list[int], spec_steps: list[int], reps: int = 5) -> dict:
        """Seconds per plain step (K=0) and per speculative cycle (K drafts + verify) at each batch
        size, timed on dummy rows whose context is half of max_model_len. Seeds the adaptive policy,
        which then needs no live exploration of every K (that cost up to 11% in short runs).
        The K values are timed in turn, `reps` rounds, and each takes its median: drift and a stray
        slow call (a shared CPU) hit every K alike instead of reordering them."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        ctx = min(self.max_model_len // 2, 256)
        costs = {}
        for B in batch_sizes:
            ids = torch.zeros(B, dtype=torch.long, device=self.device)
            pos = torch.full((B,), ctx, dtype=torch.long, device=self.device)
            greedy = BatchSampling.build([SamplingParams(temperature=0)] * B, [0] * B, self.device)
            last = torch.zeros(B, dtype=torch.long, device=self.device)
            on = torch.ones(B, dtype=torch.bool, device=self.device)
            runs = {0: lambda: self.decode(ids, pos)}
            for K in spec_steps:
                entry = torch.full((B, K + 1), self.scratch, dtype=torch.long, device=self.device)
                entry[:, 0] = ctx - 1

                def cycle(K=K, entry=entry):
                    if self.cfg.drafts_tree(B):  # greedy cycles as the engine runs them
                        self.draft_tree(K, entry, last)
                        self.verify_tree(K, ids, pos, on)
                        return
                    d = self.draft(K, entry, last, greedy)
                    self.verify(torch.cat([ids.unsqueeze(1), d.tokens], 1), pos)
                runs[K] = cycle
            for fn in runs.values():
                fn()  # warm-up (first eager call, lazy allocations)
            times: dict[int, list[float]] = {K: [] for K in runs}
            for _ in range(reps):
                for K, fn in runs.items():
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    times[K].append(time.perf_counter() - t0)
            costs.update({(B, K): statistics.median(ts) for K, ts in times.items()})
        return costs

    # ------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture_graphs(self, spec_steps: list[int], on_progress=None) -> float:
        """Capture decode, draft and verify graphs for every batch bucket,
        largest first so smaller graphs reuse its memory pool."""
        if self.device.type != "cuda" or not self.cfg.cuda_graphs:
            return 0.0
        t0 = time.perf_counter()
        sizes = self.cfg.graph_batch_sizes or default_graph_batch_sizes(self.rows)
        sizes = tuple(sorted({min(b, self.rows) for b in sizes}))
        self.graph_batch_sizes = sizes
        # prompt prefills first: the largest activations, so the other graphs reuse their pool
        jobs = []
        for Tb in reversed(self.prefill_buckets):
            jobs.append((("prefill", Tb), 1, lambda b, Tb=Tb: self._prefill_body(Tb)))
            if self.drafter is not None:  # (reads the prefill graph's features: captured after it)
                jobs.append((("drafter_prefill", Tb), 1, lambda b, Tb=Tb: self._drafter_prefill_body(Tb)))
        tree_buckets = {self._bucket(n) for n in range(1, max(sizes) + 1) if self.cfg.drafts_tree(n)}
        for B in sorted(sizes, reverse=True):
            jobs.append((("decode",), B, self._decode_body))
            for K in spec_steps:
                if K <= 0:
                    continue
                jobs.append((("verify", K), B, lambda b, K=K: self._verify_body(b, K)))
                jobs.append((("draft", K, False, False), B, lambda b, K=K: self._draft_body(b, K, False, False)))
                jobs.append((("draft", K, True, True), B, lambda b, K=K: self._draft_body(b, K, True, True)))
                if B in tree_buckets:
                    for flags in ((False, False), (True, False), (True, True)):  # greedy, sampled, filtered
                        jobs.append((("tree_verify", K, *flags), B,
                                     lambda b, K=K, f=flags: self._tree_verify_body(b, K, *f)))
                    jobs.append((("tree_draft", K), B, lambda b, K=K: self._tree_draft_body(b, K)))
        # Padding state for capture: every row writes to the scratch slot.
        self.s_pos.fill_(self.scratch)
        self.s_pos0.fill_(self.scratch)
        self.s_ids.zero_()
        self.s_last.zero_()
        self.s_temp.fill_(1.0)
        self.s_pf_pos.fill_(self.stage_scratch)
        stream = torch.cuda.Stream(self.device)
        for n, (key, B, body) in enumerate(jobs):
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                body(B)  # warm-up outside the graph (allocator, lazy init)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool, stream=stream):
                outputs = body(B)
            if self.graph_pool is None:
                self.graph_pool = graph.pool()
            self.graphs[(*key, B)] = _Graph(graph, outputs)
            if on_progress:
                on_progress(n + 1, len(jobs), key, B)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0
