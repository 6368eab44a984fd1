"""``depth="auto"`` policies compared without a clock: the bench's prompts are decoded
(greedy, so the steps are deterministic) at every fixed depth and under the drafter's own
``depth="auto"`` policy (``DepthPolicy.auto``, generate's makespan rule) with each value of one
knob, and each run is priced as its steps at each window times one cost
table (seconds per step per window, the one ``depth="auto"`` measured for that batch and
cached on disk). Every configuration is priced by the same table, so the ratios carry none of
a shared machine's timing noise; what they leave out is how far the table is from the true
step costs (and a static batch's finished rows cost their slots in both).

    python benchmarks/policy_steps.py --knob relax --values 0.0003,0.01 [--drafters mtp,ngram]
        [--batches 1,8,32,64] [--workloads code,mixed] [--prompts bench] [--json] [--out FILE]

``--prompts recipe`` or ``slices`` prices prompts the bench does not use (``_report.prompt_set``):
what was tuned on the bench's prompts, checked on others. ``--priors fixed,measured`` runs auto
also with a prior per draft position (``CostTable.acceptance``: the first group's depth-3
verdicts pooled, as a warm-up at the widest window would see them); ``--with k=v`` holds other
knobs.

Tables come from ``$SPECJAX_CACHE_DIR/costs.json`` (``specjax bench`` leaves them there; a
missing one is measured first, as ``depth="auto"`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

import specjax
from specjax.bench import mixed_prompts
from specjax.depth_policy import KNOBS, CostTable, DepthPolicy, cost_cache_path, pooled_acceptance
from specjax.engine import generate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _report import PROMPT_SETS, add_priors, emit, knob_args, parse_priors, prompt_set  # noqa: E402

WINDOWS = (1, 2, 3, 4)
NEW_TOKENS = 128


def _table(bundle, toks, drafter: str, batch: int) -> np.ndarray:
    """The cached cost table of ``depth="auto"`` for this drafter and batch (measured now if absent)."""
    def lookup():
        path = cost_cache_path()
        found = {}
        for entry in (json.loads(path.read_text()).values() if path.exists() else []):
            key = entry["key"]
            if f"name='{drafter}'" in key["engine"] and key["shapes"][0][0] == batch \
                    and tuple(entry["windows"]) == WINDOWS and "rule='makespan'" in key["engine"]:
                found[(key["v"], key["shapes"][0][1])] = entry["seconds"][0]
        return found[max(found)] if found else None  # the newest measurement's, the widest prompt bucket's
    table = lookup()
    if table is None:
        generate(bundle.model, toks[:batch], max_new_tokens=NEW_TOKENS, depth="auto", max_depth=3,
                 **bundle.generate_kwargs({"drafter": drafter}))
        table = lookup()
    return np.asarray(table)


def main() -> None:
    def extra(ap):
        ap.add_argument("--drafters", default="mtp,ngram")
        ap.add_argument("--workloads", default="code,mixed")
        ap.add_argument("--prompts", choices=PROMPT_SETS, default="bench")
        add_priors(ap)
    a, values, batches = knob_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), KNOBS,
                                   knob="relax", values="0.0003,0.01", batches="1,8,32,64", extra=extra)
    try:
        if None in values:
            raise ValueError("every value must be a number")
        # each drafter's own depth="auto" policy (generate's: makespan), the knob set to each value
        policies = {d: {v: dataclasses.replace(DepthPolicy.auto(3, "makespan", always_offers=d != "ngram"),
                                               **a.fixed, **{a.knob: v}) for v in values} for d in ("mtp", "ngram")}
        for by_value in policies.values():
            for p in by_value.values():
                p.check(3)
    except ValueError as e:
        sys.exit(f"--values: {e}")
    drafters, workloads, priors = a.drafters.split(","), a.workloads.split(","), parse_priors(a)
    if not set(drafters) <= {"mtp", "ngram"} or not set(workloads) <= {"code", "mixed"} \
            or any(b < 1 or 64 % b for b in batches):
        sys.exit("--drafters: mtp, ngram; --workloads: code, mixed; --batches: divisors of 64")
    bundle = specjax.load_model()
    rows = []
    src = prompt_set(a.prompts)
    for wl in workloads:
        prompts = src if wl == "code" else mixed_prompts(src)
        toks = [bundle.encode_prompts([p], bos=False)[0] for p in prompts]
        plain_kw = bundle.generate_kwargs({"drafter": None})
        for d in drafters:
            kw = bundle.generate_kwargs({"drafter": d})
            for b in batches:
                c = _table(bundle, toks, d, b)
                groups = [toks[i:i + b] for i in range(0, len(toks), b)]
                # plain's steps counted too (the prefill emits the first token: 127 steps for 128 tokens)
                secs = {"plain": c[0] * sum(generate(bundle.model, g, max_new_tokens=NEW_TOKENS, **plain_kw)
                                            .metrics["steps"] for g in groups)}
                for k in (1, 2, 3):
                    runs = [generate(bundle.model, g, max_new_tokens=NEW_TOKENS, depth=k, **kw).metrics
                            for g in groups]
                    secs[f"depth {k}"] = c[k] * sum(m["steps"] for m in runs)
                    if k == 3:  # a warm-up at the widest window on the first group would see these verdicts
                        first = runs[0]
                best = min(secs, key=secs.get)
                measured = pooled_acceptance(first["accepted_per_position_count"],
                                             first["verdicts_per_position_count"], DepthPolicy.auto(3).prior)
                for prior in priors:
                    cost = CostTable.create(WINDOWS, [b], [c.tolist()], measured if prior == "measured" else None)
                    for v, pol in policies[d].items():
                        steps = np.zeros(len(WINDOWS))
                        for g in groups:
                            m = generate(bundle.model, g, max_new_tokens=NEW_TOKENS, depth=pol, max_depth=3,
                                         cost=cost, **kw).metrics
                            steps += np.asarray(m["window_share"]) * m["steps"]
                        t = float(steps @ c)
                        rows.append({"workload": wl, "drafter": d, "batch": b, "prior": prior, a.knob: v,
                                     "acceptance_prior": m["acceptance_prior"], "best_fixed": best,
                                     "vs_best_fixed": secs[best] / t, "vs_plain": secs["plain"] / t,
                                     "window_share": (steps / steps.sum()).round(3).tolist(),
                                     "fixed_vs_plain": {k: secs["plain"] / s for k, s in secs.items()}})
                        print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if emit(rows, a.out, a.json):
        return
    cols = [(p, v) for p in priors for v in values]
    print(f"auto priced by its steps x the cached cost table, vs the best of plain and depths 1-3 (same pricing); "
          f"{a.knob} = {values}, priors {priors}")
    print(f"{'workload':8} {'drafter':7} {'B':>3} {'best fixed':>10}  "
          + "  ".join(f"{p} {v:g}".rjust(16) for p, v in cols))
    for i in range(0, len(rows), len(cols)):
        r = rows[i]
        cells = "  ".join(f"{x['vs_best_fixed']:.3f} / {x['vs_plain']:.3f}".rjust(16) for x in rows[i:i + len(cols)])
        print(f"{r['workload']:8} {r['drafter']:7} {r['batch']:>3} {r['best_fixed']:>10}  {cells}")
    for p, v in cols:
        x = [r for r in rows if r[a.knob] == v and r["prior"] == p]
        print(f"{p} prior, {a.knob}={v:g}: within 0.95x of the best fixed at "
              f"{sum(r['vs_best_fixed'] >= 0.95 for r in x)}/{len(x)}, at or above plain at "
              f"{sum(r['vs_plain'] >= 1.0 for r in x)}/{len(x)}, mean {np.mean([r['vs_best_fixed'] for r in x]):.3f} "
              "of the best fixed")


if __name__ == "__main__":
    main()
