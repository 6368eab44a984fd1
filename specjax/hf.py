"""Hugging Face checkpoints: load (Llama, Qwen2, Mistral) from safetensors, export, tokenizers.

Tensors are read one at a time with the ``safetensors`` flax API from memory-mapped
files (no pickle, no torch). Anything this loader does not implement exactly is a
``ValueError`` naming the config field or tensor, never a silent approximation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from specjax.model import Model, ModelConfig, fuse_params, unfuse_params

__all__ = ["HFTokenizer", "generate_text", "load_hf_checkpoint", "load_tokenizer", "save_hf_checkpoint"]

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _field(cfg: dict, name: str, path: Path, default=...):
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if default is ...:
        raise ValueError(f"{path}: required field {name!r} is missing")
    return default


def _config(path: Path) -> tuple[ModelConfig, str, dict]:
    cfg_path = path / "config.json"
    raw = _read_json(cfg_path)
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHS:
        raise ValueError(f"{cfg_path}: field 'architectures'={archs!r} is not supported; supported: {list(ARCHS)}")
    arch = archs[0]
    if raw.get("rope_scaling") not in (None, {}) and (raw["rope_scaling"].get("rope_type")
                                                      or raw["rope_scaling"].get("type")) != "default":
        raise ValueError(f"{cfg_path}: field 'rope_scaling'={raw['rope_scaling']!r} is not implemented "
                         "(only no scaling is supported)")
    rope_params = raw.get("rope_parameters")
    if isinstance(rope_params, dict) and rope_params.get("rope_type", "default") != "default":
        raise ValueError(f"{cfg_path}: field 'rope_parameters'={rope_params!r} is not implemented")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{cfg_path}: field 'hidden_act'={act!r} is not supported (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if arch == "LlamaForCausalLM" and raw.get(flag):
            raise ValueError(f"{cfg_path}: field {flag!r}=True is not supported")
    if arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
        raise ValueError(f"{cfg_path}: field 'use_sliding_window'=True (Qwen2 per-layer windows) is not supported")
    theta = raw.get("rope_theta")
    if theta is None and isinstance(rope_params, dict):
        theta = rope_params.get("rope_theta")
    heads = _field(raw, "num_attention_heads", cfg_path)
    sliding = raw.get("sliding_window") if arch == "MistralForCausalLM" else None
    config = ModelConfig(
        vocab_size=_field(raw, "vocab_size", cfg_path),
        d_model=_field(raw, "hidden_size", cfg_path),
        n_layers=_field(raw, "num_hidden_layers", cfg_path),
        n_heads=heads,
        n_kv_heads=_field(raw, "num_key_value_heads", cfg_path, heads),
        d_ff=_field(raw, "intermediate_size", cfg_path),
        max_seq_len=_field(raw, "max_position_embeddings", cfg_path),
        sliding_window=sliding,
        mtp_depth=0,
        head_dim=raw.get("head_dim"),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM",
        rope_theta=float(theta if theta is not None else 10000.0),
        norm_eps=float(_field(raw, "rms_norm_eps", cfg_path, 1e-6)),
    )
    return config, arch, raw


def _tensor_files(path: Path) -> dict[str, Path]:
    """tensor name -> file, from ``model.safetensors`` or a sharded index."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
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


class _Reader:
    def __init__(self, files: dict[str, Path], dtype):
        self.files, self.dtype, self.used = files, dtype, set()

    def get(self, name: str, shape: tuple[int, ...], transpose: bool = False):
        from safetensors import safe_open

        if name not in self.files:
            raise ValueError(f"checkpoint tensor {name!r} is missing")
        path = self.files[name]
        if not path.exists():
            raise ValueError(f"{path}: shard file for tensor {name!r} not found")
        try:
            with safe_open(str(path), framework="flax") as f:
                x = f.get_tensor(name)
        except Exception as e:  # truncated or corrupt file
            raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from None
        want = shape[::-1] if transpose else shape
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(want)}")
        self.used.add(name)
        x = x.T if transpose else x
        return jnp.asarray(x, self.dtype if self.dtype is not None else x.dtype)


