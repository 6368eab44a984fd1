"""Hugging Face checkpoints: load (Llama, Qwen2, Mistral, Qwen3, Gemma 3) from safetensors, export, tokenizers.

Tensors are read one at a time with the ``safetensors`` flax API from memory-mapped
files (no pickle, no torch). Anything this loader does not implement exactly is a
``ValueError`` naming the config field or tensor, never a silent approximation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

from specjax.hf_io import DTYPES as _DTYPES
from specjax.hf_io import TensorReader as _Reader
from specjax.hf_io import config_field as _field
from specjax.hf_io import read_json as _read_json
from specjax.hf_io import rope_fields as _rope
from specjax.hf_io import rope_scaling_dict
from specjax.hf_io import tensor_files as _tensor_files
from specjax.model import Model, ModelConfig, fuse_params, unfuse_params
from specjax.mtp_head import MTP_WEIGHTS, load_mtp
from specjax.sharding import shard_model
from specjax.tokenizer import ByteTokenizer

__all__ = ["HFTokenizer", "generate_text", "load_hf_checkpoint", "load_tokenizer", "save_hf_checkpoint"]

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
         "MiMoForCausalLM")
# families whose public checkpoints carry MTP layers but whose decoders specjax does not run
_CANNOT_RUN = {
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA) and mixture-of-experts layers",
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA) and mixture-of-experts layers",
    "Glm4MoeForCausalLM": "mixture-of-experts layers",
    "Qwen3NextForCausalLM": "linear-attention (Gated DeltaNet) layers and mixture-of-experts layers",
    "Qwen3MoeForCausalLM": "mixture-of-experts layers",
    "MiMoV2FlashForCausalLM": "mixture-of-experts layers and partial RoPE",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# transformers' class defaults where a family's config.json may leave a field out
_DEFAULTS = {
    "Gemma3ForCausalLM": {"head_dim": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                          "sliding_window": 4096, "query_pre_attn_scalar": 256, "tie_word_embeddings": True,
                          "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh"},
    "Qwen3ForCausalLM": {"head_dim": 128},
}
_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _layer_pattern(raw: dict, arch: str, n_layers: int, path: Path) -> int:
    """Gemma 3's local/global pattern as ``global_every`` (layer ``i`` global iff
    ``i % k == k - 1``): from ``layer_types``, else ``sliding_window_pattern``."""
    types = raw.get("layer_types")
    if types is None:
        k = int(raw["sliding_window_pattern"])
        types = ["sliding_attention" if (i + 1) % k else "full_attention" for i in range(n_layers)]
    if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{path}: field 'layer_types'={types!r} must name sliding_attention or full_attention for "
                         f"each of the {n_layers} layers")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full:
        return 0
    k = full[0] + 1
    if full != [i for i in range(n_layers) if i % k == k - 1]:
        raise ValueError(f"{path}: field 'layer_types'={types!r} is not periodic (one full-attention layer every "
                         "k layers, ending each period), which is what is implemented")
    return k


def read_config(path: Path) -> tuple[ModelConfig, str, dict]:
    """A Hugging Face checkpoint folder's ``config.json`` as ``(ModelConfig, architecture, raw
    dict)``; ``ValueError`` naming the field for an architecture or setting specjax cannot run."""
    cfg_path = path / "config.json"
    raw = _read_json(cfg_path)
    archs = raw.get("architectures") or []
    if len(archs) == 1 and archs[0] in _CANNOT_RUN:
        raise ValueError(f"{cfg_path}: {archs[0]} needs {_CANNOT_RUN[archs[0]]}, which specjax does not implement "
                         f"(its MTP layers load only onto a target specjax runs: {list(ARCHS)})")
    if len(archs) != 1 or archs[0] not in ARCHS:
        raise ValueError(f"{cfg_path}: field 'architectures'={archs!r} is not supported; supported: {list(ARCHS)}")
    arch = archs[0]
    raw = {**_DEFAULTS.get(arch, {}), **{k: v for k, v in raw.items() if v is not None}}
    gemma = arch == "Gemma3ForCausalLM"
    act_field = "hidden_activation" if gemma else "hidden_act"
    act = raw.get(act_field, "silu")
    if act not in _ACTS:
        raise ValueError(f"{cfg_path}: field {act_field!r}={act!r} is not supported (only {list(_ACTS)})")
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window", "use_bidirectional_attention",
                 "final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(flag) and not (flag == "attention_bias" and arch in ("Qwen2ForCausalLM", "MiMoForCausalLM")):
            raise ValueError(f"{cfg_path}: field {flag!r}={raw[flag]!r} is not supported")
    heads = _field(raw, "num_attention_heads", cfg_path)
    n_layers = _field(raw, "num_hidden_layers", cfg_path)
    sliding = raw.get("sliding_window") if arch in ("MistralForCausalLM", "Gemma3ForCausalLM") else None
    global_every = _layer_pattern(raw, arch, n_layers, cfg_path) if gemma else 0
    if gemma and global_every == 1:
        sliding = None  # every layer global
    d = _field(raw, "hidden_size", cfg_path)
    config = ModelConfig(
        vocab_size=_field(raw, "vocab_size", cfg_path),
        d_model=d,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=_field(raw, "num_key_value_heads", cfg_path, heads),
        d_ff=_field(raw, "intermediate_size", cfg_path),
        max_seq_len=_field(raw, "max_position_embeddings", cfg_path),
        sliding_window=sliding,
        global_every=global_every,
        mtp_depth=0,
        head_dim=raw.get("head_dim"),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch in ("Qwen2ForCausalLM", "MiMoForCausalLM"),
        norm_eps=float(_field(raw, "rms_norm_eps", cfg_path, 1e-6)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norm=gemma,
        mlp_act=_ACTS[act],
        embed_scale=float(d) ** 0.5 if gemma else 1.0,
        query_pre_attn_scalar=float(raw["query_pre_attn_scalar"]) if gemma else None,
        **_rope(raw, arch, cfg_path),
    )
    return config, arch, raw


def load_hf_checkpoint(path: str | Path, dtype=None, mtp: str | Path | None = None, mesh=None) -> Model:
    """Load a local Llama / Qwen2 / Mistral / Qwen3 / Gemma 3 (text) checkpoint directory as a
    specjax ``Model``.

    ``dtype``: ``None`` keeps each tensor's stored dtype (a bf16 checkpoint stays bf16, and so
    do the KV caches the engine builds for it); else e.g. ``jnp.bfloat16`` or ``"float32"``.
    Norms, softmax, RoPE and logits are computed in float32 whatever the dtype.
    ``mtp``: a directory holding an MTP module made by ``specjax train-mtp`` (``mtp.safetensors``
    + ``mtp_config.json``) to attach; by default the checkpoint directory's own, if it has one.
    ``mesh`` (``specjax.make_mesh``): the model sharded for it (``specjax.sharding``): tensors are
    read on the host and each device receives only its slice (none is gathered on one device).
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    cfg, _, raw = read_config(path)
    if isinstance(dtype, str) and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: must be one of {list(_DTYPES)}, a jnp dtype or None")
    r = _Reader(_tensor_files(path), _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype,
                host=mesh is not None)
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
    nq, nkv = cfg.n_heads * hd, cfg.n_kv_heads * hd

    def layer_tensors(pre: str) -> dict:
        """One decoder layer's params (the target's, or an MTP layer's) from names under ``pre``."""
        p = {
            "attn_norm": r.get(pre + "input_layernorm.weight", (d,)),
            "wq": r.get(pre + "self_attn.q_proj.weight", (d, nq), transpose=True),
            "wk": r.get(pre + "self_attn.k_proj.weight", (d, nkv), transpose=True),
            "wv": r.get(pre + "self_attn.v_proj.weight", (d, nkv), transpose=True),
            "wo": r.get(pre + "self_attn.o_proj.weight", (nq, d), transpose=True),
            "mlp_norm": r.get(pre + ("pre_feedforward_layernorm" if cfg.sandwich_norm
                                     else "post_attention_layernorm") + ".weight", (d,)),
            "w_gate": r.get(pre + "mlp.gate_proj.weight", (d, f), transpose=True),
            "w_up": r.get(pre + "mlp.up_proj.weight", (d, f), transpose=True),
            "w_down": r.get(pre + "mlp.down_proj.weight", (f, d), transpose=True),
        }
        if cfg.qkv_bias:
            p["bq"] = r.get(pre + "self_attn.q_proj.bias", (nq,))
            p["bk"] = r.get(pre + "self_attn.k_proj.bias", (nkv,))
            p["bv"] = r.get(pre + "self_attn.v_proj.bias", (nkv,))
        if cfg.qk_norm:
            p["q_norm"] = r.get(pre + "self_attn.q_norm.weight", (hd,))
            p["k_norm"] = r.get(pre + "self_attn.k_norm.weight", (hd,))
        if cfg.sandwich_norm:
            p["post_attn_norm"] = r.get(pre + "post_attention_layernorm.weight", (d,))
            p["post_mlp_norm"] = r.get(pre + "post_feedforward_layernorm.weight", (d,))
        return p

    layers = [layer_tensors(f"model.layers.{i}.") for i in range(cfg.n_layers)]
    params = {
        "embed": r.get("model.embed_tokens.weight", (cfg.vocab_size, d)),
        "layers": layers,
        "final_norm": r.get("model.norm.weight", (d,)),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = r.get("lm_head.weight", (d, cfg.vocab_size), transpose=True)
    from specjax.drafter_checkpoints.native_mtp import read_native_mtp  # (that package imports this module)

    native = read_native_mtp(r, raw, cfg, layer_tensors, path)
    if native is not None:  # the checkpoint's own MTP layer (MiMo, DeepSeek-V3 layout)
        if mtp is not None:
            raise ValueError(f"mtp={str(mtp)!r}: {path} carries its own MTP layer ({native[1]} layout); attach one "
                             "or the other")
        params["mtp"] = native[0]
        cfg = dataclasses.replace(cfg, mtp_depth=1, mtp_layout="native")
    extra = sorted(n for n in r.files if n not in r.used and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"checkpoint tensor {extra[0]!r} is not used by this architecture ({len(extra)} unused)")
    model = Model(fuse_params(params), cfg)  # HF's separate q/k/v and gate/up -> one matmul each
    if mtp is None and (path / MTP_WEIGHTS).exists():
        mtp = path
    model = model if mtp is None else load_mtp(model, mtp)
    return model if mesh is None else shard_model(model, mesh)


def save_hf_checkpoint(model: Model, path: str | Path, tokenizer: ByteTokenizer | HFTokenizer | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` that transformers loads as Llama
    (Qwen2 with q/k/v bias, Mistral with a sliding window on every layer). MTP weights,
    which those architectures lack, are not written. ``tokenizer`` (a bundle's byte
    tokenizer or a loaded ``HFTokenizer``): also ``tokenizer.json``, ``tokenizer_config.json``
    and the BOS/EOS ids, so ``load_tokenizer``, ``--model DIR`` and ``train-mtp`` take the folder."""
    from safetensors.numpy import save_file

    if tokenizer is not None and not isinstance(tokenizer, ByteTokenizer | HFTokenizer):
        raise ValueError(f"tokenizer={type(tokenizer).__name__} is invalid: a bundle's ByteTokenizer, a "
                         "specjax.load_tokenizer(...) tokenizer or None")

    if model.config.shard_groups != 1:
        raise ValueError("export the model as loaded, not its shard_model() layout "
                         f"(shard_groups={model.config.shard_groups}, KV heads replicated)")
    cfg, p = model.config, unfuse_params(model.params, model.config)
    if cfg.compressed_layers:
        raise ValueError(f"compressed-memory layers {list(cfg.compressed_layers)} have no transformers architecture "
                         "to export to")
    if cfg.sliding_window is not None and cfg.global_layers:
        raise ValueError("interleaved local/global layers have no transformers architecture to export to")
    if cfg.qkv_bias and cfg.sliding_window is not None:
        raise ValueError("q/k/v bias together with a sliding window has no transformers architecture to export to")
    family = {"qk_norm": False, "norm_offset": 0.0, "sandwich_norm": False, "mlp_act": "silu", "embed_scale": 1.0,
              "query_pre_attn_scalar": None, "local_rope_theta": None}
    differ = [f"{k}={getattr(cfg, k)!r}" for k, v in family.items() if getattr(cfg, k) != v]
    if differ:
        raise ValueError(f"export writes Llama, Qwen2 or Mistral checkpoints, which cannot express {', '.join(differ)}")
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
    if cfg.rope_scaling is not None:  # the legacy key: transformers 4 and 5 both read it
        config["rope_scaling"] = rope_scaling_dict(cfg.rope_scaling)
    if arch == "MistralForCausalLM":
        config["sliding_window"] = cfg.sliding_window
    if tokenizer is not None:
        config.update(_save_tokenizer(tokenizer, path))
    (path / "config.json").write_text(json.dumps(config, indent=2))


def _byte_unicode() -> list[str]:
    """Byte ``b`` -> the printable character byte-level BPE writes for it (GPT-2's table: the
    printable Latin-1 bytes stand for themselves, the rest move to code points from 256 up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(moved)) for b in range(256)]


def _save_tokenizer(tokenizer: ByteTokenizer | HFTokenizer, path: Path) -> dict:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``path``; returns the ids for
    ``config.json`` (``bos_token_id``, ``eos_token_id``). The byte tokenizer becomes byte-level
    BPE without merges (id = byte), its specials at their ids and BOS added to every encoding,
    as the bundle's prompts start."""
    if isinstance(tokenizer, HFTokenizer):
        (path / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
        tcfg = {k: v for k, v in tokenizer.special.items() if v}
        if tokenizer.chat_template is not None:
            tcfg["chat_template"] = tokenizer.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
        eos = list(tokenizer.eos_ids)
        return {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None}
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    t = ByteTokenizer
    names = {t.pad_id: "<pad>", t.bos_id: "<s>", t.eos_id: "</s>"}
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_byte_unicode())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(names[i], special=True) for i in sorted(names)])  # ids 256, 257, 258
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[
        ("<s>", t.bos_id)])
    (path / "tokenizer.json").write_text(tok.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": names[t.bos_id], "eos_token": names[t.eos_id], "pad_token": names[t.pad_id]}, indent=2))
    return {"bos_token_id": t.bos_id, "eos_token_id": t.eos_id, "pad_token_id": t.pad_id}


@dataclasses.dataclass
class HFTokenizer:
    """A ``tokenizers`` tokenizer as transformers runs it: special tokens (BOS) exactly as its
    post-processor adds them, stop ids as ``generation_config.json`` lists them, and the
    checkpoint's chat template."""

    tokenizer: object
    bos_id: int | None  # what the config names (the post-processor decides whether it is added)
    eos_ids: tuple[int, ...]  # generation stops on any of them
    chat_template: str | None = None
    special: dict = dataclasses.field(default_factory=dict)  # bos_token, eos_token, ... for templates

    @property
    def eos_id(self) -> int | list[int] | None:
        """What ``generate(eos_id=...)`` takes: the one stop id, the list, or ``None``."""
        ids = list(self.eos_ids)
        return None if not ids else ids[0] if len(ids) == 1 else ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (special tokens written in it are recognised); the
        post-processor adds BOS where the checkpoint's tokenizer does (Llama 3: yes; Qwen: no)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role", "content"}]``) with the checkpoint's jinja2 chat template,
        as transformers does (a sandboxed environment with ``trim_blocks``/``lstrip_blocks``)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json names none)")
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat template rendered and tokenized (the template writes BOS itself, so the
        post-processor adds nothing, as in transformers)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled once (every prompt of a batch renders the same one)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("chat templates need jinja2: pip install jinja2") from None

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """``tokenizer.json`` via the ``tokenizers`` library. BOS as its post-processor adds it;
    stop ids from ``generation_config.json`` (an int or a list), else ``config.json``; the chat
    template and special tokens from ``tokenizer_config.json``."""
    from tokenizers import Tokenizer

    path = Path(path)
    tok_path = path / "tokenizer.json"
    if not tok_path.exists():
        raise ValueError(f"{tok_path}: file not found")
    tok = Tokenizer.from_file(str(tok_path))
    ids: dict[str, object] = {"bos_token_id": None, "eos_token_id": None}
    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            raw = _read_json(path / name)
            for k in ids:
                if ids[k] is None and raw.get(k) is not None:
                    ids[k] = raw[k]
    eos = ids["eos_token_id"]
    eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
    bos = ids["bos_token_id"]
    template, special = None, {}
    if (path / "tokenizer_config.json").exists():
        tcfg = _read_json(path / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        special = {k: _token_text(tcfg.get(k)) or "" for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return HFTokenizer(tok, None if bos is None else int(bos[0] if isinstance(bos, list) else bos), eos_ids,
                       template, special)


def generate_text(model: Model, tokenizer: HFTokenizer, prompts: list[str], *, chat: bool = False, **kwargs):
    """Text in, text out: encodes ``prompts`` (with ``chat``, each as one user message through
    the chat template), runs ``specjax.generate`` (``kwargs``: its arguments, ``config=`` and
    settings; stop ids from the tokenizer unless given), decodes. Returns ``(texts, GenerationResult)``."""
    from specjax.generation import generate

    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a list of strings, got {prompts!r}")
    if chat and tokenizer.chat_template is None:
        raise ValueError(f"chat=True is invalid: tokenizer={type(tokenizer).__name__} has no chat template (a Hugging "
                         "Face checkpoint's tokenizer_config.json carries one); pass chat=False")
    config = kwargs.get("config")
    if "eos_id" not in kwargs and (config is None or config.eos_id is None):
        kwargs["eos_id"] = tokenizer.eos_id
    enc = (lambda p: tokenizer.encode_chat([{"role": "user", "content": p}])) if chat else tokenizer.encode
    res = generate(model, [enc(p) for p in prompts], **kwargs)
    return [tokenizer.decode(t) for t in res.tokens], res
