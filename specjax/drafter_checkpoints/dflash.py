"""DFlash drafters (z-lab's public layout) onto specjax's block drafter (``specjax.model.block``).

A DFlash checkpoint folder holds ``config.json`` (``architectures: ["DFlashDraftModel"]``,
Qwen3 layer fields, ``block_size``, ``num_target_layers`` and ``dflash_config``:
``mask_token_id``, ``target_layer_ids``) and ``model.safetensors``. It has no embedding and no
LM head: the target's are used. Tensor map (torch ``Linear`` weights are ``[out, in]``; ours
``[in, out]``):

==========================================  ===========================================
DFlash tensor                               specjax (``params["block"]``)
==========================================  ===========================================
``fc.weight [d, n_taps * d]``               ``fc [n_taps * d, d]`` (taps concatenated in
                                            ``target_layer_ids`` order)
``hidden_norm.weight [d]``                  ``hidden_norm``
``layers.N.input_layernorm.weight``         ``layers[N].attn_norm``
``layers.N.self_attn.{q,k,v}_proj.weight``  ``layers[N].wqkv`` (fused ``[q | k | v]``; no biases:
                                            ``attention_bias`` is refused)
``layers.N.self_attn.{q,k}_norm.weight``    ``layers[N].q_norm``, ``k_norm`` (per head)
``layers.N.self_attn.o_proj.weight``        ``layers[N].wo``
``layers.N.post_attention_layernorm``       ``layers[N].mlp_norm``
``layers.N.mlp.{gate,up}_proj.weight``      ``layers[N].w_gate_up``
``layers.N.mlp.down_proj.weight``           ``layers[N].w_down``
``norm.weight [d]``                         ``norm``
==========================================  ===========================================

``target_layer_ids`` index the target's layers from 0 and name the hidden state *after* that
layer (Hugging Face's ``hidden_states[id + 1]``), which is what ``block_taps`` means. The
drafter's layers may be shaped apart from the target's (heads, ``head_dim``, ``d_ff``, RoPE,
norm eps): they become ``ModelConfig.block_overrides``. Its width must be the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specjax.drafter_checkpoints.tensors import (
    cast,
    layer_overrides,
    layer_shapes,
    refuse_unexpressible,
    tensor_reader,
    with_drafter,
)
from specjax.hf_io import config_field as _field
from specjax.hf_io import rope_scaling_dict
from specjax.model import Model, unfuse_params
from specjax.model.layers import fuse_block

__all__ = ["ARCH", "default_target_layers", "load", "matches", "save"]

ARCH = "DFlashDraftModel"
_LAYER = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
          "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def matches(raw: dict) -> bool:
    """Is this ``config.json`` a DFlash drafter's?"""
    return ARCH in (raw.get("architectures") or []) or isinstance(raw.get("dflash_config"), dict)


