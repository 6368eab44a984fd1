"""What the public drafter layouts' readers and writers share: a drafter layer's settings and
tensor shapes from a Hugging Face-style config, the config and tensor reader it loads with,
and the float cast of what is written."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.hf_io import DTYPES, TensorReader, config_field, rope_fields, tensor_files

__all__ = ["cast", "layer_overrides", "layer_shapes", "refuse_unexpressible", "tensor_reader", "with_drafter"]

SAVE_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def cast(tensors: dict, dtype: str) -> dict:
    """``tensors`` (NumPy) with their float ones in ``dtype`` (``SAVE_DTYPES``), contiguous."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: one of {list(SAVE_DTYPES)}")
    to = SAVE_DTYPES[dtype]
    return {k: np.ascontiguousarray(v.astype(to) if v.dtype.kind == "f" else v) for k, v in tensors.items()}


def layer_overrides(raw: dict, cfg_path: Path, d: int, *, qk_norm: bool, rope_arch: str) -> dict:
    """A drafter layer's settings (``ModelConfig.block_overrides`` / ``mtp_overrides``) from its
    ``config.json``: its heads, ``head_dim``, ``d_ff``, eps and RoPE (read as ``rope_arch``'s);
    a plain SwiGLU layer with or without per-head q/k norms."""
    heads = config_field(raw, "num_attention_heads", cfg_path)
    return {
        "n_heads": heads, "n_kv_heads": config_field(raw, "num_key_value_heads", cfg_path, heads),
        "head_dim": config_field(raw, "head_dim", cfg_path, d // heads),
        "d_ff": config_field(raw, "intermediate_size", cfg_path), "qk_norm": qk_norm, "qkv_bias": False,
        "norm_eps": float(config_field(raw, "rms_norm_eps", cfg_path, 1e-6)), "norm_offset": 0.0,
        "sandwich_norm": False, "mlp_act": "silu", "query_pre_attn_scalar": None,
        **rope_fields(raw, rope_arch, cfg_path),
    }


def with_drafter(config, cfg_path: Path, **fields):
    """``config`` with the drafter's ``fields``; an invalid one is a ``ValueError`` naming the file."""
    try:
        return dataclasses.replace(config, **fields)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None


def tensor_reader(path: Path, dtype, target) -> TensorReader:
    """The folder's tensors read in ``dtype`` (a name in ``DTYPES`` or a dtype; default: the target's)."""
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype)
    return TensorReader(tensor_files(path), dtype if dtype is not None else target.params["embed"].dtype)


def layer_shapes(lc, d: int, d_in: int) -> dict:
    """A decoder layer's separate weight shapes ``[in, out]`` for layer config ``lc`` whose q/k/v
    read ``d_in`` wide (an EAGLE-3 layer: ``2 d``)."""
    hd, f = lc.head_dim, lc.d_ff
    nq, nkv = lc.n_heads * hd, lc.n_kv_heads * hd
    return {"wq": (d_in, nq), "wk": (d_in, nkv), "wv": (d_in, nkv), "wo": (nq, d), "w_gate": (d, f), "w_up": (d, f),
            "w_down": (f, d)}


def refuse_unexpressible(lc, layout: str, what: str, qk_norm: bool) -> None:
    """``ValueError`` naming what of ``what``'s layer config ``lc`` the public ``layout`` (a
    SwiGLU layer with or without per-head q/k norms, no biases) cannot express."""
    want = (("qk_norm", qk_norm), ("qkv_bias", False), ("sandwich_norm", False), ("mlp_act", "silu"),
            ("query_pre_attn_scalar", None))
    differ = [f"{k}={getattr(lc, k)!r}" for k, v in want if getattr(lc, k) != v]
    if differ:
        raise ValueError(f"the {layout} cannot express this {what}'s {', '.join(differ)}")
