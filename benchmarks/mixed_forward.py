"""One forward over a decode step's windows and a prefill chunk (``forward_mixed``) against the
two forwards it replaces (the chunk's, then the step's), side by side in one run.

    python benchmarks/mixed_forward.py [--shape d512 qwen3-0.6b] [--dtype float32] [--reps 7]
                                       [--cases 16x4+4x128 4x4+1x64] [--json] [--out FILE]

Per case ``BxW+RxC``: ``B`` decode rows of a ``W``-token verify window at context
``--context``, and ``R`` pending rows taking a chunk of ``C`` prompt tokens at half that
context, all in one paged pool (as a batch job holds them). Random weights in the named shape
(``d512``: the batch benchmarks' d_model 512 / 8 layers / vocabulary 32,000 model;
otherwise ``specjax.model.shapes``; models whose layers are all global). Timed: the target's
forward only (every layer; no LM head, drafting or commit), each call donating the pool;
``separate`` is two jitted calls (the chunk's, then the window's), ``mixed`` one. The two
alternate ``--reps`` times after a warm-up; reported: the median of each, the ratio, and each
group alone. The ratio is what a step with a chunk saves by reading the weights once: on an
accelerator, where a forward of a few hundred tokens is bound by reading the weights, it
approaches 2x; on a CPU, where such a forward is bound by its multiplications, about 1x.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

from _report import write_result


def _case(spec: str) -> tuple[int, int, int, int]:
    try:
        dec, chunk = spec.split("+")
        b, w = (int(x) for x in dec.split("x"))
        r, c = (int(x) for x in chunk.split("x"))
    except ValueError:
        sys.exit(f"--cases {spec!r} is invalid: BxW+RxC (e.g. 16x4+4x128)")
    if min(b, w, r, c) < 1:
        sys.exit(f"--cases {spec!r} is invalid: every count must be >= 1")
    return b, w, r, c


def measure(shape: str, dtype: str, b: int, w: int, r: int, c: int, context: int, reps: int,
            impl: str = "xla") -> dict:
    """Median seconds of the mixed forward, the two separate forwards, and each alone."""
    import jax
    import jax.numpy as jnp

    from specjax.model import ModelConfig
    from specjax.scale import random_models

    cfg = ModelConfig(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=1536,
                      max_seq_len=4096, mtp_depth=0) if shape == "d512" else shape  # or a ModelConfig
    target, _ = random_models(cfg, dtype=dtype, draft=False)
    dec, params = target.decoder, target.params
    if any(dec.config.is_local(i) or dec.config.is_compressed(i) for i in range(dec.config.n_layers)):
        sys.exit(f"--shape {shape}: a model whose layers are all global (one paged pool for both groups)")
    cache = dec.init_cache(b + r, context + max(c, w), kind="paged", slack=0, page_size=16, num_pages=None)
    start = jnp.asarray([context] * b + [context // 2] * r, jnp.int32)
    cache = cache.reserve(start).advance(start)  # the rows' contexts (their K/V: zeros; only time is measured)
    cache = cache.reserve(jnp.asarray([w] * b + [c] * r, jnp.int32))  # the window's and the chunk's pages
    rows = (jnp.arange(b), jnp.arange(b, b + r))
    key = jax.random.PRNGKey(0)
    vocab = dec.config.vocab_size
    tokens = (jax.random.randint(key, (b, w), 0, vocab), jax.random.randint(key, (r, c), 0, vocab))

    def view(full, g):
        return full.replace(global_kv=full.global_kv.take_rows(rows[g]))

    def at(v, t):
        return v.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]

    @functools.partial(jax.jit, donate_argnums=1)
    def mixed(params, full):
        a, ch = view(full, 0), view(full, 1)
        (ha, a), (hc, _) = dec.forward_mixed(params, [(tokens[0], at(a, w), a, None), (tokens[1], at(ch, c), ch, None)],
                                             attention_impl=impl)
        return ha, hc, full.on_pool_of(a)

    @functools.partial(jax.jit, donate_argnums=1, static_argnums=2)
    def one(params, full, g):
        v = view(full, g)
        h, v = dec.forward_hidden(params, tokens[g], at(v, (w, c)[g]), v, attention_impl=impl)
        return h, full.on_pool_of(v)

    def run_mixed(full):
        *_, full = mixed(params, full)
        return jax.block_until_ready(full)

    def run_separate(full):
        _, full = one(params, full, 1)
        _, full = one(params, full, 0)
        return jax.block_until_ready(full)

    def run_alone(g):
        def go(full):
            return jax.block_until_ready(one(params, full, g)[1])
        return go

    timed = {"mixed": run_mixed, "separate": run_separate, "window_alone": run_alone(0), "chunk_alone": run_alone(1)}
    times: dict[str, list[float]] = {k: [] for k in timed}
    for fn in timed.values():  # compile and warm
        cache = fn(cache)
    for _ in range(reps):
        for name, fn in timed.items():
            t0 = time.perf_counter()
            cache = fn(cache)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    name = shape if isinstance(shape, str) else "config"
    return {"shape": name, "dtype": dtype, "decode_rows": b, "window": w, "chunk_rows": r, "chunk": c,
            "context": context, "tokens": b * w + r * c, "ms": {k: v * 1e3 for k, v in med.items()},
            "separate_over_mixed": med["separate"] / med["mixed"], "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["d512", "qwen3-0.6b"])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--cases", nargs="+", default=["16x4+4x128", "16x4+1x16", "4x4+1x64"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.reps < 1 or args.context < 2:
        sys.exit("--reps must be >= 1 and --context >= 2")
    cases = [_case(s) for s in args.cases]

    from specjax.bench import machine
    from specjax.model.shapes import SHAPES

    for s in args.shape:
        if s != "d512" and s not in SHAPES:
            sys.exit(f"--shape {s!r} is unknown: 'd512' or one of {', '.join(SHAPES)}")
    rows = []
    for s in args.shape:
        for b, w, r, c in cases:
            print(f"{s} {b}x{w}+{r}x{c}: compiling and timing", file=sys.stderr)
            rows.append(measure(s, args.dtype, b, w, r, c, args.context, args.reps))
    if write_result({"machine": machine(), "rows": rows}, args.out, args.json):
        return
    print(f"{'shape':<11} | {'case':<12} | {'tokens':>6} | {'mixed ms':>8} | {'separate ms':>11} | {'ratio':>5} | "
          f"{'window alone':>12} | {'chunk alone':>11}")
    for x in rows:
        ms = x["ms"]
        case = f"{x['decode_rows']}x{x['window']}+{x['chunk_rows']}x{x['chunk']}"
        print(f"{x['shape']:<11} | {case:<12} | {x['tokens']:>6} | {ms['mixed']:>8.1f} | {ms['separate']:>11.1f} | "
              f"{x['separate_over_mixed']:>5.2f} | {ms['window_alone']:>12.1f} | {ms['chunk_alone']:>11.1f}")


if __name__ == "__main__":
    main()
