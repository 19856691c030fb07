"""The benchmark's configurations: `baseline`, `eagle3:steps=K`, `ngram:steps=K,min=2,max=5`, ... parsed into
`BenchConfig`s, each checked by the engine's own config before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import ConfigError, EngineConfig

PEERS = ("hf", "hf-assisted")  # what --peers runs (named here so a config that is one is pointed there)
DEFAULT_STEPS = 4  # eagle3 without steps= (as `specserve generate`)

# Each configuration scheme and its keys: key -> (type, default). Add schemes or keys here.
SCHEMES: dict[str, dict[str, tuple[type, object]]] = {
    "baseline": {},
    "eagle3": {
        "steps": (int, DEFAULT_STEPS),
        "adaptive": (bool, False),
        "topk": (int, None),
        "tokens": (int, None),
        "text": (str, None),
    },
    # The target's own MTP layer, and the draft-free methods (--speculative-method); text=ngram|suffix: --text-drafts
    "mtp": {
        "steps": (int, DEFAULT_STEPS),
        "adaptive": (bool, False),
        "topk": (int, None),
        "tokens": (int, None),
        "text": (str, None),
    },
    "ngram": {"steps": (int, DEFAULT_STEPS), "adaptive": (bool, False), "min": (int, None), "max": (int, None)},
    "suffix": {"steps": (int, DEFAULT_STEPS), "adaptive": (bool, False), "topk": (int, None), "tokens": (int, None)},
}


@dataclass(frozen=True)
class BenchConfig:
    """One engine configuration: `name:key=value,key=value` (a bare key means key=true)."""

    name: str
    params: tuple[tuple[str, object], ...]

    @property
    def label(self) -> str:
        if not self.params:
            return self.name
        # Flags first (eagle3:adaptive,steps=6 reads as "adaptive, up to 6").
        flags = [k for k, v in self.params if v is True]
        kvs = [f"{k}={v}" for k, v in self.params if not isinstance(v, bool)]
        return f"{self.name}:{','.join(flags + kvs)}"

    def get(self, key: str):
        return dict(self.params).get(key)

    @property
    def tree(self) -> tuple[int, int | None]:
        """(top-k, nodes verified): (1, None) for chains and plain decoding."""
        return int(self.get("topk") or 1), self.get("tokens")

    def engine_options(self) -> dict:
        """The engine options that set this config's drafting method: configs that differ in them need
        engines of their own (others share one, switching K)."""
        if self.name == "baseline":
            return {}
        out = {"spec_method": self.name, "spec_topk": self.tree[0], "spec_tokens": self.tree[1]}
        if self.get("text"):
            out["spec_text_drafts"] = self.get("text")
        if self.name == "ngram" or self.get("text") == "ngram":
            out.update(
                ngram_min=self.get("min") or EngineConfig.ngram_min, ngram_max=self.get("max") or EngineConfig.ngram_max
            )
        return out

    @property
    def spec_steps(self) -> int:
        """Fixed K, or the largest K for an adaptive config; 0 for plain decoding."""
        return int(self.get("steps") or 0)


def parse_config(text: str) -> BenchConfig:
    name, _, rest = text.strip().partition(":")
    if name not in SCHEMES:
        hint = " (peers go in --peers)" if name in PEERS else ""
        raise ConfigError(
            f"unknown bench config {text!r}{hint}; known: {', '.join(SCHEMES)} "
            f"(e.g. baseline, eagle3:steps=3, eagle3:adaptive,steps=6)"
        )
    keys = SCHEMES[name]
    values = {k: default for k, (_, default) in keys.items()}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        if key not in keys:
            raise ConfigError(
                f"bench config {text!r}: unknown key {key!r} for {name} (known: {', '.join(keys) or 'none'})"
            )
        typ = keys[key][0]
        if typ is bool:
            if eq and raw.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"bench config {text!r}: {key} takes true or false, got {raw!r}")
            values[key] = (not eq) or raw.lower() in ("true", "1")
        else:
            try:
                values[key] = typ(raw)
            except ValueError:
                raise ConfigError(f"bench config {text!r}: {key}={raw!r} is not a valid {typ.__name__}") from None
    steps = values.get("steps")
    if steps is not None and not 1 <= steps <= 16:
        raise ConfigError(f"bench config {text!r}: steps must be in 1..16, got {steps}")
    if name != "baseline":  # the engine's own checks, with the config named
        try:
            EngineConfig(
                draft="-" if name == "eagle3" else None,
                spec_steps=steps,
                **BenchConfig(name, tuple(values.items())).engine_options(),
            )
        except ConfigError as e:
            raise ConfigError(f"bench config {text!r}: {e}") from None
    # Unset optional keys (None) stay out of the label.
    return BenchConfig(name, tuple(sorted((k, v) for k, v in values.items() if v is not None)))


def parse_configs(texts: list[str]) -> list[BenchConfig]:
    """Parse and de-duplicate; baseline is always measured (speedups and output checks need it)."""
    configs = [parse_config(t) for t in texts]
    labels = [c.label for c in configs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ConfigError(f"--configs lists the same configuration twice: {', '.join(dupes)}")
    if "baseline" not in labels:
        configs.insert(0, parse_config("baseline"))
    return configs
