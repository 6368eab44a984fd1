"""``specjax memory``, ``specjax compile`` and ``specjax bench``: what a run needs, whether it
fits a TPU slice, and how fast it goes."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import TYPE_CHECKING

from specjax.cli.args import mesh_arg
from specjax.cli.runner import Status

if TYPE_CHECKING:
    pass


def cmd_compile(args: argparse.Namespace) -> int:
    """``specjax compile``: the prefill and the decode step compiled for a TPU slice (libtpu's
    compile-only client): fits or not, temporaries, cache-sized copies, Mosaic kernels."""
    from specjax.tpu_compile import GIB, INSTALL, compile_generation, has_libtpu

    if not has_libtpu():
        print(f"specjax compile: {INSTALL}", file=sys.stderr)
        return 2
    from specjax.generation_config import tree_setting
    from specjax.memory import resolve_config

    status = None
    try:
        cfg = resolve_config(args.model or args.shape)
        tree = tree_setting(args.tree)
        status = Status(f"compiling for TPU {args.chip}:{args.topology} (a minute or more for an 8B shape) ...",
                         quiet=args.json)
        r = compile_generation(cfg, chip=args.chip, topology=args.topology, mesh=args.mesh, batch=args.batch,
                               context=args.context, prompt=args.prompt,
                               drafter=None if args.drafter == "none" else args.drafter, depth=args.depth, tree=tree,
                               cache=args.cache, dtype=args.dtype, layer_loop=args.layer_loop,
                               attention=args.attention, dump=args.dump, block=args.block,
                               block_layers=args.block_layers)
    except (ValueError, RuntimeError) as e:
        if status is not None:
            status.done()
        print(f"specjax compile: error: {e}", file=sys.stderr)
        return 2
    status.done()
    r = {"shape": args.model or args.shape, **r}
    if args.json:
        print(json.dumps(r))
        return 0 if r["fits"] else 1
    print(f"{r['shape']} on TPU {args.chip} ({r['device_kind']}), mesh {r['mesh']} of {args.chip}:{args.topology}, "
          f"batch {r['batch']}, context {r['context']}, {r['dtype']}, drafter {r['drafter']}, "
          f"attention {r['attention']}")
    for name in r["programs"]:
        p = r[name]
        if not p["compiled"]:
            print(f"  {name:<12} does not compile ({p['seconds']} s): {p['error'][:200]}")
            continue
        copies = f", cache-sized copies {len(p['cache_sized_copies'])}" if name == "decode_step" else ""
        print(f"  {name:<12} compiled in {p['seconds']} s: arguments {p['argument_bytes'] / GIB:.2f} GiB, "
              f"temporaries {p['temp_bytes'] / GIB:.3f} GiB, Mosaic kernels {p['mosaic_calls']}{copies}")
        for t in p["largest_temporaries"][:3]:
            print(f"      {t['array']:<44}{t['bytes'] / 2**20:10.1f} MiB")
    print(r["verdict"])
    return 0 if r["fits"] else 1


def cmd_memory(args: argparse.Namespace) -> int:
    from specjax.memory import memory_plan, resolve_config

    try:
        cfg = resolve_config(args.config)
        plan = memory_plan(cfg, data=args.mesh[0], model=args.mesh[1], batch=args.batch, context=args.context,
                           prompt=args.prompt, depth=args.depth,
                           drafter=None if args.drafter == "none" else args.drafter,
                           cache=args.cache, dtype=args.dtype, block=args.block, block_layers=args.block_layers)
    except ValueError as e:
        print(f"specjax memory: error: {e}", file=sys.stderr)
        return 2
    out = plan.to_dict()
    if args.json:
        print(json.dumps({"config": args.config, **out}))
        return 0
    gib = lambda n: f"{n / 2**30:9.3f} GiB"  # noqa: E731
    print(f"{args.config} on a {args.mesh[0]}x{args.mesh[1]} mesh (data x model), batch {args.batch}, context "
          f"{args.context} (cache capacity {plan.capacity}), {args.dtype}, KV heads per model shard "
          f"{plan.kv_heads // args.mesh[1]}: per device")
    for name in ("params", "kv_cache", "drafter", "rows", "step_activation", "prefill_activation", "total"):
        print(f"  {name:<20}{gib(out[name])}")
    return 0


def _int_list(arg: str, text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{arg} {text!r} is invalid: a comma-separated list of ints >= 1")
    return out


def cmd_bench_shape(args: argparse.Namespace) -> int:
    """``specjax bench --shape NAME --random``: the at-scale bench (``specjax.scale``)."""
    from specjax.generation_config import GenerationConfig
    from specjax.scale import bench_shape, table

    try:
        if not args.random:
            raise ValueError(f"--shape {args.shape}: only random weights in that shape are benchmarked: add --random")
        drafters = [x.strip() for x in (args.drafters or "mtp,ngram,draft_model").split(",") if x.strip()]
        for d in drafters:
            if d not in ("mtp", "ngram", "draft_model"):
                raise ValueError(f"--drafters {args.drafters!r} is invalid: each must be mtp, ngram or draft_model")
        if not 1 <= args.depth <= 7:
            raise ValueError(f"--depth {args.depth} is invalid: must lie in [1, 7]")
        if args.draft_vocab < 0:
            raise ValueError(f"--draft-vocab {args.draft_vocab} is invalid: must be >= 0")
        if args.draft_vocab and "mtp" in drafters:  # MTP over the draft vocabulary beside the full one
            drafters.insert(drafters.index("mtp") + 1, "mtp:dv")
        rows = [("none", 0)] + [(d, k) for d in drafters
                                for k in (range(1, args.depth + 1) if d.startswith("mtp") else [args.depth])]
        for t in (args.trees or "").split():  # tree rows: a preset for the MTP rows, a dynamic tree for each drafter
            if t.endswith("+auto"):
                raise ValueError(f"--trees {t}: --shape benches fixed trees (no +auto)")
            spec, _, d = t.partition("@")
            if d and not d.isdigit():
                raise ValueError(f"--trees {t} is invalid: a tree, then @D (its depth) for a dynamic tree")
            tree = GenerationConfig(tree=spec).tree  # a bad tree: its one error, before anything runs
            preset = isinstance(tree, tuple)
            depth = len(tree) if preset else int(d or args.depth)
            rows += [(x, depth, spec) for x in drafters if x.startswith("mtp") or not preset]
        result = bench_shape(args.shape, dtype=args.dtype, batches=_int_list("--batches", args.batches or "1,4"),
                             prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens or 64, rows=rows,
                             acceptance=args.acceptance, rounds=args.rounds or 2, seed=args.seed,
                             roofline=not args.no_roofline, progress=not args.json, draft_vocab=args.draft_vocab,
                             layer_loop=args.shape_layer_loop, breakdown_parts=args.breakdown)
    except ValueError as e:
        print(f"specjax bench: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else table(result))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specjax.bench import bench, plot, plot_depth, table
    from specjax.checkpoint import CheckpointError, load_model

    if args.shape is not None:
        return cmd_bench_shape(args)
    try:
        batches = _int_list("--batches", args.batches or "1,8,32,64")
        drafters = [x.strip() for x in (args.drafters or "mtp,draft_model,ngram").split(",") if x.strip()]
        bundle = load_model(args.model)
        result = bench(bundle, batches=batches, drafters=drafters, depth=args.depth,
                       max_new_tokens=args.max_new_tokens or 128, n_prompts=args.prompts, progress=not args.json,
                       temperatures=[float(x) for x in args.temperatures.split(",") if x.strip()],
                       workloads=[x.strip() for x in args.workloads.split(",") if x.strip()], rounds=args.rounds or 1,
                       trees=(args.trees or "").split())
    except (ValueError, CheckpointError) as e:
        print(f"specjax bench: error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
        stem = pathlib.Path(args.plot)
        depth_png = str(stem.with_name(f"{stem.stem}_depth{stem.suffix or '.png'}"))
        if plot_depth(result, depth_png, min(result["settings"]["temperatures"])):
            result["plot_depth"] = depth_png
    if args.json:
        print(json.dumps(result))
        return 0
    print(table(result))
    for key in ("plot", "plot_depth"):
        if key in result:
            print(f"wrote {result[key]}")
    return 0


def memory_command(sub) -> None:
    """``specjax memory``'s flags."""
    mem = sub.add_parser("memory", help="per-device bytes of a generation on a device mesh, before running it")
    mem.add_argument("--config", default="llama3-8b",
                     help="a named shape (specjax.model.shapes: qwen3-0.6b, llama3.2-1b, gemma3-1b, llama3.1-8b, "
                          "llama3-8b, llama3-70b), a specjax bundle or a Hugging Face checkpoint directory")
    mem.add_argument("--mesh", type=mesh_arg, default=(1, 1), metavar="DATAxMODEL")
    mem.add_argument("--batch", type=int, default=64, help="rows decoded together (all data shards)")
    mem.add_argument("--context", type=int, default=8192, help="tokens per row: prompt plus new tokens")
    mem.add_argument("--prompt", type=int, default=None, help="prompt tokens per row (default: half the context)")
    mem.add_argument("--depth", type=int, default=None, help="default: 3; with --drafter block the whole block")
    mem.add_argument("--drafter", choices=["mtp", "ngram", "block", "none"], default="ngram")
    block_flags(mem)
    mem.add_argument("--cache", choices=["dense", "paged"], default="dense")
    mem.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    mem.add_argument("--json", action="store_true")
    mem.set_defaults(func=cmd_memory)


