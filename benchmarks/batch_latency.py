"""Latency of short requests beside long prompts in one batch job: how long a prefill stalls
the rows that are already decoding (issue #52's mixed workload).

    python benchmarks/batch_latency.py [--short 64] [--long 8] [--long-len 1500] [--slots 16]
                                       [--prefill-chunks none,128] [--chunk-modes mixed,separate] [--json]

Model: random weights, d_model 512, 8 layers, 8 heads, vocabulary 32,000, context 2,048
(``specjax.scale.random_models``; random weights, so the n-gram drafter's acceptance is
whatever the model's repetitive greedy output gives). Workload: ``--short`` requests
(prompts of 16 to 48 random tokens, ``--new`` new tokens each) with ``--long`` prompts of
``--long-len`` tokens spread evenly through the stream (every ``short / long``-th request);
greedy, n-gram depth 3, dense cache, ``--slots`` slots, ``refill_rows`` 4. The job runs once
to compile and warm, then once timed. Reported per class of request (short, long): time to
first token and inter-token latency (p50 / p95 / p99 / max: one entry per decode step of
every request; ``specjax.latency``), and for the job: tokens, seconds, tok/s; one row per
``--prefill-chunks`` value and ``--chunk-modes`` mode, in one run (``none``: each long prompt
prefilled whole in its admit; N: in chunks of N tokens, one per decode step; ``mixed``, the
default: each chunk in the step's own forward, ``_chunk_step``; ``separate``: each chunk its
own call before the step, ``specjax.batch.scheduler.MIXED_STEP = False``).

The figure to watch is the short rows' p99 inter-token latency against their median: an
admit of a long prompt runs its whole prefill between two decode steps, and every live row
waits for it; chunked, it waits for one chunk at a time.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _report import write_result


def workload(n_short: int, n_long: int, long_len: int, new: int, vocab: int, seed: int = 0) -> list:
    import specjax

    rng = np.random.default_rng(seed)
    every = max(1, n_short // max(n_long, 1))
    reqs, n_l = [], 0
    for i in range(n_short):
        if n_l < n_long and i % every == 0:
            reqs.append(specjax.Request(rng.integers(0, vocab, long_len).tolist(), id=f"long{n_l}",
                                        max_new_tokens=new))
            n_l += 1
        reqs.append(specjax.Request(rng.integers(0, vocab, int(rng.integers(16, 49))).tolist(), id=f"short{i}",
                                    max_new_tokens=new))
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--long-len", type=int, default=1500)
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prefill-chunks", default="none,128",
                    help="comma-separated prefill_chunk values to compare in one run ('none': whole prompts)")
    ap.add_argument("--chunk-modes", default="mixed",
                    help="comma-separated: 'mixed' (each chunk in a decode step's forward), 'separate' (its own call)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here (e.g. docs/batch_latency.json)")
    args = ap.parse_args()

    import specjax
    from specjax.bench import machine
    from specjax.latency import latency_summary
    from specjax.model import ModelConfig
    from specjax.scale import random_models

    cfg = ModelConfig(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1536,
                      max_seq_len=2048, mtp_depth=0)
    model, _ = random_models(cfg, draft=False)
    reqs = workload(args.short, args.long, args.long_len, args.new, cfg.vocab_size)

    try:
        chunks = [None if x.strip() == "none" else int(x) for x in args.prefill_chunks.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"--prefill-chunks {args.prefill_chunks!r} is invalid: comma-separated ints or 'none'")
    modes = [m.strip() for m in args.chunk_modes.split(",") if m.strip()]
    if not modes or any(m not in ("mixed", "separate") for m in modes):
        sys.exit(f"--chunk-modes {args.chunk_modes!r} is invalid: comma-separated 'mixed' and 'separate'")
    runs = [(c, m) for c in chunks for m in (modes if c is not None else ["whole"])]

    import specjax.batch.scheduler as scheduler

    def run(chunk, mode):
        scheduler.MIXED_STEP = mode == "mixed"
        return list(specjax.batch_generate(model, reqs, slots=args.slots, refill_rows=4, drafter="ngram", depth=3,
                                           max_new_tokens=args.new, prefill_chunk=chunk))

    rows, ref = [], None
    for chunk, mode in runs:
        print(f"prefill_chunk={chunk} {mode}: warm-up (compiles)", file=sys.stderr)
        warm = {c.id: c.tokens for c in run(chunk, mode)}
        ref = ref or warm
        t0 = time.perf_counter()
        out = run(chunk, mode)
        dt = time.perf_counter() - t0
        n_tok = sum(len(c.tokens) for c in out)
        lat = {kind: latency_summary(c for c in out if c.id.startswith(kind)) for kind in ("short", "long")}
        short_itl = lat["short"]["itl_s"]
        rows.append({"prefill_chunk": chunk, "mode": mode, "tokens": n_tok, "seconds": dt, "tok_per_s": n_tok / dt,
                     "same_tokens": {c.id: c.tokens for c in out} == ref == warm, "latency": lat,
                     "short_itl_p99_over_p50": short_itl["p99"] / short_itl["p50"]})
        print(f"prefill_chunk={chunk} {mode}: {n_tok} tokens in {dt:.1f} s = {n_tok / dt:.0f} tok/s", file=sys.stderr)
    result = {
        "machine": machine(),
        "config": {"model": {"d_model": 512, "n_layers": 8, "vocab": 32000, "context": 2048}, "short": args.short,
                   "long": args.long, "long_len": args.long_len, "new": args.new, "slots": args.slots,
                   "refill_rows": 4, "drafter": "ngram", "depth": 3},
        "rows": rows,
    }
    if write_result(result, args.out, args.json):
        return
    print(f"{'chunk':>5} | {'mode':<8} | {'tok/s':>5} | same | {'requests':<8} | {'figure':<22} | "
          f"{'p50':>8} | {'p95':>8} | {'p99':>8} | {'max':>8}")
    for r in rows:
        for kind in ("short", "long"):
            for key, name in (("ttft_s", "time to first token s"), ("itl_s", "inter-token ms")):
                st, scale = r["latency"][kind][key], (1e3 if key == "itl_s" else 1.0)
                cells = " | ".join(f"{st[p] * scale:>8.2f}" for p in ("p50", "p95", "p99", "max"))
                print(f"{str(r['prefill_chunk']):>5} | {r['mode']:<8} | {r['tok_per_s']:>5.0f} | "
                      f"{str(r['same_tokens']):<4} | {kind:<8} | {name:<22} | {cells}")
    for r in rows:
        print(f"prefill_chunk={r['prefill_chunk']} {r['mode']}: short rows' inter-token p99 / p50 "
              f"{r['short_itl_p99_over_p50']:.1f}x, job {r['tok_per_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
