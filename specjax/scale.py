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
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.controlled import Controlled, control_data, expected_tokens_per_step, oracle_rows
from specjax.model import LAYER_LOOPS, Model, ModelConfig, init_model, with_layer_loop
from specjax.model.shapes import draft_shape, shape
from specjax.tree import tree_reach

__all__ = ["DEVICES", "PARTS", "ROWS", "acceptance_profile", "bench_shape", "breakdown", "expected_tree_tokens",
           "gather_overcount", "predict", "random_models", "read_bandwidth", "table", "tree_profile"]

# (drafter, depth): the configurations a shape is benchmarked in (plain first: every ratio's base)
ROWS: tuple[tuple[str, int], ...] = (("none", 0), ("mtp", 1), ("mtp", 2), ("mtp", 3), ("ngram", 3),
                                     ("draft_model", 3))

# datasheet figures: HBM bytes/s, dense peak flop/s (bfloat16; float32 matmuls at XLA's default precision run
# as TF32 on H100/H200 (half the bf16 rate) and as bf16 passes on TPU), and the launch cost assumed per compiled op
DEVICES: dict[str, dict[str, float]] = {
    "H100 SXM": {"bytes_per_s": 3.35e12, "bf16_flops": 989e12, "f32_flops": 494e12, "launch_s": 4e-6},
    "H200": {"bytes_per_s": 4.8e12, "bf16_flops": 989e12, "f32_flops": 494e12, "launch_s": 4e-6},
    "TPU v5e": {"bytes_per_s": 8.19e11, "bf16_flops": 197e12, "f32_flops": 197e12 / 3, "launch_s": 1e-6},
    "TPU v6e": {"bytes_per_s": 1.64e12, "bf16_flops": 918e12, "f32_flops": 918e12 / 3, "launch_s": 1e-6},
}


# ----------------------------------------------------------------------------- acceptance


def _bundled_metrics(depth: int, n_prompts: int, max_new_tokens: int, tree: object = None) -> list[dict]:
    """The bundled model's MTP head at ``depth`` (drafting ``tree`` if given), greedy, on the
    bench's held-out prompts, eight at a time: each run's metrics."""
    from specjax.bench import bench_prompts
    from specjax.checkpoint import load_model
    from specjax.generation import generate

    bundle = load_model()
    toks = bundle.encode_prompts(bench_prompts(n_prompts), bos=False)
    return [generate(bundle.model, toks[i : i + 8], max_new_tokens=max_new_tokens, drafter="mtp", depth=depth,
                     tree=tree, temperature=0.0, eos_id=bundle.tokenizer.eos_id).metrics
            for i in range(0, len(toks), 8)]


@functools.lru_cache(maxsize=2)
def _bundled_run(depth: int, n_prompts: int, max_new_tokens: int) -> tuple[tuple[float, ...], tuple]:
    """The bundled MTP head's chain run (``_bundled_metrics``): (conditional acceptance per draft
    position, each row's accepted count per step)."""
    verdicts, accepted, traces = np.zeros(depth), np.zeros(depth), []
    for m in _bundled_metrics(depth, n_prompts, max_new_tokens):
        verdicts += m["verdicts_per_position_count"]
        accepted += m["accepted_per_position_count"]
        traces += m["row_accepted_trace"]
    return tuple(float(x) for x in accepted / np.maximum(verdicts, 1)), tuple(tuple(t) for t in traces)


@functools.lru_cache(maxsize=4)
def _bundled_tree_run(tree: object, depth: int, n_prompts: int, max_new_tokens: int) -> tuple[tuple[float, ...], ...]:
    """The bundled MTP head drafting ``tree`` to ``depth`` (``_bundled_metrics``): its acceptance
    per branch ``[depth, ranks]`` (``TreeAcceptance.learn``)."""
    from specjax.sim import TreeAcceptance

    tested, took = 0, 0
    for m in _bundled_metrics(depth, n_prompts, max_new_tokens, tree):
        tested = tested + np.asarray(m["branch_tested_count"])
        took = took + np.asarray(m["branch_accepted_count"])
    metrics = {"branch_tested_count": tested.tolist(), "branch_accepted_count": took.tolist()}
    rates = TreeAcceptance.learn(metrics, (tested.shape[1],) * min(depth, tested.shape[0])).rates
    return tuple(tuple(float(x) for x in r) for r in np.asarray(rates))