def block_flags(p: argparse.ArgumentParser) -> None:
    """``--block`` and ``--block-layers``: the block drafter ``--drafter block`` sizes or compiles."""
    p.add_argument("--block", type=int, default=16, metavar="K",
                   help="--drafter block on a shape without one: a DFlash-style drafter of K positions")
    p.add_argument("--block-layers", type=int, default=1, metavar="N", help="... and N layers shaped like the target's")


def compile_command(sub) -> None:
    """``specjax compile``'s flags."""
    c = sub.add_parser("compile", help="compile a generation for a TPU slice from any machine (libtpu, no TPU): "
                                       "fits or not, temporaries, cache-sized copies")
    c.add_argument("--chip", choices=["v5e", "v5p", "v6e", "v4"], default="v5e")
    c.add_argument("--topology", default="2x2", metavar="AxB", help="the slice's chips (libtpu's smallest: 2x2)")
    c.add_argument("--shape", default="llama3.2-1b",
                   help="a named shape (specjax.model.shapes: qwen3-0.6b, llama3.2-1b, gemma3-1b, llama3.1-8b, ...)")
    c.add_argument("--model", default=None, metavar="DIR",
                   help="a checkpoint's config instead (a specjax bundle or a Hugging Face directory; no weights read)")
    c.add_argument("--mesh", type=mesh_arg, default=(1, 1), metavar="DATAxMODEL",
                   help="the chips of the slice the generation is sharded over (1x1: one chip)")
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--context", type=int, default=2048, help="tokens per row: prompt plus new tokens")
    c.add_argument("--prompt", type=int, default=None, help="prompt tokens per row (default: half the context)")
    c.add_argument("--drafter", choices=["mtp", "ngram", "block", "none"], default="none")
    c.add_argument("--depth", type=int, default=None,
                   help="drafts per step (default 3; with --drafter block the whole block)")
    block_flags(c)
    c.add_argument("--tree", default=None, metavar="K1xK2x...", help="a token tree (the mtp drafter's preset)")
    c.add_argument("--cache", choices=["dense", "paged"], default="dense")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    c.add_argument("--layer-loop", choices=["unrolled", "scan"], default=None)
    c.add_argument("--attention", choices=["pallas", "xla"], default="pallas")
    c.add_argument("--dump", default=None, metavar="DIR", help="write each program's optimized HLO here")
    c.add_argument("--json", action="store_true", help="one JSON object; exit 1 when it does not fit")
    c.set_defaults(func=cmd_compile)


