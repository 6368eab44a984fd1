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
import re

import jax.numpy as jnp

from specjax import load_model
from specjax.advance import KvAdvance
from specjax.engine import make_engine, prefill, request_capacity, step

FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines (``ENTRY`` under the key ``"ENTRY"``)."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = "ENTRY" if head.group(1) else head.group(2)
            comps[name] = []
        elif line == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps


def count_ops(hlo_text: str) -> collections.Counter:
    """Ops executed by the entry computation, each loop body times its known trip count."""
    comps = _computations(hlo_text)

    def count(name: str) -> collections.Counter:
        ops: collections.Counter = collections.Counter()
        for line in comps[name]:
            m = re.match(r"\s*(?:ROOT )?%\S+ = .*?\s([a-z][a-z0-9\-]*)\(", line)  # the op after the (tuple) type
            if not m or m.group(1) in FREE:
                continue
            if m.group(1) == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                for op, n in count(body).items():
                    ops[op] += n * (int(trips.group(1)) if trips else 1)
            else:
                ops[m.group(1)] += 1
        return ops

    return count("ENTRY")


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
