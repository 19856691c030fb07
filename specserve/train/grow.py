"""`specserve grow`: widen a small Llama target and its EAGLE-3 drafter to a
big model's shape (by default Llama-3-8B's) without changing what they compute.

The point is benchmarking: the grown pair has an 8B model's kernel shapes and
(nearly) its bytes, so it runs at an 8B model's speed, while its greedy output
and its drafter's acceptance stay those of the small trained pair.

Construction (every step is exact in real arithmetic):

* Residual stream (hidden H -> H' = r*H): each unit is duplicated r times,
  x' = [x0 x0 .. x0, x1 x1 .. x1, ...]. RMSNorm is unchanged (the mean of the
  squares is the same), so norm weights are just repeated. A linear that
  *writes* the stream (embedding, o_proj, down_proj, drafter fc) duplicates its
  output rows; a linear that *reads* it (q/k/v, gate/up, lm_head, fc) repeats
  its input columns with coefficients that sum to 1, so W' x' = W x.
* Coefficients (`--read`): "one" (default) puts weight 1 on the first copy and
  0 on the others, so a matmul adds the small model's products plus exact
  zeros; "all" uses powers of two (37 copies = 27 x 1/32 + 10 x 1/64), so
  every weight is non-zero but each product is added in 32 pieces. Both are
  exact in bf16 (the grown checkpoint holds the small one's values, moved
  around); in bf16 compute "one" stays closer to the small model (fewer
  rounded additions per product). Zero weights cost the same bytes and
  time in dense kernels.
* Heads (Hq -> a*Hq, Hkv -> b*Hkv, head_dim d -> d' = s*d): new query head h
  copies old head h // a, new KV head k copies old KV head k // b; the GQA
  mapping then agrees (new q head h reads new KV head h // g', a copy of old KV
  head h // (a*g)). Inside a head, old dims i and i + d/2 (a rotary pair) go to
  new dims s*i and s*i + d'/2, which rotate at exactly the same frequency
  (theta^(-2si/d') = theta^(-2i/d)); the other dims are zero in q, k and v.
  q is scaled by sqrt(s) to undo the smaller 1/sqrt(d') attention scale (exact
  for s = 4: 32 -> 128). o_proj reads each copy of a head with a coefficient.
* MLP (I -> I'): unit u is duplicated c_u times (c_u = I' // I or one more, so
  any I' >= I works: 384 -> 14336 uses 37 and 38 copies); down_proj reads the
  copies with power-of-two coefficients summing to 1; SiLU(g)*u is per unit.
* Layers (L -> L'): the L original layers keep their order; L' - L new layers
  have random q/k/v/gate/up (real data for the kernels to read) but zero
  o_proj and down_proj, so they add exactly 0 to the residual stream. Their
  places are chosen so that EAGLE-3's default taps on the grown model (entering
  layers 2, L'//2, L'-3) see the same residual stream as the old taps; when
  that is impossible (or the drafter lists its layers), the grown drafter gets
  explicit `eagle_aux_hidden_state_layer_ids` (SGLang convention).
* Embeddings are untied in the grown model (the embedding must duplicate, the
  LM head must read with coefficients: no longer the same matrix).
* The drafter is widened the same way: fc reads three duplicated taps and
  writes the new stream, q/k/v read two duplicated halves, heads and MLP as in
  the target; d2t/t2d are unchanged.

Experts (`Shape.experts` > 0): the target becomes a Mixtral model (Llama attention, a
softmax router whose top-k weights are renormalised to sum to 1). Every expert of a
kept layer is that layer's grown MLP, so whichever k experts the (random) router
picks, their weighted sum is the MLP's output; only the weights' rounding (their sum
is 1 to within a rounding error) separates it from the dense model. The router is
random so that tokens spread over the experts as a real model's do. An identity
layer's experts are random with zero down projections. Qwen3-MoE is not a target:
its attention always applies RMSNorm to q and k, which the small Llama does not.

Vocabulary: by default it stays the small model's (4096 for the demo, against
128256 for Llama-3-8B), so the grown "8B" has ~7.0B parameters and reads ~1 GB
less per decode step for its LM head (~14.0 GB bf16 against 16.06 GB).
`--pad-vocab 128256` adds never-chosen tokens so the embedding and LM head have
the real sizes (8.03B parameters); see `PadPlan` for how their logits are kept
at about -1e4 without biases. Its cost: real logits are scaled by one positive
factor per position (~1 - 1/(2H'), 1 - 1.2e-4 at 4096: argmax unchanged,
sampling temperature changed by that much) and 64 of the last layer's MLP units
serve the padding. The drafter's draft vocabulary keeps its size (a real
Llama-3 EAGLE-3 drafter has 32000), so its LM head stays smaller.

Other limits: only Llama targets without biases; numerics are not bit-identical
(matmuls over 4096 instead of 128 inputs round differently, bf16 activations
round at other points), so long greedy runs can diverge where two tokens are
almost tied; positions beyond the small model's max_position_embeddings are not
supported (the config keeps it).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specserve.config import (
    ConfigError,
    DraftConfig,
    ModelConfig,
    checkpoint_files,
    default_aux_layers,
    draft_tensor_name,
    read_json,
    resolve_aux_layers,
)
from specserve.train.shapes import OUT_DTYPE_NAMES, READ_MODES, Shape

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
OUT_DTYPES = {name: getattr(torch, name) for name in OUT_DTYPE_NAMES}


# ------------------------------------------------------------------ index maps


def split_coefs(c: int, read: str = "one") -> torch.Tensor:
    """Weights of c copies, summing to exactly 1. "one": all on the first copy (the
    others add exact zeros, so matmuls round as in the small model: the default);
    "all": c powers of two (2^p - e of 2^-p, 2e of 2^-(p+1)), so every weight is used."""
    if read == "one":
        return torch.tensor([1.0] + [0.0] * (c - 1), dtype=torch.float64)
    p = c.bit_length() - 1
    extra = c - (1 << p)
    return torch.tensor([2.0**-p] * ((1 << p) - extra) + [2.0 ** -(p + 1)] * (2 * extra), dtype=torch.float64)


@dataclass
class DimMap:
    """How one dimension grows: new index n copies old index src[n] and, when read, weighs it by coef[n]."""

    src: torch.Tensor
    coef: torch.Tensor

    @classmethod
    def from_counts(cls, counts: list[int], read: str = "one") -> "DimMap":
        src = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        return cls(src, torch.cat([split_coefs(c, read) for c in counts]))

    def to(self, device) -> "DimMap":
        return DimMap(self.src.to(device), self.coef.to(device))


def mlp_counts(old: int, new: int) -> list[int]:
    q, rem = divmod(new, old)
    return [q + 1] * rem + [q] * (old - rem)


def as_reader(w: torch.Tensor, m: DimMap) -> torch.Tensor:
    """A linear reading a grown input dimension (the last one): W'[:, n] = W[:, src[n]] * coef[n]."""
    return w[..., m.src] * m.coef.to(w.dtype)