def bench_command(sub) -> None:
    """``specjax bench``'s flags."""
    b = sub.add_parser("bench", help="plain vs cohort vs per_sequence on the bundled model, all drafters; "
                                     "--shape NAME --random: at a real model's shape")
    b.add_argument("--model", default=None, help="specjax bundle (default: checkpoints/default)")
    b.add_argument("--batches", default=None, help="default 1,8,32,64 (--shape: 1,4)")
    b.add_argument("--drafters", default=None, help="default mtp,draft_model,ngram")
    b.add_argument("--depth", type=int, default=3)
    b.add_argument("--trees", default=None, metavar="'T1 T2'",
                   help="token-tree rows beside the chains (per_sequence), space-separated: presets (2x2x1, the "
                        "mtp drafter's) and dynamic trees drafted to the bench's --depth or to D (dynamic:8,2@5, "
                        "every drafter's); ending +auto, the tree under --depth auto (each step the tree, a chain "
                        "or plain decoding, as the cost table prices them). With --shape: fixed trees, acceptance "
                        "per branch from --acceptance")
    b.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (--shape: 64)")
    b.add_argument("--prompts", type=int, default=None, help="use the first N of the 64 fixed prompts")
    b.add_argument("--rounds", type=int, default=None,
                   help="timed passes (interleaved, each row keeps its fastest); default 1 (--shape: 2)")
    b.add_argument("--shape", default=None, metavar="NAME",
                   help="bench at a named shape (specjax.model.shapes: qwen3-0.6b, llama3.2-1b, gemma3-1b, "
                        "llama3.1-8b, ...) with random weights and controlled acceptance (needs --random)")
    b.add_argument("--random", action="store_true", help="--shape: random weights (what is measured is cost)")
    b.add_argument("--layer-loop", dest="shape_layer_loop", choices=["scan", "unrolled"], default=None,
                   help="--shape: the layers as one scan (compile time flat in depth and window: use it for tree "
                        "rows on CPU) or unrolled (the faster decode on XLA:CPU; the default)")
    b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="--shape: weight dtype")
    b.add_argument("--prompt-len", type=int, default=512, help="--shape: prompt tokens per row")
    b.add_argument("--acceptance", default="bundled",
                   help="--shape: bundled (the bundled MTP head's per-position rates), bundled-traces, iid:P, "
                        "rates:P1,P2,...")
    b.add_argument("--seed", type=int, default=0, help="--shape: weights and prompts")
    b.add_argument("--no-roofline", action="store_true", help="--shape: skip the compiled steps' cost analysis")
    b.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="--shape: also MTP rows over an N-token draft vocabulary (mtp:dv); 0: none")
    b.add_argument("--breakdown", action="store_true",
                   help="--shape: also time each row's step parts on their own (draft, the window's forward, "
                        "verification, the drafter's commit, the commit, the loop): where a step's time goes")
    b.add_argument("--temperatures", default="0,0.8",
                   help="0 = greedy; a sampled row uses top-p 0.95 and per-prompt seeds")
    b.add_argument("--workloads", default="code,mixed",
                   help="code: the held-out prompts; mixed: every other one repetitive (n-gram friendly)")
    b.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")
    b.add_argument("--plot", metavar="FILE", default=None,
                   help="PNG of tok/step and tok/s vs batch size (and FILE_depth.png: fixed depths vs auto)")
    b.set_defaults(func=cmd_bench)
