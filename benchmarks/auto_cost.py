"""Is depth="auto"'s measured cost table right? Side by side, in one run: the table the engine
measures at warm-up (``generate``'s settings: each window forced for the whole generation,
interleaved rounds) and each window forced for a whole generation again (prefill subtracted),
on the bundled model.

    python benchmarks/auto_cost.py --batch 64 --drafter mtp [--json] [--out FILE]

``--repeat N``: how stable is the table? It is measured N times with ``generate``'s settings
("whole") and N times as ``stream`` and batch jobs measure (8 widest-window steps, then
24-step slices, 2 interleaved rounds: "slice"), alternating, and each window's cost over
window 1's is printed as a range.
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

import specjax
from specjax.bench import bench_prompts
from specjax.engine import (
    SLICES,
    _compiled,
    _setup,
    _timed_generate,
    auto_state,
    measure_cost,
    placeholder_cost,
    warm_steps,
)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import emit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--drafter", choices=["mtp", "ngram"], default="mtp")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeat", type=int, default=0)
    a = ap.parse_args()
    bundle = specjax.load_model()
    toks = bundle.encode_prompts(bench_prompts(a.batch), bos=False)
    b = len(toks)
    eng, params, args = _setup(bundle.model, toks, a.max_new_tokens, a.drafter, None, "auto", None, "dense", 0.0, None,
                               None, list(range(b)), None, 3, "auto", 3, None)
    auto = auto_state(eng, placeholder_cost(eng, b), b)
    run, _ = _compiled(eng, params, (*args, auto, jnp.int32(eng.max_steps)))

    def timed(k, warm, n):
        return _timed_generate(run, params, args, auto, k, warm, n)

    whole = dict(steps=eng.max_steps)  # generate's settings
    slice_ = dict(SLICES, warm=warm_steps(a.max_new_tokens), baseline=True)  # stream's, a batch job's slices
    if a.repeat:
        ratios = {"whole": [], "slice": []}
        for i in range(2 * a.repeat):
            name = ("whole", "slice")[(i + i // 2) % 2]  # whole, slice, slice, whole, ...: neither always first
            t = np.asarray(measure_cost(eng, b, timed, **(whole if name == "whole" else slice_)).seconds)[0]
            ratios[name].append((t / t[0]).tolist())
        rows = [{"how": n, "window": w, "min_ratio": float(np.min(np.asarray(r)[:, k])),
                 "max_ratio": float(np.max(np.asarray(r)[:, k])), "tables": len(r)}
                for n, r in ratios.items() for k, w in enumerate(eng.windows)]
        if emit(rows, a.out, a.json):
            return
        print(f"B={b}, {a.drafter}: cost of each window over window 1's, {a.repeat} tables each way")
        for r in rows:
            print(f"{r['how']:>6} window {r['window']}: {r['min_ratio']:.2f}x - {r['max_ratio']:.2f}x")
        return
    table = np.asarray(measure_cost(eng, b, timed, **whole).seconds)[0]
    prefill = min(timed(0, 0, 0)[0] for _ in range(3))
    rows = []
    for k, w in enumerate(eng.windows):
        t, n = min(timed(k, 0, eng.max_steps) for _ in range(2))
        rows.append({"window": w, "measured_ms": 1000 * float(table[k]), "whole_run_ms": 1000 * (t - prefill) / n,
                     "whole_run_steps": n})
    for r in rows:
        r["measured_vs_whole"] = r["measured_ms"] / r["whole_run_ms"]
    if emit(rows, a.out, a.json):
        return
    print(f"B={b}, {a.drafter}, {a.max_new_tokens} new tokens; prefill {1000 * prefill:.0f} ms")
    print(f"{'window':>6} {'measured ms':>12} {'whole run ms':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['window']:>6} {r['measured_ms']:>12.2f} {r['whole_run_ms']:>13.2f} {r['measured_vs_whole']:>6.2f}")


if __name__ == "__main__":
    main()
