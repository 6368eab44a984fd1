"""A Llama-family decoder with an optional DeepSeek-V3-style MTP module, in plain JAX.

Read top to bottom: params -> RMSNorm, RoPE -> one block -> the forward over a
per-row KV cache -> the plain full-prefix forward -> MTP.

Params are a plain pytree (dicts of arrays); ``Model`` pairs them with a static
``ModelConfig``. Shapes: tokens/positions ``[B, t]``, hidden ``[B, t, d_model]``,
q ``[B, t, n_heads, head_dim]``, k/v ``[B, t, n_kv_heads, head_dim]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax._pytree import pytree_dataclass, static_field
from specjax.cache import DenseKVCache, PagedKVCache, RollingKVCache
from specjax.model.config import ModelConfig

__all__ = ["Model", "ModelCache", "forward", "init_cache", "init_model", "logits", "mtp_forward"]


# ----------------------------------------------------------------------------- params


@pytree_dataclass
class Model:
    params: dict
    config: ModelConfig = static_field()


def _block_params(key: jax.Array, cfg: ModelConfig, dtype) -> dict:
    d, hd, f = cfg.d_model, cfg.dim_head, cfg.d_ff
    ks = jax.random.split(key, 7)
    std = 0.02
    p = {
        "attn_norm": jnp.ones((d,), dtype),
        "wq": (jax.random.normal(ks[0], (d, cfg.n_heads * hd)) * std).astype(dtype),
        "wk": (jax.random.normal(ks[1], (d, cfg.n_kv_heads * hd)) * std).astype(dtype),
        "wv": (jax.random.normal(ks[2], (d, cfg.n_kv_heads * hd)) * std).astype(dtype),
        "wo": (jax.random.normal(ks[3], (cfg.n_heads * hd, d)) * std / np.sqrt(2 * cfg.n_layers)).astype(dtype),
        "mlp_norm": jnp.ones((d,), dtype),
        "w_gate": (jax.random.normal(ks[4], (d, f)) * std).astype(dtype),
        "w_up": (jax.random.normal(ks[5], (d, f)) * std).astype(dtype),
        "w_down": (jax.random.normal(ks[6], (f, d)) * std / np.sqrt(2 * cfg.n_layers)).astype(dtype),
    }
    if cfg.qkv_bias:
        p["bq"] = jnp.zeros((cfg.n_heads * hd,), dtype)
        p["bk"] = jnp.zeros((cfg.n_kv_heads * hd,), dtype)
        p["bv"] = jnp.zeros((cfg.n_kv_heads * hd,), dtype)
    return p


def init_model(config: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Model:
    """Random-initialised ``Model`` (normal(0, 0.02) weights, unit norms)."""
    key = jax.random.key(seed)
    k_emb, k_head, k_layers, k_mtp = jax.random.split(key, 4)
    params: dict = {
        "embed": (jax.random.normal(k_emb, (config.vocab_size, config.d_model)) * 0.02).astype(dtype),
        "layers": [_block_params(k, config, dtype) for k in jax.random.split(k_layers, config.n_layers)],
        "final_norm": jnp.ones((config.d_model,), dtype),
    }
    if not config.tie_embeddings:
        params["lm_head"] = (jax.random.normal(k_head, (config.d_model, config.vocab_size)) * 0.02).astype(dtype)
    if config.mtp_depth > 0:
        k_proj, k_block = jax.random.split(k_mtp)
        d = config.d_model
        params["mtp"] = {
            "norm_h": jnp.ones((d,), dtype),
            "norm_e": jnp.ones((d,), dtype),
            "proj": (jax.random.normal(k_proj, (2 * d, d)) * 0.02).astype(dtype),
            "block": _block_params(k_block, config, dtype),
        }
    return Model(params, config)


# ----------------------------------------------------------------------------- pieces


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. ``x [B, t, H, hd]``, ``positions [B, t]`` (per token, per row)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))  # [hd/2]
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, t, hd/2]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, axis=-1)[:, :, None]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, axis=-1)[:, :, None]
    x32 = x.astype(jnp.float32)
    half = hd // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _qkv(p: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig):
    b, t, _ = x.shape
    h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = rope(q.reshape(b, t, cfg.n_heads, cfg.dim_head), positions, cfg.rope_theta)
    k = rope(k.reshape(b, t, cfg.n_kv_heads, cfg.dim_head), positions, cfg.rope_theta)
    return q, k, v.reshape(b, t, cfg.n_kv_heads, cfg.dim_head)


def _finish_block(p: dict, x: jax.Array, attn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Residual after attention, then the SwiGLU MLP residual."""
    b, t = x.shape[:2]
    x = x + attn.reshape(b, t, -1) @ p["wo"]
    h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
    return x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def _head(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Shared final norm + output head -> float32 logits ``[B, t, V]``."""
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


# ----------------------------------------------------------------------------- cache


GlobalCache = DenseKVCache | PagedKVCache


@pytree_dataclass
class ModelCache:
    """Per-row KV state of a whole model: global layers in a dense or paged cache,
    sliding-window layers in a rolling cache. All parts share the same ``lengths``."""

    global_kv: GlobalCache | None
    local_kv: RollingKVCache | None

    @property
    def parts(self) -> tuple:
        return tuple(c for c in (self.global_kv, self.local_kv) if c is not None)

    @property
    def lengths(self) -> jax.Array:
        return self.parts[0].lengths

    @property
    def status(self) -> jax.Array:
        out = self.parts[0].status
        for c in self.parts[1:]:
            out = out | c.status
        return out

    def _map(self, fn) -> ModelCache:
        return ModelCache(
            None if self.global_kv is None else fn(self.global_kv),
            None if self.local_kv is None else fn(self.local_kv),
        )

    def reserve(self, t: int) -> ModelCache:
        """Paged global layers: own pages for ``t`` more tokens (no-op for other kinds)."""
        return self._map(lambda c: c.reserve(t) if isinstance(c, PagedKVCache) else c)

    def advance(self, n: jax.Array | int) -> ModelCache:
        return self._map(lambda c: c.advance(n))

    def apply_plan(self, plan) -> ModelCache:
        return self._map(lambda c: c.apply_plan(plan))

    def rollback(self, new_lengths: jax.Array) -> ModelCache:
        return self._map(lambda c: c.rollback(new_lengths))

    def with_lengths(self, lengths: jax.Array) -> ModelCache:
        """Same buffers, write offset moved to ``lengths`` (scratch writes past the
        committed length, e.g. chained drafting; restore with ``with_lengths`` after)."""
        return self._map(lambda c: c.replace(lengths=lengths))


def init_cache(
    config: ModelConfig,
    batch: int,
    capacity: int,
    *,
    kind: str = "dense",
    slack: int = 8,
    page_size: int = 16,
    num_pages: int | None = None,
    dtype=jnp.float32,
) -> ModelCache:
    """Empty per-row caches for ``batch`` rows of up to ``capacity`` tokens.

    ``kind``: ``"dense"`` or ``"paged"`` for global layers (sliding-window layers always
    use the rolling cache, whose ``slack`` must cover the longest single write).
    """
    if kind not in ("dense", "paged"):
        raise ValueError(f"cache kind must be 'dense' or 'paged', got {kind!r}")
    n_g, n_l = len(config.global_layers), len(config.local_layers)
    hkv, hd = config.n_kv_heads, config.dim_head
    g = None
    if n_g:
        if kind == "dense":
            g = DenseKVCache.create(n_g, batch, capacity, hkv, hd, dtype)
        else:
            max_pages = -(-capacity // page_size)
            pages = batch * max_pages if num_pages is None else num_pages
            g = PagedKVCache.create(n_g, batch, pages, page_size, max_pages, hkv, hd, dtype)
    loc = RollingKVCache.create(n_l, batch, config.sliding_window, slack, hkv, hd, dtype) if n_l else None
    return ModelCache(g, loc)


# ----------------------------------------------------------------------------- forward


def forward(
    params: dict, config: ModelConfig, tokens: jax.Array, positions: jax.Array, cache: ModelCache
) -> tuple[jax.Array, jax.Array, ModelCache]:
    """Run ``tokens [B, t]`` at RoPE ``positions [B, t]``, writing their K/V at each row's
    own ``cache.lengths`` (the lengths do not move: commit with ``cache.apply_plan``).

    Query ``j`` of row ``b`` attends cache slots up to ``lengths[b] + j`` (and the window
    on local layers); everything else is masked per row. Returns float32 logits
    ``[B, t, V]``, the last block's hidden state ``[B, t, d]`` (before the final norm,
    what MTP consumes), and the written cache.
    """
    x = params["embed"][tokens]
    g_idx = {layer: i for i, layer in enumerate(config.global_layers)}
    l_idx = {layer: i for i, layer in enumerate(config.local_layers)}
    g, loc = cache.global_kv, cache.local_kv
    for layer, p in enumerate(params["layers"]):
        q, k, v = _qkv(p, x, positions, config)
        if config.is_local(layer):
            loc = loc.write(l_idx[layer], k, v)
            attn = loc.attend(q, l_idx[layer])
        else:
            g = g.write(g_idx[layer], k, v)
            attn = g.attend(q, g_idx[layer])
        x = _finish_block(p, x, attn, config)
    return _head(params, config, x), x, ModelCache(g, loc)


def _full_attention(q, k, v, window):
    """Plain causal softmax attention over the ``t`` tokens themselves (no cache): the
    training path and the oracle the cached forward is tested against. Query ``i``
    sees keys ``j <= i`` (and ``j > i - window`` when windowed)."""
    t, d = q.shape[1], q.shape[-1]
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None]
    visible = (j <= i) if window is None else (j <= i) & (j > i - window)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * d**-0.5
    p = jax.nn.softmax(jnp.where(visible, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


def hidden_states(model: Model, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain full-prefix forward without a cache: ``tokens [B, T]`` -> float32 logits
    ``[B, T, V]`` and the pre-norm hidden ``[B, T, d]`` (what MTP consumes)."""
    cfg, params = model.config, model.params
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params["embed"][tokens]
    for layer, p in enumerate(params["layers"]):
        q, k, v = _qkv(p, x, positions, cfg)
        window = cfg.sliding_window if cfg.is_local(layer) else None
        x = _finish_block(p, x, _full_attention(q, k, v, window), cfg)
    return _head(params, cfg, x), x


