"""Speed at real model shapes: random weights in a named shape, acceptance under control.

``specjax bench --shape qwen3-0.6b --random`` (``bench_shape``): for each batch size, plain
decoding and every drafter configuration run the same prompts through the engine's own
jitted prefill and decode loop. Drafts come from ``specjax.controlled``: the real drafter
runs (its cost is paid) and its proposals are replaced by the target's own greedy
continuation, corrupted to follow an acceptance profile, so tok/step is known and the wall
time is what the engine costs at that acceptance. **It measures cost, not draft quality.**

Per batch it reports, side by side in one run (interleaved rounds, each configuration's
fastest decode kept; prefill excluded):

* ``ms_per_step``, ``tok_per_step``, ``speedup`` (tok/s over plain decoding's) and whether
  the tokens equal plain decoding's;
* ``forward_ms[w]``: the target's own ``w``-token forward (every layer, the LM head over the
  ``w`` positions, argmax, the cache write) in a loop of its own, and ``head_ms`` (the LM head
  over one position per row): what a step of window ``w`` needs at the least;
* ``step_over_forward`` = ``ms_per_step / forward_ms[w]``: what drafting, verification and
  bookkeeping add (1.0: nothing);
* ``efficiency`` = ``speedup / (tok_per_step * plain_ms / forward_ms[w])``: the measured
  speedup over the one the window's forward allows (1.0: drafting and bookkeeping free);
* ``breakdown_ms`` (``breakdown_parts``): where a step's time goes. The step's own parts
  (draft, verify, commit, the drafter's commit) each run in a loop of their own, like
  ``forward(w)``, and are split into ``PARTS``, which sum to ``ms_per_step``;
* plain decoding's weight-read rate against the machine's read bandwidth (measured at start);
* a roofline per configuration: the compiled step's bytes and flops (XLA's cost analysis)
  and op count, turned into a predicted step time on H100, H200, TPU v5e and v6e.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.acceptance_profile import acceptance_profile, expected_tree_tokens, trace_rows, tree_profile
from specjax.controlled import Controlled, control_data, expected_tokens_per_step, oracle_rows
from specjax.model import LAYER_LOOPS, Model, ModelConfig, init_model, with_layer_loop
from specjax.model.shapes import draft_shape, shape
from specjax.roofline import DEVICES, gather_overcount, predict, roofline
from specjax.step_parts import (
    PARTS,
    breakdown,
    copy_tree,
    decode,
    forward,
    forward_loop,
    head,
    part_timers,
    time_on_copy,
)
from specjax.tree import tree_reach

__all__ = ["DEVICES", "PARTS", "ROWS", "acceptance_profile", "bench_shape", "breakdown", "expected_tree_tokens",
           "gather_overcount", "predict", "random_models", "read_bandwidth", "table", "tree_profile"]

# (drafter, depth): the configurations a shape is benchmarked in (plain first: every ratio's base)
ROWS: tuple[tuple[str, int], ...] = (("none", 0), ("mtp", 1), ("mtp", 2), ("mtp", 3), ("ngram", 3),
                                     ("draft_model", 3))



# ----------------------------------------------------------------------------- machine and models


def read_bandwidth(n_bytes: int = 1 << 30, repeat: int = 5) -> dict:
    """This backend's measured memory bandwidth: a sum over ``n_bytes`` of float32 (reads) and
    ``x + 1`` (a read and a write per element), fastest of ``repeat``; bytes/s."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    read, copy = jax.jit(jnp.sum), jax.jit(lambda a: a + 1.0)
    out = {}
    for name, fn, moved in (("read", read, n_bytes), ("copy", copy, 2 * n_bytes)):
        jax.block_until_ready(fn(x))
        best = np.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_bytes_per_s"] = moved / best
    del x
    return out


def random_models(name_or_config: str | ModelConfig, dtype: str = "float32", seed: int = 0,
                  draft: bool = True) -> tuple[Model, Model | None]:
    """Random-weight target (with its MTP module) and draft model in a named shape
    (``specjax.model.shapes``) or a given config (its draft: half the width, 4 layers)."""
    if isinstance(name_or_config, str):
        cfg, dcfg = shape(name_or_config), draft_shape(name_or_config)
    else:
        cfg = name_or_config
        dcfg = dataclasses.replace(cfg, mtp_depth=0, n_layers=min(cfg.n_layers, 2))
    dt = jnp.dtype(dtype)
    target = init_model(cfg, seed=seed, dtype=dt)
    return target, (init_model(dcfg, seed=seed + 1, dtype=dt) if draft else None)


