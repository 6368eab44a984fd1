"""The MTP module: one decoder block that drafts the token after next from the target's hidden
and the next token's embedding (DeepSeek-V3's layout, ``mtp_layout="specjax"``), a checkpoint's
own MTP layer (``"native"``: MiMo, DeepSeek-V3, normed in and out) or an EAGLE-3 head
(``"eagle3"``: the target's tapped layers through ``fc``, q/k/v over [embedding ‖ hidden], its
own final norm and draft vocabulary). Shapes: hidden ``[B, t, d]``, tokens ``[B, t]``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.attention import TreeMask
from specjax.cache import DenseKVCache
from specjax.model.config import ModelConfig
from specjax.model.layers import (
    block_finish,
    block_params,
    cache_attention,
    causal_attention,
    embed,
    head,
    norm,
    project_qkv,
)
from specjax.sharding import per_shard

__all__ = ["init_mtp_params", "mtp_attention_input", "mtp_forward", "mtp_hidden", "mtp_input", "mtp_logits",
           "mtp_source"]


def init_mtp_params(key: jax.Array, config: ModelConfig, dtype=jnp.float32) -> dict:
    """A random-initialised MTP module (``params["mtp"]``) in ``config.mtp_layout``: two norms,
    the ``[2d, d]`` projection and one block shaped like ``config.mtp_config``'s layers; an
    EAGLE-3 head has ``fc [n_taps * d, d]`` instead of the projection and its block's q/k/v read
    ``2 d`` (no input norm); native and EAGLE-3 modules have a ``final_norm`` of their own."""
    k_proj, k_block, k_head, k_qkv = jax.random.split(key, 4)
    d, mc = config.d_model, config.mtp_config
    one = 1.0 - mc.norm_offset
    out = {"norm_h": jnp.full((d,), one, dtype), "norm_e": jnp.full((d,), one, dtype),
           "block": block_params(k_block, mc, dtype)}
    if config.mtp_layout == "eagle3":
        out["fc"] = (jax.random.normal(k_proj, (len(config.mtp_taps) * d, d)) * 0.02).astype(dtype)
        blk = {k: v for k, v in out["block"].items() if k != "attn_norm"}
        blk["wqkv"] = (jax.random.normal(k_qkv, (2 * d, blk["wqkv"].shape[1])) * 0.02).astype(dtype)
        out["block"] = blk
    else:
        out["proj"] = (jax.random.normal(k_proj, (2 * d, d)) * 0.02).astype(dtype)
    if config.mtp_layout != "specjax":  # its own final norm
        out["final_norm"] = jnp.full((d,), one, dtype)
    if config.mtp_draft_vocab:  # a draft vocabulary: the first N ids until ``with_draft_vocab`` picks them
        n = config.mtp_draft_vocab
        out["draft_ids"] = jnp.arange(n, dtype=jnp.int32)
        out["draft_head"] = (jax.random.normal(k_head, (d, n)) * 0.02).astype(dtype)
    return out


def mtp_logits(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The MTP module's draft logits from its hidden ``[..., d]`` (pre-norm; a native module's
    normed already: ``mtp_layout``): float32 ``[..., N]`` over its draft vocabulary
    (``mtp_draft_vocab``), else the target's head ``[..., V]``."""
    if cfg.mtp_layout == "specjax":
        h = norm(x, params["final_norm"], cfg)
    elif cfg.mtp_layout == "eagle3":
        h = norm(x, params["mtp"]["final_norm"], cfg.mtp_config)
    else:  # native: its output is normed already
        h = x
    if cfg.mtp_draft_vocab:
        w = params["mtp"]["draft_head"]
    else:
        w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


def mtp_input(params: dict, config: ModelConfig, hidden: jax.Array, next_tokens: jax.Array) -> jax.Array:
    """The MTP block's input ``[B, t, d]``: ``concat(RMSNorm(h_i), RMSNorm(emb(t_{i+1}))) @ proj``."""
    m, mc = params["mtp"], config.mtp_config
    e = embed(params, config, next_tokens)
    return jnp.concatenate([norm(hidden, m["norm_h"], mc), norm(e, m["norm_e"], mc)], axis=-1) @ m["proj"]


