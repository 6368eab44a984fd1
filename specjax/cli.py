"""specjax: batched speculative decoding in JAX. Commands: generate (text from the bundled model
or a Hugging Face checkpoint), batch (a JSONL job file), bench (speed, bundled or at a real
model's shape), memory (bytes per device before a run), compile (compiled for a TPU slice from
any machine: fits or not), simulate (the two KV advance rules), train (the bundled model),
train-mtp (an MTP drafter for any model)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specjax.cli_drafter import train_drafter_command

if TYPE_CHECKING:
    from specjax.generation_config import GenerationConfig

__all__ = ["main"]

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


def _is_bundle(path: str | None) -> bool:
    import pathlib

    if path is None or not pathlib.Path(path).exists():
        return True  # the bundle loader reports a missing path
    cfg = pathlib.Path(path) / "config.json"
    try:
        return cfg.is_file() and json.loads(cfg.read_text()).get("format") == "specjax-bundle"
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


class _TextRunner:
    """Text in/out over either a specjax bundle (byte tokenizer) or a HF checkpoint."""

    def __init__(self, args: argparse.Namespace) -> None:
        from specjax.sharding import make_mesh, place

        self.mesh = None if args.mesh is None else make_mesh(*args.mesh)
        if _is_bundle(args.model):
            from specjax.checkpoint import load_model

            if args.draft_model:
                raise ValueError("--draft-model applies to Hugging Face checkpoints; a bundle carries its own")
            flag = next((f for f, v in (("--chat", args.chat), ("--mtp", args.mtp)) if v), None)
            if flag:
                raise ValueError(f"{flag} applies to Hugging Face checkpoints (a bundle carries its own MTP module "
                                 "and no chat template)")
            self.bundle = load_model(args.model, dtype=args.dtype or "float32", mesh=self.mesh)
            self.model, self.draft = self.bundle.model, self.bundle.draft_model
            self.encode = lambda p: self.bundle.tokenizer.encode(p, bos=True)
            self.decode = self.bundle.tokenizer.decode
            self.eos = self.bundle.tokenizer.eos_id
        else:
            from specjax.hf import load_hf_checkpoint, load_tokenizer

            if args.draft_model and pathlib.Path(args.draft_model).exists() and _is_bundle(args.draft_model):
                raise ValueError(f"--draft-model {args.draft_model} is a specjax bundle: a Hugging Face target takes "
                                 "a Hugging Face draft checkpoint with its tokenizer (a bundle carries its own draft "
                                 "model)")
            self.model = load_hf_checkpoint(args.model, dtype=args.dtype, mtp=args.mtp, mesh=self.mesh)
            tok = load_tokenizer(args.model)
            self.draft = load_hf_checkpoint(args.draft_model, dtype=args.dtype, mesh=self.mesh) if args.draft_model \
                else None
            if args.chat and tok.chat_template is None:
                raise ValueError(f"--chat: {args.model} has no chat_template in tokenizer_config.json")
            self.encode = (lambda p: tok.encode_chat([{"role": "user", "content": p}])) if args.chat else tok.encode
            self.decode = tok.decode
            self.eos = tok.eos_id
        if args.draft_checkpoint:
            from specjax.drafter_checkpoints import load_drafter

            if self.mesh is not None:
                raise ValueError("--draft-checkpoint does not run on a --mesh yet (a loaded drafter is not sharded)")
            self.model = load_drafter(args.draft_checkpoint, self.model, dtype=args.dtype)
        from specjax.model import with_layer_loop

        self.model = with_layer_loop(self.model, args.layer_loop)
        self.draft = None if self.draft is None else with_layer_loop(self.draft, args.layer_loop)
        if self.mesh is not None and args.layer_loop == "scan":  # the stacks placed by the table again
            self.model = self.model.replace(params=place(self.model.params, self.mesh))
            self.draft = None if self.draft is None else self.draft.replace(params=place(self.draft.params, self.mesh))


def _drafter(args: argparse.Namespace, run: _TextRunner) -> str | None:
    """``--drafter``; by default the API's rule (``specjax.drafters.default_drafter``)."""
    from specjax.drafters import AUTO, default_drafter

    if args.drafter == "none":
        return None
    return default_drafter(args.drafter or AUTO, run.model, run.draft)


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
        status = _Status(f"compiling for TPU {args.chip}:{args.topology} (a minute or more for an 8B shape) ...",
                         quiet=args.json)
        r = compile_generation(cfg, chip=args.chip, topology=args.topology, mesh=args.mesh, batch=args.batch,
                               context=args.context, prompt=args.prompt,
                               drafter=None if args.drafter == "none" else args.drafter, depth=args.depth, tree=tree,
                               cache=args.cache, dtype=args.dtype, layer_loop=args.layer_loop,
                               attention=args.attention, dump=args.dump)
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


