"""The pieces every decoder block is made of (the target's layers, the MTP block, the block
drafter's layers): RMSNorm, the embedding, one block's fused q/k/v projection and RoPE, its
attention output and gated MLP, the output head, and the block params' fused layout.

Each block runs two input matmuls, not five: ``wqkv [d, (Hq + 2 Hkv) * hd]`` (q, k, v side by
side) and ``w_gate_up [d, 2 * d_ff]``. ``fuse_block``/``unfuse_block`` convert to and from the
separate tensors that bundles and Hugging Face checkpoints store.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.attention import attend_visible
from specjax.masks import visible
from specjax.model.config import ModelConfig
from specjax.model.rope import rope, rope_frequencies

__all__ = ["block_finish", "block_params", "block_qkv", "cache_attention", "causal_attention", "embed", "fuse_block",
           "head", "norm", "project_qkv", "rms_norm", "unfuse_block"]


def block_params(key: jax.Array, cfg: ModelConfig, dtype) -> dict:
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    ks = jax.random.split(key, 7)
    std = 0.02
    unit = lambda n: jnp.full((n,), 1.0 - cfg.norm_offset, dtype)  # noqa: E731  a norm weight acting as 1
    p = {
        "attn_norm": unit(d),
        "wq": (jax.random.normal(ks[0], (d, cfg.n_heads * hd)) * std).astype(dtype),
        "wk": (jax.random.normal(ks[1], (d, cfg.n_kv_heads * hd)) * std).astype(dtype),
        "wv": (jax.random.normal(ks[2], (d, cfg.n_kv_heads * hd)) * std).astype(dtype),
        "wo": (jax.random.normal(ks[3], (cfg.n_heads * hd, d)) * std / np.sqrt(2 * cfg.n_layers)).astype(dtype),
        "mlp_norm": unit(d),
        "w_gate": (jax.random.normal(ks[4], (d, f)) * std).astype(dtype),
        "w_up": (jax.random.normal(ks[5], (d, f)) * std).astype(dtype),
        "w_down": (jax.random.normal(ks[6], (f, d)) * std / np.sqrt(2 * cfg.n_layers)).astype(dtype),
    }
    if cfg.qkv_bias:
        p["bq"] = jnp.zeros((cfg.n_heads * hd,), dtype)
        p["bk"] = jnp.zeros((cfg.n_kv_heads * hd,), dtype)
        p["bv"] = jnp.zeros((cfg.n_kv_heads * hd,), dtype)
    if cfg.qk_norm:
        p["q_norm"], p["k_norm"] = unit(hd), unit(hd)
    if cfg.sandwich_norm:
        p["post_attn_norm"], p["post_mlp_norm"] = unit(d), unit(d)
    return fuse_block(p)


_FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}


def fuse_block(p: dict) -> dict:
    out = {k: v for k, v in p.items() if not any(k in parts for parts in _FUSED.values())}
    for fused, parts in _FUSED.items():
        if parts[0] in p:
            xp = np if isinstance(p[parts[0]], np.ndarray) else jnp  # host arrays stay on the host
            out[fused] = xp.concatenate([p[n] for n in parts], axis=-1)
    return out


def unfuse_block(p: dict, cfg: ModelConfig) -> dict:
    hd = cfg.head_dim
    sizes = {"wqkv": (cfg.n_heads * hd, cfg.n_kv_heads * hd), "bqkv": (cfg.n_heads * hd, cfg.n_kv_heads * hd),
             "w_gate_up": (cfg.d_ff,)}
    out = {k: v for k, v in p.items() if k not in _FUSED}
    for fused, parts in _FUSED.items():
        if fused in p:
            cuts = np.cumsum(sizes[fused]).tolist()
            for name, piece in zip(parts, jnp.split(p[fused], cuts, axis=-1), strict=True):
                out[name] = piece
    return out


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm in float32, weight applied as ``offset + w`` (Gemma stores ``w`` around 0)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    w32 = w.astype(jnp.float32)
    return (y * (w32 + offset if offset else w32)).astype(x.dtype)


def norm(x: jax.Array, w: jax.Array, cfg: ModelConfig) -> jax.Array:
    return rms_norm(x, w, cfg.norm_eps, cfg.norm_offset)


def embed(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Token embeddings ``[..., d]``, times ``embed_scale`` (rounded to their dtype, as Gemma does)."""
    x = params["embed"][tokens]
    return x if cfg.embed_scale == 1.0 else x * jnp.asarray(cfg.embed_scale, x.dtype)


