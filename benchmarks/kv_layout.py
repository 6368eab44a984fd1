"""Which K/V layout the batched attention dot wants on this backend: one decode window
(``t_q`` queries per row) against a cache of ``T`` slots, 4 KV heads x 64, float32.

    python benchmarks/kv_layout.py [--json]

Variants (scores + softmax + weighted values, same math):

* ``token-major``: cache ``[B, T, Hkv, D]``, ``einsum('bqhd,bkhd->bhqk')`` (the old layout);
* ``head-major``: cache ``[B, Hkv, T, D]`` with batch and head axes leading on every operand;
* ``head-major, key-major scores``: as above, scores computed as ``K @ q^T`` (``[B, Hkv, T, t_q]``)
  and softmax over the key axis (what ``specjax.attention`` runs).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def _bench(f, *a, n=30) -> float:
    jax.block_until_ready(f(*a))
    t0 = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return (time.perf_counter() - t0) / n * 1e3


def token_major(q, k, v):  # q [B, t, H, D], k [B, T, H, D]
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def head_major(q, k, v):  # q [B, H, t, D], k [B, H, T, D]
    p = jax.nn.softmax(jnp.einsum("bhqd,bhkd->bhqk", q, k), -1)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v)


def head_major_key_scores(q, k, v):
    p = jax.nn.softmax(jnp.einsum("bhkd,bhqd->bhkq", k, q), axis=2)
    return jnp.einsum("bhqk,bhkd->bhqd", p.swapaxes(2, 3), v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h, d = 4, 64
    rows = []
    for b, t, tq in [(1, 256, 4), (8, 256, 4), (32, 256, 1), (32, 256, 4), (64, 256, 4), (32, 1024, 4)]:
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((b, tq, h, d)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
        qh, kh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        r = {"B": b, "T": t, "t_q": tq, "kv_MB": 2 * k.nbytes / 1e6,
             "token_major_ms": _bench(jax.jit(token_major), q, k, k),
             "head_major_ms": _bench(jax.jit(head_major), qh, kh, kh),
             "head_major_key_scores_ms": _bench(jax.jit(head_major_key_scores), qh, kh, kh)}
        rows.append(r)
    out = {"backend": jax.default_backend(), "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"backend {out['backend']}; 4 KV heads x 64, float32; ms per call (lower is better)")
    print("| B | T | t_q | KV MB | token-major | head-major | head-major, key-major scores |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['T']} | {r['t_q']} | {r['kv_MB']:.1f} | {r['token_major_ms']:.3f} | "
              f"{r['head_major_ms']:.3f} | {r['head_major_key_scores_ms']:.3f} |")


if __name__ == "__main__":
    main()
