"""Named shapes of public checkpoints: one table of names -> ``ModelConfig`` (no weights).

Used for sizing (``specjax memory --config NAME``) and for speed at real shapes
(``specjax bench --shape NAME``: random weights in that shape). Each entry follows the
checkpoint's own ``config.json`` (layers, widths, heads, vocabulary, tied embeddings, RoPE,
norms); ``mtp_depth`` is 3 (an MTP module shaped like one of the model's blocks, as
DeepSeek-V3's) so every shape can draft with MTP. ``max_seq_len`` is only a validation bound.

``DRAFT_SHAPES``: the draft model each shape is benchmarked with (same vocabulary): the
smaller public sibling where one exists (Llama-3.2-1B for Llama-3.1-8B), else a 4-layer model
of half the width (about a tenth of the target's blocks; the vocabulary's embedding stays).
"""

from __future__ import annotations

import dataclasses

from specjax.model.config import ModelConfig
from specjax.model.rope import RopeScaling

__all__ = ["DRAFT_SHAPES", "SHAPES", "draft_shape", "shape"]

_LLAMA3_ROPE = dict(kind="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

SHAPES: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                              d_ff=3072, max_seq_len=40960, mtp_depth=3, tie_embeddings=True, qk_norm=True,
                              rope_theta=1000000.0),
    "llama3.2-1b": ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                               d_ff=8192, max_seq_len=131072, mtp_depth=3, tie_embeddings=True, rope_theta=500000.0,
                               norm_eps=1e-5, rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_ROPE)),
    "gemma3-1b": ModelConfig(vocab_size=262144, d_model=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256,
                             d_ff=6912, max_seq_len=32768, mtp_depth=3, tie_embeddings=True, sliding_window=512,
                             global_every=6, qk_norm=True, norm_offset=1.0, sandwich_norm=True, mlp_act="gelu_tanh",
                             embed_scale=1152 ** 0.5, query_pre_attn_scalar=256.0, rope_theta=1000000.0,
                             local_rope_theta=10000.0),
    "llama3.1-8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                               max_seq_len=131072, mtp_depth=3, tie_embeddings=False, rope_theta=500000.0,
                               norm_eps=1e-5, rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_ROPE)),
    "llama3-8b": ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                             max_seq_len=8192, mtp_depth=3, tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-5),
    "llama3-70b": ModelConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                              max_seq_len=8192, mtp_depth=3, tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-5),
}

# the draft model benchmarked with each shape: a public sibling (a SHAPES name) or None (``draft_shape``'s rule)
DRAFT_SHAPES: dict[str, str | None] = {"llama3.1-8b": "llama3.2-1b", "llama3-8b": "llama3.2-1b",
                                       "llama3-70b": "llama3.2-1b"}


def shape(name: str) -> ModelConfig:
    """``SHAPES[name]``; ``ValueError`` naming the shapes there are."""
    if name not in SHAPES:
        raise ValueError(f"shape {name!r} is unknown: must be one of {', '.join(SHAPES)}")
    return SHAPES[name]


def draft_shape(name: str) -> ModelConfig:
    """The draft model's shape for target shape ``name`` (no MTP module of its own)."""
    target = shape(name)
    sibling = DRAFT_SHAPES.get(name)
    if sibling is not None:
        cfg = SHAPES[sibling]
    else:
        d = target.d_model // 2
        heads = max(1, target.n_heads // 2)
        kv = max(1, min(target.n_kv_heads, heads))
        while heads % kv:
            kv -= 1
        cfg = dataclasses.replace(target, d_model=d, n_layers=4, n_heads=heads, n_kv_heads=kv,
                                  head_dim=min(target.head_dim, 128), d_ff=target.d_ff // 2,
                                  embed_scale=d ** 0.5 if target.embed_scale != 1.0 else 1.0,
                                  sliding_window=None, global_every=0, local_rope_theta=None)
    return dataclasses.replace(cfg, mtp_depth=0, max_seq_len=target.max_seq_len)
