"""An EAGLE-3 head for the bundled model beside its MTP module, on the bench's prompts.

    PYTHONPATH=. python benchmarks/eagle3_head.py [--head checkpoints/default/eagle3] [--prompts 64] [--json]

Greedy, the bench's code prompts (``specjax.bench.bench_prompts``), ``--new`` tokens each, all
prompts in one batch. Per configuration: tokens per step (per_sequence: each row's own, so the
figure does not depend on the batch) and acceptance per draft position, then cohort's tokens
per step at the same batch and the per_sequence / cohort ratio. The head is loaded with
``specjax.load_drafter`` (the public EAGLE-3 layout ``train-drafter --kind eagle3`` writes).
Tokens per step only: wall-clock speed is ``benchmarks/block_drafter.py``'s question.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import specjax  # noqa: E402
from specjax.bench import bench_prompts  # noqa: E402

CONFIGS = (("mtp", 3, None), ("eagle3", 3, None), ("mtp", 3, "dynamic:10,3"), ("eagle3", 3, "dynamic:10,3"),
           ("eagle3", 5, "dynamic:16,3"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="checkpoints/default/eagle3")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    bundle = specjax.load_model()
    models = {"mtp": bundle.model, "eagle3": specjax.load_drafter(args.head, bundle.model)}
    tok = bundle.tokenizer
    prompts = [tok.encode(p, bos=True) for p in bench_prompts(args.prompts)]
    rows = []
    for name, depth, tree in CONFIGS:
        row = {"drafter": name, "depth": depth, "tree": tree or "chain", "batch": len(prompts)}
        for rule in ("per_sequence", "cohort"):
            m = specjax.generate(models[name], prompts, max_new_tokens=args.new, drafter="mtp", depth=depth, tree=tree,
                                 kv_advance=rule).metrics
            row[f"tok_per_step_{rule}"] = m["tok_per_step"]
            if rule == "per_sequence":
                row["acceptance_per_position"] = m["acceptance_per_position"]
        row["per_sequence_over_cohort"] = row["tok_per_step_per_sequence"] / row["tok_per_step_cohort"]
        rows.append(row)
        print(f"  {name} depth {depth} {row['tree']}: {row['tok_per_step_per_sequence']:.2f} tok/step", file=sys.stderr)
    if args.json:
        print(json.dumps({"prompts": len(prompts), "new_tokens": args.new, "head": args.head, "rows": rows}))
        return 0
    print(f"{len(prompts)} bench prompts, {args.new} new tokens, greedy, batch {len(prompts)}")
    print("| drafter | depth | tree | tok/step per_sequence | acceptance per position | tok/step cohort | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        acc = " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        print(f"| {r['drafter']} | {r['depth']} | {r['tree']} | {r['tok_per_step_per_sequence']:.2f} | {acc} | "
              f"{r['tok_per_step_cohort']:.2f} | {r['per_sequence_over_cohort']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
