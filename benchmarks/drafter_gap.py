"""Where a drafter's engine acceptance and its training agreement part ways, on the same sequences.

    python benchmarks/drafter_gap.py --model smollm2-135m-instruct --draft DIR --prompts FILE.jsonl
        [--num-prompts 8] [--max-tokens 128] [--steps 4] [--dtype float32] [--json OUT.json]
    python benchmarks/drafter_gap.py ... --turns TURNS.jsonl.gz --trained 24000 --pick heldout|trained

1. The engine answers the prompts greedily with the drafter at K=--steps (chat template, stop at
   the end of turn), and every cycle's base entry and drafted tokens are recorded.
2. The trainer's forward (`ttt_loss`: the target's features, the TTT unroll, response tokens
   only) runs with the same drafter on exactly those sequences (prompt + answer).

It prints both sides' per-position figures, how often the engine's first draft of a cycle is the
trainer's step-0 prediction at that entry (1.0 unless the two disagree on features, positions
or vocabulary), the trainer's agreement at the engine's cycle bases only (the engine skips the
entries after an accepted draft), and step-0 agreement by answer position.

--turns reads `sharegpt_prompts.py` records and picks those a `train-draft --regenerate
--regen-prompts N --seed S` run trained on (--pick trained) or left out (--pick heldout): that
run shuffles every record's prompt with random.Random(S) and keeps the first N.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specserve.config import DraftConfig, ModelConfig, resolve_aux_layers  # noqa: E402
from specserve.train import train_draft as td  # noqa: E402

BUCKETS = (0, 8, 16, 32, 64, 128, 256)  # answer-position buckets of the step-0 agreement
CONFIDENCE = (0.0, 0.3, 0.6, 0.9)  # buckets of the target's top-1 probability at the drafted token


def load_prompts(args) -> list[list[dict]]:
    """Chat message lists: from --prompts, or the --pick share of --turns."""
    if args.turns:
        opener = gzip.open if args.turns.endswith(".gz") else open
        with opener(args.turns, "rt", encoding="utf-8") as f:
            recs = [json.loads(ln)["messages"] for ln in f if ln.strip()]
        order = list(range(len(recs)))
        random.Random(args.seed).shuffle(order)  # as train-draft shuffles its prompt list
        pick = order[:args.trained] if args.pick == "trained" else order[args.trained:]
        return [recs[i] for i in pick[:args.num_prompts]]
    out = []
    for ln in Path(args.prompts).read_text(encoding="utf-8").splitlines():
        if ln.strip():
            out.append(json.loads(ln)["messages"])
    if args.spread:  # MT-Bench lists its 8 categories 10 prompts each: the first ones are all writing
        out = out[::max(1, len(out) // args.num_prompts)]
    return out[:args.num_prompts]


def engine_side(model: str, draft: str, prompts, K: int, max_tokens: int, dtype: str, max_prompt: int):
    """(outputs, cycles): the engine's greedy answers and, per request, {base entry: drafted tokens}."""
    from specserve.engine.llm import LLM, SamplingParams
    from specserve.spec.proposer import Proposer

    cycles: dict[str, dict[int, list[int]]] = {}
    draft_batch = Proposer.draft_batch

    def record(self, seqs, K_, spec_ok, sampling):
        res = draft_batch(self, seqs, K_, spec_ok, sampling)
        for s, ok, toks in zip(seqs, spec_ok, res.tokens.tolist()):
            if ok:
                cycles.setdefault(s.seq_id, {})[s.num_cached - 1] = toks
        return res

    Proposer.draft_batch = record
    try:
        llm = LLM(model=model, draft=draft, spec_steps=K, device="cpu", dtype=dtype, max_num_seqs=len(prompts))
        tok = llm.tokenizer
        # cut as train-draft cuts a regenerated prompt: its last --max-len minus --regen-max-tokens tokens
        reqs = [tok.encode(tok.apply_chat_template(p))[-max_prompt:] for p in prompts]
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=[tok.end_of_turn_id])
        outs = llm.generate(reqs, sp)
        totals = llm.engine.totals
    finally:
        Proposer.draft_batch = draft_batch
    return outs, cycles, totals


