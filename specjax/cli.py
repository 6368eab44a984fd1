"""``specjax`` command line: ``specjax simulate ...``, ``specjax generate ...``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]

SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _acceptance(args: argparse.Namespace):
    from specjax.sim import Bernoulli, BetaRows, PositionDecay

    if args.beta is not None:
        return BetaRows(float(args.beta[0]), float(args.beta[1]), float(args.decay or 1.0))
    if args.decay is not None:
        return PositionDecay(float(args.p), float(args.decay))
    return Bernoulli(float(args.p))


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


def cmd_simulate(args: argparse.Namespace) -> int:
    acc = _acceptance(args)
    config = {
        "batch": args.batch,
        "depth": args.depth,
        "steps": args.steps,
        "seed": args.seed,
        "acceptance": type(acc).__name__,
        "p": None if args.beta is not None else args.p,
        "decay": args.decay,
        "beta": args.beta,
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


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from specjax.hf import generate_text, load_hf_checkpoint, load_tokenizer

    prompts = list(args.prompt)
    if args.batch_file:
        with open(args.batch_file) as f:
            prompts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
    try:
        if not prompts:
            raise ValueError("give a prompt or --batch-file with one prompt per line")
        if args.model is None:
            raise ValueError("--model PATH (a local Hugging Face checkpoint directory) is required")
        model = load_hf_checkpoint(args.model)
        tok = load_tokenizer(args.model)
        draft = load_hf_checkpoint(args.draft_model) if args.draft_model else None
        drafter = None if args.drafter == "none" else args.drafter
        if drafter is None and args.drafter is None:
            drafter = "mtp" if model.config.mtp_depth > 0 else ("draft_model" if draft is not None else "ngram")
        t0 = time.perf_counter()
        texts, res = generate_text(
            model, tok, prompts, max_new_tokens=args.max_new_tokens, drafter=drafter, draft_model=draft,
            depth=args.depth, kv_advance=args.kv_advance, cache=args.cache, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        )
        dt = time.perf_counter() - t0
    except ValueError as e:
        print(f"specjax generate: error: {e}", file=sys.stderr)
        return 2
    m = res.metrics
    n_tok = sum(len(t) for t in res.tokens)
    summary = {"tok_per_step": m["tok_per_step"], "mean_accepted_length": m["mean_accepted_length"],
               "tok_per_s_incl_compile": n_tok / dt, "drafter": m["drafter"], "kv_advance": m["kv_advance"],
               "depth": m["depth"], "new_tokens": n_tok, "seconds": dt}
    if args.json:
        print(json.dumps({"texts": texts, "tokens": res.tokens, "summary": summary, "metrics": m}))
        return 0
    for p, t in zip(prompts, texts, strict=True):
        print(p + t)
        print("-" * 40)
    print(f"{m['drafter']} depth {m['depth']}, {m['kv_advance']}: {m['tok_per_step']:.3f} tok/step, "
          f"mean accepted length {m['mean_accepted_length']:.3f}, {n_tok / dt:.1f} tok/s (incl. compile)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("simulate", help="tok/step of the cohort vs per-sequence KV advance rules")
    s.add_argument("--batch", type=int, default=128)
    s.add_argument("--depth", type=int, default=3, help="drafts per step (window = depth + 1)")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--p", type=float, default=0.33, help="per-draft acceptance probability")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--decay", type=float, default=None, help="position decay: p_k = p * decay**k")
    s.add_argument("--beta", type=float, nargs=2, metavar=("A", "B"), default=None,
                   help="heterogeneous rows: p_i ~ Beta(A, B) (replaces --p)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", metavar="FILE", default=None,
                   help="write a PNG of tok/step vs batch size (1..256) for both rules")
    s.set_defaults(func=cmd_simulate)

    g = sub.add_parser("generate", help="generate text with speculative decoding from a local checkpoint")
    g.add_argument("prompt", nargs="*", help="prompt text (several: one batch)")
    g.add_argument("--model", default=None, help="local Hugging Face checkpoint directory")
    g.add_argument("--draft-model", default=None, help="checkpoint of a smaller model with the same tokenizer")
    g.add_argument("--drafter", choices=["mtp", "draft_model", "ngram", "none"], default=None,
                   help="default: mtp if the model has it, else draft_model if given, else ngram")
    g.add_argument("--depth", type=int, default=3)
    g.add_argument("--kv-advance", choices=["per_sequence", "cohort"], default=None)
    g.add_argument("--cache", choices=["dense", "paged"], default="dense")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-file", default=None, help="one prompt per line (\\n for a newline)")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
