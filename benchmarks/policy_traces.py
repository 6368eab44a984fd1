"""A depth-policy knob on real rows, in the simulator, on the bench's prompts and on others.

Each prompt set is decoded once at depth 3 (MTP, greedy, 128 new tokens) and every row's
accepted drafts per step are kept (``metrics["row_accepted_trace"]``). The simulator then
replays those rows (``Trace.from_rows(..., steps=)``: each row's own steps repeated) in static
batches of ``B`` under MTP's ``depth="auto"`` knobs (``DepthPolicy.auto``, the makespan rule,
128 tokens a row), against the best fixed window on the same rows, over the cost tables of
``policy_grid.py`` (with ``--measured``, also each batch's own: MTP's cached ``depth="auto"``
table, as ``policy_steps.py`` finds or measures it), once per value of one knob. Prompt sets:

``bench``, ``recipe`` and ``slices`` (``_report.prompt_set``: the bench's 64 prompts, 64 others
by its recipe, 64 held-out slices cut anywhere).

Each with its ``mixed`` version (every other prompt made repetitive) unless ``--workloads``
says otherwise. A knob tuned on the bench's prompts (``policy_steps.py``) shows here whether
it holds on prompts it was not tuned on. The replay is the simulator's: a trace's step
``t`` is what the row accepted at its ``t``-th depth-3 step, whatever window the policy ran
before it (so it keeps each row's rate and its runs, not the token positions).

    python benchmarks/policy_traces.py --knob shrink --values 0.5,0.75 [--sets bench,recipe,slices]
        [--workloads code,mixed] [--batches 8,32,64] [--measured] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import specjax
from specjax.bench import mixed_prompts
from specjax.depth_policy import KNOBS as POLICY_KNOBS
from specjax.depth_policy import CostTable, DepthPolicy, pooled_acceptance
from specjax.engine import generate
from specjax.sim import Trace, simulate_fixed, simulate_policy

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import PROMPT_SETS, add_priors, emit, knob_args, parse_priors, prompt_set  # noqa: E402
from policy_grid import COSTS  # noqa: E402
from policy_steps import _table  # noqa: E402

KNOBS = tuple(k for k in POLICY_KNOBS if k != "threshold")  # the ema rule's knob: this runs makespan
N, NEW_TOKENS, STEPS = 64, 128, 400


def trace_acceptance(rows: list[list[int]], depth: int, prior: float) -> tuple[float, ...]:
    """``pooled_acceptance`` of rows decoded at ``depth`` (every step proposing ``depth``
    drafts; a step's entry is its accepted count): what a warm-up at the widest window over
    these rows would see, as a prior per draft position (``CostTable.acceptance``)."""
    a = np.concatenate([np.asarray(r, np.int64) for r in rows])
    j = np.arange(depth)[:, None]
    return pooled_acceptance((a[None] > j).sum(1), (a[None] >= j).sum(1), prior)


def main() -> None:
    def extra(ap):
        ap.add_argument("--sets", default=",".join(PROMPT_SETS))
        ap.add_argument("--workloads", default="code,mixed")
        ap.add_argument("--measured", action="store_true", help="add each batch's cached (or measured) MTP table")
        add_priors(ap)
    a, values, batches = knob_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), KNOBS,
                                   knob="shrink", values="0.5,0.75", batches="8,32,64", extra=extra)
    sets, workloads = a.sets.split(","), a.workloads.split(",")
    if not set(sets) <= set(PROMPT_SETS) or not set(workloads) <= {"code", "mixed"} \
            or any(b < 1 or N % b for b in batches):
        sys.exit(f"--sets: {', '.join(PROMPT_SETS)}; --workloads: code, mixed; --batches: divisors of {N}")
    priors = parse_priors(a)
    bundle = specjax.load_model()
    kw = bundle.generate_kwargs({"drafter": "mtp"})
    base = dict(tokens=NEW_TOKENS, **{**DepthPolicy.auto(3, "makespan", always_offers=True).knobs(), **a.fixed})
    rows = []
    for name in sets:
        src = prompt_set(name)
        for wl in workloads:
            prompts = src if wl == "code" else mixed_prompts(src)
            toks = [bundle.encode_prompts([p], bos=False)[0] for p in prompts]
            run = generate(bundle.model, toks, max_new_tokens=NEW_TOKENS, depth=3, **kw)
            traces = run.metrics["row_accepted_trace"]
            for b in batches:
                costs = dict(COSTS, **({"measured": _table(bundle, toks, "mtp", b)} if a.measured else {}))
                measured = trace_acceptance(traces[:b], 3, base["prior"])  # the first group's: the warm-up's
                for cname, c in costs.items():
                    table = CostTable.create((1, 2, 3, 4), [b], [list(c)])
                    for g in range(0, N, b):
                        acc = Trace.from_rows(traces[g:g + b], steps=STEPS)
                        best = max(r.tok_per_s for r in simulate_fixed(b, STEPS, acc, table, **base))
                        for prior, v in [(p, v) for p in priors for v in values]:
                            knobs = {k: x for k, x in base.items() if k != a.knob} if v is None else {**base, a.knob: v}
                            if prior == "measured":
                                knobs["prior"] = measured
                            got = simulate_policy(b, STEPS, acc, table, "makespan", **knobs)
                            rows.append({"set": name, "workload": wl, "cost": cname, "batch": b, "group": g // b,
                                         "prior": prior, a.knob: v, "vs_best_fixed": got.tok_per_s / best})
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    summary = []
    for name in sets:
        for prior, v in [(p, v) for p in priors for v in values]:
            x = np.array([r["vs_best_fixed"] for r in rows
                          if r["set"] == name and r[a.knob] == v and r["prior"] == prior])
            summary.append({"set": name, "prior": prior, a.knob: v, "mean": float(x.mean()), "min": float(x.min()),
                            "within_0.95": int((x >= 0.95).sum()), "cells": len(x)})
    if emit(summary + rows, a.out, a.json):
        return
    tables = len(COSTS) + a.measured
    print(f"makespan / best fixed window on replayed MTP rows ({', '.join(workloads)}; {tables} cost tables; "
          f"B in {batches}, every group of each)")
    print(f"{'set':8} {'prior':>8} {a.knob:>12} {'mean':>7} {'min':>6} {'>=0.95x':>9}")
    for s in summary:
        print(f"{s['set']:8} {s['prior']:>8} {str(s[a.knob]):>12} {s['mean']:>7.4f} {s['min']:>6.3f} "
              f"{s['within_0.95']:>4}/{s['cells']:<4}")


if __name__ == "__main__":
    main()
