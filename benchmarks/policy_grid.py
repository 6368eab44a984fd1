"""A depth-policy knob in the simulator, against the best fixed window: the makespan rule
(a static batch, 128 tokens a row) with the engine's defaults over a grid of cost tables,
row models and batch sizes, once per value of the knob.

    python benchmarks/policy_grid.py --knob prior_weight --values none,0.5,1,2,4 [--rows beta|ngram]
        [--seeds 2] [--json] [--out FILE]

``--rows beta`` (default): Beta rows, every draft offered, ``DepthPolicy``'s own defaults.
``--rows ngram``: n-gram rows (``specjax.sim.Matches``: drafts only where a row's context
repeats, in runs), with n-gram's ``depth="auto"`` knobs (``DepthPolicy.auto(...,
always_offers=False)``).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from specjax.depth_policy import KNOBS as POLICY_KNOBS
from specjax.depth_policy import CostTable, DepthPolicy
from specjax.sim import Bernoulli, BetaRows, Matches, simulate_fixed, simulate_policy

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import emit, knob_args  # noqa: E402

COSTS = {  # seconds per step at windows 1-4
    "cpu B=8": (3.89, 6.61, 7.54, 8.74),  # measured on the bundled model (2-core CPU)
    "cpu B=1": (1.24, 1.62, 2.14, 2.54),
    "even": (1.0, 1.35, 1.6, 1.85),
    "cheap": (1.0, 1.1, 1.2, 1.3),
    "loss": (1.0, 1.9, 2.8, 3.7),
}
ROWS = {"Beta(7,3) decay 0.9": BetaRows(7.0, 3.0, 0.9), "Beta(2,2)": BetaRows(2.0, 2.0),
        "Beta(0.5,2)": BetaRows(0.5, 2.0), "Beta(9,2)": BetaRows(9.0, 2.0)}
NGRAM_ROWS = {  # accept where matched / share of steps matched / mean run of matched steps (/ per-row shares)
    "p0.7 match 0.4 runs 6": Matches(Bernoulli(0.7), 0.4, 6.0),
    "Beta(4,2) match 0.5 runs 4, c 4": Matches(BetaRows(4.0, 2.0), 0.5, 4.0, 4.0),
    "p0.5 match 0.3 runs 2": Matches(Bernoulli(0.5), 0.3, 2.0),
}
KNOBS = tuple(k for k in POLICY_KNOBS if k != "threshold")  # the ema rule's knob: the grid runs makespan


def main() -> None:
    def extra(ap):
        ap.add_argument("--rows", choices=["beta", "ngram"], default="beta")
        ap.add_argument("--seeds", type=int, default=2)
    a, values, batches = knob_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), KNOBS,
                                   knob="prior_weight", values="none,0.5,1,2,4", batches="1,8,32,64", extra=extra)
    if a.seeds < 1:
        sys.exit("--seeds must be >= 1")
    policy = DepthPolicy((1, 2, 3, 4)) if a.rows == "beta" else DepthPolicy.auto(3, always_offers=False)
    base = dict(tokens=128, **{**policy.knobs(), **a.fixed})
    models = ROWS if a.rows == "beta" else NGRAM_ROWS
    rows = []
    for cname, c in COSTS.items():
        for rname, acc in models.items():
            for b in batches:
                table = CostTable.create((1, 2, 3, 4), [b], [c])
                best = [max(r.tok_per_s for r in simulate_fixed(b, 800, acc, table, seed, **base))
                        for seed in range(a.seeds)]
                for v in values:
                    kw = dict(base)
                    if v is None:
                        kw.pop(a.knob, None)
                    else:
                        kw[a.knob] = v
                    got = [simulate_policy(b, 800, acc, table, "makespan", seed=s, **kw).tok_per_s / best[s]
                           for s in range(a.seeds)]
                    rows.append({"cost": cname, "rows": rname, "batch": b, a.knob: v,
                                 "vs_best_fixed": float(np.mean(got))})
    summary = []
    for v in values:
        x = np.array([r["vs_best_fixed"] for r in rows if r[a.knob] == v])
        summary.append({a.knob: v, "mean": float(x.mean()), "min": float(x.min()),
                        "within_0.95": int((x >= 0.95).sum()), "cells": len(x)})
    if emit(summary + rows, a.out, a.json):
        return
    print(f"makespan / best fixed window, {len(rows) // len(values)} cells ({len(COSTS)} cost tables x "
          f"{len(models)} row models ({a.rows}) x B in {batches}), mean of {a.seeds} seeds")
    for s in summary:
        print(f"{a.knob}={s[a.knob]}: mean {s['mean']:.4f}  min {s['min']:.3f}  "
              f"within 0.95x: {s['within_0.95']}/{s['cells']}")


if __name__ == "__main__":
    main()
