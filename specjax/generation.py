"""``generate``: one static batch of prompts, prefilled and decoded to the end in one compiled
loop (the engine's ``generate_loop``; ``depth="auto"``'s table given, cached or measured first),
and the set-up ``stream`` shares: validation before any compile, the static engine, the host batch."""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import Any

import jax
import numpy as np

from specjax.advance import kv_advance as resolve_kv_advance
from specjax.auto import AutoDepth, auto_state
from specjax.auto.cost import check_cost, cost_key, known_cost, measured_cost, placeholder_cost, whole_run_timer
from specjax.auto.policy import AutoState
from specjax.compile_cache import default_on
from specjax.drafters import default_drafter
from specjax.engine import (
    EngineConfig,
    check_status,
    fetch,
    generate_loop,
    make_engine,
    prompt_bucket,
    request_capacity,
)
from specjax.engine.loop import TRACES
from specjax.generation_config import GenerationConfig, takes_settings
from specjax.metrics import GenerationResult, metrics, tokens
from specjax.protocols import DecoderModel
from specjax.sampling import RowSampling, derive_seed
from specjax.sharding import DATA, agree_max, put_rows, shard_model, shardings, state_specs
from specjax.tree import tree_reach
from specjax.validate import eos_table, fail, resolve_depth, validate

__all__ = ["check_mesh", "clear_compiled", "compiled_loop", "generate", "mesh_context", "put_replicated",
           "put_rows_of", "setup"]

COMPILED: collections.OrderedDict = collections.OrderedDict()
COMPILED_MAX = 32  # compiled generate loops kept (least recently used dropped)
_generate = jax.jit(generate_loop, static_argnums=0)


def clear_compiled() -> None:
    """Forget every compiled generate loop (the next ``generate`` compiles again)."""
    COMPILED.clear()


