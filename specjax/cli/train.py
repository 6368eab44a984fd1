"""``specjax train`` (the bundled model) and ``specjax train-mtp`` (an MTP drafter for any model)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from specjax.cli.runner import is_bundle


def cmd_train(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from specjax.train import STAGES, preset, train

    try:
        recipe = preset(args.preset)
        stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
        given = (("batch", args.batch), ("seq_len", args.seq_len), ("lr", args.lr),
                 ("ckpt_every", args.ckpt_every), ("eval_every", args.eval_every))
        overrides = {k: v for k, v in given if v is not None}
        new_stages = {}
        for s in STAGES:
            steps = getattr(args, f"{s}_steps")
            sc = dataclasses.replace(recipe.stages[s], **overrides, **({"steps": steps} if steps is not None else {}))
            new_stages[s] = sc
        recipe = dataclasses.replace(recipe, stages=new_stages,
                                     max_files=args.max_files if args.max_files is not None else recipe.max_files)
        t0 = time.perf_counter()
        summary = train(recipe, args.run_dir, args.out, resume=args.resume, stages=stages, progress=not args.json)
    except (ValueError, FileNotFoundError) as e:
        print(f"specjax train: error: {e}", file=sys.stderr)
        return 2
    summary["wall_s_this_run"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(summary))
        return 0
    for stage, info in summary["stages"].items():
        ev = info.get("final_eval", {})
        print(f"{stage:<7} step {info['step']:>6}  tokens {info['tokens']:>11,}  wall {info['wall_s'] / 60:7.1f} min  "
              f"held-out bits/byte {ev.get('bits_per_byte')}  accuracy {ev.get('accuracy')}")
    for stage, ev in summary.get("held_out_full", {}).items():
        print(f"full held-out set, {stage}: bits/byte {ev['bits_per_byte']}, accuracy {ev['accuracy']}")
    if summary.get("out"):
        print(f"wrote bundle {summary['out']}")
    return 0


def cmd_train_mtp(args: argparse.Namespace) -> int:

    from specjax.cli.drafter import training_target
    from specjax.mtp_head import text_corpus, train_mtp
    from specjax.train import StageConfig

    try:
        if args.chain < 1:
            raise ValueError(f"--chain={args.chain} is invalid: must be >= 1")
        model, encode, eos, bytes_only = training_target(args.model, is_bundle(args.model))
        seq_len = min(args.seq_len, model.config.max_seq_len)
        sc = StageConfig(steps=args.steps, batch=args.batch, seq_len=seq_len, lr=args.lr,
                         warmup=args.warmup if args.warmup is not None else args.steps // 6,
                         eval_every=min(args.eval_every, args.steps), ckpt_every=args.ckpt_every, seed=args.seed)
        if seq_len <= args.chain:
            raise ValueError(f"--seq-len={seq_len} must exceed --chain={args.chain}")
        corpus = text_corpus(args.data, encode, eos_id=eos, min_tokens=seq_len + 1)
        _, summary = train_mtp(model, corpus, args.out, sc, chain=args.chain, resume=args.resume,
                               progress=not args.json, bytes_only=bytes_only, info={"base_model": str(args.model)},
                               draft_vocab=args.draft_vocab)
    except (ValueError, FileNotFoundError) as e:
        print(f"specjax train-mtp: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary))
        return 0
    ev = summary.get("final_eval", {})
    unit = "byte" if bytes_only else "token"
    print(f"mtp step {summary['step']}  tokens {summary['tokens']:,}  wall {summary['wall_s']:.1f} s  held-out "
          f"bits/{unit} per chained pass {ev.get(f'bits_per_{unit}')}  accuracy {ev.get('accuracy')}")
    print(f"wrote {pathlib.Path(args.out) / 'mtp.safetensors'}")
    return 0


def train_command(sub) -> None:
    """``specjax train``'s flags."""
    t = sub.add_parser("train", help="train the target, its MTP module and a draft model on the stdlib corpus")
    t.add_argument("--preset", choices=["default", "smoke"], default="default")
    t.add_argument("--run-dir", default="runs/default", help="orbax training checkpoints and log.jsonl")
    t.add_argument("--out", default=None, help="export the trained bundle here (e.g. checkpoints/default)")
    t.add_argument("--resume", action="store_true", help="continue each stage from its last checkpoint")
    t.add_argument("--stages", default="target,mtp,draft", help="comma-separated subset, in order")
    for stage in ("target", "mtp", "draft"):
        t.add_argument(f"--{stage}-steps", type=int, default=None)
    t.add_argument("--batch", type=int, default=None)
    t.add_argument("--seq-len", type=int, default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--ckpt-every", type=int, default=None)
    t.add_argument("--eval-every", type=int, default=None)
    t.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files")
    t.add_argument("--json", action="store_true", help="no progress bar; print the summary as JSON")
    t.set_defaults(func=cmd_train)


def train_mtp_command(sub) -> None:
    """``specjax train-mtp``'s flags."""
    m = sub.add_parser("train-mtp", help="train an MTP drafting module for any model (target frozen) on your text")
    m.add_argument("--model", required=True, help="a local Hugging Face checkpoint directory or a specjax bundle")
    m.add_argument("--data", nargs="+", required=True, metavar="FILE", help="UTF-8 text files to train on")
    m.add_argument("--out", required=True, metavar="DIR",
                   help="writes mtp.safetensors + mtp_config.json here (the checkpoint directory itself: loaded "
                        "with it; elsewhere: pass --mtp DIR to generate) and the orbax run under DIR/train")
    m.add_argument("--steps", type=int, default=300)
    m.add_argument("--batch", type=int, default=16)
    m.add_argument("--seq-len", type=int, default=256, help="training window (at most the model's max positions)")
    m.add_argument("--lr", type=float, default=2e-3)
    m.add_argument("--warmup", type=int, default=None, help="default: steps // 6")
    m.add_argument("--chain", type=int, default=3, help="chained MTP passes trained (the drafter's depth)")
    m.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="draft over the N most frequent tokens of --data (EAGLE-3's draft vocabulary: the head "
                        "costs N / vocab of the target's); 0: the whole vocabulary")
    m.add_argument("--eval-every", type=int, default=100)
    m.add_argument("--ckpt-every", type=int, default=100)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--resume", action="store_true", help="continue from the last checkpoint under DIR/train")
    m.add_argument("--json", action="store_true", help="no progress bar; print the summary as JSON")
    m.set_defaults(func=cmd_train_mtp)
