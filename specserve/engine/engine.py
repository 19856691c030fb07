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
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from specserve.config import EngineConfig
from specserve.engine.adaptive import SpecPolicy, bucket_sizes
from specserve.engine.runner import ModelRunner
from specserve.engine.sampling import BatchSampling, SamplingParams, sample_tokens, to_device
from specserve.engine.speculative import accept_drafts, emitted_tokens

log = logging.getLogger("specserve.engine")


class Status(Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    def record(self, K: int, accepted: int) -> None:
        self.cycles += 1
        self.drafted += K
        self.accepted += accepted
        while len(self.drafted_per_pos) < K:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(K):
            self.drafted_per_pos[i] += 1
            if i < accepted:
                self.accepted_per_pos[i] += 1

    @property
    def accept_length(self) -> float | None:
        """Mean tokens per speculative cycle: accepted drafts + the one target token."""
        return 1 + self.accepted / self.cycles if self.cycles else None

    @property
    def accept_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def as_dict(self) -> dict:
        return {"cycles": self.cycles, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "accept_length_mean": self.accept_length, "accept_per_position": self.accept_per_position}


def _host_lists(device: torch.device, *tensors: torch.Tensor):
    """Queue copies of small device tensors into pinned host memory now; the returned function
    waits for those copies alone (not for work queued after them) and gives the values as lists."""
    if device.type != "cuda":
        return lambda: [t.tolist() for t in tensors]
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(hosts, tensors):
        h.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()

    def read():
        done.synchronize()
        return [h.tolist() for h in hosts]
    return read


@dataclass
class _Launched:
    """A plain decode step queued on the device: its sampled tokens, and their host copy."""

    seqs: list["Sequence"]
    tokens: torch.Tensor  # [B] on the device
    pos: torch.Tensor  # [B] positions of the step's input tokens
    read: Callable[[], list[list[int]]]  # waits for the tokens' host copy (`_host_lists`)
    pending_at: torch.Tensor | None = None  # [B] drafter-input slot each token was written to (drafting)

    def token_list(self) -> list[int]:
        return self.read()[0]


@dataclass
class _DraftAhead:
    """A speculative cycle's draft queued behind the previous cycle's verify, before its results
    were read: valid for the same batch (serials) and K."""

    serials: list[int]
    K: int
    draft: object  # DraftResult (chain) or TreeDraft
    marks: list | None  # profile marks around it


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1
    prefilled: int = 0  # prompt tokens already through the target
    num_cached: int = 0  # tokens with target KV
    pending: int = 0  # drafter inputs waiting (see runner)
    finish_reason: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    new_tokens: list[int] = field(default_factory=list)  # produced by the last step
    serial: int = field(default_factory=itertools.count().__next__)  # unique per engine process, never reused

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]


