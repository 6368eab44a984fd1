"""Pallas ragged attention vs the XLA reference.

    python benchmarks/attention.py [--json] [--dtype bfloat16] [--repeats 20]

On GPU/TPU: for B in {1, 8, 64}, context in {512, 4096, 32768}, t_q in {1, 4}
(Hq=32, Hkv=8, head_dim=128), each row with a random live length in [ctx/2, ctx],
prints kernel and XLA time, live KV bytes read, achieved GB/s and the fraction of
the device's peak memory bandwidth. On CPU the kernels only run in interpret mode,
so it reports interpret-mode correctness (max abs error vs the oracle) and says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged import ragged_attention, ragged_attention_reference

HQ, HKV, D = 32, 8, 128
# Peak HBM bandwidth, bytes/s, by device_kind substring (vendor figures).
PEAK_BW = {
    "H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L4": 0.3e12,
    "TPU v6": 1.64e12, "TPU v5p": 2.765e12, "TPU v5 lite": 0.819e12, "TPU v5e": 0.819e12, "TPU v4": 1.2e12,
}


def _peak(kind: str) -> float | None:
    return next((bw for k, bw in PEAK_BW.items() if k.lower() in kind.lower()), None)


def _case(b, ctx, t_q, dtype, seed=0):
    rng = np.random.default_rng(seed)
    live = rng.integers(ctx // 2, ctx + 1, b)
    qs = (live - t_q).astype(np.int32)
    lead = np.zeros(b, np.int32)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t_q, HQ, D), dtype)
    k = jax.random.normal(kk, (b, HKV, ctx, D), dtype)  # head-major, the cache layout
    v = jax.random.normal(kv, (b, HKV, ctx, D), dtype)
    live_bytes = int(live.sum()) * HKV * D * jnp.dtype(dtype).itemsize * 2
    return q, k, v, jnp.asarray(lead), jnp.asarray(qs), live_bytes


def _time(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--block-k", type=int, default=256)
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    backend = jax.default_backend()
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
               "backend": backend, "device": dev.device_kind}
    rows = []
    if backend == "cpu":
        note = "CPU: Pallas runs in interpret mode only; correctness vs the XLA oracle, no timings"
        for b, t_q in itertools.product((1, 8), (1, 4)):
            q, k, v, lead, qs, _ = _case(b, 512, t_q, dtype)
            ref = np.asarray(ragged_attention_reference(q, k, v, lead, qs), np.float32)
            for body in ("grid", "loop"):
                out = np.asarray(ragged_attention(q, k, v, lead, qs, block_k=128, body=body), np.float32)
                rows.append({"batch": b, "context": 512, "t_q": t_q, "body": body,
                             "max_abs_err": float(np.abs(out - ref).max())})
    else:
        note = f"{dev.device_kind}: compiled kernels"
        peak = _peak(dev.device_kind)
        kernel = jax.jit(lambda q, k, v, lp, qs: ragged_attention(q, k, v, lp, qs, block_k=args.block_k))
        xla = jax.jit(lambda q, k, v, lp, qs: ragged_attention_reference(q, k, v, lp, qs))
        for b, ctx, t_q in itertools.product((1, 8, 64), (512, 4096, 32768), (1, 4)):
            q, k, v, lead, qs, live_bytes = _case(b, ctx, t_q, dtype)
            err = float(np.abs(np.asarray(kernel(q, k, v, lead, qs), np.float32)
                               - np.asarray(xla(q, k, v, lead, qs), np.float32)).max())
            tk, tx = _time(kernel, (q, k, v, lead, qs), args.repeats), _time(xla, (q, k, v, lead, qs), args.repeats)
            gbs = live_bytes / tk / 1e9
            rows.append({"batch": b, "context": ctx, "t_q": t_q, "kernel_s": tk, "xla_s": tx,
                         "speedup_vs_xla": tx / tk, "live_kv_bytes": live_bytes, "kernel_gb_s": gbs,
                         "frac_peak_bw": None if peak is None else gbs * 1e9 / peak, "max_abs_err": err})
            del q, k, v
    if args.json:
        print(json.dumps({"machine": machine, "note": note, "dtype": args.dtype, "rows": rows}))
        return
    print(f"machine: {machine}\n{note}; dtype {args.dtype}, Hq={HQ} Hkv={HKV} D={D}")
    if backend == "cpu":
        print(f"{'B':>3} | {'ctx':>5} | {'t_q':>3} | {'body':<4} | {'max abs err':>11}")
        for r in rows:
            print(f"{r['batch']:>3} | {r['context']:>5} | {r['t_q']:>3} | {r['body']:<4} | {r['max_abs_err']:>11.2e}")
        return
    print(f"{'B':>3} | {'ctx':>6} | {'t_q':>3} | {'kernel ms':>9} | {'xla ms':>8} | {'speedup':>7} | "
          f"{'live MB':>8} | {'GB/s':>7} | {'% peak':>6} | {'err':>8}")
    for r in rows:
        frac = "-" if r["frac_peak_bw"] is None else f"{100 * r['frac_peak_bw']:.1f}"
        print(f"{r['batch']:>3} | {r['context']:>6} | {r['t_q']:>3} | {r['kernel_s'] * 1e3:>9.3f} | "
              f"{r['xla_s'] * 1e3:>8.3f} | {r['speedup_vs_xla']:>7.2f} | {r['live_kv_bytes'] / 1e6:>8.1f} | "
              f"{r['kernel_gb_s']:>7.1f} | {frac:>6} | {r['max_abs_err']:>8.1e}")


if __name__ == "__main__":
    main()