def _read_batch_file(path: str) -> list[str]:
    """One prompt per non-blank line (``\\n`` for a newline); a ``ValueError`` naming the file
    for a missing, unreadable, non-UTF-8 or empty one."""
    from specjax.jobfile import read_text

    text = read_text(path, f"--batch-file {path}", "a file of prompts")
    lines = [line.replace("\\n", "\n") for line in text.split("\n") if line.strip()]
    if not lines:
        raise ValueError(f"--batch-file {path}: holds no prompt (one prompt per non-blank line)")
    return lines


def cmd_memory(args: argparse.Namespace) -> int:
    from specjax.memory import memory_plan, resolve_config

    try:
        cfg = resolve_config(args.config)
        plan = memory_plan(cfg, data=args.mesh[0], model=args.mesh[1], batch=args.batch, context=args.context,
                           prompt=args.prompt, depth=args.depth,
                           drafter=None if args.drafter == "none" else args.drafter,
                           cache=args.cache, dtype=args.dtype)
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


class _Status:
    """Progress on stderr while something slow runs (a compile), cleared by ``done()``: on a
    terminal one transient line at once; elsewhere (a pipe, a log) a line after ``after``
    seconds and one every ``every`` seconds more, so a log shows the wait. ``quiet``
    (``--json``): none."""

    def __init__(self, text: str, quiet: bool = False, after: float = 2.0, every: float = 10.0) -> None:
        import threading
        import time

        self.text, self.t0, self.clock = text, time.perf_counter(), time.perf_counter
        self.tty = not quiet and sys.stderr.isatty()
        self.stop = threading.Event()
        if self.tty:
            sys.stderr.write(text)
            sys.stderr.flush()
        elif not quiet:
            threading.Thread(target=self._lines, args=(after, every), daemon=True, name="specjax-status").start()

    def _lines(self, after: float, every: float) -> None:
        wait = after
        while not self.stop.wait(wait):
            print(f"{self.text} {self.clock() - self.t0:.0f} s", file=sys.stderr, flush=True)
            wait = every

    def done(self) -> None:
        self.stop.set()
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.tty = False


COMPILING = "compiling (once per shape: later runs read the compilation cache) ..."


def _settings(args: argparse.Namespace, run: _TextRunner, drafter) -> GenerationConfig:
    """The generation settings ``generate`` and ``batch`` share, from their flags (checked here:
    a bad value is a one-line error before anything loads or compiles further)."""
    from specjax.generation_config import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, drafter=drafter, depth=args.depth,
                            max_depth=args.max_depth, cost=args.cost, kv_advance=args.kv_advance, cache=args.cache,
                            attention_impl=args.attention, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, eos_id=run.eos, tree=args.tree)


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
        run = _TextRunner(args)
        drafter = _drafter(args, run)
        kw = dict(config=_settings(args, run, drafter), draft_model=run.draft, mesh=run.mesh)
        toks = [run.encode(p) for p in prompts]
        setup(run.model, toks, kw["config"], run.draft, run.mesh)  # every check first: an error is the only line
        t0 = time.perf_counter()
        status = _Status(f"specjax generate: {COMPILING}", quiet=args.json)
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