class Engine:
    def __init__(self, cfg: EngineConfig, eos_token_ids: set[int] | None = None, stop_checker=None,
                 on_graph_progress=None):
        self.cfg = cfg
        self.runner = ModelRunner(cfg)
        self.device = self.runner.device
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = set(eos_token_ids or ()) | set(self.runner.model_cfg.eos_token_ids)
        self.stop_checker = stop_checker  # (seq) -> truncated length or None; set by the LLM (needs the tokenizer)
        self.rows: list[Sequence | None] = [None] * self.runner.rows
        self.n_running = 0
        self.n_prefill = 0
        self.waiting: deque[Sequence] = deque()
        self.by_id: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.totals = SpecStats()
        self.tokens_generated = 0
        self.profile: list[dict] = []
        self._sampling_cache: tuple[tuple, BatchSampling] | None = None
        self._ahead: _Launched | None = None  # a plain step queued before the last one was read
        self._draft_ahead: _DraftAhead | None = None  # a cycle's draft queued before the last cycle was read
        self._chosen: int | None = None  # K for the next step, when chosen early (with a draft queued ahead)
        self.drafts_ahead = 0  # speculative cycles whose draft was queued behind the previous verify
        # When the last decode step ended, while decoding runs back to back (None after a prefill or
        # a pause). Step costs for the adaptive policy run from there: the wall time per step as the
        # user sees it, the same for plain steps queued ahead (whose GPU time overlaps the previous
        # step's host work) and for speculative cycles (which may first wait for a dropped queued step).
        self._decode_end: float | None = None
        self.launch_ahead = self.device.type == "cuda"  # pointless where nothing runs asynchronously
        spec_values = []
        if self.runner.drafter is not None:
            spec_values = list(range(1, self.runner.k_max + 1)) if cfg.adaptive else [cfg.spec_steps]
        self.graph_seconds = self.runner.capture_graphs(spec_values, on_graph_progress)
        self.spec_values = spec_values
        self.policy = SpecPolicy(cfg, self.runner.k_max) if self.runner.drafter is not None else None
        if self.policy is not None and cfg.adaptive:
            self.policy.seed_costs(self.runner.measure_step_costs(bucket_sizes(self.runner.rows), spec_values))
        self.last_k = cfg.spec_steps if self.runner.drafter is not None else 0

    @property
    def drafting(self) -> bool:
        """Whether the drafter takes part at all (not when speculation is fixed off)."""
        return self.policy is not None and self.policy.fixed != 0

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
        if K is None and not self.cfg.adaptive:
            raise ValueError("adaptive speculation needs an engine built with adaptive=True")
        self._ahead = self._draft_ahead = self._chosen = None
        self.policy.fixed = K

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
        for seq in self.rows[: self.n_running + self.n_prefill]:  # only these can hold last step's tokens
            seq.new_tokens = []
        touched: dict[str, Sequence] = {}
        self._admit()
        if self.n_prefill:
            for s in self._prefill_chunk():
                touched[s.seq_id] = s
            self._release_finished()  # a sequence may end with its first token (max_tokens=1, EOS)
            self._decode_end = None
        if self.n_running:
            for s in self._decode():
                touched[s.seq_id] = s
        self._release_finished()
        out = list(touched.values())
        for s in out:
            if s.status == Status.FINISHED:
                self.by_id.pop(s.seq_id, None)
        return out

    def _admit(self) -> None:
        while self.waiting and self.free_rows > 0:
            seq = self.waiting.popleft()
            seq.row = self.n_running + self.n_prefill
            seq.status = Status.PREFILL
            self.rows[seq.row] = seq
            self.n_prefill += 1

    def _prefill_chunk(self) -> list[Sequence]:
        budget = self.cfg.prefill_chunk
        chunks, starts, seqs = [], [], []
        for row in range(self.n_running, self.n_running + self.n_prefill):
            seq = self.rows[row]
            take = min(len(seq.prompt_ids) - seq.prefilled, budget)
            if take <= 0:
                break
            chunks.append(seq.prompt_ids[seq.prefilled: seq.prefilled + take])
            starts.append(seq.prefilled)
            seqs.append(seq)
            budget -= take
        logits, feats = self.runner.prefill(self.n_running, chunks, starts)
        done = [i for i, s in enumerate(seqs) if s.prefilled + len(chunks[i]) == len(s.prompt_ids)]
        first = None
        if done:
            params = [seqs[i].params for i in done]
            sampling = BatchSampling.build(params, [seqs[i].seed for i in done], self.device)
            pos = to_device([len(seqs[i].prompt_ids) for i in done], self.device)
            first = sample_tokens(logits[done], sampling, pos).tolist()
        for i, seq in enumerate(seqs):
            seq.prefilled += len(chunks[i])
            seq.num_cached = seq.prefilled
        if self.drafting:
            self._prefill_drafter(seqs, chunks, starts, feats, done, first)
        finished_prefill = []
        for j, i in enumerate(done):
            seq = seqs[i]
            seq.status = Status.RUNNING
            seq.first_token_time = time.perf_counter()
            seq.pending = 1 if self.drafting else 0
            self._append(seq, [first[j]])
            finished_prefill.append(seq)
        # Completed prompts are the first rows of the prefill block: they join the running prefix.
        self.n_running += len(done)
        self.n_prefill -= len(done)
        return finished_prefill

    def _prefill_drafter(self, seqs, chunks, starts, feats, done, first) -> None:
        """Write the drafter's KV for the chunk's (feature_t, token_t+1) entries;
        a completed prompt also leaves its last entry pending for the first cycle."""
        r = self.runner
        m, T = len(seqs), max(len(c) for c in chunks)
        tok = torch.zeros(m, T, dtype=torch.long)
        pos = torch.full((m, T), r.scratch, dtype=torch.long)
        first_of = dict(zip(done, first or []))
        for i, seq in enumerate(seqs):
            n = len(chunks[i])
            nxt = [seq.token_at(t + 1) if t + 1 < len(seq.prompt_ids) else first_of[i] for t in range(starts[i], starts[i] + n)]
            tok[i, :n] = torch.tensor(nxt)
            pos[i, :n] = torch.arange(starts[i], starts[i] + n)
        tok, pos = tok.to(self.device), pos.to(self.device)
        if not (m == 1 and r.drafter_prefill(self.n_running, tok[0])):
            r.drafter_extend(self.n_running, tok, feats, pos)
        for j, i in enumerate(done):
            row = seqs[i].row
            n = len(chunks[i])
            r.pending_tok[row, 0] = tok[i, n - 1]
            r.pending_feat[row, 0] = feats[i, n - 1]

    # -------------------------------------------------------------- decode
    def _decode(self) -> list[Sequence]:
        seqs = self.rows[: self.n_running]
        chosen, self._chosen = self._chosen, None
        K = chosen if chosen is not None else (self.policy.choose(len(seqs)) if self.policy else 0)
        self.last_k = K
        t_start = self._decode_end if self._decode_end is not None else time.perf_counter()
        out = self._plain_step(seqs, t_start) if K == 0 else self._spec_step(seqs, K, t_start)
        self._decode_end = time.perf_counter()
        return out

    def _sampling(self, seqs: list[Sequence]) -> BatchSampling:
        """Sampling tensors for this batch, rebuilt only when the batch's members change."""
        key = tuple(s.serial for s in seqs)
        if self._sampling_cache is None or self._sampling_cache[0] != key:
            built = BatchSampling.build([s.params for s in seqs], [s.seed for s in seqs], self.device)
            self._sampling_cache = (key, built)
        return self._sampling_cache[1]

    def _launch_plain(self, seqs: list[Sequence], ids: torch.Tensor, pos: torch.Tensor,
                      pending_at: torch.Tensor | None = None) -> _Launched:
        """Queue one plain decode step (ids/pos on the device) and the copy of its tokens to the host.
        While drafting, the step's (feature, token) pairs also go into the drafter's pending inputs
        at slots `pending_at`, on the device, before any later step can overwrite the features."""
        r = self.runner
        logits, feats = r.decode(ids, pos)
        tokens = sample_tokens(logits, self._sampling(seqs), pos + 1)
        if pending_at is not None:
            rows = torch.arange(len(seqs), device=self.device)
            r.pending_tok[rows, pending_at] = tokens
            r.pending_feat[rows, pending_at] = feats[:, 0]
        return _Launched(list(seqs), tokens, pos, _host_lists(self.device, tokens), pending_at)

    def _may_launch_ahead(self, seqs: list[Sequence]) -> bool:
        """Queue the next plain step before reading this one's tokens? With nothing waiting to join,
        no sequence ending by length this step and, while drafting, room for both steps' drafter
        inputs without a flush (on CUDA; tests switch it on elsewhere)."""
        if not self.launch_ahead or self.waiting or self.n_prefill:
            return False
        drafting, width = self.drafting, self.runner.pending_width
        return all(len(s.output_ids) + 1 < s.params.max_tokens and s.total_len + 2 < self.max_model_len
                   and (not drafting or s.pending + 2 < width) for s in seqs)

    def _plain_step(self, seqs: list[Sequence], t_start: float) -> list[Sequence]:
        """One token per sequence. On CUDA the next step is queued before this step's tokens are
        read (`_may_launch_ahead`), so the GPU runs while the host does its bookkeeping: the next
        step's input is this step's sampled token, already on the device."""
        r = self.runner
        B = len(seqs)
        drafting = self.drafting
        self._draft_ahead = None
        ahead, self._ahead = self._ahead, None
        if ahead is not None and [s.serial for s in ahead.seqs] != [s.serial for s in seqs]:
            # The batch changed since that step was queued (a sequence ended or joined). Its tokens
            # still hold for the sequences that kept running: their KV rows moved with them. Not so
            # while drafting: rows moved without that step's drafter inputs, so it is dropped (it
            # wrote nothing a later step does not rewrite).
            kept = [] if drafting else [(s, t) for s, t in zip(ahead.seqs, ahead.token_list())
                                        if s.status == Status.RUNNING and s.finish_reason is None]
            for seq, tok in kept:
                seq.num_cached += 1
                self._append(seq, [tok])
            if kept:
                return [seq for seq, _ in kept]
            ahead = None
        if ahead is not None:
            cur = ahead
        else:
            ids = to_device([s.last_token for s in seqs], self.device)
            pos = to_device([s.num_cached for s in seqs], self.device)
            cur = self._launch_plain(seqs, ids, pos, to_device([s.pending for s in seqs], self.device)
                                     if drafting else None)
        if self._may_launch_ahead(seqs):
            self._ahead = self._launch_plain(seqs, cur.tokens, cur.pos + 1,
                                             cur.pending_at + 1 if drafting else None)
        new = cur.token_list()
        for seq, tok in zip(seqs, new):
            seq.num_cached += 1
            if drafting:
                seq.pending += 1
            self._append(seq, [tok])
        if drafting and max(s.pending for s in seqs) >= r.pending_width:
            self._flush_pending(seqs, keep=1)
        if self.policy:
            self.policy.observe_cost(B, 0, time.perf_counter() - t_start)
        return list(seqs)

    def _flush_pending(self, seqs: list[Sequence], keep: int) -> None:
        """Feed the drafter all but the last `keep` pending entries of each row, then move those
        `keep` entries to the front."""
        start = to_device([s.num_cached - s.pending for s in seqs], self.device)
        fed = to_device([max(s.pending - keep, 0) for s in seqs], self.device)
        self._feed_pending(len(seqs), self.runner.pending_width, start, fed, keep)
        for s in seqs:
            s.pending = min(s.pending, keep)

    def _feed_pending(self, B: int, width: int, start: torch.Tensor, fed: torch.Tensor, keep: int) -> None:
        """Feed the drafter the first fed[b] of row b's pending entries (at positions start[b]..),
        then move the `keep` entries after them to the front: one drafter forward and one gather
        for all rows (a loop of per-row copies cost two kernel launches per sequence). Device
        tensors in, nothing read back: it can be queued ahead (`_draft_next`)."""
        r = self.runner
        j = torch.arange(width, device=self.device)
        pos = torch.where(j < fed.unsqueeze(1), start.unsqueeze(1) + j, r.scratch)
        r.drafter_extend(0, r.pending_tok[:B, :width], r.pending_feat[:B, :width], pos)
        src = (fed.unsqueeze(1) + j[:keep]).clamp(max=width - 1)  # rows with nothing fed keep theirs in place
        r.pending_tok[:B, :keep] = r.pending_tok[:B, :width].gather(1, src)
        feat = r.pending_feat[:B, :width]
        r.pending_feat[:B, :keep] = feat.gather(1, src.unsqueeze(-1).expand(-1, -1, feat.shape[-1]))

    def _spec_step(self, seqs: list[Sequence], K: int, t_start: float) -> list[Sequence]:
        r = self.runner
        B = len(seqs)
        # A plain step queued ahead is dropped: it wrote only what this cycle rewrites (target KV
        # from the current position on, drafter inputs past the pending ones).
        self._ahead = None
        ahead, self._draft_ahead = self._draft_ahead, None
        prof = self.cfg.profile
        # Drafting is skipped (acceptance forced to 0) where the drafter would pass its trained positions.
        limit = r.drafter_max_pos
        spec_ok = [limit is None or s.num_cached + K <= limit for s in seqs]
        sampling = self._sampling(seqs)
        tree = self.cfg.drafts_tree(B)
        if ahead is not None and ahead.K == K and ahead.serials == [s.serial for s in seqs]:
            draft, marks = ahead.draft, ahead.marks  # queued behind the last verify (`_draft_next`)
            self.drafts_ahead += 1
        else:
            if max(s.pending for s in seqs) > K + 1:
                self._flush_pending(seqs, keep=1)
            marks = [_Mark(self.device) for _ in range(2)] if prof else None
            if prof:
                marks[0].record()
            start = to_device([s.num_cached - s.pending for s in seqs], self.device)
            last_idx = to_device([s.pending - 1 for s in seqs], self.device)
            # rows not drafting (past the drafter's positions) get no entries
            entries = to_device([s.pending - 1 if ok else -1 for s, ok in zip(seqs, spec_ok)], self.device)
            draft = self._draft(B, K, self._entry_positions(K, start, entries), last_idx, sampling)
            if prof:
                marks[1].record()
        last = to_device([s.last_token for s in seqs], self.device)
        pos0 = to_device([s.num_cached for s in seqs], self.device)
        enabled = to_device(spec_ok, self.device, torch.bool)
        if prof:
            marks = marks + [_Mark(self.device) for _ in range(3)]
            marks[2].record()
        if tree:  # acceptance, KV move and the drafter's next inputs happen in the verify graph
            n_acc, grid, _ = r.verify_tree(K, last, pos0, enabled, sampling)
            if prof:
                marks[3].record()
        else:
            logits, feats = r.verify(torch.cat([last.unsqueeze(1), draft.tokens], 1), pos0)
            if prof:
                marks[3].record()
            n_acc, next_tok = accept_drafts(logits, draft, sampling, pos0, enabled)
            grid = emitted_tokens(draft.tokens, n_acc, next_tok)  # also the drafter's next input tokens
            r.pending_tok[:B, : K + 1] = grid
            r.pending_feat[:B, : K + 1] = feats
        if prof:
            marks[4].record()
        results = _host_lists(self.device, n_acc, grid)
        kept = self._draft_next(seqs, K, n_acc, pos0, sampling)
        acc_list, grid_list = results()  # the one host sync of the cycle
        for b, seq in enumerate(seqs):
            a = acc_list[b]
            if spec_ok[b]:
                seq.spec.record(K, a)
                self.totals.record(K, a)
            seq.num_cached += a + 1
            seq.pending = min(a + 1, kept)
            self._append(seq, grid_list[b][: a + 1])
        if self.policy:
            self.policy.observe_cost(B, K, time.perf_counter() - t_start)
            self.policy.observe_acceptance(K, [acc_list[b] for b in range(B) if spec_ok[b]], B)
        if prof:
            spans = _Mark.spans(marks, {"draft": (0, 1), "verify": (2, 3), "accept": (3, 4)})
            self.profile.append({"batch": B, "K": K, **spans})
        return list(seqs)

    def _entry_positions(self, K: int, start: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """[B, K + 1] positions of each row's drafter entries: start .. start + last (none where
        last is -1), the scratch slot after them."""
        j = torch.arange(K + 1, device=self.device)
        return torch.where(j <= last.unsqueeze(1), start.unsqueeze(1) + j, self.runner.scratch)

    def _draft(self, B: int, K: int, entry_pos: torch.Tensor, last_idx: torch.Tensor, sampling: BatchSampling):
        """Queue a cycle's draft: a tree at batch sizes that draft trees, else a chain."""
        if self.cfg.drafts_tree(B):
            return self.runner.draft_tree(K, entry_pos, last_idx)
        return self.runner.draft(K, entry_pos, last_idx, sampling)

    def _draft_next(self, seqs: list[Sequence], K: int, n_acc: torch.Tensor, pos0: torch.Tensor,
                    sampling: BatchSampling) -> int:
        """Choose the next step's K now and, where the batch should stay as it is, queue that cycle's
        draft behind this cycle's verify: the GPU then drafts while the host reads and books this
        cycle's tokens (the host work of a cycle, ~0.7 ms on an H200, otherwise leaves it idle).
        Its inputs are known on the device: the entries at pos0 .. pos0 + accepted (see `_spec_step`).
        A smaller next K first feeds the drafter the entries its draft has no room for, on the device
        too, so cycles after a switch down overlap as others do (without that, the adaptive policy
        timed such K slower than they run and favoured larger ones). Not when a sequence may end by
        length this cycle or new requests wait (the batch would change). Returns how many pending
        entries each row keeps (K + 1: all of them)."""
        if not self.launch_ahead or self.waiting or self.n_prefill:
            return K + 1
        if not all(len(s.output_ids) + K + 1 < s.params.max_tokens and s.total_len + K + 1 < self.max_model_len
                   for s in seqs):
            return K + 1
        r, B = self.runner, len(seqs)
        K2 = self._chosen = self.policy.choose(B)
        limit = r.drafter_max_pos
        if K2 == 0 or (limit is not None and any(s.num_cached + K + 1 + K2 > limit for s in seqs)):
            return K + 1
        marks = [_Mark(self.device) for _ in range(2)] if self.cfg.profile else None
        if marks:
            marks[0].record()
        last = n_acc
        if K2 < K:  # entries 0 .. a - K2 - 1 go to the drafter now; the rest move to the front
            fed = (n_acc - K2).clamp_min(0)
            self._feed_pending(B, K + 1, pos0, fed, K2 + 1)
            pos0, last = pos0 + fed, n_acc - fed
        draft = self._draft(B, K2, self._entry_positions(K2, pos0, last), last, sampling)
        if marks:
            marks[1].record()
        self._draft_ahead = _DraftAhead([s.serial for s in seqs], K2, draft, marks)
        return min(K, K2) + 1

    # ------------------------------------------------------------ finishing
    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Append accepted tokens, stopping at EOS, stop ids/strings, max_tokens or max_model_len."""
        p = seq.params
        for tok in tokens:
            seq.output_ids.append(tok)
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
        """Free the rows of finished sequences, keeping running rows a prefix
        and the prefill block right behind it (their KV moves with them)."""
        for row in range(self.n_running + self.n_prefill - 1, -1, -1):
            seq = self.rows[row]
            if seq is None or seq.finish_reason is None:
                continue
            seq.status = Status.FINISHED
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
            self.rows[self.n_running + self.n_prefill] = None

    def _move(self, src: int, dst: int) -> None:
        if src == dst:
            return
        seq = self.rows[src]
        self.runner.move_row(src, dst, seq.num_cached, seq.pending)
        self.rows[dst] = seq
        self.rows[src] = None
        seq.row = dst

    # ---------------------------------------------------------------- stats
    def kv_usage(self) -> dict:
        used = self.n_running + self.n_prefill
        return {"rows_total": self.runner.rows, "rows_used": used, "usage": used / self.runner.rows,
                "tokens_cached": sum(s.num_cached for s in self.rows[:used] if s)}

    def check_idle_integrity(self) -> None:
        """When idle every row must be free; raises if a row leaked."""
        leaked = [i for i, s in enumerate(self.rows) if s is not None]
        if leaked or self.n_running or self.n_prefill:
            raise AssertionError(f"KV rows still held while idle: {leaked}")


class _Mark:
    """A timestamp: a CUDA event on GPU, a host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ev = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.t = 0.0

    def record(self) -> None:
        if self.cuda:
            self.ev.record()
        else:
            self.t = time.perf_counter()

    @staticmethod
    def spans(marks: list["_Mark"], between: dict[str, tuple[int, int]]) -> dict:
        """Milliseconds {name: from mark i to mark j} for between = {name: (i, j)}."""
        if marks[0].cuda:
            marks[-1].ev.synchronize()
            return {n: marks[i].ev.elapsed_time(marks[j].ev) for n, (i, j) in between.items()}
        return {n: (marks[j].t - marks[i].t) * 1000 for n, (i, j) in between.items()}
