"""Compile time vs depth: how the unrolled layer loop's compile grows with ``n_layers``.

    python benchmarks/compile_depth.py [--json] [--out docs/compile_depth.json] [--layers 2 8 32]

For random models of ``n_layers`` in ``--layers`` (d_model 64, 4 heads, 2 KV heads, d_ff
128, vocab 256), each in a fresh compile cache, it measures the seconds XLA takes to compile:

- ``generate`` (prefill + the whole decode loop, one executable): plain decoding
  (``drafter=None``) and MTP speculative decoding at depth 3, dense cache, B=4, per_sequence;
- the same with interleaved local/global layers (sliding window 16, every 4th layer global:
  two cache kinds per step);
- the uncached forward ``logits`` (what training and ``train-mtp`` compile), B=4, T=64.

Layers run as a Python loop over per-layer parameter dicts, so each layer is traced and
compiled again: compile time grows with depth. Run time is not measured here.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from specjax.engine import generate
from specjax.model import ModelConfig, init_model, logits


def _config(layers: int, local: bool) -> ModelConfig:
    extra = dict(sliding_window=16, global_every=4) if local else {}
    return ModelConfig(vocab_size=256, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2, d_ff=128,
                       max_seq_len=512, mtp_depth=1, **extra)


def measure(layers: int) -> dict:
    jax.clear_caches()
    row: dict = {"n_layers": layers}
    prompts = [list(range(1, 17 + 3 * i)) for i in range(4)]
    for local in (False, True):
        model = init_model(_config(layers, local))
        tag = "interleaved" if local else "global"
        for drafter in (None, "mtp"):
            res = generate(model, prompts, max_new_tokens=16, drafter=drafter, depth=3, kv_advance="per_sequence")
            row[f"generate_{drafter or 'plain'}_{tag}_s"] = round(res.metrics["seconds_compile"], 2)
    model = init_model(_config(layers, False))
    tokens = np.zeros((4, 64), np.int32)
    t0 = time.perf_counter()
    jax.jit(logits).lower(model, tokens).compile()
    row["forward_s"] = round(time.perf_counter() - t0, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    rows = [measure(n) for n in args.layers]
    base = rows[0]
    for r in rows:
        r["ratio_vs_first"] = {k: round(r[k] / base[k], 2) for k in r if k.endswith("_s") and base[k]}
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    keys = [k for k in rows[0] if k.endswith("_s")]
    print(f"{'layers':>6} | " + " | ".join(f"{k[:-2]:>24}" for k in keys))
    for r in rows:
        print(f"{r['n_layers']:>6} | " + " | ".join(f"{r[k]:>9.2f} s ({r['ratio_vs_first'][k]:>5.2f}x)    "
                                                   for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