def tree_profile(spec: str, tree: object, depth: int, rates: Sequence[float]) -> list[list[float]]:
    """A tree row's acceptance per branch ``[depth, ranks]`` (``Controlled``'s ``branch``) under
    the acceptance ``spec``: ``bundled`` and ``bundled-traces``: the bundled model's MTP head's,
    measured now on the same tree (``_bundled_tree_run``: the bench's 64 held-out prompts, 128
    tokens each); ``iid:P`` and ``rates:...``: every rank at its level's rate (``rates``)."""
    from specjax.tree import DynamicTree

    if spec.partition(":")[0] in ("bundled", "bundled-traces"):
        return [list(r) for r in _bundled_tree_run(tree, depth, 64, 128)]
    ranks = tree.topk if isinstance(tree, DynamicTree) else max(tree)
    return [[float(r)] * ranks for r in list(rates)[:depth]]


def expected_tree_tokens(branch: Sequence[Sequence[float]], tree: object) -> float | None:
    """Tokens a step of the preset ``tree`` emits at acceptance per branch ``branch`` (levels are
    independent: level ``j`` passes with ``1 - prod_r (1 - branch[j][r])`` over its ranks);
    ``None`` for a dynamic tree (its shape is data)."""
    if not isinstance(tree, tuple):
        return None
    p = [1.0 - float(np.prod([1.0 - x for x in branch[j][:k]])) for j, k in enumerate(tree)]
    return expected_tokens_per_step(p, len(tree))


def acceptance_profile(spec: str, depth: int = 3) -> dict:
    """``spec`` -> ``{"spec", "rates" [depth], "trace" ([rows][steps] or None)}``:

    * ``bundled``: the bundled model's MTP head's conditional acceptance per position (measured
      now: its depth-``depth`` greedy run on the bench's 64 held-out prompts, 128 tokens each);
    * ``bundled-traces``: the same run's per-row accepted counts replayed step by step (row ``i``
      of a batch replays run row ``i mod 64``; past a trace's end, ``rates``);
    * ``iid:P``: every draft right with probability ``P``;
    * ``rates:P1,P2,...``: conditional acceptance per position (the last repeats)."""
    kind, _, arg = spec.partition(":")
    if kind in ("bundled", "bundled-traces") and not arg:
        rates, traces = _bundled_run(depth, 64, 128)
        return {"spec": spec, "rates": list(rates), "trace": [list(t) for t in traces] if kind != "bundled" else None}
    try:
        if kind == "iid" and arg:
            rates = [float(arg)] * depth
        elif kind == "rates" and arg:
            given = [float(x) for x in arg.split(",")]
            rates = (given + [given[-1]] * depth)[:depth]
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"acceptance={spec!r} is invalid: must be bundled, bundled-traces, iid:P or "
                         "rates:P1,P2,...") from None
    if not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"acceptance={spec!r} is invalid: each rate must lie in [0, 1]")
    return {"spec": spec, "rates": rates, "trace": None}


