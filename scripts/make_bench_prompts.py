"""Regenerate ``specjax/data/bench_prompts.json``: the fixed prompts of ``specjax bench``.

64 snippets of held-out stdlib files (never trained on), each up to ~112 bytes of
whole lines ending right after a ``def ...:`` line, evenly spaced over all candidates.
Committed, so ``specjax bench`` measures the same prompts on every machine.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

from specjax.corpus import is_held_out, stdlib_files

N_PROMPTS = 64
MAX_BYTES = 112


def main() -> int:
    cands = []
    for rel, path in stdlib_files():
        if not is_held_out(rel):
            continue
        data = path.read_bytes()
        for m in re.finditer(rb"\n( *)def [^\n]{0,80}:\n", data):
            end = m.end()
            start = data.find(b"\n", max(0, end - MAX_BYTES)) + 1
            if 0 < start < m.start() + 1 and data[start:end].isascii():
                cands.append((rel, start, data[start:end].decode()))
    if len(cands) < N_PROMPTS:
        print(f"only {len(cands)} candidate prompts", file=sys.stderr)
        return 1
    step = len(cands) / N_PROMPTS
    picked = [cands[int(i * step)] for i in range(N_PROMPTS)]
    out = pathlib.Path(__file__).resolve().parent.parent / "specjax" / "data" / "bench_prompts.json"
    doc = {"about": __doc__.strip().splitlines()[0], "prompts": [
        {"file": rel, "offset": off, "text": text} for rel, off, text in picked]}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({len(picked)} prompts from {len({p[0] for p in picked})} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
