"""`specserve check`: preflight validation of a target (and drafter) before any weight is loaded.

    specserve check --model T [--draft D] [--tp N] [--max-model-len N] [--max-num-seqs N]
                    [--gpu-memory-utilization F] [--json]

Reads only config.json, tokenizer.json and the JSON headers of the safetensors files
(the first 8 bytes give the header's length; no tensor data is read), and NVML for free
GPU memory. One line per finding: `ERROR: ...`, `WARNING: ...`, `info: ...`, `ok: ...`,
then a summary line. Exit 1 on any error, else 0. `serve` runs the same checks first
through `run_checks` / `check_engine_kwargs`.

Configs are parsed by `specserve.config` (the parser the engine uses), so what passes
here is what the engine will see. No torch at import time: a check must not create a
CUDA context (it would take memory on the GPU it is measuring).

Rules worth knowing:
- context length: the length that will be served (--max-model-len, else the engine's
  default min(target max_position_embeddings, 4096 on CUDA / 1024 on CPU)) must not
  exceed the drafter's max_position_embeddings: past it the engine silently stops
  drafting (a performance cliff), so that is an ERROR naming both numbers and both ways
  out; with --allow-draft-position-extension it is a WARNING. A drafter whose limit
  merely differs from the target's is fine.
- memory per device = weights / TP (the drafter is replicated on every rank; every routed
  expert of an MoE target counts, as all are loaded) + KV cache (KV heads split across
  ranks; latent attention caches one latent of kv_lora_rank + rope dims per token and
  layer, no V; the drafter's one layer whole) + a rough overhead
  allowance (OVERHEAD_BYTES for the CUDA context, cuBLAS workspaces and the shared CUDA
  graph pool, plus the verify forward's fp32 logits buffers), compared with
  min(free, total * --gpu-memory-utilization) of each GPU the ranks will use. int4 linears
  count their int32 words as stored, their scales in the compute dtype and their zero points
  at a byte each. Where weights and overhead alone do not fit, it names the smallest --tp
  whose share would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specserve.config import (
    DEFAULT_MAX_MODEL_LEN,
    PREFILL_GRAPH_TOKENS,
    ConfigError,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    checkpoint_files,
    default_max_model_len,
    draft_tensor_name,
    prefill_stage_len,
    resolve_aux_layers,
)
from specserve.model.gguf import find_gguf, tensor_shapes
from specserve.model.gguf import vocab as gguf_vocab

GIB = 1024**3
MIB = 1024**2

# Rough allowance per device beyond weights and KV: CUDA context (~0.5 GiB, not yet
# counted in NVML's "used" before start-up), cuBLAS/SDPA workspaces, the shared pool of
# the decode/draft/verify CUDA graphs and prefill activations. It is an allowance, not a
# measurement: peak-memory figures from GPU runs are what should set it.
OVERHEAD_BYTES = 1 * GIB
MAX_TP_SUGGESTED = 64  # the largest TP degree the memory check proposes
# The verify forward of the largest batch keeps logits and probabilities in fp32.
LOGIT_COPIES = 3

# Mirrors loader.DTYPES/resolve_dtype (tests assert they agree).
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2}
# safetensors dtype tags -> bytes per element.
ST_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_TAGS = {"F64", "F32", "F16", "BF16"}  # what the loader can cast to the compute dtype
DRAFT_INT_TENSORS = {"d2t", "t2d"}
INT4_SUFFIXES = (".weight_packed", ".weight_zero_point", ".weight_shape")  # a target's int4 linears' integer tensors
MAX_HEADER = 100 * MIB  # safetensors' own limit

_PREFIX = {"error": "ERROR", "warning": "WARNING", "info": "info", "ok": "ok"}


@dataclass
class Finding:
    level: str  # error | warning | info | ok
    code: str  # stable identifier for machines (e.g. "draft_positions", "tp", "memory")
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return f"{_PREFIX[self.level]}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Findings(list):
    def add(self, level: str, code: str, message: str, **data: Any) -> None:
        self.append(Finding(level, code, message, data))


def has_errors(findings: list[Finding]) -> bool:
    return any(f.level == "error" for f in findings)


def summary(findings: list[Finding]) -> str:
    n_err = sum(f.level == "error" for f in findings)
    n_warn = sum(f.level == "warning" for f in findings)
    word = "failed" if n_err else "passed"
    return f"check {word}: {n_err} error{'s' * (n_err != 1)}, {n_warn} warning{'s' * (n_warn != 1)}"


def format_report(findings: list[Finding], show_ok: bool = True) -> str:
    """The human report: one line per finding and the summary line."""
    lines = [f.line() for f in findings if show_ok or f.level in ("error", "warning")]
    return "\n".join([*lines, summary(findings)])


# ------------------------------------------------------------------ file reading
def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype tag, shape) from a safetensors file's header, without its data."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise ConfigError(f"{path} is not a valid safetensors file (header length {n}, file size {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: safetensors header is not valid JSON ({e})") from None
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = (str(info["dtype"]), tuple(int(s) for s in info["shape"]))
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise ConfigError(f"{path}: malformed safetensors header entry for {name!r}") from None
    if 8 + n + end > size:
        raise ConfigError(
            f"{path} is truncated: its header describes {8 + n + end} bytes, the file has {size} "
            "(an interrupted download?)"
        )
    return out


@dataclass
class _Weights:
    files: list[Path]
    tensors: dict[str, tuple[str, tuple[int, ...]]] | None  # None for pickles (no header to read)
    disk_bytes: int

    def numel(self, skip: set[str] = frozenset()) -> int:
        return sum(math.prod(shape) for name, (_, shape) in (self.tensors or {}).items() if name not in skip)


def _read_weights(f: _Findings, code: str, model_dir: Path, allow_pickle: bool, what: str) -> _Weights | None:
    try:
        gguf_file = find_gguf(model_dir)
        if gguf_file is not None:
            # Every tensor is dequantized into the compute dtype on load: count it as a float tensor.
            shapes = {name: ("F32", shape) for name, (_, shape) in tensor_shapes(gguf_file).items()}
            return _Weights([gguf_file], shapes, gguf_file.stat().st_size)
        files = checkpoint_files(model_dir, allow_pickle)
        disk = sum(p.stat().st_size for p in files)
        if files[0].suffix != ".safetensors":
            f.add(
                "warning",
                code,
                f"{what} weights are pickle files ({len(files)}): contents unchecked until "
                "loaded; sizes taken from the files",
            )
            return _Weights(files, None, disk)
        tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        for p in files:
            tensors.update(read_safetensors_header(p))
    except ConfigError as e:
        f.add("error", code, str(e))
        return None
    return _Weights(files, tensors, disk)


def _unsupported_dtypes(w: _Weights, allowed_ints: set[str]) -> dict[str, list[str]]:
    bad: dict[str, list[str]] = {}
    for name, (tag, _) in (w.tensors or {}).items():
        if tag not in FLOAT_TAGS and name not in allowed_ints:
            bad.setdefault(tag, []).append(name)
    return bad


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(x) for x in s) + "]"


def _gib(b: float) -> str:
    return f"{b / GIB:.2f} GiB" if b >= 0.1 * GIB else f"{b / MIB:.1f} MiB"


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return str(n)


# --------------------------------------------------------------------- devices
def _resolve_device(device: str, f: _Findings):
    """('cuda'|'cpu', NVML query or None). 'auto' follows NVML (no torch: no CUDA context)."""
    from specserve.ops import nvml

    if device == "cpu":
        return "cpu", None
    q = nvml.query(processes=False)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    has_gpu = q.available and bool(q.gpus) and visible not in ("", "-1")
    gpu_wanted = device == "auto" or device.startswith("cuda")
    if gpu_wanted and visible not in ("", "-1") and not q.available and nvml.driver_without_package():
        f.add(
            "warning",
            "device",
            "an NVIDIA driver is loaded but nvidia-ml-py is not installed, so the GPU "
            "memory checks are skipped: pip install 'specserve[ops]'",
        )
        return "cuda", None
    if device == "auto":
        return ("cuda", q) if has_gpu else ("cpu", None)
    if device.startswith("cuda"):
        if not has_gpu:
            why = q.reason or "none visible"
            f.add(
                "warning",
                "device",
                f"--device {device}: NVML sees no NVIDIA GPU here ({why}); "
                "the engine will refuse to start unless CUDA is available",
            )
            return "cuda", None
        return "cuda", q
    f.add("error", "device", f"--device {device!r}: expected cpu, cuda, cuda:N or auto")
    return "cpu", None


def _rank_gpus(q, device: str, tp: int, nnodes: int = 1):
    """The NVML GPUs this machine's TP ranks will use (CUDA_VISIBLE_DEVICES order), or an error string."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = q.gpus
    if visible is not None:
        chosen = []
        for tok in (t.strip() for t in visible.split(",") if t.strip()):
            if tok.lstrip("-").isdigit():
                if int(tok) < 0:
                    break  # CUDA stops at the first invalid id
                match = [g for g in q.gpus if g.index == int(tok)]
            else:
                match = [g for g in q.gpus if g.uuid and g.uuid.startswith(tok)]
            if not match:
                return f"CUDA_VISIBLE_DEVICES={visible}: {tok!r} matches no GPU NVML sees (MIG?)"
            chosen.append(match[0])
        gpus = chosen
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    local = max(1, tp // nnodes)
    need = gpus[first : first + local]
    if len(need) < local:
        where = (f" from cuda:{first}" if first else "") + (f" on each of the {nnodes} nodes" if nnodes > 1 else "")
        return f"--tp {tp} needs {local} GPUs{where}; {len(gpus)} visible"
    return need


# ----------------------------------------------------------------------- checks
def run_checks(
    model: str,
    draft: str | None = None,
    tp: int = 1,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    gpu_memory_utilization: float = 0.9,
    spec_steps: int | None = None,
    allow_draft_position_extension: bool = False,
    aux_layer_convention: str = "sglang",
    device: str = "auto",
    dtype: str = "auto",
    allow_pickle: bool = False,
    cuda_graphs: bool = True,
    spec_topk: int = 1,
    spec_tokens: int | None = None,
    spec_tree_max_batch: int = EngineConfig.spec_tree_max_batch,
    nnodes: int = 1,
    spec_method: str = "eagle3",
) -> list[Finding]:
    """Validate a target (and optional EAGLE-3 drafter) without loading weights (`nnodes`: the
    tp ranks are spread over that many machines, so this one needs tp / nnodes GPUs).

    `spec_steps` is the largest K the engine may use (max_spec_steps); default 4 with a
    drafter (or another `spec_method`), else 0. Returns findings in check order; `has_errors` says
    whether to refuse.
    """
    f = _Findings()
    speculates = bool(draft) or spec_method != "eagle3"
    if spec_steps is None:
        spec_steps = 4 if speculates else 0
    settings_ok, room, tree_rows = True, spec_steps, 0
    try:
        ecfg = EngineConfig.from_kwargs(
            model=str(model),
            draft=draft,
            spec_steps=spec_steps,
            max_spec_steps=spec_steps,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            tp=tp,
            device=device,
            dtype=dtype,
            aux_layer_convention=aux_layer_convention,
            spec_topk=spec_topk if speculates else 1,
            spec_tokens=spec_tokens if speculates else None,
            spec_tree_max_batch=spec_tree_max_batch,
            spec_method=spec_method,
        )
        room = ecfg.cache_room(spec_steps if speculates else 0)
        tree_batch = max((B for B in range(1, max_num_seqs + 1) if ecfg.drafts_tree(B)), default=0)
        if tree_batch and spec_steps:  # tree verify logits, for the batches that draft trees
            tree_rows = tree_batch * (ecfg.tree_nodes(spec_steps) + 1)
    except ConfigError as e:
        f.add("error", "settings", str(e))
        settings_ok = False
    if not 0 < gpu_memory_utilization <= 1:
        f.add("error", "settings", f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
        settings_ok = False
    if dtype != "auto" and dtype not in DTYPE_BYTES:
        f.add("error", "settings", f"unknown dtype {dtype!r}; choose from auto, float32, float16, bfloat16")
        settings_ok = False
    if tp > 1 and device.startswith("cuda:") and device != "cuda:0":  # as TPLLM refuses it
        f.add(
            "error",
            "settings",
            f"--device {device} with --tp {tp}: TP workers use cuda:0..cuda:{tp - 1}; "
            "select GPUs with CUDA_VISIBLE_DEVICES instead",
        )
        settings_ok = False
    dev_type, gpu_query = _resolve_device(device, f)

    # ---- target
    model_dir = Path(model)
    tcfg = draft_cfg = None
    try:
        tcfg = ModelConfig.from_dir(model_dir)
    except ConfigError as e:
        f.add("error", "target_config", str(e))
    t_weights = None
    if tcfg is not None:
        f.add(
            "ok",
            "target_config",
            f"target {tcfg.architecture}: {tcfg.num_layers} layers, "
            f"hidden {tcfg.hidden_size}, {_attention_words(tcfg)}, vocab {tcfg.vocab_size}, "
            f"max_position_embeddings {tcfg.max_position_embeddings}, dtype {tcfg.dtype}",
        )
        t_weights = _read_weights(f, "target_weights", model_dir, allow_pickle, "target")
        if t_weights is not None and t_weights.tensors is not None:
            _check_mtp(f, tcfg, t_weights, spec_method)
            t_weights = _text_model_tensors(tcfg, t_weights)
        if t_weights is not None and t_weights.tensors is not None:
            _check_target_tensors(f, tcfg, t_weights, model_dir)
    _check_target_tokenizer(f, model_dir, tcfg)

    # ---- context length (config.default_max_model_len, as the engine serves it)
    served = None
    if tcfg is not None:
        served = max_model_len or default_max_model_len(tcfg, dev_type)
        if served > tcfg.max_position_embeddings:
            f.add(
                "error",
                "max_model_len",
                f"--max-model-len {served} exceeds the target's max_position_embeddings {tcfg.max_position_embeddings}",
            )
        _check_tp(f, tcfg, tp)

    # ---- drafter
    d_weights = None
    if draft:
        draft_dir = Path(draft)
        try:
            draft_cfg = DraftConfig.from_dir(draft_dir)
        except ConfigError as e:
            f.add("error", "draft_config", str(e))
        if draft_cfg is not None:
            d_weights = _read_weights(f, "draft_weights", draft_dir, allow_pickle, "drafter")
            if tcfg is not None:
                _check_pair(f, tcfg, draft_cfg, d_weights, draft_dir, aux_layer_convention)
                _check_positions(f, tcfg, draft_cfg, served, max_model_len, dev_type, allow_draft_position_extension)
                _check_draft_tokenizer(f, model_dir, draft_dir, tcfg)

    # ---- memory
    if tcfg is not None and t_weights is not None and settings_ok and served is not None:
        _check_memory(
            f,
            tcfg,
            draft_cfg,
            t_weights,
            d_weights,
            served,
            max_num_seqs,
            spec_steps if draft_cfg else 0,
            tp,
            dtype,
            dev_type,
            device,
            gpu_query,
            gpu_memory_utilization,
            cuda_graphs,
            room if draft_cfg else 0,
            tree_rows if draft_cfg else 0,
            nnodes,
        )
    return list(f)


MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _check_mtp(f: _Findings, t: ModelConfig, w: _Weights, method: str) -> None:
    """Whether the checkpoint has a multi-token-prediction layer (DeepSeek-V3's `num_nextn_predict_layers`),
    complete, for `--speculative-method mtp`."""
    if not t.mtp_layers:
        if method == "mtp":
            f.add(
                "error",
                "mtp",
                "--speculative-method mtp: the target has no multi-token-prediction layer "
                "(num_nextn_predict_layers is 0 or absent in config.json); use eagle3 (--draft), ngram or suffix",
            )
        elif t.architecture == "DeepseekV3ForCausalLM":
            f.add(
                "ok",
                "mtp",
                "target has no MTP layer (num_nextn_predict_layers 0): --speculative-method mtp unavailable",
            )
        return
    p = f"{t.tensor_prefix}model.layers.{t.num_layers}."
    missing = [p + n for n in MTP_TENSORS if p + n not in w.tensors]
    block = sum(1 for n in w.tensors if n.startswith((p + "self_attn.", p + "mlp.")))
    if missing or not block:
        f.add(
            "error" if method == "mtp" else "warning",
            "mtp",
            f"config.json declares {t.mtp_layers} MTP layer(s) but the checkpoint lacks "
            f"{', '.join(missing) or p + 'self_attn.* / mlp.*'}: --speculative-method mtp cannot load it",
        )
        return
    f.add(
        "ok",
        "mtp",
        f"target has {t.mtp_layers} MTP layer(s) ({p[:-1]}: enorm, hnorm, eh_proj, a latent-attention "
        f"+ MoE block of {block} tensors, shared_head): --speculative-method mtp drafts with it"
        + ("" if method == "mtp" else " (not used by this run)"),
    )


def _attention_words(t: ModelConfig) -> str:
    words = f"{t.num_heads} heads / {t.num_kv_heads} KV heads"
    if t.mla is not None:
        words = (
            f"{t.num_heads} heads of latent attention (kv_lora_rank {t.mla.kv_lora_rank}, "
            f"rope dims {t.mla.qk_rope_head_dim}, q_lora_rank {t.mla.q_lora_rank})"
        )
    if t.moe is not None:
        m = t.moe
        words += (
            f", {m.num_experts} routed experts ({m.top_k} per token, {m.scoring} routing"
            f"{', shared experts' if m.shared_intermediate_size else ''}) in "
            f"{t.num_layers - len(m.dense_layers)} layers"
        )
    return words


def _text_model_tensors(t: ModelConfig, w: _Weights) -> _Weights:
    """The tensors the engine loads, named as it names them: a wrapper's text model (its prefix
    removed) without the tensors it skips (vision tower, multi-token-prediction layers)."""
    if not (t.tensor_prefix or t.skip_prefixes):
        return w
    kept = {}
    for name, v in w.tensors.items():
        text = name[len(t.tensor_prefix) :] if t.tensor_prefix and name.startswith(t.tensor_prefix) else name
        if not any(name.startswith(p) or text.startswith(p) for p in t.skip_prefixes):
            kept[text] = v
    return _Weights(w.files, kept, w.disk_bytes)


def _check_target_tensors(f: _Findings, t: ModelConfig, w: _Weights, model_dir: Path) -> None:
    bad = _unsupported_dtypes(w, {n for n in w.tensors if n.endswith(INT4_SUFFIXES)} if t.quant else set())
    if bad:
        what = "; ".join(f"{tag} ({len(n)} tensors, e.g. {n[0]})" for tag, n in sorted(bad.items()))
        f.add(
            "error",
            "dtype",
            f"target weights in unsupported dtypes: {what}; supported: F32, F16, BF16 "
            "(quantized: compressed-tensors pack-quantized int4, declared in quantization_config)",
        )
    want = (t.vocab_size, t.hidden_size)
    names = ["model.embed_tokens.weight"] + ([] if t.tie_word_embeddings else ["lm_head.weight"])
    for name in names:
        if name not in w.tensors:
            f.add(
                "error",
                "target_weights",
                f"{model_dir}: checkpoint has no {name} (a different architecture or naming?)",
            )
        elif w.tensors[name][1] != want:
            f.add(
                "error",
                "target_weights",
                f"{model_dir}: {name} is {_shape(w.tensors[name][1])} but config.json "
                f"says {_shape(want)} (vocab_size {t.vocab_size}, hidden_size {t.hidden_size})",
            )
    skip = {"lm_head.weight"} if t.tie_word_embeddings else set()
    kind = "GGUF" if w.files[0].suffix == ".gguf" else "safetensors"
    packed = {n: s for n, (_, s) in w.tensors.items() if n.endswith(".weight_packed")}
    skip |= {n for n in w.tensors if n.endswith(INT4_SUFFIXES)} | {n[: -len("_packed")] + "_scale" for n in packed}
    params = w.numel(skip) + sum(math.prod(s) * 8 for s in packed.values())  # eight int4 weights a word
    int4 = ""
    if packed:
        scales = sum(
            math.prod(w.tensors[n[: -len("_packed")] + "_scale"][1])
            for n in packed
            if n[: -len("_packed")] + "_scale" in w.tensors
        )
        expert_words = [math.prod(s) for n, s in packed.items() if ".experts." in n]
        in_experts = f", {len(expert_words)} of them in routed experts" if expert_words else ""
        int4 = (
            f" ({len(packed)} int4 linears{in_experts}: {_count(8 * sum(math.prod(s) for s in packed.values()))} "
            f"weights in {_gib(4 * sum(math.prod(s) for s in packed.values()))} of words, {_count(scales)} scales)"
        )
    # Weights, not stored elements: an int4 expert's packed word holds eight, its scales and shapes none.
    experts = sum(
        math.prod(shape) for name, (_, shape) in w.tensors.items() if ".experts." in name and name not in skip
    ) + sum(math.prod(s) * 8 for n, s in packed.items() if ".experts." in n)
    of_which = f" ({_count(experts)} of them in routed experts, all loaded)" if experts else ""
    f.add(
        "ok",
        "target_weights",
        f"target weights: {len(w.files)} {kind} file(s), {_count(params)} parameters{of_which}{int4}",
    )


def _tokenizer_file(model_dir: Path) -> Path:
    """Where a checkpoint's vocabulary lives: its GGUF file, else tokenizer.json."""
    try:
        return find_gguf(model_dir) or model_dir / "tokenizer.json"
    except ConfigError:  # already reported for the target's config
        return model_dir / "tokenizer.json"


def _vocab(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer as HFTokenizer

    if path.suffix == ".gguf":
        return gguf_vocab(path)
    try:
        return HFTokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ConfigError(f"{path} cannot be loaded: {e}") from None


def _check_target_tokenizer(f: _Findings, model_dir: Path, t: ModelConfig | None) -> None:
    from specserve.engine.tokenizer import Tokenizer
    from specserve.server.reasoning import resolve_parser

    try:
        tok = Tokenizer(model_dir)
    except ConfigError as e:
        f.add("error", "target_tokenizer", str(e))
        return
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        f.add("error", "target_tokenizer", f"{model_dir}: the tokenizer cannot be loaded: {e}")
        return
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    name = _tokenizer_file(model_dir).name if tok.kind == "GGUF" else tok.kind
    top = max(vocab.values(), default=-1)
    if t is not None and top >= t.vocab_size:
        f.add(
            "error",
            "target_tokenizer",
            f"{model_dir / name} has token ids up to {top} but the model's vocab_size "
            f"is {t.vocab_size}: tokenizer and model do not belong together",
        )
        return
    f.add("ok", "target_tokenizer", f"{name}: {len(vocab)} tokens")
    try:
        features = tok.template_features
    except Exception as e:  # jinja2's TemplateSyntaxError and kin
        f.add("error", "chat_template", f"{model_dir}: the chat template does not parse: {e}")
        return
    if features is None:
        f.add("info", "chat_template", "no chat template: chat requests are refused, /v1/completions serves")
        return
    stops = sorted({*tok.eos_token_ids, *([tok.end_of_turn_id] if tok.end_of_turn_id is not None else [])})
    family = resolve_parser("auto", features)
    f.add(
        "ok",
        "chat_template",
        f"chat template: {features.words()}; reasoning parser (auto): {family or 'none'}; "
        f"replies stop at {', '.join(repr(tok.decode([i], skip_special_tokens=False)) for i in stops)}",
        tools=features.tools,
        thinking_switch=features.thinking_switch,
        reasoning_parser=family,
        tool_calls=features.tool_calls,
    )


def _tp_sizes(t: ModelConfig) -> dict[str, int]:
    """The sizes a TP degree must divide."""
    sizes = {
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "vocab_size": t.vocab_size,
        "intermediate_size": t.intermediate_size,
    }
    if t.moe is not None:  # experts are sharded over the ranks, shared experts split like an MLP
        sizes |= {"routed experts": t.moe.num_experts, "moe_intermediate_size": t.moe.intermediate_size}
        if t.moe.shared_intermediate_size:
            sizes["shared experts' intermediate size"] = t.moe.shared_intermediate_size
    if t.mla is not None:  # the latent is whole on every rank
        del sizes["num_key_value_heads"]
    return sizes


def _check_tp(f: _Findings, t: ModelConfig, tp: int) -> None:
    if tp <= 1:
        return
    sizes = _tp_sizes(t)
    bad = [f"{k} {v}" for k, v in sizes.items() if v % tp]
    if bad:
        ok = [n for n in range(2, 9) if all(v % n == 0 for v in sizes.values())]
        f.add(
            "error",
            "tp",
            f"--tp {tp}: {', '.join(bad)} not divisible by {tp} "
            f"(TP sizes up to 8 that divide all: {', '.join(map(str, ok)) or 'none'})",
            not_divisible=bad,
        )
    else:
        f.add("ok", "tp", f"--tp {tp}: {', '.join(sizes)} divide evenly")


def _check_pair(
    f: _Findings, t: ModelConfig, d: DraftConfig, w: _Weights | None, draft_dir: Path, convention: str
) -> None:
    n_before = len(f)
    if d.vocab_size != t.vocab_size:
        f.add(
            "error",
            "vocab",
            f"drafter vocab_size {d.vocab_size} differs from the target's {t.vocab_size}: "
            "the drafter was trained for another tokenizer",
        )
    if d.draft_vocab_size > d.vocab_size:
        f.add("error", "vocab", f"drafter draft_vocab_size {d.draft_vocab_size} exceeds its vocab_size {d.vocab_size}")
    if d.target_hidden_size != t.hidden_size:
        f.add(
            "error",
            "hidden_size",
            f"drafter fc expects 3 x {d.target_hidden_size} = {3 * d.target_hidden_size} "
            f"input features (target_hidden_size {d.target_hidden_size}); the target's hidden size "
            f"{t.hidden_size} gives {3 * t.hidden_size}: this drafter belongs to a different target",
        )
    if d.aux_layer_ids is not None and len(d.aux_layer_ids) != 3:
        f.add(
            "error",
            "aux_layers",
            f"drafter eagle_aux_hidden_state_layer_ids {list(d.aux_layer_ids)} has "
            f"{len(d.aux_layer_ids)} ids; EAGLE-3's fc takes exactly 3 hidden states (3 x hidden)",
        )
    try:
        taps = resolve_aux_layers(d, t.num_layers, convention)
    except ConfigError as e:
        other = "vllm" if convention == "sglang" else "sglang"
        hint = ""
        try:
            resolve_aux_layers(d, t.num_layers, other)
            hint = f"; they fit under --aux-layer-convention {other}: check how this drafter was trained"
        except ConfigError:
            hint = "; this drafter was trained for a deeper target"
        f.add("error", "aux_layers", f"{e}{hint}")
    else:
        src = "from eagle_aux_hidden_state_layer_ids" if d.aux_layer_ids else "EAGLE-3 default"
        f.add(
            "ok",
            "aux_layers",
            f"aux layers: captures the inputs of target layers {list(taps)} of 0..{t.num_layers} "
            f"({src}, {convention} convention)",
        )
    if d.dtype != t.dtype:
        f.add(
            "warning",
            "dtype",
            f"drafter dtype {d.dtype} differs from the target's {t.dtype}: the drafter is cast to the engine's dtype",
        )
    if w is not None and w.tensors is not None:
        _check_draft_tensors(f, t, d, w, draft_dir)
    if not any(x.level == "error" for x in f[n_before:]):
        f.add(
            "ok",
            "draft_config",
            f"drafter ({d.layout} layout): hidden {d.hidden_size}, "
            f"fc {3 * d.target_hidden_size} -> {d.hidden_size}, draft vocab {d.draft_vocab_size} of {d.vocab_size}, "
            f"max_position_embeddings {d.max_position_embeddings}",
        )


def _check_draft_tensors(f: _Findings, t: ModelConfig, d: DraftConfig, w: _Weights, draft_dir: Path) -> None:
    tensors = {draft_tensor_name(n): v for n, v in w.tensors.items()}
    bad = _unsupported_dtypes(_Weights(w.files, tensors, 0), DRAFT_INT_TENSORS)
    if bad:
        what = "; ".join(f"{tag} ({', '.join(n[:3])})" for tag, n in sorted(bad.items()))
        f.add("error", "dtype", f"drafter weights in unsupported dtypes: {what}; supported: F32, F16, BF16")
    expect = {
        "fc.weight": (
            (d.hidden_size, 3 * d.target_hidden_size),
            f"hidden_size {d.hidden_size}, 3 x target_hidden_size {d.target_hidden_size}",
        ),
        "lm_head.weight": (
            (d.draft_vocab_size, d.hidden_size),
            f"draft_vocab_size {d.draft_vocab_size}, hidden_size {d.hidden_size}",
        ),
    }
    if d.draft_vocab_size != d.vocab_size or "d2t" in tensors:
        expect["d2t"] = ((d.draft_vocab_size,), f"draft_vocab_size {d.draft_vocab_size}")
    if "embed_tokens.weight" in tensors:
        expect["embed_tokens.weight"] = (
            (d.vocab_size, d.hidden_size),
            f"vocab_size {d.vocab_size}, hidden_size {d.hidden_size}",
        )
    elif d.hidden_size != t.hidden_size:
        f.add(
            "error",
            "hidden_size",
            f"drafter has no embed_tokens.weight, so it embeds with the target's "
            f"({t.hidden_size} wide), but its hidden_size is {d.hidden_size}",
        )
    for name, (shape, why) in expect.items():
        if name not in tensors:
            f.add("error", "draft_weights", f"{draft_dir}: drafter checkpoint has no {name}")
        elif tensors[name][1] != shape:
            f.add(
                "error",
                "draft_weights" if name != "fc.weight" else "hidden_size",
                f"{draft_dir}: {name} is {_shape(tensors[name][1])} in the checkpoint but config.json implies "
                f"{_shape(shape)} ({why})",
            )


def _check_positions(
    f: _Findings,
    t: ModelConfig,
    d: DraftConfig,
    served: int,
    max_model_len: int | None,
    dev_type: str,
    allow_extension: bool,
) -> None:
    limit = d.max_position_embeddings
    if max_model_len:
        source = "--max-model-len"
    else:
        source = (
            f"default: min(target max_position_embeddings {t.max_position_embeddings}, "
            f"{DEFAULT_MAX_MODEL_LEN[dev_type]} on {dev_type})"
        )
    if served <= limit:
        beyond = ""
        if limit < t.max_position_embeddings:  # fine now; says what serving the target's full context takes
            beyond = (
                f" (the target allows {t.max_position_embeddings}: past {limit}, serving needs "
                "--allow-draft-position-extension)"
            )
        f.add(
            "ok",
            "draft_positions",
            f"context length {served} ({source}) within the drafter's max_position_embeddings {limit}{beyond}",
        )
        return
    if allow_extension:
        f.add(
            "warning",
            "draft_positions",
            f"context length {served} exceeds the drafter's max_position_embeddings "
            f"{limit}; drafting continues past {limit} (--allow-draft-position-extension), at positions it was "
            "not trained on: acceptance may drop on long sequences",
            served=served,
            draft_max=limit,
        )
        return
    f.add(
        "error",
        "draft_positions",
        f"context length {served} ({source}) exceeds the drafter's "
        f"max_position_embeddings {limit}: past {limit} tokens speculation would silently stop. Either cap "
        f"--max-model-len {limit} (or less), or pass --allow-draft-position-extension to keep drafting past "
        f"{limit}",
        served=served,
        draft_max=limit,
        target_max=t.max_position_embeddings,
    )


def _check_draft_tokenizer(f: _Findings, model_dir: Path, draft_dir: Path, t: ModelConfig) -> None:
    d_path, t_path = draft_dir / "tokenizer.json", _tokenizer_file(model_dir)
    if not d_path.exists():
        f.add("info", "tokenizer_match", "drafter has no tokenizer.json: vocabularies compared by size only")
        return
    if not t_path.exists():
        return  # already an error for the target
    try:
        tv, dv = _vocab(t_path), _vocab(d_path)
    except ConfigError as e:
        f.add("error", "tokenizer_match", str(e))
        return
    diff = [tok for tok in tv.keys() | dv.keys() if tv.get(tok) != dv.get(tok)]
    if not diff:
        f.add("ok", "tokenizer_match", f"drafter tokenizer.json matches the target's ({len(tv)} tokens)")
        return
    diff.sort(key=lambda tok: min(x for x in (tv.get(tok), dv.get(tok)) if x is not None))
    shown = "; ".join(f"{tok!r}: target id {tv.get(tok)}, drafter id {dv.get(tok)}" for tok in diff[:3])
    f.add(
        "error",
        "tokenizer_match",
        f"drafter tokenizer.json differs from the target's: {len(diff)} tokens differ "
        f"(target {len(tv)} tokens, drafter {len(dv)}), e.g. {shown}",
        differing=len(diff),
    )


def _compute_dtype(dtype: str, config_dtype: str, dev_type: str) -> str:
    """Mirrors loader.resolve_dtype: 'auto' = float32 on CPU, the checkpoint's dtype on GPU."""
    if dtype == "auto":
        if dev_type == "cpu":
            return "float32"
        return config_dtype if config_dtype in DTYPE_BYTES else "bfloat16"
    return dtype


def _weight_bytes(w: _Weights, elem: int, skip: set[str]) -> int:
    """Bytes the loaded weights take: floats (int4 scales too) in the compute dtype, int4 words as
    stored, int4 zero points unpacked to a byte each (eight per stored word)."""
    if w.tensors is None:
        return w.disk_bytes  # pickles: no header; take the file size
    return sum(
        math.prod(s)
        * (elem if tag in FLOAT_TAGS else 8 if name.endswith(".weight_zero_point") else ST_BYTES.get(tag, 1))
        for name, (tag, s) in w.tensors.items()
        if name not in skip
    )


def estimate_memory(
    t: ModelConfig,
    d: DraftConfig | None,
    t_weights: _Weights,
    d_weights: _Weights | None,
    max_model_len: int,
    max_num_seqs: int,
    k: int,
    tp: int,
    elem: int,
    cuda_graphs: bool = True,
    room: int | None = None,
    tree_rows: int = 0,
    block_size: int = 16,
) -> dict[str, int]:
    """Bytes per device: weights, KV cache, other (overhead allowance), total. `room`: KV slots past
    a sequence's end (EngineConfig.cache_room; default k), `tree_rows`: verify rows of tree batches."""
    room = k if room is None else room
    target_w = _weight_bytes(t_weights, elem, {"lm_head.weight"} if t.tie_word_embeddings else set())
    draft_w = _weight_bytes(d_weights, elem, set()) if d_weights is not None else 0
    # The default pool, as kv_cache.plan_blocks (without importing torch): every row's blocks for
    # max_model_len + room + 1 indices, the null block, and a null column per row.
    bs = block_size
    row = -(-(max_model_len + room + 1) // bs)
    cache_len = (row + 1) * bs
    pool = (row * max_num_seqs + 1) * bs
    heads, k_dim, v_dim = t.kv_cache_dims()  # latent attention: one latent "head", no V
    kv = t.num_layers * (heads // tp if heads % tp == 0 else heads) * (k_dim + v_dim) * elem * pool
    pending = 0
    if d is not None:
        kv += 2 * d.num_kv_heads * d.head_dim * elem * pool
        pending = max_num_seqs * max(16, k + 1) * 3 * t.hidden_size * elem  # drafter inputs buffered per row
    logits = LOGIT_COPIES * max(max_num_seqs * (k + 1), tree_rows) * t.vocab_size * 4
    fixed_other = OVERHEAD_BYTES if cuda_graphs else OVERHEAD_BYTES // 2
    if cuda_graphs:  # the prompt-prefill graphs' one-row staging cache (runner._allocate; at most this long)
        fixed_other += kv // pool * prefill_stage_len(min(PREFILL_GRAPH_TOKENS[-1], max_model_len))
    other = fixed_other + logits + pending
    weights = target_w // tp + draft_w
    # Everything but weights and the fixed allowance grows linearly with max_num_seqs.
    return {
        "weights": weights,
        "kv": kv,
        "other": other,
        "total": weights + kv + other,
        "cache_len": cache_len,
        "kv_per_token": kv // pool,
        "fixed": weights + fixed_other,
        "per_seq": (kv + logits + pending) // max_num_seqs,
    }


def _check_memory(
    f: _Findings,
    t: ModelConfig,
    d: DraftConfig | None,
    t_weights: _Weights,
    d_weights: _Weights | None,
    served: int,
    max_num_seqs: int,
    k: int,
    tp: int,
    dtype: str,
    dev_type: str,
    device: str,
    q,
    util: float,
    cuda_graphs: bool,
    room: int,
    tree_rows: int,
    nnodes: int,
) -> None:
    cdtype = _compute_dtype(dtype, t.dtype, dev_type)
    est = estimate_memory(
        t, d, t_weights, d_weights, served, max_num_seqs, k, tp, DTYPE_BYTES[cdtype], cuda_graphs, room, tree_rows
    )
    parts = (
        f"weights {_gib(est['weights'])} + KV {_gib(est['kv'])} ({max_num_seqs} seqs x {served} tokens, "
        f"{cdtype}) + overhead {_gib(est['other'])}"
    )
    f.add(
        "info",
        "memory_estimate",
        f"memory estimate per device{f' (tp {tp})' if tp > 1 else ''}: {parts} = {_gib(est['total'])}",
        **est,
    )
    if dev_type == "cpu" or q is None:
        f.add("info", "memory", "no GPU: memory check against device memory skipped")
        try:
            import psutil

            avail = psutil.virtual_memory().available
        except Exception:
            return
        per_token = est["kv_per_token"]
        if dev_type == "cpu" and per_token:
            tokens = int(avail * 0.5 // per_token)
            f.add(
                "info",
                "kv_capacity",
                f"device cpu: KV {per_token} bytes per token; half the available RAM holds "
                f"~{tokens} tokens = {tokens // est['cache_len']} sequences of {served} tokens (--kv-cache-tokens "
                f"sets the pool)",
                kv_tokens=tokens,
                sequences_fit=tokens // est["cache_len"],
                kv_bytes_per_token=per_token,
            )
        if dev_type == "cpu" and est["kv"] > avail * 0.5:  # KVCache's CPU budget for the KV cache
            f.add(
                "warning",
                "memory",
                f"device cpu: KV cache {_gib(est['kv'])} exceeds half the available RAM "
                f"({_gib(avail * 0.5)}): the engine would refuse to start now (it caps the KV cache there); "
                "lower --max-num-seqs or --max-model-len",
            )
        return
    gpus = _rank_gpus(q, device, tp, nnodes)
    if isinstance(gpus, str):
        f.add("error", "memory", gpus)
        return
    for g in gpus:
        total = g.memory_total_mib * MIB
        free = (g.memory_total_mib - g.memory_used_mib) * MIB
        usable = min(free, total * util)
        head = f"GPU {g.index} ({g.name}): needs ~{_gib(est['total'])}"
        avail = f"{_gib(usable)} usable (free {_gib(free)} of {_gib(total)}, --gpu-memory-utilization {util})"
        left = usable - est["fixed"]
        fit = int(left // est["per_seq"]) if left > 0 else 0
        per_token = est["kv_per_token"]
        pool = int(max(left, 0) // per_token) if per_token else 0
        f.add(
            "info",
            "kv_capacity",
            f"GPU {g.index}: KV {per_token} bytes per token; a pool sized by "
            f"--gpu-memory-utilization {util} holds ~{pool} tokens = {fit} sequences of {served} tokens at once "
            f"(serve admits by free blocks: shorter sequences fit more)",
            gpu=g.index,
            kv_tokens=pool,
            sequences_fit=fit,
            kv_bytes_per_token=per_token,
        )
        if est["total"] <= usable:
            f.add("ok", "memory", f"{head}, {avail}", gpu=g.index, usable=int(usable))
            continue
        needed = None
        if fit >= 1:
            way = (
                f"at most {fit} sequences of {served} tokens fit: lower --max-num-seqs to {min(fit, max_num_seqs)}"
                f" or --max-model-len, or raise --tp"
            )
        else:
            # The smallest TP degree whose share of the weights leaves room for one sequence here.
            elem = DTYPE_BYTES[cdtype]
            needed = next(
                (
                    n
                    for n in range(tp + 1, MAX_TP_SUGGESTED + 1)
                    if all(v % n == 0 for v in _tp_sizes(t).values())
                    and estimate_memory(t, d, t_weights, d_weights, served, 1, k, n, elem, cuda_graphs, room, 0)[
                        "total"
                    ]
                    <= usable
                ),
                None,
            )
            more = (
                f"it needs at least {needed} GPUs of this size (--tp {needed})"
                if needed
                else f"no --tp up to {MAX_TP_SUGGESTED} makes it fit on GPUs of this size"
            )
            way = f"weights and overhead alone do not fit: {more}; or free the GPU, or use larger GPUs"
        f.add(
            "error",
            "memory",
            f"{head} ({parts}), more than {avail}; {way}",
            gpu=g.index,
            usable=int(usable),
            max_num_seqs_fit=fit,
            gpus_needed=needed,
        )


def check_engine_kwargs(kw: dict[str, Any], gpu_memory_utilization: float = 0.9) -> list[Finding]:
    """`run_checks` for the keyword arguments `engine_kwargs(args)` builds for LLM (what serve uses)."""
    return run_checks(
        model=kw["model"],
        draft=kw.get("draft"),
        tp=kw.get("tp", 1),
        max_model_len=kw.get("max_model_len"),
        max_num_seqs=kw.get("max_num_seqs", 64),
        gpu_memory_utilization=gpu_memory_utilization,
        spec_steps=max(kw.get("max_spec_steps") or 0, kw.get("spec_steps") or 0)
        if kw.get("draft") or kw.get("spec_method", "eagle3") != "eagle3"
        else 0,
        allow_draft_position_extension=kw.get("allow_draft_position_extension", False),
        aux_layer_convention=kw.get("aux_layer_convention", "sglang"),
        device=kw.get("device", "auto"),
        dtype=kw.get("dtype", "auto"),
        allow_pickle=kw.get("allow_pickle", False),
        cuda_graphs=kw.get("cuda_graphs", True),
        spec_topk=kw.get("spec_topk", 1),
        spec_tokens=kw.get("spec_tokens"),
        spec_tree_max_batch=kw.get("spec_tree_max_batch", EngineConfig.spec_tree_max_batch),
        nnodes=kw.get("nnodes", 1),
        spec_method=kw.get("spec_method", "eagle3"),
    )


# -------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    from specserve.engine.generate_cmd import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.add_argument("--quiet", action="store_true", help="print only errors, warnings and the summary")


def run(args: argparse.Namespace) -> int:
    from specserve.engine.generate_cmd import engine_kwargs

    kw = engine_kwargs(args)
    findings = check_engine_kwargs(kw, args.gpu_memory_utilization or 0.9)
    if args.json:
        n_err = sum(x.level == "error" for x in findings)
        print(
            json.dumps(
                {
                    "ok": n_err == 0,
                    "errors": n_err,
                    "warnings": sum(x.level == "warning" for x in findings),
                    "model": kw["model"],
                    "draft": kw.get("draft"),
                    "findings": [x.to_dict() for x in findings],
                },
                indent=2,
            )
        )
    else:
        print(format_report(findings, show_ok=not args.quiet))
    sys.stdout.flush()
    return 1 if has_errors(findings) else 0
