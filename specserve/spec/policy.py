"""Adaptive speculation: choose the number of draft steps K (0 = plain
decoding) for each step from measured step costs and observed acceptance.

Expected tokens per cycle with K drafts: once K has run, the mean tokens its own cycles
produced, shrunk towards the model 1 + sum_{i<=K} prod_{j<=i} a_j, where a_j is the
conditional acceptance rate at draft position j pooled over every K (tracked apart for
tree cycles, which accept more per position than chains). The pooled model alone is
biased towards long drafts: a cycle starts right after the previous one's rejection,
where the text is harder to guess, more often the longer the drafts, so rates learnt
while running a long K undervalue a shorter one and would keep the policy on the long
K where the shorter is faster. The policy
picks the K with the highest expected tokens per second at the current batch size,
K = 0 included, so speculation is used only where it pays: by SPEC_MARGIN at least, as
what a K > 0 costs beyond its cycles (the drafter's upkeep on plain steps, its catch-ups,
explorations) is not in its rate.

A batch job (`choose(B, remaining=...)`: the caller waits for every running sequence and
nothing waits to replace those that end) is judged by when its last sequence ends instead.
Its sequences need their remaining tokens in a number of cycles that varies with their
acceptance luck, and the batch runs until the unluckiest is done: a K is rated by the
tokens of the longest remaining sequence over the time of its expected cycles plus the
expected maximum, over the batch's rows, of their deviation (a normal approximation with
the tokens-per-cycle variance of the acceptance model). Plain decoding finishes every
row together. With one row this is the tokens-a-second rule. While the job's longest
sequences are still in prefill, a decode step is off its critical path: the cheapest
step is best. Coming from plain decoding (`stale`), a K > 0 first catches the drafter up
(`observe_switch` times it), once, which the job's remaining tokens must earn back: a job
charges it to every K > 0. An exploration's timing ends the back-off only if it wins by
the same rule.

Costs per (bucket, K), a bucket (`shape` in the code) being a step's batch size and its rows' mean cached
length (`batch_context`), each rounded up to a power of two (a verify's attention reads the whole cache, so a K that
pays at short context may lose at long context). Once a K has run at a bucket, the mean of its last
LIVE_WINDOW live step times without the slowest (`_window_cost`: one slow step, a pause of
the host, moves it little, where a moving average would price plain decoding out for dozens
of steps; a median would miss the long tail speculative cycles have where the host does much
of their work, as on a 135M model, and pick K > 0 at no gain); before that, the
start-up measurement (`seed_costs`: the runner times plain steps and K-cycles on dummy rows at a few buckets
and K, `startup_grid`, at one context or a few, `startup_contexts`; `interpolate_costs` and
`interpolate_contexts` fill in the rest) plus a learned offset for what that timing cannot see (host
bookkeeping), one per bucket for plain steps and one for speculative cycles, moving averages of (measured -
seeded); a context bucket without its own offset yet takes the nearest one's. Without seeded costs (e.g. a
test that skips the start-up measurement) every (bucket, K) is tried twice before the model trusts its
numbers; with them, a first live timing far above its prediction (WARMUP_OUTLIER) is taken for one-off
warm-up and skipped.

Every EXPLORE_EVERY-th choice at a bucket runs the K with the stalest live cost
among those within EXPLORE_WITHIN of the best, judged optimistically (by the lower of
its live cost and its start-up cost without the offset), so one bad estimate cannot
lock the policy out of a better K for good, plain decoding included: a few slow cycles
of one K raise the shared offset of every speculative K, which can make plain decoding
look best while another K would still beat it, and one slow plain step timed live can
keep plain decoding out while speculation is in fact slower. While plain decoding is best,
speculation backs off: each exploration of a K > 0 doubles the wait for the next, up to
EXPLORE_MAX_GAP, since one costs a catch-up of the drafter after the plain steps before it; and
where that catch-up is dear against a plain step (a model whose eager forward costs tens of its
graph-replayed decode steps), the wait is stretched until catch-ups take at most EXPLORE_SHARE of
the time. An exploration whose own timing would make its K the best ends the wait.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from functools import lru_cache
from statistics import NormalDist

from specserve.config import EngineConfig
from specserve.engine.protocol import SpeculationPolicy

_EMA = 0.2
LIVE_WINDOW = 9  # live timings a (bucket, K)'s cost is taken from (`_window_cost`)
OWN_PRIOR = 8  # sequence-cycles of weight the pooled model keeps in a K's own tokens-per-cycle mean
EXPLORE_EVERY = 24
# Speculation is chosen over plain decoding only when expected to be this much faster: what a K > 0 costs
# beyond its cycles (the drafter's upkeep and catch-ups, explorations) goes unpriced, so a near tie loses.
SPEC_MARGIN = 0.05
EXPLORE_WITHIN = 0.7  # explore a K only if its optimistic tokens/s is at least this share of the best
# A K > 0 explored from plain decoding first catches the drafter up on the plain steps before it, so at a
# bucket each exploration of any K > 0 that leaves plain best doubles the decisions before the next, up to this.
EXPLORE_MAX_GAP = 16 * EXPLORE_EVERY
# Past that gap, explorations from plain decoding wait until the catch-ups they cost (`observe_switch`) add up
# to at most this share of the time spent on the plain steps between them.
EXPLORE_SHARE = 0.02
# The first live timing of a (bucket, K) may be a batch size start-up did not time, paying one-off warm-up
# (kernels compiled, graphs captured): above this multiple of its prediction it is skipped; a second is kept.
WARMUP_OUTLIER = 4.0


def _window_cost(times) -> float:
    """A step's cost from its recent timings: their mean without the slowest once there are three (a lone
    pause is dropped; a tail of steady slow steps, which throughput pays, is kept), else the lowest."""
    ordered = sorted(times)
    return sum(ordered[:-1]) / (len(ordered) - 1) if len(ordered) >= 3 else ordered[0]


def _best(rate: dict[int, float]) -> int:
    """The K of the highest rate, plain decoding unless a K > 0 beats it by SPEC_MARGIN."""
    K = max(rate, key=rate.get)
    return 0 if K and 0 in rate and rate[K] < (1 + SPEC_MARGIN) * rate[0] else K


@lru_cache(maxsize=1024)
def _expected_max_normal(n: int) -> float:
    """The expected maximum of n standard normal draws (Blom's approximation; 0 for one)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def _bucket(B: int) -> int:
    b = 1
    while b < B:
        b *= 2
    return b


# The smallest context bucket: below it a step's cost hardly depends on its context.
CONTEXT_MIN = 64


def context_bucket(n: int) -> int:
    """A step's context bucket: its mean cached length rounded up to a power of two, CONTEXT_MIN at least."""
    return 1 << (max(n, CONTEXT_MIN) - 1).bit_length()


def batch_context(seqs) -> int:
    """The context a batch's step reads: its sequences' mean cached length (the cache its attention
    reads grows with their sum)."""
    return sum(s.total_len for s in seqs) // max(len(seqs), 1)


def context_buckets(max_len: int) -> list[int]:
    """Every context bucket up to the one of `max_len`."""
    out = [CONTEXT_MIN]
    while out[-1] < max_len:
        out.append(2 * out[-1])
    return out


def startup_contexts(max_len: int, cheap: bool) -> list[int]:
    """The contexts start-up times steps at: where a step is cheap (a GPU), the smallest bucket, the longest
    context the engine holds and one between (geometrically), as verify costs grow with the cache read;
    else one short context (a CPU takes minutes for one), and live timings land in their own buckets."""
    if not cheap or max_len <= 2 * CONTEXT_MIN:
        return [min(max_len // 2, 4 * CONTEXT_MIN)]
    return sorted({CONTEXT_MIN, int(math.sqrt(CONTEXT_MIN * max_len)), max_len})


def bucket_sizes(max_batch: int) -> list[int]:
    """One batch size per bucket up to `max_batch` (the largest bucket measured at `max_batch`)."""
    return sorted({min(_bucket(B), max_batch) for B in range(1, max_batch + 1)})


def startup_grid(buckets: list[int], spec_steps: list[int], drafts_tree) -> tuple[list[int], list[int]]:
    """The batch sizes and K values (> 0) timed at start-up: the smallest, middle (geometrically)
    and largest bucket, plus the largest that drafts trees (tree cycles cost unlike chains); the
    smallest, middle and largest K. Timing every pair takes minutes on a small CPU, and live
    timings replace these seeds anyway; `interpolate_costs` fills in the rest."""
    trees = [b for b in buckets if drafts_tree(b)]
    picked_b = {buckets[0], buckets[len(buckets) // 2], buckets[-1]} | ({trees[-1]} if trees else set())
    ks = sorted(spec_steps)
    picked_k = {ks[0], ks[len(ks) // 2], ks[-1]} if ks else set()
    return sorted(picked_b), sorted(picked_k)


def _interpolate(x: int, known: dict[int, float]) -> float:
    """Piecewise-linear through the known points, constant past the ends."""
    xs = sorted(known)
    if x <= xs[0] or x >= xs[-1]:
        return known[xs[0] if x <= xs[0] else xs[-1]]
    hi = next(i for i, v in enumerate(xs) if v >= x)
    x0, x1 = xs[hi - 1], xs[hi]
    return known[x0] + (known[x1] - known[x0]) * (x - x0) / (x1 - x0)


def interpolate_costs(
    timed: dict[tuple[int, int], float], buckets: list[int], ks: list[int], drafts_tree=lambda B: False
) -> dict[tuple[int, int], float]:
    """Seconds for every (bucket, K) from those timed: linear in K at each timed bucket, then
    linear in the batch size at each K. Tree and chain buckets are interpolated apart (K = 0
    across all), since a tree cycle's cost does not lie on the chains' line."""
    by_b: dict[int, dict[int, float]] = {}
    for (B, K), sec in timed.items():
        by_b.setdefault(B, {})[K] = sec
    full_k = {B: {K: _interpolate(K, known) for K in ks} for B, known in by_b.items()}
    out = {}
    for B in buckets:
        for K in ks:
            same = [b for b in full_k if K == 0 or drafts_tree(b) == drafts_tree(B)] or list(full_k)
            out[(B, K)] = timed.get((B, K), _interpolate(B, {b: full_k[b][K] for b in same}))
    return out


def interpolate_contexts(
    by_context: dict[int, dict[tuple[int, int], float]], contexts: list[int]
) -> dict[int, dict[tuple[int, int], float]]:
    """{context: {(bucket, K): seconds}} for every context in `contexts` from those timed: linear in the
    context between timed ones (a step's cache reads grow linearly with it), the nearest timed past the ends."""
    keys = set().union(*by_context.values())
    return {
        c: {key: _interpolate(c, {t: costs[key] for t, costs in by_context.items()}) for key in keys} for c in contexts
    }


class SpecPolicy(SpeculationPolicy):
    def __init__(self, cfg: EngineConfig, k_max: int):
        self.cfg = cfg
        self.fixed = None if cfg.spec.adaptive else cfg.spec.steps
        self.k_max = k_max
        # Keyed by (batch bucket, context bucket, K); a step's `shape` is its (batch bucket, context bucket).
        self.cost: dict[tuple[int, int, int], float] = {}  # seconds per step, measured live
        self.recent: dict[tuple[int, int, int], deque] = {}  # its last LIVE_WINDOW live timings
        self.tries: dict[tuple[int, int, int], int] = {}
        self.seeded: dict[tuple[int, int, int], float] = {}  # seconds, from start-up
        # (batch bucket, speculative?) -> {context bucket: live - seeded}
        self.offset: dict[tuple[int, bool], dict[int, float]] = {}
        # Conditional acceptance per position, from a weak optimistic prior (Beta(2, 1)); kept apart
        # for tree cycles (SpecConfig.drafts_tree), which accept more.
        self.tree = cfg.spec.drafts_tree
        self.acc_hits = {mode: [2.0] * k_max for mode in (False, True)}
        self.acc_seen = {mode: [3.0] * k_max for mode in (False, True)}
        self.own_tokens: dict[tuple[bool, int], list[float]] = {}  # (tree?, K) -> [tokens, sequence-cycles]
        # (tree?, K) -> (expected tokens a cycle, their variance): every choice rates every K, but these change
        # only as acceptance is observed (a host-bound plain step would pay tens of microseconds for them)
        self._token_model: dict[tuple[bool, int], tuple[float, float]] = {}
        self.choices: dict[int, int] = {}  # how often each K was chosen
        self.decisions: dict[tuple[int, int], int] = {}  # shape -> choices made there
        self.last_seen: dict[tuple[int, int, int], int] = {}  # (shape, K) -> decision count at its last live timing
        self.explored: dict[tuple[int, int], tuple[int, int]] = {}  # shape -> (last exploration of a K > 0, gap)
        self.job: dict[tuple[int, int], list[int] | None] = {}  # shape -> the batch job's remaining budgets
        self.switch_cost: dict[tuple[int, int], float] = {}  # shape -> seconds of its last switch to speculation
        # Tensor-parallel ranks measure different step times; each must run the same K.
        # The TP worker sets this to a broadcast of rank 0's choice (K -> K).
        self.sync_choice = None

    def acceptance(self, tree: bool = False) -> list[float]:
        return [h / n for h, n in zip(self.acc_hits[tree], self.acc_seen[tree])]

    def expected_tokens(self, K: int, tree: bool = False) -> float:
        return self._tokens_of(K, tree)[0]

    def tokens_variance(self, K: int, tree: bool = False) -> float:
        """Variance of the tokens a K-cycle yields, from the pooled acceptance model:
        with A accepted drafts, E[A^2] = sum_i (2i - 1) P(A >= i)."""
        return self._tokens_of(K, tree)[1]

    def _tokens_of(self, K: int, tree: bool) -> tuple[float, float]:
        """(expected tokens, pooled-model variance) of a K-cycle, kept until acceptance is next observed."""
        model = self._token_model.get((tree, K))
        if model is None:
            total, run, mean, second = 1.0, 1.0, 0.0, 0.0
            for i, a in enumerate(self.acceptance(tree)[:K], 1):
                run *= a
                total += run
                mean += run
                second += (2 * i - 1) * run
            tokens, n = self.own_tokens.get((tree, K), (0.0, 0))
            model = self._token_model[(tree, K)] = (
                (tokens + OWN_PRIOR * total) / (n + OWN_PRIOR),
                max(second - mean * mean, 0.0),
            )
        return model

    def fresh(self, k_max: int | None = None) -> "SpecPolicy":
        """A policy with this one's settings (K up to `k_max`, at most this one's) and start-up costs and nothing
        learnt live: what a new engine starts from (the bench runs adaptive K on an engine shared with fixed-K
        runs, whose timings and acceptance would otherwise carry over)."""
        p = SpecPolicy(self.cfg, min(self.k_max, k_max or self.k_max))
        p.fixed, p.seeded, p.sync_choice = self.fixed, dict(self.seeded), self.sync_choice
        return p

    def seed_costs(self, costs: dict[tuple[int, int], float], context: int = 0) -> None:
        """Start-up timings {(batch size, K): seconds} at `context` tokens, mapped to their buckets."""
        c = context_bucket(context)
        for (B, K), seconds in costs.items():
            self.seeded[(_bucket(B), c, K)] = seconds

    def predicted_cost(self, bucket: int, K: int, context: int = 0) -> float | None:
        """Seconds a step of K is expected to take at a batch bucket and `context` tokens (None: unknown)."""
        return self._predicted((bucket, context_bucket(context)), K)

    def _predicted(self, shape: tuple[int, int], K: int) -> float | None:
        key = (*shape, K)
        if key in self.cost:
            return self.cost[key]
        if key in self.seeded:
            return self.seeded[key] + self._offset(shape, K > 0)
        return None

    def _offset(self, shape: tuple[int, int], spec: bool) -> float:
        """The learned (live - seeded) offset at `shape`, else at the nearest context bucket of its batch
        bucket that has one (host bookkeeping hardly depends on the context)."""
        b, c = shape
        by_context = self.offset.get((b, spec))
        if not by_context:
            return 0.0
        if c in by_context:
            return by_context[c]
        return by_context[min(by_context, key=lambda cb: abs(cb.bit_length() - c.bit_length()))]  # (powers of 2)

    def optimistic_cost(self, shape: tuple[int, int], K: int) -> float:
        """The lower of K's live cost and its start-up cost without the offset (one of them known)."""
        return min(c for c in (self.cost.get((*shape, K)), self.seeded.get((*shape, K))) if c is not None)

    def choose(self, B: int, remaining: list[int] | None = None, stale: bool = False, context: int = 0) -> int:
        """K for the next step of B sequences whose mean cached length is `context` (`batch_context`);
        `remaining`: when they belong to a batch job whose end is what counts (see the module docstring),
        the remaining token budgets of its sequences, this step's B first, then those still in prefill;
        else None. `stale`: a K > 0 would first catch the drafter up on plain steps (a batch job is then
        charged the last catch-up's time at this shape)."""
        if self.fixed is not None:
            K = self.fixed
        else:
            shape = (_bucket(B), context_bucket(context))
            n = self.decisions[shape] = self.decisions.get(shape, 0) + 1
            tree = self.tree(B)
            self.job[shape] = remaining
            switch = self._switch_cost(shape) if stale else 0.0
            rate = self._rates(shape, tree, remaining, B, switch=switch)
            untried = [k for k in range(self.k_max + 1) if k not in rate]
            if untried:
                K = untried[0]
            else:
                K = _best(rate)
                if K:
                    self.explored.pop(shape, None)  # speculation is best: explored at the base rate once it is not
                if n % EXPLORE_EVERY == 0:
                    hope = {k: self.expected_tokens(k, tree) / self.optimistic_cost(shape, k) for k in rate}
                    near = [
                        k
                        for k in hope
                        if k != K and hope[k] >= EXPLORE_WITHIN * rate[K] and (not k or self._due(shape, n))
                    ]
                    if near:
                        K = min(near, key=lambda k: self.last_seen.get((*shape, k), -1))
                        if K:
                            gap = self.explored.get(shape, (0, EXPLORE_EVERY // 2))[1]
                            self.explored[shape] = (n, min(2 * gap, EXPLORE_MAX_GAP))
            if self.sync_choice is not None:
                K = self.sync_choice(K)
        self.choices[K] = self.choices.get(K, 0) + 1
        return K

    def _due(self, shape: tuple[int, int], n: int) -> bool:
        """Whether a K > 0 may be explored at the n-th decision at `shape`: once the back-off gap since
        the last exploration of any K > 0 there has passed (plain decoding, the cheapest step, always may)."""
        last, gap = self.explored.get(shape, (None, 0))
        if last is None:
            return True
        plain = self._predicted(shape, 0)
        if plain:
            gap = max(gap, self._switch_cost(shape) / (EXPLORE_SHARE * plain))
        return n - last >= gap

    def _switch_cost(self, shape: tuple[int, int]) -> float:
        """Seconds a switch to speculation costs at `shape`: its last catch-up, else the dearest timed at
        any shape (a batch's rows end one by one, and each smaller bucket would pay one to learn its own)."""
        return self.switch_cost.get(shape, max(self.switch_cost.values(), default=0.0))

    def observe_switch(self, B: int, seconds: float, context: int = 0) -> None:
        """The one-off cost of a switch from plain decoding to speculation at batch B and `context` tokens
        (the drafter's catch-up on the plain steps before it), which no K's cycle is charged."""
        self.switch_cost[(_bucket(B), context_bucket(context))] = seconds

    def _rates(
        self,
        shape: tuple[int, int],
        tree: bool,
        remaining: list[int] | None = None,
        B: int = 0,
        costs: dict[int, float | None] | None = None,
        switch: float = 0.0,
    ) -> dict[int, float]:
        """Expected tokens a second for each K whose cost at `shape` is known (or given in `costs`):
        of every row, or for a batch job (`remaining`; this step's B rows first) of the row expected to
        end last, every K > 0 charged `switch` seconds once."""
        costs = costs or {k: self._predicted(shape, k) for k in range(self.k_max + 1)}
        if not remaining or not max(remaining):
            return {k: self._tokens_of(k, tree)[0] / c for k, c in costs.items() if c is not None}
        if max(remaining[:B], default=0) < max(remaining):
            # The job's longest sequences are still in prefill, not in this step: it only delays them.
            return {k: 1.0 / c for k, c in costs.items() if c is not None}
        # The m rows with the most tokens left (r_m, the least of them) end no sooner than r_m/E cycles
        # plus the expected maximum of m normal deviations; the batch, by the largest of these.
        tops, m = [], 0
        for r, count in sorted(Counter(remaining).items(), reverse=True):
            m += count
            tops.append((r, _expected_max_normal(m)))
        R = tops[0][0]
        rates = {}
        for k, c in costs.items():
            if c is None:
                continue
            E, v = self._tokens_of(k, tree)
            cycles = max(r / E + z * math.sqrt(r * v / E**3) for r, z in tops)
            rates[k] = R / (cycles * c + (switch if k else 0.0))
        return rates

    def _would_win(self, shape: tuple[int, int], B: int, K: int, seconds: float) -> bool:
        """Whether K, at `seconds` a cycle, would rate above every other K, by the rule of the last
        choice at `shape` (tokens a second, or a batch job's end)."""
        remaining = self.job.get(shape)
        costs = {k: self._predicted(shape, k) for k in range(self.k_max + 1)}
        costs[K] = seconds
        return _best(self._rates(shape, self.tree(B), remaining, B, costs)) == K

    def observe_cost(self, B: int, K: int, seconds: float, context: int = 0) -> None:
        """A live timing of a step of K at batch B and `context` tokens (`batch_context`)."""
        shape = (_bucket(B), context_bucket(context))
        key = (*shape, K)
        n = self.tries.get(key, 0)
        self.tries[key] = n + 1
        self.last_seen[key] = self.decisions.get(shape, 0)
        if n == 0 and key in self.seeded and seconds > WARMUP_OUTLIER * self._predicted(shape, K):
            return  # a batch size of the bucket that start-up did not time, paying its warm-up: not learned from
        if key in self.seeded:
            by_context = self.offset.setdefault((shape[0], K > 0), {})
            old = by_context.get(shape[1])
            diff = seconds - self.seeded[key]
            by_context[shape[1]] = diff if old is None else (1 - _EMA) * old + _EMA * diff
        elif n == 0:
            return  # the first run of a shape pays warm-up costs; don't learn from it
        if K and shape in self.explored and self._would_win(shape, B, K, seconds):
            self.explored.pop(shape, None)  # this timing would make K the best: worth another look soon
        recent = self.recent.setdefault(key, deque(maxlen=LIVE_WINDOW))
        recent.append(seconds)
        self.cost[key] = _window_cost(recent)

    def snapshot(self) -> dict:
        """{batch bucket: {context bucket: {K: start-up, live and predicted cost (ms, the one `choose` uses: live,
        else start-up plus the learned offset) and how often K was timed}}} (bench details, /server_info)."""
        out: dict = {}
        for key in sorted(set(self.seeded) | set(self.cost)):
            row = {
                "seeded_ms": self.seeded.get(key),
                "live_ms": self.cost.get(key),
                "predicted_ms": self._predicted(key[:2], key[2]),
                "timed": self.tries.get(key, 0),
            }
            b, c, k = map(str, key)
            out.setdefault(b, {}).setdefault(c, {})[k] = {
                n: (round(v * 1e3, 3) if isinstance(v, float) else v) for n, v in row.items()
            }
        return out

    def observe_acceptance(self, K: int, accepted: list[int], B: int) -> None:
        """Accepted counts of a cycle at depth K for a batch of B sequences."""
        mode = self.tree(B)
        self._token_model.clear()
        hits, seen = self.acc_hits[mode], self.acc_seen[mode]
        own = self.own_tokens.setdefault((mode, K), [0.0, 0])
        own[0] += sum(accepted) + len(accepted)
        own[1] += len(accepted)
        for a in accepted:
            for j in range(min(K, a + 1)):
                seen[j] += 1
                if j < a:
                    hits[j] += 1
