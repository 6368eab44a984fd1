"""Plain vs cohort vs per-sequence speculative decoding on a random small model (CPU).

    python benchmarks/engine.py [--json] [--batches 1 8 64] [--new-tokens 64]

One run, side by side: for each batch size, plain decoding (drafter none) and the
n-gram and draft-model drafters under both KV advance rules, depth 3. Reports tok/step
(emitted tokens per row per decode step), mean accepted drafts, and wall tokens/s
measured on a second call (after compile). The model is random (sharpened so it
loops, which gives the n-gram drafter real matches); the draft model is the target
with weight noise, the same size, so its rows show acceptance, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import numpy as np
from tqdm import tqdm

from specjax import ModelConfig, generate, init_model

CFG = ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=160,
                  tie_embeddings=False)


def _models():
    m = init_model(CFG, seed=0)
    p = dict(m.params)
    p["embed"], p["lm_head"] = p["embed"] * 3.0, p["lm_head"] * 40.0
    target = m.replace(params=p)
    leaves, tree = jax.tree.flatten(target.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    draft = target.replace(params=jax.tree.unflatten(
        tree, [x + 0.3 * x.std() * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]))
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    target, draft = _models()
    rng = np.random.default_rng(0)
    prompts_all = [rng.integers(0, CFG.vocab_size, int(rng.integers(8, 33))).tolist() for _ in range(max(args.batches))]
    combos = [(None, "per_sequence")] + [(d, r) for d in ("ngram", "draft_model") for r in ("cohort", "per_sequence")]
    rows = []
    jobs = [(b, d, r) for b in args.batches for d, r in combos]
    for b, drafter, rule in tqdm(jobs, desc="bench", disable=args.json, file=sys.stderr):
        prompts = prompts_all[:b]
        kw = dict(max_new_tokens=args.new_tokens, drafter=drafter, draft_model=draft, depth=3, kv_advance=rule)
        generate(target, prompts, **kw)  # compile
        t0 = time.perf_counter()
        res = generate(target, prompts, **kw)
        dt = time.perf_counter() - t0
        n_tok = sum(len(t) for t in res.tokens)
        rows.append({"batch": b, "drafter": drafter or "none", "kv_advance": rule if drafter else "-",
                     "tok_per_step": res.metrics["tok_per_step"],
                     "mean_accepted_drafts": res.metrics["mean_accepted_drafts"],
                     "tok_per_s": n_tok / dt, "seconds": dt})
    for r in rows:
        plain = next(x for x in rows if x["batch"] == r["batch"] and x["drafter"] == "none")
        r["speedup_vs_plain"] = r["tok_per_s"] / plain["tok_per_s"]
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
               "backend": jax.default_backend()}
    if args.json:
        print(json.dumps({"machine": machine, "model": CFG.to_dict(), "rows": rows}))
        return
    print(f"machine: {machine}; random model d={CFG.d_model} layers={CFG.n_layers} V={CFG.vocab_size}, depth 3, "
          f"{args.new_tokens} new tokens")
    print(f"{'B':>3} | {'drafter':<11} | {'rule':<12} | {'tok/step':>8} | {'acc drafts':>10} | {'tok/s':>8} | "
          f"{'vs plain':>8}")
    for r in rows:
        print(f"{r['batch']:>3} | {r['drafter']:<11} | {r['kv_advance']:<12} | {r['tok_per_step']:>8.3f} | "
              f"{r['mean_accepted_drafts']:>10.3f} | {r['tok_per_s']:>8.1f} | {r['speedup_vs_plain']:>8.2f}")


if __name__ == "__main__":
    main()
