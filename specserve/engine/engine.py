"""The engine loop: admission, chunked prefill, plain or speculative decode
steps over a continuously changing batch, and statistics.

One `step()` runs at most one prefill chunk (so new prompts never stall
running streams for long) and one decode or speculative cycle for every
running sequence. `generate`, `bench` and the server all drive this loop.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque

import torch

from specserve.config import EngineConfig
from specserve.constrain import masks
from specserve.engine.block_pool import NULL_BLOCK
from specserve.engine.logprobs import LogprobBatch, TokenLogprob
from specserve.engine.profiling import Mark
from specserve.engine.protocol import ServingEngine
from specserve.engine.readback import DeviceWaits, host_lists
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import BatchSampling, SamplingParams, sample_tokens, to_device
from specserve.engine.scheduler import Scheduler
from specserve.engine.sequence import Sequence, SpecStats, Status
from specserve.spec.draft_free import TextFirst, chain_drafts, text_proposer, tree_drafts
from specserve.spec.overlap import Launched, Overlap
from specserve.spec.policy import (
    SpecPolicy,
    batch_context,
    bucket_sizes,
    context_buckets,
    interpolate_contexts,
    interpolate_costs,
    startup_contexts,
    startup_grid,
)
from specserve.spec.proposer import DraftResult, Proposer
from specserve.spec.verify import accept_drafts, emitted_tokens

log = logging.getLogger("specserve.engine")


class Engine(ServingEngine):
    def __init__(
        self, cfg: EngineConfig, eos_token_ids: set[int] | None = None, stop_checker=None, on_graph_progress=None
    ):
        self.cfg = cfg
        self.runner = ModelRunner(cfg)
        self.device = self.runner.device
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = set(eos_token_ids or ()) | set(self.runner.model_cfg.eos_token_ids)
        self.stop_checker = stop_checker  # (seq) -> truncated length or None; set by the LLM (needs the tokenizer)
        self.grammars = None  # compiles requests' grammars (constrain.grammar.Grammars); set by the LLM
        self.rows: list[Sequence | None] = [None] * self.runner.rows
        self.n_running = 0
        self.n_prefill = 0
        self.waiting: deque[Sequence] = deque()
        self.by_id: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.steps_taken = 0  # engine steps so far
        self.step_s = 0.0  # host time inside `step`, and of it the waits for device results:
        self.device_waits = DeviceWaits()
        self._deferred_since: int | None = None  # the step admissions began to wait (`cfg.admit_wait`)
        self.totals = SpecStats()
        self.tokens_generated = 0
        self.profile: list[dict] = []  # per speculative cycle: draft/verify/accept spans, while `profiling`
        self.profiling = cfg.profile  # a runtime switch: `cfg` stays as the engine was built
        self._sampling_cache: tuple[tuple, BatchSampling] | None = None
        # The last decode step's (batch size, K, context, start), until its cost goes to the adaptive policy:
        # the wall time from its start to the start of what the engine does next (the next step,
        # a prefill chunk, or nothing when no sequence runs), so the handling of the tokens it emitted,
        # the engine's and its caller's, which grows with them (a speculative cycle emits several a
        # sequence), is charged to it and not to whichever K runs next. The same wall time per step as
        # the user sees it for plain steps queued ahead (whose GPU time overlaps the previous step's
        # host work) and for speculative cycles, less a switch's one-off work (`_untimed`).
        self._timing: tuple[int, int, int, float] | None = None
        # Whether the caller waits for all it submitted together (LLM.generate): once nothing waits to be
        # admitted, the adaptive policy then aims at the last running sequence's end (SpecPolicy.choose).
        self.batch_job = False
        r = self.runner
        # Blocks a running sequence holds past its length: two cycles' writes (a draft may be queued
        # behind a verify) and a plain step queued ahead.
        self.scheduler = Scheduler(r.kv, cfg.prefix_cache, margin=2 * (r.room + 1) + 1)
        self.proposer = Proposer(self.runner) if self.runner.drafter is not None else None
        self.text_drafts = text_proposer(cfg.spec)  # draft-free methods: drafts from the text itself
        # beside a drafter model (--text-drafts): the text's drafts where they do better
        self.text_first = TextFirst(self.text_drafts) if self.proposer and self.text_drafts else None
        self.overlap = Overlap(self.device, self.max_model_len)
        spec_values = []
        if self.runner.k_max:
            spec_values = list(range(1, self.runner.k_max + 1)) if cfg.spec.adaptive else [cfg.spec.steps]
        self.graph_seconds = self.runner.capture_graphs(spec_values, on_graph_progress)
        self.spec_values = spec_values
        self.policy = SpecPolicy(cfg, self.runner.k_max) if self.runner.k_max else None
        if self.policy is not None and cfg.spec.adaptive:
            buckets = bucket_sizes(self.runner.rows)
            contexts = startup_contexts(self.max_model_len - 1, self.device.type == "cuda")
            timed = self.runner.measure_step_costs(*startup_grid(buckets, spec_values, cfg.spec.drafts_tree), contexts)
            by_context = {
                c: interpolate_costs(t, buckets, [0] + spec_values, cfg.spec.drafts_tree) for c, t in timed.items()
            }
            for c, costs in interpolate_contexts(by_context, context_buckets(self.max_model_len)).items():
                self.policy.seed_costs(costs, c)
        self.last_k = cfg.spec.steps if self.runner.k_max else 0

    @property
    def launch_ahead(self) -> bool:
        """Whether work is queued ahead of the host (on by default on CUDA only)."""
        return self.overlap.enabled

    @launch_ahead.setter
    def launch_ahead(self, on: bool) -> None:
        self.overlap.enabled = on

    @property
    def drafts_ahead(self) -> int:
        """Speculative cycles whose draft was queued behind the previous verify."""
        return self.overlap.drafts_used

    @property
    def drafting(self) -> bool:
        """Whether the drafter takes part at all (not when speculation is fixed off)."""
        return self.proposer is not None and self.policy.fixed != 0

    def set_spec_steps(self, K: int | None) -> None:
        """Switch between plain decoding (0), a fixed K, or adaptive K (None) on an
        idle engine, reusing its weights and graphs (bench compares settings this way)."""
        if self.has_work():
            raise RuntimeError("set_spec_steps needs an idle engine")
        if self.policy is None:
            if K:
                raise ValueError("this engine has no drafter: only plain decoding (K=0) is possible")
            return
        if K is not None and K != 0 and K not in self.spec_values:
            raise ValueError(f"K={K} has no captured graphs; this engine supports 0 and {self.spec_values}")
        if K is None and not self.cfg.spec.adaptive:
            raise ValueError("adaptive speculation needs an engine built with adaptive=True")
        self.overlap.clear()
        if (K == 0) != (self.policy.fixed == 0):  # cached blocks hold drafter KV only while drafting
            self.scheduler.pool.clear_cache()
        self.policy.fixed = K

    def set_prefix_cache(self, on: bool) -> None:
        """Turn prefix caching on or off on an idle engine (bench compares both this way); turning
        it off forgets every cached block."""
        if self.has_work():
            raise RuntimeError("set_prefix_cache needs an idle engine")
        pool = self.scheduler.pool
        if not on:
            pool.clear_cache()
        pool.prefix_cache = on

    # ------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: str | None = None) -> Sequence:
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.runner.model_cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in 0..{vocab - 1}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                f"(room is needed for at least one new token)"
            )
        seq_id = seq_id or f"seq-{next(self._ids)}"
        if seq_id in self.by_id:
            raise ValueError(f"request id {seq_id!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        seq = Sequence(seq_id, list(prompt_ids), params, seed)
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine has no tokenizer to compile grammars with (build it through LLM)")
            # GrammarError (a ValueError) names the fault: this request fails alone, at admission.
            seq.matcher = self.grammars.matcher(params.grammar, params.stop_token_ids)
        if params.logprobs is not None:
            seq.logprobs = []
        self.by_id[seq_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, seq_id: str) -> None:
        """Drop a request now (client gone): its row and KV are freed at once."""
        seq = self.by_id.get(seq_id)
        if seq is None or seq.status == Status.FINISHED:
            return
        if seq.status == Status.WAITING:
            self.waiting.remove(seq)
            self._finish(seq, "abort")
            if self.text_drafts is not None:  # (a preempted sequence drafted before)
                self.text_drafts.forget(seq)
            del self.by_id[seq_id]
            return
        self._finish(seq, "abort")
        self._release_finished()
        del self.by_id[seq_id]

    def has_work(self) -> bool:
        return bool(self.waiting or self.n_running or self.n_prefill)

    @property
    def free_rows(self) -> int:
        return self.runner.rows - self.n_running - self.n_prefill

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Advance every active sequence; returns those that produced tokens or finished."""
        t0 = time.perf_counter()
        for seq in self.rows[: self.n_running + self.n_prefill]:  # only these can hold last step's tokens
            seq.new_tokens = []
        touched: dict[str, Sequence] = {}
        self.steps_taken += 1
        self._admit()
        if self.n_prefill:
            self._close_timing()
            for s in self._prefill_chunk():
                touched[s.seq_id] = s
            self._release_finished()  # a sequence may end with its first token (max_tokens=1, EOS)
        if self.n_running:
            for s in self._decode():
                touched[s.seq_id] = s
        self._release_finished()
        out = list(touched.values())
        for s in out:
            if s.status == Status.FINISHED:
                self.by_id.pop(s.seq_id, None)
        self.step_s += time.perf_counter() - t0
        return out

    def _admission_deferred(self, ahead: int = 0) -> bool:
        """Whether waiting requests stay out `ahead` steps from now (`cfg.admit_wait`): only while others
        decode and none prefills, until those that fit the free rows fill a whole prefill chunk, or rows
        have stood free for them admit_wait steps. A prefill chunk reads the target's weights once however
        few prompts it holds (a MoE chunk nearly every expert), so arrivals let in as each row frees up
        (speculation's uneven endings free them one or two at a time) pay that again and again. Counted in
        steps, the rule decides alike on every tensor-parallel rank."""
        wait, free = self.cfg.admit_wait, self.free_rows
        if not (wait and self.waiting and free and self.n_running and not self.n_prefill):
            return False
        if sum(s.prefill_len - s.prefilled for s in itertools.islice(self.waiting, free)) >= self.cfg.prefill_chunk:
            return False
        since = self._deferred_since if self._deferred_since is not None else self.steps_taken + ahead
        return self.steps_taken + ahead - since < wait

    def _batch_fixed(self) -> bool:
        """Whether the next step runs the same sequences, as far as admissions go (work queued ahead
        assumes it; a sequence ending early is handled where the queued work is read)."""
        return not self.n_prefill and (not self.waiting or self._admission_deferred(1))

    def _admit(self) -> None:
        self.scheduler.step()
        if self._admission_deferred():
            if self._deferred_since is None:
                self._deferred_since = self.steps_taken
            return
        self._deferred_since = None
        while self.waiting and self.free_rows > 0:
            row = self.n_running + self.n_prefill
            if not self.scheduler.admit(self.waiting[0], row, self.rows[: self.n_running]):
                break  # first come, first served: later arrivals wait too
            seq = self.waiting.popleft()
            seq.row = row
            seq.status = Status.PREFILL
            self.rows[seq.row] = seq
            self.n_prefill += 1

    def _prefill_chunk(self) -> list[Sequence]:
        budget = self.cfg.prefill_chunk
        chunks, starts, seqs = [], [], []
        for row in range(self.n_running, self.n_running + self.n_prefill):
            seq = self.rows[row]
            take = min(seq.prefill_len - seq.prefilled, budget)
            if take <= 0:
                break
            chunks.append(seq.tokens(seq.prefilled, seq.prefilled + take))
            starts.append(seq.prefilled)
            seqs.append(seq)
            budget -= take
        ends = [s.prefilled + len(chunks[i]) == s.prefill_len for i, s in enumerate(seqs)]
        done = [i for i, end in enumerate(ends) if end]
        logits, feats = self.runner.prefill(
            self.n_running,
            chunks,
            starts,
            self.runner.prefill_history(seqs, chunks, starts),
            self.proposer.after(seqs, chunks, starts, ends) if self.drafting else None,
        )
        # A resumed sequence (preempted earlier) already has the token its prefill ends at.
        fresh = [i for i in done if not seqs[i].resumed]
        first = {i: seqs[i].last_token for i in done}  # chunk index -> the token after its prefill
        lps: dict[int, list[TokenLogprob]] = {}  # chunk index -> that token's log-probabilities
        if fresh:
            params = [seqs[i].params for i in fresh]
            sampling = BatchSampling.build(params, [seqs[i].seed for i in fresh], self.device)
            pos = to_device([seqs[i].prefill_len for i in fresh], self.device)
            logits = logits[fresh]
            self._mask_next([seqs[i] for i in fresh], logits)
            first_t = sample_tokens(logits, sampling, pos)
            lp = self._logprobs([seqs[i] for i in fresh], logits, first_t)
            read = self._read_logprobs([seqs[i] for i in fresh], lp)
            lps = {i: read[k] for k, i in enumerate(fresh) if k in read}
            first.update(zip(fresh, first_t.tolist()))
        for i, seq in enumerate(seqs):
            seq.prefilled += len(chunks[i])
            seq.num_cached = seq.prefilled
        if self.drafting:
            self.proposer.prefilled(seqs, done, [first[i] for i in done], feats)
        for seq in seqs:
            self.scheduler.prefilled(seq)
        finished_prefill = []
        for i in done:
            seq = seqs[i]
            seq.status = Status.RUNNING
            seq.pending, seq.stale = (1 if self.drafting else 0), 0
            if not seq.resumed:
                seq.first_token_time = time.perf_counter()
                self._append(seq, [first[i]], lps.get(i))
            finished_prefill.append(seq)
        # Completed prompts are the first rows of the prefill block: they join the running prefix.
        self.n_running += len(done)
        self.n_prefill -= len(done)
        return finished_prefill

    # -------------------------------------------------------------- decode
    def _reserve_blocks(self) -> None:
        """Every running sequence holds blocks for its next writes; when the pool runs short, the
        most recently arrived running sequence is preempted (see engine.scheduler)."""
        i = 0
        while i < self.n_running:
            if self.scheduler.grow(self.rows[i]):
                i += 1
                continue
            victim = max(self.rows[: self.n_running], key=lambda s: s.serial)
            log.info("KV pool full: preempting %s (%d tokens) to recompute later", victim.seq_id, victim.total_len)
            self._vacate(victim.row)
            self.scheduler.preempt(victim)
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            i = 0

    def _decode(self) -> list[Sequence]:
        self._reserve_blocks()
        if not self.n_running:
            return []
        seqs = self.rows[: self.n_running]
        ov = self.overlap
        chosen, ov.chosen = ov.chosen, None
        context = batch_context(seqs)
        K = (
            chosen
            if chosen is not None
            else (
                self.policy.choose(len(seqs), self._job_remaining(), any(s.stale for s in seqs), context)
                if self.policy
                else 0
            )
        )
        self.last_k = K
        self._close_timing()
        self._timing = (len(seqs), K, context, time.perf_counter())
        if K and self.text_drafts is not None and self.proposer is None:
            return self._text_spec_step(seqs, K)
        return self._plain_step(seqs) if K == 0 else self._spec_step(seqs, K)

    def _job_remaining(self) -> list[int] | None:
        """Where a batch job's end is what counts (nothing waits for a row) and the policy chooses K, the
        remaining token budgets of its sequences: those decoding and those still in prefill, which are
        in the race too."""
        if not self.batch_job or self.waiting or self.policy.fixed is not None:
            return None
        return [
            min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.total_len)
            for s in self.rows[: self.n_running + self.n_prefill]
        ]

    def _untimed(self, work) -> float:
        """Run `work`, and wait for the device to finish it and whatever was queued before, outside the
        current step's timing; returns the seconds that took."""
        t0 = time.perf_counter()
        work()
        self.runner.sync()
        took = time.perf_counter() - t0
        if self._timing is not None:
            B, K, context, start = self._timing
            self._timing = (B, K, context, start + took)
        return took

    def _close_timing(self) -> None:
        """The last decode step's cost, from its start until now, to the adaptive policy."""
        if self._timing is not None and self.policy:
            B, K, context, t0 = self._timing
            self.policy.observe_cost(B, K, time.perf_counter() - t0, context)
        self._timing = None

    def _sampling(self, seqs: list[Sequence]) -> BatchSampling:
        """Sampling tensors for this batch, rebuilt only when the batch's members change."""
        key = tuple(s.serial for s in seqs)
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            built = BatchSampling.build([s.params for s in seqs], [s.seed for s in seqs], self.device)
            self._sampling_cache = (key, built)
        return self._sampling_cache[1]

    def _logprobs(
        self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor, path: torch.Tensor | None = None
    ) -> LogprobBatch | None:
        """Log-probabilities of the emitted tokens for the rows of `seqs` whose requests ask for
        them (see LogprobBatch for the arguments); None when none do. (Finding the rows costs what a
        cache key of the batch would: one pass over it.)"""
        rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return None
        return LogprobBatch(logits, tokens, rows, max(seqs[b].params.logprobs for b in rows), path)

    @staticmethod
    def _read_logprobs(seqs: list[Sequence], batch: LogprobBatch | None) -> dict[int, list[TokenLogprob]]:
        if batch is None:
            return {}
        return batch.read([seqs[b].params.logprobs for b in batch.rows])

    def _launch_plain(
        self, seqs: list[Sequence], ids: torch.Tensor, pos: torch.Tensor, pending_at: torch.Tensor | None = None
    ) -> Launched:
        """Queue one plain decode step (ids/pos on the device) and the copy of its tokens to the host.
        With `pending_at`, the step's (feature, token) pairs also go into the drafter's pending inputs
        at those slots, on the device, before any later step can overwrite the features."""
        logits, feats = self.runner.decode(ids, pos)
        self._mask_next(seqs, logits)
        tokens = sample_tokens(logits, self._sampling(seqs), pos + 1)
        lp = self._logprobs(seqs, logits, tokens)
        if pending_at is not None:
            rows = torch.arange(len(seqs), device=self.device)
            self.proposer.pending.set_at(rows, pending_at, tokens, feats[:, 0])
        read = host_lists(self.device, tokens, waits=self.device_waits)
        return Launched(list(seqs), tokens, pos, read, pending_at, lp)

    def _plain_step(self, seqs: list[Sequence]) -> list[Sequence]:
        """One token per sequence. On CUDA the next step is queued before this step's tokens are
        read (`Overlap.may_queue_plain`), so the GPU runs while the host does its bookkeeping: the
        next step's input is this step's sampled token, already on the device.
        While drafting (adaptive mode), a step only stores its drafter inputs, and only while every
        row's buffer has room and none is stale; after that the batch's rows go stale and plain
        steps do no drafter work at all until a speculative cycle catches the drafter up
        (`Proposer.catch_up`): a long stretch of plain steps costs what plain decoding costs."""
        drafting = self.drafting
        ov = self.overlap
        ov.draft = None
        ahead, ov.plain = ov.plain, None
        if ahead is not None and [s.serial for s in ahead.seqs] != [s.serial for s in seqs]:
            # The batch changed since that step was queued (a sequence ended or joined). Its tokens
            # still hold for the sequences that kept running: their KV rows moved with them. Not so
            # where it stored drafter inputs: rows moved without them, so it is dropped (it wrote
            # nothing a later step does not rewrite).
            kept = (
                []
                if ahead.pending_at is not None
                else [
                    (b, s, t)
                    for b, (s, t) in enumerate(zip(ahead.seqs, ahead.token_list()))
                    if s.status == Status.RUNNING and s.finish_reason is None
                ]
            )
            lps = self._read_logprobs(ahead.seqs, ahead.logprobs) if kept else {}
            for b, seq, tok in kept:
                self._advance(seq, drafting, stored=False)
                self._append(seq, [tok], lps.get(b))
            if kept:
                return [seq for _, seq, _ in kept]
            ahead = None
        width = self.proposer.width if drafting else 0
        if ahead is not None:
            cur = ahead
        else:
            ids = to_device([s.last_token for s in seqs], self.device)
            pos = to_device([s.num_cached for s in seqs], self.device)
            store = all(s.stale == 0 and s.pending < width for s in seqs)
            cur = self._launch_plain(
                seqs, ids, pos, to_device([s.pending for s in seqs], self.device) if store else None
            )
        stored = cur.pending_at is not None
        # A constrained row's next mask needs this step's token on the host: nothing is queued ahead.
        if ov.may_queue_plain(seqs, self._batch_fixed()) and not self._constrained(seqs):
            store = stored and all(s.pending + 1 < width for s in seqs)
            ov.plain = self._launch_plain(seqs, cur.tokens, cur.pos + 1, cur.pending_at + 1 if store else None)
        new = cur.token_list()
        lps = self._read_logprobs(seqs, cur.logprobs)
        for b, (seq, tok) in enumerate(zip(seqs, new)):
            self._advance(seq, drafting, stored)
            self._append(seq, [tok], lps.get(b))
        return list(seqs)

    @staticmethod
    def _advance(seq: Sequence, drafting: bool, stored: bool) -> None:
        """Book a plain step's token: its drafter entry is pending (stored or, if not, stale)."""
        seq.num_cached += 1
        if drafting:
            seq.pending += 1
            seq.stale += not stored

    def _spec_step(self, seqs: list[Sequence], K: int) -> list[Sequence]:
        r, pr, ov = self.runner, self.proposer, self.overlap
        B = len(seqs)
        # A plain step queued ahead is dropped: it wrote only what this cycle rewrites (target KV
        # from the current position on, drafter inputs past the pending ones). The device still runs
        # it: waited for outside the cycle's time, as a switch's cost, once per switch (charged to K,
        # it would price every exploration of K from plain decoding a plain step too high).
        if ov.plain is not None:
            ov.plain = None
            self._untimed(lambda: None)
        ahead, ov.draft = ov.draft, None
        prof = self.profiling
        # Drafting is skipped (acceptance forced to 0) where the drafter would pass its trained positions.
        limit = pr.max_pos
        spec_ok = [limit is None or s.num_cached + K <= limit for s in seqs]
        sampling = self._sampling(seqs)
        tree = self.cfg.spec.drafts_tree(B)
        text = None  # the text's drafts, where they replace the drafter's (`TextFirst`)
        scored = bool(self.text_first) and not tree  # (a draft queued ahead leaves the text's unread)
        if ahead is not None and ahead.K == K and ahead.serials == [s.serial for s in seqs]:
            draft, marks = ahead.draft, ahead.marks  # queued behind the last verify (`Overlap.queue_draft`)
            ov.drafts_used += 1
            scored = False
        else:
            if any(s.stale for s in seqs):
                # Catching up (an eager forward over the plain steps before this cycle) is paid once
                # per switch, not per cycle of K: it stays out of the cycle's time (on CUDA the device
                # is waited for on both sides, so its kernels are not charged either), which would
                # otherwise raise K's cost after every plain stretch (and each exploration of K from
                # plain decoding would time it slow again). The policy spaces explorations by it instead.
                r.sync()  # (work queued before belongs to this cycle)
                took = self._untimed(lambda: pr.catch_up(seqs, self.cfg.prefill_chunk))
                self.policy.observe_switch(B, took, batch_context(seqs))
            if max(s.pending for s in seqs) > K + 1:
                pr.flush(seqs, keep=1)
            marks = [Mark(self.device) for _ in range(2)] if prof else None
            if prof:
                marks[0].record()
            text = self.text_first.draft(seqs, K, self.device) if scored else None
            if text is not None:  # the drafter is fed its pending entries, as its own draft would have
                pr.flush(seqs, keep=0)
                draft = DraftResult(text)
            else:
                draft = pr.draft_batch(seqs, K, spec_ok, sampling)
            if prof:
                marks[1].record()
        last = to_device([s.last_token for s in seqs], self.device)
        pos0 = to_device([s.num_cached for s in seqs], self.device)
        enabled = to_device(spec_ok, self.device, torch.bool)
        if prof:
            marks = marks + [Mark(self.device) for _ in range(3)]
            marks[2].record()
        constrained = self._constrained(seqs)
        if tree:  # acceptance, KV move and the drafter's next inputs happen in the verify graph
            n_acc, grid, logits, path = r.verify_tree(
                K, last, pos0, enabled, sampling, self._tree_masks(seqs, constrained, draft)
            )
            if prof:
                marks[3].record()
            lp = self._logprobs(seqs, logits, grid, path)
        else:
            logits, feats = r.verify(torch.cat([last.unsqueeze(1), draft.tokens], 1), pos0)
            if prof:
                marks[3].record()
            self._mask_chain(seqs, constrained, draft.tokens, logits)
            n_acc, next_tok = accept_drafts(logits, draft, sampling, pos0, enabled)
            grid = emitted_tokens(draft.tokens, n_acc, next_tok)  # also the drafter's next input tokens
            pr.pending.set_cycle(B, grid, feats)
            lp = self._logprobs(seqs, logits, grid)
        if prof:
            marks[4].record()
        results = host_lists(self.device, n_acc, grid, waits=self.device_waits)
        kept = ov.queue_draft(
            seqs, K, n_acc, pos0, sampling, self._batch_fixed(), self.policy, pr, prof, self._job_remaining()
        )
        acc_list, grid_list = results()  # the one host sync of the cycle
        lps = self._read_logprobs(seqs, lp)
        for b, seq in enumerate(seqs):
            a = acc_list[b]
            if spec_ok[b]:
                seq.spec.record(K, a)
                self.totals.record(K, a)
            seq.num_cached += a + 1
            seq.pending = min(a + 1, kept)
            self._append(seq, grid_list[b][: a + 1], lps.get(b))
        if self.policy:
            self.policy.observe_acceptance(K, [acc_list[b] for b in range(B) if spec_ok[b]], B)
        if scored:
            self.text_first.observe(text is not None, acc_list, grid_list)
        if prof:
            spans = Mark.spans(marks, {"draft": (0, 1), "verify": (2, 3), "accept": (3, 4)})
            self.profile.append({"batch": B, "K": K, **spans})
        return list(seqs)

    def _text_spec_step(self, seqs: list[Sequence], K: int) -> list[Sequence]:
        """A speculative cycle of a draft-free method: drafts from the text on the host, then the verify
        (chain or tree) and acceptance EAGLE-3's drafts go through. Where no row has a draft, a plain
        step instead, timed as one: a K-cycle's cost is paid only where the text offers a draft."""
        r, ov, B = self.runner, self.overlap, len(seqs)
        tree = self.cfg.spec.drafts_tree(B)
        N = self.cfg.spec.tree_nodes(K)
        drafted = (
            tree_drafts(self.text_drafts, seqs, K, N) if tree else chain_drafts(self.text_drafts, seqs, K, self.device)
        )
        if drafted is None:
            self._timing = (B, 0, *self._timing[2:])
            return self._plain_step(seqs)
        if ov.plain is not None:  # dropped, as in `_spec_step`
            ov.plain = None
            self._untimed(lambda: None)
        ov.draft = None
        sampling = self._sampling(seqs)
        last = to_device([s.last_token for s in seqs], self.device)
        pos0 = to_device([s.num_cached for s in seqs], self.device)
        lengths = drafted[1]
        enabled = to_device([n > 0 for n in lengths], self.device, torch.bool)
        grammar = self._text_masks(seqs, drafted, tree)
        if tree:
            r.set_tree(drafted[0])
            n_acc, grid, logits, path = r.verify_tree(K, last, pos0, enabled, sampling, grammar)
            lp = self._logprobs(seqs, logits, grid.clamp_min(0), path)  # (PAD past a row's draft: never read)
        else:
            drafts = drafted[0]
            logits, _ = r.verify(torch.cat([last.unsqueeze(1), drafts.clamp_min(0)], 1), pos0)
            if grammar is not None:
                masks.apply(logits, *grammar)
            n_acc, next_tok = accept_drafts(logits, DraftResult(drafts), sampling, pos0, enabled)
            grid = emitted_tokens(drafts, n_acc, next_tok)
            lp = self._logprobs(seqs, logits, grid.clamp_min(0))  # (PAD past a row's draft: never read)
        acc_list, grid_list = host_lists(self.device, n_acc, grid, waits=self.device_waits)()
        lps = self._read_logprobs(seqs, lp)
        for b, seq in enumerate(seqs):  # rows without a draft count too: they paid the cycle for one token
            a = acc_list[b]
            seq.spec.record(K, a)
            self.totals.record(K, a)
            seq.num_cached += a + 1
            self._append(seq, grid_list[b][: a + 1], lps.get(b))
        self.policy.observe_acceptance(K, acc_list, B)
        return list(seqs)

    # ------------------------------------------------------------ grammars
    @staticmethod
    def _constrained(seqs: list[Sequence]) -> list[int]:
        """Batch rows of the sequences whose output follows a grammar."""
        return [b for b, s in enumerate(seqs) if s.matcher is not None]

    def _mask_next(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Mask the next-token logits [B, V] of constrained rows with their matchers' state."""
        rows = self._constrained(seqs)
        if rows:
            bitmask = masks.fill([seqs[b].matcher for b in rows], [[[]] for _ in rows], logits.shape[-1])
            masks.apply(logits, rows, bitmask)

    def _mask_chain(self, seqs: list[Sequence], rows: list[int], drafts: torch.Tensor, logits: torch.Tensor) -> None:
        """Mask a chain verify's logits [B, K+1, V]: position i of a constrained row with the state
        after its first i drafted tokens."""
        if rows:
            drafted = drafts[rows].tolist()
            bitmask = masks.fill(
                [seqs[b].matcher for b in rows], [masks.chain_paths(d) for d in drafted], logits.shape[-1]
            )
            masks.apply(logits, rows, bitmask)

    def _text_masks(self, seqs: list[Sequence], drafted, tree: bool) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [R, verify positions, words]) for the verify of text drafts (`chain_drafts` /
        `tree_drafts`: padded with PAD past each row's length). Positions past a row's draft are never
        emitted from, so they take the mask of its last drafted position."""
        rows = self._constrained(seqs)
        if not rows:
            return None
        lengths = drafted[1]
        if tree:
            tokens, parents = drafted[0][0], drafted[0][1]
            width = tokens.shape[1] + 1
            paths = [
                masks.tree_paths(tokens[b, : lengths[b]].tolist(), parents[b, : lengths[b]].tolist()) for b in rows
            ]
        else:
            drafts = drafted[0].tolist()
            width = len(drafts[0]) + 1
            paths = [masks.chain_paths(drafts[b][: lengths[b]]) for b in rows]
        paths = [p + [p[-1]] * (width - len(p)) for p in paths]
        return rows, masks.fill([seqs[b].matcher for b in rows], paths, self.runner.model_cfg.vocab_size)

    def _tree_masks(self, seqs: list[Sequence], rows: list[int], tree) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [R, N+1, words]) for a tree verify: each verify row of a constrained
        sequence masked with the state after the drafted tokens on its branch; None: none constrained."""
        if not rows:
            return None
        tokens, parents = tree.tokens[rows].tolist(), tree.parents[rows].tolist()
        paths = [masks.tree_paths(t, p) for t, p in zip(tokens, parents)]
        return rows, masks.fill([seqs[b].matcher for b in rows], paths, self.runner.model_cfg.vocab_size)

    # ------------------------------------------------------------ finishing
    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append accepted tokens (with their log-probabilities, when the request asks), stopping at
        EOS, stop ids/strings, max_tokens or max_model_len."""
        p = seq.params
        for i, tok in enumerate(tokens):
            # A complete grammar constrains nothing more (tokens after its stop token: ignore_eos).
            if seq.matcher is not None and not seq.matcher.done and not seq.matcher.accept(tok):
                # Every constrained draw is masked, so this is a bug; it ends this sequence alone.
                log.error("%s: token %d breaks its grammar; ending it", seq.seq_id, tok)
                self._finish(seq, "abort")
                return
            seq.output_ids.append(tok)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[i])
            seq.new_tokens.append(tok)
            self.tokens_generated += 1
            if not p.ignore_eos and tok in self.eos_token_ids:
                self._finish(seq, "stop")
                return
            if tok in p.stop_token_ids:
                self._finish(seq, "stop")
                return
            if len(seq.output_ids) >= p.max_tokens:
                self._finish(seq, "length")
                return
            if seq.total_len >= self.max_model_len:
                self._finish(seq, "length")
                return
        if p.stop and self.stop_checker is not None and self.stop_checker(seq):
            self._finish(seq, "stop")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        if seq.row < 0:  # never held a row; otherwise _release_finished frees it
            seq.status = Status.FINISHED

    def _release_finished(self) -> None:
        """Free the rows and blocks of finished sequences, keeping running rows a prefix and the
        prefill block right behind it."""
        for row in range(self.n_running + self.n_prefill - 1, -1, -1):
            seq = self.rows[row]
            if seq is None or seq.finish_reason is None:
                continue
            seq.status = Status.FINISHED
            self._vacate(row)
            self.scheduler.release(seq)
            if self.text_drafts is not None:
                self.text_drafts.finished(seq)
        if not self.n_running:
            self._close_timing()  # (the engine may now wait for requests: not the last step's cost)

    def _vacate(self, row: int) -> None:
        """Take the sequence at `row` out of the row table, moving others to keep it compact."""
        seq = self.rows[row]
        seq.row = -1
        if row < self.n_running:
            last = self.n_running - 1
            self._move(last, row)
            # Pull the prefill block down by one to close the gap it leaves.
            for src in range(self.n_running, self.n_running + self.n_prefill):
                self._move(src, src - 1)
            self.n_running -= 1
        else:
            for src in range(row + 1, self.n_running + self.n_prefill):
                self._move(src, src - 1)
            self.n_prefill -= 1
        end = self.n_running + self.n_prefill
        self.rows[end] = None
        self.runner.kv.set_row(end, [])

    def _move(self, src: int, dst: int) -> None:
        if src == dst:
            return
        seq = self.rows[src]
        self.runner.move_row(src, dst, seq.pending - seq.stale)
        self.rows[dst] = seq
        self.rows[src] = None
        seq.row = dst

    # ---------------------------------------------------------------- stats
    def kv_usage(self) -> dict:
        used = self.n_running + self.n_prefill
        pool = self.scheduler.pool
        return {
            "rows_total": self.runner.rows,
            "rows_used": used,
            "usage": pool.used() / pool.usable,
            "tokens_cached": sum(s.num_cached for s in self.rows[:used] if s),
            "preemptions": self.scheduler.preemptions,
            **pool.stats(),
        }

    def check_idle_integrity(self) -> None:
        """When idle every row is free, no block is referenced, the free and cached lists cover the
        pool exactly once and the block table points nowhere; raises AssertionError otherwise."""
        leaked = [i for i, s in enumerate(self.rows) if s is not None]
        if leaked or self.n_running or self.n_prefill:
            raise AssertionError(f"KV rows still held while idle: {leaked}")
        self.scheduler.pool.check_idle()
        if bool((self.runner.kv.table != NULL_BLOCK).any()):
            raise AssertionError("block table rows still point at blocks while idle")