def _param_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------- the bench


def _row_tree(row: tuple):
    """A bench row ``(drafter, depth)`` or ``(drafter, depth, tree)``: its tree (a preset tuple or
    a ``DynamicTree``; ``None`` for a chain), checked against its drafter and depth."""
    if len(row) == 2 or row[2] is None:
        return None
    from specjax.generation_config import GenerationConfig

    drafter, depth, spec = row
    if drafter == "none":
        raise ValueError(f"row {row!r} is invalid: a tree needs a drafter")
    tree = GenerationConfig(tree=spec).tree
    if isinstance(tree, tuple) and (not drafter.startswith("mtp") or len(tree) != depth):
        raise ValueError(f"row {row!r} is invalid: a preset tree is the MTP head's, drafted to its own depth "
                         f"({len(tree)})")
    return tree


def _row_name(row: tuple) -> str:
    return f"{row[0]} depth {row[1]}" + (f" tree {row[2]}" if len(row) > 2 and row[2] is not None else "")


def _engine(target, draft, drafter: str, depth: int, capacity: int, data, tree=None):
    from specjax.advance import KvAdvance
    from specjax.engine import make_engine

    inner = None if drafter == "none" else drafter.split(":")[0]  # "mtp:dv": MTP over the draft vocabulary
    spec = None if inner is None else Controlled(inner, data)
    eng = make_engine(target, drafter=spec, draft_model=draft if inner == "draft_model" else None,
                      depth=max(depth, 1), kv_advance_rule=KvAdvance.PER_SEQUENCE, cache="dense", greedy=True,
                      capacity=capacity, attention_impl="auto", tree=tree)
    params = {"target": target.params}
    if eng.draft is not None:
        params["draft"] = draft.params
    if spec is not None:
        params["drafter"] = data
    return eng, params


