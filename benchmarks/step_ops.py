"""HLO op count of one compiled engine step (plain and MTP), on the bundled model.

    python benchmarks/step_ops.py [--json] [--batch 1 32]

Counts the instructions one step executes, leaving out the free ones (parameters,
constants, tuples, bitcasts): on CPU each remaining op is one kernel launch (a fusion, a
dot, a copy, a scatter...), which is what sets a step's cost at small batch. A loop's
body counts once per trip (XLA's known trip count: the layer scan runs its body once per
period of layers); ``while`` itself is not counted. ``copy`` ops of whole caches disappear
when the step donates its state.
"""

from __future__ import annotations

import argparse
import collections
import json

import jax.numpy as jnp

from specjax import load_model
from specjax.advance import KvAdvance
from specjax.engine import make_engine, prefill, request_capacity, step
from specjax.hlo_ops import count_ops


def step_ops(model, drafter: str | None, batch: int, depth: int = 3) -> collections.Counter:
    cap = request_capacity(64, 128, 0 if drafter is None else depth)
    eng = make_engine(model, drafter=drafter, draft_model=None, depth=depth, kv_advance_rule=KvAdvance.PER_SEQUENCE,
                      cache="dense", greedy=True, capacity=cap, attention_impl="xla")
    params = {"target": model.params}
    plen = jnp.full((batch,), 40, jnp.int32)
    st = prefill(eng, params, jnp.ones((batch, 64), jnp.int32), plen, plen + 128, jnp.full((batch,), -1, jnp.int32),
                 jnp.zeros((batch,), jnp.uint32))
    return count_ops(step.lower(eng, params, st).compile().as_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    model = load_model().model
    rows = []
    for drafter in (None, "mtp"):
        for b in args.batch:
            ops = step_ops(model, drafter, b)
            rows.append({"drafter": drafter or "plain", "batch": b, "ops": sum(ops.values()),
                         "by_kind": dict(ops.most_common())})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| step | B | HLO ops | fusion | dot | copy | other |\n|---|---|---|---|---|---|---|")
    for r in rows:
        k = r["by_kind"]
        other = r["ops"] - k.get("fusion", 0) - k.get("dot", 0) - k.get("copy", 0)
        print(f"| {r['drafter']} | {r['batch']} | {r['ops']} | {k.get('fusion', 0)} | {k.get('dot', 0)} | "
              f"{k.get('copy', 0)} | {other} |")


if __name__ == "__main__":
    main()