def default_target_layers(n_target: int, n_draft: int) -> list[int]:
    """DFlash's tapped layers when ``target_layer_ids`` is absent: one per drafter layer, spread
    evenly from layer 1 to layer ``n_target - 3`` (one drafter layer: the middle layer)."""
    if n_draft == 1:
        return [n_target // 2]
    span = (n_target - 3) - 1
    return [int(round(1 + i * span / (n_draft - 1))) for i in range(n_draft)]


def _mismatch(cfg_path: Path, what: str) -> ValueError:
    return ValueError(f"{cfg_path}: this DFlash drafter does not fit the target: {what}")


def load(path: Path, raw: dict, target: Model, dtype=None) -> Model:
    """``target`` carrying the DFlash drafter in ``path`` as its block drafter (any drafter it
    had is replaced). ``dtype``: the drafter's weights' dtype (default: the target's)."""
    cfg_path, tc = path / "config.json", target.config
    if tc.shard_groups != 1:
        raise ValueError("load the drafter onto the target as loaded, before shard_model()")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if raw.get(flag):
            raise ValueError(f"{cfg_path}: field {flag!r}={raw[flag]!r} is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{cfg_path}: field 'hidden_act'={raw['hidden_act']!r} is not supported (only 'silu')")
    kinds = set(raw.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"{cfg_path}: field 'layer_types' has {sorted(kinds - {'full_attention'})}: only "
                         "full-attention drafter layers are implemented")
    d = _field(raw, "hidden_size", cfg_path)
    if d != tc.d_model:
        raise _mismatch(cfg_path, f"hidden size {d} vs the target's {tc.d_model}")
    vocab = raw.get("vocab_size")
    if vocab is not None and vocab != tc.vocab_size:
        raise _mismatch(cfg_path, f"vocabulary {vocab} vs the target's {tc.vocab_size}")
    n_draft = _field(raw, "num_hidden_layers", cfg_path)
    n_target = raw.get("num_target_layers")
    if n_target is not None and n_target != tc.n_layers:
        raise _mismatch(cfg_path, f"num_target_layers {n_target} vs the target's {tc.n_layers} layers")
    dcfg = raw.get("dflash_config") or {}
    taps = dcfg.get("target_layer_ids") or default_target_layers(tc.n_layers, n_draft)
    bad = [i for i in taps if not (isinstance(i, int) and 0 <= i < tc.n_layers)]
    if bad:
        raise _mismatch(cfg_path, f"target layer id {bad[0]!r} (dflash_config.target_layer_ids) is past the target's "
                                  f"depth: its layers are 0 .. {tc.n_layers - 1}")
    block = dcfg.get("block_size", raw.get("block_size"))
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{cfg_path}: field 'block_size'={block!r} must be an int >= 2")
    mask = dcfg.get("mask_token_id", raw.get("mask_token_id"))
    if mask is None:
        raise ValueError(f"{cfg_path}: field 'dflash_config.mask_token_id' is missing")
    if not (isinstance(mask, int) and 0 <= mask < tc.vocab_size):
        raise _mismatch(cfg_path, f"mask token id {mask!r} is outside the target's vocabulary [0, {tc.vocab_size})")
    overrides = layer_overrides(raw, cfg_path, d, qk_norm=True, rope_arch="Qwen3ForCausalLM")
    cfg = with_drafter(tc, cfg_path, block_size=block, block_layers=n_draft, block_taps=tuple(taps),
                       block_mask_id=mask, block_overrides=overrides)
    r = tensor_reader(path, dtype, target)
    bc = cfg.block_config
    hd = bc.head_dim
    shapes = layer_shapes(bc, d, d)
    layers = []
    for i in range(n_draft):
        pre = f"layers.{i}."
        p = {ours: r.get(pre + theirs + ".weight", shapes[ours], transpose=True) for ours, theirs in _LAYER.items()}
        p["attn_norm"] = r.get(pre + "input_layernorm.weight", (d,))
        p["mlp_norm"] = r.get(pre + "post_attention_layernorm.weight", (d,))
        p["q_norm"] = r.get(pre + "self_attn.q_norm.weight", (hd,))
        p["k_norm"] = r.get(pre + "self_attn.k_norm.weight", (hd,))
        layers.append(fuse_block(p))
    params = {"fc": r.get("fc.weight", (len(taps) * d, d), transpose=True),
              "hidden_norm": r.get("hidden_norm.weight", (d,)), "layers": layers, "norm": r.get("norm.weight", (d,))}
    extra = sorted(n for n in r.files if n not in r.used and not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"{path}: tensor {extra[0]!r} is not part of the DFlash layout ({len(extra)} unused)")
    return Model({**target.params, "block": params}, cfg)


def save(model: Model, path: Path, dtype: str = "float32") -> None:
    """Write ``model``'s block drafter in the DFlash layout (``config.json`` +
    ``model.safetensors``, float32), which ``load`` (and DFlash's own code) reads back."""
    from safetensors.numpy import save_file

    cfg = model.config
    if not cfg.block_size:
        raise ValueError("the model has no block drafter to save (block_size=0)")
    if cfg.shard_groups != 1:
        raise ValueError("save the drafter of the model as loaded, not its shard_model() layout")
    bc = cfg.block_config
    refuse_unexpressible(bc, "DFlash layout (Qwen3 layers: per-head q/k norms, SwiGLU)", "block drafter", qk_norm=True)
    blk = unfuse_params(model.params, cfg)["block"]
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    unit = lambda w: f32(np.asarray(w, np.float32) + bc.norm_offset)  # noqa: E731  the weight as applied
    tensors = {"fc.weight": f32(blk["fc"]).T, "hidden_norm.weight": unit(blk["hidden_norm"]),
               "norm.weight": unit(blk["norm"])}
    for i, p in enumerate(blk["layers"]):
        pre = f"layers.{i}."
        tensors.update({pre + theirs + ".weight": f32(p[ours]).T for ours, theirs in _LAYER.items()})
        tensors[pre + "input_layernorm.weight"] = unit(p["attn_norm"])
        tensors[pre + "post_attention_layernorm.weight"] = unit(p["mlp_norm"])
        tensors[pre + "self_attn.q_norm.weight"] = unit(p["q_norm"])
        tensors[pre + "self_attn.k_norm.weight"] = unit(p["k_norm"])
    path.mkdir(parents=True, exist_ok=True)
    save_file(cast(tensors, dtype), str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": [ARCH], "model_type": "qwen3", "hidden_size": cfg.d_model, "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.block_layers, "num_target_layers": cfg.n_layers, "block_size": cfg.block_size,
        "num_attention_heads": bc.n_heads, "num_key_value_heads": bc.n_kv_heads, "head_dim": bc.head_dim,
        "intermediate_size": bc.d_ff, "rms_norm_eps": bc.norm_eps, "rope_theta": bc.rope_theta,
        "attention_bias": False, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": False, "torch_dtype": dtype, "layer_types": ["full_attention"] * cfg.block_layers,
        "dflash_config": {"mask_token_id": cfg.block_mask_id, "target_layer_ids": list(cfg.block_taps)},
    }
    if bc.rope_scaling is not None:
        config["rope_scaling"] = rope_scaling_dict(bc.rope_scaling)
    (path / "config.json").write_text(json.dumps(config, indent=2))