def _check(batches, layer_loop, prompt_len: int, max_new_tokens: int, rows, draft_vocab: int,
           name_or_config) -> tuple[tuple, dict]:
    """``bench_shape``'s arguments checked before anything compiles: ``(rows, trees)``, plain
    decoding's row first."""
    for b in batches:
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"batches={list(batches)} is invalid: each must be an int >= 1")
    if layer_loop is not None and layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop={layer_loop!r} is invalid: must be one of {list(LAYER_LOOPS)}")
    if prompt_len < 1 or max_new_tokens < 1:
        raise ValueError(f"prompt_len={prompt_len} / max_new_tokens={max_new_tokens} are invalid: must be >= 1")
    rows = tuple(tuple(r) for r in rows)
    if not rows or rows[0] != ("none", 0):
        rows = (("none", 0), *[r for r in rows if r != ("none", 0)])
    trees = {r: _row_tree(r) for r in rows}
    for row in rows:
        drafter, depth = row[:2]
        if drafter not in ("none", "mtp", "mtp:dv", "ngram", "draft_model") or not 0 <= depth <= 7:
            raise ValueError(f"row ({drafter!r}, {depth}) is invalid: drafter none|mtp|mtp:dv|ngram|draft_model, "
                             "depth 0-7")
        if drafter == "mtp:dv" and not draft_vocab:
            raise ValueError("rows ('mtp:dv', d) need draft_vocab > 0")
    if isinstance(name_or_config, str):
        shape(name_or_config)  # an unknown name fails before anything runs
    return rows, trees


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every batch size of a ``bench_shape`` run shares."""

    target: Model
    draft: Model | None
    target_dv: Model | None  # the target over the draft vocabulary (rows "mtp:dv")
    rows: tuple
    trees: dict
    branch: dict  # tree row -> acceptance per branch
    rates: list
    trace: list | None
    prompt_len: int
    max_new_tokens: int
    reach: int  # the farthest slot past a row's length a step writes
    dtype: str
    rounds: int
    log: Callable[[str], None]


def _models(name_or_config, dtype: str, seed: int, rows, models, layer_loop, draft_vocab: int):
    """``(target, draft, target over the draft vocabulary)`` for a run, laid out as asked."""
    target, draft = models if models is not None else random_models(
        name_or_config, dtype, seed, draft=any(r[0] == "draft_model" for r in rows))
    if layer_loop is not None:
        target = with_layer_loop(target, layer_loop)
        draft = None if draft is None else with_layer_loop(draft, layer_loop)
    target_dv = None
    if draft_vocab:
        from specjax.model import with_draft_vocab

        target_dv = with_draft_vocab(target, np.arange(draft_vocab))
    return target, draft, target_dv


def bench_shape(name_or_config: str | ModelConfig, *, dtype: str = "float32", batches: Sequence[int] = (1, 4),
                prompt_len: int = 512, max_new_tokens: int = 64, rows: Sequence[tuple[str, int]] = ROWS,
                acceptance: str = "bundled", rounds: int = 2, seed: int = 0,
                roofline: bool | Sequence[int] = True, bandwidth: bool = True, progress: bool = True,
                models: tuple | None = None, draft_vocab: int = 0, layer_loop: str | None = None,
                breakdown_parts: bool | Sequence[int] = False) -> dict:
    """The at-scale bench (module docstring). ``models``: ``(target, draft)`` already built
    (default: ``random_models``). ``draft_vocab = N``: rows ``("mtp:dv", d)`` run the MTP module
    over an ``N``-token draft vocabulary (``ModelConfig.mtp_draft_vocab``; the first ``N`` ids: the
    cost is what is measured). ``roofline``: compile each row's single step for its cost analysis
    (a second compile per row), at every batch size or at those listed. Returns ``{"settings",
    "machine", "bandwidth", "weight_bytes", "batches": [...]}``. ``layer_loop``: the models'
    layers laid out for ``"scan"`` (one layer body compiled: at a real shape XLA:CPU's compile of
    a wide window's unrolled forward can take tens of minutes) or ``"unrolled"`` (the faster
    decode on XLA:CPU); ``None``: as built. ``breakdown_parts``: also time each row's step parts on
    their own (``breakdown``; one more compile of the window's forward per row) and report where
    its step's time goes, at every batch size or at those listed."""
    from specjax.bench import machine

    rows, trees = _check(batches, layer_loop, prompt_len, max_new_tokens, rows, draft_vocab, name_or_config)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    log(f"{len(rows) * len(list(batches))} runs ({len(rows)} rows x {len(list(batches))} batch sizes), each "
        "compiling and timing a step at this shape: about a minute or more each on a 2-core CPU at qwen3-0.6b's "
        "shape (a breakdown, trees and larger batches take longer; fewer drafters, depths or batches shorten the run)")
    max_depth = max(r[1] for r in rows)
    reach = max(tree_reach(trees[r], r[1]) for r in rows)
    profile = acceptance_profile(acceptance, max(max_depth, 1))
    branch = {r: tree_profile(acceptance, trees[r], r[1], profile["rates"]) for r in rows if trees[r] is not None}
    t0 = time.perf_counter()
    target, draft, target_dv = _models(name_or_config, dtype, seed, rows, models, layer_loop, draft_vocab)
    cfg = target.config
    if prompt_len + max_new_tokens + 2 * (reach + 1) > cfg.max_seq_len:
        raise ValueError(f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens} does not fit the shape's "
                         f"max_seq_len {cfg.max_seq_len}")
    log(f"models built in {time.perf_counter() - t0:.1f} s")
    setup = _Setup(target, draft, target_dv, rows, trees, branch, profile["rates"], profile["trace"], prompt_len,
                   max_new_tokens, reach, dtype, rounds, log)
    out = {"settings": {"shape": name_or_config if isinstance(name_or_config, str) else "custom",
                        "config": cfg.to_dict(), "dtype": dtype, "batches": list(batches), "prompt_len": prompt_len,
                        "max_new_tokens": max_new_tokens, "acceptance": acceptance, "rates": profile["rates"],
                        "replayed_traces": profile["trace"] is not None, "rounds": rounds, "seed": seed,
                        "draft_vocab": draft_vocab, "layer_loop": layer_loop,
                        "branch_rates": {_row_name(r): b for r, b in branch.items()},
                        "rows": [list(r) for r in rows]},
           "machine": machine(), "weight_bytes": _param_bytes({k: v for k, v in target.params.items() if k != "mtp"}),
           "draft_weight_bytes": None if draft is None else _param_bytes(draft.params),
           "mtp_weight_bytes": _param_bytes(target.params.get("mtp", {})), "batches": []}
    if bandwidth:
        out["bandwidth"] = read_bandwidth()
        log(f"read bandwidth {out['bandwidth']['read_bytes_per_s'] / 1e9:.1f} GB/s")
    rng = np.random.default_rng(seed)
    for b in batches:
        prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(b)]
        costed = roofline if isinstance(roofline, bool) else b in roofline
        parted = breakdown_parts if isinstance(breakdown_parts, bool) else b in breakdown_parts
        out["batches"].append(_bench_batch(setup, prompts, costed, parted, out.get("bandwidth"), out["weight_bytes"]))
    return out


