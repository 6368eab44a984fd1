"""Token trees against the chain at a real shape on this machine (``specjax.scale.bench_shape``).

    PYTHONPATH=. python benchmarks/at_scale_trees.py                 # qwen3-0.6b, float32, B=1
    PYTHONPATH=. python benchmarks/at_scale_trees.py --batches 1,4 --json

Random weights in the shape, the layer scan (one layer body compiled: the listed layers' 11-token
forward took XLA:CPU 39 minutes to compile), prompt 512, 64 new tokens, the MTP module over a
32k draft vocabulary: plain decoding, the depth-3 chain, a 2x2x1 preset and a 6-node dynamic
tree. Acceptance ``bundled``: the chain at the bundled MTP head's rates, each tree at the
acceptance per branch the bundled head reached in that tree. What is measured is cost at that
acceptance, not draft quality (``docs/results/at-scale.md``).
"""

from __future__ import annotations

import argparse
import json

ROWS = (("none", 0), ("mtp:dv", 3), ("mtp:dv", 3, "2x2x1"), ("mtp:dv", 3, "dynamic:6,2"))


def main() -> None:
    from specjax.model import with_layer_loop
    from specjax.scale import bench_shape, random_models, table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", default="1")
    ap.add_argument("--acceptance", default="bundled")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    target, _ = random_models(args.shape, args.dtype, draft=False)
    out = bench_shape(args.shape, dtype=args.dtype, batches=[int(b) for b in args.batches.split(",")],
                      prompt_len=512, max_new_tokens=64, rows=ROWS, acceptance=args.acceptance, rounds=2,
                      roofline=False, progress=not args.json, models=(with_layer_loop(target, "scan"), None),
                      draft_vocab=32768)
    print(json.dumps(out) if args.json else table(out))


if __name__ == "__main__":
    main()
