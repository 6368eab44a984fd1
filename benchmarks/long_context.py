"""Decode cost vs the model's declared context: the same random weights declared at
``max_seq_len`` 512 and 8192 (d_model 128, 4 layers, B=8, 200-token prompts, 64 new
tokens, plain greedy decoding), in one run.

    python benchmarks/long_context.py [--json] [--repeats 3] [--attention xla]

``request`` rows are ``specjax.generate`` (caches sized from the request:
``request_capacity``). ``declared`` rows run the same jitted loop with caches sized from
``max_seq_len`` (what the engine did before), for comparison. Times exclude compilation
(each configuration runs once to compile, then the best of ``--repeats`` timed runs).
Target: request-sized decode at 8192 within 1.3x of 512.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.advance import KvAdvance
from specjax.engine import make_engine, prompt_bucket, request_capacity
from specjax.generation import compiled_loop, generate
from specjax.model import ModelConfig, init_model
from specjax.sampling import RowSampling

B, PROMPT, NEW = 8, 200, 64


def _declared(model, prompts, impl):
    """The compiled generate loop with caches of ``max_seq_len`` slots (the old sizing)."""
    cfg = model.config
    eng = make_engine(model, drafter=None, draft_model=None, depth=3, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="dense", greedy=True, capacity=request_capacity(0, cfg.max_seq_len, 0), attention_impl=impl)
    toks = jnp.asarray(np.array(prompts, np.int32))
    plen = jnp.full((B,), PROMPT, jnp.int32)
    params = {"target": model.params}
    args = (toks, plen, plen + NEW, jnp.full((B, 1), -1, jnp.int32), jnp.arange(B, dtype=jnp.uint32),
            RowSampling.rows([0.0] * B, [None] * B, [None] * B), None, jnp.int32(eng.max_steps))
    run, _ = compiled_loop(eng, params, args)
    return lambda: jax.block_until_ready(run(params, *args).seq), eng.capacity


def _request(model, prompts, impl):
    def run():
        return generate(model, prompts, max_new_tokens=NEW, drafter=None, attention_impl=impl)

    cap = request_capacity(prompt_bucket(prompts), NEW, 0)
    return run, cap


def _time(fn, repeats: int) -> float:
    fn()  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention", default="xla", choices=["xla", "pallas", "auto"])
    args = ap.parse_args()
    base = ModelConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=512)
    model = init_model(base, seed=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 256, (B, PROMPT)).tolist()
    rows = []
    for sizing, make in (("request", _request), ("declared", _declared)):
        for ctx in (512, 8192):
            m = model.replace(config=dataclasses.replace(base, max_seq_len=ctx))
            fn, cap = make(m, prompts, args.attention)
            rows.append({"sizing": sizing, "max_seq_len": ctx, "capacity": cap, "seconds": _time(fn, args.repeats)})
    for r in rows:
        ref = next(x for x in rows if x["sizing"] == r["sizing"] and x["max_seq_len"] == 512)
        r["vs_512"] = r["seconds"] / ref["seconds"]
    out = {"backend": jax.default_backend(), "attention": args.attention, "batch": B, "prompt": PROMPT,
           "new_tokens": NEW, "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"backend {out['backend']}, attention {args.attention}, B={B}, {PROMPT}-token prompts, {NEW} new tokens")
    print("| cache sizing | max_seq_len | cache slots/row | decode s | vs 512 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sizing']} | {r['max_seq_len']} | {r['capacity']} | {r['seconds']:.3f} | {r['vs_512']:.2f}x |")


if __name__ == "__main__":
    main()
