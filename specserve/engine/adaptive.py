"""Adaptive speculation: choose the number of draft steps K (0 = plain
decoding) for each step from measured step costs and observed acceptance.

Expected tokens per cycle with K drafts: 1 + sum_{i<=K} prod_{j<=i} a_j, where
a_j is the conditional acceptance rate at draft position j (tracked apart for
tree cycles, which accept more per position than chains). The policy picks
the K with the highest expected tokens per second at the current batch size,
K = 0 included, so speculation is used only where it pays.

Costs per (batch bucket, K) come from a measurement at start-up (`seed_costs`:
the runner times plain steps and K-cycles on dummy rows) plus a learned offset
for what the start-up timing cannot see (host bookkeeping, longer contexts):
one offset per bucket for plain steps and one for speculative cycles, moving
averages of (measured - seeded). Without seeded costs (e.g. a test that skips
the start-up measurement) every (bucket, K) is tried twice before the model
trusts its numbers.
"""

from __future__ import annotations

from specserve.config import EngineConfig

_EMA = 0.2


def _bucket(B: int) -> int:
    b = 1
    while b < B:
        b *= 2
    return b


def bucket_sizes(max_batch: int) -> list[int]:
    """One batch size per bucket up to `max_batch` (the largest bucket measured at `max_batch`)."""
    return sorted({min(_bucket(B), max_batch) for B in range(1, max_batch + 1)})


class SpecPolicy:
    def __init__(self, cfg: EngineConfig, k_max: int):
        self.fixed = None if cfg.adaptive else cfg.spec_steps
        self.k_max = k_max
        self.cost: dict[tuple[int, int], float] = {}  # (bucket, K) -> seconds per step, measured live
        self.tries: dict[tuple[int, int], int] = {}
        self.seeded: dict[tuple[int, int], float] = {}  # (bucket, K) -> seconds, from start-up
        self.offset: dict[tuple[int, bool], float] = {}  # (bucket, speculative?) -> live - seeded
        # Conditional acceptance per position, from a weak optimistic prior (Beta(2, 1)); kept apart
        # for tree cycles (EngineConfig.drafts_tree), which accept more.
        self.tree = cfg.drafts_tree
        self.acc_hits = {mode: [2.0] * k_max for mode in (False, True)}
        self.acc_seen = {mode: [3.0] * k_max for mode in (False, True)}
        self.choices: dict[int, int] = {}  # how often each K was chosen
        # Tensor-parallel ranks measure different step times; each must run the same K.
        # The TP worker sets this to a broadcast of rank 0's choice (K -> K).
        self.sync_choice = None

    def acceptance(self, tree: bool = False) -> list[float]:
        return [h / n for h, n in zip(self.acc_hits[tree], self.acc_seen[tree])]

    def expected_tokens(self, K: int, tree: bool = False) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance(tree)[:K]:
            run *= a
            total += run
        return total

    def seed_costs(self, costs: dict[tuple[int, int], float]) -> None:
        """Start-up timings {(batch size, K): seconds}; batch sizes are mapped to their bucket."""
        for (B, K), seconds in costs.items():
            self.seeded[(_bucket(B), K)] = seconds

    def predicted_cost(self, bucket: int, K: int) -> float | None:
        if (bucket, K) in self.seeded:
            return self.seeded[(bucket, K)] + self.offset.get((bucket, K > 0), 0.0)
        return self.cost.get((bucket, K)) if self.tries.get((bucket, K), 0) >= 2 else None

    def choose(self, B: int) -> int:
        if self.fixed is not None:
            K = self.fixed
        else:
            bucket = _bucket(B)
            costs = {k: self.predicted_cost(bucket, k) for k in range(self.k_max + 1)}
            untried = [k for k, c in costs.items() if c is None]
            if untried:
                K = untried[0]
            else:
                tree = self.tree(B)
                K = max(costs, key=lambda k: self.expected_tokens(k, tree) / costs[k])
            if self.sync_choice is not None:
                K = self.sync_choice(K)
        self.choices[K] = self.choices.get(K, 0) + 1
        return K

    def observe_cost(self, B: int, K: int, seconds: float) -> None:
        key = (_bucket(B), K)
        n = self.tries.get(key, 0)
        self.tries[key] = n + 1
        if key in self.seeded:  # (start-up timing already ran this shape: no warm-up left to skip)
            okey = (key[0], K > 0)
            old = self.offset.get(okey)
            diff = seconds - self.seeded[key]
            self.offset[okey] = diff if old is None else (1 - _EMA) * old + _EMA * diff
            return
        if n == 0:
            return  # the first run of a shape pays warm-up costs; don't learn from it
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def observe_acceptance(self, K: int, accepted: list[int], B: int) -> None:
        """Accepted counts of a cycle at depth K for a batch of B sequences."""
        hits, seen = self.acc_hits[self.tree(B)], self.acc_seen[self.tree(B)]
        for a in accepted:
            for j in range(min(K, a + 1)):
                seen[j] += 1
                if j < a:
                    hits[j] += 1
