"""Quantized checkpoints: which linear layers hold int4 weights, read from `quantization_config`.

The one scheme read is compressed-tensors `pack-quantized` int4 with weights only (W4A16): eight
4-bit values per int32 word along the input dimension (`weight_packed`), a scale per output row
and group of input columns (`weight_scale`), the unpacked shape (`weight_shape`) and, for
asymmetric schemes, packed zero points (`weight_zero_point`). Every other method, format, bit
width or activation quantization is refused by name, before any weight is read.

No torch here: `specserve check` parses configs through this module without creating a CUDA
context. The arithmetic lives in `specserve.kernels.int4`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

from specserve.errors import ConfigError

PACK_QUANTIZED = "pack-quantized"
SUPPORTED = "compressed-tensors pack-quantized int4 weights (W4A16), group or channel strategy"


def _refuse(where: str, what: str) -> NoReturn:
    raise ConfigError(f"{where}: {what} is not supported; specserve loads {SUPPORTED}, or float checkpoints")


@dataclass(frozen=True)
class Int4Weights:
    """How one linear's weight is stored: 4-bit ints, a scale per (output row, group of
    `group_size` input columns), zero points when asymmetric. `group_size` None: one group per
    row (the channel strategy)."""

    group_size: int | None
    symmetric: bool

    def groups(self, in_features: int) -> int:
        """Scale columns of a weight with `in_features` input columns."""
        return 1 if self.group_size is None else in_features // self.group_size

    def describe(self) -> str:
        group = "per channel" if self.group_size is None else f"group {self.group_size}"
        return f"int4 {group}, {'symmetric' if self.symmetric else 'asymmetric'}"


def _match(name: str, pattern: str) -> bool:
    """compressed-tensors naming: `re:` patterns match from the name's start, others whole names."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


@dataclass(frozen=True)
class QuantConfig:
    """The parsed `quantization_config`: per scheme group, its targets and weight format, and the
    names left in float (`ignore`)."""

    groups: tuple[tuple[tuple[str, ...], Int4Weights], ...]
    ignore: tuple[str, ...]
    # A multimodal wrapper's text-model prefix (`language_model.`): its config names modules as
    # the checkpoint does, with the prefix, where specserve asks for the text model's names.
    prefix: str = ""

    def linear(self, name: str) -> Int4Weights | None:
        """The int4 format of the Hugging Face linear module `name` (`model.layers.0.mlp.up_proj`,
        `lm_head`), or None where it stays float. Targets name a module class (`Linear`) or the
        module itself; the first group that targets it wins, as in compressed-tensors."""
        names = (name, self.prefix + name) if self.prefix else (name,)
        if any(_match(n, p) for n in names for p in self.ignore):
            return None
        for targets, weights in self.groups:
            if any(t == "Linear" or _match(n, t) for n in names for t in targets):
                return weights
        return None

    def stacked(self, names: list[str]) -> Int4Weights | None:
        """The one format of modules fused into one product (q/k/v, gate/up): they must agree."""
        found = [self.linear(n) for n in names]
        if len(set(found)) > 1:
            parts = ", ".join(f"{n.rsplit('.', 1)[-1]} {_describe(f)}" for n, f in zip(names, found))
            raise ConfigError(
                f"{names[0].rsplit('.', 1)[0]}: {parts} in quantization_config; they run as one fused "
                "product, so they must be quantized alike"
            )
        return found[0]

    def experts(self, prefix: str, num_experts: int) -> Int4Weights | None:
        """The one format of a layer's routed experts (`prefix`: `model.layers.1.mlp.`): each
        projection of every expert is stacked into one tensor, so they must all agree."""
        names = [f"{prefix}experts.{e}.{p}" for e in range(num_experts) for p in EXPERT_PROJECTIONS]
        first = self.linear(names[0])
        odd = next((n for n in names[1:] if self.linear(n) != first), None)
        if odd is not None:
            raise ConfigError(
                f"{prefix}experts: {names[0]} is {_describe(first)} but {odd} is "
                f"{_describe(self.linear(odd))} in quantization_config; a layer's routed experts are "
                "stacked into one weight per projection, so they must be quantized alike"
            )
        return first


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # each routed expert's Hugging Face linears


