"""EAGLE-3 heads (the SpecForge / EAGLE-authors layout) onto specjax's MTP module
(``ModelConfig.mtp_layout="eagle3"``, chained by the MTP drafter, with trees).

A checkpoint folder holds ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
Llama layer fields, ``num_hidden_layers: 1``, ``draft_vocab_size``, optionally
``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors``:

===================================================  ==========================================
EAGLE-3 tensor                                       specjax (``params["mtp"]``)
===================================================  ==========================================
``fc.weight [d, 3 d]``                               ``fc [3 d, d]`` over the taps in id order
``midlayer.hidden_norm.weight``                      ``norm_h`` (the hidden's norm)
``midlayer.input_layernorm.weight``                  ``norm_e`` (the embedding's norm)
``midlayer.self_attn.{q,k,v}_proj.weight [., 2 d]``  ``block.wqkv [2 d, .]`` over [emb ‖ hidden]
``midlayer.self_attn.o_proj.weight``                 ``block.wo``
``midlayer.post_attention_layernorm.weight``         ``block.mlp_norm``
``midlayer.mlp.{gate,up,down}_proj.weight``          ``block.w_gate_up``, ``block.w_down``
``norm.weight``                                      ``final_norm``
``lm_head.weight [N, d]``                            ``draft_head [d, N]``
``d2t [N]`` (int64 offsets)                          ``draft_ids = arange(N) + d2t``
``t2d [V]`` (bool)                                   checked against ``draft_ids``
``embed_tokens.weight`` (optional)                   must equal the target's embedding
===================================================  ==========================================

The aux layer ids follow vLLM's reading: id ``k`` is the hidden state entering the target's
layer ``k``, the output of layer ``k - 1`` (specjax's tap ``k - 1``); the default without
``eagle_config`` is ``(2, L // 2, L - 3)`` of an ``L``-layer target. The layer's q/k/v read
[RMSNorm(embedding of the next token) ‖ RMSNorm(hidden)] and its residual is the hidden; the
head applies ``norm`` to the layer's output, which a chain feeds back before that norm.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.drafter_checkpoints.tensors import (
    cast,
    layer_overrides,
    layer_shapes,
    refuse_unexpressible,
    tensor_reader,
    with_drafter,
)
from specjax.hf_io import TensorReader as _Reader
from specjax.hf_io import config_field as _field
from specjax.hf_io import rope_scaling_dict
from specjax.model import Model, unfuse_params
from specjax.model.layers import fuse_block

__all__ = ["ARCH", "default_aux_layers", "load", "matches", "save"]

ARCH = "LlamaForCausalLMEagle3"
_LAYER = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
          "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def matches(raw: dict) -> bool:
    """Is this ``config.json`` an EAGLE-3 head's?"""
    return ARCH in (raw.get("architectures") or [])