def as_writer(w: torch.Tensor, m: DimMap) -> torch.Tensor:
    """A linear (or embedding) writing a grown dimension (the first one): rows duplicated."""
    return w[m.src]


@dataclass
class HeadMap:
    """q/k/v rows and o_proj columns of the grown attention."""

    q_new: torch.Tensor  # new row index of each copied q row
    q_old: torch.Tensor  # the old row it copies
    kv_new: torch.Tensor
    kv_old: torch.Tensor
    o_coef: torch.Tensor  # coefficient of each copied o_proj column (same order as q_new)
    q_scale: float
    q_rows: int
    kv_rows: int

    def to(self, device) -> "HeadMap":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return HeadMap(**moved)


def head_map(heads: int, kv_heads: int, d: int, new_heads: int, new_kv: int, new_d: int, read: str = "one") -> HeadMap:
    a, b, s = new_heads // heads, new_kv // kv_heads, new_d // d
    half = torch.arange(d // 2)
    pos = torch.cat([s * half, s * half + new_d // 2])  # where old dim c lands inside a new head

    def rows(n_new: int, copies: int):
        h = torch.arange(n_new)
        new = (h[:, None] * new_d + pos[None, :]).reshape(-1)
        old = ((h // copies)[:, None] * d + torch.arange(d)[None, :]).reshape(-1)
        return new, old

    q_new, q_old = rows(new_heads, a)
    kv_new, kv_old = rows(new_kv, b)
    o_coef = split_coefs(a, read).repeat(heads).repeat_interleave(d)
    return HeadMap(q_new, q_old, kv_new, kv_old, o_coef, math.sqrt(s), new_heads * new_d, new_kv * new_d)


def place_rows(w: torch.Tensor, new: torch.Tensor, old: torch.Tensor, n_rows: int, scale: float = 1.0) -> torch.Tensor:
    out = w.new_zeros(n_rows, w.shape[1])
    out[new] = w[old] * scale
    return out


# ------------------------------------------------------------------ validation and layer placement
def check_shape(
    what: str, heads: int, kv_heads: int, d: int, hidden: int, inter: int, shape: Shape, new_inter: int | None = None
) -> None:
    """new_inter: the grown MLP's width (default shape.intermediate)."""
    new_inter = shape.intermediate if new_inter is None else new_inter
    problems = []
    for name, old, new in (
        ("hidden size", hidden, shape.hidden),
        ("attention heads", heads, shape.heads),
        ("KV heads", kv_heads, shape.kv_heads),
        ("head_dim", d, shape.head_dim),
    ):
        if new < old or new % old:
            problems.append(f"{name} {new} is not a multiple of the source's {old}")
    if inter > new_inter:
        problems.append(f"intermediate size {new_inter} is smaller than the source's {inter}")
    if d % 2:
        problems.append(f"source head_dim {d} is odd (rotary pairs need an even head_dim)")
    if shape.heads % shape.kv_heads:
        problems.append(f"{shape.heads} heads are not a multiple of {shape.kv_heads} KV heads")
    if problems:
        raise ConfigError(f"cannot grow the {what} to {shape}: " + "; ".join(problems))


def place_layers(old_layers: int, new_layers: int, constraints: list[tuple[int, int]]) -> list[int | None]:
    """Order of the grown layers: old layer index, or None for an identity layer.

    constraints: (new index n, old index e) pairs meaning "the stream entering
    new layer n must be the stream entering old layer e" (e == old_layers: the
    final stream). Old layers are spread evenly between the constraints.
    Raises ValueError when they cannot be met."""
    if new_layers < old_layers:
        raise ConfigError(f"cannot shrink {old_layers} layers to {new_layers}")
    points = sorted(set(constraints) | {(0, 0), (new_layers, old_layers)})
    order: list[int | None] = []
    for (n0, e0), (n1, e1) in zip(points, points[1:]):
        slots, count = n1 - n0, e1 - e0
        if count < 0 or count > slots or (n0 == n1 and e0 != e1):
            raise ValueError(f"tap constraints {constraints} cannot be met")
        chosen = {n0 + (i * slots) // count for i in range(count)}
        nxt = iter(range(e0, e1))
        order += [next(nxt) if n0 + j in chosen else None for j in range(slots)]
    return order


def grown_taps(order: list[int | None], old_taps: tuple[int, ...]) -> tuple[int, ...]:
    """New layer index whose input equals the input of each old tap layer."""
    where = {old: new for new, old in enumerate(order) if old is not None}
    return tuple(where.get(e, len(order)) for e in old_taps)


# ------------------------------------------------------------------ checkpoints in and out
def load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from specserve.model.loader import iter_tensors

    return dict(iter_tensors(checkpoint_files(model_dir, allow_pickle=False)))


class ShardWriter:
    """Collects tensors (cast to `dtype`, on CPU) into safetensors shards of about `shard_bytes`."""

    def __init__(self, out: Path, dtype: torch.dtype, shard_bytes: int):
        self.out, self.dtype, self.shard_bytes = out, dtype, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.is_floating_point():
            t = t.to(self.dtype)
        t = t.contiguous().cpu()
        self.pending[name] = t
        self.pending_bytes += t.numel() * t.element_size()
        self.total += t.numel() * t.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.out / f"part-{len(self.files):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        self._flush()
        n = len(self.files)
        if n == 1:
            self.files[0][0].rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        weight_map, names = {}, []
        for i, (path, keys) in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.out / name)
            names.append(name)
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def _set_dtype_key(cfg: dict, dtype: torch.dtype) -> None:
    name = str(dtype).replace("torch.", "")
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    for k in keys:
        cfg[k] = name


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"output directory {out} is not empty; pass --force to replace its contents")
        for p in out.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)


# ------------------------------------------------------------------ the target
def as_experts(layer: dict[str, torch.Tensor], shape: Shape, rand, identity: bool) -> dict[str, torch.Tensor]:
    """The layer's tensors with its dense MLP replaced by a random router and shape.experts experts:
    copies of that MLP (the renormalised top-k weights sum to 1, so any choice of experts sums
    back to it), or for an identity layer random gate/up with the zero down projection."""
    gate, up, down = (layer.pop(f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
    p = "block_sparse_moe."
    layer[p + "gate.weight"] = rand(shape.experts, shape.hidden) / math.sqrt(shape.hidden)
    for e in range(shape.experts):  # fresh tensors: shards may not alias
        w1, w3 = (rand(*gate.shape) * 0.02, rand(*up.shape) * 0.02) if identity else (gate.clone(), up.clone())
        layer.update(
            {
                f"{p}experts.{e}.w1.weight": w1,
                f"{p}experts.{e}.w3.weight": w3,
                f"{p}experts.{e}.w2.weight": down.clone(),
            }
        )
    return layer


SIGN_UNITS = 64  # MLP units of the last layer that drive padded logits negative (see _pad_plan)
PAD_LOGIT = 1e4  # typical magnitude of a padded token's (negative) logit


@dataclass
class PadPlan:
    """Vocabulary padding: padded tokens must never be chosen, yet their LM-head rows must be
    read like real ones. Without biases no logit is constant, so the last layer gets SIGN_UNITS
    extra MLP units with gate = up (silu(z)*z = z^2*sigmoid(z) > 0): their positive sum s is
    written, times beta, along u = (e_a - e_b)/sqrt(2) for two equal-weight copies a, b of one
    unit. Every real reader weighs a and b alike, so it cannot see u; the final RMSNorm's scale
    grows by sqrt(1 + (beta*s)^2 / (H' rms^2)), a positive factor common to all real logits
    (argmax unchanged; ~1/(2H') at the calibrated size, 1.2e-4 for H' = 4096). Padded LM-head
    rows are -m*u, giving logit -m*gamma*beta*s/rms, about -PAD_LOGIT."""

    a: int
    b: int
    rho: float  # scale of the sign units' gate/up rows (their inputs ~ N(0, 1))
    beta: float  # scale of their down_proj column
    m: float  # scale of the padded LM-head rows


@torch.no_grad()
def _pad_plan(
    model_dir: Path, cfg: ModelConfig, r: int, last_is_old: bool, device: torch.device, seed: int, read: str
) -> PadPlan:
    """Size the sign units from the small model's activations on random tokens."""
    from specserve.model.layers import ForwardContext
    from specserve.model.loader import load_target

    n = min(64, cfg.max_position_embeddings)
    m = load_target(model_dir, device, torch.float32, n)
    for att in m.attention_modules():
        att.k_cache = torch.zeros(4, att.num_kv_heads, n, att.head_dim, device=device)
        att.v_cache = torch.zeros_like(att.k_cache)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(cfg.vocab_size, (4, n), generator=gen).to(device)
    pos = torch.arange(n, device=device).expand(4, n)
    ctx = ForwardContext(0, pos, pos, n)
    h, residual = m.embed_tokens(ids), None
    for layer in m.layers[:-1]:
        h, residual, _ = layer(h, residual, ctx)
    if residual is not None:
        h = h + residual  # the residual stream entering the last layer
    last = m.layers[-1]
    h = h + last.self_attn(last.input_layernorm(h), ctx)
    post = last.post_attention_layernorm(h)
    h = h + last.mlp(post)
    rms = h.pow(2).mean(-1).sqrt().median().item()
    # |input of the sign units|: the old last layer's normed input, duplicated r times; else a
    # fresh identity layer's RMSNorm with unit weights (mean square 1 over H' = r*H dims).
    in_norm = post.norm(dim=-1).median().item() * math.sqrt(r) if last_is_old else math.sqrt(r * cfg.hidden_size)
    gamma = m.norm.weight.float()
    j = int(gamma.abs().argmax())
    beta = rms / (SIGN_UNITS / 2)  # E[z^2 sigmoid(z)] = 1/2 for z ~ N(0,1): beta*s ~ rms
    return PadPlan(a=j * r + r - 2, b=j * r + r - 1, rho=1 / in_norm, beta=beta, m=PAD_LOGIT / float(gamma[j]))


@torch.no_grad()
def grow_target(
    model_dir: Path,
    out: Path,
    shape: Shape,
    order: list[int | None],
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    shard_bytes: int,
    extra_config: dict,
    pad_vocab: int | None = None,
    read: str = "one",
) -> dict:
    cfg_json = read_json(model_dir / "config.json")
    cfg = ModelConfig.from_hf_dict(cfg_json, model_dir / "config.json")
    src = load_state(model_dir)
    f32 = torch.float32
    get = lambda name: src[name].to(device, f32)  # noqa: E731
    r = shape.hidden // cfg.hidden_size
    H = DimMap.from_counts([r] * cfg.hidden_size, read).to(device)
    hm = head_map(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, shape.heads, shape.kv_heads, shape.head_dim, read).to(
        device
    )
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=f32)  # noqa: E731
    V = cfg.vocab_size
    pad = (pad_vocab or V) - V
    plan = _pad_plan(model_dir, cfg, r, order[-1] is not None, device, seed, read) if pad else None
    width = shape.target_intermediate
    if plan and width - SIGN_UNITS < cfg.intermediate_size:
        raise ConfigError(
            f"padding the vocabulary needs {SIGN_UNITS} spare MLP units in the last layer: "
            f"intermediate {width} - {SIGN_UNITS} < {cfg.intermediate_size}"
        )

    w = ShardWriter(out, dtype, shard_bytes)
    embed = get("model.embed_tokens.weight")
    head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    w.add("model.embed_tokens.weight", torch.cat([as_writer(embed.T, H).T, rand(pad, shape.hidden) * 0.02]))
    ones = lambda: torch.ones(shape.hidden, device=device)  # noqa: E731  (fresh: shards may not alias)
    mlp_maps: dict[int, DimMap] = {}
    for new_i, old_i in enumerate(order):
        p = f"model.layers.{new_i}."
        signs = SIGN_UNITS if plan and new_i == len(order) - 1 else 0
        inter = width - signs
        if inter not in mlp_maps:
            mlp_maps[inter] = DimMap.from_counts(mlp_counts(cfg.intermediate_size, inter), read).to(device)
        M = mlp_maps[inter]
        if old_i is None:  # identity layer: real data to read, nothing written to the stream
            q_size, kv_size = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
            layer = {
                "self_attn.q_proj.weight": rand(q_size, shape.hidden) * 0.02,
                "self_attn.k_proj.weight": rand(kv_size, shape.hidden) * 0.02,
                "self_attn.v_proj.weight": rand(kv_size, shape.hidden) * 0.02,
                "self_attn.o_proj.weight": torch.zeros(shape.hidden, q_size, device=device),
                "mlp.gate_proj.weight": rand(inter, shape.hidden) * 0.02,
                "mlp.up_proj.weight": rand(inter, shape.hidden) * 0.02,
                "mlp.down_proj.weight": torch.zeros(shape.hidden, inter, device=device),
                "input_layernorm.weight": ones(),
                "post_attention_layernorm.weight": ones(),
            }
        else:
            o = f"model.layers.{old_i}."
            q = place_rows(get(o + "self_attn.q_proj.weight"), hm.q_new, hm.q_old, hm.q_rows, hm.q_scale)
            k = place_rows(get(o + "self_attn.k_proj.weight"), hm.kv_new, hm.kv_old, hm.kv_rows)
            v = place_rows(get(o + "self_attn.v_proj.weight"), hm.kv_new, hm.kv_old, hm.kv_rows)
            o_old = get(o + "self_attn.o_proj.weight")
            o_new = o_old.new_zeros(cfg.hidden_size, hm.q_rows)
            o_new[:, hm.q_new] = o_old[:, hm.q_old] * hm.o_coef.to(f32)
            layer = {
                "self_attn.q_proj.weight": as_reader(q, H),
                "self_attn.k_proj.weight": as_reader(k, H),
                "self_attn.v_proj.weight": as_reader(v, H),
                "self_attn.o_proj.weight": as_writer(o_new, H),
                "mlp.gate_proj.weight": as_reader(as_writer(get(o + "mlp.gate_proj.weight"), M), H),
                "mlp.up_proj.weight": as_reader(as_writer(get(o + "mlp.up_proj.weight"), M), H),
                "mlp.down_proj.weight": as_writer(as_reader(get(o + "mlp.down_proj.weight"), M), H),
                "input_layernorm.weight": as_writer(get(o + "input_layernorm.weight"), H),
                "post_attention_layernorm.weight": as_writer(get(o + "post_attention_layernorm.weight"), H),
            }
        if signs:  # gate = up rows, down column along u (see PadPlan)
            rows = rand(signs, shape.hidden) * plan.rho
            cols = torch.zeros(shape.hidden, signs, device=device)
            cols[plan.a], cols[plan.b] = plan.beta / math.sqrt(2), -plan.beta / math.sqrt(2)
            for name, extra in (("mlp.gate_proj.weight", rows), ("mlp.up_proj.weight", rows.clone())):
                layer[name] = torch.cat([layer[name], extra])
            layer["mlp.down_proj.weight"] = torch.cat([layer["mlp.down_proj.weight"], cols], dim=1)
        if shape.experts:  # (with padding, every expert carries the sign units: their sum is unchanged)
            layer = as_experts(layer, shape, rand, identity=old_i is None)
        for name, t in layer.items():
            w.add(p + name, t)
    w.add("model.norm.weight", as_writer(get("model.norm.weight"), H))
    pad_rows = torch.zeros(pad, shape.hidden, device=device)
    if plan:
        pad_rows[:, plan.a], pad_rows[:, plan.b] = -plan.m / math.sqrt(2), plan.m / math.sqrt(2)
    w.add("lm_head.weight", torch.cat([as_reader(head, H), pad_rows]))
    files = w.finish()

    new_cfg = dict(cfg_json)
    new_cfg.update(
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=V + pad,
        intermediate_size=width,
        tie_word_embeddings=False,
        **extra_config,
    )
    if shape.experts:
        for key in ("mlp_bias", "pretraining_tp"):  # Llama's, not Mixtral's
            new_cfg.pop(key, None)
        new_cfg.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.top_k,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    if plan:
        new_cfg["grow_padded_vocab"] = {"real_vocab_size": V, **asdict(plan)}
    _set_dtype_key(new_cfg, dtype)
    (out / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, out / name)
    return {"files": files, "bytes": w.total, "params": w.total * 8 // torch.finfo(dtype).bits}


# ------------------------------------------------------------------ the drafter
@torch.no_grad()
def grow_drafter(
    draft_dir: Path,
    out: Path,
    shape: Shape,
    target_hidden: int,
    aux_ids: list[int] | None,
    dtype: torch.dtype,
    device: torch.device,
    extra_config: dict,
    vocab: int | None = None,
    read: str = "one",
) -> dict:
    cfg_json = read_json(draft_dir / "config.json")
    dc = DraftConfig.from_hf_dict(cfg_json, draft_dir / "config.json")
    if dc.hidden_size != target_hidden or dc.target_hidden_size != target_hidden:
        raise ConfigError(
            f"{draft_dir}: drafter hidden size {dc.hidden_size} (target_hidden_size "
            f"{dc.target_hidden_size}) differs from the target's {target_hidden}"
        )
    if dc.fc_bias:
        raise ConfigError(f"{draft_dir}: drafters with an fc bias are not supported by grow")
    check_shape("drafter", dc.num_heads, dc.num_kv_heads, dc.head_dim, dc.hidden_size, dc.intermediate_size, shape)
    src = {draft_tensor_name(k): v for k, v in load_state(draft_dir).items()}
    f32 = torch.float32
    get = lambda name: src[name].to(device, f32)  # noqa: E731
    H = DimMap.from_counts([shape.hidden // dc.hidden_size] * dc.hidden_size, read).to(device)
    M = DimMap.from_counts(mlp_counts(dc.intermediate_size, shape.intermediate), read).to(device)
    hm = head_map(dc.num_heads, dc.num_kv_heads, dc.head_dim, shape.heads, shape.kv_heads, shape.head_dim, read).to(
        device
    )

    def read_cat(wt: torch.Tensor, parts: int) -> torch.Tensor:  # input = `parts` grown streams side by side
        return torch.cat([as_reader(c, H) for c in wt.chunk(parts, dim=-1)], dim=-1)

    m = "midlayer."
    q = place_rows(get(m + "self_attn.q_proj.weight"), hm.q_new, hm.q_old, hm.q_rows, hm.q_scale)
    k = place_rows(get(m + "self_attn.k_proj.weight"), hm.kv_new, hm.kv_old, hm.kv_rows)
    v = place_rows(get(m + "self_attn.v_proj.weight"), hm.kv_new, hm.kv_old, hm.kv_rows)
    o_old = get(m + "self_attn.o_proj.weight")
    o_new = o_old.new_zeros(dc.hidden_size, hm.q_rows)
    o_new[:, hm.q_new] = o_old[:, hm.q_old] * hm.o_coef.to(f32)
    t = {
        "fc.weight": as_writer(read_cat(get("fc.weight"), 3), H),
        m + "input_layernorm.weight": as_writer(get(m + "input_layernorm.weight"), H),
        m + "hidden_norm.weight": as_writer(get(m + "hidden_norm.weight"), H),
        m + "post_attention_layernorm.weight": as_writer(get(m + "post_attention_layernorm.weight"), H),
        m + "self_attn.q_proj.weight": read_cat(q, 2),
        m + "self_attn.k_proj.weight": read_cat(k, 2),
        m + "self_attn.v_proj.weight": read_cat(v, 2),
        m + "self_attn.o_proj.weight": as_writer(o_new, H),
        m + "mlp.gate_proj.weight": as_reader(as_writer(get(m + "mlp.gate_proj.weight"), M), H),
        m + "mlp.up_proj.weight": as_reader(as_writer(get(m + "mlp.up_proj.weight"), M), H),
        m + "mlp.down_proj.weight": as_writer(as_reader(get(m + "mlp.down_proj.weight"), M), H),
        "norm.weight": as_writer(get("norm.weight"), H),
        "lm_head.weight": as_reader(get("lm_head.weight"), H),
    }
    pad = (vocab or dc.vocab_size) - dc.vocab_size
    if "embed_tokens.weight" in src:
        emb = as_writer(get("embed_tokens.weight").T, H).T
        t["embed_tokens.weight"] = torch.cat([emb, emb.new_zeros(pad, shape.hidden)])
    if pad:  # padded target ids are not in the draft vocabulary (which keeps its size)
        t["d2t"] = src.get("d2t", torch.zeros(dc.draft_vocab_size, dtype=torch.long))
        t2d = src.get("t2d", torch.ones(dc.vocab_size, dtype=torch.bool))
        t["t2d"] = torch.cat([t2d, torch.zeros(pad, dtype=torch.bool)])
    else:
        t.update({name: src[name] for name in ("d2t", "t2d") if name in src})
    w = ShardWriter(out, dtype, 1 << 62)
    for name, tensor in t.items():
        w.add(name, tensor)
    w.finish()

    new_cfg = dict(cfg_json)
    new_cfg.update(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate,
        vocab_size=dc.vocab_size + pad,
        **extra_config,
    )
    if "target_hidden_size" in new_cfg:
        new_cfg["target_hidden_size"] = shape.hidden
    if aux_ids is not None:
        new_cfg.setdefault("eagle_config", {})["eagle_aux_hidden_state_layer_ids"] = aux_ids
    _set_dtype_key(new_cfg, dtype)
    (out / "config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    return {"bytes": w.total}


# ------------------------------------------------------------------ the whole pair
def grow(
    model_dir: str | Path,
    out: str | Path,
    shape: Shape,
    draft_dir: str | Path | None = None,
    dtype: str = "bfloat16",
    device: str = "auto",
    seed: int = 0,
    shard_gb: float = 5.0,
    preset: str | None = None,
    force: bool = False,
    pad_vocab: int | None = None,
    read: str = "one",
) -> dict:
    """Grow the target at `model_dir` (and the drafter at `draft_dir`) into
    `out` (drafter in `out/draft`). Returns a summary dict."""
    from specserve.model.loader import resolve_device

    t0 = time.perf_counter()
    model_dir, out = Path(model_dir), Path(out)
    if read not in READ_MODES:
        raise ConfigError(f"--read must be one of {', '.join(READ_MODES)}, got {read!r}")
    if dtype not in OUT_DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype!r}")
    dev = resolve_device(device)
    cfg_json = read_json(model_dir / "config.json")
    cfg = ModelConfig.from_hf_dict(cfg_json, model_dir / "config.json")
    if cfg.architecture != "LlamaForCausalLM":
        raise ConfigError(f"{model_dir}: grow supports Llama targets only, found {cfg.architecture}")
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise ConfigError(f"{model_dir}: grow does not support attention or MLP biases")
    if shape.experts and not 1 <= shape.top_k <= shape.experts:
        raise ConfigError(f"--moe-top-k {shape.top_k} must be in 1..{shape.experts} (--moe, the experts per layer)")
    if shape.experts < 0 or (shape.top_k and not shape.experts):
        raise ConfigError(
            f"--moe {shape.experts} --moe-top-k {shape.top_k}: give --moe a positive expert count with --moe-top-k"
        )
    check_shape(
        "target",
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
        shape,
        shape.target_intermediate,
    )
    if shape.layers < cfg.num_layers:
        raise ConfigError(f"cannot grow {cfg.num_layers} layers to fewer ({shape.layers})")
    if pad_vocab is not None and pad_vocab < cfg.vocab_size:
        raise ConfigError(f"--pad-vocab {pad_vocab} is smaller than the source vocabulary ({cfg.vocab_size})")
    r = shape.hidden // cfg.hidden_size
    if pad_vocab and pad_vocab > cfg.vocab_size and (r < 2 or split_coefs(r, read)[-2] != split_coefs(r, read)[-1]):
        raise ConfigError(
            f"--pad-vocab needs two equally read copies of a hidden unit; the hidden size grows only "
            f"{r}x (at least {2 if read == 'all' else 3}x needed with --read {read})"
        )

    # Layer placement: keep the drafter's taps on the same residual streams.
    dc = DraftConfig.from_dir(draft_dir) if draft_dir else None
    old_taps = resolve_aux_layers(dc, cfg.num_layers) if dc else default_aux_layers(cfg.num_layers)
    new_default = default_aux_layers(shape.layers)
    aux_ids = None
    try:
        order = place_layers(cfg.num_layers, shape.layers, list(zip(new_default, old_taps)))
        if dc is not None and dc.aux_layer_ids is not None:  # it lists layers: list the grown ones
            aux_ids = [n - 1 for n in grown_taps(order, old_taps)]
    except ValueError:
        order = place_layers(cfg.num_layers, shape.layers, [])
        aux_ids = [n - 1 for n in grown_taps(order, old_taps)]
    taps = grown_taps(order, old_taps)

    for src_dir in filter(None, (model_dir, draft_dir)):
        if out.resolve() == Path(src_dir).resolve() or out.resolve() in Path(src_dir).resolve().parents:
            raise ConfigError(f"--out {out} would overwrite the source {src_dir}; choose another directory")
    _prepare_out(out, force)
    extra = {
        "grown_from": str(model_dir),
        "grow_preset": preset or "custom",
        "grow_read": read,
        "grow_layer_map": [-1 if o is None else o for o in order],
    }
    summary = {
        "preset": preset or "custom",
        "read": read,
        "shape": asdict(shape),
        "out": str(out),
        "dtype": dtype,
        "device": str(dev),
        "layer_map": extra["grow_layer_map"],
        "aux_taps": list(taps),
    }
    summary["target"] = grow_target(
        model_dir, out, shape, order, OUT_DTYPES[dtype], dev, seed, int(shard_gb * 2**30), extra, pad_vocab, read
    )
    if dc is not None:
        draft_out = out / "draft"
        draft_out.mkdir()
        dextra = {"grown_from": str(draft_dir), "grow_preset": preset or "custom"}
        summary["draft"] = grow_drafter(
            Path(draft_dir), draft_out, shape, cfg.hidden_size, aux_ids, OUT_DTYPES[dtype], dev, dextra, pad_vocab, read
        )
        summary["draft"]["out"] = str(draft_out)
        summary["draft"]["aux_layer_ids"] = aux_ids
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    return summary
