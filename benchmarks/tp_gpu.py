"""Tensor parallelism on 2 GPUs, one command:

    python benchmarks/tp_gpu.py --out $OUT          # on a machine with 2 GPUs (H200 class)

1. builds (once, under /tmp/specserve_tp) an 8B-shaped random bf16 Llama (hidden 4096, 32 layers,
   32 heads, 8 KV heads, MLP 14336, vocab 128256) as sharded safetensors, an EAGLE-3 "oracle"
   drafter for it (taps the target's final hidden state and reuses its norm and head rows, so its
   first draft is right and speculation accepts tokens), and a small float32 pair for exactness;
2. `specserve nccl-tune --tp 2 --hidden 4096` (table in the output, best profile file);
3. correctness: small float32 pair, TP2 vs TP1 with CUDA graphs: plain greedy, speculative greedy
   and seeded speculative sampling must give identical tokens (float32: no near-tie flips);
4. speed: 8B shape, batch 1, decode tok/s for TP1 and TP2, plain and speculative (K = --spec-steps),
   with per-cycle draft/verify ms; the bf16 token agreement TP2 vs TP1 is reported too;
5. if time is left: TP2 with SPECSERVE_ALLREDUCE=torch (torch.distributed inside CUDA graphs, which
   hung in an earlier probe) to show the capture guard: graphs captured, or a warning and eager.

Writes $OUT/tp_gpu.json (everything), $OUT/nccl_tune.txt, $OUT/nccl_profile.json; prints a table.
Every engine runs in its own child process (clean GPU memory between configurations).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("SPECSERVE_TP_WORKDIR", "/tmp/specserve_tp"))
BIG = dict(hidden=4096, layers=32, heads=32, kv_heads=8, mlp=14336, vocab=128256, draft_vocab=32000)
SMALL = dict(hidden=1024, layers=8, heads=16, kv_heads=8, mlp=2816, vocab=32000, draft_vocab=32000)


# ------------------------------------------------------------------ building
def _tokenizer(out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def build_pair(
    out: Path, shape: dict, dtype_name: str, seed: int, device: str = "cuda:0", kind: str = "random"
) -> None:
    """A random Llama (HF names, sharded safetensors + index) and an EAGLE-3 drafter for it.

    kind "random": ordinary random init (std 0.02; the head x8 for decisive logits); every layer
    matters, so TP1 == TP2 token equality (in float32) checks the sharded computation. Its drafter
    "lags": it taps the target's final hidden state at position p (which predicts p+1) where an
    EAGLE-3 head must predict p+2, so drafts are accepted only when the target repeats itself.
    kind "perm": the residual stream is dominated by the token embedding (attention and MLP outputs
    are small but fully computed), and the head maps token t to pi(t) for a random permutation pi of
    the draft vocabulary: greedy text follows pi with a huge logit margin. Its drafter's head maps to
    pi(pi(t)), so its first draft of every cycle is right (acceptance length ~2, like a real
    drafter's order of magnitude). Speed does not depend on the weights' values.
    """
    import torch
    from safetensors.torch import save_file

    if (out / "target" / "DONE").exists() and (out / "draft" / "DONE").exists():
        return
    dtype = getattr(torch, dtype_name)
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    H, L, V, Vd = shape["hidden"], shape["layers"], shape["vocab"], shape["draft_vocab"]
    heads, kv, mlp = shape["heads"], shape["kv_heads"], shape["mlp"]
    hd = H // heads
    perm = kind == "perm"

    def rnd(*s, std=0.02):
        return (torch.randn(*s, generator=g, device=dev, dtype=torch.float32) * std).to(dtype)

    tdir, ddir = out / "target", out / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    ddir.mkdir(parents=True, exist_ok=True)
    embed = rnd(V, H, std=1.0 if perm else 0.02)
    if perm:
        pi = torch.randperm(Vd, generator=g, device=dev)
        head = rnd(V, H)
        head[pi] = embed[:Vd] * 0.01  # row pi(i) = embedding of i: argmax(head . norm(E[t])) = pi(t)
        draft_head = torch.empty(Vd, H, dtype=dtype, device=dev)
        draft_head[pi[pi]] = embed[:Vd] * 0.01  # two steps ahead
    else:
        head = rnd(V, H, std=0.16)
        head[Vd:] *= 0.25  # frequent tokens first (like real vocabularies)
        draft_head = head[:Vd].clone()
    out_std = 0.0005 if perm else 0.02  # o_proj / down_proj: how much each layer writes to the residual
    weight_map, shard, n_shards = {}, {}, 4

    def flush(i: int) -> None:
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in shard.items()}, str(tdir / name))
        weight_map.update({k: name for k in shard})
        shard.clear()

    shard["model.embed_tokens.weight"] = embed
    per = -(-L // n_shards)
    for i in range(L):
        p = f"model.layers.{i}."
        shard.update(
            {
                p + "self_attn.q_proj.weight": rnd(heads * hd, H),
                p + "self_attn.k_proj.weight": rnd(kv * hd, H),
                p + "self_attn.v_proj.weight": rnd(kv * hd, H),
                p + "self_attn.o_proj.weight": rnd(H, heads * hd, std=out_std),
                p + "mlp.gate_proj.weight": rnd(mlp, H),
                p + "mlp.up_proj.weight": rnd(mlp, H),
                p + "mlp.down_proj.weight": rnd(H, mlp, std=out_std),
                p + "input_layernorm.weight": torch.ones(H, dtype=dtype, device=dev),
                p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype, device=dev),
            }
        )
        if (i + 1) % per == 0 or i == L - 1:
            if i == L - 1:
                shard["model.norm.weight"] = torch.ones(H, dtype=dtype, device=dev)
                shard["lm_head.weight"] = head
            flush(i // per)
    (tdir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": mlp,
        "num_hidden_layers": L,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": V,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "eos_token_id": V - 1,
        "bos_token_id": None,
        "torch_dtype": dtype_name,
        "hidden_act": "silu",
    }
    (tdir / "config.json").write_text(json.dumps(cfg, indent=1))
    _tokenizer(tdir, V)
    # Drafter: fc picks the final hidden state (3 taps of it), attention/MLP outputs are zero, so the
    # output is that hidden state; the target's norm, and the head chosen above (d2t = 0: first Vd ids).
    t = {
        "fc.weight": torch.cat([torch.eye(H, device=dev), torch.zeros(H, 2 * H, device=dev)], 1).to(dtype),
        "midlayer.input_layernorm.weight": torch.ones(H, dtype=dtype, device=dev),
        "midlayer.hidden_norm.weight": torch.ones(H, dtype=dtype, device=dev),
        "midlayer.post_attention_layernorm.weight": torch.ones(H, dtype=dtype, device=dev),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": torch.zeros(H, heads * hd, dtype=dtype, device=dev),
        "midlayer.mlp.gate_proj.weight": rnd(mlp, H),
        "midlayer.mlp.up_proj.weight": rnd(mlp, H),
        "midlayer.mlp.down_proj.weight": torch.zeros(H, mlp, dtype=dtype, device=dev),
        "norm.weight": torch.ones(H, dtype=dtype, device=dev),
        "lm_head.weight": draft_head,
        "d2t": torch.zeros(Vd, dtype=torch.long, device=dev),
    }
    t2d = torch.zeros(V, dtype=torch.bool, device=dev)
    t2d[:Vd] = True
    t["t2d"] = t2d
    save_file({k: v.cpu().contiguous() for k, v in t.items()}, str(ddir / "model.safetensors"))
    dcfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "hidden_size": H,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": mlp,
        "rms_norm_eps": 1e-5,
        "vocab_size": V,
        "draft_vocab_size": Vd,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "torch_dtype": dtype_name,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [L - 1] * 3},
    }
    (ddir / "config.json").write_text(json.dumps(dcfg, indent=1))
    (tdir / "DONE").write_text("ok")
    (ddir / "DONE").write_text("ok")


# ------------------------------------------------------------------ one engine (child process)
def child_run(spec: dict) -> dict:
    """Load one configuration, run the requested generations, return numbers and tokens."""
    from specserve.engine.llm import LLM, SamplingParams

    kw = dict(
        model=spec["model"],
        draft=spec.get("draft"),
        spec_steps=spec["K"],
        max_spec_steps=spec["K"],
        device=spec.get("device", "cuda"),
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_model_len=spec["max_model_len"],
        graph_batch_sizes=tuple(spec["graph_batch_sizes"]),
        graph_capture_timeout=spec.get("capture_timeout", 120),
    )
    t0 = time.perf_counter()
    if spec["tp"] == 1:
        llm = LLM(**kw)
        set_profile = lambda on: setattr(llm.engine.cfg, "profile", on)  # noqa: E731
        info = {"graphs": len(llm.engine.runner.graphs), "allreduce": None}
    else:
        from specserve.distributed.tp_llm import TPLLM

        llm = TPLLM(tp=spec["tp"], env=spec.get("env") or {}, nccl_profile=spec.get("nccl_profile"), **kw)
        set_profile = llm.set_profile
        info = dict(llm.info, warnings=llm.warnings, worker_env=llm.worker_env())
    res = {"load_s": round(time.perf_counter() - t0, 2), "info": info}

    def params(p):
        return SamplingParams(
            max_tokens=p["max_tokens"],
            temperature=p.get("temperature", 0.0),
            top_p=p.get("top_p", 1.0),
            seed=p.get("seed"),
            ignore_eos=True,
        )

    res["checks"] = {}
    for name, job in (spec.get("checks") or {}).items():
        outs = llm.generate(job["prompts"], [params(p) for p in job["params"]])
        res["checks"][name] = {
            "tokens": [o.token_ids for o in outs],
            "accept_length": [o.spec.get("accept_length_mean") for o in outs],
        }
    if spec.get("speed"):
        sp = spec["speed"]
        llm.generate([sp["prompt"]], params({"max_tokens": 16}))  # warm-up
        runs = []
        for _ in range(sp["repeats"]):
            t = time.perf_counter()
            o = llm.generate([sp["prompt"]], params({"max_tokens": sp["max_tokens"]}))[0]
            wall = time.perf_counter() - t
            runs.append(
                {
                    "tokens": len(o.token_ids),
                    "wall_s": wall,
                    "tok_s": len(o.token_ids) / wall,
                    "decode_tok_s": (len(o.token_ids) - 1) / (o.latency_s - o.ttft_s),
                    "accept_length": o.spec.get("accept_length_mean"),
                    "token_ids": o.token_ids,
                }
            )
        best = max(runs, key=lambda r: r["decode_tok_s"])
        res["speed"] = {
            "decode_tok_s": round(best["decode_tok_s"], 2),
            "tok_s": round(best["tok_s"], 2),
            "all_decode_tok_s": [round(r["decode_tok_s"], 2) for r in runs],
            "accept_length": best["accept_length"],
            "token_ids": best["token_ids"],
        }
        if spec["K"]:
            set_profile(True)
            llm.generate([sp["prompt"]], params({"max_tokens": 64}))
            res["speed"]["profile_ms"] = llm.profile_summary()
            set_profile(False)
    if hasattr(llm, "close"):
        llm.close()
    return res


def run_child(spec: dict, timeout: float, log) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        log(f"   child failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
        return {"error": p.stderr[-4000:], "rc": p.returncode}
    out = json.loads(lines[-1][len("RESULT ") :])
    out["child_s"] = round(time.time() - t0, 1)
    out["log_tail"] = "\n".join(ln for ln in p.stderr.splitlines() if "[tp]" in ln or "warning" in ln.lower())[-3000:]
    return out


# ------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "tp_gpu_out"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--spec-steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=360, help="skip the optional guard demo past this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU (gloo): checks this script, not speed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, str(ROOT))
        print("RESULT " + json.dumps(child_run(json.loads(args.child))), flush=True)
        return 0

    t_start = time.time()
    device, big_shape, small_shape, work = "cuda", BIG, SMALL, WORK
    if args.cpu_smoke:
        device, work = "cpu", WORK.with_name(WORK.name + "_cpu_smoke")
        big_shape = dict(hidden=256, layers=4, heads=4, kv_heads=2, mlp=512, vocab=4096, draft_vocab=1024)
        small_shape = dict(hidden=64, layers=4, heads=4, kv_heads=2, mlp=128, vocab=4096, draft_vocab=4096)
        args.max_tokens = 16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape_8b": big_shape,
        "small": small_shape,
        "device": device,
    }

    def log(s: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {s}", flush=True)

    def save() -> None:
        (out / "tp_gpu.json").write_text(json.dumps(report, indent=1))

    # 1. models
    log("building models (cached under %s)" % work)
    b = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, json; sys.path.insert(0, sys.argv[1]); import tp_gpu as t; "
            "from pathlib import Path; a = json.loads(sys.argv[2]); "
            "t.build_pair(Path(a['work']) / 'small', a['small'], 'float32', 1, a['dev']); "
            "t.build_pair(Path(a['work']) / 'big', a['big'], a['big_dtype'], 2, a['dev'], 'perm')",
            str(Path(__file__).parent),
            json.dumps(
                {
                    "work": str(work),
                    "small": small_shape,
                    "big": big_shape,
                    "dev": "cuda:0" if device == "cuda" else "cpu",
                    "big_dtype": "bfloat16" if device == "cuda" else "float32",
                }
            ),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if b.returncode != 0:
        print(b.stderr[-3000:])
        report["error"] = "build failed: " + b.stderr[-3000:]
        save()
        return 1
    report["build_s"] = round(time.time() - t_start, 1)
    small, big = work / "small", work / "big"

    # 2. nccl-tune
    log("nccl-tune --tp 2 --hidden 4096")
    prof_path = out / "nccl_profile.json"
    t = subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "nccl-tune",
            "--tp",
            "2",
            "--device",
            device,
            "--hidden",
            str(big_shape["hidden"]),
            "--tokens",
            "1",
            "2",
            "4",
            "8",
            "16",
            "32",
            "64",
            "--runs",
            "5",
            "--graph-timeout",
            "30",
            "--out",
            str(prof_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    table = "\n".join(ln for ln in t.stdout.splitlines() if not ln.startswith("{"))
    (out / "nccl_tune.txt").write_text(table + "\n\n" + t.stderr[-5000:])
    print(table, flush=True)
    js = [ln for ln in t.stdout.splitlines() if ln.startswith("{")]
    report["nccl_tune"] = json.loads(js[-1]) if js else {"error": t.stderr[-3000:], "rc": t.returncode}
    profile = str(prof_path) if t.returncode == 0 and prof_path.exists() else "default"
    report["tp2_profile"] = profile
    save()

    # 3. exactness (float32)
    K = args.spec_steps
    prompts = [[(97 * i + 13 * j) % (small_shape["vocab"] - 100) + 5 for j in range(12 + 5 * i)] for i in range(3)]
    checks = {
        "plain_like_greedy": {"prompts": prompts, "params": [{"max_tokens": 48}] * 3},
        "sampled_seeded": {
            "prompts": prompts,
            "params": [{"max_tokens": 48, "temperature": 0.8, "top_p": 0.95, "seed": 100 + i} for i in range(3)],
        },
    }
    base_small = dict(
        model=str(small / "target"),
        draft=str(small / "draft"),
        K=K,
        dtype="float32",
        max_num_seqs=4,
        device=device,
        max_model_len=256,
        graph_batch_sizes=[1, 2, 4],
        checks=checks,
    )
    nodraft_small = dict(base_small, draft=None, K=0, checks={"greedy": checks["plain_like_greedy"]})
    exact = {}
    for name, spec in (("spec", base_small), ("plain", nodraft_small)):
        log(f"exactness float32 {name}: TP1")
        r1 = run_child(dict(spec, tp=1), 300, log)
        log(f"exactness float32 {name}: TP2")
        r2 = run_child(dict(spec, tp=2, nccl_profile=profile), 300, log)
        same = {
            k: (
                r1.get("checks", {}).get(k, {}).get("tokens") == r2.get("checks", {}).get(k, {}).get("tokens")
                and "error" not in r1
                and "error" not in r2
            )
            for k in spec["checks"]
        }
        exact[name] = {
            "identical": same,
            "tp2_info": r2.get("info"),
            "accept_length": r2.get("checks", {}),
            "errors": [r.get("error") for r in (r1, r2) if r.get("error")],
        }
        for k in exact[name]["accept_length"].values():
            k.pop("tokens", None)
        log(f"   identical: {same}")
    report["exactness_fp32"] = exact
    save()

    # 4. speed, 8B shape, batch 1
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(5, big_shape["draft_vocab"]) for _ in range(32)]
    speed_base = dict(
        model=str(big / "target"),
        dtype="bfloat16" if device == "cuda" else "float32",
        device=device,
        max_num_seqs=1,
        max_model_len=512,
        graph_batch_sizes=[1],
        speed={"prompt": prompt, "max_tokens": args.max_tokens, "repeats": 3},
    )
    runs = {}
    for mode, extra in (("plain", dict(draft=None, K=0)), ("spec", dict(draft=str(big / "draft"), K=K))):
        for tp in (1, 2):
            name = f"tp{tp}_{mode}"
            log(f"speed 8B {name}")
            spec = dict(speed_base, tp=tp, capture_timeout=60, **extra)
            if tp == 2:
                spec["nccl_profile"] = profile
            runs[name] = run_child(spec, 420, log)
            s = runs[name].get("speed", {})
            log(
                f"   {s.get('decode_tok_s')} tok/s decode (runs {s.get('all_decode_tok_s')}), accept length "
                f"{s.get('accept_length')}, load {runs[name].get('load_s')} s"
            )
            report["speed_8b"] = runs
            save()
    summary = {}
    for mode in ("plain", "spec"):
        a, b2 = runs[f"tp1_{mode}"].get("speed"), runs[f"tp2_{mode}"].get("speed")
        if a and b2:
            ids1, ids2 = a["token_ids"], b2["token_ids"]
            agree = next((i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y), min(len(ids1), len(ids2)))
            summary[mode] = {
                "tp1_tok_s": a["decode_tok_s"],
                "tp2_tok_s": b2["decode_tok_s"],
                "speedup": round(b2["decode_tok_s"] / a["decode_tok_s"], 3),
                "bf16_tokens_agree_until": agree,
                "of": len(ids1),
                "accept_length_tp1": a["accept_length"],
                "accept_length_tp2": b2["accept_length"],
                "profile_ms_tp1": a.get("profile_ms"),
                "profile_ms_tp2": b2.get("profile_ms"),
            }
    report["summary"] = summary
    for r in runs.values():
        r.get("speed", {}).pop("token_ids", None)
    save()

    # 5. the capture guard with torch.distributed collectives (optional: needs time)
    if time.time() - t_start < args.budget_s:
        log("guard demo: TP2 plain with SPECSERVE_ALLREDUCE=torch, capture timeout 40 s")
        spec = dict(
            speed_base,
            tp=2,
            draft=None,
            K=0,
            env={"SPECSERVE_ALLREDUCE": "torch"},
            capture_timeout=40,
            speed={"prompt": prompt, "max_tokens": 64, "repeats": 1},
        )
        g = run_child(spec, 300, log)
        report["guard_torch_allreduce"] = {
            "load_s": g.get("load_s"),
            "info": g.get("info"),
            "error": g.get("error"),
            "decode_tok_s": g.get("speed", {}).get("decode_tok_s"),
            "log_tail": g.get("log_tail"),
        }
    else:
        report["guard_torch_allreduce"] = "skipped (time budget)"
    report["total_s"] = round(time.time() - t_start, 1)
    save()

    print("\n== TP2 vs TP1, 8B shape (bf16), batch 1, decode tok/s ==")
    print(f"{'mode':6s} {'TP1':>8s} {'TP2':>8s} {'speedup':>8s}  accept(TP1/TP2)  bf16 tokens agree")
    for mode, s in summary.items():
        print(
            f"{mode:6s} {s['tp1_tok_s']:8.1f} {s['tp2_tok_s']:8.1f} {s['speedup']:7.2f}x  "
            f"{s['accept_length_tp1'] or '-'}/{s['accept_length_tp2'] or '-'}  {s['bf16_tokens_agree_until']}/{s['of']}"
        )
    print(f"float32 exactness TP2 == TP1: {json.dumps({k: v['identical'] for k, v in exact.items()})}")
    print(
        f"TP2 profile: {profile}; TP2 start-up info: {json.dumps(runs.get('tp2_plain', {}).get('info', {}), default=str)[:600]}"
    )
    print(f"guard demo: {json.dumps(report['guard_torch_allreduce'], default=str)[:800]}")
    print(f"total {report['total_s']} s; wrote {out / 'tp_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