def default_aux_layers(n_target: int) -> list[int]:
    """vLLM's aux layer ids when a head's config names none: early, middle and late."""
    return [2, n_target // 2, n_target - 3]


def _mismatch(cfg_path: Path, what: str) -> ValueError:
    return ValueError(f"{cfg_path}: this EAGLE-3 head does not fit the target: {what}")


def load(path: Path, raw: dict, target: Model, dtype=None) -> Model:
    """``target`` carrying the EAGLE-3 head in ``path`` as its MTP module (any MTP module it had
    is replaced). ``dtype``: the head's weights' dtype (default: the target's)."""
    cfg_path, tc = path / "config.json", target.config
    if tc.shard_groups != 1:
        raise ValueError("load the drafter onto the target as loaded, before shard_model()")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{cfg_path}: field {flag!r}={raw[flag]!r} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg_path}: field 'hidden_act'={raw['hidden_act']!r} is not supported (only 'silu')")
    if _field(raw, "num_hidden_layers", cfg_path, 1) != 1:
        raise ValueError(f"{cfg_path}: field 'num_hidden_layers'={raw['num_hidden_layers']!r}: an EAGLE-3 head has "
                         "one layer (midlayer)")
    d = _field(raw, "hidden_size", cfg_path)
    for name, theirs in (("hidden size", d), ("target hidden size", raw.get("target_hidden_size", d))):
        if theirs != tc.d_model:
            raise _mismatch(cfg_path, f"{name} {theirs} vs the target's {tc.d_model}")
    vocab = _field(raw, "vocab_size", cfg_path)
    if vocab != tc.vocab_size:
        raise _mismatch(cfg_path, f"vocabulary {vocab} vs the target's {tc.vocab_size}")
    n = int(_field(raw, "draft_vocab_size", cfg_path, vocab))
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(tc.n_layers)
    for i in ids:
        if not (isinstance(i, int) and 1 <= i <= tc.n_layers):
            raise _mismatch(cfg_path, f"aux layer id {i!r} (eagle_aux_hidden_state_layer_ids: the hidden state "
                                      f"entering that layer) is outside the target's layers 1 .. {tc.n_layers}")
    overrides = layer_overrides(raw, cfg_path, d, qk_norm=False, rope_arch="LlamaForCausalLM")
    cfg = with_drafter(tc, cfg_path, mtp_depth=1, mtp_layout="eagle3", mtp_taps=tuple(i - 1 for i in ids),
                       mtp_draft_vocab=n, mtp_overrides=overrides)
    r = tensor_reader(path, dtype, target)
    shapes = layer_shapes(cfg.mtp_config, d, 2 * d)
    blk = {ours: r.get(f"midlayer.{theirs}.weight", shapes[ours], transpose=True) for ours, theirs in _LAYER.items()}
    blk["mlp_norm"] = r.get("midlayer.post_attention_layernorm.weight", (d,))
    raw_reader = _Reader(r.files, None, host=True)  # stored dtypes, on the host
    d2t = np.asarray(raw_reader.get("d2t", (n,)), np.int64)
    r.used.add("d2t")
    draft_ids = np.arange(n) + d2t
    bad = draft_ids[(draft_ids < 0) | (draft_ids >= tc.vocab_size)]
    if bad.size:
        raise _mismatch(cfg_path, f"d2t maps a draft id to target id {int(bad[0])}, outside the target's vocabulary "
                                  f"[0, {tc.vocab_size})")
    if len(np.unique(draft_ids)) != n:
        raise ValueError(f"{path}: d2t maps two draft ids to one target id")
    if "t2d" in r.files:
        t2d = np.asarray(raw_reader.get("t2d", (tc.vocab_size,)), bool)
        r.used.add("t2d")
        if t2d.sum() != n or not t2d[draft_ids].all():
            raise ValueError(f"{path}: t2d does not mark the target ids d2t maps to")
    if "embed_tokens.weight" in r.files:
        mine = target.params["embed"]  # compared in the target's dtype (a bf16 target of an f32 head)
        theirs = jnp.asarray(raw_reader.get("embed_tokens.weight", (tc.vocab_size, d)), mine.dtype)
        r.used.add("embed_tokens.weight")
        if not bool(jnp.array_equal(theirs, mine)):
            raise ValueError(f"{path}: tensor 'embed_tokens.weight' differs from the target's embedding: a head with "
                             "an embedding of its own is not implemented")
    mtp = {"fc": r.get("fc.weight", (len(ids) * d, d), transpose=True),
           "norm_h": r.get("midlayer.hidden_norm.weight", (d,)),
           "norm_e": r.get("midlayer.input_layernorm.weight", (d,)),
           "block": fuse_block(blk), "final_norm": r.get("norm.weight", (d,)),
           "draft_head": r.get("lm_head.weight", (d, n), transpose=True),
           "draft_ids": jnp.asarray(draft_ids, jnp.int32)}
    extra = sorted(k for k in r.files if k not in r.used)
    if extra:
        raise ValueError(f"{path}: tensor {extra[0]!r} is not part of the EAGLE-3 layout ({len(extra)} unused)")
    return Model({**target.params, "mtp": mtp}, cfg)


def save(model: Model, path: Path, dtype: str = "float32") -> None:
    """Write ``model``'s EAGLE-3 MTP module (``mtp_layout="eagle3"``) in the public layout
    (float32), which ``load``, vLLM and SGLang read."""
    from safetensors.numpy import save_file

    cfg = model.config
    if cfg.mtp_layout != "eagle3" or "mtp" not in model.params:
        raise ValueError(f"the model has no EAGLE-3 head to save (mtp_layout={cfg.mtp_layout!r})")
    mc = cfg.mtp_config
    refuse_unexpressible(mc, "EAGLE-3 layout (a Llama layer)", "head", qk_norm=False)
    m = unfuse_params(model.params, cfg)["mtp"]
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    unit = lambda w: f32(np.asarray(w, np.float32) + mc.norm_offset)  # noqa: E731
    if cfg.mtp_draft_vocab:
        head, ids = f32(m["draft_head"]), np.asarray(m["draft_ids"], np.int64)
    else:  # the target's head over every token
        head = f32(model.params["embed"]).T if cfg.tie_embeddings else f32(model.params["lm_head"])
        ids = np.arange(cfg.vocab_size)
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[ids] = True
    tensors = {"fc.weight": f32(m["fc"]).T, "midlayer.hidden_norm.weight": unit(m["norm_h"]),
               "midlayer.input_layernorm.weight": unit(m["norm_e"]),
               "midlayer.post_attention_layernorm.weight": unit(m["block"]["mlp_norm"]),
               "norm.weight": unit(m["final_norm"]), "lm_head.weight": head.T, "d2t": ids - np.arange(ids.size),
               "t2d": t2d}
    tensors.update({"midlayer." + theirs + ".weight": f32(m["block"][ours]).T for ours, theirs in _LAYER.items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file(cast(tensors, dtype), str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": [ARCH], "model_type": "llama", "hidden_size": cfg.d_model, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": int(ids.size), "num_hidden_layers": 1, "num_attention_heads": mc.n_heads,
        "num_key_value_heads": mc.n_kv_heads, "head_dim": mc.head_dim, "intermediate_size": mc.d_ff,
        "rms_norm_eps": mc.norm_eps, "rope_theta": mc.rope_theta, "hidden_act": "silu", "attention_bias": False,
        "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": False, "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [t + 1 for t in cfg.mtp_taps],
                         "use_aux_hidden_state": True},
    }
    if mc.rope_scaling is not None:
        config["rope_scaling"] = rope_scaling_dict(mc.rope_scaling)
    (path / "config.json").write_text(json.dumps(config, indent=2))
