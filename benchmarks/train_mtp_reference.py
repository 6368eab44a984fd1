"""How far ``specjax train-mtp`` gets on the bundled target: its MTP module against the one
the bundle ships (trained by ``specjax train``'s MTP stage), side by side.

    specjax train-mtp --model checkpoints/default --out runs/mtp_ref --steps 300 --batch 16 --seq-len 256 \\
        --data $(python benchmarks/train_mtp_reference.py --list-train-files)
    python benchmarks/train_mtp_reference.py --mtp runs/mtp_ref [--json] [--out docs/train_mtp_reference.json]

Both modules sit on the same frozen target. Reported for each: held-out bits per byte and
next-byte accuracy per chained pass on the bundle's held-out corpus (the stdlib files neither
run trained on), and ``generate`` with ``drafter="mtp"`` (greedy, depth 3, per_sequence) on
the 64 bench prompts at B=16: mean accepted length (tokens per row-step) and acceptance per
draft position.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from specjax import generate, load_model
from specjax.bench import bench_prompts
from specjax.corpus import build_corpus, is_held_out, stdlib_files
from specjax.mtp_head import load_mtp
from specjax.train import eval_windows, evaluate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mtp", help="the directory train-mtp wrote")
    ap.add_argument("--list-train-files", action="store_true", help="print the bundle's training files and exit")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.list_train_files:
        print(" ".join(str(p) for rel, p in stdlib_files() if not is_held_out(rel)))
        return 0
    if not args.mtp:
        ap.error("--mtp DIR is required")
    bundle = load_model()
    trained = load_mtp(bundle.model, args.mtp)
    meta = json.loads((pathlib.Path(args.mtp) / "mtp_config.json").read_text())
    held = eval_windows(build_corpus().held_out, 256, 64)
    prompts = [bundle.tokenizer.encode(p, bos=True) for p in bench_prompts()][:64]
    rows = []
    for name, model in (("shipped (specjax train)", bundle.model), ("train-mtp", trained)):
        ev = evaluate("mtp", model.params, model.config, held, 3)
        accepted, per_pos = [], []
        for i in range(0, len(prompts), 16):
            res = generate(model, prompts[i : i + 16], max_new_tokens=64, drafter="mtp", depth=3,
                           kv_advance="per_sequence")
            accepted.append(res.metrics["mean_accepted_length"])
            per_pos.append(res.metrics["acceptance_per_position"])
        rows.append({"mtp": name, "held_out_bits_per_byte": [round(x, 3) for x in ev["bits_per_byte"]],
                     "held_out_accuracy": [round(x, 3) for x in ev["accuracy"]],
                     "mean_accepted_length": round(float(np.mean(accepted)), 3),
                     "acceptance_per_position": [round(float(x), 3) for x in np.mean(per_pos, axis=0)]})
    result = {"rows": rows, "train_mtp": {k: meta["summary"].get(k) for k in ("step", "tokens", "wall_s",
                                                                              "stage_config")}}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'MTP module':<24} | {'held-out bits/byte (pass 1/2/3)':>32} | {'accuracy':>20} | {'accepted len':>12} | "
          "acceptance per position")
    for r in rows:
        print(f"{r['mtp']:<24} | {' / '.join(map(str, r['held_out_bits_per_byte'])):>32} | "
              f"{' / '.join(map(str, r['held_out_accuracy'])):>20} | {r['mean_accepted_length']:>12} | "
              f"{r['acceptance_per_position']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