def _bench_batch(setup: _Setup, prompts: list, costed: bool, parted: bool, bandwidth: dict | None,
                 weights: int) -> dict:
    """One batch size of ``bench_shape``: build, time side by side, report."""
    from specjax.engine import prompt_bucket, request_capacity

    b = len(prompts)
    width = prompt_bucket(prompts)
    capacity = request_capacity(width, setup.max_new_tokens, setup.reach)  # one capacity: comparable forwards
    runs = _compile_rows(setup, prompts, width, capacity)
    timed = _timers(setup, runs, b, parted)
    best = _fastest(timed, setup.rounds, lambda r: setup.log(f"B={b} round {r + 1}/{setup.rounds} done"))
    for key, run in runs.items():
        run["seconds"] = best[key]
    return _batch_report(setup, runs, best, capacity, costed, parted, bandwidth, weights)


def _compile_rows(setup: _Setup, prompts: list, width: int, capacity: int) -> dict[tuple, dict]:
    """Every row's engine, prefilled state and decode (compiled and run once: its tokens and
    metrics). Plain decoding runs first: its tokens are the oracle the drafters' proposals
    come from."""
    from specjax.engine import prefill
    from specjax.metrics import metrics, tokens

    s, b = setup, len(prompts)
    toks = np.zeros((b, width), np.int32)
    toks[:, : s.prompt_len] = np.asarray(prompts)
    plen = np.full((b,), s.prompt_len, np.int32)
    args = (jnp.asarray(toks), jnp.asarray(plen), jnp.asarray(plen + s.max_new_tokens),
            jnp.full((b,), -1, jnp.int32), jnp.arange(b, dtype=jnp.uint32))
    max_depth = max(r[1] for r in s.rows)
    data, plain_tokens, runs = None, None, {}
    for row in s.rows:
        drafter, depth = row[:2]
        t1 = time.perf_counter()
        row_data = data if s.trees[row] is None else dataclasses.replace(data, branch=jnp.asarray(s.branch[row]))
        eng, params = _engine(s.target_dv if drafter == "mtp:dv" else s.target, s.draft, drafter, depth, capacity,
                              row_data, s.trees[row])
        st0 = jax.block_until_ready(prefill(eng, params, *args))
        final = jax.block_until_ready(decode(eng, params, copy_tree(st0)))  # compiles, and the tokens
        got = tokens(final)
        if drafter == "none":  # the oracle every drafter's proposals come from
            oracle = oracle_rows(prompts, got, capacity + max_depth + 2)
            data = control_data(oracle, s.rates, trace_rows(s.trace, b))
            plain_tokens = got
        runs[row] = {"eng": eng, "params": params, "st0": st0, "window": eng.window,
                     "metrics": metrics(final, eng, 0), "same": got == plain_tokens}
        s.log(f"B={b} {_row_name(row)}: compiled and warmed in {time.perf_counter() - t1:.1f} s")
    return runs


def _timers(setup: _Setup, runs: dict, b: int, parted: bool) -> dict[Any, tuple[Callable, Any, float]]:
    """``key -> (fn, arg, n)``, each compiled: every row's decode, the target's own ``w``-token
    forward per window and the LM head alone (``n`` calls a run), and with ``parted`` each row's
    step parts."""
    base, n_fwd, target = runs[("none", 0)], 8, setup.target
    cache, tok = base["st0"].cache, base["st0"].seq[:, setup.prompt_len]
    timed: dict[Any, tuple[Callable, Any, float]] = {
        key: (functools.partial(decode, run["eng"], run["params"]), run["st0"], 1.0) for key, run in runs.items()}
    for w in sorted({run["window"] for run in runs.values()}):
        fn = functools.partial(forward, base["eng"].target, base["eng"].attention_impl, w, n_fwd, target.params)
        timed[("forward", w)] = (lambda c, fn=fn, tok=tok: fn(c, tok), cache, n_fwd)
    x = jnp.zeros((b, target.config.d_model), target.params["embed"].dtype)
    timed[("head", 1)] = (functools.partial(head, base["eng"].target, n_fwd, target.params), x, n_fwd)
    if parted:
        for key, run in runs.items():
            for name, (fn, arg) in part_timers(run["eng"], run["params"], run["st0"], n_fwd).items():
                timed[("part", key, name)] = (fn, arg, n_fwd)
        setup.log(f"B={b}: step parts compiled")
    for key, (fn, arg, _) in timed.items():
        if key[0] in ("forward", "head"):  # compile
            jax.block_until_ready(fn(copy_tree(arg)))
    return timed


