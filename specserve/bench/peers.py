"""Peers measured in the same run: transformers `generate()` ("hf", static
cache where it works) and transformers assisted generation ("hf-assisted":
an assistant LM given by --peer-draft, else prompt-lookup decoding).

They get the same token ids, device, dtype, max_tokens and greedy/sampling
settings as the engine, and are timed the same way (wall time of a batch).

Each peer runs in a process of its own (`PeerProcess`): transformers compiles
static-cache decoding on GPUs into CUDA graphs of torch.compile's own, and
sharing a process with the engine's graphs corrupts the engine's outputs
(garbage token ids, device-side asserts). A separate process
also keeps the peer's memory and threads out of the engine's timings.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings

import torch

from specserve.bench.runs import RunOutput
from specserve.distributed.worker import die_with_parent

PROMPT_LOOKUP_TOKENS = 10  # candidate tokens per prompt-lookup step (the transformers docs' example value)


def _unavailable(name: str, bs: int) -> str | None:
    if name == "hf-assisted" and bs > 1:
        return "transformers assisted generation supports batch size 1 only"
    return None


class _Clock:
    """A stopping criterion that never stops: it timestamps each generation step
    (called once per new token, or once per assisted cycle)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _load_hf(auto_cls, model: str, dtype):
    """transformers' model for `model`: a Hugging Face folder, or a GGUF file (also by known name),
    which transformers dequantizes itself."""
    from specserve.model.gguf import find_gguf

    gguf = find_gguf(model)
    if gguf is not None:
        return auto_cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    return auto_cls.from_pretrained(model, dtype=dtype)


