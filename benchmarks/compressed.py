"""Compressed-memory layers: tokens per step under both rules, and decode cost vs live length.

    python benchmarks/compressed.py [--json] [--out docs/compressed.json] [--quick]

1. **Tokens per step** (``tok_per_step``: emitted tokens per row per step) of a random model
   whose layers 0 and 2 are compressed (window 8, block 4; layer 1 sliding window, layer 3
   global), greedy, depth 3, at B in {1, 8, 64}: ``draft_model`` (the target with 30% weight
   noise) and ``ngram``, per_sequence and cohort, real runs side by side with
   ``specjax.sim.simulate`` driven by the acceptance measured in the same configuration's
   per_sequence run (iid per position: it has no row heterogeneity, so it understates the
   cohort loss the real rows show).
2. **Decode step cost vs live length**: the same weights (d_model 128, 4 layers, 4 heads) with
   every layer compressed (window 64, block 16), every layer sliding-window (window 64) and
   every layer global (dense cache), B=2, prompts of L in {256, 1024, 4096} tokens, one jitted
   plain decode step timed (median of ``--steps`` steps after a warm-up) at that live length.
   A global layer reads ``L`` keys per query; a compressed one ``capacity / 16 + 64 + 16 +
   2 * slack + 1``; a sliding one its ring, ``64 + slack`` (the prompt is a bounded wide write,
   so it no longer sizes the ring).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax.engine as eng_mod
from specjax.advance import KvAdvance
from specjax.generation import generate
from specjax.model import ModelConfig, init_model
from specjax.sim import PositionDecay, simulate

SPEC = ModelConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256,
                   tie_embeddings=False, sliding_window=8, global_every=4, compressed_layers=(0, 2),
                   compress_window=8, compress_block=4)
COST = ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=8192)


def _sharp(cfg: ModelConfig, seed: int):
    """A random model with peaked logits (not near-uniform), as the engine tests use."""
    m = init_model(cfg, seed=seed)
    p = dict(m.params, embed=m.params["embed"] * 3.0, lm_head=m.params["lm_head"] * 40.0)
    return m.replace(params=p)


def _noisy(model, scale: float, seed: int = 5):
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [x + scale * x.std() * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return model.replace(params=jax.tree.unflatten(tree, out))


def _prompts(batch: int, seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(batch):
        p = rng.integers(0, vocab, int(rng.integers(8, 33))).tolist()
        out.append((p[:4] * 9)[: len(p)] if i % 2 == 0 else p)  # half repetitive: n-gram finds them
    return out


def tokens_per_step(batches: tuple[int, ...], new: int) -> list[dict]:
    model = _sharp(SPEC, seed=2)
    draft = _noisy(model, 0.3)
    rows = []
    for b in batches:
        prompts = _prompts(b, seed=b, vocab=SPEC.vocab_size)
        for drafter in ("draft_model", "ngram"):
            runs = {rule: generate(model, prompts, max_new_tokens=new, drafter=drafter, draft_model=draft, depth=3,
                                   kv_advance=rule) for rule in ("per_sequence", "cohort")}
            assert runs["per_sequence"].tokens == runs["cohort"].tokens  # same tokens, different step counts
            acc = runs["per_sequence"].metrics["acceptance_per_position"]
            p0 = max(acc[0], 1e-6)
            decay = min([acc[k] / acc[k - 1] for k in range(1, 3) if acc[k - 1] > 0] or [1.0])
            fit = PositionDecay(min(p0, 1.0), max(min(decay, 1.0), 0.0))
            steps = max(int(np.mean(runs["per_sequence"].metrics["row_steps"])), 1)
            for rule, res in runs.items():
                sim = simulate(b, 3, steps, fit, rule)
                rows.append({"batch": b, "drafter": drafter, "rule": rule,
                             "tok_per_step": res.metrics["tok_per_step"], "sim_tok_per_step": sim.tok_per_step,
                             "acceptance_per_position": acc})
    return rows


def _step_time(model, live: int, steps: int) -> tuple[float, int]:
    """Median seconds of one jitted plain decode step at ``live`` tokens per row (B=2)."""
    b = 2
    cap = eng_mod.request_capacity(live, steps + 4, 0)
    eng = eng_mod.make_engine(model, drafter=None, draft_model=None, depth=1, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                              cache="dense", capacity=cap)
    params = {"target": model.params}
    prompts = np.random.default_rng(live).integers(0, model.config.vocab_size, (b, live)).astype(np.int32)
    plen = jnp.full((b,), live, jnp.int32)
    st = eng_mod.prefill(eng, params, prompts, plen, plen + steps + 4, jnp.full((b,), -1, jnp.int32),
                         jnp.zeros((b,), jnp.uint32))
    st = jax.block_until_ready(eng_mod.step(eng, params, st))  # compile
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        st = jax.block_until_ready(eng_mod.step(eng, params, st))
        times.append(time.perf_counter() - t0)
    assert not np.asarray(st.cache.status).any()
    return float(np.median(times)), cap


def step_cost(lives: tuple[int, ...], steps: int) -> list[dict]:
    plain = init_model(COST, seed=0)
    comp_cfg = dataclasses.replace(COST, compressed_layers=(0, 1, 2, 3), compress_window=64, compress_block=16)
    comp = plain.replace(config=comp_cfg)  # the same weights: compression adds no parameter
    slide = plain.replace(config=dataclasses.replace(COST, sliding_window=64))
    rows = []
    for live in lives:
        t_glob, cap = _step_time(plain, live, steps)
        t_comp, _ = _step_time(comp, live, steps)
        t_slide, _ = _step_time(slide, live, steps)
        rows.append({"live": live, "capacity": cap, "global_ms": 1e3 * t_glob, "compressed_ms": 1e3 * t_comp,
                     "sliding_ms": 1e3 * t_slide, "compressed_vs_global": t_comp / t_glob,
                     "sliding_vs_global": t_slide / t_glob})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="also write the JSON here")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--cost-only", action="store_true", help="only the step-cost table")
    args = ap.parse_args()
    batches, lives, new, steps = ((1, 8), (128, 512), 24, 5) if args.quick else ((1, 8, 64), (256, 1024, 4096), 64, 15)
    out = {"backend": jax.default_backend(), "tok_per_step": [] if args.cost_only else tokens_per_step(batches, new),
           "step_cost": step_cost(lives, steps)}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"backend {out['backend']}; tokens per step (depth 3, greedy, {new} new tokens)")
    print("| B | drafter | per_sequence | cohort | per_seq / cohort | sim per_sequence | sim cohort |")
    print("|---|---|---|---|---|---|---|")
    rows = out["tok_per_step"]
    for r in rows:
        if r["rule"] != "per_sequence":
            continue
        c = next(x for x in rows if x["batch"] == r["batch"] and x["drafter"] == r["drafter"] and x["rule"] == "cohort")
        print(f"| {r['batch']} | {r['drafter']} | {r['tok_per_step']:.2f} | {c['tok_per_step']:.2f} | "
              f"{r['tok_per_step'] / c['tok_per_step']:.2f}x | {r['sim_tok_per_step']:.2f} | "
              f"{c['sim_tok_per_step']:.2f} |")
    print("\ndecode step (B=2, plain greedy) vs live length: every layer compressed (window 64, block 16), "
          "every layer sliding (window 64), every layer global")
    print("| live tokens | cache slots | global ms | compressed ms | sliding ms | compressed / global | "
          "sliding / global |\n|---|---|---|---|---|---|---|")
    for r in out["step_cost"]:
        print(f"| {r['live']} | {r['capacity']} | {r['global_ms']:.2f} | {r['compressed_ms']:.2f} | "
              f"{r['sliding_ms']:.2f} | {r['compressed_vs_global']:.2f}x | {r['sliding_vs_global']:.2f}x |")


if __name__ == "__main__":
    main()
