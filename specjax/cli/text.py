"""``specjax generate`` (prompts to text, streamed) and ``specjax batch`` (a JSONL job file)."""

from __future__ import annotations

import argparse
import json
import sys

from specjax.cli.args import add_decoding_args
from specjax.cli.runner import COMPILING, Status, TextRunner, drafter_for, settings_for


def _read_batch_file(path: str) -> list[str]:
    """One prompt per non-blank line (``\\n`` for a newline); a ``ValueError`` naming the file
    for a missing, unreadable, non-UTF-8 or empty one."""
    from specjax.jobfile import read_text

    text = read_text(path, f"--batch-file {path}", "a file of prompts")
    lines = [line.replace("\\n", "\n") for line in text.split("\n") if line.strip()]
    if not lines:
        raise ValueError(f"--batch-file {path}: holds no prompt (one prompt per non-blank line)")
    return lines


def cmd_generate(args: argparse.Namespace) -> int:
    import time

    from specjax.checkpoint import CheckpointError
    from specjax.generation import generate, setup
    from specjax.streaming import stream

    prompts = [p.replace("\\n", "\n") for p in args.prompt]  # a typed backslash-n: a newline
    try:
        empty = [i + 1 for i, p in enumerate(prompts) if not p]
        if empty:
            raise ValueError(f"prompt {empty[0]} is empty: give some text to continue")
        if args.batch_file:
            prompts += _read_batch_file(args.batch_file)
        if not prompts:
            raise ValueError("give a prompt or --batch-file with one prompt per line")
        if args.stream and args.json:
            raise ValueError("--stream and --json cannot be combined")
        run = TextRunner(args)
        drafter = drafter_for(args, run)
        kw = dict(config=settings_for(args, run, drafter), draft_model=run.draft, mesh=run.mesh)
        toks = [run.encode(p) for p in prompts]
        setup(run.model, toks, kw["config"], run.draft, run.mesh)  # every check first: an error is the only line
        t0 = time.perf_counter()
        status = Status(f"specjax generate: {COMPILING}", quiet=args.json)
        try:
            if args.stream:
                res = _stream_out(stream(run.model, toks, **kw), prompts, run.decode, status)
            else:
                res = generate(run.model, toks, **kw)
        finally:
            status.done()
        dt = time.perf_counter() - t0
    except (ValueError, CheckpointError) as e:
        print(f"specjax generate: error: {e}", file=sys.stderr)
        return 2
    texts = [run.decode(t) for t in res.tokens]
    m = res.metrics
    n_tok = sum(len(t) for t in res.tokens)
    summary = {"tok_per_step": m["tok_per_step"], "mean_accepted_length": m["mean_accepted_length"],
               "tok_per_s_incl_compile": n_tok / dt, "drafter": m["drafter"], "kv_advance": m["kv_advance"],
               "depth": m["depth"], "layer_loop": m["layer_loop"], "new_tokens": n_tok, "seconds": dt}
    if "tree" in m:
        summary["tree"] = m["tree"]
    if "window_share" in m:  # depth="auto"
        summary.update(max_depth=m["max_depth"], windows=m["windows"], window_share=m["window_share"],
                       mean_proposed_drafts=m["mean_proposed_drafts"])
    if "tok_per_s" in m:  # generate measures compile and run apart (stream does not)
        summary.update(tok_per_s=m["tok_per_s"], seconds_compile=m["seconds_compile"], seconds_run=m["seconds_run"])
    if args.json:
        print(json.dumps({"texts": texts, "tokens": res.tokens, "summary": summary, "metrics": m}))
        return 0
    if not args.stream:
        for p, t in zip(prompts, texts, strict=True):
            print(p + _printable(t))
            print("-" * 40)
    speed = (f"{m['tok_per_s']:.1f} tok/s (compile {m['seconds_compile']:.1f} s apart)" if "tok_per_s" in m
             else f"{n_tok / dt:.1f} tok/s (incl. compile)")
    shape = f"tree {m['tree']} (depth {m['depth']})" if "tree" in m else f"depth {m['depth']}"
    print(f"{m['drafter']} {shape}, {m['kv_advance']}: {m['tok_per_step']:.3f} tok/step, "
          f"mean accepted length {m['mean_accepted_length']:.3f}, {speed}")
    return 0