def _describe(fmt: Int4Weights | None) -> str:
    return fmt.describe() if fmt is not None else "float"


def _weights(args: Any, where: str) -> Int4Weights:
    if not isinstance(args, dict):
        _refuse(where, f"a scheme without weight quantization ({args!r})")
    bits, kind = args.get("num_bits"), args.get("type", "int")
    if kind != "int" or bits != 4:
        _refuse(where, f"{kind} {bits}-bit weights")
    strategy = args.get("strategy")
    if args.get("dynamic"):
        _refuse(where, "dynamic weight quantization")
    if args.get("actorder") in ("group", "dynamic", True):  # a g_idx permutation per linear ("static" has none)
        _refuse(where, f"activation-ordered groups (actorder {args['actorder']!r}: a weight_g_idx per layer)")
    if strategy == "group":
        size = args.get("group_size")
        if not isinstance(size, int) or size < 8 or size % 8:
            _refuse(where, f"int4 group size {size!r} (a positive multiple of 8 is needed)")
        group = size
    elif strategy == "channel":
        group = None
    else:
        _refuse(where, f"int4 weights with strategy {strategy!r}")
    return Int4Weights(group_size=group, symmetric=bool(args.get("symmetric", True)))


def parse_quantization_config(q: Any, where: str, prefix: str = "") -> QuantConfig:
    """`quantization_config` of a config.json -> QuantConfig, or a ConfigError naming the scheme.
    `prefix`: the text model's tensor prefix in a multimodal wrapper (QuantConfig.prefix)."""
    if not isinstance(q, dict):
        _refuse(where, f"quantization_config {q!r}")
    method = q.get("quant_method")
    if method != "compressed-tensors":
        bits = q.get("bits", q.get("w_bit"))
        fmt = q.get("fmt") or q.get("version") or q.get("format")
        detail = "".join(f", {k} {v!r}" for k, v in (("bits", bits), ("format", fmt)) if v is not None)
        _refuse(where, f"quantized checkpoint (quant_method {method!r}{detail})")
    top_format = q.get("format")
    groups = []
    for gname, group in (q.get("config_groups") or {}).items():
        gwhere = f"{where}: quantization_config group {gname!r}"
        if not isinstance(group, dict):
            _refuse(gwhere, f"scheme {group!r}")
        fmt = group.get("format") or top_format
        if fmt != PACK_QUANTIZED:
            w = group.get("weights") or {}
            _refuse(
                gwhere, f"compressed-tensors format {fmt!r} ({w.get('type', '?')} {w.get('num_bits', '?')}-bit weights)"
            )
        if group.get("input_activations") or group.get("output_activations"):
            _refuse(gwhere, "activation quantization (only weight-only W4A16 runs)")
        targets = group.get("targets")
        if not targets or not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            _refuse(gwhere, f"a scheme with targets {targets!r} (a list of module classes or names is needed)")
        groups.append((tuple(targets), _weights(group.get("weights"), gwhere)))
    if not groups:
        _refuse(where, "a compressed-tensors config without config_groups")
    for key, what in (("sparsity_config", "sparse compression"), ("transform_config", "weight transforms")):
        if q.get(key):
            _refuse(where, f"{what} ({key} {q[key].get('format', q[key]) if isinstance(q[key], dict) else q[key]!r})")
    if q.get("kv_cache_scheme"):
        _refuse(where, "a quantized KV cache (kv_cache_scheme)")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":  # "frozen"/"calibration": float weights still carrying observers
        _refuse(where, f"a compressed-tensors checkpoint in status {status!r} (compressed weights are needed)")
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        _refuse(where, f"ignore list {ignore!r}")
    return QuantConfig(groups=tuple(groups), ignore=tuple(ignore), prefix=prefix)
