"""A per-row write of ``t`` tokens moves O(B*t) bytes, not O(B*capacity).

    python benchmarks/cache_write.py [--json]

Times the jitted, buffer-donated ``write`` of t=4 tokens per row into dense and
paged caches of growing capacity, next to a whole-cache copy (``front_pad_kv_cache``)
of the same cache. XLA's static cost analysis is printed too, but it charges a
scatter with its whole operand even when the update happens in place, so the
timing is the evidence: write time stays flat as capacity grows, the copy grows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

from specjax.cache import DenseKVCache, PagedKVCache, front_pad_kv_cache

B, T, HKV, D, PAGE = 8, 4, 4, 64, 16


def _time(fn, state, arg, repeats):
    state = fn(state, arg)  # compile + warm
    jax.block_until_ready(state)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = fn(state, arg)
        jax.block_until_ready(state)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _cost_bytes(fn, *args):
    ca = fn.lower(*args).compile().cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    return float(ca.get("bytes accessed", float("nan")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--capacities", type=int, nargs="+", default=[512, 4096, 32768])
    args = ap.parse_args()
    kn = jnp.ones((B, T, HKV, D), jnp.float32)
    moved = 2 * B * T * HKV * D * 4  # k and v of the new tokens
    write = jax.jit(lambda c, k: c.write(0, k, k), donate_argnums=0)
    copy = jax.jit(lambda c, _: front_pad_kv_cache(c), donate_argnums=0)
    rows = []
    for cap in args.capacities:
        dense = DenseKVCache.create(1, B, cap, HKV, D).replace(lengths=jnp.arange(B, dtype=jnp.int32) * 3)
        cache_bytes = 2 * B * cap * HKV * D * 4
        cost = _cost_bytes(write, dense, kn)
        rows.append({"cache": "dense", "op": "write t=4", "capacity": cap, "cache_bytes": cache_bytes,
                     "update_bytes": moved, "xla_cost_bytes": cost,
                     "seconds": _time(write, dense, kn, args.repeats)})
        dense = DenseKVCache.create(1, B, cap, HKV, D).replace(lengths=jnp.arange(B, dtype=jnp.int32) * 3)
        rows.append({"cache": "dense", "op": "front_pad copy", "capacity": cap, "cache_bytes": cache_bytes,
                     "update_bytes": cache_bytes, "xla_cost_bytes": None,
                     "seconds": _time(copy, dense, kn, max(3, args.repeats // 4))})
        pages = B * cap // PAGE
        paged = PagedKVCache.create(1, B, pages, PAGE, cap // PAGE, HKV, D).reserve(cap // 2)
        rows.append({"cache": "paged", "op": "write t=4", "capacity": cap, "cache_bytes": cache_bytes,
                     "update_bytes": moved, "xla_cost_bytes": _cost_bytes(write, paged, kn),
                     "seconds": _time(write, paged, kn, args.repeats)})
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
               "backend": jax.default_backend()}
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}))
        return
    print(f"machine: {machine}; B={B} t={T} kv_heads={HKV} head_dim={D} float32, donated buffers")
    print(f"{'cache':<6} | {'op':<15} | {'capacity':>8} | {'cache MB':>9} | {'moved KB':>9} | "
          f"{'XLA cost MB':>11} | {'ms':>8}")
    for r in rows:
        cost = "-" if r["xla_cost_bytes"] is None else f"{r['xla_cost_bytes'] / 1e6:.1f}"
        print(f"{r['cache']:<6} | {r['op']:<15} | {r['capacity']:>8} | {r['cache_bytes'] / 1e6:>9.1f} | "
              f"{r['update_bytes'] / 1e3:>9.1f} | {cost:>11} | {r['seconds'] * 1e3:>8.3f}")


if __name__ == "__main__":
    main()
