"""`specserve generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from specserve.config import DRAFT_FREE_METHODS, SPEC_METHODS, ConfigError, EngineConfig, check_max_num_seqs


def device_name(text: str) -> str:
    """argparse type of --device: the names the engine runs on, checked before torch is imported."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got {text!r}")
    return text


def template_variables(text: str) -> dict:
    """argparse type of --chat-template-kwargs: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of template variables, got {text!r}")
    return value


def add_engine_arguments(p: argparse.ArgumentParser, adaptive_flag: bool = True) -> None:
    """Flags shared by generate, bench and serve (serve adapts by default and offers --no-adaptive instead)."""
    p.add_argument(
        "--model",
        help="target: a Hugging Face model directory, a .gguf file (or a folder holding one) "
        "or a known model name such as smollm2-135m-instruct (default: the bundled demo target)",
    )
    p.add_argument(
        "--draft",
        help="EAGLE-3 drafter directory (default: the one bundled for the target, for the "
        "demo target and known models such as smollm2-135m-instruct)",
    )
    p.add_argument(
        "--speculative-method",
        default="eagle3",
        choices=SPEC_METHODS,
        help="where drafts come from: eagle3 (an EAGLE-3 drafter, --draft; the default), mtp (the target "
        "checkpoint's own multi-token-prediction layer, DeepSeek-V3 style), ngram (prompt lookup: "
        "what followed the text's ending earlier in the prompt and output) or suffix (frequency-"
        "scored suffix tries over the request's text and its tenant's finished requests; the server's "
        "tenant is the request's `user` field); ngram and suffix need no drafter model",
    )
    p.add_argument(
        "--ngram-min",
        type=int,
        default=EngineConfig.ngram_min,
        help=f"ngram: shortest text ending matched (default {EngineConfig.ngram_min})",
    )
    p.add_argument(
        "--ngram-max",
        type=int,
        default=EngineConfig.ngram_max,
        help=f"ngram: longest text ending matched, the longest that occurred is used "
        f"(default {EngineConfig.ngram_max})",
    )
    p.add_argument(
        "--text-drafts",
        choices=DRAFT_FREE_METHODS,
        default=None,
        help="with a drafter model (eagle3, mtp): also draft from the text by ngram or suffix, and verify "
        "those drafts instead of the drafter's in cycles where every sequence has a full-length one "
        "and they have lately been accepted at least as well (the drafter's steps are skipped then)",
    )
    p.add_argument(
        "--spec-steps",
        type=int,
        default=None,
        help="draft tokens per cycle K (default: 4 with a drafter or another --speculative-method, "
        "else 0 = plain decoding)",
    )
    if adaptive_flag:
        p.add_argument(
            "--adaptive",
            action="store_true",
            help="choose K (0..--spec-steps) each step from measured costs and acceptance",
        )
    p.add_argument(
        "--spec-topk",
        type=int,
        default=1,
        help="branches kept per depth: >1 drafts a tree of candidates instead of one chain, for "
        "batches up to --spec-tree-max-batch (default: 1)",
    )
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=None,
        help="tree nodes verified per cycle, at most 63 (default: --spec-topk x --spec-steps)",
    )
    p.add_argument(
        "--spec-tree-max-batch",
        type=int,
        default=EngineConfig.spec_tree_max_batch,
        help=f"with --spec-topk > 1: larger batches draft chains (default: {EngineConfig.spec_tree_max_batch})",
    )
    p.add_argument("--device", default="auto", type=device_name, help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights and activations (auto: the checkpoint's dtype on GPU, float32 on CPU)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="longest sequence (prompt + output) in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences in flight (default: the number of prompts; serve: 64)",
    )
    p.add_argument(
        "--admit-wait",
        type=int,
        default=0,
        metavar="STEPS",
        help="while others decode, let waiting requests in together: once those that fit the free rows "
        "fill a prefill chunk, or rows have stood free for them STEPS engine steps (default 0: at "
        "once). Fewer, fuller prefill chunks for a later first token; pays on MoE targets, whose "
        "prefill chunk reads nearly every expert however short it is",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=EngineConfig.kv_block_size,
        help=f"tokens per KV block (default {EngineConfig.kv_block_size})",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens (default: --gpu-memory-utilization when serving on a GPU, "
        "else --max-num-seqs x --max-model-len)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="GPU: size the KV pool so weights, activations, graphs and KV use this fraction of the GPU's "
        "memory (serve's default on a GPU: 0.9)",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt in full (default: serve shares full prompt blocks across requests; "
        "generate and bench do not)",
    )
    p.add_argument("--disable-cuda-graph", action="store_true", help="run every forward eagerly")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="GPU, float16/bfloat16: products of 1-64 rows run one fixed kernel shape in 16-row tiles, so "
        "a token's logits do not depend on the rows beside it and speculative greedy output equals "
        "plain output token for token (else a decode step and a verify round differently and "
        "near-ties can flip); can cost plain decode speed",
    )
    p.add_argument(
        "--aux-layer-convention",
        default="sglang",
        choices=["sglang", "vllm"],
        help="how the drafter's eagle_aux_hidden_state_layer_ids are read: 'sglang' = layer outputs "
        "(capture entering id+1, as SpecForge/SGLang write them), 'vllm' = captured as listed",
    )
    p.add_argument(
        "--allow-draft-position-extension",
        action="store_true",
        help="keep drafting past the drafter's max_position_embeddings (else those sequences decode plainly)",
    )
    p.add_argument(
        "--allow-pickle", action="store_true", help="allow loading pickle (*.bin) checkpoints (trusted only)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the TP workers (repeatable; wins over --nccl-profile)",
    )
    p.add_argument(
        "--nccl-profile",
        default="default",
        help="NCCL settings for the TP workers: a preset (default, pcie-low-latency) or a profile file "
        "written by `specserve nccl-tune`",
    )
    add_node_arguments(p)


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that spread the --tp ranks over machines (engine commands and nccl-tune)."""
    p.add_argument(
        "--nnodes", type=int, default=1, help="machines the --tp ranks are spread over, tp / nnodes on each (default 1)"
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's index: 0 serves / generates / benchmarks and drives every step; "
        "1..nnodes-1 run their workers headless for node 0 (default 0)",
    )
    p.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help="with --nnodes > 1: node 0's address as every node reaches it (PORT: rendezvous, "
        "PORT+1: node 0's channel to the other nodes)",
    )
    p.add_argument(
        "--dist-key-file",
        metavar="FILE",
        help="with --nnodes > 1: the secret every node shares (make one with `specserve dist-key --out "
        "FILE`; mode 0600). Default: SPECSERVE_DIST_KEY, or a per-run secret on a loopback address",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=300.0,
        help="seconds for every node to join, for any collective across nodes, and for the TP workers "
        "to answer one serving step: a worker silent that long ends the server (default 300)",
    )