@takes_settings
def generate(model: DecoderModel, prompts: list[list[int]], config: GenerationConfig | None = None, *,
             draft_model: DecoderModel | None = None, mesh: jax.sharding.Mesh | None = None,
             **settings: Any) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt (one int, or one per prompt) with
    speculative decoding. One static batch: it runs until its slowest row finishes (for a
    stream of requests refilling finished rows, see ``batch_generate``).

    ``config`` (``GenerationConfig``: drafter, depth, cache, rule, attention, sampling, seeds,
    stops, token budget; its docstring says what each takes) holds the settings, and each
    keyword setting overrides its field. ``model`` and ``draft_model`` follow the model
    protocol (``specjax.protocols``: specjax's ``Model``, a Flax NNX module through
    ``specjax.nnx_model``, or your own). Greedy tokens never depend on ``depth="auto"``'s
    choices; sampled rows stay lossless, but their draws follow the batch's window choices.
    Caches hold ``request_capacity(prompt bucket, max(max_new_tokens), depth)`` slots per row,
    whatever the model's ``max_seq_len``. Compiles once per (batch, prompt-width bucket,
    capacity bucket, model, drafter, depth, cache kind, rule, greedy or sampled, attention);
    everything else is data. A cache that refused a write raises ``RuntimeError``.

    ``mesh`` (``specjax.make_mesh``): run on many devices: the batch split over ``"data"``, the
    model over ``"model"`` (``specjax.sharding``; the model is sharded for it unless
    ``shard_model`` already did). Only the new tokens, counters and cache status come back to
    the host. With many processes (``jax.distributed``) each passes its own prompts (the same
    count everywhere) and gets its own rows back.
    """
    cfg = GenerationConfig.of(config, **settings)
    eng, params, args = setup(model, prompts, cfg, draft_model, mesh)
    before = TRACES["generate"]
    b = len(prompts) * (1 if mesh is None else jax.process_count())
    table, cost_source, key, auto = None, None, None, None
    if eng.controller is not None:  # a given or cached table: no placeholder state, one transfer of the real one
        key = cost_key(eng, [np.shape(a) for a in args[:2]])
        table, cost_source = known_cost(eng, cfg.cost, key)
        auto = put_replicated(auto_state(eng, placeholder_cost(eng, b) if table is None else table, b), mesh)
    limit = put_rows_of(np.int32(eng.max_steps), mesh)
    run, compile_s = compiled_loop(eng, params, (*args, auto, limit))
    if auto is not None and table is None:
        # each window timed over the whole generation (every step to the end, the prefill-only
        # call subtracted): the context spans the real run's, and the timed part dwarfs the noise
        # of the subtraction (a 32-step window-1 slice at B=8 was under a third of its call)
        table, cost_source = measured_cost(eng, b, key, whole_run_timer(run, params, args, auto),
                                           steps=eng.max_steps)
        auto = put_replicated(auto_state(eng, table, b), mesh)
    t0 = time.perf_counter()
    st, status = fetch(eng, run(params, *args, auto, limit))
    run_s = time.perf_counter() - t0
    compiles = TRACES["generate"] - before
    check_status(status)
    result_metrics = metrics(st, eng, compiles)
    if cost_source is not None:
        result_metrics["cost_source"] = cost_source
    n_new = sum(int(k - p) for k, p in zip(st.known, st.prompt_len, strict=True))
    result_metrics.update(seconds_compile=compile_s, seconds_run=run_s, tok_per_s=n_new / run_s if run_s else 0.0)
    return GenerationResult(tokens(st), result_metrics)


def setup(model: DecoderModel, prompts: list[list[int]], cfg: GenerationConfig, draft_model=None, mesh=None):
    """Validate (before any compile), build the static engine and the host-side batch (placed
    on the mesh's data shards under ``mesh``; the model and draft model sharded for it).
    Returns ``(engine, params, (prompts, prompt_len, max_len, eos, seeds, sampling))``."""
    default_on()  # the persistent compilation cache, before the first compile
    drafter = default_drafter(cfg.drafter, model, draft_model)
    depth, policy = resolve_depth(cfg.depth, cfg.max_depth, drafter, static_batch=True, tree=cfg.tree, model=model)
    check_cost(cfg.cost, policy)
    total = len(prompts) * jax.process_count()
    check_mesh(mesh, total, "prompts", f"{total} rows", ": pad the batch", policy is not None and cfg.cost is None)
    seeds, news, stops = validate(model, prompts, cfg, drafter, draft_model)
    temperature, top_k, top_p, seed = cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed
    if mesh is not None:
        model = shard_model(model, mesh)
        draft_model = None if draft_model is None else shard_model(draft_model, mesh, replicate=True)
    rule = resolve_kv_advance(cfg.kv_advance)
    width, longest = prompt_bucket(prompts), max(news)
    if mesh is not None and jax.process_count() > 1:  # every process compiles the same program: agree on its shapes
        width, longest = agree_max([width, longest])
        if isinstance(seed, int):  # a base seed: rows numbered globally (process p holds rows p*b ...)
            seeds = [derive_seed(seed, jax.process_index() * len(prompts) + i) for i in range(len(prompts))]
    capacity = request_capacity(width, longest, tree_reach(cfg.tree, depth))
    eng = make_engine(model, drafter=drafter, draft_model=draft_model, depth=depth, kv_advance_rule=rule,
                      cache=cfg.cache or "dense", greedy=temperature == 0, ngram_n=cfg.ngram_n, capacity=capacity,
                      attention_impl=cfg.attention_impl, controller=None if policy is None else AutoDepth(policy),
                      mesh=mesh, tree=cfg.tree)
    b = len(prompts)
    toks = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):  # host-side batch assembly
        toks[i, : len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)
    params = {"target": model.params}
    if eng.draft is not None:
        params["draft"] = draft_model.params
    if getattr(eng.drafter, "data", None) is not None:  # a drafter's data (``specjax.controlled``): not static
        params["drafter"] = eng.drafter.data
    args = (toks, plen, plen + np.array(news, np.int32), eos_table([stops] * b), np.array(seeds, np.uint32),
            RowSampling.rows([temperature] * b, [top_k] * b, [top_p] * b, host=True))
    if mesh is None:
        return eng, params, jax.device_put(args)  # one batched transfer (a call per array: ~1 ms of host time)
    return eng, params, jax.tree.map(lambda x: put_rows_of(x, mesh), args)


def mesh_context(eng: EngineConfig):
    """Trace under the engine's mesh (``jax.set_mesh``: attention runs per shard, ``per_shard``)."""
    return contextlib.nullcontext() if eng.mesh is None else jax.set_mesh(eng.mesh)


def put_rows_of(x: np.ndarray, mesh) -> jax.Array:
    """A host array onto the device (one device), or this process's rows onto the mesh's data shards."""
    return jax.device_put(x) if mesh is None else put_rows(x, mesh)


def check_mesh(mesh, rows: int, arg: str, value: object, hint: str = "", policy_needs_table: bool = False) -> None:
    """``mesh``: ``None`` or a ``specjax.make_mesh`` mesh whose data axis divides ``rows`` (the
    batch over every process; the argument ``arg=value`` that sets it is named in the error)."""
    if mesh is None:
        return
    if not isinstance(mesh, jax.sharding.Mesh) or set(mesh.axis_names) != {DATA, "model"}:
        fail("mesh", mesh, "must be a jax.sharding.Mesh with axes ('data', 'model'): specjax.make_mesh(data=, model=)")
    if policy_needs_table and jax.process_count() > 1:
        fail("cost", None, "depth='auto' on many processes needs a given cost table (each process would measure "
             "its own): pass cost=")
    if rows % mesh.shape[DATA]:
        fail(arg, value, f"must divide by the mesh's data axis ({mesh.shape[DATA]}){hint}")


def compiled_loop(eng: EngineConfig, params: dict, args: tuple):
    """The compiled generate loop for these static settings and shapes, and the seconds its
    compile took now (0.0 when it was cached): compile time and run time are measured apart."""
    leaves, tree = jax.tree.flatten((params, args))
    key = (eng, tree, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves))
    if key in COMPILED:
        COMPILED.move_to_end(key)
        return COMPILED[key], 0.0
    t0 = time.perf_counter()
    with mesh_context(eng):
        run = _generate if eng.mesh is None else _generate_on(eng, params, args)
        fn = run.lower(eng, params, *args).compile()
    COMPILED[key] = fn
    if len(COMPILED) > COMPILED_MAX:
        COMPILED.popitem(last=False)
    return fn, time.perf_counter() - t0


def _generate_on(eng: EngineConfig, params: dict, args: tuple):
    """``_generate`` for ``eng.mesh``: its final state placed by the sharding table (the loop's
    per-step constraints place the state inside; this pins what the caller receives)."""
    before = TRACES["generate"]
    out = jax.eval_shape(functools.partial(generate_loop, eng), params, *args)
    TRACES["generate"] = before  # shapes only: not a compile of the loop
    return jax.jit(generate_loop, static_argnums=0, out_shardings=shardings(state_specs(out, eng.mesh), eng.mesh))


def put_replicated(auto: AutoState, mesh) -> AutoState:
    """``depth="auto"``'s data, replicated on every device of ``mesh`` (explicitly placed;
    without one it stays where ``auto_state`` put it)."""
    if mesh is None:
        return auto
    return jax.device_put(auto, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
