"""`specserve train-draft`: train an EAGLE-3 drafter for a supported target.

    specserve train-draft --model DIR --data PATH --out DIR [--regenerate] [--draft-vocab N]
                          [--ttt-steps K] [--epochs E] [--from DIR] [--max-minutes M] [--resume]

What it does, in order:

1. reads the data (``.jsonl`` with "text" or chat "messages", ``.txt``, ``.npy`` token
   stream, or a folder; see `specserve.train.data`);
2. with ``--regenerate``, lets the target itself write the responses (chat records: the
   last assistant turn; plain text: continuations of prompt prefixes cut at line starts),
   so the drafter learns what the target really says;
3. picks the draft vocabulary: the N most frequent target tokens of the training data
   (EOS always in), sorted by id; ``d2t[i] = target_id[i] - i``, ``t2d`` marks them;
4. trains with training-time test (TTT): the target's aux-layer features are computed on
   the fly, the drafter is unrolled K steps feeding back its own outputs, and every step
   is scored against the target's own next-token distribution (restricted to the draft
   vocabulary) with weight 0.8**k;
5. writes ``config.json`` + ``model.safetensors`` in the SpecForge/SGLang layout
   (``LlamaForCausalLMEagle3``; no ``embed_tokens``: the target's is shared).

Alignment with the engine (runner.py `prefill` with `after`, `Engine._spec_step`, runner.py `_draft_body`):
the drafter entry at position t reads the target feature f_t (residual streams entering the
aux layers) and token x[t+1] at rope position t, and predicts x[t+2]. Draft step k of a chain
based at position b runs at position b+k on the step k-1 output of position b+k-1 and token
x[b+k+1], and attends to the feature entries at positions <= b (the committed cache) plus the
chain's own step 1..k entries (written into the cache during the cycle). `ttt_forward`
reproduces exactly that with one attention over [feature keys | the chain's diagonal keys].
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.config import ConfigError, DraftConfig, EngineConfig, ModelConfig, default_aux_layers, resolve_aux_layers
from specserve.train.data import DataError, chat_prompt, check_messages, read_records, split_long, tokenize_records

STEP_WEIGHT = 0.8  # loss weight of unroll step k is STEP_WEIGHT**k
CHECKPOINT = "checkpoint"


def log(msg: str) -> None:
    print(f"[train-draft {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Target features
# ---------------------------------------------------------------------------------------------


class FrozenTarget:
    """specserve's own CausalLM (the engine's numerics) returning aux features and logits."""

    def __init__(
        self, target_dir: str, device: torch.device, dtype: torch.dtype, max_len: int, aux_layers: tuple[int, ...]
    ):
        from specserve.model.loader import load_target

        self.cfg = ModelConfig.from_dir(target_dir)
        self.max_len = max_len
        self.model = load_target(target_dir, device, dtype, max_len)
        self.model.aux_layers = tuple(aux_layers)
        self.device, self.dtype = device, dtype
        self._rows = 0

    def _caches(self, rows: int) -> None:
        if rows <= self._rows:
            return
        for a in self.model.attention_modules():
            shape = (rows, a.num_kv_heads, self.max_len, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            a.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._rows = rows

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (features [B, T, 3H], final normed hidden [B, T, H]); `logits(hidden)`
        gives the target's logits."""
        from specserve.model.layers import ForwardContext

        B, T = ids.shape
        self._caches(B)
        pos = torch.arange(T, device=ids.device).expand(B, T)
        hidden, feats = self.model(ids, ForwardContext(0, pos, pos, T))
        return feats, hidden

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden.to(self.dtype))


class FeatureCache:
    """Target features per training sample, computed on first use and kept in RAM (bf16
    features, fp32 final hidden) while they fit in `limit_bytes`: later epochs then skip the
    target forward, which on CPU costs about as much as the drafter's own step."""

    def __init__(self, target: FrozenTarget, samples: list[list[int]], starts: list[int], limit_bytes: int):
        self.target, self.samples, self.starts = target, samples, starts
        H = target.cfg.hidden_size
        self.per_token = 3 * H * 2 + H * 4
        self.limit = limit_bytes
        self.used = 0
        self.store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def batch(self, idx: list[int]):
        """(ids [B, L], lengths [B], starts [B], features [B, L, 3H] fp32, hidden [B, L, H] fp32)."""
        dev = self.target.device
        ids, lengths, starts = collate(self.samples, self.starts, idx, dev)
        if all(i in self.store for i in idx):
            L = ids.shape[1]
            f = torch.stack([F.pad(self.store[i][0], (0, 0, 0, L - self.store[i][0].shape[0])) for i in idx])
            h = torch.stack([F.pad(self.store[i][1], (0, 0, 0, L - self.store[i][1].shape[0])) for i in idx])
            return ids, lengths, starts, f.to(dev, torch.float32), h.to(dev, torch.float32)
        feats, hidden = self.target(ids)
        feats = feats.to(torch.bfloat16)  # as cached: the same numbers in every epoch (and after --resume)
        for r, i in enumerate(idx):
            n = len(self.samples[i])
            if i not in self.store and self.used + n * self.per_token <= self.limit:
                self.store[i] = (feats[r, :n].cpu(), hidden[r, :n].to("cpu", torch.float32))
                self.used += n * self.per_token
        return ids, lengths, starts, feats.float(), hidden.float()


# ---------------------------------------------------------------------------------------------
# Drafter: config, init, save
# ---------------------------------------------------------------------------------------------


def drafter_config(
    tcfg: ModelConfig,
    draft_ids: torch.Tensor,
    captured: tuple[int, ...],
    save_dtype: str = "bfloat16",
    intermediate: int | None = None,
) -> dict:
    """A SpecForge/SGLang-layout config. Aux ids are written in the SGLang convention
    (layer outputs = captured input index - 1), which specserve reads by default. The MLP is the
    target's width unless `intermediate` says otherwise (a wider drafter MLP costs little next
    to the target's forward and is free when the pair is grown to a big model's shape)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": tcfg.hidden_size,
        "target_hidden_size": tcfg.hidden_size,
        "intermediate_size": intermediate or tcfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": tcfg.num_heads,
        "num_key_value_heads": tcfg.num_kv_heads,
        "head_dim": tcfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": tcfg.rms_norm_eps,
        "rope_theta": tcfg.rope_theta,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "vocab_size": tcfg.vocab_size,
        "draft_vocab_size": int(draft_ids.numel()),
        "tie_word_embeddings": False,
        "torch_dtype": save_dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in captured]},
    }
    if tcfg.rope_scaling:
        cfg["rope_scaling"] = dict(tcfg.rope_scaling)
    return cfg


# Weights a drafter holds that training leaves as they are: a shipped embedding is the target's
# token space as the drafter learned it, and target_embed is the target's own table, which the
# drafter only reads (it is registered as a submodule, so it shows up among the drafter's weights).
FROZEN = ("embed_tokens.", "target_embed.")


def trainable(drafter) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, weight) pairs the optimizer updates, in its order. Also sets requires_grad to match."""
    named = list(drafter.named_parameters())
    for n, p in named:
        p.requires_grad_(not n.startswith(FROZEN))
    return [(n, p) for n, p in named if p.requires_grad]


def _blank_drafter(cfg: dict, target: FrozenTarget, has_embedding: bool):
    from specserve.model.eagle3 import Eagle3Drafter

    return Eagle3Drafter(DraftConfig.from_hf_dict(cfg), target.max_len, has_embedding).to(target.device, torch.float32)


def new_drafter(cfg: dict, target: FrozenTarget, draft_ids: torch.Tensor, seed: int):
    """A fresh drafter. Warm start: the final norm and the lm_head rows of the draft
    vocabulary are copied from the target (so its output space starts as the target's);
    the decoder layer and fc keep PyTorch's default init."""
    torch.manual_seed(seed)
    d = _blank_drafter(cfg, target, has_embedding=False)
    t = target.model
    head = t.embed_tokens.weight if t.lm_head is None else t.lm_head.weight
    with torch.no_grad():
        d.lm_head.weight.copy_(head[draft_ids.to(head.device)].float())
        d.norm.weight.copy_(t.norm.weight.float())
        d.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
        d.t2d.zero_()
        d.t2d[draft_ids] = True
    return d