def engine_kwargs(args: argparse.Namespace, default_max_num_seqs: int = 64) -> dict:
    """Map CLI flags to LLM/EngineConfig keyword arguments (demo defaults applied)."""
    from specserve.engine.llm import default_pair

    method = args.speculative_method
    model, draft = default_pair(args.model, args.draft if method == "eagle3" else None)
    if method != "eagle3":
        if args.draft:
            raise ConfigError(f"--speculative-method {method} takes no --draft (only eagle3 uses a drafter model)")
        draft = None  # (not the drafter bundled with a known target)
    if args.max_num_seqs is not None:  # checked here too: bench raises the count to its largest batch
        check_max_num_seqs(args.max_num_seqs)
    speculates = bool(draft) or method != "eagle3"
    K = args.spec_steps if args.spec_steps is not None else (4 if speculates else 0)
    if K == 0 and not args.adaptive:
        draft, speculates = None, False
    kw = dict(
        model=model,
        draft=draft,
        spec_method=method if speculates else "eagle3",
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        spec_text_drafts=args.text_drafts if speculates else None,
        spec_steps=0 if args.adaptive else K,
        max_spec_steps=K,
        adaptive=bool(args.adaptive and speculates),
        device=args.device,
        dtype=args.dtype,
        spec_topk=args.spec_topk if speculates else 1,
        spec_tokens=args.spec_tokens if speculates else None,
        spec_tree_max_batch=args.spec_tree_max_batch,
        max_model_len=args.max_model_len,
        max_num_seqs=default_max_num_seqs if args.max_num_seqs is None else args.max_num_seqs,
        cuda_graphs=not args.disable_cuda_graph,
        batch_invariant=args.batch_invariant,
        aux_layer_convention=args.aux_layer_convention,
        allow_draft_position_extension=args.allow_draft_position_extension,
        allow_pickle=args.allow_pickle,
        tp=args.tp,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        dist_timeout=args.dist_timeout,
        dist_key_file=args.dist_key_file,
        kv_block_size=args.kv_block_size,
        admit_wait=args.admit_wait,
        kv_cache_tokens=args.kv_cache_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    from specserve.distributed.nccl_profiles import load_profile, parse_env_args

    kw["env"] = parse_env_args(getattr(args, "env", None))  # ConfigError on a bad KEY=VALUE
    kw["nccl_profile"] = getattr(args, "nccl_profile", None) or "default"
    if args.tp > 1 and not args.node_rank:  # a headless node applies node 0's profile, not its own file
        load_profile(kw["nccl_profile"])  # a missing profile file fails before any weight loads
    return kw


def headless_node(kw: dict) -> int | None:
    """With --node-rank N > 0 this machine only runs node N's workers for node 0 (which sends
    them the engine settings) until node 0 ends: the exit code. None on node 0."""
    if not kw.get("node_rank"):
        return None
    from specserve.distributed.multinode import run_node

    return run_node(EngineConfig.from_kwargs(**kw).parallel)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt, at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: smallest token set of this probability (1 = off)"
    )
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed of sampled requests (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--profile", action="store_true", help="time draft/verify/accept per cycle")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send each prompt as a user turn through the model's chat template; the reply ends at the "
        "template's end-of-turn token",
    )
    p.add_argument(
        "--chat-template-kwargs",
        type=template_variables,
        default={},
        metavar="JSON",
        help="with --chat: variables for the chat template, e.g. '{\"thinking\": false}' (Kimi-K2.5) or "
        "'{\"enable_thinking\": false}' (Qwen3); either name reaches the template's own switch",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def run(args: argparse.Namespace) -> int:
    from specserve.engine.llm import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        kw = engine_kwargs(args, default_max_num_seqs=max(len(args.prompt), 1))
        code = headless_node(kw)
        if code is not None:
            return code
        if args.tp > 1:
            from specserve.distributed.tp_llm import TPLLM as LLMClass  # workers, one per GPU/rank
        else:
            LLMClass = LLM
        llm = LLMClass(profile=args.profile, **kw)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.chat:
        tok = llm.tokenizer
        try:
            ids = [
                tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], **args.chat_template_kwargs))
                for p in args.prompt
            ]
        except (ConfigError, ValueError) as e:
            print(f"error: --chat: {e}", file=sys.stderr)
            return 1
        if tok.end_of_turn_id is not None and not args.ignore_eos:
            params.stop_token_ids = [*params.stop_token_ids, tok.end_of_turn_id]
    else:
        ids = llm.encode_prompts(args.prompt)
    limit = llm.engine.max_model_len
    for n, p in enumerate(ids, 1):
        if len(p) >= limit:
            which = f"prompt {n}" if len(ids) > 1 else "the prompt"
            print(
                f"error: {which} has {len(p)} tokens but --max-model-len is {limit} (prompt + output): "
                f"raise --max-model-len or shorten the prompt",
                file=sys.stderr,
            )
            return 1
    t0 = time.perf_counter()
    outs = llm.generate(ids, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    for n, (prompt, o) in enumerate(zip(args.prompt, outs), 1):
        if args.json:
            stats = {
                "tokens": len(o.token_ids),
                "seconds": round(seconds, 6),
                "tok_s": round(len(o.token_ids) / seconds, 3) if seconds else None,
                "finish_reason": o.finish_reason,
                **o.spec,
            }
            if args.profile:
                stats["profile"] = llm.profile_summary()
            print(
                json.dumps(
                    {"text": o.text, "token_ids": o.token_ids, "prompt_token_ids": o.prompt_token_ids, "stats": stats}
                )
            )
        else:
            if len(outs) > 1:  # which completion belongs to which prompt
                shown = prompt if len(prompt) <= 60 else prompt[:57] + "..."
                print(f"{'-' * 8} [{n}/{len(outs)}] {shown!r} {'-' * 8}")
            print(o.text)
        if o.finish_reason == "length" and len(o.token_ids) < args.max_tokens:
            which = f"prompt {n}" if len(outs) > 1 else "output"
            print(
                f"note: {which} stopped after {len(o.token_ids)} of --max-tokens {args.max_tokens} tokens "
                f'(finish reason "length"): prompt + output reached --max-model-len {limit}',
                file=sys.stderr,
            )
    if not args.json:
        line = f"[{tokens} tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s"
        spec = outs[0].spec if outs else {}
        if spec.get("accept_length_mean"):
            line += f", acceptance length {spec['accept_length_mean']:.2f}"
        print(line + "]", file=sys.stderr)
        if args.profile:
            for part, v in llm.profile_summary().items():
                print(
                    f"  {part:7s} mean {v['mean_ms']:.3f} ms  p50 {v['p50_ms']:.3f}  p90 {v['p90_ms']:.3f}",
                    file=sys.stderr,
                )
    return 0
