"""The bundled block drafter beside the MTP chain and plain decoding, measured side by side.

    PYTHONPATH=. python benchmarks/block_drafter.py [--prompts 16] [--batches 1,8,16] [--trees] [--json]

Per batch size: every configuration runs once to compile, then the timed passes interleave
the configurations (each keeps its fastest of ``--rounds``), so a slow spell of a shared machine
falls on all of them. Greedy, per_sequence, the bench's code prompts. ``--trees`` adds each
drafter's dynamic tree (``TREES``). Prints a table, or JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import specjax  # noqa: E402
from specjax.bench import bench_prompts  # noqa: E402

CONFIGS = (("none", 0, None), ("mtp", 3, None), ("block", 3, None), ("block", 7, None))
TREES = (("mtp", 3, "dynamic:10,3"), ("block", 7, "dynamic:16,3"))  # (drafter, depth, tree)


def run(bundle, prompts, drafter, depth, tree, new):
    res = specjax.generate(bundle.model, prompts, max_new_tokens=new, drafter=None if drafter == "none" else drafter,
                           depth=depth or 1, tree=tree)
    return res.metrics


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trees", action="store_true", help=f"add the dynamic trees {TREES}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    configs = CONFIGS + (TREES if args.trees else ())
    bundle = specjax.load_model()
    toks = bundle.encode_prompts(bench_prompts(args.prompts), bos=False)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        groups = [toks[i : i + b] for i in range(0, len(toks), b)]
        for c in configs:  # compile every prompt width once
            for g in groups:
                run(bundle, g, *c, args.new)
        best = {c: float("inf") for c in configs}
        steps = {}
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[: r % len(configs)]
            for c in order:
                secs, emitted, per_step = 0.0, 0, []
                for g in groups:
                    m = run(bundle, g, *c, args.new)
                    secs += m["seconds_run"]
                    emitted += m["emitted"]
                    per_step.append(m["tok_per_step"])
                best[c] = min(best[c], secs)
                steps[c] = (emitted, sum(per_step) / len(per_step))
        for c in configs:
            rows.append({"batch": b, "drafter": c[0], "depth": c[1], "tree": c[2],
                         "tok_per_step": round(steps[c][1], 3), "tok_per_s": round(steps[c][0] / best[c], 1),
                         "vs_plain": round(best[CONFIGS[0]] / best[c], 3)})
        print(f"batch {b} done", file=sys.stderr)
    if args.json:
        print(json.dumps({"settings": vars(args), "rows": rows}, indent=1))
        return 0
    print("| batch | drafter | depth | tree | tok/step | tok/s | vs plain |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['drafter']} | {r['depth']} | {r['tree'] or 'chain'} | {r['tok_per_step']:.2f} "
              f"| {r['tok_per_s']:.0f} | {r['vs_plain']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