def _trace_rows(trace: list[list[int]] | None, batch: int) -> np.ndarray | None:
    if not trace:
        return None
    rows = [trace[i % len(trace)] for i in range(batch)]
    out = np.full((batch, max(len(r) for r in rows) or 1), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


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


# ----------------------------------------------------------------------------- timed pieces


def _decode_loop(eng, params, st):
    from specjax.engine import run_steps

    return run_steps(eng, params, st, lambda s: jnp.any(~s.done) & (s.i < eng.max_steps))


_decode = jax.jit(_decode_loop, static_argnums=0, donate_argnums=2)


def _forward_loop(dec, impl: str, w: int, n: int, params, cache, tok):
    """``n`` forwards of a ``w``-token window per row (every layer, the LM head over all ``w``
    positions, argmax), each writing its K/V and advancing one slot; the argmax feeds the next."""
    b = tok.shape[0]
    live = jnp.ones((b,), bool)

    def body(_, carry):
        cache, tok = carry
        pos = cache.lengths[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
        hidden, cache = dec.forward_hidden(params, jnp.broadcast_to(tok[:, None], (b, w)), pos,
                                           cache.reserve(w, live), attention_impl=impl)
        nxt = jnp.argmax(dec.head(params, hidden), axis=-1).astype(jnp.int32)  # [B, w]
        return cache.advance(jnp.ones((b,), jnp.int32)), nxt[:, -1]
    return jax.lax.fori_loop(0, n, body, (cache, tok))


_forward = jax.jit(_forward_loop, static_argnums=(0, 1, 2, 3), donate_argnums=5)


def _head_loop(dec, n: int, params, x):
    def body(_, x):
        return x + (1e-6 * jnp.max(dec.head(params, x), axis=-1, keepdims=True)).astype(x.dtype)
    return jax.lax.fori_loop(0, n, body, x)


_head = jax.jit(_head_loop, static_argnums=(0, 1))


# A step's parts, each from the step's own functions, each timed in a loop of its own as
# ``forward(w)`` is (a single call costs about 5% more on XLA:CPU). Each part maps its inputs to
# ``(next inputs, live outputs)``: a buffer it writes (a cache) becomes the next iteration's input,
# so it is written in place as in the decode loop, and what else it returns stays live (not dead
# code). An optimization barrier at the top of each iteration keeps XLA from hoisting the part out
# of the loop (its inputs do not change from one iteration to the next).
def _draft_part(eng, params, st):
    """What a step drafts: the drafter's chain or tree."""
    if eng.tree is not None:
        tokens, parents, dstate = eng.drafter.propose_tree(eng, params, st)
        return st.replace(dstate=dstate), (tokens, parents)
    proposals, probs_, dstate = eng.drafter.propose(eng.at_window(eng.window), params, st)
    return st.replace(dstate=dstate), (proposals, probs_)


def _verify_part(eng, params, st):
    """A step up to its commit: draft, the target's window forward, its LM head, acceptance (a
    tree's walk and compaction)."""
    from specjax.engine.step import verify

    v = verify(eng, params, st, eng.window)[0]
    return st.replace(cache=v.cache, dstate=v.dstate), v._replace(cache=None, dstate=None)


def _commit_part(eng, params, inputs):
    """A step's commit: emit, the plan's advance, the drafter's commit, the counters."""
    from specjax.engine.step import commit

    st, v = inputs
    new, verdicts = commit(eng, params, st, eng.window, v)
    # the caches it advanced and wrote go back to ``v`` (each buffer carried once: no copy)
    return (new.replace(cache=st.cache, dstate=st.dstate), v._replace(cache=new.cache, dstate=new.dstate)), verdicts


def _drafter_commit_part(eng, params, inputs):
    """The drafter's own commit (an MTP module's block pass over the window and its head)."""
    from specjax.engine.step import commit_drafter

    st, v, new, advance = inputs
    dstate = commit_drafter(eng, params, st, eng.window, v, new, advance)
    return (st, v._replace(dstate=dstate), new, advance), ()


_PART_FNS = {"draft": _draft_part, "verify": _verify_part, "commit": _commit_part,
             "drafter_commit": _drafter_commit_part}


def _part_loop(eng, name: str, n: int, params, inputs):
    part = _PART_FNS[name]

    def body(_, carry):
        inputs, _ = jax.lax.optimization_barrier(carry)
        return part(eng, params, inputs)
    return jax.lax.fori_loop(1, n, body, part(eng, params, inputs))  # n runs


_part = jax.jit(_part_loop, static_argnums=(0, 1, 2), donate_argnums=4)


@functools.partial(jax.jit, static_argnums=0)
def _part_inputs(eng, st, verified):
    """The commit parts' inputs from the verify part's outcome on ``st`` (``verified``: its
    ``(next inputs, live outputs)``): ``(v, emitted state, advance)``."""
    from specjax.engine.step import emit

    nxt, v = verified
    v = v._replace(cache=nxt.cache, dstate=nxt.dstate)
    new, _, advance = emit(eng, st, eng.window, v)
    return v, new, advance


def _part_timers(eng, params, st, n: int) -> dict[str, tuple[Callable, Any]]:
    """``name -> (fn, arg)``: ``fn(arg)`` runs the step's part ``n`` times on ``st`` (compiled here)."""
    timers = {name: functools.partial(_part, eng, name, n, params) for name in _PART_FNS}
    with warnings.catch_warnings():  # a donated input a part does not write (a counter) is not an error
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        # the verify part's compile run gives the commit parts their inputs (its n runs verify the
        # same window again: the commit's cost is what is timed)
        v, new, advance = _part_inputs(eng, st, timers["verify"](_copy(st)))
        # one target cache per row in memory (a cache per part ran this machine's 23 GB out at B=4 at
        # Qwen3-0.6B's shape): the commit parts move caches' lengths and never read their K/V, so
        # they time the same on the state's own cache
        v = v._replace(cache=st.cache)
        new = new.replace(cache=st.cache)
        args = {"draft": st, "verify": st, "commit": (st, v), "drafter_commit": (st, v, new, advance)}
        for name in ("draft", "commit", "drafter_commit"):  # compile
            jax.block_until_ready(timers[name](_copy(args[name])))
    return {name: (fn, args[name]) for name, fn in timers.items()}


# the breakdown's columns, in a step's order: each is a part's time less the parts inside it
PARTS = ("draft", "forward", "verify", "drafter_commit", "commit", "loop")


def breakdown(step_ms: float, forward_ms: float, part_ms: dict[str, float]) -> dict[str, float]:
    """Where a step's ``step_ms`` goes, from its parts each timed in a loop (``part_ms``: ``draft``,
    ``verify``, ``commit``, ``drafter_commit``) and the target's own forward over the window:
    ``draft``; ``forward`` (the target's window forward: layers, K/V write, LM head); ``verify``
    (the rest of a step up to its commit: the window's assembly, acceptance, a tree's walk and
    compaction); ``drafter_commit``; ``commit`` (emit, plan, counters); ``loop`` (the decode
    loop's own work, less what fusing the parts in one step saves: may be negative). They sum
    to ``step_ms``."""
    return {"draft": part_ms["draft"], "forward": forward_ms,
            "verify": part_ms["verify"] - part_ms["draft"] - forward_ms,
            "drafter_commit": part_ms["drafter_commit"], "commit": part_ms["commit"] - part_ms["drafter_commit"],
            "loop": step_ms - part_ms["verify"] - part_ms["commit"]}


def _copy(tree):
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree)


def _time_on_copy(fn: Callable[[Any], Any], arg) -> float:
    """Seconds of ``fn`` on a fresh copy of ``arg`` (which it may donate), the copy made first."""
    arg = jax.block_until_ready(_copy(arg))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg))
    return time.perf_counter() - t0


