"""``stream``: ``generate`` one step at a time, for interactive output."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.auto import auto_state
from specjax.auto.cost import SLICES, cost_key, cost_table, placeholder_cost, slice_timer, warm_steps
from specjax.engine import EngineConfig, EngineState, check_status, decode_step, fetch, prefill
from specjax.generation import mesh_context, setup
from specjax.generation_config import GenerationConfig, takes_settings
from specjax.metrics import GenerationResult, metrics, tokens
from specjax.protocols import DecoderModel
from specjax.sharding import local_rows

__all__ = ["StreamChunk", "stream"]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _stream_step(eng: EngineConfig, params: dict, st: EngineState):
    """``step`` plus the few values ``stream`` reads back: the (up to ``w``) tokens each row
    emitted, how many, and the loop state. Never the caches or the whole sequence."""
    before = st.known
    st = decode_step(eng, params, st)
    idx = before[:, None] + jnp.arange(eng.window, dtype=jnp.int32)[None]
    new = jnp.take_along_axis(st.seq, jnp.clip(idx, 0, st.seq.shape[1] - 1), axis=1)
    return st, (new, st.known - before, st.done, st.i)


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    new_tokens: list[list[int]]  # per row: tokens emitted since the previous chunk
    result: GenerationResult | None  # set on the last chunk only


@takes_settings
def stream(model: DecoderModel, prompts: list[list[int]], config: GenerationConfig | None = None, *,
           draft_model: DecoderModel | None = None, mesh: jax.sharding.Mesh | None = None,
           **settings: Any) -> Iterator[StreamChunk]:
    """``generate`` one step at a time, for interactive output: the same jitted ``prefill``
    and ``step`` (same tokens, same metrics), but the host reads the new tokens after
    every step (one device sync per step; ``generate`` has none). Same arguments as
    ``generate``; the last chunk carries the ``GenerationResult``."""
    cfg = GenerationConfig.of(config, **settings)
    eng, params, args = setup(model, prompts, cfg, draft_model, mesh)
    with mesh_context(eng):  # under a mesh: traced with attention per shard
        st = prefill(eng, params, *args)
        if eng.controller is not None:
            st = eng.controller.init(eng, st, _auto_for_stream(eng, params, args, cfg.cost))
    # the first token comes from prefill; afterwards each step reads back only [B, w] tokens (this process's rows)
    first, done, i = jax.tree.map(local_rows, (st.seq[jnp.arange(st.seq.shape[0]), args[1]], st.done, st.i))
    new = [[int(t)] for t in first]
    while True:
        if bool(done.all()) or int(i) >= eng.max_steps:
            host, status = fetch(eng, st)
            check_status(status)
            yield StreamChunk(new, GenerationResult(tokens(host), metrics(host, eng, 0)))
            return
        yield StreamChunk(new, None)
        with mesh_context(eng):
            st, small = _stream_step(eng, params, st)
        toks, n_new, done, i = jax.tree.map(local_rows, small)
        new = [toks[r, : n_new[r]].tolist() for r in range(toks.shape[0])]


def _auto_for_stream(eng: EngineConfig, params: dict, args: tuple, cost):
    """``depth="auto"``'s table for ``stream``: given, cached, or timed on ``_stream_step`` itself
    over a scratch prefill of the same prompts (no compile of its own)."""
    b = np.shape(args[0])[0]
    scratch = prefill(eng, params, *args).replace(auto=auto_state(eng, placeholder_cost(eng, b), b))

    def advance(s: EngineState, n: int) -> EngineState:
        for _ in range(n):
            s, small = _stream_step(eng, params, s)
            jax.block_until_ready(small)
        return s
    timed, _ = slice_timer(scratch, advance, len(eng.windows))
    table, _ = cost_table(eng, b, cost, cost_key(eng, [np.shape(a) for a in args[:2]] + [["stream"]]), timed,
                          warm=warm_steps(int(np.max(local_rows(args[2]) - local_rows(args[1])))),
                          **SLICES)
    return auto_state(eng, table, b)

