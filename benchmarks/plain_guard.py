"""Plain decoding's regression guard: this tree against a git revision, side by side.

    python benchmarks/plain_guard.py                       # against BASELINE, B = 1 8 32 64
    python benchmarks/plain_guard.py --against HEAD~5 --batches 32 --rounds 3 --json
    python benchmarks/plain_guard.py --check 0.95          # exit 1 if any B runs below 0.95x

For each batch size B: the plain decode step's HLO op count (built as
``benchmarks/step_ops.py`` builds it, counted by this tree's ``specjax.hlo_ops``: older
revisions lack that module, so the guard carries its own copy of the few lines that build the
step; what one step launches on CPU) and plain greedy decoding's tok/s on the bundled model
(the 64 held-out bench prompts in batches of B, 128 new tokens, every prompt bucket compiled
first, the fastest of ``--reps`` passes). Each side runs in a fresh process on its own source
tree (the revision in a temporary git worktree), the sides alternating ``--rounds`` times, so a
slow spell of a shared machine falls on both; each side keeps its fastest round. The ratio
``tok/s this tree / tok/s the revision`` is the guard; op counts are exact.

Both sides are measured by this file's ``measure`` (it needs only ``specjax.load_model``,
``specjax.generate``, ``specjax.bench.bench_prompts`` and ``specjax.engine``'s
``make_engine``/``prefill``/``request_capacity``/``step``, which every revision since
2026-12-05 has).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = "95fe65a"  # plain decoding at B=32 measured 1653 tok/s here, 1.19x transformers (2026-12-05)


def measure(batches: list[int], reps: int) -> dict:
    """In this process: ``{B: {"tok_per_s", "ops"}}`` for the ``specjax`` on ``sys.path``."""
    import time

    import jax.numpy as jnp

    import specjax
    from specjax.advance import KvAdvance
    from specjax.bench import bench_prompts
    from specjax.engine import make_engine, prefill, request_capacity, step

    count_ops = _count_ops()

    bundle = specjax.load_model()
    prompts = bundle.encode_prompts(bench_prompts(64), bos=False)
    out = {}
    for b in batches:
        groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
        for g in groups:  # every prompt bucket compiled before the timed passes
            specjax.generate(bundle.model, g, max_new_tokens=128, drafter=None)
        best = None
        for _ in range(reps):
            t0, n = time.perf_counter(), 0
            for g in groups:
                n += sum(len(t) for t in specjax.generate(bundle.model, g, max_new_tokens=128, drafter=None).tokens)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        eng = make_engine(bundle.model, drafter=None, draft_model=None, depth=3,
                          kv_advance_rule=KvAdvance.PER_SEQUENCE, cache="dense", greedy=True,
                          capacity=request_capacity(64, 128, 0), attention_impl="xla")
        params = {"target": bundle.model.params}
        plen = jnp.full((b,), 40, jnp.int32)
        st = prefill(eng, params, jnp.ones((b, 64), jnp.int32), plen, plen + 128, jnp.full((b,), -1, jnp.int32),
                     jnp.zeros((b,), jnp.uint32))
        ops = count_ops(step.lower(eng, params, st).compile().as_text())
        out[b] = {"tok_per_s": n / best, "ops": sum(ops.values()), "copies": ops.get("copy", 0)}
    return out


def _count_ops():
    """``specjax.hlo_ops.count_ops`` of this tree (plain text processing), for either side: one
    counting rule whatever the revision holds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_guard_hlo_ops", ROOT / "specjax" / "hlo_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.count_ops


def _side(tree: pathlib.Path, batches: list[int], reps: int) -> dict:
    """``measure`` in a fresh process importing ``specjax`` from ``tree`` only."""
    code = ("import sys, json\n"
            "sys.meta_path = [f for f in sys.meta_path if 'Editable' not in repr(f)]\n"  # not the installed checkout
            f"sys.path.insert(0, {str(tree)!r})\n"
            f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
            "from plain_guard import measure\n"
            f"print(json.dumps(measure({batches!r}, {reps})))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_COMPILATION_CACHE_DIR")}
    env["SPECJAX_COMPILATION_CACHE"] = "0"  # every side compiles its own programs
    proc = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(), env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"plain_guard: the run on {tree} failed:\n{proc.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default=BASELINE, help=f"the git revision to compare with (default {BASELINE})")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two sides (each keeps its best)")
    ap.add_argument("--reps", type=int, default=2, help="timed passes per side per round")
    ap.add_argument("--check", type=float, default=None, metavar="RATIO",
                    help="exit 1 if this tree's tok/s / the revision's is below RATIO at any batch size")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the JSON result here")
    args = ap.parse_args()
    if min(args.batches) < 1 or args.rounds < 1 or args.reps < 1:
        ap.error("--batches, --rounds and --reps must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "base"
        got = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.against],
                             capture_output=True, text=True)
        if got.returncode:
            raise SystemExit(f"plain_guard: --against {args.against}: {got.stderr.strip()}")
        try:
            sides: dict[str, dict] = {"this": {}, "base": {}}
            for r in range(args.rounds):
                for name, tree in (("this", ROOT), ("base", base)) if r % 2 == 0 else (("base", base), ("this", ROOT)):
                    print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                    for b, m in _side(tree, args.batches, args.reps).items():
                        keep = sides[name].get(b)
                        if keep is None or m["tok_per_s"] > keep["tok_per_s"]:
                            sides[name][b] = m
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    rows = [{"batch": b, "tok_per_s": sides["this"][b]["tok_per_s"], "base_tok_per_s": sides["base"][b]["tok_per_s"],
             "ratio": sides["this"][b]["tok_per_s"] / sides["base"][b]["tok_per_s"],
             "ops": sides["this"][b]["ops"], "base_ops": sides["base"][b]["ops"],
             "copies": sides["this"][b]["copies"], "base_copies": sides["base"][b]["copies"]} for b in args.batches]
    from specjax.bench import machine

    result = {"against": args.against, "rounds": args.rounds, "reps": args.reps, "machine": machine(), "rows": rows}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"plain decoding, this tree vs {args.against} (bundled model, 64 prompts, 128 new tokens, greedy)")
        print("| B | tok/s | tok/s at base | ratio | step ops | at base | copies | at base |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['tok_per_s']:.0f} | {r['base_tok_per_s']:.0f} | {r['ratio']:.2f}x | {r['ops']} "
                  f"| {r['base_ops']} | {r['copies']} | {r['base_copies']} |")
    low = [r for r in rows if args.check is not None and r["ratio"] < args.check]
    return 1 if low else 0


if __name__ == "__main__":
    raise SystemExit(main())
