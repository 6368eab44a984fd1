"""``stream``: ``generate`` one step at a time, for interactive output."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from specjax.engine import EngineConfig, EngineState, _check_status, _setup, _step, generate, prefill
from specjax.metrics import GenerationResult, metrics, tokens
from specjax.model.llama import Model

__all__ = ["StreamChunk", "stream"]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _stream_step(eng: EngineConfig, params: dict, st: EngineState):
    """``step`` plus the few values ``stream`` reads back: the (up to ``w``) tokens each row
    emitted, how many, and the loop state. Never the caches or the whole sequence."""
    before = st.known
    st = _step(eng, params, st)
    idx = before[:, None] + jnp.arange(eng.window, dtype=jnp.int32)[None]
    new = jnp.take_along_axis(st.seq, jnp.clip(idx, 0, st.seq.shape[1] - 1), axis=1)
    return st, (new, st.known - before, st.done, st.i)


@dataclasses.dataclass(frozen=True)
class StreamChunk:
    new_tokens: list[list[int]]  # per row: tokens emitted since the previous chunk
    result: GenerationResult | None  # set on the last chunk only


def stream(model: Model, prompts: list[list[int]], **kwargs: Any) -> Iterator[StreamChunk]:
    """``generate`` one step at a time, for interactive output: the same jitted ``prefill``
    and ``step`` (same tokens, same metrics), but the host reads the new tokens after
    every step (one device sync per step; ``generate`` has none). Same keyword arguments
    as ``generate``; the last chunk carries the ``GenerationResult``."""
    # generate's signature is the one source of names and defaults (a bad name is a TypeError)
    bound = inspect.signature(generate).bind(model, prompts, **kwargs)
    bound.apply_defaults()
    eng, params, args = _setup(**bound.arguments)
    st = prefill(eng, params, *args)
    # the first token comes from prefill; afterwards each step reads back only [B, w] tokens
    first, done, i = jax.device_get((st.seq[jnp.arange(st.seq.shape[0]), args[1]], st.done, st.i))
    new = [[int(t)] for t in first]
    while True:
        if bool(done.all()) or int(i) >= eng.max_steps:
            host = jax.device_get(st)
            _check_status(host)
            yield StreamChunk(new, GenerationResult(tokens(host), metrics(host, eng, 0)))
            return
        yield StreamChunk(new, None)
        st, small = _stream_step(eng, params, st)
        toks, n_new, done, i = jax.device_get(small)
        new = [toks[r, : n_new[r]].tolist() for r in range(toks.shape[0])]


stream.__signature__ = inspect.signature(generate).replace(  # help(stream) shows generate's keywords
    return_annotation=Iterator[StreamChunk])