def _stream_out(chunks, prompts: list[str], decode, status: _Status):
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
    from specjax.jobfile import run_job

    try:
        if args.input == args.out:
            raise ValueError(f"--out {args.out} is the input file")
        run = _TextRunner(args)
        drafter = _drafter(args, run)
        kw = dict(config=_settings(args, run, drafter), draft_model=run.draft, mesh=run.mesh, slots=args.slots,
                  pages=args.pages, prefill_chunk=args.prefill_chunk,
                  prefix_cache=False if args.no_prefix_cache else None)
        return run_job(args, run, kw)
    except (ValueError, CheckpointError, OSError) as e:
        print(f"specjax batch: error: {e}", file=sys.stderr)
        return 2


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
    import pathlib

    from specjax.cli_drafter import training_target
    from specjax.mtp_head import text_corpus, train_mtp
    from specjax.train import StageConfig

    try:
        if args.chain < 1:
            raise ValueError(f"--chain={args.chain} is invalid: must be >= 1")
        model, encode, eos, bytes_only = training_target(args.model, _is_bundle(args.model))
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


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option with a default says it in ``--help`` (unless its help already names one)."""
    for action in parser._actions:  # argparse keeps no public list of actions
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
            continue
        if not action.option_strings or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            continue
        if "default" not in (action.help or ""):
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"


def _mesh_arg(text: str) -> tuple[int, int]:
    """``--mesh DATAxMODEL``."""
    from specjax.sharding import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _depth_arg(text: str) -> int | str:
    """``--depth``: an int, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'auto', got {text!r}") from None


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The model and decoding options ``generate`` and ``batch`` share."""
    p.add_argument("--model", default=None,
                   help="a specjax bundle or a local Hugging Face checkpoint directory (default: checkpoints/default)")
    p.add_argument("--draft-model", default=None, help="checkpoint of a smaller model with the same tokenizer")
    p.add_argument("--draft-checkpoint", default=None, metavar="DIR",
                   help="a drafter's public checkpoint folder for the model (format read from its config.json: "
                        "DFlash -> the block drafter)")
    p.add_argument("--drafter", choices=["mtp", "draft_model", "ngram", "block", "none"], default=None,
                   help="default: mtp if the model has it, else block if it has a block drafter (a bundle's, or "
                        "--draft-checkpoint's), else draft_model if given, else ngram")
    p.add_argument("--depth", type=_depth_arg, default=None,
                   help="drafts per step (default: 3, a preset tree's own, or the block drafter's whole block), or "
                        "'auto': each step picks its window (1 .. --max-depth + 1) and each row its drafts by "
                        "expected tokens per second")
    p.add_argument("--max-depth", type=int, default=3, help="the most drafts --depth auto may propose")
    p.add_argument("--tree", default=None, metavar="K1xK2x...",
                   help="verify a token tree each step instead of a chain: children per node at each draft depth, "
                        "e.g. 2x2x1 (10 nodes, depth 3; the MTP drafter; --depth is the tree's), or dynamic:N,K; "
                        "with --depth auto each step verifies the tree, a chain or none, as the cost table prices them")
    p.add_argument("--cost", default=None, metavar="FILE",
                   help="--depth auto: a step-cost table (JSON: windows, batches, seconds); default: measured at "
                        "warm-up and kept in $SPECJAX_CACHE_DIR (~/.cache/specjax)")
    p.add_argument("--kv-advance", choices=["per_sequence", "cohort"], default=None,
                   help="KV advance rule (default: $SPECJAX_KV_ADVANCE, else per_sequence)")
    p.add_argument("--cache", choices=["dense", "paged"], default=None,
                   help="KV cache layout (default: dense for generate; paged for batch jobs where the model's layers "
                        "are all global, so requests share cached prompt prefixes)")
    p.add_argument("--attention", choices=["auto", "xla", "pallas"], default="auto",
                   help="attention path: Pallas kernels (interpret mode on CPU) or XLA; auto = Pallas on TPU, "
                        "XLA on GPU and CPU (default: auto)")
    p.add_argument("--mesh", type=_mesh_arg, default=None, metavar="DATAxMODEL",
                   help="run on a (data, model) device mesh covering every device, e.g. 4x2: the batch split over "
                        "data, the model over model (README: Many devices, many hosts)")
    p.add_argument("--layer-loop", choices=["unrolled", "scan"], default="unrolled",
                   help="scan: the layers as one lax.scan (compile time flat in depth); unrolled: every layer "
                        "compiled (faster decode on CPU)")
    p.add_argument("--chat", action="store_true",
                   help="Hugging Face checkpoints: each prompt as a user message through the model's chat template")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV caches in this dtype (default: a Hugging Face checkpoint's own; float32 for a "
                        "bundle)")
    p.add_argument("--mtp", default=None, metavar="DIR",
                   help="Hugging Face checkpoints: the MTP module `specjax train-mtp` wrote to DIR (default: the "
                        "checkpoint directory's own, if any)")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``specjax generate: error: ...``, exit 2), like every other
    CLI error; ``--help`` still shows the usage."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _simulate_command(sub) -> None:
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


def _generate_command(sub) -> None:
    """``specjax generate``'s flags."""
    g = sub.add_parser("generate", help="generate text with speculative decoding (default: the bundled model)")
    g.add_argument("prompt", nargs="*", help="prompt text (several: one batch; \\n for a newline)")
    _add_decoding_args(g)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=0.95, help="1 = no top-p filter")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch-file", default=None, help="one prompt per line (\\n for a newline)")
    g.add_argument("--stream", action="store_true", help="print tokens as each step emits them")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_generate)


def _memory_command(sub) -> None:
    """``specjax memory``'s flags."""
    mem = sub.add_parser("memory", help="per-device bytes of a generation on a device mesh, before running it")
    mem.add_argument("--config", default="llama3-8b",
                     help="a named shape (specjax.model.shapes: qwen3-0.6b, llama3.2-1b, gemma3-1b, llama3.1-8b, "
                          "llama3-8b, llama3-70b), a specjax bundle or a Hugging Face checkpoint directory")
    mem.add_argument("--mesh", type=_mesh_arg, default=(1, 1), metavar="DATAxMODEL")
    mem.add_argument("--batch", type=int, default=64, help="rows decoded together (all data shards)")
    mem.add_argument("--context", type=int, default=8192, help="tokens per row: prompt plus new tokens")
    mem.add_argument("--prompt", type=int, default=None, help="prompt tokens per row (default: half the context)")
    mem.add_argument("--depth", type=int, default=3)
    mem.add_argument("--drafter", choices=["mtp", "ngram", "none"], default="ngram")
    mem.add_argument("--cache", choices=["dense", "paged"], default="dense")
    mem.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    mem.add_argument("--json", action="store_true")
    mem.set_defaults(func=cmd_memory)


