"""Shared prompt prefixes stored once: a batch job whose requests share a long instruction
header, with the prefix cache on and off (issue #52).

    python benchmarks/prefix_cache.py [--requests 512] [--prefix 1000] [--slots 32] [--new 32]
                                      [--json] [--out docs/prefix_cache.json]

Model: random weights, d_model 512, 8 layers, 8 heads, vocabulary 32,000, context 2,048
(``specjax.scale.random_models``). Workload: ``--requests`` requests, each one shared
``--prefix``-token header (random tokens) followed by its own 20 to 200 random tokens,
``--new`` new tokens each; greedy, n-gram depth 3, paged cache (16-token pages, the pool
sized for every slot's full capacity), ``--slots`` slots, ``refill_rows`` slots / 4. Each
configuration runs a small warm-up job first (it compiles the admit and decode shapes the
timed job meets), then the whole job, timed, in one process, side by side.

Reported per configuration: job seconds and tok/s; prompt tokens, those served from cached
pages (hit rate) and the prefill tokens the admits computed (rows x width, padding
included: a prompt is padded to a power of two, a cached prefix's rest to one of its own);
the pool's peak pages held by rows (read at every harvest); and whether every request's
tokens equal the run without the cache. The ratios: throughput with / without, and peak
pages with / without.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _report import write_result


def workload(n: int, prefix: int, new: int, vocab: int, seed: int = 0) -> list:
    import specjax

    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab, prefix).tolist()
    return [specjax.Request(head + rng.integers(0, vocab, int(rng.integers(20, 201))).tolist(), id=i,
                            max_new_tokens=new) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=1000, help="tokens of the header every request shares")
    ap.add_argument("--new", type=int, default=32, help="new tokens per request")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here (e.g. docs/prefix_cache.json)")
    args = ap.parse_args()
    for name in ("requests", "prefix", "new", "slots"):
        if getattr(args, name) < 1:
            sys.exit(f"--{name} {getattr(args, name)} is invalid: must be >= 1")

    import specjax
    import specjax.batch.scheduler as batch_mod
    from specjax.bench import machine
    from specjax.model import ModelConfig
    from specjax.scale import random_models

    cfg = ModelConfig(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1536,
                      max_seq_len=2048, mtp_depth=0)
    if args.prefix + 200 + args.new > cfg.max_seq_len:
        sys.exit(f"--prefix {args.prefix} is invalid: prefix + 200 + new tokens must fit the context of 2048")
    model, _ = random_models(cfg, draft=False)
    reqs = workload(args.requests, args.prefix, args.new, cfg.vocab_size)
    warm = workload(min(args.requests, 2 * args.slots), args.prefix, args.new, cfg.vocab_size, seed=1)

    computed = [0]  # prefill tokens the admits computed (rows x width)
    real_admit = batch_mod.admit

    def counting_admit(eng, c, params, st, idle, rows, prompts, *rest):
        computed[0] += rows.shape[0] * (prompts.shape[1] if c is None else c)
        return real_admit(eng, c, params, st, idle, rows, prompts, *rest)

    batch_mod.admit = counting_admit

    def run(on, requests):
        return list(specjax.batch_generate(model, requests, slots=args.slots, refill_rows=max(1, args.slots // 4),
                                           drafter="ngram", depth=3, cache="paged", max_new_tokens=args.new,
                                           prefix_cache=on))

    rows, ref = [], None
    for on in (False, True):
        name = "prefix cache" if on else "no prefix cache"
        print(f"{name}: warm-up (compiles)", file=sys.stderr)
        run(on, warm)
        computed[0] = 0
        t0 = time.perf_counter()
        out = run(on, reqs)
        dt = time.perf_counter() - t0
        tokens = {c.id: c.tokens for c in out}
        ref = ref or tokens
        n_tok = sum(len(t) for t in tokens.values())
        prompt = sum(c.metrics["prompt_tokens"] for c in out)
        cached = sum(c.metrics["cached_tokens"] for c in out)
        rows.append({"prefix_cache": on, "tokens": n_tok, "seconds": dt, "tok_per_s": n_tok / dt,
                     "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt,
                     "prefill_tokens_computed": computed[0],
                     "peak_pages_in_use": max(c.metrics["pages_in_use"] for c in out),
                     "same_tokens": tokens == ref})
        print(f"{name}: {n_tok} tokens in {dt:.1f} s = {n_tok / dt:.0f} tok/s", file=sys.stderr)
    off, on_ = rows
    result = {
        "machine": machine(),
        "config": {"model": {"d_model": 512, "n_layers": 8, "vocab": 32000, "context": 2048},
                   "requests": args.requests, "prefix": args.prefix, "suffix": [20, 200], "new": args.new,
                   "slots": args.slots, "refill_rows": max(1, args.slots // 4), "drafter": "ngram", "depth": 3,
                   "cache": "paged", "page_size": 16},
        "rows": rows,
        "throughput_ratio": on_["tok_per_s"] / off["tok_per_s"],
        "peak_pages_ratio": on_["peak_pages_in_use"] / off["peak_pages_in_use"],
    }
    if write_result(result, args.out, args.json):
        return
    print(f"{'prefix cache':<12} | {'seconds':>7} | {'tok/s':>6} | {'hit rate':>8} | {'prefill computed':>16} | "
          f"{'peak pages':>10} | same tokens")
    for r in rows:
        print(f"{'on' if r['prefix_cache'] else 'off':<12} | {r['seconds']:>7.1f} | {r['tok_per_s']:>6.1f} | "
              f"{100 * r['hit_rate']:>7.1f}% | {r['prefill_tokens_computed']:>16} | {r['peak_pages_in_use']:>10} | "
              f"{r['same_tokens']}")
    print(f"prefix cache on / off: throughput {result['throughput_ratio']:.2f}x, "
          f"peak pages {result['peak_pages_ratio']:.2f}x")


if __name__ == "__main__":
    main()
