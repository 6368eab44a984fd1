"""Batch jobs: continuous batching (``batch_generate``, slot refill) vs static batches
(``generate`` per chunk of ``slots`` requests), both KV advance rules, one run.

    python benchmarks/batch_jobs.py [--requests 512] [--slots 32] [--drafter mtp] [--json]

Workload: ``--requests`` requests cycling through the fixed held-out bench prompts (each cut
to its first 32 tokens, so that 32 + 224 fits the bundle's 256-token context), each with its
own ``max_new_tokens`` from a fixed seeded long-tailed mix (log-normal, median 40, clipped to
[16, 224]); greedy, EOS stops a row. Static batches pass each request's own budget
(``generate(max_new_tokens=[...])``), so a row stops at its budget, but the batch waits for
its slowest row. Every configuration runs once to compile and warm, then once timed.
tok/s counts the tokens the requests received over wall time; ``same_tokens`` checks that
every request got the same tokens in every configuration (greedy: it must). Continuous rows
also give the requests' latency (``specjax.latency``): time to first token (every request
arrives at the job's start, so it includes the queue) and inter-token latency, p50 / p99.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from _report import write_result


def workload(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    from specjax.bench import bench_prompts

    prompts = bench_prompts()
    rng = np.random.default_rng(seed)
    news = np.clip(np.round(rng.lognormal(np.log(40), 0.8, n)), 16, 224).astype(int).tolist()
    return [prompts[i % len(prompts)] for i in range(n)], news


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--drafter", default="mtp", choices=["mtp", "draft_model", "ngram"])
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--refill-rows", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here (e.g. docs/batch_jobs.json)")
    args = ap.parse_args()

    import specjax
    from specjax.bench import machine
    from specjax.latency import latency_summary

    bundle = specjax.load_model()
    texts, news = workload(args.requests)
    tokens = [bundle.tokenizer.encode(t, bos=True)[:32] for t in texts]
    eos = bundle.tokenizer.eos_id
    common = dict(drafter=args.drafter, depth=args.depth, eos_id=eos,
                  draft_model=bundle.draft_model if args.drafter == "draft_model" else None)

    def continuous(rule):
        reqs = [specjax.Request(prompt=t, id=i, max_new_tokens=n) for i, t, n in zip(range(len(news)), tokens, news,
                                                                                          strict=True)]
        out = {c.id: c for c in specjax.batch_generate(bundle.model, reqs, slots=args.slots, kv_advance=rule,
                                                        refill_rows=args.refill_rows, **common)}
        steps = sum(c.metrics["steps"] for c in out.values())
        return [out[i].tokens for i in range(len(reqs))], steps, latency_summary(out.values())

    def static(rule):
        toks, steps = [], 0
        for lo in range(0, len(tokens), args.slots):
            hi = lo + args.slots
            res = specjax.generate(bundle.model, tokens[lo:hi], max_new_tokens=news[lo:hi], kv_advance=rule, **common)
            toks += res.tokens
            steps += res.metrics["steps"]  # the batch's own steps: its slowest row's
        return toks, steps, None

    rows, ref = [], None
    for mode, fn in (("static", static), ("continuous", continuous)):
        for rule in ("cohort", "per_sequence"):
            print(f"{mode} {rule}: warm-up", file=sys.stderr)
            fn(rule)
            t0 = time.perf_counter()
            toks, steps, lat = fn(rule)
            dt = time.perf_counter() - t0
            n_tok = sum(len(t) for t in toks)
            ref = ref or toks
            rows.append({"mode": mode, "rule": rule, "tokens": n_tok, "seconds": dt, "tok_per_s": n_tok / dt,
                         "same_tokens": toks == ref, "latency": lat})
            print(f"{mode} {rule}: {n_tok} tokens in {dt:.1f} s = {n_tok / dt:.0f} tok/s", file=sys.stderr)
    by = {(r["mode"], r["rule"]): r["tok_per_s"] for r in rows}
    ratios = {
        "continuous_vs_static_per_sequence": by["continuous", "per_sequence"] / by["static", "per_sequence"],
        "continuous_vs_static_cohort": by["continuous", "cohort"] / by["static", "cohort"],
        "per_sequence_vs_cohort_continuous": by["continuous", "per_sequence"] / by["continuous", "cohort"],
        "per_sequence_vs_cohort_static": by["static", "per_sequence"] / by["static", "cohort"],
    }
    result = {"machine": machine(), "config": {"requests": args.requests, "slots": args.slots, "drafter": args.drafter,
                                               "depth": args.depth, "refill_rows": args.refill_rows,
                                               "mean_max_new_tokens": float(np.mean(news)),
                                               "max_max_new_tokens": int(max(news))},
              "rows": rows, "ratios": ratios}
    if write_result(result, args.out, args.json):
        return
    print(f"{'mode':<11} | {'rule':<13} | {'tokens':>7} | {'seconds':>7} | {'tok/s':>7} | same tokens | "
          "TTFT p50/p99 s | ITL p50/p99 ms")
    for r in rows:
        lat = r["latency"]
        ttft = f"{lat['ttft_s']['p50']:.2f} / {lat['ttft_s']['p99']:.2f}" if lat else "-"
        itl = f"{lat['itl_s']['p50'] * 1e3:.1f} / {lat['itl_s']['p99'] * 1e3:.1f}" if lat else "-"
        print(f"{r['mode']:<11} | {r['rule']:<13} | {r['tokens']:>7} | {r['seconds']:>7.1f} | {r['tok_per_s']:>7.0f} | "
              f"{str(r['same_tokens']):<11} | {ttft:>14} | {itl:>14}")
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")


if __name__ == "__main__":
    main()