def _compile_command(sub) -> None:
    """``specjax compile``'s flags."""
    c = sub.add_parser("compile", help="compile a generation for a TPU slice from any machine (libtpu, no TPU): "
                                       "fits or not, temporaries, cache-sized copies")
    c.add_argument("--chip", choices=["v5e", "v5p", "v6e", "v4"], default="v5e")
    c.add_argument("--topology", default="2x2", metavar="AxB", help="the slice's chips (libtpu's smallest: 2x2)")
    c.add_argument("--shape", default="llama3.2-1b",
                   help="a named shape (specjax.model.shapes: qwen3-0.6b, llama3.2-1b, gemma3-1b, llama3.1-8b, ...)")
    c.add_argument("--model", default=None, metavar="DIR",
                   help="a checkpoint's config instead (a specjax bundle or a Hugging Face directory; no weights read)")
    c.add_argument("--mesh", type=_mesh_arg, default=(1, 1), metavar="DATAxMODEL",
                   help="the chips of the slice the generation is sharded over (1x1: one chip)")
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--context", type=int, default=2048, help="tokens per row: prompt plus new tokens")
    c.add_argument("--prompt", type=int, default=None, help="prompt tokens per row (default: half the context)")
    c.add_argument("--drafter", choices=["mtp", "ngram", "none"], default="none")
    c.add_argument("--depth", type=int, default=3)
    c.add_argument("--tree", default=None, metavar="K1xK2x...", help="a token tree (the mtp drafter's preset)")
    c.add_argument("--cache", choices=["dense", "paged"], default="dense")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    c.add_argument("--layer-loop", choices=["unrolled", "scan"], default=None)
    c.add_argument("--attention", choices=["pallas", "xla"], default="pallas")
    c.add_argument("--dump", default=None, metavar="DIR", help="write each program's optimized HLO here")
    c.add_argument("--json", action="store_true", help="one JSON object; exit 1 when it does not fit")
    c.set_defaults(func=cmd_compile)


def _batch_command(sub) -> None:
    """``specjax batch``'s flags."""
    j = sub.add_parser("batch", help="a JSONL job file through continuous batching (resumable)")
    j.add_argument("input", metavar="IN.jsonl",
                   help='one request per line: {"id", "prompt", "max_new_tokens", "temperature", "top_p", "top_k", '
                        '"seed"} (only prompt is required; id defaults to the line number)')
    j.add_argument("--out", required=True, metavar="OUT.jsonl", help="one result line per request, as it completes")
    j.add_argument("--resume", action="store_true", help="skip ids already complete in OUT")
    j.add_argument("--slots", type=int, default=32, help="rows decoded together; a finished row takes the next request")
    _add_decoding_args(j)
    j.add_argument("--pages", type=int, default=None,
                   help="paged pool size in 16-token pages (--cache paged; default: every slot's full capacity)")
    j.add_argument("--max-new-tokens", type=int, default=128, help="for lines without max_new_tokens")
    j.add_argument("--temperature", type=float, default=0.8, help="for lines without temperature; 0 = greedy")
    j.add_argument("--top-k", type=int, default=None)
    j.add_argument("--top-p", type=float, default=0.95, help="for lines without top_p; 1 = no filter")
    j.add_argument("--seed", type=int, default=0, help="lines without a seed derive theirs from this and their id")
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


def _bench_command(sub) -> None:
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


def _train_command(sub) -> None:
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


def _train_mtp_command(sub) -> None:
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


COMMANDS = (  # in --help's order
    _simulate_command,
    _generate_command,
    _memory_command,
    _compile_command,
    _batch_command,
    _bench_command,
    _train_command,
    _train_mtp_command,
    train_drafter_command,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def console() -> None:
    """The ``specjax`` command (and ``python -m specjax``): ``main`` with Ctrl-C handled from the
    first moment (``specjax`` imports nothing heavy before this runs: ``specjax.interrupt``)."""
    from specjax import interrupt

    interrupt.install()
    raise SystemExit(main())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _show_defaults(parser)
    args = parser.parse_args(argv)
    from specjax import interrupt

    interrupt.name(f"specjax {args.command}")
    from specjax.compile_cache import enable_compilation_cache

    enable_compilation_cache()  # the second run of a command compiles nothing ($SPECJAX_COMPILATION_CACHE=0: off)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C in a caller's process (console() leaves before this)
        print(f"\nspecjax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    console()