def _stream_out(chunks, prompts: list[str], decode, status: Status):
    """Print tokens as they arrive: one prompt streams live; a batch prints row by row at the end.
    ``status`` (the compile line) is cleared when the first chunk arrives."""
    import codecs

    live = len(prompts) == 1
    got: list[list[int]] = [[] for _ in prompts]
    # bytes -> text as they arrive: a cut multi-byte character waits for its last byte, and
    # bytes that are not UTF-8 print as U+FFFD (a model may emit any byte)
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sent = 0  # bytes of the decoded text already fed to the decoder
    for n, ch in enumerate(chunks):
        if n == 0:  # compiled: the prompt, then its tokens as they come
            status.done()
            if live:
                sys.stdout.write(prompts[0])
        for i, t in enumerate(ch.new_tokens):
            got[i] += t
        if live:
            data = decode(got[0]).encode("utf-8", "surrogateescape")
            sys.stdout.write(utf8.decode(data[sent:], final=ch.result is not None))
            sys.stdout.flush()
            sent = len(data)
        if ch.result is not None:
            res = ch.result
    if live:
        print()
        print("-" * 40)
    else:
        for p, t in zip(prompts, got, strict=True):
            print(p + _printable(decode(t)))
            print("-" * 40)
    return res


def _printable(text: str) -> str:
    """Bytes that are not UTF-8 (kept as surrogates by the byte tokenizer) as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def cmd_batch(args: argparse.Namespace) -> int:
    from specjax.checkpoint import CheckpointError
    from specjax.jobfile import JobFiles, run_job

    try:
        if args.input == args.out:
            raise ValueError(f"--out {args.out} is the input file")
        run = TextRunner(args)
        drafter = drafter_for(args, run)
        kw = dict(config=settings_for(args, run, drafter), draft_model=run.draft, mesh=run.mesh, slots=args.slots,
                  pages=args.pages, prefill_chunk=args.prefill_chunk,
                  prefix_cache=False if args.no_prefix_cache else None)
        return run_job(JobFiles(args.input, args.out, getattr(args, "stats", None), args.resume), run, kw,
                       json_out=args.json)
    except (ValueError, CheckpointError, OSError) as e:
        print(f"specjax batch: error: {e}", file=sys.stderr)
        return 2


def generate_command(sub) -> None:
    """``specjax generate``'s flags."""
    g = sub.add_parser("generate", help="generate text with speculative decoding (default: the bundled model)")
    g.add_argument("prompt", nargs="*", help="prompt text (several: one batch; \\n for a newline)")
    add_decoding_args(g)
    g.add_argument("--batch-file", default=None, help="one prompt per line (\\n for a newline)")
    g.add_argument("--stream", action="store_true", help="print tokens as each step emits them")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)


def batch_command(sub) -> None:
    """``specjax batch``'s flags."""
    j = sub.add_parser("batch", help="a JSONL job file through continuous batching (resumable)")
    j.add_argument("input", metavar="IN.jsonl",
                   help='one request per line: {"id", "prompt", "max_new_tokens", "temperature", "top_p", "top_k", '
                        '"seed"} (only prompt is required; id defaults to the line number)')
    j.add_argument("--out", required=True, metavar="OUT.jsonl", help="one result line per request, as it completes")
    j.add_argument("--resume", action="store_true", help="skip ids already complete in OUT")
    j.add_argument("--slots", type=int, default=32, help="rows decoded together; a finished row takes the next request")
    add_decoding_args(j, per_request=True)
    j.add_argument("--pages", type=int, default=None,
                   help="paged pool size in 16-token pages (--cache paged; default: every slot's full capacity)")
    j.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill prompts longer than N tokens N at a time, one chunk in each decode step's forward, "
                        "so a long prompt stalls the running rows for one chunk at a time")
    j.add_argument("--no-prefix-cache", action="store_true",
                   help="with --cache paged, compute every prompt in full (by default a prompt whose head is already "
                        "in the pool as whole pages reuses them, with every drafter on a model whose layers are all "
                        "global)")
    j.add_argument("--stats", metavar="FILE", default=None,
                   help="also write the job's summary as JSON: throughput and latency percentiles (time to first "
                        "token, inter-token, queue wait)")
    j.add_argument("--json", action="store_true", help="no progress bar; print the summary as JSON")
    j.set_defaults(func=cmd_batch)
