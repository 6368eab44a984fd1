"""``specjax train-drafter``: train a drafter for a frozen target. ``--kind block``: the block
drafter (``specjax.train_block``), written into a bundle that carries it; ``--kind eagle3``: an
EAGLE-3 head (``specjax.mtp_head.train_mtp(layout="eagle3")``) for a bundle or a Hugging Face
checkpoint, written in the public EAGLE-3 layout (``--draft-checkpoint OUT`` loads it)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

KINDS = ("block", "eagle3")


def _is_bundle(path: str) -> bool:
    """Is ``path`` a specjax bundle (its ``config.json`` says so)?"""
    cfg = pathlib.Path(path) / "config.json"
    try:
        return cfg.is_file() and json.loads(cfg.read_text()).get("format") == "specjax-bundle"
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def training_target(path: str, bundle: bool):
    """A frozen target to train a drafter for, and how its text is read: ``(model, encode, eos,
    bytes_only)`` of a specjax bundle (``bundle``) or a Hugging Face checkpoint (float32)."""
    if bundle:
        from specjax.checkpoint import load_model

        b = load_model(path)
        tok = b.tokenizer
        return b.model, (lambda t: tok.encode(t, bos=True)), tok.eos_id, True
    from specjax.hf import load_hf_checkpoint, load_tokenizer

    if not pathlib.Path(path).is_dir():
        raise ValueError(f"--model {path}: not a directory")
    model = load_hf_checkpoint(path, dtype="float32", mtp=None)
    tok = load_tokenizer(path)
    return model, tok.encode, (tok.eos_ids[0] if tok.eos_ids else None), False


def _train_eagle3(args: argparse.Namespace) -> dict:
    """``--kind eagle3``: the target frozen, the head trained on the target's own text."""
    from specjax.mtp_head import text_corpus, train_mtp
    from specjax.train import StageConfig

    if args.chain < 1:
        raise ValueError(f"--chain={args.chain} is invalid: must be >= 1")
    from specjax.corpus import build_corpus

    bundle = _is_bundle(args.model)
    model, encode, eos, bytes_only = training_target(args.model, bundle)
    default_corpus = build_corpus if bundle else None
    seq_len = min(args.seq_len, model.config.max_seq_len)
    if seq_len <= args.chain:
        raise ValueError(f"--seq-len={seq_len} must exceed --chain={args.chain}")
    taps = None
    if args.taps:
        try:
            taps = tuple(int(x) for x in args.taps.split(","))
        except ValueError:
            raise ValueError(f"--taps={args.taps!r} is invalid: comma-separated target layer indices") from None
    sc = StageConfig(steps=args.steps, batch=args.batch, seq_len=seq_len, lr=args.lr,
                     warmup=args.warmup if args.warmup is not None else args.steps // 6,
                     eval_every=min(args.eval_every, args.steps), ckpt_every=args.ckpt_every, seed=args.seed)
    if args.data:
        corpus = text_corpus(args.data, encode, eos_id=eos, min_tokens=seq_len + 1)
    elif default_corpus is not None:
        corpus = default_corpus()
    else:
        raise ValueError("--kind eagle3 on a Hugging Face checkpoint needs --data FILE ... (text the target reads)")
    _, summary = train_mtp(model, corpus, args.out, sc, chain=args.chain, resume=args.resume,
                           progress=not args.json, bytes_only=bytes_only, info={"base_model": str(args.model)},
                           draft_vocab=args.draft_vocab, layout="eagle3", taps=taps)
    return summary


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from specjax.checkpoint import CheckpointError, load_model, save_bundle
    from specjax.corpus import build_corpus
    from specjax.mtp_head import text_corpus
    from specjax.train import StageConfig
    from specjax.train_block import train_block

    if args.kind == "eagle3":
        try:
            summary = _train_eagle3(args)
        except (ValueError, FileNotFoundError) as e:
            print(f"specjax train-drafter: error: {e}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(summary, default=str))
            return 0
        ev = summary.get("final_eval", {})
        print(f"eagle3 step {summary['step']}  wall {summary['wall_s']:.1f} s  held-out accuracy per chained pass "
              f"{ev.get('accuracy')}")
        if "out" in summary:
            print(f"wrote {args.out} (the EAGLE-3 layout: --draft-checkpoint {args.out})")
        return 0
    try:
        if args.block < 2:
            raise ValueError(f"--block={args.block} is invalid: a block of at least 2 positions (one draft)")
        if not _is_bundle(args.model):
            raise ValueError(f"--model {args.model}: not a specjax bundle (train-drafter --kind block takes bundles "
                             "for now; Hugging Face checkpoints are not supported yet)")
        bundle = load_model(args.model)
        model, tok = bundle.model, bundle.tokenizer
        seq_len = min(args.seq_len, model.config.max_seq_len)
        if args.prompt + args.block >= seq_len:
            raise ValueError(f"--prompt={args.prompt} + --block={args.block} must be below --seq-len={seq_len}")
        sc = StageConfig(steps=args.steps, batch=args.batch, seq_len=seq_len, lr=args.lr,
                         warmup=args.warmup if args.warmup is not None else args.steps // 16,
                         eval_every=min(args.eval_every, args.steps), ckpt_every=args.ckpt_every, seed=args.seed)
        corpus = (build_corpus() if not args.data else
                  text_corpus(args.data, lambda t: tok.encode(t, bos=True), eos_id=tok.eos_id, min_tokens=seq_len + 1))
        run = pathlib.Path(args.run_dir or f"{args.out}.run")
        trained, summary = train_block(model, corpus, run, sc, block_size=args.block, layers=args.layers,
                                       sequences=args.sequences, prompt=args.prompt, resume=args.resume,
                                       progress=not args.json)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"specjax train-drafter: error: {e}", file=sys.stderr)
        return 2
    if summary["step"] >= sc.steps:
        training = dict(bundle.meta.get("training", {}))
        training.setdefault("stages", {})["block"] = summary
        save_bundle(args.out, trained, bundle.draft_model, dtype=bundle.meta.get("dtype", "bfloat16"),
                    training=training)
        summary["out"] = str(args.out)
    if args.json:
        print(json.dumps(summary))
        return 0
    ev = summary.get("final_eval", {})
    print(f"block step {summary['step']}  wall {summary['wall_s']:.1f} s  held-out accuracy per block position "
          f"{[round(a, 3) for a in ev.get('accuracy', [])]}")
    if "out" in summary:
        print(f"wrote {args.out} (drafter='block')")
    return 0