def trainer_side(model: str, draft: str, seqs: list[tuple[list[int], int]], K: int, bf16: bool,
                 target_dtype: torch.dtype):
    """Per sequence: (accs, counts, (accepted, bases)) of `ttt_loss`, the step-0 draft per entry
    (target ids), and the target's own greedy next token per entry (x[t+2] predicted at t)."""
    from specserve.model.loader import load_drafter

    ncfg = ModelConfig.from_dir(model)
    captured = resolve_aux_layers(DraftConfig.from_dir(draft), ncfg.num_layers)
    L = max(len(s) for s, _ in seqs) + 1
    tgt = td.FrozenTarget(model, torch.device("cpu"), target_dtype, L, captured)
    dr = load_drafter(draft, tgt.model, torch.device("cpu"), torch.float32, L)
    if dr.embed_tokens is None:
        dr.target_embed = tgt.model.embed_tokens
    ids_of = td.draft_vocab_ids(dr)
    res = []
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad():
        for s, start in seqs:
            ids = torch.tensor([s])
            feats, hidden = tgt(ids)
            _, accs, counts, every, cycles = td.ttt_loss(dr, tgt, ids, torch.tensor([len(s)]), torch.tensor([start]),
                                                         feats.float(), hidden.float(), K, ids_of,
                                                         torch.bfloat16 if bf16 else None)
            with amp:
                outs = td.ttt_forward(dr, feats[:, :-1].float(), ids[:, 1:], K)
                preds = [ids_of[dr.logits(o).argmax(-1)][0].tolist() for o in outs]
            probs = torch.softmax(tgt.logits(hidden[0, 1:]).float(), -1)
            conf, greedy = (x.tolist() for x in probs.max(-1))  # the target's own top-1 probability and token
            in_vocab = dr.t2d[ids[0, start:]].float().mean().item()  # answer tokens the drafter can draft at all
            res.append((accs, counts, every, cycles, preds, greedy, in_vocab, conf))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", help=".jsonl of chat \"messages\" records (e.g. the bench's mt-bench.jsonl)")
    ap.add_argument("--turns", help="sharegpt_prompts.py output (.jsonl.gz), with --trained and --pick")
    ap.add_argument("--trained", type=int, default=24000, help="--regen-prompts of the training run")
    ap.add_argument("--seed", type=int, default=0, help="--seed of the training run")
    ap.add_argument("--pick", choices=("heldout", "trained"), default="heldout")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--spread", action="store_true", help="take --prompts evenly across the file, not the first ones")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="draft length K of the engine and the trainer's unroll")
    ap.add_argument("--max-prompt", type=int, default=768,
                    help="prompt tokens kept, the last ones (the training run's --max-len minus --regen-max-tokens)")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype on the CPU")
    ap.add_argument("--bf16", action="store_true",
                    help="the trainer side as train-draft runs on a GPU: a bf16 target, the drafter in bf16 autocast")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not (args.prompts or args.turns):
        ap.error("pass --prompts FILE or --turns FILE")
    model = args.model
    prompts = load_prompts(args)
    K = args.steps
    outs, cycles, totals = engine_side(model, args.draft, prompts, K, args.max_tokens, args.dtype, args.max_prompt)
    seqs = [(list(o.prompt_token_ids) + list(o.token_ids), len(o.prompt_token_ids)) for o in outs]
    tr = trainer_side(model, args.draft, seqs, K, args.bf16, torch.bfloat16 if args.bf16 else torch.float32)

    hits, n = [0.0] * K, [0] * K
    every_k, every_n, walk_k, walk_n = [0] * K, 0, [0] * K, 0
    same_draft = eng_cycles = eng_hit0 = tr_hit0_at_bases = greedy_same = greedy_n = chain_same = chain_n = 0
    by_pos: dict[int, list[int]] = {}
    by_conf: dict[float, list[int]] = {}
    conf_sum = 0.0
    for o, (s, start), (accs, counts, every, walk, preds, greedy, _, conf) in zip(outs, seqs, tr):
        for k in range(K):
            hits[k] += accs[k] * counts[k]
            n[k] += counts[k]
            every_k[k] += every[0][k]
            walk_k[k] += walk[0][k]
        every_n += every[1]
        walk_n += walk[1]
        for t in range(start - 1, len(s) - 2):  # entries whose next token is an answer token
            nxt = s[t + 2]
            greedy_same += greedy[t] == nxt
            greedy_n += 1
            bucket = max(x for x in BUCKETS if x <= t + 1 - start)
            h = by_pos.setdefault(bucket, [0, 0])
            h[0] += preds[0][t] == nxt
            h[1] += 1
            # how sure the target itself is of the token the drafter must guess
            c = by_conf.setdefault(max(x for x in CONFIDENCE if x <= conf[t]), [0, 0])
            c[0] += preds[0][t] == nxt
            c[1] += 1
            conf_sum += conf[t]
        for base, toks in cycles.get(o.request_id, {}).items():
            if base + 2 >= len(s):
                continue  # the cycle after the last token: nothing to compare with
            eng_cycles += 1
            same_draft += toks[0] == preds[0][base]
            eng_hit0 += toks[0] == s[base + 2]
            tr_hit0_at_bases += preds[0][base] == s[base + 2]
            for k in range(K):  # step k is teacher-forced on the drafted tokens while steps < k hit
                if base + k + 2 >= len(s):
                    break
                chain_n += 1
                chain_same += toks[k] == preds[k][base + k]
                if toks[k] != s[base + k + 2]:
                    break
    fig = {
        "prompts": len(prompts), "answer_tokens": sum(len(o.token_ids) for o in outs), "K": K,
        "engine_tau": round(totals.accept_length, 3),
        "engine_accept_per_position": [round(x, 3) for x in totals.accept_per_position],
        "trainer_step_agreement": [round(h / max(c, 1), 3) for h, c in zip(hits, n)],
        "trainer_tau_all_bases": td.accept_length(every_k, every_n),
        "trainer_accept_per_position_all_bases": [round(a / max(every_n, 1), 3) for a in every_k],
        "trainer_tau_cycles": td.accept_length(walk_k, walk_n),
        "trainer_accept_per_position_cycles": [round(a / max(walk_n, 1), 3) for a in walk_k],
        "cycles_compared": eng_cycles,
        "engine_first_draft_equals_trainer": round(same_draft / max(eng_cycles, 1), 4),
        "engine_chain_equals_trainer": round(chain_same / max(chain_n, 1), 4),
        "engine_pos1_at_bases": round(eng_hit0 / max(eng_cycles, 1), 3),
        "trainer_step0_at_engine_bases": round(tr_hit0_at_bases / max(eng_cycles, 1), 3),
        "target_full_forward_equals_engine_output": round(greedy_same / max(greedy_n, 1), 4),
        "answer_tokens_in_draft_vocab": round(sum(r[6] * len(o.token_ids) for r, o in zip(tr, outs))
                                              / max(sum(len(o.token_ids) for o in outs), 1), 3),
        "engine_tau_per_prompt": [round(o.spec["accept_length_mean"] or 1.0, 2) for o in outs],
        "target_top1_prob_mean": round(conf_sum / max(greedy_n, 1), 3),
        "step0_by_target_top1_prob": {f"{lo}+": [round(h / max(c, 1), 3), c] for lo, (h, c) in sorted(by_conf.items())},
        "step0_by_answer_position": {f"{lo}+": [round(h / max(c, 1), 3), c] for lo, (h, c) in sorted(by_pos.items())},
    }
    print(json.dumps(fig, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1) + "\n")


if __name__ == "__main__":
    main()
