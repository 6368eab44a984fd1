"""Time ``specjax simulate``: compile, one run after compile, and the full plot sweep.

    python benchmarks/simulate.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax

from specjax.cli import SWEEP_BATCHES
from specjax.sim import simulate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for rule in ("per_sequence", "cohort"):
        t0 = time.perf_counter()
        simulate(128, 3, 200, 0.33, rule, seed=0)
        first = time.perf_counter() - t0
        times = []
        for i in range(args.repeats):
            t0 = time.perf_counter()
            simulate(128, 3, 200, 0.33, rule, seed=i + 1)
            times.append(time.perf_counter() - t0)
        rows.append({"what": f"B=128 d=3 200 steps {rule}", "first_call_s": first,
                     "after_compile_s": sorted(times)[len(times) // 2]})
    t0 = time.perf_counter()
    for rule in ("cohort", "per_sequence"):
        for b in SWEEP_BATCHES:
            simulate(b, 3, 200, 0.33, rule, seed=0)
    sweep = time.perf_counter() - t0
    rows.append({"what": f"plot sweep B in {list(SWEEP_BATCHES)}, both rules (compiles included)",
                 "first_call_s": sweep, "after_compile_s": None})
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
               "backend": jax.default_backend()}
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}))
        return
    print(f"machine: {machine}")
    print(f"{'what':<70} | {'first call s':>12} | {'after compile s':>15}")
    for r in rows:
        ac = "-" if r["after_compile_s"] is None else f"{r['after_compile_s']:.4f}"
        print(f"{r['what']:<70} | {r['first_call_s']:>12.3f} | {ac:>15}")


if __name__ == "__main__":
    main()
