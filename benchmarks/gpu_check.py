"""One prepared check for an accelerator machine (e.g. an H200, JAX 0.11 + CUDA, no network).

    PYTHONPATH=. python benchmarks/gpu_check.py            # ~5-8 minutes on an H200, prints JSON
    PYTHONPATH=. python benchmarks/gpu_check.py --smoke    # tiny shapes, any backend (CPU: interpret mode)

Sections (each reports its own error instead of stopping the run):

1. ``kernels``: the dense, paged and ring Pallas kernels compiled for the device (not
   interpret mode), against the XLA reference over random ragged shapes, float32 and bf16:
   max abs error per case.
2. ``bandwidth``: decode attention at 32k context (B=8, 8 query heads, 2 KV heads,
   head_dim 128, bf16, every row live to 32k): achieved HBM bandwidth = K/V bytes read /
   time, for the Pallas kernel and the XLA live-range path, and the Pallas kernel with rows
   live to 8k only (live-block skipping: time should fall ~4x).
3. ``engine``: ``specjax bench`` on the bundled model (``attention_impl="auto"``: Pallas on
   TPU, XLA on GPU), B in {1, 8, 32, 64}, mtp and ngram, both rules.
4. ``scale``: the at-scale bench (``specjax.scale.bench_shape``, ``specjax bench --shape``):
   random weights in llama3.2-1b's and llama3.1-8b's shapes, bfloat16, the layer scan (compile
   time flat in depth), prompt 512, 64 new tokens, the bundled MTP head's acceptance; plain,
   MTP depth 1-3, MTP depth 3 over a 32k draft vocabulary and the draft model (Llama-3.2-1B's
   shape for the 8B) at B 1/8/32/64 (the 8B at B 1 and 32), each with the target's own w-token
   forwards; at B=1 the roofline from this device's own compile beside the measured step, and
   where each row's step time goes (its parts timed on their own: draft, the window's forward,
   verification, the drafter's commit, the commit, the loop).

5. ``trees``: token trees at llama3.2-1b's shape (random weights, bfloat16, B 1 and 8, the
   at-scale bench's tree rows): MTP chains at depth 3 and 4 against a 2x2x1 preset and dynamic
   trees of 6 and 8 nodes, over a 32k draft vocabulary, each tree at the acceptance per branch
   the bundled MTP head reached in it: tok/step, ms/step and speedup over plain decoding.
6. ``mixed``: a batch job's step with a prefill chunk in its forward (``forward_mixed``) against
   the chunk's and the step's forwards one after the other, at llama3.2-1b's shape (bfloat16,
   one paged pool, context 2,048): 1, 16 and 64 rows of a 4-token window beside one chunk.

    # the at-scale bench only, one shape a call (each estimated within the 10-minute limit: not yet run)
    PYTHONPATH=. python benchmarks/gpu_check.py --skip kernels bandwidth engine trees mixed --scale-shapes llama3.2-1b
    PYTHONPATH=. python benchmarks/gpu_check.py --skip kernels bandwidth engine trees mixed --scale-shapes llama3.1-8b
    # token trees at a real shape only
    PYTHONPATH=. python benchmarks/gpu_check.py --skip kernels bandwidth engine scale mixed
    # the mixed forward only
    PYTHONPATH=. python benchmarks/gpu_check.py --skip kernels bandwidth engine scale trees
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def _timeit(fn, *args, n=20) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def kernels(smoke: bool) -> list[dict]:
    from pallas_kernels.paged import paged_attention, paged_attention_reference
    from pallas_kernels.ragged import (
        ragged_attention,
        ragged_attention_reference,
        ring_attention,
        ring_attention_reference,
    )

    rng = np.random.default_rng(0)
    rows = []
    cases = [(1, 8, 2, 128, 1024, 128, None), (4, 8, 2, 128, 2048, 128, None), (4, 4, 4, 64, 512, 64, 100)]
    if smoke:
        cases = [(1, 4, 2, 64, 64, 16, None), (4, 4, 1, 64, 64, 16, 12)]
    b = 4
    for t_q, hq, hkv, d, t, block, window in cases:
        for dtype in (jnp.float32, jnp.bfloat16):
            q = jnp.asarray(rng.standard_normal((b, t_q, hq, d)), dtype)
            k = jnp.asarray(rng.standard_normal((b, hkv, t, d)), dtype)
            v = jnp.asarray(rng.standard_normal((b, hkv, t, d)), dtype)
            qs = jnp.asarray(rng.integers(0, t - t_q + 1, b).astype(np.int32))
            lead = jnp.minimum(jnp.asarray(rng.integers(0, 9, b).astype(np.int32)), qs)
            case = dict(t_q=t_q, hq=hq, hkv=hkv, d=d, keys=t, block=block, window=window, dtype=jnp.dtype(dtype).name)
            ring_len, ring_w = qs + 3 * t, window or t // 2
            runs = {
                "dense": (ragged_attention, ragged_attention_reference, (q, k, v, lead, qs),
                          dict(window=window), dict(block_k=block)),
                "ring": (ring_attention, ring_attention_reference, (q, k, v, lead, ring_len),
                         dict(window=ring_w), dict(block_k=block)),
            }
            for name in ("dense", "ring", "paged"):
                try:
                    if name == "paged":
                        out, ref = _paged(paged_attention, paged_attention_reference, q, k, v, lead, qs, window,
                                          block, rng)
                    else:
                        kernel, reference, a, common, extra = runs[name]
                        out, ref = kernel(*a, **common, **extra), reference(*a, **common)
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
                    rows.append({"kernel": name, **case, "max_abs_err": err, "ok": err < (3e-2 if dtype ==
                                                                                         jnp.bfloat16 else 2e-4)})
                except Exception as e:  # report, keep going
                    rows.append({"kernel": name, **case, "error": f"{type(e).__name__}: {str(e)[:400]}"})
    return rows


def _paged(paged_attention, reference, q, k, v, lead, qs, window, page, rng):
    b, hkv, t, d = k.shape
    mp = t // page
    pool_k = k.reshape(b, hkv, mp, page, d).transpose(0, 2, 1, 3, 4).reshape(b * mp, hkv, page, d)
    pool_v = v.reshape(b, hkv, mp, page, d).transpose(0, 2, 1, 3, 4).reshape(b * mp, hkv, page, d)
    perm = rng.permutation(b * mp).astype(np.int32)
    inv = np.argsort(perm)
    bt = jnp.asarray(inv.reshape(b, mp))  # logical page j of row r lives at pool slot inv[r * mp + j]
    pool_k, pool_v = pool_k[perm], pool_v[perm]
    return (paged_attention(q, pool_k, pool_v, bt, lead, qs, window=window),
            reference(q, pool_k, pool_v, bt, lead, qs, window=window))


def bandwidth(smoke: bool) -> dict:
    from pallas_kernels.ragged import ragged_attention
    from specjax.cache import DenseKVCache

    b, hq, hkv, d, t, t_q = (8, 8, 2, 128, 32768, 1) if not smoke else (2, 4, 2, 64, 1024, 1)
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((b, t_q, hq, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.bfloat16)
    lead = jnp.zeros((b,), jnp.int32)
    full = jnp.full((b,), t - t_q, jnp.int32)
    quarter = jnp.full((b,), t // 4 - t_q, jnp.int32)
    kv_bytes = 2 * k.size * k.dtype.itemsize
    out = {"batch": b, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "context": t, "dtype": "bfloat16",
           "kv_bytes": kv_bytes}
    pallas = jax.jit(lambda q, k, v, lead, qs: ragged_attention(q, k, v, lead, qs, block_k=512 if not smoke else 128))
    cache = DenseKVCache((k,), (v,), full, lead, lead)
    xla = jax.jit(lambda q, c: c.attend(q, 0, impl="xla"))
    for name, fn, args, live in (
        ("pallas_full", pallas, (q, k, v, lead, full), 1.0),
        ("pallas_quarter_live", pallas, (q, k, v, lead, quarter), 0.25),
        ("xla_live_range_full", xla, (q, cache), 1.0),
    ):
        try:
            s = _timeit(fn, *args)
            out[name] = {"seconds": s, "GB_per_s": kv_bytes * live / s / 1e9}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    return out


def engine(smoke: bool) -> dict:
    import specjax
    from specjax.bench import bench

    bundle = specjax.load_model()
    kw = dict(batches=(1, 8, 32, 64), drafters=("mtp", "ngram"), n_prompts=64, max_new_tokens=128)
    if smoke:
        kw = dict(batches=(1, 2), drafters=("mtp",), n_prompts=2, max_new_tokens=8)
    return bench(bundle, progress=False, **kw)


# (shape, batches) of the scale section; --smoke runs a tiny config instead
SCALE_RUNS = (("llama3.2-1b", (1, 8, 32, 64)), ("llama3.1-8b", (1, 32)))


SCALE_SHAPES: list[str] = [name for name, _ in SCALE_RUNS]  # --scale-shapes narrows it (one call per shape)


def scale(smoke: bool) -> dict:
    from specjax.model import ModelConfig, with_layer_loop
    from specjax.scale import bench_shape, random_models

    rows = (("none", 0), ("mtp", 1), ("mtp", 2), ("mtp", 3), ("mtp:dv", 3), ("draft_model", 3))
    out = {}
    runs = [(name, b) for name, b in SCALE_RUNS if name in SCALE_SHAPES]
    if smoke:
        cfg = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256,
                          mtp_depth=3)
        runs = ((cfg, (1, 2)),)
    for name, batches in runs:
        key = name if isinstance(name, str) else "smoke"
        try:
            target, draft = random_models(name, "bfloat16")
            models = (with_layer_loop(target, "scan"), with_layer_loop(draft, "scan"))
            # the roofline and the step's parts (more compiles per row) at B=1 only; a 32k draft vocabulary
            # beside MTP's full one
            out[key] = bench_shape(name, dtype="bfloat16", batches=batches, prompt_len=32 if smoke else 512,
                                   max_new_tokens=16 if smoke else 64, rows=rows, rounds=2, progress=True,
                                   models=models, roofline=(1,), breakdown_parts=(1,),
                                   draft_vocab=64 if smoke else 32768,
                                   acceptance="iid:0.8" if smoke else "bundled")
        except Exception:
            out[key] = {"error": traceback.format_exc()[-2000:]}
        print(f"gpu_check: scale {key} done", file=sys.stderr, flush=True)
    return out


# rows of the trees section (specjax.scale.bench_shape): MTP chains over a 32k draft vocabulary against trees
TREE_ROWS = (("none", 0), ("mtp:dv", 3), ("mtp:dv", 4), ("mtp:dv", 3, "2x2x1"), ("mtp:dv", 4, "dynamic:6,2"),
             ("mtp:dv", 5, "dynamic:8,2"))


def trees(smoke: bool) -> dict:
    """Token trees at a real shape (``specjax.scale.bench_shape`` with tree rows): random
    llama3.2-1b weights (bfloat16, the layer scan), prompt 512, 64 new tokens, B 1 and 8, the
    MTP chain at depth 3 and 4 against a 2x2x1 preset and dynamic trees of 6 and 8 nodes, all
    over a 32k draft vocabulary. Controlled acceptance: chains at the bundled MTP head's rates,
    each tree at the acceptance per branch the bundled head reached in that same tree (measured
    at start), so tok/step is the bundled model's and ms/step is the device's."""
    from specjax.model import ModelConfig, with_layer_loop
    from specjax.scale import bench_shape, random_models

    if smoke:
        name = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256,
                           mtp_depth=3)
        prompt_len, new, batches, dv, acceptance = 16, 8, (1, 2), 64, "iid:0.8"
    else:
        name, prompt_len, new, batches, dv, acceptance = "llama3.2-1b", 512, 64, (1, 8), 32768, "bundled"
    target, draft = random_models(name, "bfloat16", draft=False)
    models = (with_layer_loop(target, "scan"), draft)
    return bench_shape(name, dtype="bfloat16", batches=batches, prompt_len=prompt_len, max_new_tokens=new,
                       rows=TREE_ROWS, rounds=2, progress=True, models=models, roofline=(1,), draft_vocab=dv,
                       acceptance=acceptance)


def mixed(smoke: bool) -> dict:
    """A decode step's verify windows and a prefill chunk in one forward (``forward_mixed``,
    what a batch job's step runs while a long prompt is pending) against the two forwards it
    replaces: random llama3.2-1b weights, bfloat16, one paged pool, context 2,048
    (``benchmarks/mixed_forward.py``). ``separate_over_mixed`` near 2 means the weights are
    read once for both."""
    from mixed_forward import measure

    from specjax.model import ModelConfig

    if smoke:
        shape = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                            max_seq_len=512)
        cases, context, reps = [(2, 4, 1, 16)], 64, 1
    else:
        shape, cases, context, reps = "llama3.2-1b", [(1, 4, 1, 512), (16, 4, 1, 512), (64, 4, 1, 256)], 2048, 7
    rows = []
    for b, w, r, c in cases:
        rows.append(measure(shape, "bfloat16", b, w, r, c, context, reps))
        print(f"gpu_check: mixed {b}x{w}+{r}x{c} {rows[-1]['separate_over_mixed']:.2f}x", file=sys.stderr, flush=True)
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: interpret mode)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["kernels", "bandwidth", "engine", "scale", "trees",
                                                                     "mixed"])
    ap.add_argument("--scale-shapes", nargs="*", default=list(SCALE_SHAPES), choices=SCALE_SHAPES,
                    help="the scale section's shapes (one call each: each should fit the 10-minute limit)")
    args = ap.parse_args()
    SCALE_SHAPES[:] = args.scale_shapes
    result = {"backend": jax.default_backend(), "devices": [str(x) for x in jax.devices()], "jax": jax.__version__,
              # jax's own default for Pallas on GPU (the loop body names Triton whatever this says)
              "pallas_gpu_default": "mosaic" if getattr(jax.config, "jax_pallas_use_mosaic_gpu", False) else "triton"}
    for name, fn in (("kernels", kernels), ("bandwidth", bandwidth), ("engine", engine),
                     ("scale", scale), ("trees", trees), ("mixed", mixed)):
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn(args.smoke)
        except Exception:
            result[name] = {"error": traceback.format_exc()[-2000:]}
        result[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
        print(f"gpu_check: {name} done in {result[f'{name}_seconds']} s", file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