def _roofline(compiled, dtype) -> dict:
    """Bytes, flops and op count of one compiled call, and the step time they predict per device."""
    from specjax.hlo_ops import count_ops

    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    raw, flops = float(ca.get("bytes accessed", 0.0)), float(ca.get("flops", 0.0))
    text = compiled.as_text()
    over = gather_overcount(text)
    nbytes = max(raw - over, 0.0)
    ops = sum(count_ops(text).values())
    return {"bytes": nbytes, "bytes_xla": raw, "gather_overcount": over, "flops": flops, "ops": ops,
            "predicted_ms": predict(nbytes, flops, ops, dtype)}


_DEF = re.compile(r"%([\w.\-]+) = (\w+)\[([\d,]*)\]")  # an instruction: its name, element type and shape
_GATHER = re.compile(r"%[\w.\-]+ = (\w+)\[([\d,]*)\]\S* gather\(%([\w.\-]+)")
_ITEM = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}


def gather_overcount(hlo_text: str) -> float:
    """Bytes XLA's cost analysis counts for gathers beyond what they read: it charges a gather its
    whole operand (a token lookup in a 151,936 x 1,024 float32 embedding: 622 MB), while a gather
    reads what it returns. The sum over every gather of (operand bytes - output bytes)."""
    shapes = {m.group(1): (m.group(2), m.group(3)) for m in _DEF.finditer(hlo_text)}
    size = lambda t, s: _ITEM.get(t, 4) * float(np.prod([int(x) for x in s.split(",") if x]))  # noqa: E731
    total = 0.0
    for m in _GATHER.finditer(hlo_text):
        out_t, out_s, operand = m.groups()
        if operand in shapes:
            total += max(size(*shapes[operand]) - size(out_t, out_s), 0.0)
    return total