def train_drafter_command(sub) -> None:
    """``specjax train-drafter``'s flags."""
    m = sub.add_parser("train-drafter", help="train a drafter for a frozen target (--kind block: one pass drafts a "
                                             "whole block, into a bundle; --kind eagle3: an EAGLE-3 head in its "
                                             "public layout, for a bundle or a Hugging Face checkpoint)")
    m.add_argument("--kind", choices=KINDS, required=True)
    m.add_argument("--model", required=True, help="the target, frozen: a specjax bundle (--kind eagle3: or a Hugging "
                                                  "Face checkpoint)")
    m.add_argument("--out", required=True, metavar="DIR",
                   help="block: the bundle with the trained drafter (overwritten); eagle3: the head's folder")
    m.add_argument("--run-dir", default=None, metavar="DIR", help="the orbax run (default: OUT.run)")
    m.add_argument("--data", nargs="*", metavar="FILE",
                   help="UTF-8 text files whose prompts the target continues (default: the bundle's corpus)")
    m.add_argument("--block", type=int, default=8, help="block positions k: k - 1 drafts per pass")
    m.add_argument("--chain", type=int, default=3, help="eagle3: chained passes trained (training-time test)")
    m.add_argument("--draft-vocab", type=int, default=0, help="eagle3: draft over the corpus's N most frequent "
                                                               "tokens (0: the whole vocabulary)")
    m.add_argument("--taps", default=None, help="eagle3: the target layers whose outputs the head reads, e.g. 0,2,5 "
                                                "(default: an early, a middle and a late layer)")
    m.add_argument("--layers", type=int, default=2, help="the drafter's decoder layers")
    m.add_argument("--sequences", type=int, default=2048, help="greedy continuations of the target to train on")
    m.add_argument("--prompt", type=int, default=32, help="corpus tokens before each continuation")
    m.add_argument("--steps", type=int, default=800)
    m.add_argument("--batch", type=int, default=16)
    m.add_argument("--seq-len", type=int, default=256)
    m.add_argument("--lr", type=float, default=2e-3)
    m.add_argument("--warmup", type=int, default=None, help="default: steps // 16")
    m.add_argument("--eval-every", type=int, default=200)
    m.add_argument("--ckpt-every", type=int, default=200)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--resume", action="store_true", help="continue from the last checkpoint of the run")
    m.add_argument("--json", action="store_true", help="no progress bar; print the summary as JSON")
    m.set_defaults(func=cmd_train_drafter)
