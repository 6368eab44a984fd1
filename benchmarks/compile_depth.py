"""Compile time vs depth: the layer scan against the same layers unrolled, side by side.

    python benchmarks/compile_depth.py [--json] [--out docs/compile_depth.json] [--layers 2 8 32]

For random models of ``n_layers`` in ``--layers`` (d_model 64, 4 heads, 2 KV heads, d_ff
128, vocab 256), each in a fresh compile cache, and for each layer loop (``scan``: stacked
params, one ``lax.scan`` over periods of layers; ``unrolled``: listed params, a Python loop,
every layer traced and compiled), it measures the seconds XLA takes to compile:

- ``generate`` (prefill + the whole decode loop, one executable): plain decoding
  (``drafter=None``) and MTP speculative decoding at depth 3, dense cache, B=4, per_sequence;
- the same with interleaved local/global layers (sliding window 16, every 4th layer global:
  two cache kinds per step);
- the uncached forward ``logits`` (what training and ``train-mtp`` compile), B=4, T=64.

and, so that the scan is seen to cost nothing at run time, the run time of the same plain
``generate`` once compiled (``run_plain_global_s``: prefill + 16 decode steps, best of 3).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from _report import emit

from specjax.generation import clear_compiled, generate
from specjax.model import ModelConfig, init_model, logits, with_layer_loop

LOOPS = ("scan", "unrolled")


def _config(layers: int, local: bool) -> ModelConfig:
    extra = dict(sliding_window=16, global_every=4) if local else {}
    return ModelConfig(vocab_size=256, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2, d_ff=128,
                       max_seq_len=512, mtp_depth=1, **extra)


def measure(layers: int, loop: str) -> dict:
    jax.clear_caches()
    clear_compiled()  # generate's own cache of compiled loops
    row: dict = {"n_layers": layers, "loop": loop}
    prompts = [list(range(1, 17 + 3 * i)) for i in range(4)]
    for local in (False, True):
        model = with_layer_loop(init_model(_config(layers, local)), loop)
        tag = "interleaved" if local else "global"
        for drafter in (None, "mtp"):
            res = generate(model, prompts, max_new_tokens=16, drafter=drafter, depth=3, kv_advance="per_sequence")
            row[f"generate_{drafter or 'plain'}_{tag}_s"] = round(res.metrics["seconds_compile"], 2)
    model = with_layer_loop(init_model(_config(layers, False)), loop)
    tokens = np.zeros((4, 64), np.int32)
    t0 = time.perf_counter()
    jax.jit(logits).lower(model, tokens).compile()
    row["forward_s"] = round(time.perf_counter() - t0, 2)
    runs = [generate(model, prompts, max_new_tokens=16, depth=3, drafter=None).metrics["seconds_run"]
            for _ in range(3)]
    row["run_plain_global_s"] = round(min(runs), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    rows = [measure(n, loop) for n in args.layers for loop in LOOPS]
    for r in rows:
        base = next(b for b in rows if b["loop"] == r["loop"])  # the shallowest model, same loop
        unrolled = next(b for b in rows if b["loop"] == "unrolled" and b["n_layers"] == r["n_layers"])
        r["ratio_vs_first"] = {k: round(r[k] / base[k], 2) for k in r if k.endswith("_s") and base[k]}
        r["ratio_vs_unrolled"] = {k: round(r[k] / unrolled[k], 2) for k in r if k.endswith("_s") and unrolled[k]}
    if emit(rows, args.out, args.json):
        return 0
    keys = [k for k in rows[0] if k.endswith("_s")]
    print("seconds (ratio to the same layer loop at the smallest depth; ratio to unrolled at this depth)")
    print(f"{'layers':>6} {'loop':>8} | " + " | ".join(f"{k[:-2]:>26}" for k in keys))
    for r in rows:
        print(f"{r['n_layers']:>6} {r['loop']:>8} | " + " | ".join(
            f"{r[k]:>8.3g} ({r['ratio_vs_first'][k]:>5.2f}x, {r['ratio_vs_unrolled'][k]:>4.2f}x)" for k in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
