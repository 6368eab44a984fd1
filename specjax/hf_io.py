"""Reading Hugging Face-style checkpoint folders: ``config.json`` fields (RoPE included, in
either config format) and safetensors tensors one at a time. Shared by ``specjax.hf`` (models)
and ``specjax.drafter_checkpoints`` (drafters). Anything not implemented exactly is a
``ValueError`` naming the field or tensor."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from specjax.model import RopeScaling

__all__ = ["DTYPES", "ROPE_KEYS", "TensorReader", "config_field", "read_json", "rope_fields", "rope_scaling",
           "rope_scaling_dict", "tensor_files"]

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
              "mscale_all_dim", "truncate", "partial_rotary_factor"}

def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def config_field(cfg: dict, name: str, path: Path, default=...):
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if default is ...:
        raise ValueError(f"{path}: required field {name!r} is missing")
    return default


def rope_scaling(d: dict | None, field: str, raw: dict, path: Path) -> RopeScaling | None:
    """One RoPE parameter dict (either config format) -> ``RopeScaling`` or ``None`` (no scaling),
    as transformers standardises it; anything not implemented exactly names the field."""
    if not d:
        return None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: field {field!r}={d!r} must be a dict")
    unknown = sorted(set(d) - ROPE_KEYS)
    if unknown:
        raise ValueError(f"{path}: field {field!r} has key {unknown[0]!r}, which is not implemented")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{path}: field {field!r}: partial_rotary_factor={d['partial_rotary_factor']} is not "
                         "implemented (only 1.0)")
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"{path}: field {field!r} has rope_type={kind!r}, which is not implemented; implemented: "
                         "default, linear, llama3, yarn")
    orig = raw.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") \
        or raw.get("max_position_embeddings")
    factor = d.get("factor")
    if factor is None and kind == "yarn" and orig:  # DeepSeek-style: the context ratio
        factor = raw.get("max_position_embeddings") / orig
    try:
        return RopeScaling(
            kind=kind, factor=factor, low_freq_factor=d.get("low_freq_factor"),
            high_freq_factor=d.get("high_freq_factor"), original_max_position=orig if kind != "linear" else None,
            beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
            attention_factor=d.get("attention_factor"), mscale=d.get("mscale"), mscale_all_dim=d.get("mscale_all_dim"),
            truncate=bool(d.get("truncate", True)))
    except ValueError as e:
        raise ValueError(f"{path}: field {field!r}={d!r}: {e}") from None


def rope_fields(raw: dict, arch: str, path: Path) -> dict:
    """``rope_theta``/``rope_scaling`` (and Gemma 3's local pair) from either config format:
    legacy ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq``), or transformers 5's
    ``rope_parameters`` (one dict, or one per layer type)."""
    params = raw.get("rope_parameters")
    nested = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
    theta = raw.get("rope_theta", 10000.0)  # raw already holds the family's defaults (_DEFAULTS)
    if nested:
        unknown = sorted(set(params) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"{path}: field 'rope_parameters' has layer type {unknown[0]!r}, which is not "
                             "implemented")
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full = dict(params or raw.get("rope_scaling") or {})
        if isinstance(raw.get("rope_scaling"), dict) and params:  # both given: rope_scaling wins, as in transformers
            full = {**full, **raw["rope_scaling"]}
        local = {}
    field = "rope_parameters" if params else "rope_scaling"
    out = {"rope_theta": float(full.get("rope_theta", theta)),
           "rope_scaling": rope_scaling(full, field + (".full_attention" if nested else ""), raw, path)}
    if arch == "Gemma3ForCausalLM":
        out["local_rope_theta"] = float(local.get("rope_theta", raw["rope_local_base_freq"]))
        out["local_rope_scaling"] = rope_scaling(local, field + ".sliding_attention", raw, path)
    elif local:
        raise ValueError(f"{path}: field 'rope_parameters' has per-layer-type entries, which {arch} does not use")
    return out


def tensor_files(path: Path) -> dict[str, Path]:
    """tensor name -> file, from ``model.safetensors`` or a sharded index."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: field 'weight_map' is missing")
        return {k: path / v for k, v in weight_map.items()}
    if single.exists():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="flax") as f:
                return dict.fromkeys(f.keys(), single)
        except Exception as e:  # truncated or corrupt header
            raise ValueError(f"{single}: not a readable safetensors file ({e})") from None
    raise ValueError(f"{path}: neither model.safetensors nor model.safetensors.index.json found")


class TensorReader:
    def __init__(self, files: dict[str, Path], dtype, host: bool = False):
        self.files, self.dtype, self.used, self.host = files, dtype, set(), host

    def get(self, name: str, shape: tuple[int, ...], transpose: bool = False):
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"checkpoint tensor {name!r} is missing")
        path = self.files[name]
        if not path.exists():
            raise ValueError(f"{path}: shard file for tensor {name!r} not found")
        try:
            with safe_open(str(path), framework="numpy" if self.host else "flax") as f:
                x = f.get_tensor(name)
        except Exception as e:  # truncated or corrupt file
            raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from None
        want = shape[::-1] if transpose else shape
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(want)}")
        self.used.add(name)
        x = x.T if transpose else x
        if self.host:  # kept on the host, to be placed shard by shard (load_hf_checkpoint(mesh=))
            return x if self.dtype is None else x.astype(self.dtype)
        return jnp.asarray(x, self.dtype if self.dtype is not None else x.dtype)


def rope_scaling_dict(s: RopeScaling) -> dict:
    """``RopeScaling`` as a config's ``rope_scaling`` dict (the inverse of ``rope_scaling``)."""
    keys = {"factor": s.factor, "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position, "attention_factor": s.attention_factor,
            "mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim}
    if s.kind == "yarn":
        keys.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
    return {"rope_type": s.kind, **{k: v for k, v in keys.items() if v is not None}}
