"""The model runner: loads the weights, holds the graphs' static inputs and runs
the four kinds of forward pass, eagerly or by CUDA graph replay:

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

KV memory lives in `kv_cache.KVCache` (layout and sizing there), the drafter's pending
inputs in `spec.proposer.PendingInputs`, graph capture in `graphs`; acceptance and the
tree's KV move are `spec.verify`'s, called from inside the tree-verify graph body.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from specserve.config import (
    MAX_TREE_NODES,
    PREFILL_GRAPH_PROMPTS,
    PREFILL_GRAPH_TOKENS,
    ConfigError,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    default_max_model_len,
    resolve_aux_layers,
)
from specserve.constrain import masks
from specserve.distributed.parallel_state import min_over_ranks
from specserve.engine.block_pool import NULL_BLOCK
from specserve.engine.graphs import Graph, GraphKey, capture, default_graph_batch_sizes
from specserve.engine.kv_cache import KVCache, bytes_per_block, plan_blocks, row_blocks
from specserve.engine.sampling import (
    BatchSampling,
    SamplingParams,
    draft_noise,
    processed_probs,
    sample_from,
    sample_tokens,
)
from specserve.kernels.tree import tree_level
from specserve.model.layers import ForwardContext, pin_attributes
from specserve.model.loader import load_drafter, load_target, resolve_device, resolve_dtype
from specserve.spec.proposer import PENDING_WIDTH, DraftResult, PendingInputs, TreeDraft
from specserve.spec.verify import accept_tree, branch_inputs, move_branch_kv

log = logging.getLogger("specserve.runner")


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
        # Draft-free methods (ngram, suffix) speculate without a drafter model.
        speculates = self.draft_cfg is not None or cfg.spec.method != "eagle3"
        self.k_max = cfg.spec.max_steps if speculates else 0
        self.topk = cfg.spec.topk if speculates else 1
        self.pending_width = max(PENDING_WIDTH, self.k_max + 1)
        self.room = cfg.spec.cache_room(self.k_max)  # slots past a sequence's end that a cycle may write
        self.block_size = cfg.kv_block_size
        self.cache_len = row_blocks(self.max_model_len, self.room, self.block_size) * self.block_size
        self.scratch = self.cache_len - 1
        self.rows = cfg.max_num_seqs
        self.drafter_max_pos = None
        if self.draft_cfg is not None:
            self.drafter_max_pos = None if cfg.spec.draft_position_extension else self.draft_cfg.max_position_embeddings

        t0 = time.perf_counter()
        self.target = load_target(cfg.model, self.device, self.dtype, self.cache_len, cfg.allow_pickle)
        self.drafter = None
        if self.draft_cfg is not None:
            self.target.aux_layers = resolve_aux_layers(
                self.draft_cfg, self.model_cfg.num_layers, cfg.aux_layer_convention
            )
            self.drafter = load_drafter(
                cfg.draft, self.target, self.device, self.dtype, self.cache_len, cfg.allow_pickle
            )
            if self.draft_cfg.target_hidden_size != self.model_cfg.hidden_size:
                raise ConfigError(
                    f"drafter expects target hidden size {self.draft_cfg.target_hidden_size} (fc input "
                    f"{3 * self.draft_cfg.target_hidden_size}), target has {self.model_cfg.hidden_size}"
                )
            if self.topk > self.draft_cfg.draft_vocab_size:
                raise ConfigError(
                    f"--spec-topk {self.topk} exceeds the drafter's draft vocabulary "
                    f"({self.draft_cfg.draft_vocab_size} tokens)"
                )
            if self.draft_cfg.vocab_size != self.model_cfg.vocab_size:
                raise ConfigError(
                    f"drafter vocab_size {self.draft_cfg.vocab_size} differs from the target's {self.model_cfg.vocab_size}"
                )
        elif cfg.spec.method == "mtp":  # the checkpoint's own MTP layer, reading the target's normed output
            from specserve.model.mtp import load_mtp

            self.target.aux_layers = (self.model_cfg.num_layers + 1,)
            self.drafter = load_mtp(cfg.model, self.target, self.device, self.dtype, cfg.allow_pickle)
        self.load_seconds = time.perf_counter() - t0
        self.draft_targets = None  # [Vd] the target id of each draft id
        if self.drafter is not None:
            self.drafter.fuse_projections(column_major=self.device.type == "cpu")
            self.draft_targets = self.drafter.to_target_ids(torch.arange(self.drafter.d2t.shape[0], device=self.device))
        if self.device.type == "cpu":  # eager Python on every forward there
            for m in (self.target, self.drafter):
                if m is not None:
                    pin_attributes(m)
        self.linear_tuning = self._tune_linear()
        self._allocate()
        self._tree_const: dict[int, dict[str, torch.Tensor]] = {}
        self.graphs: dict[GraphKey, Graph] = {}
        self.graph_batch_sizes: tuple[int, ...] = ()
        self.graph_pool = None

    def _tune_linear(self) -> dict:
        """Per weight shape and row count, the fastest product here: on GPU cuBLAS or the GEMV
        kernel (and for int4 weights the W4A16 GEMV's launch shape), on CPU (weights stored
        column-major first) MKL, oneDNN with a packed weight or the native panel GEMV."""
        from specserve.kernels.cpu_linear import column_major_copy, tune_linear_cpu
        from specserve.kernels.gemv import GEMV_ROWS, tune_linear
        from specserve.kernels.int4 import tune_int4
        from specserve.model.int4_linear import Int4Linear

        t0 = time.perf_counter()
        tensors = list(self.target.parameters()) + (self.drafter.product_weights() if self.drafter is not None else [])
        seen, weights = set(), []
        for p in tensors:
            if p is not None and p.dim() == 2 and p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                weights.append(p)
        max_rows = self.rows * (self.room + 1)  # the widest product a step runs: all rows, each verifying room + 1
        if self.device.type == "cuda":
            max_rows = min(GEMV_ROWS[-1], max_rows)
            report = tune_linear(weights, max_rows=max_rows, invariant=self.cfg.batch_invariant)
            int4 = [
                (m.weight_packed, m.weight_scale, m.weight_zero_point)
                for model in (self.target, self.drafter)
                if model is not None
                for m in model.modules()
                if isinstance(m, Int4Linear)
            ]
            report |= tune_int4(int4, max_rows=max_rows, invariant=self.cfg.batch_invariant)
        else:
            for w in weights:  # (the drafter's stacked weights already are)
                if w.is_contiguous():
                    w.data = column_major_copy(w.data)
            report = tune_linear_cpu(weights, max_rows=max_rows)
        if report:
            log.info(
                "linear kernels tuned in %.1fs: %d weight shapes, %d (shape, rows) timings (details at DEBUG)",
                time.perf_counter() - t0,
                len(report),
                sum(len(v) for v in report.values()),
            )
            log.debug("linear kernel timings per shape and rows: %s", report)
        return report

    # ------------------------------------------------------------------ memory
    def _prefill_graph_buckets(self) -> tuple[int, ...]:
        """Prompt lengths (padded up to these) prefilled by a CUDA graph: run eagerly, a large
        model's hundreds of kernel launches cost more host time than the GPU's work takes."""
        if not (
            self.device.type == "cuda"
            and self.cfg.cuda_graphs
            and self.target.graph_safe
            and getattr(self.drafter, "graph_safe", True)
        ):
            return ()
        return tuple(b for b in PREFILL_GRAPH_TOKENS if b <= self.max_model_len and b // 2 < self.cfg.prefill_chunk)

    def _prefill_bucket(self, T: int) -> int | None:
        """The prefill graph length a T-token prompt is padded to (None: longer than any)."""
        return next((b for b in self.prefill_buckets if T <= b), None)

    def _activation_bytes(self) -> int:
        """GPU memory a prefill chunk's forward takes beyond the weights, measured on a warm-up
        forward over a one-block-per-token scratch cache (only when the pool is sized from free memory)."""
        if self.device.type != "cuda" or self.cfg.gpu_memory_utilization is None:
            return 0
        T = min(self.cfg.prefill_chunk, self.max_model_len)
        bs = self.block_size
        n = -(-T // bs) + 1
        mods = list(self.target.attention_modules())
        saved = [(a.k_cache, a.v_cache) for a in mods]
        for a in mods:
            a.k_cache = torch.zeros(n, a.num_kv_heads, bs, a.head_dim, dtype=self.dtype, device=self.device)
            a.v_cache = (
                torch.zeros(n, a.num_kv_heads, bs, a.v_dim, dtype=self.dtype, device=self.device) if a.v_dim else None
            )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        table = torch.arange(n, device=self.device).unsqueeze(0)
        pos = torch.arange(T, device=self.device).unsqueeze(0)
        with torch.inference_mode():
            hidden, _ = self.target(
                torch.zeros(1, T, dtype=torch.long, device=self.device),
                ForwardContext(0, pos, pos, T, block_table=table, block_size=bs),
            )
            self.target.logits(hidden[:, -1])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        for a, (k, v) in zip(mods, saved):
            a.k_cache, a.v_cache = k, v
        return peak

    def _allocate(self) -> None:
        self.prefill_buckets = self._prefill_graph_buckets()
        block_bytes = bytes_per_block(self.target, self.drafter, self.block_size, self.dtype)
        num_blocks = plan_blocks(
            self.cfg, self.rows, self.max_model_len, self.room, block_bytes, self.device, self._activation_bytes()
        )
        num_blocks = min_over_ranks(num_blocks)  # every TP rank's engine must take the same decisions
        self.kv = KVCache(
            self.target,
            self.drafter,
            self.rows,
            self.max_model_len,
            self.room,
            self.dtype,
            self.device,
            max(self.prefill_buckets, default=0),
            self.block_size,
            num_blocks,
        )
        self.pending: PendingInputs | None = None
        if self.drafter is not None:
            feat_dim = len(self.target.aux_layers) * self.model_cfg.hidden_size  # EAGLE-3: 3H; MTP: H
            self.pending = PendingInputs(self.rows, self.pending_width, feat_dim, self.dtype, self.device)
        # Static inputs shared by all graphs (largest shapes; graphs read prefixes).
        W = max(self.room + 1, 1)
        self.s_ids = torch.zeros(self.rows, W, dtype=torch.long, device=self.device)
        P = max(self.prefill_buckets, default=0)
        # Prefill graphs: prompts packed one after another into the staging row; each token's staging index
        # (padding: the scratch slot), rope position within its prompt, and its prompt's first index (a
        # query sees no key below it); the last index of each prompt, whose logits come out.
        self.s_pf_ids = torch.zeros(1, P, dtype=torch.long, device=self.device)
        self.s_pf_pos = torch.zeros(1, P, dtype=torch.long, device=self.device)
        self.s_pf_rope = torch.zeros(1, P, dtype=torch.long, device=self.device)
        self.s_pf_lo = torch.zeros(1, P, dtype=torch.long, device=self.device)
        self.s_pf_last = torch.zeros(PREFILL_GRAPH_PROMPTS, dtype=torch.long, device=self.device)
        # With a drafter: the token after each packed index, the second half of its drafter entry (-1: no entry)
        self.s_pf_tok = torch.zeros(1, P, dtype=torch.long, device=self.device)
        self.s_pos = torch.zeros(self.rows, W, dtype=torch.long, device=self.device)
        # Trees: the drafted tree (written by the draft graph, read by the verify graph) and the
        # verify inputs staged by the host.
        N = self.cfg.spec.tree_nodes(self.k_max) if self.topk > 1 else 0
        self.tree = TreeDraft(*(torch.zeros(self.rows, N, dtype=torch.long, device=self.device) for _ in range(4)))
        self.s_root = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_pos0 = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_enabled = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        self.s_last = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_temp = torch.zeros(self.rows, dtype=torch.float32, device=self.device)
        self.s_top_p = torch.ones(self.rows, dtype=torch.float32, device=self.device)
        self.s_top_k = torch.zeros(self.rows, dtype=torch.long, device=self.device)
        self.s_seed = torch.zeros(self.rows, dtype=torch.long, device=self.device)

    def reserve_every_row(self) -> None:
        """Give row r blocks for a whole max_model_len sequence of its own, for callers that drive
        the runner without the engine's scheduler (lockstep regeneration); needs the default pool
        size (rows x max_model_len)."""
        per_row = self.kv.max_blocks - 1
        if self.kv.num_blocks < self.rows * per_row + 1:
            raise ValueError("reserve_every_row needs a pool of rows x max_model_len tokens")
        for r in range(self.rows):
            self.kv.set_row(r, list(range(1 + r * per_row, 1 + (r + 1) * per_row)))

    def move_row(self, src: int, dst: int, pending: int) -> None:
        """Move a sequence (its block-table row and pending drafter inputs) to another row."""
        if src == dst:
            return
        self.kv.move_row(src, dst)
        if self.drafter is not None and pending:
            self.pending.move_row(src, dst, pending)

    # ----------------------------------------------------------------- prefill
    @torch.inference_mode()
    def prefill(
        self,
        row_start: int,
        chunks: list[list[int]],
        starts: list[int],
        history: list[list[int]] | None = None,
        after: list[int] | None = None,
    ):
        """Run the target over one chunk per row (rows row_start..), chunk i from index starts[i]. Returns the
        logits at each row's last chunk token [m, V] and the EAGLE features there [m, 3H] (None without a
        drafter). `history`: each row's tokens before its chunk (a prefix-cache hit, an earlier chunk), with
        which a prefill graph can take rows that do not start at 0 (`_graph_prefill`). `after` (with a drafter):
        each row's token after its chunk, or -1 where none is known yet; the drafter's KV is written too, for
        the chunk's entries (feature t, token t + 1) that have their token (a row's last without one is left
        to the caller: a prompt's waits for its first cycle)."""
        m, T = len(chunks), max(len(c) for c in chunks)
        groups = None
        if all(chunks) and (history is not None or not any(starts)):
            groups = self._prefill_groups([len(c) + (len(history[i]) if history else 0) for i, c in enumerate(chunks)])
        if groups:
            outs = [
                self._graph_prefill(
                    row_start + a,
                    chunks[a:b],
                    starts[a:b],
                    history[a:b] if history else None,
                    after[a:b] if after is not None else None,
                )
                for a, b in groups
            ]
            if len(outs) == 1:
                return outs[0]
            feats = None if outs[0][1] is None else torch.cat([f for _, f in outs])
            return torch.cat([lg for lg, _ in outs]), feats
        ids = torch.zeros(m, T, dtype=torch.long)
        pos = torch.full((m, T), self.scratch, dtype=torch.long)
        last = torch.zeros(m, dtype=torch.long)
        for i, (c, s) in enumerate(zip(chunks, starts)):
            ids[i, : len(c)] = torch.tensor(c)
            pos[i, : len(c)] = torch.arange(s, s + len(c))
            last[i] = max(len(c) - 1, 0)
        ids, pos_d, last = ids.to(self.device), pos.to(self.device), last.to(self.device)
        kv_len = max(s + len(c) for c, s in zip(chunks, starts))
        ctx = ForwardContext(
            row_start, self._rope_pos(pos_d), pos_d, kv_len, block_table=self.kv.table, block_size=self.block_size
        )
        hidden, feats = self.target(ids, ctx)
        rows = torch.arange(m, device=self.device)
        if after is not None and self.drafter is not None:
            nxt = torch.zeros(m, T, dtype=torch.long)
            for i, c in enumerate(chunks):
                if c:
                    nxt[i, : len(c)] = torch.tensor(c[1:] + [after[i]])
                    if after[i] < 0:
                        pos[i, len(c) - 1] = self.scratch
            self.drafter_extend(row_start, nxt.clamp(min=0).to(self.device), feats, pos.to(self.device))
        return self.target.logits(hidden[rows, last]), None if feats is None else feats[rows, last]

    def _prefill_groups(self, lens: list[int]) -> list[tuple[int, int]] | None:
        """Rows (their tokens from the first: `lens`) cut into consecutive groups that one prefill graph each
        takes, packed (up to PREFILL_GRAPH_PROMPTS rows, their tokens summed within the largest graph): [(first
        row, past the last)], or None where a row fits no graph or the groups' graphs would replay more than two
        largest graphs' tokens (a history computed again costs more than the eager forward then saves)."""
        most = self.graph_prefill_tokens()
        if not most or max(lens) > most:
            return None
        groups, a, total = [], 0, 0
        for i, n in enumerate(lens):
            if i > a and (total + n > most or i - a == PREFILL_GRAPH_PROMPTS):
                groups.append((a, i))
                a, total = i, 0
            total += n
        groups.append((a, len(lens)))
        replayed = sum(self._prefill_bucket(sum(lens[a:b])) for a, b in groups)
        return groups if replayed <= 2 * most else None

    def graph_prefill_tokens(self) -> int:
        """Tokens (a chunk's rows from their first token, packed) the largest prefill graph takes; 0 where
        none was captured (the CPU)."""
        return max((k.tokens for k in self.graphs if k.kind == "prefill"), default=0)

    def prefill_history(self, seqs, chunks: list[list[int]], starts: list[int]) -> list[list[int]] | None:
        """`prefill`'s `history` for sequences whose chunks start past their first token (a prefix-cache hit,
        an earlier chunk, a catch-up): their tokens before the chunk, where each row's tokens from the first
        fit a prefill graph (computing them again costs less than the eager forward it saves: on a GPU a
        forward of short chunks is bound by the host; `_prefill_groups` bounds the rest); else None."""
        if (
            not any(starts)
            or not all(chunks)
            or max(s + len(c) for s, c in zip(starts, chunks)) > self.graph_prefill_tokens()
        ):
            return None
        return [seq.tokens(0, s) for seq, s in zip(seqs, starts)]

    def _graph_prefill(
        self,
        row_start: int,
        chunks: list[list[int]],
        starts: list[int],
        history: list[list[int]] | None,
        after: list[int] | None,
    ):
        """`prefill` of a group of rows (`_prefill_groups`) by one prefill graph: each row's tokens from its
        first (history, then chunk) packed one after another into the staging row, each chunk's KV (the
        target's, and the drafter's where `after` is given) then copied to its row (a history's tokens are
        computed again, their KV left where it is: a prefix-cache hit's blocks may be shared)."""
        full = [h + c for h, c in zip(history, chunks)] if history is not None else chunks
        lens = [len(f) for f in full]
        total, m = sum(lens), len(chunks)
        Tb = self._prefill_bucket(total)
        graph = self.graphs[GraphKey("prefill", 1, tokens=Tb)]
        n = torch.tensor(lens)
        first = n.cumsum(0) - n
        at = first + torch.tensor(starts)  # each chunk's first packed index
        clen = torch.tensor([len(c) for c in chunks])
        # ids, staging index, rope position, row's first index, the drafter entry's next token
        host = torch.zeros(5, Tb, dtype=torch.long)
        host[1].fill_(self.kv.stage_scratch)
        host[0, :total] = torch.tensor([t for f in full for t in f])
        host[1, :total] = torch.arange(total)
        host[3, :total] = torch.repeat_interleave(first, n)
        host[2, :total] = host[1, :total] - host[3, :total]
        host[4].fill_(-1)
        if after is not None:
            chunk_idx = torch.cat([torch.arange(a, a + c) for a, c in zip(at.tolist(), clen.tolist())])
            host[4, chunk_idx] = torch.tensor([t for c, a in zip(chunks, after) for t in c[1:] + [a]])
        last = torch.zeros(PREFILL_GRAPH_PROMPTS, dtype=torch.long)
        last[:m] = first + n - 1
        host, last = host.to(self.device, non_blocking=True), last.to(self.device, non_blocking=True)
        for buf, row in zip((self.s_pf_ids, self.s_pf_pos, self.s_pf_rope, self.s_pf_lo, self.s_pf_tok), host):
            buf[0, :Tb].copy_(row)
        self.s_pf_last.copy_(last)
        graph.graph.replay()
        drafter = after is not None and self.drafter is not None
        for i, (a, s, c) in enumerate(zip(at.tolist(), starts, clen.tolist())):
            self.kv.unstage(row_start + i, c, a, s, drafter)
        # (copies: the graph's outputs are refilled by its next replay)
        logits, feats = graph.outputs
        if feats is not None:  # each chunk's last token's
            feats = feats[0, (at + clen - 1).to(self.device, non_blocking=True)]
        return logits[:m].clone(), feats

    def _prefill_body(self, Tb: int):
        """Packed prompts (`_graph_prefill`), Tb tokens with padding at the staging scratch slot, in the
        staging cache; a query sees the keys of its own prompt up to itself. With a drafter, its KV for the
        entries that have a next token (`s_pf_tok`), from the features just computed."""
        ids, pos, lo, rope = self.s_pf_ids[:, :Tb], self.s_pf_pos[:, :Tb], self.s_pf_lo[:, :Tb], self.s_pf_rope[:, :Tb]
        with self.kv.staged(self.target.attention_modules()):
            hidden, feats = self.target(ids, ForwardContext(0, self._rope_pos(rope), pos, Tb, key_lo=lo))
        if self.drafter is not None:
            tok = self.s_pf_tok[:, :Tb]
            keep = tok >= 0
            if self.drafter_max_pos is not None:
                keep &= rope < self.drafter_max_pos
            scratch = self.kv.stage_scratch
            with self.kv.staged(self.drafter.attention_modules()):
                self.drafter.write_kv(
                    tok.clamp(min=0),
                    feats,
                    ForwardContext(0, torch.where(keep, rope, 0), torch.where(keep, pos, scratch), Tb),
                )
        return self.target.logits(hidden[0, self.s_pf_last]), feats

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
        self.drafter.write_kv(tok, feat, self._context(pos, pos, row_start))

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

    def _context(
        self,
        pos: torch.Tensor,
        rope_pos: torch.Tensor,
        row_start: int = 0,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> ForwardContext:
        """Attention metadata for rows row_start.. at cache indices `pos` (`tree`: (tree_base,
        tree_anc), see ForwardContext). CUDA: every cache position is read (graphs need static
        shapes; the Triton kernel stops at each row's end by itself). CPU: up to the furthest real
        position, since SDPA there reads every key it is given; the positions are host memory, so
        a Python pass over them is cheaper than tensor ops. When every query sits at the last key
        read (decode, draft steps), no mask is built."""
        base, anc = tree if tree is not None else (None, None)
        paged = {"block_table": self.kv.table, "block_size": self.block_size}
        if self.device.type == "cuda":
            return ForwardContext(row_start, rope_pos, pos, self.cache_len, tree_base=base, tree_anc=anc, **paged)
        flat = pos.reshape(-1).tolist()
        kv_len = max((p for p in flat if p != self.scratch), default=0) + 1
        return ForwardContext(
            row_start,
            rope_pos,
            pos,
            kv_len,
            full_view=tree is None and min(flat) >= kv_len - 1,
            tree_base=base,
            tree_anc=anc,
            **paged,
        )

    def _decode_body(self, B: int):
        ids, pos = self.s_ids[:B, :1], self.s_pos[:B, :1]
        hidden, feats = self.target(ids, self._context(pos, self._rope_pos(pos)))
        return self.target.logits(hidden[:, 0]), feats

    def _verify_body(self, B: int, K: int):
        ids, pos = self.s_ids[:B, : K + 1], self.s_pos[:B, : K + 1]
        hidden, feats = self.target(ids, self._context(pos, self._rope_pos(pos)))
        return self.target.logits(hidden), feats

    def _pick_draft(self, logits: torch.Tensor, entry_pos: torch.Tensor, sampling: bool, filtered: bool):
        """The drafter's token (draft id) from its logits [B, Vd]: the argmax, or with `sampling` its
        race over the noise the target's draw at that position uses (`draft_noise`)."""
        if not sampling:
            return logits.argmax(-1)
        B = logits.shape[0]
        probs = processed_probs(logits, self.s_temp[:B], self.s_top_p[:B], self.s_top_k[:B], filtered)
        return sample_from(probs, draft_noise(self.s_seed[:B], entry_pos + 2, self.draft_targets))

    def _draft_body(self, B: int, K: int, sampling: bool, filtered: bool):
        """Extend over the pending entries (width K+1, padded), then K-1 steps.
        s_pos[:, :K+1] holds the entries' positions, s_last the index of each
        row's last real entry."""
        d = self.drafter
        pos = self.s_pos[:B, : K + 1]
        out = d(self.pending.tok[:B, : K + 1], self.pending.feat[:B, : K + 1], self._context(pos, pos))
        rows = torch.arange(B, device=self.device)
        last = self.s_last[:B]
        g = out[rows, last].unsqueeze(1)  # [B, 1, H]
        # Position of the last real entry, then of each draft step (padding rows stay at the scratch index).
        p = pos[rows, last].unsqueeze(1) + torch.arange(K, device=self.device)
        p = p.clamp(max=self.scratch)
        tokens = []
        for i in range(K):
            # The draft chosen now is the token at sequence position p + 2 (entry p predicts p + 2).
            tid = d.to_target_ids(self._pick_draft(d.logits(g[:, 0], upcast=sampling), p[:, i], sampling, filtered))
            tokens.append(tid)
            if i + 1 < K:
                step_pos = p[:, i + 1 : i + 2]
                g = d(tid.unsqueeze(1), g, self._context(step_pos, step_pos))
        return (torch.stack(tokens, 1),)

    def _tree_draft_body(self, B: int, K: int):
        """Greedy tree drafting (EAGLE-2 style). Extend over the pending entries as a chain does;
        its top-k tokens are the depth-1 candidates. Each later step runs the k best branches so far
        (the frontier) through the drafter side by side, each seeing the context and its own
        ancestors, and offers the top-k children of each: k*k candidates scored by cumulative
        log-probability, the k best becoming the next frontier. Of all candidates the best N are
        verified. A child scores strictly below its parent, so the best N always include every
        selected node's ancestors."""
        d, k, N = self.drafter, self.topk, self.cfg.spec.tree_nodes(K)
        dev, scratch = self.device, self.scratch
        c = self._tree_constants(K)
        pos = self.s_pos[:B, : K + 1]
        out = d(self.pending.tok[:B, : K + 1], self.pending.feat[:B, : K + 1], self._context(pos, pos))
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
                d.logits(g, upcast=False), score, bits, front_idx, all_score, all_ids, all_par, off, d.d2t
            )
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
                "own": own,
                "own_bits": 1 << own,
                "depth_of_slot": torch.arange(1, K, device=dev).view(K - 1, 1).expand(K - 1, k).contiguous(),
                "front_idx": torch.arange(k, device=dev),
                "front_bits": torch.zeros(k, dtype=torch.long, device=dev),
                "cand_depth": torch.where(cand < k, 1, 2 + (cand - k).div(k * k, rounding_mode="floor")),
                "node_rows": torch.arange(1, N + 1, device=dev),  # verify row of the j-th selected node
                # root column 0 (no bits), then node j's own bit 1 << j
                "node_bits": torch.cat(
                    [torch.zeros(1, dtype=torch.long, device=dev), 1 << torch.arange(N, device=dev)]
                ),
            }
        return got

    def _tree_verify_body(self, B: int, K: int, sampling: bool = False, filtered: bool = False, grammar=None):
        """The target over [root, tree nodes] (node j at cache index pos0 + 1 + j, rope position
        pos0 + its depth, seeing the context and its ancestors); the target's token at every node
        (argmax, or with `sampling` its seeded draw, as `sample_tokens` draws) and `accept_tree`;
        the accepted branch's KV moved to indices pos0 + 1.. in every layer; the drafter's next
        inputs (feature, token) along the branch. Padding rows (pos0 at the scratch slot) write
        only there. Returns (accepted count, the branch's tokens then the next token, logits: float32
        when sampling, else the model's dtype, the branch's verify rows by depth)."""
        N, dev, scratch = self.cfg.spec.tree_nodes(K), self.device, self.scratch
        tree = self.tree.head(B, N)
        pos0 = self.s_pos0[:B].unsqueeze(1)
        pad = pos0 == scratch
        write = torch.where(pad, scratch, pos0 + torch.arange(N + 1, device=dev))
        rope = torch.cat([pos0, pos0 + tree.depth], 1).clamp(max=scratch)
        anc = torch.cat([torch.zeros_like(pos0), tree.anc], 1)
        ids = torch.cat([self.s_root[:B].unsqueeze(1), tree.tokens.clamp_min(0)], 1)  # (draft-free padding: -1)
        hidden, feats = self.target(ids, self._context(write, rope, tree=((pos0 + 1)[:, 0], anc)))
        # Greedy picks read the head's own dtype (an argmax needs no float32 copy of 32 x vocab).
        logits = self.target.logits(hidden, upcast=sampling)
        if grammar is not None:  # (rows, bitmask): constrained rows' grammar masks (constrain.masks)
            masks.apply(logits, *grammar)
        per_node = lambda t: t[:B].unsqueeze(1).expand(-1, N + 1)  # noqa: E731
        s = BatchSampling(
            per_node(self.s_temp),
            per_node(self.s_top_p),
            per_node(self.s_top_k),
            per_node(self.s_seed),
            all_greedy=not sampling,
            filtered=filtered,
        )
        pred = sample_tokens(logits, s, rope + 1)  # each node's token, keyed by the position it would fill
        n_acc, next_tok, path = accept_tree(pred, tree, K, self.s_enabled[:B])
        move_branch_kv(self.kv.target_caches(), self.kv.table[:B], self.block_size, pos0, pad, n_acc, path, K, scratch)
        grid, feat = branch_inputs(tree, feats, n_acc, next_tok, path)
        if self.pending is not None:
            self.pending.set_cycle_except(B, pad, grid, feat)
        return n_acc, grid, logits, path

    def _run(self, kind: str, B: int, body, K: int = 0, sampling: bool = False, filtered: bool = False):
        """Replay the captured graph of this kind at B's batch bucket, or run eagerly."""
        g = self.graphs.get(GraphKey(kind, self._bucket(B), K, 0, sampling, filtered))
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
        return self._run("decode", B, self._decode_body)

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
        out = self._run("draft", B, lambda b: self._draft_body(b, K, sampling, sampling), K, sampling, sampling)
        # All graphs share one memory pool, so the verify replay that follows may reuse this
        # graph's output memory: take the (small) draft tokens out first.
        return DraftResult(out[0].clone() if self.graphs else out[0])

    @torch.inference_mode()
    def verify(self, ids: torch.Tensor, pos0: torch.Tensor):
        B, W = ids.shape
        self.s_ids[:B, :W].copy_(ids)
        self.s_pos[:B, :W].copy_(pos0.unsqueeze(1) + torch.arange(W, device=self.device))
        self._fill_padding(B, W)
        return self._run("verify", B, lambda b: self._verify_body(b, W - 1), W - 1)

    @torch.inference_mode()
    def draft_tree(self, K: int, entry_pos: torch.Tensor, last_idx: torch.Tensor) -> TreeDraft:
        """Greedy tree of draft tokens (see _tree_draft_body) into `self.tree`; entries as for `draft`.
        Returns views of the first B rows."""
        B = entry_pos.shape[0]
        self.s_pos[:B, : K + 1].copy_(entry_pos)
        self.s_last[:B].copy_(last_idx)
        self._fill_padding(B, K + 1)
        self._run("tree_draft", B, lambda b: self._tree_draft_body(b, K), K)
        return self.tree.head(B, self.cfg.spec.tree_nodes(K))

    @torch.inference_mode()
    def set_tree(self, parts: list[torch.Tensor]) -> None:
        """A tree drafted elsewhere (draft-free methods: tokens, parents, depths, ancestor bits [B, N])
        into the buffers the tree verify reads."""
        B, N = parts[0].shape
        out = self.tree.head(B, N)
        for buf, val in zip((out.tokens, out.parents, out.depth, out.anc), parts):
            buf.copy_(val, non_blocking=True)

    @torch.inference_mode()
    def verify_tree(
        self,
        K: int,
        root: torch.Tensor,
        pos0: torch.Tensor,
        enabled: torch.Tensor,
        s: BatchSampling | None = None,
        grammar=None,
    ):
        """Verify the tree `draft_tree` left, rooted at token `root` at index `pos0` per row, and
        keep its accepted branch (see _tree_verify_body); rows not `enabled` accept nothing; `s`:
        the batch's sampling (None or all greedy: argmax); `grammar`: (rows, bitmask) masking the logits
        of constrained rows before the draws (`constrain.masks`), run eagerly. Returns (accepted count [B], the branch
        then the next token [B, K+1], logits [B, N+1, V], the branch's verify rows by depth [B, K])."""
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
        if grammar is not None:  # the masks come from the host each cycle: no graph holds them
            return self._tree_verify_body(B, K, sampling, filtered, grammar)
        return self._run(
            "tree_verify", B, lambda b: self._tree_verify_body(b, K, sampling, filtered), K, sampling, filtered
        )

    def sync(self) -> None:
        """Wait for the device's queued work (nothing to wait for on the CPU), to time it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def measure_step_costs(
        self, batch_sizes: list[int], spec_steps: list[int], contexts: list[int], reps: int | None = None
    ) -> dict[int, dict[tuple[int, int], float]]:
        """{context: {(batch size, K): seconds}} per plain step (K=0) and per speculative cycle (K drafts +
        verify) at each batch size and context, timed on dummy rows whose blocks are distinct (as far as the
        pool holds them), so a long context reads as many cache bytes as a real one. Seeds the adaptive policy,
        which then needs no live exploration of every K (costly in short runs).
        The K values are timed in turn, `reps` rounds (default 5 on GPU, 3 on CPU, where a cycle is
        slow and the live averages soon replace the seeds), and each takes its median: drift and a
        stray slow call (a shared CPU) hit every K alike instead of reordering them. Logs each
        (batch size, K) point as it starts."""
        reps = reps or (5 if self.device.type == "cuda" else 3)
        costs: dict[int, dict[tuple[int, int], float]] = {}
        pool = self.kv.num_blocks - 1  # (block 0 is the null block)
        blocks_at = {c: min(-(-(c + self.kv.room + 1) // self.block_size), self.kv.max_blocks - 1) for c in contexts}
        # Shapes the pool cannot hold never run: past the smallest batch they are not timed (interpolation
        # gives them the nearest timed batch's costs).
        shapes = [(c, B) for c in contexts for B in batch_sizes if B == batch_sizes[0] or B * blocks_at[c] <= pool]
        total, done = len(shapes) * (len(spec_steps) + 1), 0
        for ctx, B in shapes:
            per_row = blocks_at[ctx]  # (the row's last block, holding the scratch slot, stays the null block)
            blocks = 1 + torch.arange(B * per_row, device=self.device).view(B, per_row) % pool
            self.kv.table[:B, :per_row] = blocks
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
                    drafter = self.drafter is not None  # (draft-free methods: the verify alone)
                    if self.cfg.spec.drafts_tree(B):  # greedy cycles as the engine runs them
                        if drafter:
                            self.draft_tree(K, entry, last)
                        self.verify_tree(K, ids, pos, on)
                        return
                    d = self.draft(K, entry, last, greedy).tokens if drafter else ids.unsqueeze(1).expand(B, K)
                    self.verify(torch.cat([ids.unsqueeze(1), d], 1), pos)

                runs[K] = cycle
            for K, fn in runs.items():
                done += 1
                log.info("timing step costs: %d/%d (batch %d, K=%d, context %d)", done, total, B, K, ctx)
                fn()  # warm-up (first eager call, lazy allocations)
            times: dict[int, list[float]] = {K: [] for K in runs}
            for _ in range(reps):
                for K, fn in runs.items():
                    self.sync()
                    t0 = time.perf_counter()
                    fn()
                    self.sync()
                    times[K].append(time.perf_counter() - t0)
            costs.setdefault(ctx, {}).update({(B, K): statistics.median(ts) for K, ts in times.items()})
            self.kv.table[:B].fill_(NULL_BLOCK)
        return costs

    # ------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture_graphs(self, spec_steps: list[int], on_progress=None, enabled: bool | None = None) -> float:
        """Capture decode, draft and verify graphs for every batch bucket, largest first so smaller
        graphs reuse its memory pool. `enabled` (default: the config's cuda_graphs) lets an engine
        built without graphs capture them afterwards (the TP workers do, under a timeout)."""
        if self.device.type != "cuda" or not (self.cfg.cuda_graphs if enabled is None else enabled):
            return 0.0
        if not (self.target.graph_safe and getattr(self.drafter, "graph_safe", True)):
            log.warning("%s: no CUDA graphs (its MoE layers run the eager reference path)", self.model_cfg.architecture)
            return 0.0
        t0 = time.perf_counter()
        sizes = self.cfg.graph_batch_sizes or default_graph_batch_sizes(self.rows)
        sizes = tuple(sorted({min(b, self.rows) for b in sizes}))
        self.graph_batch_sizes = sizes
        # prompt prefills first: the largest activations, so the other graphs reuse their pool
        jobs = []
        for Tb in reversed(self.prefill_buckets):
            jobs.append((GraphKey("prefill", 1, tokens=Tb), lambda b, Tb=Tb: self._prefill_body(Tb)))
        tree_buckets = {self._bucket(n) for n in range(1, max(sizes) + 1) if self.cfg.spec.drafts_tree(n)}
        for B in sorted(sizes, reverse=True):
            jobs.append((GraphKey("decode", B), self._decode_body))
            for K in spec_steps:
                if K <= 0:
                    continue
                jobs.append((GraphKey("verify", B, K), lambda b, K=K: self._verify_body(b, K)))
                if self.drafter is not None:
                    jobs.append((GraphKey("draft", B, K), lambda b, K=K: self._draft_body(b, K, False, False)))
                    jobs.append(
                        (
                            GraphKey("draft", B, K, sampling=True, filtered=True),
                            lambda b, K=K: self._draft_body(b, K, True, True),
                        )
                    )
                if B in tree_buckets:
                    for flags in ((False, False), (True, False), (True, True)):  # greedy, sampled, filtered
                        jobs.append(
                            (
                                GraphKey("tree_verify", B, K, 0, *flags),
                                lambda b, K=K, f=flags: self._tree_verify_body(b, K, *f),
                            )
                        )
                    if self.drafter is not None:
                        jobs.append((GraphKey("tree_draft", B, K), lambda b, K=K: self._tree_draft_body(b, K)))
        # Padding state for capture: every row writes to the scratch slot.
        self.s_pos.fill_(self.scratch)
        self.s_pos0.fill_(self.scratch)
        self.s_ids.zero_()
        self.s_last.zero_()
        self.s_temp.fill_(1.0)
        self.s_pf_pos.fill_(self.kv.stage_scratch)
        self.s_pf_rope.zero_()
        self.s_pf_lo.zero_()
        self.graph_pool = capture(jobs, self.device, self.graphs, on_progress)
        self._compile_eager_attention()
        return time.perf_counter() - t0

    def _compile_eager_attention(self) -> None:
        """Compile now, once per attention shape of target and drafter, the cache-attention kernels only
        eager forwards reach (`kernels.attention.compile_eager_variants`, and for latent attention
        `kernels.latent_attention.compile_eager_latent_variants`): compiled while serving, each would
        stall every request for ~1 s."""
        from specserve.kernels.attention import compile_eager_variants
        from specserve.kernels.latent_attention import compile_eager_latent_variants
        from specserve.model.layers import KVCacheAttention
        from specserve.model.mla import LatentAttention

        done = set()
        for model in (self.target, self.drafter):
            for attn in model.attention_modules() if model is not None else ():
                key = (type(attn), attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.k_cache.dtype)
                if key in done:
                    continue
                done.add(key)
                if type(attn) is LatentAttention:
                    compile_eager_latent_variants(
                        attn.k_cache,
                        attn.num_heads,
                        attn.latent_dim,
                        attn.scale,
                        self.scratch,
                        self.kv.table,
                        self.block_size,
                        self.rows,
                    )
                elif type(attn) is KVCacheAttention:
                    compile_eager_variants(
                        attn.k_cache,
                        attn.v_cache,
                        attn.num_heads,
                        attn.scale,
                        self.scratch,
                        self.kv.table,
                        self.block_size,
                        self.rows,
                    )
        self.sync()
