"""The Python API.

from specserve import LLM, SamplingParams
llm = LLM()                                   # the bundled demo pair
outs = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=32))
print(outs[0].text, outs[0].spec["accept_length_mean"])
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from specserve.config import DEMO_DIR, EngineConfig
from specserve.constrain.grammar import Grammars
from specserve.engine.engine import Engine
from specserve.engine.logprobs import TokenLogprob
from specserve.engine.sampling import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.engine.tokenizer import Tokenizer
from specserve.model.catalog import bundled_draft
from specserve.model.gguf import require_model

__all__ = ["LLM", "SamplingParams", "RequestOutput", "demo_paths", "default_pair"]


def demo_paths() -> tuple[str, str | None]:
    draft = DEMO_DIR / "draft"
    return str(DEMO_DIR), (str(draft) if (draft / "config.json").exists() else None)


def default_pair(model: str | None, draft: str | None, speculating: bool = True) -> tuple[str, str | None]:
    """The target and the drafter a run defaults to: no model means the bundled demo pair, a known
    model name brings the drafter bundled for it (model.catalog); a drafter given always wins, and
    none is filled in where the run does not speculate."""
    if model is None:
        model, bundled = demo_paths()
    else:
        bundled = bundled_draft(model)
    return model, draft or (bundled if speculating else None)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    spec: dict = field(default_factory=dict)
    ttft_s: float | None = None
    latency_s: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when SamplingParams.logprobs is set


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s and s in text]
    if not hits:
        return text, False
    return text[: min(hits)], True


def prepare_requests(tokenizer, prompts, sampling_params) -> tuple[list[list[int]], list[SamplingParams]]:
    """Normalize one prompt or many (text or token ids) and their sampling params (one, or one each)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    ids = [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
    params = sampling_params or SamplingParams()
    params = params if isinstance(params, list) else [params] * len(ids)
    if len(params) != len(ids):
        raise ValueError(f"{len(ids)} prompts but {len(params)} sampling params")
    return ids, params


def attach_grammars(engine: Engine, tokenizer: Tokenizer) -> None:
    """Let `engine` compile requests' grammars for `tokenizer`'s vocabulary; its end-of-turn token
    ends a constrained chat reply as the engine's EOS ids do (the server stops chat replies there)."""
    ends = {tokenizer.end_of_turn_id} - {None}
    engine.grammars = Grammars(tokenizer, engine.runner.model_cfg.vocab_size, engine.eos_token_ids | ends)


class LLM:
    def __init__(self, model: str | None = None, draft: str | None = None, on_graph_progress=None, **engine_kwargs):
        eagle = engine_kwargs.get("spec_method", "eagle3") == "eagle3"  # (other methods bring no drafter)
        model, draft = default_pair(model, draft, speculating=eagle and bool(engine_kwargs.get("spec_steps", 0)))
        require_model(str(model))
        self.config = EngineConfig.from_kwargs(model=str(model), draft=draft, **engine_kwargs)
        self.tokenizer = Tokenizer(self.config.model)
        self.engine = Engine(
            self.config,
            eos_token_ids=self.tokenizer.eos_token_ids,
            stop_checker=self._stop_hit,
            on_graph_progress=on_graph_progress,
        )
        attach_grammars(self.engine, self.tokenizer)

    def _stop_hit(self, seq: Sequence) -> bool:
        # Only the tail can contain a new match: decode a window long enough for any stop string.
        width = max(len(s) for s in seq.params.stop) + 16
        tail = self.tokenizer.decode(seq.output_ids[-width:])
        return cut_at_stop(tail, seq.params.stop)[1]

    def encode_prompts(self, prompts) -> list[list[int]]:
        return prepare_requests(self.tokenizer, prompts, None)[0]

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, progress: bool = False
    ) -> list[RequestOutput]:
        """Generate for one prompt or many (text or token ids), batched together."""
        ids, params = prepare_requests(self.tokenizer, prompts, sampling_params)
        seqs = [self.engine.add_request(p, sp) for p, sp in zip(ids, params)]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        self.engine.batch_job = True  # the caller waits for all of them: what counts is when the last ends
        try:
            while any(s.finish_reason is None for s in seqs):
                done = [s for s in self.engine.step() if s.finish_reason is not None]
                if bar:
                    bar.update(len(done))
        finally:
            self.engine.batch_job = False
        if bar:
            bar.close()
        return [self._output(s) for s in seqs]

    def _output(self, s: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(s.output_ids)
        if s.params.stop:
            text = cut_at_stop(text, s.params.stop)[0]
        return RequestOutput(
            request_id=s.seq_id,
            prompt_token_ids=s.prompt_ids,
            token_ids=list(s.output_ids),
            text=text,
            finish_reason=s.finish_reason,
            spec=s.spec.as_dict() if self.engine.policy is not None else {},
            ttft_s=(s.first_token_time - s.arrival) if s.first_token_time else None,
            latency_s=(s.finish_time - s.arrival) if s.finish_time else None,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
        )

    def profile_summary(self) -> dict:
        """mean/p50/p90 milliseconds of draft, verify and accept per cycle (needs profile=True)."""
        out = {}
        for part in ("draft", "verify", "accept"):
            xs = sorted(p[part] for p in self.engine.profile)
            if xs:
                out[part] = {
                    "mean_ms": statistics.fmean(xs),
                    "p50_ms": _pct(xs, 50),
                    "p90_ms": _pct(xs, 90),
                    "cycles": len(xs),
                }
        return out


def _pct(xs: list[float], q: float) -> float:
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]
