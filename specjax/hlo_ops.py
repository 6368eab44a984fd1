"""HLO op counts of a compiled executable: the ops one call executes, each loop body times its
known trip count, the free ones (parameters, constants, tuples, bitcasts) left out. On CPU
each counted op is one kernel launch (a fusion, a dot, a copy, a scatter...); the at-scale
bench (``specjax.scale``) also uses the count as the launch term of its roofline estimate."""

from __future__ import annotations

import collections
import re

__all__ = ["FREE", "count_ops"]

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
