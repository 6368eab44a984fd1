"""Run a Flax NNX decoder in the engine (the model protocol, ``specjax.protocols``).

The module's contract is small. It computes its own q, k, v (RoPE applied at the
``positions`` it is given) and hands attention to specjax::

    class MyDecoder(nnx.Module):
        def __call__(self, tokens, positions, kv):   # tokens, positions int32 [B, t]
            ...                                      # in attention layer i:
            out = kv(i, q, k, v)                     # q [B, t, Hq, D], k/v [B, t, Hkv, D] -> [B, t, Hq, D]
            ...
            return hidden                            # [B, t, H]: before the output head
        def logits(self, hidden):                    # [..., H] -> [..., V]
            ...

``kv`` writes the window's K/V at each row's own offset in specjax's cache (dense or paged)
and attends with the row's ragged mask: the module holds no cache and never sees an offset.
Where its K/V live is the ``KVLayout`` (layers, KV heads, head dim) given to ``nnx_model``.
Layers must call ``kv`` in order from Python (an ``nnx.scan`` over layers is not supported).

What ``kv(i, q, k, v, *, scale=None, window=None)`` computes, per row: softmax attention of
each query over the row's keys at positions ``<=`` its own (causal), scores scaled by
``scale`` (default ``head_dim ** -0.5``) and computed in float32; query head ``h`` reads KV
head ``h // (Hq // Hkv)`` (grouped-query attention: ``Hq`` a multiple of ``Hkv``); with
``window``, only keys at positions ``> q_pos - window`` (a sliding-window layer: pass its own
window in each call). Masked slots never reach a row, whatever values they hold.

Positions: the module is handed ``positions`` in ``[0, max_seq_len)`` only (slots past a row's
last reachable position repeat it; ``specjax.protocols``), so a learned position table of
exactly ``max_seq_len`` rows is safe.

``nnx_model`` splits the module once (``nnx.split``): the graph definition is static (part of
the compiled engine: equal graphs share one compile), the state is the params pytree, and
each traced forward rebuilds the module from them (``nnx.merge``). The module's own state is
never mutated by decoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax.cache import CACHE_KINDS, ModelCache, kv_cache

__all__ = ["KVLayout", "NnxDecoder", "NnxModel", "nnx_model"]


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Where a module's K/V live: ``layers`` attention layers (the ``i`` it passes to ``kv``),
    each with ``kv_heads`` heads of ``head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class NnxDecoder:
    """An NNX module's static half: its graph definition and facts (``protocols.Decoder``)."""

    graphdef: Any  # nnx.GraphDef: hashable, compared by structure
    layout: KVLayout
    vocab_size: int
    max_seq_len: int
    hidden_size: int
    dtype: Any = jnp.float32
    head_method: str = "logits"
    mtp_depth: int = 0

    def _module(self, params: Any):
        from flax import nnx  # lazy: flax is only needed by those who bring an NNX model

        return nnx.merge(self.graphdef, params)

    def init_cache(self, batch: int, capacity: int, *, kind: str, slack: int, page_size: int,
                   num_pages: int | None) -> ModelCache:
        lay = self.layout
        return kv_cache(lay.layers, lay.kv_heads, lay.head_dim, batch, capacity, kind=kind, page_size=page_size,
                        num_pages=num_pages, dtype=self.dtype)

    def forward_hidden(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: ModelCache, *,
                       attention_impl: str = "xla") -> tuple[jax.Array, ModelCache]:
        glob = [cache.global_kv]  # threaded through the module's layers in call order

        def kv(layer: int, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float | None = None,
               window: int | None = None) -> jax.Array:
            c = glob[0].write(layer, k.astype(self.dtype), v.astype(self.dtype))  # at each row's own offset
            glob[0] = c
            return c.attend(q, layer, impl=attention_impl, window=window, scale=scale).astype(q.dtype)

        hidden = self._module(params)(tokens, positions, kv)
        return hidden, cache.replace(global_kv=glob[0])

    def head(self, params: Any, hidden: jax.Array) -> jax.Array:
        return getattr(self._module(params), self.head_method)(hidden).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class NnxModel:
    """A model for ``generate``: ``params`` (the module's ``nnx.State``) and its ``decoder``."""

    params: Any
    decoder: NnxDecoder


def nnx_model(module: Any, *, layout: KVLayout, vocab_size: int, max_seq_len: int,
              head_method: str = "logits") -> NnxModel:
    """Wrap an NNX decoder module (contract above) for the engine: ``generate(nnx_model(...), ...)``.

    ``layout``: its attention layers' K/V shape; ``vocab_size``: its logits' width;
    ``max_seq_len``: the longest sequence it accepts; ``head_method``: the method mapping
    hidden states to logits. Checked here, before any compile: a one-token forward is traced
    (shapes only) to find the hidden size and the logits' width."""
    from flax import nnx

    if not isinstance(module, nnx.Module):
        raise ValueError(f"module={type(module).__name__} is invalid: must be a flax.nnx.Module")
    if not isinstance(layout, KVLayout) or min(layout.layers, layout.kv_heads, layout.head_dim) < 1:
        raise ValueError(f"layout={layout!r} is invalid: must be a KVLayout with layers, kv_heads, head_dim >= 1")
    for name, val in (("vocab_size", vocab_size), ("max_seq_len", max_seq_len)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 2:
            raise ValueError(f"{name}={val!r} is invalid: must be an int >= 2")
    if not callable(getattr(module, head_method, None)):
        raise ValueError(f"head_method={head_method!r} is invalid: the module has no such method")
    graphdef, state = nnx.split(module)
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]
    dtype = jnp.dtype(leaves[0].dtype) if leaves else jnp.dtype(jnp.float32)
    probe = NnxDecoder(graphdef, layout, vocab_size, max_seq_len, 0, dtype, head_method)
    hidden_size = _check_shapes(probe, state)
    return NnxModel(state, dataclasses.replace(probe, hidden_size=hidden_size))


def _check_shapes(dec: NnxDecoder, state: Any) -> int:
    """Trace one token through the module (no FLOPs): its hidden size, or a clear error."""
    def run(params):
        cache = dec.init_cache(1, 8, kind=CACHE_KINDS[0], slack=0, page_size=8, num_pages=None)
        tok = jnp.zeros((1, 1), jnp.int32)
        hidden, _ = dec.forward_hidden(params, tok, tok, cache)
        return hidden, dec.head(params, hidden)

    try:
        hidden, logits = jax.eval_shape(run, state)
    except Exception as e:  # the user's module: report what it raised, named
        raise ValueError(f"module is invalid: one token through it with layout={dec.layout} failed: "
                         f"{type(e).__name__}: {e}") from e
    if hidden.ndim != 3 or hidden.shape[:2] != (1, 1):
        raise ValueError(f"module is invalid: it returned hidden of shape {hidden.shape} for tokens [1, 1]; "
                         "expected [B, t, H]")
    if logits.shape[-1] != dec.vocab_size:
        raise ValueError(f"vocab_size={dec.vocab_size} is invalid: the module's {dec.head_method} returns "
                         f"{logits.shape[-1]} logits")
    return int(hidden.shape[-1])