def resumed_drafter(state: dict, target: FrozenTarget):
    """The checkpoint's drafter, rebuilt from what the checkpoint records alone (its config, and
    whether it carries an embedding of its own), whichever way the run built it at first."""
    weights = state["drafter"]
    d = _blank_drafter(state["drafter_config"], target, has_embedding="embed_tokens.weight" in weights)
    d.load_state_dict({k: v.to(target.device) for k, v in weights.items()})
    return d


def draft_vocab_ids(drafter) -> torch.Tensor:
    return torch.arange(drafter.d2t.numel(), device=drafter.d2t.device) + drafter.d2t


def save_drafter(drafter, cfg: dict, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (t, _) in drafter.hf_weight_map().items():
        t = t.detach().cpu()
        tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def select_draft_vocab(docs: list[list[int]], vocab_size: int, n: int, always: set[int]) -> torch.Tensor:
    """The n most frequent target ids in docs (plus `always`), sorted ascending."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for d in docs:
        counts += torch.bincount(torch.tensor(d, dtype=torch.long), minlength=vocab_size)
    n = min(n, vocab_size)
    keep = {int(i) for i in always if 0 <= i < vocab_size}
    order = torch.argsort(counts, descending=True, stable=True).tolist()
    for i in order:
        if len(keep) >= n:
            break
        keep.add(i)
    return torch.tensor(sorted(keep), dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Training-time test forward and loss
# ---------------------------------------------------------------------------------------------


def _shift(x: torch.Tensor, d: int, dim: int) -> torch.Tensor:
    """y[t] = x[t - d] along dim (zeros for t < d)."""
    if d == 0:
        return x
    T = x.shape[dim]
    pad_shape = list(x.shape)
    pad_shape[dim] = min(d, T)
    return torch.cat([x.new_zeros(pad_shape), x.narrow(dim, 0, T - pad_shape[dim])], dim)


def ttt_forward(drafter, feats: torch.Tensor, next_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Unroll the drafter `steps` times over whole sequences.

    feats [B, T, 3H] (f_t), next_ids [B, T] (x[t+1]). Returns the pre-norm outputs of every
    step, [B, T, H] each: step k at index t is the k-th draft step of the chain based at
    t - k (valid for t >= k) and predicts x[t+2]. Uses the drafter's own submodules, but
    computes attention over [feature keys (positions <= t-k) | the chain's keys of steps
    1..k], which is what the engine's KV cache holds during a draft cycle."""
    m = drafter.midlayer
    a = m.self_attn
    B, T, _ = feats.shape
    Hq, KV, D = a.heads, a.kv_heads, a.head_dim
    G = Hq // KV
    pos = torch.arange(T, device=feats.device).expand(B, T)
    emb = m.input_layernorm(drafter.embed(next_ids).to(feats.dtype))
    hidden = drafter.fc(feats)
    scale = D**-0.5
    t_idx = torch.arange(T, device=feats.device)
    base_k = base_v = None
    chain_k: list[torch.Tensor] = []
    chain_v: list[torch.Tensor] = []
    outs = []
    for k in range(steps):
        x = torch.cat((emb, m.hidden_norm(hidden)), dim=-1)
        q = a.q_proj(x).view(B, T, Hq, D)
        kk = a.k_proj(x).view(B, T, KV, D)
        v = a.v_proj(x).view(B, T, KV, D)
        q, kk = a.rope(q, kk, pos)
        q = q.transpose(1, 2).reshape(B, KV, G, T, D)  # head h = kv * G + g, as KVCacheAttention groups them
        kk, v = kk.transpose(1, 2), v.transpose(1, 2)  # [B, KV, T, D]
        if k == 0:
            base_k, base_v = kk, v
        else:
            chain_k.append(kk)
            chain_v.append(v)
        scores = torch.matmul(q, base_k.unsqueeze(2).transpose(-1, -2))  # [B, KV, G, T, T]
        visible = t_idx.view(1, -1) <= (t_idx.view(-1, 1) - k)  # feature key s visible to query t
        scores = scores.masked_fill(~visible, float("-inf"))
        # The chain's step-j key for query t sits at position t-k+j: a diagonal, shifted by k-j.
        shifted_v = []
        diag = []
        for j in range(1, k + 1):
            kj = _shift(chain_k[j - 1], k - j, dim=2)
            shifted_v.append(_shift(chain_v[j - 1], k - j, dim=2))
            diag.append((q * kj.unsqueeze(2)).sum(-1, keepdim=True))
        if diag:
            scores = torch.cat([scores, *diag], dim=-1)
        w = torch.softmax(scores.float() * scale, dim=-1).to(q.dtype)
        o = torch.matmul(w[..., :T], base_v.unsqueeze(2))
        for j, vj in enumerate(shifted_v):
            o = o + w[..., T + j : T + j + 1] * vj.unsqueeze(2)
        o = o.reshape(B, Hq, T, D).transpose(1, 2).reshape(B, T, Hq * D)
        h = hidden + a.o_proj(o)
        out = h + m.mlp(m.post_attention_layernorm(h))
        outs.append(out)
        hidden = _shift(out, 1, dim=1)  # step k+1 at position t reads step k's output at t-1
    return outs


def chain_acceptance(
    hits: list[torch.Tensor], real: torch.Tensor, first: torch.Tensor
) -> tuple[tuple[list[int], int], tuple[list[int], int]]:
    """What greedy verification accepts of the chain drafted at every base position, and at the
    bases a run of cycles visits from each row's first base `first` [B] (the prompt's last entry).

    hits[k] [B, T]: step k at index t (the chain based at t - k) drafts the target's own next
    token. Draft k of the chain based at b is accepted iff steps 0..k all hit; while they do, the
    teacher-forced input tokens are the drafted ones, so on a target-greedy sequence this is
    exactly what the engine accepts in a cycle based at b. Per-step accuracy is not: a step can
    hit after an earlier miss, which the engine never sees. real [B, T]: the scored entries; a
    base counts when its whole chain lies among them.

    Every base weighs each stretch of easy tokens once per position in it, where the engine
    drafts it in one cycle and then moves past it. Counting only the engine's bases (from
    `first`, a cycle that accepts a drafts is followed by the one based a + 1 entries later) gives
    the engine's acceptance on the same sequences, which is lower. Returns ((accepted drafts per
    chain position, bases counted) at every base, (the same, cycles counted) along the cycles)."""
    K = len(hits)
    bases = real & F.pad(real[:, K - 1 :], (0, K - 1), value=False)
    ok = bases
    every, runs = [], torch.zeros_like(real, dtype=torch.long)
    for k, h in enumerate(hits):
        ok = ok & F.pad(h[:, k:], (0, k), value=False)  # step k of the chain based at b sits at b + k
        every.append(int(ok.sum()))
        runs += ok
    accepted, cycles = [0] * K, 0
    T = real.shape[1]
    for row_bases, row_runs, b in zip(bases.tolist(), runs.tolist(), first.tolist()):
        while b < T and row_bases[b]:
            for j in range(row_runs[b]):
                accepted[j] += 1
            cycles += 1
            b += row_runs[b] + 1
    return (every, int(bases.sum())), (accepted, cycles)


def ttt_loss(
    drafter,
    target: FrozenTarget,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    starts: torch.Tensor,
    feats: torch.Tensor,
    hidden: torch.Tensor,
    steps: int,
    draft_ids: torch.Tensor,
    autocast_dtype=None,
):
    """Loss, per-step accuracy (and its counts) and `chain_acceptance` (at every base, and at
    the bases a run of cycles visits from each row's first) of one padded batch:
    ids [B, L], lengths [B], starts [B] (the first scored token of each row), the target's
    features [B, L, 3H] and final hidden [B, L, H].

    Only chains the engine drafts are scored: a chain based at entry b drafts x[b+2..], and the
    engine's first chain of a request is based at the prompt's last entry (start - 1), whose
    draft is the response's second token. Earlier entries are attention context only: scoring
    them would teach the drafter to predict the user's text instead of the target's."""
    B, L = ids.shape
    T = L - 1  # drafter entries t = 0..L-2: (f_t, x[t+1]) -> the target's distribution at t+1
    feats = feats[:, :T]
    tgt = target.logits(hidden[:, 1:]).float()
    tgt_top = tgt.argmax(-1)
    tgt_p = torch.softmax(tgt.index_select(-1, draft_ids), dim=-1)  # renormalized over the draft vocab
    del tgt
    t_idx = torch.arange(T, device=ids.device)
    first = (starts.view(-1, 1) - 1).clamp(min=0)
    real = (t_idx.view(1, -1) < (lengths.view(-1, 1) - 1)) & (t_idx.view(1, -1) >= first)
    amp = (lambda: torch.autocast(ids.device.type, dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
    with amp():
        outs = ttt_forward(drafter, feats, ids[:, 1:], steps)
    total = 0.0
    norm = 0.0
    accs, counts, hits = [], [], []
    for k, out in enumerate(outs):
        mask = real & (t_idx.view(1, -1) >= first + k)  # step k at t belongs to the chain based at t - k
        n = int(mask.sum())
        with amp():
            logits_d = drafter.logits(out)  # float32 out; the head matmul runs in bf16 under autocast
        ce = F.cross_entropy(
            logits_d.view(-1, logits_d.shape[-1]), tgt_p.view(-1, tgt_p.shape[-1]), reduction="none"
        ).view(B, T)
        w = STEP_WEIGHT**k
        total = total + w * (ce * mask).sum() / max(n, 1)
        norm += w
        with torch.no_grad():
            hit = draft_ids[logits_d.argmax(-1)] == tgt_top  # draft id -> target id
            hits.append(hit)
            accs.append(float((hit & mask).sum()) / max(n, 1))
            counts.append(n)
    return (total / norm, accs, counts, *chain_acceptance(hits, real, first.view(-1)))


# ---------------------------------------------------------------------------------------------
# Regeneration
# ---------------------------------------------------------------------------------------------


def line_start_table(tokenizer) -> torch.Tensor:
    """bool per token id: its text contains a newline (the next token starts a line)."""
    V = tokenizer.vocab_size
    return torch.tensor(["\n" in tokenizer.decode([i], skip_special_tokens=False) for i in range(V)])


def cut_prompts(
    docs: list[list[int]], n: int, lo: int, hi: int, nl: torch.Tensor, rng: random.Random, eos: set[int]
) -> list[list[int]]:
    """n prompt prefixes of lo..hi tokens, each starting at a line start of a document."""
    usable = [d for d in docs if len(d) > lo + 1]
    if not usable:
        raise DataError(f"no document is longer than {lo + 1} tokens: nothing to cut prompts from")
    weights = [len(d) for d in usable]
    starts_of = {}
    out = []
    for _ in range(n):
        i = rng.choices(range(len(usable)), weights)[0]
        d = usable[i]
        if i not in starts_of:
            t = torch.tensor(d[: -lo - 1])
            starts_of[i] = [0] + (torch.nonzero(nl[t]).view(-1) + 1).tolist()
        s = rng.choice(starts_of[i])
        p = d[s : s + rng.randint(lo, hi)]
        while p and p[-1] in eos:
            p = p[:-1]
        if len(p) >= 2:
            out.append(p)
    return out


REGEN_PREFILL_TOKENS = 1 << 17  # padded prompt tokens per regeneration prefill call


def regenerate_samples(
    target_dir: str,
    prompts: list[list[int]],
    max_new: int,
    temperature: float,
    seed: int,
    device: str,
    batch: int,
    deadline: float | None,
    eos: set[int],
    save_to: Path | None = None,
    threads: int | None = None,
) -> tuple[list[list[int]], list[int]]:
    """prompt + the target's own continuation (up to and including its first EOS) for each prompt,
    and each sample's prompt length (where its response, the part the loss scores, starts).

    The prompts run in lockstep batches of `batch`, sorted by length so a batch's prompts are
    about equally long: one prefill, then one decode step for the whole batch per token (a CUDA
    graph on a GPU) until every row has ended. The batches run in a random order (seeded): a run
    that the deadline cuts short then keeps prompts of every length, where length order would
    keep only the shortest ones and train the drafter on short contexts alone. There is no per-sequence scheduling, which is what
    made the engine's continuous batching slow here (host bookkeeping for 1024 sequences per step).
    At `deadline` the batch in flight is kept as far as it got (rows with 16+ new tokens). Each
    finished batch is appended to `save_to` as {"i", "ids", "prompt"} lines, and prompts already there are
    skipped, so an interrupted run resumes where it stopped."""

    def result():
        order = sorted(done)
        return [done[i] for i in order], [len(prompts[i]) for i in order]

    from tqdm import tqdm

    from specserve.engine.runner import ModelRunner

    done: dict[int, list[int]] = {}
    if save_to is not None and save_to.exists():
        for ln in save_to.read_text().splitlines():
            if ln.strip():
                rec = json.loads(ln)
                done[rec["i"]] = rec["ids"]
    todo = sorted((i for i in range(len(prompts)) if i not in done), key=lambda i: len(prompts[i]))
    if not todo or (deadline is not None and time.time() >= deadline):
        return result()
    B = min(batch, len(todo))
    batches = [todo[i : i + B] for i in range(0, len(todo), B)]
    random.Random(seed).shuffle(batches)
    max_len = min(
        ModelConfig.from_dir(target_dir).max_position_embeddings, max(len(prompts[i]) for i in todo) + max_new + 1
    )
    runner = ModelRunner(
        EngineConfig(
            model=target_dir, device=device, max_num_seqs=B, max_model_len=max_len, graph_batch_sizes=(B,), seed=seed
        )
    )
    runner.reserve_every_row()
    runner.capture_graphs([])
    dev = runner.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    eos_ids = torch.tensor(sorted(eos) or [-1], device=dev)
    tuner = _thread_tuner(threads, dev)
    bar = tqdm(
        total=len(prompts),
        initial=len(done),
        desc="regenerate",
        unit="prompt",
        dynamic_ncols=True,
        mininterval=2.0 if sys.stderr.isatty() else 30.0,
    )
    sink = open(save_to, "a") if save_to is not None else contextlib.nullcontext()  # noqa: SIM115

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, -1)
        return torch.multinomial(probs, 1, generator=gen).view(-1)

    with sink as f, torch.inference_mode():
        for rows in batches:
            chunk = [prompts[i] for i in rows]
            n = len(rows)
            # Prefill pads every row to the batch's longest prompt; a group of rows per call keeps
            # the activations (tokens x MLP width) within the kernels' int32 indexing.
            group = max(1, REGEN_PREFILL_TOKENS // max(len(c) for c in chunk))
            logits = torch.cat(
                [
                    runner.prefill(r, chunk[r : r + group], [0] * len(chunk[r : r + group]))[0]
                    for r in range(0, n, group)
                ]
            )
            pos = torch.tensor([len(c) for c in chunk], device=dev)
            out = torch.empty(n, max_new, dtype=torch.long, device=dev)
            ended = torch.zeros(n, dtype=torch.bool, device=dev)
            steps, cut = 0, False
            for steps in range(1, max_new + 1):
                t = time.perf_counter()
                tok = pick(logits)
                out[:, steps - 1] = tok
                ended |= torch.isin(tok, eos_ids)
                if steps == max_new or (steps % 16 == 0 and bool(ended.all())):
                    break
                if deadline is not None and steps % 16 == 0 and time.time() > deadline:
                    cut = True
                    break
                logits, _ = runner.decode(tok, pos)
                pos += 1
                if tuner:
                    tuner.record(time.perf_counter() - t)
            kept = 0
            for i, ids in zip(rows, out[:, :steps].tolist()):
                end = next((j + 1 for j, x in enumerate(ids) if x in eos), len(ids))
                if cut and end < 16:
                    continue
                done[i] = list(prompts[i]) + ids[:end]
                kept += 1
                if f:
                    f.write(json.dumps({"i": i, "ids": done[i], "prompt": len(prompts[i])}) + "\n")
            bar.update(kept)
            if cut or (deadline is not None and time.time() > deadline):
                bar.write(
                    f"[train-draft] regeneration time is up: {len(done)} of {len(prompts)} prompts"
                    + (f" (the last {kept} cut short)" if cut else "")
                )
                break
    bar.close()
    return result()


def _load_samples(path: Path) -> tuple[list[list[int]], list[int]]:
    """Samples as saved for --resume, and where each one's scored tokens start: token lists
    (all scored), or {"i", "ids", "prompt"} records (regenerated; the response scored) in prompt order."""
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if recs and isinstance(recs[0], dict):
        recs = sorted(recs, key=lambda r: r["i"])
        return [r["ids"] for r in recs], [r["prompt"] for r in recs]
    return recs, [0] * len(recs)


def _prepare_samples(
    data,
    tok,
    eos,
    eos_id,
    rng,
    target_dir,
    regenerate,
    regen_prompts,
    regen_max_tokens,
    regen_temperature,
    regen_prompt_len,
    regen_batch,
    max_len,
    seed,
    device,
    ck_dir: Path,
    resume: bool,
    regen_budget: tuple[float, float] | None,
    threads=None,
):
    """Training samples (token-id lists), where each one's scored tokens start, the file they
    are kept in for --resume, and how many were regenerated. `regen_budget` is (seconds, run deadline):
    regeneration may answer for that many seconds from when it starts, after the data is read and
    tokenized (reading 30,000 chat records can take a minute), and never past the deadline."""
    records = read_records(data, eos_id)
    ck_dir.mkdir(parents=True, exist_ok=True)
    if not regenerate:
        docs, starts = split_long(tokenize_records(records, tok, eos_id), max_len)
        if not docs:
            raise DataError(f"--data {data}: no record has 8 or more tokens")
        log(f"data: {len(records)} records, {sum(map(len, docs)):,} tokens from {data}")
        data_file = ck_dir / "samples.jsonl"
        data_file.write_text("".join(json.dumps(s) + "\n" for s in docs))
        return docs, starts, str(data_file), 0
    chat = [r for r in records if r.messages is not None]
    plain = tokenize_records([r for r in records if r.messages is None], tok, eos_id)
    prompts = [p for p in (chat_prompt(r, tok) for r in chat) if p]
    if chat and not prompts:
        raise DataError(f"--data {data}: no chat record has a user turn to answer")
    if plain:
        lo, hi = regen_prompt_len
        # default: about as many generated tokens as the plain text holds
        n_cut = regen_prompts or max(1, sum(map(len, plain)) // regen_max_tokens)
        prompts += cut_prompts(plain, n_cut, lo, hi, line_start_table(tok), rng, eos)
    rng.shuffle(prompts)
    if regen_prompts:
        prompts = prompts[:regen_prompts]
    room = max_len - regen_max_tokens
    if room < 2:
        raise ConfigError(f"--max-len {max_len} leaves no room for a prompt before {regen_max_tokens} new tokens")
    prompts = [p[-room:] for p in prompts]
    regen_file = ck_dir / "regenerated.jsonl"
    if not resume:
        regen_file.write_text("")
    log(
        f"data: {len(records)} records from {data}; regenerating {len(prompts)} prompts x up to "
        f"{regen_max_tokens} new tokens (temperature {regen_temperature}, batch {regen_batch})"
    )
    regen_deadline = min(time.time() + regen_budget[0], regen_budget[1]) if regen_budget else None
    samples, starts = regenerate_samples(
        target_dir,
        prompts,
        regen_max_tokens,
        regen_temperature,
        seed,
        device,
        regen_batch,
        regen_deadline,
        eos,
        regen_file,
        threads,
    )
    if not samples:
        raise DataError("regeneration produced no samples (time budget too small?)")
    return samples, starts, str(regen_file), len(samples)


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


def make_batches(samples: list[list[int]], batch_tokens: int, gen: torch.Generator) -> list[list[int]]:
    """Index batches of similar lengths, at most batch_tokens padded tokens each, in random order."""
    order = torch.randperm(len(samples), generator=gen).tolist()
    batches = []
    window = 64  # sort within windows of shuffled samples: little padding, still random
    for w in range(0, len(order), window * 8):
        group = sorted(order[w : w + window * 8], key=lambda i: len(samples[i]))
        cur: list[int] = []
        for i in group:
            longest = max([len(samples[j]) for j in cur] + [len(samples[i])])
            if cur and longest * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def collate(samples: list[list[int]], starts: list[int], idx: list[int], device) -> tuple[torch.Tensor, ...]:
    """(ids [B, L] zero-padded, lengths [B], starts [B]) of the samples idx."""
    L = max(len(samples[i]) for i in idx)
    ids = torch.zeros(len(idx), L, dtype=torch.long)
    for r, i in enumerate(idx):
        ids[r, : len(samples[i])] = torch.tensor(samples[i])
    return (
        ids.to(device),
        torch.tensor([len(samples[i]) for i in idx], device=device),
        torch.tensor([starts[i] for i in idx], device=device),
    )


# ---------------------------------------------------------------------------------------------
# Evaluation with the engine
# ---------------------------------------------------------------------------------------------


def read_prompts(path: str | Path) -> list[str | list[dict]]:
    """Prompts from a .jsonl or a text file (one per line). A .jsonl line holds a "prompt" (or
    "text") string, continued as it is, or a chat "messages" list, which `measure_acceptance`
    renders through the target's chat template: the bench's rule for its prompt files."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--eval-prompts {path}: no such file")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if isinstance(obj, dict) and "messages" in obj:
                out.append(check_messages(obj["messages"], f"{path}:{n}"))
                continue
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise DataError(f'{path}:{n}: needs a string "prompt" (or "text") or a chat "messages" list')
            out.append(text)
        else:
            out.append(line)
    if not out:
        raise DataError(f"--eval-prompts {path}: no prompts")
    return out


def measure_acceptance(
    target_dir: str, draft_dir: str, prompts, spec_steps: int = 4, max_tokens: int = 128, device: str = "auto"
) -> dict:
    """Greedy acceptance length over all speculative cycles of all prompts (one batch). Chat
    prompts (message lists) go through the target's chat template and stop at its end of turn,
    as `specserve generate` and the server answer them."""
    from specserve.engine.llm import LLM, SamplingParams

    n = len(prompts)
    llm = LLM(model=target_dir, draft=draft_dir, spec_steps=spec_steps, device=device, max_num_seqs=n)
    tok = llm.tokenizer
    stop = [tok.end_of_turn_id] if tok.end_of_turn_id is not None else []
    reqs, params = [], []
    for p in prompts:
        chat = not isinstance(p, str)
        if chat:
            try:
                p = tok.encode(tok.apply_chat_template(p))
            except ConfigError as e:
                raise DataError(f'--eval-prompts has chat "messages" but {e}') from None
        reqs.append(p)
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop if chat else []))
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params)
    secs = time.perf_counter() - t0
    tot = llm.engine.totals
    return {
        "spec_steps": spec_steps,
        "prompts": n,
        "max_tokens": max_tokens,
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "tokens": sum(len(o.token_ids) for o in outs),
        "cycles": tot.cycles,
        "accept_length_mean": tot.accept_length,
        "accept_per_position": tot.accept_per_position,
        "seconds": round(secs, 2),
    }


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def save_checkpoint(path: Path, drafter, opt, state: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    own = {k: v for k, v in drafter.state_dict().items() if not k.startswith("target_embed.")}  # not the target's table
    blob = {
        "drafter": {k: v.detach().cpu() for k, v in own.items()},
        "optimizer": opt.state_dict(),
        "torch_rng": torch.get_rng_state(),
        **state,
    }
    tmp = path / "state.pt.tmp"
    torch.save(blob, tmp)
    tmp.replace(path / "state.pt")


def load_checkpoint(path: Path) -> dict:
    f = path / "state.pt"
    if not f.exists():
        raise ConfigError(f"--resume: no checkpoint at {f}")
    state = torch.load(f, map_location="cpu", weights_only=True)
    if "drafter_config" not in state:
        raise ConfigError(
            f"--resume: {f} does not record the drafter it trains (an older train-draft wrote it); "
            "start the run again without --resume"
        )
    return state


def check_resume(config: TrainConfig, state: dict, ck_dir: Path) -> None:
    """Refuse flags of a --resume call that contradict the run its checkpoint holds: the resumed
    drafter and optimizer are rebuilt from the checkpoint, so a differing flag would be ignored."""
    if config.from_dir and state["from_dir"] is None:
        raise ConfigError(
            f"--from {config.from_dir}: the checkpoint's run trains a fresh drafter; resume it without "
            f"--from, or fine-tune in another --out than {ck_dir.parent}"
        )
    if config.from_dir and str(Path(config.from_dir).resolve()) != state["from_dir"]:
        raise ConfigError(
            f"--from {config.from_dir} differs from the checkpoint's --from {state['from_dir']}: a "
            "resumed run goes on fine-tuning its own drafter; pass that --from or none"
        )
    cfg = state["drafter_config"]
    for flag, given, recorded, why in (
        ("--val-samples", config.val_samples, state["val_samples"], "a resumed run holds out the same samples"),
        ("--max-len", config.max_len, state["max_len"], "its batches index the samples cut at that length"),
        ("--draft-vocab", config.draft_vocab, cfg["draft_vocab_size"], "a resumed run keeps its drafter's shape"),
        (
            "--draft-intermediate",
            config.draft_intermediate,
            cfg["intermediate_size"],
            "a resumed run keeps its drafter's shape",
        ),
        ("--lr", config.lr, state["lr"], "a resumed run goes on with its lr schedule"),
    ):
        if given is not None and given != recorded:
            raise ConfigError(f"{flag} {given} differs from the checkpoint's {recorded}: {why}")


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------


def feature_cache_bytes(dev: torch.device, gb: float | None) -> int:
    """RAM for cached target features: --feature-cache-gb, else on CPU a quarter of the
    available memory (at most 8 GB); on GPU the target forward is cheap, so none."""
    if gb is not None:
        return int(gb * 2**30)
    if dev.type != "cpu":
        return 0
    import psutil

    return int(min(psutil.virtual_memory().available / 4, 8 * 2**30))


def _use_bf16(flag: bool | None, dev: torch.device) -> bool:
    """bf16 autocast for the drafter (weights and optimizer stay fp32). Default: on GPU; on
    CPU only with native bf16 instructions (AVX512-BF16/AMX), where it is ~1.3x faster."""
    if flag is not None:
        return flag
    if dev.type != "cpu":
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _thread_tuner(threads: int | None, dev: torch.device):
    """On CPU, switch between 1..N intra-op threads, whichever is faster now (under load from
    other processes one thread can be 5-10x faster than two; see ThreadTuner)."""
    if dev.type != "cpu":
        return None
    from specserve.train.thread_tuner import ThreadTuner

    if threads:
        torch.set_num_threads(threads)
        return None
    # (the demo build's own tuner may have left 1 thread set: still consider 2)
    n = max(torch.get_num_threads(), min(2, os.cpu_count() or 1))
    if n <= 1:
        return None
    tuner = ThreadTuner(sorted({1, n}), every_s=60.0, trial=3)
    # Start on one thread (never the disaster case), try n right after the first few steps.
    tuner.current = 1
    torch.set_num_threads(1)
    tuner.last_explore -= tuner.every_s
    return tuner


@dataclass
class TrainResult:
    out_dir: str
    steps: int
    samples: int
    tokens: int
    regenerated: int
    draft_vocab: int
    draft_vocab_coverage: float
    minutes_regenerate: float
    minutes_train: float
    final_loss: float
    final_acc: list[float]  # per-step top-1 agreement, teacher-forced (overstates what a chain keeps)
    final_accept_length: float | None = None  # what greedy cycles accept of these drafts (plus 1): the engine's
    final_accept_length_all_bases: float | None = None  # the same at every base position (overstates the engine's)
    val_acc: list[float] | None = None
    val_accept_length: float | None = None
    eval: list[dict] = field(default_factory=list)


def _pick_device(device: str) -> torch.device:
    from specserve.model.loader import resolve_device

    return resolve_device(device)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one `train_draft` run uses. The defaults are the `specserve train-draft` flags'
    defaults; `from_args` maps the flags, `demo` is the bundled demo pair's recipe."""

    target_dir: str
    out_dir: str
    data: str | None = None  # .jsonl, .txt, .npy token stream or a folder (None only with resume)
    val_data: str | None = None
    val_samples: int = 0  # training samples held out and scored at the end instead
    minutes: float | None = None  # wall-clock budget for regeneration + training
    seed: int = 0
    draft_vocab: int | None = None  # default min(32000, target vocabulary)
    draft_intermediate: int | None = None  # default: the target's intermediate size
    ttt_steps: int = 5
    epochs: float = 1.0
    lr: float | None = None  # default 1e-3 fresh, 5e-5 fine-tuning
    from_dir: str | None = None  # fine-tune this drafter
    regenerate: bool = False
    regen_prompts: int | None = None
    regen_max_tokens: int = 256
    regen_temperature: float = 0.0
    regen_prompt_len: tuple[int, int] = (32, 192)
    regen_share: float = 0.35  # share of `minutes` regeneration may answer for, from when it starts
    regen_batch: int = 64
    batch_tokens: int = 4096
    max_len: int = 512
    warmup: int = 50
    max_steps: int | None = None
    checkpoint_every: int = 100
    resume: bool = False
    keep_checkpoint: bool = False
    lr_minutes: float | None = None  # training minutes the lr schedule spans over resumed calls
    device: str = "auto"
    threads: int | None = None
    feature_cache_gb: float | None = None
    bf16: bool | None = None  # default: on GPU, and on CPUs with AVX512-BF16/AMX
    eval_prompts: str | None = None
    eval_spec_steps: tuple[int, ...] = (4,)
    eval_max_tokens: int = 128
    progress: bool = True
    aux_layer_ids: tuple[int, ...] | None = None  # default EAGLE-3's taps

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        """The `train-draft` flags (see `train_draft_cmd.add_arguments`) as a TrainConfig: the one place they map."""
        return cls(
            target_dir=args.model,
            out_dir=args.out,
            data=args.data,
            val_data=args.val_data,
            val_samples=args.val_samples,
            minutes=args.max_minutes,
            seed=args.seed,
            draft_vocab=args.draft_vocab,
            draft_intermediate=args.draft_intermediate,
            ttt_steps=args.ttt_steps,
            epochs=args.epochs,
            lr=args.lr,
            from_dir=args.from_dir,
            regenerate=args.regenerate,
            regen_prompts=args.regen_prompts,
            regen_max_tokens=args.regen_max_tokens,
            regen_temperature=args.regen_temperature,
            regen_prompt_len=args.regen_prompt_len,
            regen_share=args.regen_share,
            regen_batch=args.regen_batch,
            batch_tokens=args.batch_tokens,
            max_len=args.max_len,
            warmup=args.warmup,
            max_steps=args.max_steps,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            keep_checkpoint=args.keep_checkpoint,
            lr_minutes=args.lr_minutes,
            device=args.device,
            threads=args.threads,
            feature_cache_gb=args.feature_cache_gb,
            bf16=args.bf16,
            eval_prompts=args.eval_prompts,
            eval_spec_steps=args.eval_spec_steps,
            eval_max_tokens=args.eval_max_tokens,
            aux_layer_ids=args.aux_layer_ids,
        )

    @classmethod
    def demo(
        cls, target_dir: str, out_dir: str, train_tokens: str, val_tokens: str, minutes: float, seed: int = 0
    ) -> TrainConfig:
        """The bundled demo drafter's recipe: train on the target's own regenerated text, for as
        many epochs as `minutes` allows (the time budget ends the run, not the epoch count), and
        measure acceptance on the target's held-out prompts where scripts/build_demo.py wrote them."""
        heldout = Path(target_dir) / "heldout_prompts.jsonl"
        return cls(
            target_dir=target_dir,
            out_dir=out_dir,
            data=train_tokens,
            val_data=val_tokens,
            minutes=minutes,
            seed=seed,
            regenerate=True,
            draft_vocab=2048,
            ttt_steps=5,
            lr=4e-3,
            regen_share=0.35,
            epochs=1000.0,
            regen_max_tokens=256,
            regen_prompt_len=(32, 192),
            batch_tokens=4096,
            max_len=512,
            eval_prompts=str(heldout) if heldout.exists() else None,
        )


def train_draft(config: TrainConfig) -> TrainResult:
    """Train (or fine-tune, `config.from_dir`) an EAGLE-3 drafter for `config.target_dir`; writes it
    to `config.out_dir`. Called by `specserve train-draft` and by scripts/build_demo.py's drafter stage.
    The phases: check the flags, read (and regenerate) the data, build the target and the drafter,
    train, then save, validate and measure acceptance."""
    _check_flags(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    t_start = time.time()
    deadline = t_start + config.minutes * 60 if config.minutes else None
    out = Path(config.out_dir)
    ck_dir = out / CHECKPOINT
    dev = _pick_device(config.device)
    tcfg = ModelConfig.from_dir(config.target_dir)
    _check_aux_layer_ids(config, tcfg)
    tok, eos, eos_id = _tokenizer(config.target_dir, tcfg)
    max_len = min(config.max_len, tcfg.max_position_embeddings)
    state = _resume_state(config, ck_dir)
    data = _training_data(config, state, tok, eos, eos_id, max_len, ck_dir, t_start, deadline)
    captured = _aux_taps(config, state, tcfg)
    target = FrozenTarget(
        config.target_dir, dev, torch.float32 if dev.type == "cpu" else torch.bfloat16, max_len, captured
    )
    drafter, cfg, draft_ids = _drafter(config, state, target, tcfg, data.scored, eos, captured)
    coverage = _vocab_coverage(data.scored, draft_ids, tcfg.vocab_size)
    log(
        f"draft vocabulary {draft_ids.numel()} of {tcfg.vocab_size} ids, covering {coverage:.1%} of scored tokens; "
        f"aux layers (captured inputs) {list(captured)}"
    )
    loop = _TrainLoop(config, state, drafter, cfg, target, data, draft_ids, captured, dev, ck_dir, deadline)
    loop.run()
    res = _save_and_evaluate(config, loop, tok, eos_id, max_len, coverage, data)
    del target, loop
    _measure_acceptance(config, res)
    (out / "training_summary.json").write_text(json.dumps(asdict(res), indent=2) + "\n")
    if not config.keep_checkpoint and ck_dir.exists():
        shutil.rmtree(ck_dir)
    log(
        f"wrote {out / 'model.safetensors'} ({(out / 'model.safetensors').stat().st_size / 1e6:.2f} MB) after "
        f"{res.steps} steps in {(time.time() - t_start) / 60:.1f} min"
    )
    return res


def _check_flags(config: TrainConfig) -> None:
    if config.data is None and not config.resume:
        raise DataError("no training data: pass --data PATH")
    if config.val_samples and config.val_data:
        raise ConfigError("pass one of --val-data and --val-samples")
    if config.val_samples < 0:
        raise ConfigError(f"--val-samples must be 0 or more, got {config.val_samples}")
    if config.ttt_steps < 1:
        raise ConfigError(f"--ttt-steps must be at least 1, got {config.ttt_steps}")
    if config.lr_minutes is not None and config.lr_minutes <= 0:
        raise ConfigError(f"--lr-minutes must be positive, got {config.lr_minutes}")
    if config.epochs <= 0 and not config.max_steps:
        raise ConfigError(f"--epochs must be positive, got {config.epochs}")
    if config.draft_intermediate is not None and config.draft_intermediate < 1:
        raise ConfigError(f"--draft-intermediate must be positive, got {config.draft_intermediate}")


def _check_aux_layer_ids(config: TrainConfig, tcfg: ModelConfig) -> None:
    aux = config.aux_layer_ids
    if aux is not None and (len(aux) != 3 or not all(0 <= i < tcfg.num_layers for i in aux)):
        raise ConfigError(
            f"--aux-layer-ids needs 3 layer ids in 0..{tcfg.num_layers - 1} (the target has "
            f"{tcfg.num_layers} layers), got {list(config.aux_layer_ids)}"
        )


def _tokenizer(target_dir: str, tcfg: ModelConfig):
    """(tokenizer, the ids that end a sample, the document separator): the tokenizer's EOS token,
    else the config's first EOS id."""
    from specserve.engine.tokenizer import Tokenizer

    tok = Tokenizer(target_dir)
    eos = set(tok.eos_token_ids) | set(tcfg.eos_token_ids)
    if tok.end_of_turn_id is not None:  # a regenerated chat reply ends with its turn, as a served one does
        eos.add(tok.end_of_turn_id)
    eos_id = tok.tok.token_to_id(tok.eos_token) if tok.eos_token else None
    if eos_id is None and eos:
        eos_id = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else min(eos)
    return tok, eos, eos_id


def _resume_state(config: TrainConfig, ck_dir: Path) -> dict | None:
    """A --resume run's checkpoint state, checked against this run's flags (None: a fresh run, or
    one resumed from its regenerated data alone)."""
    if not config.resume:
        return None
    state = None
    if (ck_dir / "state.pt").exists():
        state = load_checkpoint(ck_dir)
    elif not (ck_dir / "regenerated.jsonl").exists():
        raise ConfigError(f"--resume: nothing to resume in {ck_dir}")
    if state is not None:
        check_resume(config, state, ck_dir)
        log(f"resuming from {ck_dir} at step {state['step']}")
    return state


@dataclass
class _Data:
    """A run's training samples (each scored from its start on), held-out ones, and where they came from."""

    samples: list[list[int]]
    starts: list[int]
    held_out: tuple[list[list[int]], list[int]] | None  # never trained on, scored at the end
    data_file: str
    regenerated: int
    minutes_regenerate: float

    @property
    def scored(self) -> list[list[int]]:
        """The tokens the drafter is trained to predict."""
        return [s[b:] for s, b in zip(self.samples, self.starts)]


def _training_data(
    config: TrainConfig,
    state: dict | None,
    tok,
    eos: set[int],
    eos_id: int | None,
    max_len: int,
    ck_dir: Path,
    t_start: float,
    deadline: float | None,
) -> _Data:
    t0 = time.time()
    if state is not None:
        samples, starts = _load_samples(Path(state["data_file"]))
        data_file, n_regen = state["data_file"], state.get("regenerated", 0)
    else:
        samples, starts, data_file, n_regen = _prepare_samples(
            config.data,
            tok,
            eos,
            eos_id,
            random.Random(config.seed),
            config.target_dir,
            config.regenerate,
            config.regen_prompts,
            config.regen_max_tokens,
            config.regen_temperature,
            config.regen_prompt_len,
            config.regen_batch,
            max_len,
            config.seed,
            config.device,
            ck_dir,
            config.resume,
            (config.regen_share * (deadline - t_start), deadline) if deadline else None,
            config.threads,
        )
    held_out = None
    if config.val_samples:
        if config.val_samples >= len(samples):
            raise ConfigError(
                f"--val-samples {config.val_samples} leaves nothing to train on "
                f"({len(samples)} samples): hold out fewer"
            )
        # the last ones: regenerated prompts are shuffled before they are answered
        held_out = split_long(samples[-config.val_samples :], max_len, starts[-config.val_samples :])
        samples, starts = samples[: -config.val_samples], starts[: -config.val_samples]
    samples, starts = split_long(samples, max_len, starts)
    if not samples:
        raise DataError("no training samples of at least 8 tokens")
    data = _Data(samples, starts, held_out, data_file, n_regen, (time.time() - t0) / 60)
    log(
        f"training samples: {len(samples)} ({sum(map(len, samples)):,} tokens, "
        f"{sum(map(len, data.scored)):,} scored), {n_regen} regenerated in {data.minutes_regenerate:.1f} min"
    )
    return data


def _aux_taps(config: TrainConfig, state: dict | None, tcfg: ModelConfig) -> tuple[int, ...]:
    """The target layers whose inputs the drafter reads: a fine-tune or a resumed run keeps its
    drafter's; else --aux-layer-ids (SGLang convention: ids of layers whose output is read), else
    EAGLE-3's defaults."""
    kept = None  # (whose, taps)
    if state is not None:
        kept = ("the checkpoint's", tuple(state["aux_layers"]))
    elif config.from_dir:
        kept = ("the --from drafter's", resolve_aux_layers(DraftConfig.from_dir(config.from_dir), tcfg.num_layers))
    if kept is not None:
        if config.aux_layer_ids is not None and tuple(i + 1 for i in config.aux_layer_ids) != kept[1]:
            raise ConfigError(
                f"--aux-layer-ids {list(config.aux_layer_ids)} differ from {kept[0]} "
                f"{[i - 1 for i in kept[1]]}: "
                "a fine-tune or a resumed run keeps its drafter's taps"
            )
        return kept[1]
    if config.aux_layer_ids is not None:
        return tuple(i + 1 for i in config.aux_layer_ids)
    return default_aux_layers(tcfg.num_layers)


def _drafter(
    config: TrainConfig,
    state: dict | None,
    target: FrozenTarget,
    tcfg: ModelConfig,
    scored: list[list[int]],
    eos: set[int],
    captured: tuple[int, ...],
):
    """(drafter in training mode, its config.json dict, its draft vocabulary): resumed, loaded from
    --from for a fine-tune, or new."""
    if state is not None:  # flags that would shape it differently were refused by check_resume
        drafter, cfg, draft_ids = resumed_drafter(state, target), state["drafter_config"], state["draft_ids"]
    elif config.from_dir:
        from specserve.model.loader import load_drafter

        drafter = load_drafter(config.from_dir, target.model, target.device, torch.float32, target.max_len)
        draft_ids = draft_vocab_ids(drafter).cpu()
        if config.draft_vocab and config.draft_vocab != draft_ids.numel():
            raise ConfigError(
                f"--draft-vocab {config.draft_vocab} differs from the --from drafter's {draft_ids.numel()}"
            )
        cfg = json.loads((Path(config.from_dir) / "config.json").read_text())
        cfg["torch_dtype"] = "bfloat16"
        if config.draft_intermediate and config.draft_intermediate != cfg["intermediate_size"]:
            raise ConfigError(
                f"--draft-intermediate {config.draft_intermediate} differs from the --from drafter's "
                f"{cfg['intermediate_size']} (fine-tuning keeps the drafter's shape)"
            )
    else:
        draft_ids = select_draft_vocab(scored, tcfg.vocab_size, config.draft_vocab or min(32000, tcfg.vocab_size), eos)
        cfg = drafter_config(tcfg, draft_ids, captured, intermediate=config.draft_intermediate)
        drafter = new_drafter(cfg, target, draft_ids, config.seed)
    drafter.train()
    if drafter.embed_tokens is None:
        drafter.target_embed = target.model.embed_tokens
    return drafter, cfg, draft_ids


def _vocab_coverage(scored: list[list[int]], draft_ids: torch.Tensor, vocab_size: int) -> float:
    """The share of the scored tokens that the draft vocabulary holds."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in scored:
        counts += torch.bincount(torch.tensor(s, dtype=torch.long), minlength=vocab_size)
    return float(counts[draft_ids].sum()) / max(int(counts.sum()), 1)


class _TrainLoop:
    """The optimisation: AdamW over the drafter's trainable weights, a warm-up and cosine learning
    rate over steps or training time, training-time-test losses, checkpoints to resume from."""

    def __init__(
        self,
        config: TrainConfig,
        state: dict | None,
        drafter,
        cfg: dict,
        target: FrozenTarget,
        data: _Data,
        draft_ids: torch.Tensor,
        captured: tuple[int, ...],
        dev: torch.device,
        ck_dir: Path,
        deadline: float | None,
    ):
        self.config, self.drafter, self.cfg, self.target, self.data = config, drafter, cfg, target, data
        self.draft_ids, self.captured, self.ck_dir = draft_ids, captured, ck_dir
        self.draft_ids_dev = draft_ids.to(dev)
        self.cache = FeatureCache(target, data.samples, data.starts, feature_cache_bytes(dev, config.feature_cache_gb))
        self.named = trainable(drafter)
        self.params = [p for _, p in self.named]
        self.gen = torch.Generator().manual_seed(config.seed)
        if state is not None:
            self.lr, self.from_dir = state["lr"], state["from_dir"]
        else:
            self.from_dir = str(Path(config.from_dir).resolve()) if config.from_dir else None
            self.lr = config.lr if config.lr is not None else 5e-5 if self.from_dir else 1e-3
        self.opt = torch.optim.AdamW(self.params, lr=self.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step, self.epoch, self.pos_in_epoch, train_seconds = 0, 0, 0, 0.0
        if state is not None:
            self._restore(state)
            train_seconds = state.get("train_seconds", 0.0)
        self.batches = make_batches(data.samples, config.batch_tokens, self.gen) if state is None else state["batches"]
        self.planned = (
            config.max_steps if config.max_steps is not None else max(1, math.ceil(config.epochs * len(self.batches)))
        )
        self.autocast = torch.bfloat16 if _use_bf16(config.bf16, dev) else None
        self.deadline = deadline - 20 if deadline else None  # leave time to save
        self.budget = (self.deadline - time.time()) if self.deadline else None
        # Training seconds the cosine spans, counted over every resumed call of the run: --lr-minutes,
        # else up to the end of this call's budget.
        self.schedule_s = (
            config.lr_minutes * 60 if config.lr_minutes else train_seconds + self.budget if self.budget else None
        )
        self.t_loop = time.time() - train_seconds
        self.tuner = _thread_tuner(config.threads, dev)
        self.ema_loss = self.ema_tau = self.ema_tau_all = None
        self.ema_acc: list[float] | None = None
        self.minutes = 0.0

    def _restore(self, state: dict) -> None:
        if [n for n, _ in self.named] != state["trainable"]:  # the optimizer's moments are matched by position
            raise ConfigError(
                f"--resume: the checkpoint trains {len(state['trainable'])} weights, this "
                f"train-draft's rebuilt drafter {len(self.named)}: the checkpoint is from another "
                "version; start the run again without --resume"
            )
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.gen.set_state(state["gen"])
        self.step, self.epoch, self.pos_in_epoch = state["step"], state["epoch"], state["pos"]

    def lr_at(self, progress: float) -> float:
        warm = min(1.0, (self.step + 1) / max(1, min(self.config.warmup, self.planned // 10 + 1)))
        return self.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    def checkpoint(self) -> None:
        save_checkpoint(
            self.ck_dir,
            self.drafter,
            self.opt,
            {
                "step": self.step,
                "epoch": self.epoch,
                "pos": self.pos_in_epoch,
                "gen": self.gen.get_state(),
                "batches": self.batches,
                "draft_ids": self.draft_ids,
                "data_file": self.data.data_file,
                "regenerated": self.data.regenerated,
                "aux_layers": list(self.captured),
                "val_samples": self.config.val_samples,
                "max_len": self.config.max_len,
                "lr": self.lr,
                "from_dir": self.from_dir,
                "drafter_config": self.cfg,
                "trainable": [n for n, _ in self.named],
                "train_seconds": time.time() - self.t_loop,
            },
        )

    def run(self) -> None:
        from tqdm import tqdm

        config = self.config
        log(
            f"training: {self.planned} steps planned ({len(self.batches)} batches/epoch of <= {config.batch_tokens} "
            f"tokens), TTT {config.ttt_steps} steps, lr {self.lr:g}, "
            f"{'bf16 autocast' if self.autocast else 'float32'}"
            + (f", time budget {self.budget / 60:.1f} min" if self.budget else "")
        )
        bar = tqdm(
            total=self.planned,
            initial=self.step,
            desc="train-draft",
            unit="step",
            dynamic_ncols=True,
            disable=not config.progress,
            mininterval=2.0 if sys.stderr.isatty() else 30.0,
        )
        last_ck = start_step = self.step
        while self.step < self.planned:
            if self.deadline and time.time() > self.deadline:
                bar.write(f"[train-draft] time budget reached at step {self.step}")
                break
            lr = self._one_step(bar, check_gradients=self.step == start_step)
            if self.budget and self.step >= 5:  # time-bound: show the projected number of steps
                rate = self.step / max(time.time() - self.t_loop, 1e-9)
                bar.total = min(self.planned, max(self.step + 1, int(self.step + rate * (self.deadline - time.time()))))
            bar.update(1)
            bar.set_postfix_str(
                f"loss {self.ema_loss:.3f} acc "
                + "/".join(f"{a:.2f}" for a in self.ema_acc)
                + f" tau {self.ema_tau:.2f} (all bases {self.ema_tau_all:.2f}) lr {lr:.1e}",
                refresh=False,
            )
            if config.checkpoint_every and self.step - last_ck >= config.checkpoint_every and self.step < self.planned:
                self.checkpoint()
                last_ck = self.step
        bar.close()
        if config.keep_checkpoint and last_ck < self.step < self.planned:  # cut by the time budget: --resume goes on
            self.checkpoint()
        self.minutes = (time.time() - self.t_loop) / 60

    def _next_batch(self) -> list[int]:
        if self.pos_in_epoch >= len(self.batches):
            self.epoch += 1
            self.pos_in_epoch = 0
            self.batches = make_batches(self.data.samples, self.config.batch_tokens, self.gen)
        self.pos_in_epoch += 1
        return self.batches[self.pos_in_epoch - 1]

    def _one_step(self, bar, check_gradients: bool) -> float:
        """One optimizer step on the next batch; returns its learning rate."""
        idx = self._next_batch()
        progress = self.step / self.planned
        if self.schedule_s:
            progress = max(progress, (time.time() - self.t_loop) / self.schedule_s)
        lr = self.lr_at(progress)
        for g in self.opt.param_groups:
            g["lr"] = lr
        t_step = time.perf_counter()
        ids, lengths, starts_b, feats, hidden = self.cache.batch(idx)
        loss, accs, _, every_base, (acc_k, bases) = ttt_loss(
            self.drafter,
            self.target,
            ids,
            lengths,
            starts_b,
            feats,
            hidden,
            self.config.ttt_steps,
            self.draft_ids_dev,
            self.autocast,
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if check_gradients:  # a forward-only op in the graph would silently freeze what lies before it
            frozen = [n for n, p in self.drafter.named_parameters() if p.requires_grad and p.grad is None]
            if frozen:
                raise RuntimeError(f"no gradient reached {len(frozen)} drafter parameter(s): {', '.join(frozen[:6])}")
        torch.nn.utils.clip_grad_norm_(self.params, 0.5)
        self.opt.step()
        self.step += 1
        msg = (
            self.tuner.record((time.perf_counter() - t_step) / max(int(lengths.sum()), 1) * 4096)
            if self.tuner
            else None
        )
        if msg:
            bar.write(f"[train-draft] {msg}")
        self._track(loss.item(), accs, accept_length(acc_k, bases), accept_length(*every_base))
        return lr

    def _track(self, loss: float, accs: list[float], tau: float, tau_all: float) -> None:
        """Moving averages of the training figures the bar shows and the result reports."""
        ema = lambda old, new: new if old is None else 0.95 * old + 0.05 * new  # noqa: E731
        self.ema_loss, self.ema_tau, self.ema_tau_all = (
            ema(self.ema_loss, loss),
            ema(self.ema_tau, tau),
            ema(self.ema_tau_all, tau_all),
        )
        self.ema_acc = accs if self.ema_acc is None else [ema(e, a) for e, a in zip(self.ema_acc, accs)]


def _save_and_evaluate(
    config: TrainConfig, loop: _TrainLoop, tok, eos_id: int | None, max_len: int, coverage: float, data: _Data
) -> TrainResult:
    """Write the drafter, score the held-out samples (or --val-data), and sum the run up."""
    drafter = loop.drafter
    drafter.eval()
    save_drafter(drafter, loop.cfg, Path(config.out_dir))
    val_acc = val_tau = None
    held_out = data.held_out
    if config.val_data:
        held_out = split_long(tokenize_records(read_records(config.val_data, eos_id), tok, eos_id), max_len)
    if held_out:
        # all of --val-samples (the run's own kind of sample); 8 batches of --val-data, which on CPU cost as much as steps
        val_acc, val_tau = validate(
            drafter,
            loop.target,
            *held_out,
            config.ttt_steps,
            loop.draft_ids_dev,
            config.batch_tokens,
            None if config.val_samples else 8,
        )
        log(
            "validation top-1 agreement per step: "
            + " ".join(f"{a:.3f}" for a in val_acc)
            + f"; greedy acceptance length {val_tau:.3f}"
        )
    r = lambda x: round(x, 4) if x is not None else None  # noqa: E731
    return TrainResult(
        out_dir=str(Path(config.out_dir)),
        steps=loop.step,
        samples=len(data.samples),
        tokens=sum(map(len, data.samples)),
        regenerated=data.regenerated,
        draft_vocab=int(loop.draft_ids.numel()),
        draft_vocab_coverage=round(coverage, 4),
        minutes_regenerate=round(data.minutes_regenerate, 2),
        minutes_train=round(loop.minutes, 2),
        final_loss=round(loop.ema_loss or float("nan"), 4),
        final_acc=[round(a, 4) for a in (loop.ema_acc or [])],
        final_accept_length=r(loop.ema_tau),
        final_accept_length_all_bases=r(loop.ema_tau_all),
        val_acc=val_acc,
        val_accept_length=val_tau,
    )


def _measure_acceptance(config: TrainConfig, res: TrainResult) -> None:
    """The engine's acceptance length of the saved drafter on --eval-prompts, for each K asked."""
    if not config.eval_prompts:
        return
    prompts = read_prompts(config.eval_prompts)
    for K in config.eval_spec_steps:
        r = measure_acceptance(
            config.target_dir, str(Path(config.out_dir)), prompts, K, config.eval_max_tokens, config.device
        )
        res.eval.append(r)
        log(
            f"held-out acceptance length at K={K}: {r['accept_length_mean']:.3f} "
            f"({r['cycles']} cycles, {len(prompts)} prompts x {config.eval_max_tokens} tokens)"
        )


@torch.no_grad()
def validate(
    drafter,
    target,
    docs: list[list[int]],
    starts: list[int],
    steps: int,
    draft_ids,
    batch_tokens: int,
    max_batches: int | None,
):
    """Per-step top-1 agreement and the greedy acceptance length it implies (`chain_acceptance`
    over the bases a run of cycles visits) on held-out data: (agreement per step, acceptance
    length). The length is the engine's only where the held-out text is the target's own greedy
    output (regenerated); on other text it scores drafts against the target's predictions of
    someone else's tokens."""
    gen = torch.Generator().manual_seed(1234)
    hits = [0.0] * steps
    n = [0] * steps
    accepted, bases = [0] * steps, 0
    for idx in make_batches(docs, batch_tokens, gen)[:max_batches]:
        ids, lengths, starts_b = collate(docs, starts, idx, target.device)
        feats, hidden = target(ids)
        _, accs, counts, _, (acc_k, b) = ttt_loss(
            drafter, target, ids, lengths, starts_b, feats.float(), hidden.float(), steps, draft_ids
        )
        for k in range(steps):
            hits[k] += accs[k] * counts[k]
            n[k] += counts[k]
            accepted[k] += acc_k[k]
        bases += b
    return [round(h / max(c, 1), 4) for h, c in zip(hits, n)], accept_length(accepted, bases)


def accept_length(accepted: list[int], bases: int) -> float:
    """Tokens per verify cycle: the target's own token plus the accepted drafts."""
    return round(1 + sum(accepted) / max(bases, 1), 4)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        if args.eval_only:
            if not args.eval_prompts:
                raise ConfigError("--eval-only needs --eval-prompts")
            prompts = read_prompts(args.eval_prompts)
            for K in args.eval_spec_steps:
                r = measure_acceptance(args.model, args.out, prompts, K, args.eval_max_tokens, args.device)
                print(json.dumps(r))
            return 0
        if not args.data and not args.resume:
            raise DataError("--data is required (unless --resume or --eval-only)")
        res = train_draft(TrainConfig.from_args(args))
    except (ConfigError, DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(res)))
    return 0