def predict(nbytes: float, flops: float, ops: int, dtype) -> dict[str, dict[str, float]]:
    """Predicted ms of a call per device in ``DEVICES``: ``bound_ms``, the slower of reading
    ``nbytes`` at HBM bandwidth and ``flops`` at peak, and ``launch_ms``, ``ops`` launches at the
    stated cost; ``ms`` their sum. An estimate, not a simulation: every op is assumed to stream
    at full bandwidth, and the op count is XLA:CPU's (a GPU or TPU compile fuses more: the launch
    term is an upper bound there, and CUDA graphs cut it further)."""
    key = "bf16_flops" if jnp.dtype(dtype).itemsize == 2 else "f32_flops"
    out = {}
    for name, d in DEVICES.items():
        bound, launch = 1e3 * max(nbytes / d["bytes_per_s"], flops / d[key]), 1e3 * ops * d["launch_s"]
        out[name] = {"ms": bound + launch, "bound_ms": bound, "launch_ms": launch}
    return out


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
    from specjax.engine import prefill, prompt_bucket, request_capacity
    from specjax.metrics import metrics, tokens

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
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    runs = len(rows) * len(list(batches))
    log(f"{runs} runs ({len(rows)} rows x {len(list(batches))} batch sizes), each compiling and timing a step at this "
        "shape: about a minute or more each on a 2-core CPU at qwen3-0.6b's shape (a breakdown, trees and larger "
        "batches take longer; fewer drafters, depths or batches shorten the run)")
    max_depth = max(r[1] for r in rows)
    reach = max(tree_reach(trees[r], r[1]) for r in rows)  # the farthest slot past a row's length a step writes
    profile = acceptance_profile(acceptance, max(max_depth, 1))
    branch = {r: tree_profile(acceptance, trees[r], r[1], profile["rates"]) for r in rows if trees[r] is not None}
    t0 = time.perf_counter()
    target, draft = models if models is not None else random_models(
        name_or_config, dtype, seed, draft=any(r[0] == "draft_model" for r in rows))
    if layer_loop is not None:
        target = with_layer_loop(target, layer_loop)
        draft = None if draft is None else with_layer_loop(draft, layer_loop)
    cfg = target.config
    target_dv = None
    if draft_vocab:
        from specjax.model import with_draft_vocab

        target_dv = with_draft_vocab(target, np.arange(draft_vocab))
    if prompt_len + max_new_tokens + 2 * (reach + 1) > cfg.max_seq_len:
        raise ValueError(f"prompt_len + max_new_tokens = {prompt_len + max_new_tokens} does not fit the shape's "
                         f"max_seq_len {cfg.max_seq_len}")
    log(f"models built in {time.perf_counter() - t0:.1f} s")
    weights = _param_bytes({k: v for k, v in target.params.items() if k != "mtp"})
    out = {"settings": {"shape": name_or_config if isinstance(name_or_config, str) else "custom",
                        "config": cfg.to_dict(), "dtype": dtype, "batches": list(batches), "prompt_len": prompt_len,
                        "max_new_tokens": max_new_tokens, "acceptance": acceptance, "rates": profile["rates"],
                        "replayed_traces": profile["trace"] is not None, "rounds": rounds, "seed": seed,
                        "draft_vocab": draft_vocab, "layer_loop": layer_loop,
                        "branch_rates": {_row_name(r): b for r, b in branch.items()},
                        "rows": [list(r) for r in rows]},
           "machine": machine(), "weight_bytes": weights,
           "draft_weight_bytes": None if draft is None else _param_bytes(draft.params),
           "mtp_weight_bytes": _param_bytes(target.params.get("mtp", {})), "batches": []}
    if bandwidth:
        out["bandwidth"] = read_bandwidth()
        log(f"read bandwidth {out['bandwidth']['read_bytes_per_s'] / 1e9:.1f} GB/s")
    rng = np.random.default_rng(seed)
    for b in batches:
        costed = roofline if isinstance(roofline, bool) else b in roofline
        parted = breakdown_parts if isinstance(breakdown_parts, bool) else b in breakdown_parts
        prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(b)]
        width = prompt_bucket(prompts)
        capacity = request_capacity(width, max_new_tokens, reach)  # one capacity: comparable forwards
        toks = np.zeros((b, width), np.int32)
        toks[:, :prompt_len] = np.asarray(prompts)
        plen = np.full((b,), prompt_len, np.int32)
        args = (jnp.asarray(toks), jnp.asarray(plen), jnp.asarray(plen + max_new_tokens),
                jnp.full((b,), -1, jnp.int32), jnp.arange(b, dtype=jnp.uint32))
        data = None
        runs: dict[tuple, dict] = {}
        for row in rows:
            drafter, depth = row[:2]
            t1 = time.perf_counter()
            row_data = data if trees[row] is None else dataclasses.replace(data, branch=jnp.asarray(branch[row]))
            eng, params = _engine(target_dv if drafter == "mtp:dv" else target, draft, drafter, depth, capacity,
                                  row_data, trees[row])
            st0 = jax.block_until_ready(prefill(eng, params, *args))
            final = jax.block_until_ready(_decode(eng, params, _copy(st0)))  # compiles, and the tokens
            got = tokens(final)
            if drafter == "none":  # the oracle every drafter's proposals come from
                oracle = oracle_rows(prompts, got, capacity + max_depth + 2)
                data = control_data(oracle, profile["rates"], _trace_rows(profile["trace"], b))
                plain_tokens = got
            runs[row] = {"eng": eng, "params": params, "st0": st0, "window": eng.window,
                         "metrics": metrics(final, eng, 0), "same": got == plain_tokens}
            log(f"B={b} {_row_name(row)}: compiled and warmed in {time.perf_counter() - t1:.1f} s")
        # the target's own w-token forward and the LM head alone, timed in the same interleaved rounds
        base = runs[("none", 0)]
        n_fwd = 8
        cache, tok = base["st0"].cache, base["st0"].seq[:, prompt_len]
        timed: dict[Any, tuple[Callable, Any, float]] = {
            key: (functools.partial(_decode, run["eng"], run["params"]), run["st0"], 1.0) for key, run in runs.items()}
        for w in sorted({run["window"] for run in runs.values()}):
            fn = functools.partial(_forward, base["eng"].target, base["eng"].attention_impl, w, n_fwd, target.params)
            timed[("forward", w)] = (lambda c, fn=fn, tok=tok: fn(c, tok), cache, n_fwd)
        x = jnp.zeros((b, cfg.d_model), target.params["embed"].dtype)
        timed[("head", 1)] = (functools.partial(_head, base["eng"].target, n_fwd, target.params), x, n_fwd)
        if parted:
            for key, run in runs.items():
                for name, (fn, arg) in _part_timers(run["eng"], run["params"], run["st0"], n_fwd).items():
                    timed[("part", key, name)] = (fn, arg, n_fwd)
            log(f"B={b}: step parts compiled")
        for key in timed:
            if key[0] in ("forward", "head"):  # compile
                fn, arg, _ = timed[key]
                jax.block_until_ready(fn(_copy(arg)))
        best = dict.fromkeys(timed, np.inf)
        order = list(timed)
        for r in range(rounds):  # interleaved, the order rotating: a slow spell falls on different rows
            for key in order[r % len(order):] + order[: r % len(order)]:
                fn, arg, n = timed[key]
                best[key] = min(best[key], _time_on_copy(fn, arg) / n)
            log(f"B={b} round {r + 1}/{rounds} done")
        for key, run in runs.items():
            run["seconds"] = best[key]
        plain_ms = 1e3 * base["seconds"] / max(base["metrics"]["steps"], 1)
        plain_tps = base["metrics"]["emitted"] / base["seconds"]
        fwd = {key[1]: 1e3 * s for key, s in best.items() if key[0] == "forward"}
        head_ms = 1e3 * best[("head", 1)]
        log(f"B={b}: forwards {', '.join(f'w={w} {ms:.1f} ms' for w, ms in fwd.items())}, head {head_ms:.1f} ms")
        rows_out = []
        for key, run in runs.items():
            drafter, depth = key[:2]
            m = run["metrics"]
            steps = max(m["steps"], 1)
            ms = 1e3 * run["seconds"] / steps
            tps = m["emitted"] / run["seconds"]
            w = run["window"]
            tree = trees[key]
            want = expected_tokens_per_step(profile["rates"], depth) if tree is None else \
                expected_tree_tokens(branch[key], tree)
            row = {"drafter": drafter, "depth": depth, "tree": None if tree is None else key[2], "window": w,
                   "ms_per_step": ms, "tok_per_step": m["tok_per_step"], "expected_tok_per_step": want,
                   "tok_per_s": tps, "speedup": tps / plain_tps, "steps": m["steps"],
                   # the speedup at the profile's own tok/step (a fixed depth's step costs the same whatever
                   # it accepts): free of the draws' noise over a short run
                   "speedup_at_expected": None if want is None else want * plain_ms / ms,
                   "tokens_match_plain": run["same"], "forward_ms": fwd[w], "step_over_forward": ms / fwd[w],
                   "efficiency": (tps / plain_tps) / (m["tok_per_step"] * plain_ms / fwd[w]),
                   "conditional_acceptance": m["conditional_acceptance_per_position"]}
            if parted:
                row["breakdown_ms"] = breakdown(ms, fwd[w], {k[2]: 1e3 * t for k, t in best.items()
                                                             if k[0] == "part" and k[1] == key})
            if costed:
                row["roofline"] = _step_roofline(run, dtype)
            rows_out.append(row)
        plain_bw = weights / (plain_ms / 1e3)
        # K/V a step reads at the run's mean context (every layer's, every row's)
        item = jnp.dtype(target.params["embed"].dtype).itemsize
        kv_bytes = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * item * (prompt_len + max_new_tokens // 2) * b
        batch_out = {"batch": b, "capacity": capacity, "plain_ms_per_step": plain_ms, "forward_ms": fwd,
                     "kv_read_bytes_per_step": kv_bytes,
                     "head_ms": head_ms, "plain_weight_read_bytes_per_s": plain_bw, "rows": rows_out}
        if bandwidth:
            batch_out["plain_read_fraction"] = plain_bw / out["bandwidth"]["read_bytes_per_s"]
        if costed:
            batch_out["forward_roofline"] = {w: _forward_roofline(base, target, w, dtype, prompt_len)
                                             for w in fwd}
        out["batches"].append(batch_out)
        runs.clear()
    return out


def _step_roofline(run: dict, dtype) -> dict:
    from specjax.engine import step

    return _roofline(step.lower(run["eng"], run["params"], run["st0"]).compile(), dtype)


def _forward_roofline(base: dict, target: Model, w: int, dtype, prompt_len: int) -> dict:
    eng, st0 = base["eng"], base["st0"]
    fn = jax.jit(_forward_loop, static_argnums=(0, 1, 2, 3))
    lowered = fn.lower(eng.target, eng.attention_impl, w, 1, target.params, st0.cache, st0.seq[:, prompt_len])
    return _roofline(lowered.compile(), dtype)


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