def _fastest(timed: dict, rounds: int, done: Callable[[int], None]) -> dict:
    """Each entry's fastest seconds per call over ``rounds`` interleaved rounds, the order
    rotating so that a slow spell falls on different entries."""
    best = dict.fromkeys(timed, np.inf)
    order = list(timed)
    for r in range(rounds):
        for key in order[r % len(order):] + order[: r % len(order)]:
            fn, arg, n = timed[key]
            best[key] = min(best[key], time_on_copy(fn, arg) / n)
        done(r)
    return best


def _batch_report(setup: _Setup, runs: dict, best: dict, capacity: int, costed: bool, parted: bool,
                  bandwidth: dict | None, weights: int) -> dict:
    """One batch size's figures: per row and for plain decoding's forwards."""
    base, cfg = runs[("none", 0)], setup.target.config
    b = base["st0"].seq.shape[0]
    plain_ms = 1e3 * base["seconds"] / max(base["metrics"]["steps"], 1)
    plain_tps = base["metrics"]["emitted"] / base["seconds"]
    fwd = {key[1]: 1e3 * s for key, s in best.items() if key[0] == "forward"}
    head_ms = 1e3 * best[("head", 1)]
    setup.log(f"B={b}: forwards {', '.join(f'w={w} {ms:.1f} ms' for w, ms in fwd.items())}, head {head_ms:.1f} ms")
    rows_out = []
    for key, run in runs.items():
        row = _row_report(setup, key, run, plain_ms, plain_tps, fwd)
        if parted:
            row["breakdown_ms"] = breakdown(row["ms_per_step"], fwd[run["window"]],
                                            {k[2]: 1e3 * t for k, t in best.items() if k[0] == "part" and k[1] == key})
        if costed:
            row["roofline"] = _step_roofline(run, setup.dtype)
        rows_out.append(row)
    plain_bw = weights / (plain_ms / 1e3)
    # K/V a step reads at the run's mean context (every layer's, every row's)
    item = jnp.dtype(setup.target.params["embed"].dtype).itemsize
    kv_bytes = (2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * item
                * (setup.prompt_len + setup.max_new_tokens // 2) * b)
    out = {"batch": b, "capacity": capacity, "plain_ms_per_step": plain_ms, "forward_ms": fwd,
           "kv_read_bytes_per_step": kv_bytes,
           "head_ms": head_ms, "plain_weight_read_bytes_per_s": plain_bw, "rows": rows_out}
    if bandwidth is not None:
        out["plain_read_fraction"] = plain_bw / bandwidth["read_bytes_per_s"]
    if costed:
        out["forward_roofline"] = {w: _forward_roofline(base, setup.target, w, setup.dtype, setup.prompt_len)
                                   for w in fwd}
    return out


def _row_report(setup: _Setup, key: tuple, run: dict, plain_ms: float, plain_tps: float, fwd: dict) -> dict:
    drafter, depth = key[:2]
    m = run["metrics"]
    ms = 1e3 * run["seconds"] / max(m["steps"], 1)
    tps = m["emitted"] / run["seconds"]
    w = run["window"]
    tree = setup.trees[key]
    want = expected_tokens_per_step(setup.rates, depth) if tree is None else \
        expected_tree_tokens(setup.branch[key], tree)
    return {"drafter": drafter, "depth": depth, "tree": None if tree is None else key[2], "window": w,
            "ms_per_step": ms, "tok_per_step": m["tok_per_step"], "expected_tok_per_step": want,
            "tok_per_s": tps, "speedup": tps / plain_tps, "steps": m["steps"],
            # the speedup at the profile's own tok/step (a fixed depth's step costs the same whatever
            # it accepts): free of the draws' noise over a short run
            "speedup_at_expected": None if want is None else want * plain_ms / ms,
            "tokens_match_plain": run["same"], "forward_ms": fwd[w], "step_over_forward": ms / fwd[w],
            "efficiency": (tps / plain_tps) / (m["tok_per_step"] * plain_ms / fwd[w]),
            "conditional_acceptance": m["conditional_acceptance_per_position"]}


def _step_roofline(run: dict, dtype) -> dict:
    from specjax.engine import step

    return roofline(step.lower(run["eng"], run["params"], run["st0"]).compile(), dtype)


def _forward_roofline(base: dict, target: Model, w: int, dtype, prompt_len: int) -> dict:
    eng, st0 = base["eng"], base["st0"]
    fn = jax.jit(forward_loop, static_argnums=(0, 1, 2, 3))
    lowered = fn.lower(eng.target, eng.attention_impl, w, 1, target.params, st0.cache, st0.seq[:, prompt_len])
    return roofline(lowered.compile(), dtype)


# ----------------------------------------------------------------------------- report


def _label(row: dict) -> str:
    return row["drafter"] + (f" tree {row['tree']}" if row.get("tree") else "")


def table(result: dict) -> str:
    """Markdown tables of a ``bench_shape`` result."""
    s = result["settings"]
    lines = [f"{s['shape']} ({s['dtype']}, random weights), prompt {s['prompt_len']}, {s['max_new_tokens']} new "
             f"tokens, acceptance {s['acceptance']} (rates {', '.join(f'{r:.2f}' for r in s['rates'])}); "
             f"{result['machine']}"]
    if "bandwidth" in result:
        bw = result["bandwidth"]
        lines.append(f"measured read bandwidth {bw['read_bytes_per_s'] / 1e9:.1f} GB/s (copy "
                     f"{bw['copy_bytes_per_s'] / 1e9:.1f} GB/s); target weights {result['weight_bytes'] / 1e9:.2f} GB")
    for bt in result["batches"]:
        lines += ["", f"B={bt['batch']}: plain {bt['plain_ms_per_step']:.1f} ms/step, weights read at "
                  f"{bt['plain_weight_read_bytes_per_s'] / 1e9:.1f} GB/s (K/V read a step "
                  f"{bt['kv_read_bytes_per_step'] / 1e6:.0f} MB)"
                  + (f" ({100 * bt['plain_read_fraction']:.0f}% of measured)" if "plain_read_fraction" in bt else "")
                  + f"; target forward {', '.join(f'w={w}: {ms:.1f}' for w, ms in bt['forward_ms'].items())} ms; "
                  f"LM head {bt['head_ms']:.1f} ms", "",
                  "| drafter | depth | ms/step | tok/step (expected) | speedup (at expected) | step / forward(w) | "
                  "efficiency | same tokens |"
                  + (" roofline H100 / H200 / v5e / v6e ms (+ launches) |"
                     if bt["rows"] and "roofline" in bt["rows"][0] else ""),
                  "|---|---|---|---|---|---|---|---|" + ("---|" if bt["rows"] and "roofline" in bt["rows"][0] else "")]
        for r in bt["rows"]:
            name = _label(r)
            want = "-" if r["expected_tok_per_step"] is None else f"{r['expected_tok_per_step']:.2f}"
            at = "-" if r["speedup_at_expected"] is None else f"{r['speedup_at_expected']:.2f}x"
            line = (f"| {name} | {r['depth']} | {r['ms_per_step']:.1f} | {r['tok_per_step']:.2f} "
                    f"({want}) | {r['speedup']:.2f}x ({at}) | "
                    f"{r['step_over_forward']:.2f} | {r['efficiency']:.2f} | "
                    f"{'yes' if r['tokens_match_plain'] else 'NO'} |")
            if "roofline" in r:
                p = r["roofline"]["predicted_ms"]
                line += (" " + " / ".join(f"{p[k]['bound_ms']:.2f}" for k in DEVICES)
                         + f" (+{p['H100 SXM']['launch_ms']:.1f} / {p['TPU v5e']['launch_ms']:.1f}) |")
            lines.append(line)
        if bt["rows"] and "breakdown_ms" in bt["rows"][0]:
            lines += ["", f"B={bt['batch']}: where a step's time goes (ms; each part timed on its own, `loop` the "
                      "rest)", "", "| drafter | depth | window | ms/step | " + " | ".join(PARTS) + " |",
                      "|---|---|---|---|" + "---|" * len(PARTS)]
            for r in bt["rows"]:
                lines.append(f"| {_label(r)} | {r['depth']} | {r['window']} | {r['ms_per_step']:.1f} | "
                             + " | ".join(f"{r['breakdown_ms'][p]:.1f}" for p in PARTS) + " |")
    return "\n".join(lines)