def logits(model: Model, tokens: jax.Array) -> jax.Array:
    """Plain full-prefix forward without a cache: ``tokens [B, T] -> float32 [B, T, V]``."""
    return hidden_states(model, tokens)[0]


# ----------------------------------------------------------------------------- MTP


def mtp_forward(
    params: dict,
    config: ModelConfig,
    hidden: jax.Array,
    next_tokens: jax.Array,
    positions: jax.Array,
    cache: DenseKVCache | None = None,
) -> tuple[jax.Array, jax.Array, DenseKVCache | None]:
    """DeepSeek-V3 MTP: ``concat(RMSNorm(h_i), RMSNorm(emb(t_{i+1}))) -> Linear -> block ->
    final norm + head``, predicting ``t_{i+2}``.

    ``hidden [B, t, d]`` (target pre-norm hidden at positions ``i``), ``next_tokens [B, t]``
    (``t_{i+1}``). With ``cache`` (one layer, the MTP's own per-row cache) the block
    writes at ``cache.lengths``; without, it attends causally within the ``t`` tokens.
    Returns logits ``[B, t, V]``, the block's hidden ``[B, t, d]`` (fed back as ``h``
    when chaining) and the written cache.
    """
    m = params["mtp"]
    e = params["embed"][next_tokens]
    z = jnp.concatenate(
        [rms_norm(hidden, m["norm_h"], config.norm_eps), rms_norm(e, m["norm_e"], config.norm_eps)], axis=-1
    )
    x = z @ m["proj"]
    q, k, v = _qkv(m["block"], x, positions, config)
    if cache is None:
        attn = _full_attention(q, k, v, None)
    else:
        cache = cache.write(0, k, v)
        attn = cache.attend(q, 0)
    x = _finish_block(m["block"], x, attn, config)
    return _head(params, config, x), x, cache
