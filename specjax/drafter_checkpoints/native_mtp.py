"""MTP layers that ship inside a model's own checkpoint, read as specjax's MTP module.

Two public layouts, each one decoder layer shaped like the target's plus an input projection
over the concatenated (normed) hidden state and token embedding, and a final norm of its own
(``ModelConfig.mtp_layout="native"``: the module reads the target's final-normed hidden state, and
its own normed output is the LM head's input and what a chain feeds back):

=====================================  ========================================  ===================
specjax (``params["mtp"]``)            MiMo (``model.mtp_layers.0.``)            DeepSeek-V3 (``model.layers.{L}.``)
=====================================  ========================================  ===================
``norm_h`` (the hidden state's norm)   ``hidden_layernorm``                      ``hnorm``
``norm_e`` (the embedding's norm)      ``token_layernorm``                       ``enorm``
``proj [2d, d]`` over [h ‖ e]          ``input_proj [d, 2d]`` over [h ‖ e]       ``eh_proj [d, 2d]`` over [e ‖ h]
``block``                              ``input_layernorm``, ``self_attn.*``,     the same names
                                       ``post_attention_layernorm``, ``mlp.*``
``final_norm``                         ``final_layernorm``                       ``shared_head.norm``
the target's LM head                   (MiMo shares the target's)                ``shared_head.head``: must
                                                                                 equal the target's
=====================================  ========================================  ===================

``L`` is the target's layer count (DeepSeek numbers its MTP layer after the decoder's); the
DeepSeek layout may also store a copy of the embedding (``embed_tokens``), which must equal the
target's. The concatenation order differs: DeepSeek's projection reads the embedding first, so
its two row halves swap on the way in. specjax chains one module: a checkpoint with more MTP
layers (``num_nextn_predict_layers > 1``) is refused.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax.model.layers import fuse_block

__all__ = ["LAYOUTS", "read_native_mtp"]

LAYOUTS = ("mimo", "deepseek")


def _layout(files, n_layers: int) -> tuple[str, str] | None:
    """``(layout, tensor prefix)`` of the MTP layer a checkpoint's tensors hold, or ``None``."""
    if any(n.startswith("model.mtp_layers.0.") for n in files):
        return "mimo", "model.mtp_layers.0."
    if f"model.layers.{n_layers}.eh_proj.weight" in files:
        return "deepseek", f"model.layers.{n_layers}."
    return None


def read_native_mtp(r, raw: dict, cfg, layer_tensors, path) -> tuple[dict, str] | None:
    """The MTP module of a checkpoint's own MTP layer, ``(params["mtp"], layout)``, or ``None``
    when it has none. ``r``: the checkpoint's tensor reader (``specjax.hf_io.TensorReader``);
    ``layer_tensors(prefix)``: a decoder layer's params read as the target's layers are."""
    found = _layout(r.files, cfg.n_layers)
    if found is None:
        return None
    layout, pre = found
    n_mtp = raw.get("num_nextn_predict_layers", 1)
    if n_mtp != 1:
        raise ValueError(f"{path / 'config.json'}: num_nextn_predict_layers={n_mtp}: specjax chains one MTP module "
                         "(only 1 is implemented)")
    d = cfg.d_model
    names = {"mimo": ("hidden_layernorm", "token_layernorm", "input_proj", "final_layernorm"),
             "deepseek": ("hnorm", "enorm", "eh_proj", "shared_head.norm")}[layout]
    proj = r.get(pre + names[2] + ".weight", (2 * d, d), transpose=True)  # rows: the concatenation's halves
    if layout == "deepseek":  # [e ‖ h] -> specjax's [h ‖ e]
        xp = np if isinstance(proj, np.ndarray) else jnp  # host arrays (a mesh load) stay on the host
        proj = xp.concatenate([proj[d:], proj[:d]], axis=0)
    mtp = {"norm_h": r.get(pre + names[0] + ".weight", (d,)), "norm_e": r.get(pre + names[1] + ".weight", (d,)),
           "proj": proj, "block": fuse_block(layer_tensors(pre)),
           "final_norm": r.get(pre + names[3] + ".weight", (d,))}
    if layout == "deepseek":
        for name, ours in (("shared_head.head.weight", "lm_head"), ("embed_tokens.weight", "embed")):
            if pre + name in r.files:
                theirs = np.asarray(r.get(pre + name, (cfg.vocab_size, d)), np.float32)
                mine = np.asarray(r.get(_target_name(ours, cfg), (cfg.vocab_size, d)), np.float32)
                if not np.array_equal(theirs, mine):
                    raise ValueError(f"{path}: tensor {pre + name!r} differs from the target's {ours}: an MTP "
                                     f"{'head' if ours == 'lm_head' else 'embedding'} of its own is not implemented")
    return mtp, layout


def _target_name(ours: str, cfg) -> str:
    if ours == "lm_head" and not cfg.tie_embeddings:
        return "lm_head.weight"
    return "model.embed_tokens.weight"