class HFPeer:
    kind = "peer"

    def __init__(
        self,
        name: str,
        model_dir: str,
        device: str,
        dtype,
        max_tokens: int,
        temperature: float,
        ignore_eos: bool,
        eos_ids: set[int],
        peer_draft: str | None = None,
        max_cache_len: int = 2048,
        threads: int | None = None,
    ):
        import transformers
        from transformers import AutoModelForCausalLM

        if threads:  # the engine's thread count: a peer with more threads would not be a like-for-like figure
            torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.name, self.device = name, torch.device(device)
        self.max_tokens, self.temperature, self.ignore_eos = max_tokens, temperature, ignore_eos
        self.eos_ids = sorted(eos_ids)
        # One static cache per batch size, of one length for all prompts: fixed shapes, so a compiled
        # forward (transformers compiles static-cache decoding on GPU) is built once, not per prompt.
        self.max_cache_len = max_cache_len
        self._static: dict[int, object] = {}
        t0 = time.perf_counter()
        self.model = _load_hf(AutoModelForCausalLM, model_dir, dtype).to(self.device).eval()
        self.assistant = None
        self.details: dict = {"transformers": transformers.__version__, "torch_threads": torch.get_num_threads()}
        if name == "hf-assisted":
            if peer_draft:
                self.assistant = _load_hf(AutoModelForCausalLM, peer_draft, dtype).to(self.device).eval()
                self.details["method"] = f"assistant_model={peer_draft}"
            else:
                self.details["method"] = f"prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS}"
            self.cache = "dynamic"
        else:
            self.cache = "static"
        self.details["load_s"] = round(time.perf_counter() - t0, 3)
        self.details["cache"] = self.cache

    def unavailable(self, bs: int) -> str | None:
        return _unavailable(self.name, bs)

    def _config(self):
        from transformers import GenerationConfig

        sample = self.temperature > 0
        kw = dict(
            max_new_tokens=self.max_tokens,
            do_sample=sample,
            # None would fall back to the model's defaults (top_k 50): switch the filters off explicitly.
            temperature=self.temperature if sample else 1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=None if self.ignore_eos or not self.eos_ids else self.eos_ids,
            pad_token_id=self.eos_ids[0] if self.eos_ids else 0,
        )
        if self.name == "hf-assisted" and self.assistant is None:
            kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        return GenerationConfig(**kw)

    @torch.inference_mode()
    def _generate(self, ids: torch.Tensor, mask: torch.Tensor, clock: _Clock):
        from transformers import StoppingCriteriaList

        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        if self.cache == "static":
            from transformers import StaticCache

            B = ids.shape[0]
            if B not in self._static:
                self._static[B] = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
            self._static[B].reset()
            extra["past_key_values"] = self._static[B]
        with warnings.catch_warnings():
            # Newer transformers name it `cache`; `past_key_values` works on every 5.x (deprecated for 6.0).
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            return self.model.generate(
                ids,
                attention_mask=mask,
                generation_config=self._config(),
                stopping_criteria=StoppingCriteriaList([clock]),
                **extra,
            )

    def run(self, prompts: list[list[int]], params: list) -> RunOutput:
        # Left padding: every row's new tokens start at the same column.
        L = max(len(p) for p in prompts)
        pad = self.eos_ids[0] if self.eos_ids else 0
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        if self.temperature > 0:
            torch.manual_seed(params[0].seed or 0)
        while True:
            clock = _Clock()
            t0 = time.perf_counter()
            try:
                out = self._generate(ids, mask, clock)
                rows = out[:, L:].tolist()  # host copy: the GPU work is done when this returns
                wall = time.perf_counter() - t0
                break
            except Exception as e:
                if self.cache != "static":
                    raise
                # Static cache does not work for every model/version: fall back once, and say so.
                self.cache = "dynamic"
                self.details["cache"] = "dynamic"
                self.details["static_cache_error"] = f"{type(e).__name__}: {e}"[:300]
        tokens = [self._cut(r) for r in rows]
        first = clock.times[0] - t0 if clock.times else wall
        ttft = [first] * len(tokens)
        tpot = [(wall - first) / (len(t) - 1) if len(t) > 1 else None for t in tokens]
        spec = None
        if self.name == "hf-assisted":
            spec = {"cycles": len(clock.times), "tokens": sum(len(t) for t in tokens)}
        return RunOutput(tokens, wall, ttft, tpot, spec)

    def _cut(self, row: list[int]) -> list[int]:
        """Drop the padding after EOS (the engine keeps the EOS token itself, so do we)."""
        if self.ignore_eos:
            return row
        for i, t in enumerate(row):
            if t in self.eos_ids:
                return row[: i + 1]
        return row

    def finish(self) -> None:
        pass


def _serve_peer(conn, parent_pid: int, args: tuple) -> None:
    """Child process: build the peer, then answer ("run", prompts, params) until ("close",)."""
    die_with_parent(parent_pid)  # a bench killed mid-run (e.g. by a timeout) leaves no peer holding GPU memory
    try:
        peer = HFPeer(*args)
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which reports the peer as unavailable
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", peer.details))
    while True:
        msg = conn.recv()
        if msg[0] == "close":
            return
        try:
            out = peer.run(msg[1], msg[2])
            conn.send(("ok", out, peer.details))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))


class PeerProcess:
    """An `HFPeer` in a child process, with the same interface (see the module docstring)."""

    kind = "peer"

    def __init__(self, name: str, *args):
        self.name = name
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve_peer, args=(child, os.getpid(), (name, *args)), daemon=True, name=f"specserve-peer-{name}"
        )
        self._proc.start()
        child.close()
        reply = self._recv()
        self.details = reply[1]

    def _recv(self):
        try:
            reply = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"peer {self.name} exited (code {self._proc.exitcode})") from None
        if reply[0] == "error":
            raise RuntimeError(f"peer {self.name}: {reply[1]}")
        return reply

    def unavailable(self, bs: int) -> str | None:
        return _unavailable(self.name, bs)

    def run(self, prompts: list[list[int]], params: list) -> RunOutput:
        self._conn.send(("run", prompts, params))
        _, out, self.details = self._recv()
        return out

    def finish(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("close",))
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
