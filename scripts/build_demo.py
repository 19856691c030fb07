"""Rebuild the bundled demo pair (tokenizer, Llama target, EAGLE-3 drafter) from scratch.

    python scripts/build_demo.py --out specserve/assets/demo [--minutes-target 35] [--seed 0]

A one-off asset build, kept outside the served package (it imports specserve, so run it where
specserve is installed, e.g. `pip install -e .`).

Everything is derived from files already on the machine, so the build needs no network:

  1. corpus     the CPython standard library of the running interpreter (``.py`` files only,
                site-packages and test suites excluded, generated codec tables and the pydoc topic
                dump excluded), in sorted path order, one ``<|endoftext|>`` after each file.
                About 1 file in 40 (chosen by a hash of its path) is held out for validation.
  2. held-out   prompts cut from third-party packages that ``pip install -e .`` always brings
                along (jinja2 and tqdm are direct dependencies, click comes with uvicorn) and that
                never appear in the corpus; written to ``heldout_prompts.jsonl``.
  3. tokenizer  byte-level BPE (HF ``tokenizers``), 4096 entries including the special tokens
                ``<|endoftext|>`` (id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (2).
  4. target     ``transformers.LlamaForCausalLM``, 16 layers x 128 wide, trained from scratch
                on the corpus for a wall-clock budget, saved in bfloat16.
  5. drafter    ``train_draft`` with ``TrainConfig.demo`` (specserve/train/train_draft.py).

Stages 2-4 write into ``<work-dir>/staged`` and the files are copied into ``--out`` together
after the target has been trained and reloaded, so ``--out`` never pairs a tokenizer from one
run with weights from another. ``--resume`` continues an interrupted target run from the
checkpoint that every evaluation writes to ``<work-dir>/target_ckpt.pt``.

Why the test suites are left out: at this budget the target sees the 10 MB of library code about
four times, a range where repeating data costs little, while CPython's ``test`` packages are
mostly assertion boilerplate plus deliberately odd fixtures (bad syntax, exotic encodings, large
literal tables). Library code is also what the held-out prompts and demo users look like.
``--include-tests`` adds them back for experiments.

The training schedule is driven by elapsed time rather than a step count (linear warm-up over
the first steps, then a cosine over the time budget), so the run ends on time and with a fully
decayed learning rate even when other processes share the two cores; ``--target-tokens`` adds a
token limit (whichever runs out first), which makes the result independent of machine load.
With a time limit the number of steps, and thus the weights, vary from run to run; the data
order and initialisation are seeded.

Training runs as two data-parallel worker processes with one thread each (gloo all-reduce of the
gradients), not as one process with two threads: on this kind of 2-core machine that is faster
when idle and about twice as fast when other processes compete for the cores, because two OpenMP
threads that share contended cores spend most of their time waiting for each other.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from specserve.train.thread_tuner import ThreadTuner

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 2048

# A plain ChatML template. The demo target is a base model trained on code only; the template is
# there so the chat endpoints have something well-formed to render.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Held-out packages: installed by every `pip install -e .` of specserve (jinja2 and tqdm are
# declared dependencies; click is required by uvicorn), and none of them is part of the stdlib.
HELDOUT_PACKAGES = {"jinja2": 14, "click": 10, "tqdm": 8}  # package -> number of prompts
HELDOUT_MIN_TOKENS = 64
HELDOUT_MAX_TOKENS = 200

TEST_DIR_NAMES = {"test", "tests", "idle_test"}
VAL_EVERY = 40  # about 1 file in VAL_EVERY goes to the validation split


def log(msg: str) -> None:
    print(f"[build_demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Stage 1: corpus
# --------------------------------------------------------------------------------------------


@dataclass
class Doc:
    name: str  # path relative to its root, POSIX style (e.g. "json/decoder.py" or "jinja2/lexer.py")
    text: str


def _is_generated(rel: str, text: str) -> bool:
    """Machine-generated files that teach a code model nothing but cost budget."""
    if rel == "pydoc_data/topics.py":  # one 750 KB string of documentation
        return True
    if rel.startswith("_sysconfigdata"):  # build-machine specific, differs between installs
        return True
    if rel.startswith("encodings/") and any(k in text for k in ("decoding_table", "decoding_map", "gencodec.py")):
        return True  # character-map codecs: 256-line lookup tables (cp*, mac_*, iso8859_*, koi8_*, ...)
    if rel == "html/entities.py":  # 2,000-entry name -> code point dicts
        return True
    return False


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def collect_stdlib(include_tests: bool = False, max_files: int | None = None) -> list[Doc]:
    """All usable stdlib ``.py`` files of the running interpreter, sorted by relative path."""
    root = stdlib_root()
    skip_dirs = {"site-packages", "dist-packages", "__pycache__"}
    if not include_tests:
        skip_dirs |= TEST_DIR_NAMES
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        paths.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    docs: list[Doc] = []
    for p in sorted(paths, key=lambda q: q.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        try:
            text = p.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or _is_generated(rel, text):
            continue
        try:  # keep only files that parse: drops deliberately broken fixtures
            compile(text, rel, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            continue
        docs.append(Doc(rel, text))
        if max_files is not None and len(docs) >= max_files:
            break
    return docs


def split_train_val(docs: list[Doc], every: int = VAL_EVERY) -> tuple[list[Doc], list[Doc]]:
    """Hold out whole files, chosen by a hash of the path (stable when files come and go)."""
    train, val = [], []
    for d in docs:
        (val if zlib.crc32(d.name.encode()) % every == 0 else train).append(d)
    if not val and len(train) > 1:  # tiny smoke builds
        val.append(train.pop())
    return train, val


# --------------------------------------------------------------------------------------------
# Stage 2: held-out third-party code
# --------------------------------------------------------------------------------------------


def collect_package(pkg: str) -> list[Doc]:
    import importlib.util

    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"held-out package {pkg!r} is not installed (pip install -e . brings it)")
    root = Path(list(spec.submodule_search_locations)[0]).resolve()
    if root.is_relative_to(stdlib_root()) and "site-packages" not in root.parts:
        raise RuntimeError(f"{pkg} resolves into the stdlib ({root}); it cannot be held out")
    docs = []
    for p in sorted(root.rglob("*.py"), key=lambda q: q.as_posix()):
        if "__pycache__" in p.parts:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        docs.append(Doc(f"{pkg}/{p.relative_to(root).as_posix()}", text))
    return docs


def package_versions(pkgs) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in pkgs:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "?"
    return out


def make_heldout_prompts(
    tokenizer,
    docs_by_pkg: dict[str, list[Doc]],
    counts: dict[str, int],
    seed: int,
    lo: int = HELDOUT_MIN_TOKENS,
    hi: int = HELDOUT_MAX_TOKENS,
) -> list[dict]:
    """Cut prompts of ``lo``..``hi`` tokens at line boundaries, each starting at a definition or a
    top-level statement, so that the natural continuation is more code."""
    rng = random.Random(seed)
    prompts: list[dict] = []
    taken: dict[str, list[tuple[int, int]]] = {}  # file -> line ranges already used (no overlaps)

    def ntok(s: str) -> int:
        return len(tokenizer.encode(s).ids)

    for pkg, n in counts.items():
        files = [d for d in docs_by_pkg[pkg] if d.text.count("\n") >= 40]
        got, tries = 0, 0
        while got < n:
            tries += 1
            if tries > 200 * n:
                raise RuntimeError(f"could not cut {n} prompts from {pkg}")
            doc = rng.choice(files)
            lines = doc.text.splitlines(keepends=True)
            starts = [
                i
                for i, ln in enumerate(lines)
                if ln.lstrip().startswith(("def ", "async def ", "class ", "@"))
                or (ln[:1].isalpha() and not ln.startswith(("else", "elif", "except", "finally")))
            ]
            if not starts:
                continue
            start = rng.choice(starts)
            target = rng.randint(lo, hi)
            text, end = "", start
            while end < len(lines):
                cand = text + lines[end]
                if ntok(cand) > target:
                    break
                text, end = cand, end + 1
            while text.endswith("\n\n"):  # do not end on blank lines
                text = text[:-1]
            if not text.strip() or ntok(text) < lo or EOS_TOKEN in text:
                continue
            if any(start < b and a < end for a, b in taken.get(doc.name, [])):
                continue
            taken.setdefault(doc.name, []).append((start, end))
            prompts.append({"prompt": text, "category": "code", "source": f"{doc.name}:{start + 1}"})
            got += 1
    return prompts


# --------------------------------------------------------------------------------------------
# Stage 3: tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE: every byte is in the base alphabet, so any text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def write_tokenizer(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, s in enumerate(SPECIAL_TOKENS)
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").unlink(missing_ok=True)


def encode_stream(tok, docs: list[Doc]):
    """Token ids of all docs, each followed by the document separator, as one uint16 array."""
    import numpy as np

    eos = tok.token_to_id(EOS_TOKEN)
    parts = []
    batch = 64
    for i in range(0, len(docs), batch):
        for enc in tok.encode_batch([d.text for d in docs[i : i + batch]], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
            parts.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


# --------------------------------------------------------------------------------------------
# Stage 4: target
# --------------------------------------------------------------------------------------------


def target_config(eos_id: int, vocab_size: int = VOCAB_SIZE):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        hidden_act="silu",
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        # No pad id in the model config on purpose: LlamaModel would pass it to nn.Embedding as
        # padding_idx, freezing the embedding of <|endoftext|>, which is our document separator.
        pad_token_id=None,
        use_cache=True,
    )


def _chunks(stream, seq_len: int, offset: int = 0):
    """Non-overlapping windows of seq_len + 1 tokens (input plus shifted target)."""
    import torch

    n = (len(stream) - offset - 1) // seq_len
    if n <= 0:
        raise RuntimeError(f"stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    idx = offset + torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[idx]


@dataclass
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    tok_per_s: float
    batch_size: int
    seq_len: int
    workers: int
    epochs: float
    train_loss_ema: float
    train_loss: float
    val_loss: float
    heldout_loss: float
    compiled: bool
    history: list
    thread_switches: list


@dataclass
class TrainOptions:
    minutes: float
    seq_len: int
    batch_size: int  # global (all workers together)
    lr: float
    seed: int
    compile_model: bool
    threads: list[int]  # single-process mode: candidate intra-op thread counts
    target_tokens: float | None = None
    eval_every_s: float = 240.0
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    checkpoint: str | None = None  # written after every evaluation (rank 0)
    resume: bool = False  # continue from ``checkpoint`` when it exists


def _evaluate(model, windows, rank: int, world: int, batch_size: int = 16) -> float:
    """Mean next-token loss over ``windows``, split across the workers."""
    import torch
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64)  # [sum of losses, token count]
    mine = windows[rank::world]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for i in range(0, len(mine), batch_size):
            w = mine[i : i + batch_size].long()
            logits = model(input_ids=w[:, :-1], use_cache=False).logits
            acc[0] += F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
            ).item()
            acc[1] += w[:, 1:].numel()
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(acc)
    model.train(was_training)
    return float(acc[0] / acc[1].clamp(min=1))


def evaluate(model, windows, batch_size: int = 16) -> float:
    return _evaluate(model, windows, 0, 1, batch_size)


def _train_loop(
    rank: int, world: int, model, train_stream, val_stream, heldout_stream, opt_: TrainOptions, result_dir: Path | None
) -> TrainResult:
    """The training loop of one worker. With world > 1 every worker computes the gradient of its
    slice of the global batch and the gradients are averaged with one all-reduce per step; rank 0
    keeps time and decides (by broadcast) when to evaluate and when to stop."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    distributed = world > 1
    if distributed:
        import torch.distributed as dist
    seq_len, batch_size = opt_.seq_len, opt_.batch_size
    if batch_size % world:
        raise ValueError(f"global batch {batch_size} is not divisible by {world} workers")
    torch.manual_seed(opt_.seed)
    g = torch.Generator().manual_seed(opt_.seed)  # same stream on every worker: same global batches
    train_stream = torch.from_numpy(train_stream.astype("int64"))
    val_w = _chunks(torch.from_numpy(val_stream.astype("int64")), seq_len)[:96]
    held_w = _chunks(torch.from_numpy(heldout_stream.astype("int64")), seq_len)[:64]
    train_probe = _chunks(train_stream, seq_len)[::97][:64]  # fixed train subset, scored like val
    budget = opt_.minutes * 60.0
    tuner = None
    if distributed:
        torch.set_num_threads(1)
    else:
        tuner = ThreadTuner(opt_.threads)

    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    params = decay + no_decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=opt_.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    state = {"epoch": 0, "order": None, "pos": 0, "windows": None, "offset": 0}
    history: list[dict] = []
    ema = None
    step = 0
    elapsed0 = 0.0
    ck_path = Path(opt_.checkpoint) if opt_.checkpoint else None
    if opt_.resume and ck_path is not None and ck_path.exists():
        ck = torch.load(ck_path, weights_only=False)
        if (ck["seq_len"], ck["batch_size"]) != (seq_len, batch_size):
            raise RuntimeError(
                f"checkpoint {ck_path} was made with seq_len/batch {ck['seq_len']}/{ck['batch_size']}, "
                f"not {seq_len}/{batch_size}; pass --batch-size/--seq-len to match or drop --resume"
            )
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, ema, history, elapsed0 = ck["step"], ck["ema"], ck["history"], ck["elapsed"]
        g.set_state(ck["generator"])
        state.update(epoch=ck["epoch"], pos=ck["pos"], offset=ck["offset"], order=ck["order"])
        state["windows"] = _chunks(train_stream, seq_len, state["offset"])
        if rank == 0:
            log(f"resumed from {ck_path}: step {step}, {elapsed0 / 60:.1f} min of training done")

    def save_checkpoint(elapsed: float) -> None:
        tmp = ck_path.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "ema": ema,
                "history": history,
                "elapsed": elapsed,
                "generator": g.get_state(),
                "epoch": state["epoch"],
                "pos": state["pos"],
                "offset": state["offset"],
                "order": state["order"],
                "seq_len": seq_len,
                "batch_size": batch_size,
            },
            tmp,
        )
        os.replace(tmp, ck_path)

    fwd, compiled = model, False
    if opt_.compile_model:
        try:
            import torch._inductor.config as inductor_config

            # generated kernels read the OpenMP thread count at run time, so ThreadTuner works
            inductor_config.cpp.dynamic_threads = True
            fwd, compiled = torch.compile(model), True
        except Exception as e:  # pragma: no cover - depends on the toolchain
            log(f"torch.compile unavailable ({e!r}); training eager")

    def loss_of(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = fwd(input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    model.train()

    def next_batch():
        if state["windows"] is None or state["pos"] + batch_size > len(state["order"]):
            if state["windows"] is not None:
                state["epoch"] += 1
            # a new random phase each epoch, so window boundaries move between epochs
            off = int(torch.randint(0, seq_len, (1,), generator=g)) if state["epoch"] > 0 else 0
            state["offset"] = off
            state["windows"] = _chunks(train_stream, seq_len, off)
            state["order"] = torch.randperm(len(state["windows"]), generator=g)
            state["pos"] = 0
        b = state["windows"][state["order"][state["pos"] : state["pos"] + batch_size]]
        state["pos"] += batch_size
        return b

    per_rank = batch_size // world
    tokens_per_step = batch_size * seq_len
    n_windows = len(_chunks(train_stream, seq_len))
    ctrl = torch.zeros(2, dtype=torch.float64)  # [schedule progress, evaluate now?] from rank 0
    t0 = time.perf_counter() - elapsed0
    last_eval = time.perf_counter()
    recent: list[tuple[float, int]] = []
    tps = 0.0
    bar = tqdm(
        total=1000,
        initial=step,
        desc="target",
        unit="step",
        dynamic_ncols=True,
        disable=rank != 0,
        mininterval=2.0 if sys.stdout.isatty() else 30.0,
        file=sys.stdout,
    )
    while True:
        if rank == 0:
            now = time.perf_counter()
            # progress through the schedule: time, or tokens when a token target is given,
            # whichever runs out first
            frac = (now - t0) / budget
            if opt_.target_tokens:
                frac = max(frac, step * tokens_per_step / opt_.target_tokens)
            ctrl[0] = frac
            ctrl[1] = float(now - last_eval >= opt_.eval_every_s and frac < 1.0)
        if distributed:
            dist.broadcast(ctrl, 0)
        frac, do_eval = float(ctrl[0]), bool(ctrl[1] > 0)
        if do_eval:
            t_e = time.perf_counter()
            v = _evaluate(model, val_w, rank, world)
            if rank == 0:
                history.append(
                    {
                        "step": step,
                        "minutes": round((t_e - t0) / 60, 2),
                        "train_loss_ema": round(ema, 4) if ema is not None else None,
                        "val_loss": round(v, 4),
                        "tok_per_s": round(tps),
                        "threads": tuner.current if tuner else 1,
                    }
                )
                bar.write(
                    f"[build_demo] step {step} t={(t_e - t0) / 60:.1f} min  "
                    f"train(ema) {ema or float('nan'):.3f}  val {v:.3f}  tok/s {tps:,.0f}"
                )
                if ck_path is not None:
                    save_checkpoint(t_e - t0)
                last_eval = time.perf_counter()
                t0 += last_eval - t_e  # evaluation (and checkpoint) time does not count as training time
        if frac >= 1.0:
            break
        cur_lr = (
            opt_.lr
            * min(1.0, (step + 1) / opt_.warmup_steps)
            * (opt_.min_lr_ratio + (1 - opt_.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for group in opt.param_groups:
            group["lr"] = cur_lr
        batch = next_batch()[rank * per_rank : (rank + 1) * per_rank]
        t_step = time.perf_counter()
        try:
            loss = loss_of(batch)
        except Exception as e:
            if not compiled or step > 0:
                raise
            log(f"torch.compile failed on the first step ({type(e).__name__}: {e}); training eager")
            fwd, compiled = model, False
            loss = loss_of(batch)
        loss.backward()
        if distributed:
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().float().reshape(1)])
            dist.all_reduce(flat)
            flat /= world
            o = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[o : o + n].view_as(p))
                o += n
            lv = float(flat[-1])
        else:
            lv = loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        t_end = time.perf_counter()
        if tuner is not None and step > 3:
            switched = tuner.record(t_end - t_step)
            if switched:
                bar.write(f"[build_demo] step {step}: {switched}")
        if rank == 0:
            recent.append((t_end, step))
            recent = recent[-50:]
            tps = tokens_per_step * (recent[-1][1] - recent[0][1]) / max(recent[-1][0] - recent[0][0], 1e-9)
            if step >= 20 and tps > 0:  # projected total steps for the bar
                left = (budget - (t_end - t0)) * tps / tokens_per_step
                if opt_.target_tokens:
                    left = min(left, opt_.target_tokens / tokens_per_step - step)
                bar.total = max(step + 1, int(step + left))
            bar.update(1)
            bar.set_postfix(
                loss=f"{ema:.3f}",
                tok_s=f"{tps:,.0f}",
                lr=f"{cur_lr:.1e}",
                ep=f"{step * batch_size / n_windows:.2f}",
                thr=tuner.active if tuner else f"{world}x1",
                refresh=False,
            )
    bar.close()
    seconds = time.perf_counter() - t0
    tokens = step * tokens_per_step
    val = _evaluate(model, val_w, rank, world)
    held = _evaluate(model, held_w, rank, world)
    tr = _evaluate(model, train_probe, rank, world)
    history.append(
        {
            "step": step,
            "minutes": round(seconds / 60, 2),
            "train_loss_ema": round(ema, 4) if ema is not None else None,
            "val_loss": round(val, 4),
        }
    )
    res = TrainResult(
        steps=step,
        tokens=tokens,
        seconds=seconds,
        tok_per_s=tokens / max(seconds, 1e-9),
        batch_size=batch_size,
        seq_len=seq_len,
        workers=world,
        epochs=step * batch_size / n_windows,
        train_loss_ema=float(ema if ema is not None else float("nan")),
        train_loss=tr,
        val_loss=val,
        heldout_loss=held,
        compiled=compiled,
        history=history,
        thread_switches=[(round(t - t0, 1), c) for t, c in tuner.switches] if tuner else [],
    )
    if rank == 0 and result_dir is not None:
        torch.save(model.state_dict(), result_dir / "target_state.pt")
        (result_dir / "train_result.json").write_text(json.dumps(res.__dict__, default=str))
    return res


def _train_worker(
    rank: int,
    world: int,
    port: int,
    cfg_dict: dict,
    state_dict,
    train_stream,
    val_stream,
    heldout_stream,
    opt_: TrainOptions,
    result_dir: str,
) -> None:
    """Entry point of one spawned data-parallel worker."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = LlamaForCausalLM(LlamaConfig.from_dict(cfg_dict))
        model.config._attn_implementation = "sdpa"
        model.load_state_dict(state_dict)  # every worker starts from the same weights
        _train_loop(rank, world, model, train_stream, val_stream, heldout_stream, opt_, Path(result_dir))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_throughput(model, train_stream, seq_len: int, threads: list[int]) -> dict[int, float]:
    """Eager tokens/s of forward+backward at batch 2 for each thread count, on a throw-away copy."""
    import copy

    import torch
    import torch.nn.functional as F

    probe = copy.deepcopy(model)
    x = _chunks(torch.from_numpy(train_stream[: 4 * (seq_len + 1)].astype("int64")), seq_len)[:2]
    out = {}
    for n in sorted(set(threads), reverse=True):
        torch.set_num_threads(n)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = probe(input_ids=x[:, :-1], use_cache=False).logits
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)).backward()
            times.append(time.perf_counter() - t)
        out[n] = 2 * seq_len / min(times[1:])
    return out


def train_target(
    model,
    train_stream,
    val_stream,
    heldout_stream,
    *,
    minutes: float,
    seq_len: int,
    batch_size: int | None,
    lr: float,
    seed: int,
    compile_model: bool,
    workers: int = 2,
    threads: list[int] | None = None,
    target_tokens: float | None = None,
    work_dir: Path | None = None,
    eval_every_s: float = 240.0,
    resume: bool = False,
) -> TrainResult:
    """Train ``model`` in place.

    ``workers`` > 1: that many data-parallel processes (gloo, one intra-op thread each). On this
    2-core machine two 1-thread workers beat one 2-thread process both idle and, by about 2x, when
    other processes compete for the cores.
    ``workers`` == 1: one process whose thread count ThreadTuner adapts between ``threads``.
    """
    import torch

    threads = threads or [1, 2]
    probe = _probe_throughput(model, train_stream, seq_len, [1] if workers > 1 else threads)
    best = max(probe, key=probe.get)
    est_tps = probe[best] * (workers if workers > 1 else 1) * (1.4 if compile_model else 1.0)
    est_tokens = est_tps * minutes * 60
    if target_tokens:
        est_tokens = min(est_tokens, target_tokens)
    if batch_size is None:
        # 8 x seq_len tokens per step unless the budget would then allow fewer than ~150 steps
        batch_size = int(max(1, min(8, est_tokens // (150 * seq_len))))
    batch_size = max(workers, batch_size - batch_size % workers)
    log(
        "throughput probe (eager, batch 2 x %d): %s -> %d worker(s), global batch %d (%d tokens/step), "
        "~%.1f M tokens in budget"
        % (
            seq_len,
            ", ".join(f"{n} thread(s) {v:,.0f} tok/s" for n, v in probe.items()),
            workers,
            batch_size,
            batch_size * seq_len,
            est_tokens / 1e6,
        )
    )
    opts = TrainOptions(
        minutes=minutes,
        seq_len=seq_len,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        compile_model=compile_model,
        threads=[best] + [t for t in threads if t != best],
        target_tokens=target_tokens,
        eval_every_s=eval_every_s,
        resume=resume,
        checkpoint=str(Path(work_dir) / "target_ckpt.pt") if work_dir else None,
    )
    if workers <= 1:
        torch.set_num_threads(best)
        res = _train_loop(0, 1, model, train_stream, val_stream, heldout_stream, opts, None)
        return res
    import torch.multiprocessing as mp

    result_dir = Path(work_dir or tempfile.mkdtemp(prefix="specserve-demo-train-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    for f in ("target_state.pt", "train_result.json"):
        (result_dir / f).unlink(missing_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mp.spawn(
        _train_worker,
        nprocs=workers,
        join=True,
        args=(
            workers,
            _free_port(),
            model.config.to_dict(),
            state,
            train_stream,
            val_stream,
            heldout_stream,
            opts,
            str(result_dir),
        ),
    )
    model.load_state_dict(torch.load(result_dir / "target_state.pt", weights_only=True))
    return TrainResult(**json.loads((result_dir / "train_result.json").read_text()))


def save_target(model, eos_id: int, out: Path) -> None:
    import torch
    from transformers import GenerationConfig

    model = model.to(torch.bfloat16)
    if hasattr(model.config, "dtype"):  # transformers >= 5 ("torch_dtype" is deprecated there)
        model.config.dtype = torch.bfloat16
    else:
        model.config.torch_dtype = torch.bfloat16
    # Generation also stops at the end of a chat turn (<|im_end|>), as chat servers expect.
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[eos_id, SPECIAL_TOKENS.index(IM_END)], pad_token_id=eos_id, do_sample=False
    )
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(str(out), **kwargs)
    if not (out / "model.safetensors").exists():
        raise RuntimeError(f"save_pretrained did not write {out / 'model.safetensors'}")


SAMPLE_PROMPTS = ("def ", "import os\n\n\ndef read_lines(path):\n", "class Stack:\n    def __init__(self):\n")


def verify_target(out: Path, prompts=SAMPLE_PROMPTS, max_new_tokens: int = 64) -> list[str]:
    """Reload tokenizer and target with transformers and greedy-decode a few prompts."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(out))
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model.eval()
    samples = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        samples.append(tok.decode(gen[0], skip_special_tokens=False))
    return samples


# --------------------------------------------------------------------------------------------
# Stage 5: drafter (the trainer lives in specserve/train/train_draft.py)
# --------------------------------------------------------------------------------------------


def stage5_drafter(out: Path, work: Path, minutes: float, seed: int):
    """Train the demo drafter for the target written by stages 3-4 (its tokenizer and weights in
    `out`) on the stdlib token streams, into out/draft, within `minutes`."""
    from specserve.train.train_draft import TrainConfig, train_draft

    config = TrainConfig.demo(
        target_dir=str(out),
        out_dir=str(out / "draft"),
        train_tokens=str(work / "train_tokens.npy"),  # uint16 stdlib stream, EOS-separated
        val_tokens=str(work / "val_tokens.npy"),
        minutes=minutes,
        seed=seed,
    )
    log(f"stage 5: train_draft({config})")
    return train_draft(config)


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/build_demo.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output folder (e.g. specserve/assets/demo)")
    ap.add_argument(
        "--minutes-target",
        type=float,
        default=35.0,
        help="wall-clock training budget of the target, compile time included (default 35)",
    )
    ap.add_argument("--minutes-draft", type=float, default=15.0, help="budget handed to the drafter stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--stages",
        default="corpus,heldout,tokenizer,target,draft",
        help="comma list; corpus and tokenizer are re-run when later stages need them",
    )
    ap.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="training context (512 covers a 200-token prompt plus ~300 generated tokens)",
    )
    ap.add_argument("--batch-size", type=int, default=None, help="default: chosen from measured throughput")
    ap.add_argument(
        "--lr",
        type=float,
        default=6e-3,
        help="peak AdamW learning rate (6e-3 beat 2e-3 by 0.4 nats after 1 M tokens here)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="data-parallel training processes, one thread each (default 2 = one per core)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="with --workers 1: max intra-op threads; training switches between 1..N, whichever "
        "is faster under the current machine load (see ThreadTuner)",
    )
    ap.add_argument(
        "--target-tokens",
        type=float,
        default=None,
        help="also end the target's schedule after this many training tokens (whichever of time "
        "and tokens runs out first); makes the result independent of machine load",
    )
    ap.add_argument("--no-compile", action="store_true", help="train eager (torch.compile costs ~1 min, gains ~40%%)")
    ap.add_argument("--include-tests", action="store_true", help="also train on the stdlib test suites")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files (smoke tests)")
    ap.add_argument(
        "--eval-every-s",
        type=float,
        default=240.0,
        help="seconds of training between validation passes (and checkpoints)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue the target's training from <work-dir>/target_ckpt.pt (written every "
        "evaluation) and keep the existing tokenizer.json",
    )
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="scratch folder for the token streams (default: a new temp folder, kept)",
    )
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    stages = {s.strip() for s in args.stages.split(",") if s.strip()}
    final: Path = args.out
    final.mkdir(parents=True, exist_ok=True)
    if "tokenizer" in stages and "target" not in stages and (final / "model.safetensors").exists() and not args.resume:
        ap.error(
            f"retraining the tokenizer without the target would leave {final}/model.safetensors with a "
            f"tokenizer it was not trained with; add 'target' to --stages"
        )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="specserve-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    # Stages 2-4 write into a staging folder; the files are moved into --out together once the
    # target is trained and verified, so --out never holds a tokenizer from one run next to
    # weights from another (not even while a rebuild is running).
    out = work / "staged"
    if out.exists() and not args.resume:
        shutil.rmtree(out)
    out.mkdir(exist_ok=True)
    published: list[str] = []
    random.seed(args.seed)
    t_all = time.perf_counter()
    stats: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "seed": args.seed,
        "cpu_threads": args.threads,
        "work_dir": str(work),
    }

    # Stage 1 -----------------------------------------------------------------------------------
    t = time.perf_counter()
    docs = collect_stdlib(include_tests=args.include_tests, max_files=args.max_files)
    train_docs, val_docs = split_train_val(docs)
    nbytes = sum(len(d.text.encode()) for d in docs)
    log(
        f"stage 1 corpus: {len(docs)} stdlib files from {stdlib_root()} ({nbytes / 1e6:.1f} MB), "
        f"{len(train_docs)} train / {len(val_docs)} val files, {time.perf_counter() - t:.1f}s"
    )
    stats["corpus"] = {
        "stdlib": str(stdlib_root()),
        "files": len(docs),
        "bytes": nbytes,
        "train_files": len(train_docs),
        "val_files": len(val_docs),
        "include_tests": args.include_tests,
    }

    # Stage 3 (before 2: prompt lengths are measured in tokens) ---------------------------------
    from tokenizers import Tokenizer

    tok_src = out if (out / "tokenizer.json").exists() and args.resume else final
    if ("tokenizer" in stages and not args.resume) or not (tok_src / "tokenizer.json").exists():
        t = time.perf_counter()
        tok = train_tokenizer([d.text for d in train_docs])
        write_tokenizer(tok, out)
        log(
            f"stage 3 tokenizer: vocab {tok.get_vocab_size()} in {time.perf_counter() - t:.1f}s "
            f"-> {out / 'tokenizer.json'} ({_size(out / 'tokenizer.json') / 1e3:.0f} kB)"
        )
        stats["tokenizer_seconds"] = round(time.perf_counter() - t, 1)
    else:
        tok = Tokenizer.from_file(str(tok_src / "tokenizer.json"))
        log(f"stage 3 tokenizer: reusing {tok_src / 'tokenizer.json'}")
    eos_id = tok.token_to_id(EOS_TOKEN)

    t = time.perf_counter()
    train_stream = encode_stream(tok, train_docs)
    val_stream = encode_stream(tok, val_docs)
    np.save(work / "train_tokens.npy", train_stream)
    np.save(work / "val_tokens.npy", val_stream)
    log(
        f"corpus tokens: {len(train_stream):,} train / {len(val_stream):,} val "
        f"({nbytes / max(len(train_stream) + len(val_stream), 1):.2f} bytes/token), {time.perf_counter() - t:.1f}s"
    )
    stats["corpus"].update(train_tokens=int(len(train_stream)), val_tokens=int(len(val_stream)))

    # Stage 2 -----------------------------------------------------------------------------------
    held_docs = {p: collect_package(p) for p in HELDOUT_PACKAGES}
    stats["heldout_packages"] = package_versions(HELDOUT_PACKAGES)
    if "heldout" in stages:
        prompts = make_heldout_prompts(tok, held_docs, HELDOUT_PACKAGES, seed=args.seed)
        with open(out / "heldout_prompts.jsonl", "w") as f:
            for p in prompts:
                f.write(json.dumps(p) + "\n")
        lens = [len(tok.encode(p["prompt"]).ids) for p in prompts]
        log(
            f"stage 2 held-out: {len(prompts)} prompts from {stats['heldout_packages']}, "
            f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f})"
        )
    heldout_stream = encode_stream(tok, [d for ds in held_docs.values() for d in ds])

    # Stage 4 -----------------------------------------------------------------------------------
    if "target" in stages:
        from transformers import LlamaForCausalLM

        torch.manual_seed(args.seed)
        cfg = target_config(eos_id, vocab_size=tok.get_vocab_size())
        model = LlamaForCausalLM(cfg)
        model.config._attn_implementation = "sdpa"
        n_params = sum(p.numel() for p in model.parameters())
        log(
            f"stage 4 target: LlamaForCausalLM {n_params / 1e6:.2f} M params, budget {args.minutes_target} min, "
            f"seq {args.seq_len}, {'eager' if args.no_compile else 'torch.compile'}"
        )
        res = train_target(
            model,
            train_stream,
            val_stream,
            heldout_stream,
            minutes=args.minutes_target,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            compile_model=not args.no_compile,
            workers=args.workers,
            threads=list(range(1, args.threads + 1)),
            target_tokens=args.target_tokens,
            work_dir=work,
            resume=args.resume,
            eval_every_s=args.eval_every_s,
        )
        torch.set_num_threads(args.threads)
        log(
            f"trained {res.steps} steps x {res.batch_size} x {res.seq_len} = {res.tokens / 1e6:.2f} M tokens "
            f"on {res.workers} worker(s) "
            f"({res.epochs:.2f} epochs) in {res.seconds / 60:.1f} min, {res.tok_per_s:,.0f} tok/s; "
            f"loss: train {res.train_loss:.3f} (ema {res.train_loss_ema:.3f}), val {res.val_loss:.3f}, "
            f"held-out packages {res.heldout_loss:.3f}"
        )
        save_target(model, eos_id, out)
        sizes = {
            f: _size(out / f)
            for f in (
                "tokenizer.json",
                "tokenizer_config.json",
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "heldout_prompts.jsonl",
            )
            if (out / f).exists()
        }
        log(
            "sizes: "
            + ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in sizes.items())
            + f"; total {sum(sizes.values()) / 1e6:.2f} MB"
        )
        sample = verify_target(out)
        log("reload ok; greedy samples:\n" + "\n".join(f"--- {p!r}\n{s}" for p, s in zip(SAMPLE_PROMPTS, sample)))
        stats["target"] = {
            "params": n_params,
            **{k: v for k, v in res.__dict__.items()},
            "sizes": sizes,
            "sample": sample,
        }

    # publish ----------------------------------------------------------------------------------
    if "target" in stages or "heldout" in stages:
        names = [
            n
            for n in (
                "tokenizer.json",
                "tokenizer_config.json",
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "heldout_prompts.jsonl",
            )
            if (out / n).exists()
        ]
        if "target" not in stages:  # only the held-out prompts may go out without a new target
            names = [n for n in names if n == "heldout_prompts.jsonl"]
        for n in names:
            tmp = final / f".{n}.tmp"
            shutil.copyfile(out / n, tmp)
            os.replace(tmp, final / n)
        published = names
        log(f"published {', '.join(names)} -> {final}")
        if "target" in stages and "draft" not in stages and (final / "draft").exists():
            log(
                f"WARNING: {final / 'draft'} was trained for the previous target; rebuild it with "
                f"--stages draft --work-dir {work}"
            )

    # Stage 5 -----------------------------------------------------------------------------------
    if "draft" in stages:
        stage5_drafter(final, work, args.minutes_draft, args.seed)

    stats["published"] = published
    stats["total_minutes"] = round((time.perf_counter() - t_all) / 60, 2)
    (work / "build_stats.json").write_text(json.dumps(stats, indent=2, default=str) + "\n")
    log(f"done in {stats['total_minutes']} min; stats in {work / 'build_stats.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