def mtp_attention_input(params: dict, config: ModelConfig, hidden: jax.Array, next_tokens: jax.Array):
    """``(what the MTP layer's q/k/v read, its residual)``: EAGLE-3's [RMSNorm(emb(t_{i+1})) ‖
    RMSNorm(h_i)] (``2 d``) with the hidden as the residual; else the block's normed input."""
    m, mc = params["mtp"], config.mtp_config
    if config.mtp_layout == "eagle3":
        e = embed(params, config, next_tokens)
        return jnp.concatenate([norm(e, m["norm_e"], mc), norm(hidden, m["norm_h"], mc)], axis=-1), hidden
    x = mtp_input(params, config, hidden, next_tokens)
    return norm(x, m["block"]["attn_norm"], mc), x


def mtp_source(params: dict, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """The target's hidden from a forward, ``[B, t, d * (1 + n_taps)]``, as the MTP module reads
    it (``mtp_layout``): as it is, final-normed (native), or its taps through ``fc`` (EAGLE-3)."""
    d = config.d_model
    if config.mtp_layout == "native":
        return norm(hidden[..., :d], params["final_norm"], config)
    if config.mtp_layout == "eagle3":
        return hidden[..., d:] @ params["mtp"]["fc"].astype(hidden.dtype)
    return hidden[..., :d]


def mtp_hidden(
    params: dict,
    config: ModelConfig,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    cache: DenseKVCache | None = None,
    *,
    at: jax.Array | None = None,
    attention_impl: str = "xla",
    tree: TreeMask | None = None,
) -> tuple[jax.Array, DenseKVCache | None]:
    """DeepSeek-V3 MTP block: ``concat(RMSNorm(h_i), RMSNorm(emb(t_{i+1}))) -> Linear -> block``.

    ``hidden [B, t, d]`` (target pre-norm hidden at positions ``i``), ``next_tokens [B, t]``
    (``t_{i+1}``). With ``cache`` (one layer, the MTP's own per-row cache) the block
    writes at ``cache.lengths``; without, it attends causally within the ``t`` tokens.
    Returns the block's hidden ``[B, t, d]`` (``head`` of it predicts ``t_{i+2}``; it is
    fed back as ``h`` when chaining) and the written cache.

    ``at`` (int32 ``[B]``, with ``cache``): return only slot ``at`` of each row, ``[B, d]``.
    The cache gets the K and V of slots ``0 .. at`` (each depends on its own position's input
    alone; later slots are padding or rejected drafts, past what the cache keeps), and
    attention and the MLP run for slot ``at`` alone: a commit or a settle reads the block's
    output at one position, the ones before it cost only their K/V, and a write of ``t``
    slots needs room for ``at + 1`` (a settle's ``t`` is the backlog's width, not its count).
    """
    m, mc = params["mtp"], config.mtp_config
    h_in, x = mtp_attention_input(params, config, hidden, next_tokens)
    q, k, v = project_qkv(m["block"], h_in, positions, mc, None)
    if cache is None:
        attn = causal_attention(q, k, v, None)
    else:
        cache = cache.write(0, k, v, None if at is None else at + 1)
        view = cache
        if at is not None:  # one query per row, at lengths + at: it sees the keys written up to its slot
            one = lambda a: jnp.take_along_axis(a, at.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)  # noqa: E731
            q, x, view = one(q), one(x), cache.replace(lengths=cache.lengths + at)
        attn = per_shard(cache_attention(attention_impl), view, q, 0, tree)  # tree: the t tokens are a tree's nodes
    out = block_finish(m["block"], x, attn, mc)
    if config.mtp_layout == "native":  # MiMo, DeepSeek-V3: its output is its own norm's
        out = norm(out, m["final_norm"], mc)
    return (out if at is None else out[:, 0]), cache


def mtp_forward(
    params: dict,
    config: ModelConfig,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    cache: DenseKVCache | None = None,
    *,
    attention_impl: str = "xla",
) -> tuple[jax.Array, jax.Array, DenseKVCache | None]:
    """``mtp_hidden`` plus float32 logits at every position: ``(logits, hidden, cache)``; ``[B, t, V]``
    (a native or EAGLE-3 module's: ``mtp_logits``, over its draft vocabulary if it has one)."""
    x, cache = mtp_hidden(params, config, hidden, next_tokens, positions, cache, attention_impl=attention_impl)
    logits = head(params, config, x) if config.mtp_layout == "specjax" else mtp_logits(params, config, x)
    return logits, x, cache
