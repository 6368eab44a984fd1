"""Which shapes fit which TPU chip: the decode step of each named shape compiled for v5e, v5p
and v6e (libtpu's compile-only client: ``pip install -e '.[tpu]'``; no TPU needed) at several
batch sizes, one chip each. Prints a markdown table and, with ``--json FILE``, every report.

    PYTHONPATH=. python benchmarks/tpu_fit_table.py --json docs/tpu_fit.json
"""

from __future__ import annotations

import argparse
import json
import sys

from specjax.memory import resolve_config
from specjax.tpu_compile import GIB, compile_generation


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-0.6b,llama3.2-1b,gemma3-1b,llama3.1-8b")
    ap.add_argument("--chips", default="v5e,v5p,v6e")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    shapes, chips = args.shapes.split(","), args.chips.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for shape in shapes:
        cfg = resolve_config(shape)
        for chip in chips:
            for b in batches:
                r = compile_generation(cfg, chip=chip, batch=b, context=args.context, programs=("decode_step",))
                step = r["decode_step"]
                rows.append({"shape": shape, "chip": chip, "batch": b, "fits": r["fits"],
                             "needs_gib": round(r["needs_bytes"] / GIB, 2), "verdict": r["verdict"],
                             "copies": len(step.get("cache_sized_copies", [])),
                             "temp_gib": round(step.get("temp_bytes", 0) / GIB, 3)})
                print(f"{shape} {chip} B={b}: {r['verdict']}", file=sys.stderr, flush=True)
    print("| shape | chip | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for shape in shapes:
        for chip in chips:
            cells = []
            for b in batches:
                r = next(x for x in rows if (x["shape"], x["chip"], x["batch"]) == (shape, chip, b))
                mark = "fits" if r["fits"] else "**no**"
                copies = f", {r['copies']} copies" if r["copies"] else ""
                cells.append(f"{mark} ({r['needs_gib']} GiB{copies})")
            print(f"| {shape} | {chip} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "dtype": "bfloat16", "drafter": None, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
