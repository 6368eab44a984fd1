"""Decode run time of the bundled model per layer loop, side by side in one run.

    python benchmarks/layer_loop_runtime.py [--json] [--out docs/layer_loop_runtime.json]

``generate`` (40-token prompts, 64 new tokens, plain and MTP depth 3) at B = 1, 8, 32 with the
bundle's params listed (``unrolled``: a Python loop over per-layer buffers, the default) and
stacked (``scan``: ``with_layer_loop(model, "scan")``, one ``lax.scan`` over stacked caches).
Seconds are the best of ``--repeats`` runs after a compile run.
"""

from __future__ import annotations

import argparse

import numpy as np
from _report import emit

from specjax import load_model
from specjax.generation import generate
from specjax.model import with_layer_loop

LOOPS = ("unrolled", "scan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    base = load_model().model
    rows = []
    for drafter in (None, "mtp"):
        for b in args.batch:
            prompts = [np.random.default_rng(b).integers(1, 200, 40).tolist() for _ in range(b)]
            row = {"drafter": drafter or "plain", "batch": b}
            for loop in LOOPS:
                model = with_layer_loop(base, loop)
                generate(model, prompts, max_new_tokens=64, drafter=drafter, depth=3)
                row[loop + "_s"] = round(min(generate(model, prompts, max_new_tokens=64, drafter=drafter, depth=3)
                                             .metrics["seconds_run"] for _ in range(args.repeats)), 4)
            row["scan_vs_unrolled"] = round(row["scan_s"] / row["unrolled_s"], 2)
            rows.append(row)
    if emit(rows, args.out, args.json):
        return 0
    print("| step | B | unrolled s | scan s | scan / unrolled |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['batch']} | {r['unrolled_s']:.3f} | {r['scan_s']:.3f} "
              f"| {r['scan_vs_unrolled']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