def load_hf_checkpoint(path: str | Path, dtype=None) -> Model:
    """Load a local Llama / Qwen2 / Mistral checkpoint directory as a specjax ``Model``.

    ``dtype``: ``None`` keeps each tensor's stored dtype; else e.g. ``jnp.float32``.
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    cfg, _, _ = _config(path)
    r = _Reader(_tensor_files(path), _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    nq, nkv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    layers = []
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        p = {
            "attn_norm": r.get(pre + "input_layernorm.weight", (d,)),
            "wq": r.get(pre + "self_attn.q_proj.weight", (d, nq), transpose=True),
            "wk": r.get(pre + "self_attn.k_proj.weight", (d, nkv), transpose=True),
            "wv": r.get(pre + "self_attn.v_proj.weight", (d, nkv), transpose=True),
            "wo": r.get(pre + "self_attn.o_proj.weight", (nq, d), transpose=True),
            "mlp_norm": r.get(pre + "post_attention_layernorm.weight", (d,)),
            "w_gate": r.get(pre + "mlp.gate_proj.weight", (d, f), transpose=True),
            "w_up": r.get(pre + "mlp.up_proj.weight", (d, f), transpose=True),
            "w_down": r.get(pre + "mlp.down_proj.weight", (f, d), transpose=True),
        }
        if cfg.qkv_bias:
            p["bq"] = r.get(pre + "self_attn.q_proj.bias", (nq,))
            p["bk"] = r.get(pre + "self_attn.k_proj.bias", (nkv,))
            p["bv"] = r.get(pre + "self_attn.v_proj.bias", (nkv,))
        layers.append(p)
    params = {
        "embed": r.get("model.embed_tokens.weight", (cfg.vocab_size, d)),
        "layers": layers,
        "final_norm": r.get("model.norm.weight", (d,)),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = r.get("lm_head.weight", (d, cfg.vocab_size), transpose=True)
    extra = sorted(n for n in r.files if n not in r.used and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"checkpoint tensor {extra[0]!r} is not used by this architecture ({len(extra)} unused)")
    return Model(fuse_params(params), cfg)  # HF's separate q/k/v and gate/up -> one matmul each


def save_hf_checkpoint(model: Model, path: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` that transformers loads as Llama
    (Qwen2 with q/k/v bias, Mistral with a sliding window on every layer). MTP weights,
    which those architectures lack, are not written."""
    from safetensors.numpy import save_file

    cfg, p = model.config, unfuse_params(model.params, model.config)
    if cfg.compressed_layers:
        raise ValueError(f"compressed-memory layers {list(cfg.compressed_layers)} have no transformers architecture "
                         "to export to")
    if cfg.sliding_window is not None and cfg.global_layers:
        raise ValueError("interleaved local/global layers have no transformers architecture to export to")
    if cfg.qkv_bias and cfg.sliding_window is not None:
        raise ValueError("q/k/v bias together with a sliding window has no transformers architecture to export to")
    arch = "Qwen2ForCausalLM" if cfg.qkv_bias else "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    tensors = {"model.embed_tokens.weight": f32(p["embed"]), "model.norm.weight": f32(p["final_norm"])}
    if not cfg.tie_embeddings:
        tensors["lm_head.weight"] = f32(p["lm_head"]).T
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i, lp in enumerate(p["layers"]):
        pre = f"model.layers.{i}."
        tensors[pre + "input_layernorm.weight"] = f32(lp["attn_norm"])
        tensors[pre + "post_attention_layernorm.weight"] = f32(lp["mlp_norm"])
        for ours, theirs in names.items():
            tensors[pre + theirs + ".weight"] = np.ascontiguousarray(f32(lp[ours]).T)
        if cfg.qkv_bias:
            for b, theirs in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
                tensors[pre + f"self_attn.{theirs}.bias"] = f32(lp[b])
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": [arch],
        "model_type": {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}[arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if cfg.head_dim is not None:
        config["head_dim"] = cfg.head_dim
    if arch == "MistralForCausalLM":
        config["sliding_window"] = cfg.sliding_window
    (path / "config.json").write_text(json.dumps(config, indent=2))


@dataclasses.dataclass
class HFTokenizer:
    """A ``tokenizers`` tokenizer with the BOS/EOS ids of its checkpoint."""

    tokenizer: object
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """``tokenizer.json`` via the ``tokenizers`` library; BOS/EOS ids from ``config.json``
    (or ``generation_config.json``)."""
    from tokenizers import Tokenizer

    path = Path(path)
    tok_path = path / "tokenizer.json"
    if not tok_path.exists():
        raise ValueError(f"{tok_path}: file not found")
    tok = Tokenizer.from_file(str(tok_path))
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            raw = _read_json(path / name)
            for k in ids:
                v = raw.get(k)
                if ids[k] is None and v is not None:
                    ids[k] = v[0] if isinstance(v, list) else int(v)
    return HFTokenizer(tok, ids["bos_token_id"], ids["eos_token_id"])


def generate_text(model: Model, tokenizer: HFTokenizer, prompts: list[str], *, add_bos: bool = True, **kwargs):
    """Text in, text out: encodes ``prompts``, runs ``specjax.generate`` (EOS from the
    tokenizer unless given), decodes. Returns ``(texts, GenerationResult)``."""
    from specjax.engine import generate

    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a list of strings, got {prompts!r}")
    kwargs.setdefault("eos_id", tokenizer.eos_id)
    res = generate(model, [tokenizer.encode(p, add_bos) for p in prompts], **kwargs)
    return [tokenizer.decode(t) for t in res.tokens], res
