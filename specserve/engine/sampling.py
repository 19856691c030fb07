"""Sampling parameters, logit processing and sync-free sampling.

Random numbers come from a counter-based hash of (seed, token position,
stream, vocabulary index) instead of a stateful generator: a seeded request
then produces the same tokens whatever else shares its batch, and every draw is a
plain tensor op (no host sync, CUDA-graph safe).

Speculative decoding draws exactly what plain decoding draws: the target's token at
position t is always the exponential race over the noise of (seed, t, STREAM_TARGET),
and a draft token is kept only where it equals that draw ("target-only" verification),
so a seeded request's output does not depend on K, the batch or the drafter. The
drafter races its own distribution over the same noise (`draft_noise`): where its
distribution is close to the target's, both races pick the same token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specserve.constrain.grammar import GrammarSpec
from specserve.kernels.argmax import argmax

STREAM_TARGET = 1  # every sampled token, and (coupled) the drafter's proposals

_M32 = 0xFFFFFFFF

MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat limit)


@dataclass
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Report each emitted token's log-probability and this many most likely alternatives
    # (0..MAX_TOP_LOGPROBS); None: report nothing. See engine.logprobs.
    logprobs: int | None = None
    # Whose earlier texts suffix speculation may draft from (the OpenAI `user` field); None: this request's own.
    tenant: str | None = None
    # The output follows this grammar (a JSON schema, a tool-call format); None: unconstrained.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError unless every field fits the batch tensors one step packs
        (int64 and finite float32): a request that fails here must fail alone, at
        admission, never inside a step it shares with others."""
        if not _is_int64(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int64(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer in 0..2**63-1 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int64(self.seed):
            raise ValueError(f"seed must be an integer in -2**63..2**63-1, got {self.seed!r}")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a list of strings, got {self.stop!r}")
        if not all(_is_int64(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be 64-bit integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (_is_int64(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs!r}")
        if self.tenant is not None and not isinstance(self.tenant, str):
            raise ValueError(f"tenant must be None or a string, got {self.tenant!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {type(self.grammar).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int64(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply). Values stay below 2**63 in int64."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int, columns: int | torch.Tensor) -> torch.Tensor:
    """Uniform floats in (0, 1), shape [*seeds.shape, C], a pure function of (seed, position,
    stream, column): columns 0..C-1 for an int `columns`, else the ids in the 1-D tensor."""
    # Hash the position before adding the stream so (pos, stream) pairs never alias linearly.
    key = _mix32((_mix32(positions.long() & _M32) + stream * 0x632BE5AB) & _M32)
    key = _mix32((seeds.long() & _M32) ^ key)
    if isinstance(columns, int):
        columns = torch.arange(columns, device=seeds.device, dtype=torch.long)
    cols = _mix32(columns.long() * 0x27D4EB2D & _M32)
    h = _mix32((key.unsqueeze(-1) + cols) & _M32)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def processed_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, filtered: bool = True
) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted
    to its top-k and top-p set. logits [..., V]; params broadcast over [...].
    Greedy rows (T == 0) get a one-hot at the argmax, which makes greedy a
    special case of speculative rejection sampling."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    if filtered:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        rank = torch.arange(V, device=logits.device)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).unsqueeze(-1)
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(-1)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_logits = sorted_logits.masked_fill(before >= top_p.unsqueeze(-1), float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    probs = scaled.softmax(-1)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(-1), onehot, probs)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(p / E) with E = -log(u) draws index i with probability p_i.
    u close to 1 rounds to 1.0 in float32 (E = 0): E is kept above 0 so that a token of probability
    0 (masked by a grammar, top-k or top-p) gives 0, never 0 / 0 = NaN, which argmax would pick."""
    return (probs / (-torch.log(u)).clamp_min(torch.finfo(u.dtype).tiny)).argmax(-1)


def draft_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_map: torch.Tensor) -> torch.Tensor:
    """The drafter's noise at draft id j: the target's noise at target id vocab_map[j] for the same
    (seed, position). A draft race over it picks the target's own draw whenever the two
    distributions agree up to scale on the draft vocabulary and that draw lies in it."""
    return uniform(seeds, positions, STREAM_TARGET, vocab_map)


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list (or CPU tensor) on `device` without waiting for the GPU: staged in pinned
    memory and copied asynchronously (a plain `torch.tensor(..., device=cuda)` synchronizes the
    stream, leaving the GPU idle while the host prepares the next step)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class BatchSampling:
    """Per-row sampling parameters as device tensors for one step."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    all_greedy: bool
    filtered: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], device: torch.device) -> "BatchSampling":
        return cls(
            temperature=to_device([p.temperature for p in params], device, torch.float32),
            top_p=to_device([p.top_p for p in params], device, torch.float32),
            top_k=to_device([p.top_k for p in params], device),
            seed=to_device(seeds, device),
            all_greedy=all(p.greedy for p in params),
            filtered=any(p.top_p < 1 or p.top_k > 0 for p in params),
        )


def sample_tokens(logits: torch.Tensor, s: BatchSampling, positions: torch.Tensor) -> torch.Tensor:
    """Pick one token per row of logits [..., V] (the parameters in `s` and `positions` shaped
    [...]); `positions` are the sequence positions the new tokens will occupy (the noise key)."""
    if s.all_greedy:
        return argmax(logits)
    probs = processed_probs(logits, s.temperature, s.top_p, s.top_k, s.filtered)
    return sample_from(probs, uniform(s.seed, positions, STREAM_TARGET, logits.shape[-1]))