def block_qkv(p: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig, layer: int | None):
    """q ``[B, t, Hq, hd]``, k, v ``[B, t, Hkv, hd]`` of block ``p`` (``layer`` picks the RoPE;
    ``None``: the MTP block). The attention scale's departure from ``hd ** -0.5`` rides on q."""
    return project_qkv(p, norm(x, p["attn_norm"], cfg), positions, cfg, layer)


def project_qkv(p: dict, h: jax.Array, positions: jax.Array, cfg: ModelConfig, layer: int | None):
    """``block_qkv`` of an input ``h [B, t, d]`` already normed (or one that takes no norm: a
    block drafter's context, ``specjax.model.block``)."""
    b, t, _ = h.shape
    qkv = h @ p["wqkv"]  # one matmul for q, k and v
    if cfg.qkv_bias:
        qkv = qkv + p["bqkv"]
    hd, g = cfg.head_dim, cfg.shard_groups
    nq, nkv = cfg.n_heads * hd // g, cfg.n_kv_heads * hd // g  # per column group (one device's under sharding)
    qkv = qkv.reshape(b, t, g, -1)
    q = qkv[..., :nq].reshape(b, t, cfg.n_heads, hd)
    k = qkv[..., nq : nq + nkv].reshape(b, t, cfg.n_kv_heads, hd)
    if cfg.qk_norm:
        q, k = norm(q, p["q_norm"], cfg), norm(k, p["k_norm"], cfg)
    inv_freq, factor = rope_frequencies(hd, *cfg.rope_for(layer))
    q_scale = 1.0 if cfg.query_pre_attn_scalar is None else (hd / cfg.query_pre_attn_scalar) ** 0.5
    q = rope(q, positions, inv_freq, factor * q_scale)
    k = rope(k, positions, inv_freq, factor)
    return q, k, qkv[..., nq + nkv :].reshape(b, t, cfg.n_kv_heads, hd)


def block_finish(p: dict, x: jax.Array, attn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Residual after attention, then the gated MLP (SwiGLU or GeGLU) residual; with
    ``sandwich_norm`` each branch is normed again before its residual add."""
    b, t = x.shape[:2]
    a = attn.reshape(b, t, -1) @ p["wo"]
    x = x + (norm(a, p["post_attn_norm"], cfg) if cfg.sandwich_norm else a)
    h = norm(x, p["mlp_norm"], cfg)
    gate_up = (h @ p["w_gate_up"]).reshape(b, t, cfg.shard_groups, -1)  # one matmul for gate and up
    f = cfg.d_ff // cfg.shard_groups
    gate, up = gate_up[..., :f].reshape(b, t, -1), gate_up[..., f:].reshape(b, t, -1)
    act = jax.nn.silu(gate) if cfg.mlp_act == "silu" else jax.nn.gelu(gate, approximate=True)
    m = (act * up) @ p["w_down"]
    return x + (norm(m, p["post_mlp_norm"], cfg) if cfg.sandwich_norm else m)


def head(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm + output head: pre-norm hidden ``[..., d]`` -> float32 logits ``[..., V]``.
    Callers apply it only to the positions whose logits they use."""
    h = norm(x, params["final_norm"], cfg)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    return (h @ w).astype(jnp.float32)


def causal_attention(q, k, v, window):
    """Attention of ``t`` tokens over themselves (no cache): the training path and the
    oracle the cached forward is tested against. Query ``i`` sees keys ``j <= i`` (and
    ``j > i - window`` when windowed): the same core and mask as every cache path."""
    pos = jnp.arange(q.shape[1], dtype=jnp.int32)[None]
    hm = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, t, Hkv, D] -> head-major [B, Hkv, t, D]
    return attend_visible(q, hm(k), hm(v), visible(pos, pos, jnp.zeros((1,), jnp.int32), window))


def cache_attention(impl: str):
    """``per_shard``'s ``fn(cache, q, layer, tree)``: the cache's attention (one device's rows and
    heads under a mesh), under a token tree's mask where one is given."""
    def attend(c, q, layer, tree):
        return c.attend(q, layer, impl=impl, **({} if tree is None else {"tree": tree}))

    return attend
