"""``specjax simulate``: the two KV advance rules (and depth policies, token trees) in the
tokens-per-step simulator (``specjax.sim``)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _acceptance(args: argparse.Namespace):
    from specjax.sim import Bernoulli, BetaRows, Matches, PositionDecay

    if args.beta is not None:
        acc = BetaRows(float(args.beta[0]), float(args.beta[1]), float(args.decay or 1.0))
    elif args.decay is not None:
        acc = PositionDecay(float(args.p), float(args.decay))
    else:
        acc = Bernoulli(float(args.p))
    if args.match is None:
        return acc
    return Matches(acc, float(args.match), float(args.burst), float(args.match_concentration))


def _match_config(args: argparse.Namespace) -> dict:
    """The ``--match`` settings for a JSON config (none without ``--match``)."""
    if args.match is None:
        return {}
    return {"match": args.match, "burst": args.burst, "match_concentration": args.match_concentration}


def _simulate_rows(batch: int, depth: int, steps: int, acc, seed: int) -> list[dict]:
    from specjax.sim import simulate, simulate_alone

    alone = simulate_alone(batch, depth, steps, acc, seed).tok_per_step
    rows = []
    for rule in ("cohort", "per_sequence"):
        tps = simulate(batch, depth, steps, acc, rule, seed).tok_per_step
        rows.append({"rule": rule, "tok_per_step": tps, "vs_b1": (tps - alone) / alone})
    rows.append({"rule": "alone", "tok_per_step": alone, "vs_b1": 0.0})
    return rows


def _sweep(depth: int, steps: int, acc, seed: int, progress: bool) -> dict[str, list[float]]:
    from tqdm import tqdm

    from specjax.sim import simulate

    out: dict[str, list[float]] = {"cohort": [], "per_sequence": []}
    jobs = [(rule, b) for rule in out for b in SWEEP_BATCHES]
    for rule, b in tqdm(jobs, desc="sweep", disable=not progress, file=sys.stderr):
        out[rule].append(simulate(b, depth, steps, acc, rule, seed).tok_per_step)
    return out


def _plot(path: str, sweep: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rule, ys in sweep.items():
        ax.plot(SWEEP_BATCHES, ys, marker="o", label=rule)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens per step per sequence")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_dir_error(path: str | None) -> str | None:
    """A ``--plot`` path whose folder does not exist, as a one-line message (checked before any work)."""
    if path is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    return None if os.path.isdir(folder) else f"--plot {path}: folder {folder} does not exist"


def _cost_table(spec: str, windows: str):
    """``--cost``: ``roofline:FLOOR,PER_TOKEN`` (seconds = max(FLOOR, PER_TOKEN * rows * window) at
    ``--windows``) or a JSON file (``specjax.auto.CostTable.load``)."""
    from specjax.auto.policy import CostTable

    try:
        wins = tuple(int(w) for w in windows.split(","))
    except ValueError:
        raise ValueError(f"--windows {windows!r}: expected comma-separated ints, e.g. 1,2,4") from None
    if spec.startswith("roofline:"):
        try:
            floor, per_token = (float(x) for x in spec[len("roofline:"):].split(","))
        except ValueError:
            raise ValueError(f"--cost {spec!r}: expected roofline:FLOOR,PER_TOKEN, e.g. roofline:1,0.02") from None
        return CostTable.roofline(floor, per_token, wins)
    return CostTable.load(spec)


def _simulate_policies(args: argparse.Namespace, acc) -> int:
    """``specjax simulate --cost ...``: depth policies side by side in simulated tokens per second."""
    from specjax.auto.policy import DepthPolicy
    from specjax.sim import compare_policies, simulate_policy

    knobs: dict[str, float] = {}
    try:
        table = _cost_table(args.cost, args.windows)
        if args.policy == "compare":
            rows = compare_policies(args.batch, args.steps, acc, table, seed=args.seed, tokens=args.tokens)
        else:
            policy = args.policy
            if policy == "auto":  # the engine's depth="auto": its rule for this kind of run and its knobs
                policy = "makespan" if args.tokens else "goodput"
                # rows that offer every draft asked: an MTP or draft-model run's knobs; rows that
                # draft only where they match (--match): an n-gram run's
                knobs = DepthPolicy.auto(table.windows[-1] - 1, policy, always_offers=args.match is None).knobs()
                if table.acceptance is not None:  # a table with a prior per position: as in the engine
                    knobs["prior"] = table.acceptance
            rows = [simulate_policy(args.batch, args.steps, acc, table, policy, seed=args.seed,
                                    tokens=args.tokens, **knobs).to_dict()]
    except ValueError as e:
        print(f"specjax simulate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"config": {"batch": args.batch, "steps": args.steps, "tokens": args.tokens, "cost": args.cost,
                                     "windows": list(table.windows), "acceptance": type(acc).__name__,
                                     **_match_config(args),
                                     "knobs": knobs or None},  # None: the simulator's defaults
                          "rows": rows}))
        return 0
    run = f"{args.steps} steps" if args.tokens is None else f"{args.tokens} tokens a row (a static batch)"
    print(f"batch {args.batch}, {run}, {type(acc).__name__}, cost {args.cost}, windows {list(table.windows)}")
    if knobs:
        print("the engine's knobs (DepthPolicy): " + ", ".join(f"{k} {v:g}" for k, v in knobs.items()))
    print(f"{'policy':<9} | {'tok/s':>9} | {'tok/step':>8} | {'vs plain':>8} | {'vs best fixed':>13} | window share")
    for r in rows:
        vs_plain = f"{r['vs_plain']:.3f}x" if r.get("vs_plain") else "-"
        vs_best = f"{r['vs_best_fixed']:.3f}x" if "vs_best_fixed" in r else "-"
        share = " ".join(f"{w}:{x:.2f}" for w, x in zip(r["windows"], r["window_share"], strict=True))
        print(f"{r['policy']:<9} | {r['tok_per_s']:>9.3f} | {r['tok_per_step']:>8.3f} | {vs_plain:>8} | "
              f"{vs_best:>13} | {share}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    bad = _plot_dir_error(args.plot)
    if bad:
        print(f"specjax simulate: error: {bad}", file=sys.stderr)
        return 2
    if args.match is None and (args.burst != 1.0 or args.match_concentration != 0.0):
        print("specjax simulate: error: --burst and --match-concentration describe --match RATE's rows: "
              "pass --match", file=sys.stderr)
        return 2
    if args.tree is not None or args.branch_acceptance is not None:
        return _simulate_tree(args)
    acc = _acceptance(args)
    if args.cost is not None:
        return _simulate_policies(args, acc)
    if args.policy != "compare":
        print("specjax simulate: error: --policy needs --cost (the step-cost table the policy trades against)",
              file=sys.stderr)
        return 2
    config = {
        "batch": args.batch,
        "depth": args.depth,
        "steps": args.steps,
        "seed": args.seed,
        "acceptance": type(acc).__name__,
        "p": None if args.beta is not None else args.p,
        "decay": args.decay,
        "beta": args.beta,
        **_match_config(args),
    }
    try:
        rows = _simulate_rows(args.batch, args.depth, args.steps, acc, args.seed)
    except ValueError as e:
        print(f"specjax simulate: error: {e}", file=sys.stderr)
        return 2
    result: dict = {"config": config, "rows": rows}
    if args.plot:
        sweep = _sweep(args.depth, args.steps, acc, args.seed, progress=not args.json)
        _plot(args.plot, sweep, f"depth {args.depth}, {type(acc).__name__}, {args.steps} steps")
        result["plot"] = {"path": args.plot, "batches": list(SWEEP_BATCHES), **sweep}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"batch {args.batch}, depth {args.depth}, {args.steps} steps, {type(acc).__name__}")
    print(f"{'rule':<14} | {'tok/step':>9} | {'vs B=1':>8}")
    print(f"{'-' * 14}-+-{'-' * 9}-+-{'-' * 8}")
    for r in rows:
        print(f"{r['rule']:<14} | {r['tok_per_step']:>9.4f} | {r['vs_b1']:>+8.2%}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _branch_rates(spec: str) -> dict:
    """``--branch-acceptance``: a JSON file of a tree run (``specjax generate --tree ... --json``,
    or its metrics), or rates inline: ranks by commas, levels by semicolons (``0.9,0.5;0.8,0.4``),
    as counts of 1000 tests each (``TreeAcceptance.learn`` reads either)."""
    if pathlib.Path(spec).is_file():
        try:
            return json.loads(pathlib.Path(spec).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--branch-acceptance {spec}: {e}") from None
    try:
        rows = [[float(x) for x in level.split(",")] for level in spec.split(";")]
    except ValueError:
        raise ValueError(f"--branch-acceptance {spec!r} is invalid: a tree run's JSON file, or rates per level "
                         "like '0.9,0.5;0.8,0.4' (ranks by commas, levels by semicolons)") from None
    if any(not 0 <= x <= 1 for r in rows for x in r):
        raise ValueError(f"--branch-acceptance {spec!r} is invalid: rates must lie in [0, 1]")
    k = max(len(r) for r in rows)
    tested = [[1000 if i < len(r) else 0 for i in range(k)] for r in rows]
    return {"branch_tested_count": tested,
            "branch_accepted_count": [[round(1000 * x) for x in r] + [0] * (k - len(r)) for r in rows]}


def _simulate_tree(args: argparse.Namespace) -> int:
    """``specjax simulate --tree 2x2x1 --branch-acceptance RUN.json``: tok/step of a tree under
    both rules beside the chain of its first children, from learned acceptance per branch."""
    from specjax.generation_config import GenerationConfig
    from specjax.sim import TreeAcceptance

    try:
        if args.tree is None or args.branch_acceptance is None:
            raise ValueError("--tree and --branch-acceptance go together: the tree to simulate and the acceptance "
                             "per branch a tree run measured")
        extra = [f for f, on in (("--cost", args.cost is not None), ("--match", args.match is not None),
                                 ("--beta", args.beta is not None), ("--decay", args.decay is not None),
                                 ("--plot", args.plot is not None)) if on]
        if extra:
            raise ValueError(f"--tree simulates tok/step from --branch-acceptance; {extra[0]} does not apply "
                             "(a tree window's cost is the engine's: specjax bench --trees)")
        tree = GenerationConfig(tree=args.tree).tree
        if not isinstance(tree, tuple):
            raise ValueError(f"--tree {args.tree} is invalid: the simulator takes a preset (children per level, "
                             "e.g. 2x2x1)")
        runs = _branch_rates(args.branch_acceptance)
        acc = TreeAcceptance.learn(runs, tree)
        chain = TreeAcceptance.learn(runs, (1,) * len(tree))
        rows = _simulate_rows(args.batch, len(tree), args.steps, acc, args.seed)
        chain_rows = _simulate_rows(args.batch, len(tree), args.steps, chain, args.seed)
    except ValueError as e:
        print(f"specjax simulate: error: {e}", file=sys.stderr)
        return 2
    config = {"batch": args.batch, "steps": args.steps, "seed": args.seed, "tree": list(tree),
              "rates": [[round(float(x), 6) for x in level] for level in acc.rates]}
    if args.json:
        print(json.dumps({"config": config, "rows": rows, "chain_rows": chain_rows}))
        return 0
    print(f"batch {args.batch}, {args.steps} steps, tree {'x'.join(map(str, tree))} "
          f"({len(tree)} levels) vs the chain of its first children, acceptance per branch learned")
    print(f"{'rule':<14} | {'tree tok/step':>13} | {'chain tok/step':>14} | {'tree / chain':>12}")
    print(f"{'-' * 14}-+-{'-' * 13}-+-{'-' * 14}-+-{'-' * 12}")
    for t, c in zip(rows, chain_rows, strict=True):
        print(f"{t['rule']:<14} | {t['tok_per_step']:>13.4f} | {c['tok_per_step']:>14.4f} | "
              f"{t['tok_per_step'] / c['tok_per_step']:>11.3f}x")
    return 0


def simulate_command(sub) -> None:
    """``specjax simulate``'s flags."""
    s = sub.add_parser("simulate", help="tok/step of the cohort vs per-sequence KV advance rules")
    s.add_argument("--batch", type=int, default=128)
    s.add_argument("--depth", type=int, default=3, help="drafts per step (window = depth + 1)")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--p", type=float, default=0.33, help="per-draft acceptance probability")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--decay", type=float, default=None, help="position decay: p_k = p * decay**k")
    s.add_argument("--beta", type=float, nargs=2, metavar=("A", "B"), default=None,
                   help="heterogeneous rows: p_i ~ Beta(A, B) (replaces --p)")
    s.add_argument("--match", type=float, metavar="RATE", default=None,
                   help="n-gram rows: a row offers drafts only at the steps it matches, a share RATE of them "
                        "(specjax.sim.Matches); default: every row offers every step")
    s.add_argument("--burst", type=float, metavar="STEPS", default=1.0,
                   help="with --match: mean steps a match lasts (1: steps independent)")
    s.add_argument("--match-concentration", type=float, metavar="C", default=0.0,
                   help="with --match: each row its own share ~ Beta(RATE*C, (1-RATE)*C); 0: every row RATE")
    s.add_argument("--tree", default=None, metavar="K1xK2x...",
                   help="simulate a token tree (a preset: children per node at each level) with "
                        "--branch-acceptance, beside the chain of its first children")
    s.add_argument("--branch-acceptance", default=None, metavar="RUN.json|RATES",
                   help="with --tree: acceptance per branch, learned from a tree run (`specjax generate --tree ... "
                        "--json` written to a file) or given per level, ranks by commas and levels by semicolons "
                        "(0.9,0.5;0.8,0.4)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", metavar="FILE", default=None,
                   help="write a PNG of tok/step vs batch size (1..256) for both rules")
    s.add_argument("--cost", metavar="SPEC", default=None,
                   help="simulate depth policies in tokens per second against a step-cost table: "
                        "roofline:FLOOR,PER_TOKEN (seconds = max(FLOOR, PER_TOKEN * rows * window)) or a JSON "
                        "file {windows, batches, seconds}")
    s.add_argument("--windows", default="1,2,4", help="verify windows of a roofline --cost (1 = plain decoding)")
    s.add_argument("--policy", choices=["compare", "fixed", "ema", "goodput", "makespan", "auto"],
                   default="compare",
                   help="with --cost: every fixed window, ema and goodput (and makespan with --tokens) side by side "
                        "(compare), or one policy; auto = the engine's depth=\"auto\" (makespan with --tokens, "
                        "else goodput, with DepthPolicy's knobs); the others run with the simulator's defaults")
    s.add_argument("--tokens", type=int, default=None,
                   help="with --cost: a static batch, every row emits TOKENS and the run lasts until the slowest "
                        "is done (--steps bounds it); default: rows never finish (slots refilled)")
    s.set_defaults(func=cmd_simulate)
