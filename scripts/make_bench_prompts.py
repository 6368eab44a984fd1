"""Regenerate ``specjax/data/bench_prompts.json``: the fixed prompts of ``specjax bench``.

64 snippets of held-out stdlib files (never trained on), each up to ~112 bytes of
whole lines ending right after a ``def ...:`` line, evenly spaced over all candidates
(``specjax.bench.recipe_candidates`` / ``recipe_pick``).
Committed, so ``specjax bench`` measures the same prompts on every machine.
"""

from __future__ import annotations

import json
import pathlib
import sys

from specjax.bench import recipe_candidates, recipe_pick

N_PROMPTS = 64


def main() -> int:
    cands = recipe_candidates()
    if len(cands) < N_PROMPTS:
        print(f"only {len(cands)} candidate prompts", file=sys.stderr)
        return 1
    picked = recipe_pick(cands, N_PROMPTS)
    out = pathlib.Path(__file__).resolve().parent.parent / "specjax" / "data" / "bench_prompts.json"
    doc = {"about": __doc__.strip().splitlines()[0], "prompts": [
        {"file": rel, "offset": off, "text": text} for rel, off, text in picked]}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({len(picked)} prompts from {len({p[0] for p in picked})} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
