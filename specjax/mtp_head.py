"""An MTP drafting module for any loaded model: attach, train on the user's text, save, load.

No Hugging Face Llama, Qwen or Gemma ships an MTP head, so ``--drafter mtp`` has nothing to
run on them. ``train_mtp`` attaches a fresh DeepSeek-V3-style module (``init_mtp_params``),
freezes the target and trains the module with the bundle's MTP objective (the chained
``mtp_chain_logits`` loss over ``chain`` passes, ``specjax.train.run_stage``: optax,
resumable orbax checkpoints, a progress bar). ``save_mtp`` writes ``mtp.safetensors`` and
``mtp_config.json``; ``load_mtp`` attaches them to the model they were trained for (the
base config is checked field by field), and ``load_hf_checkpoint`` does so by itself when
the checkpoint directory holds them.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.corpus import Corpus
from specjax.model import Model, ModelConfig
from specjax.model.llama import init_mtp_params, with_draft_vocab

__all__ = ["MTP_CONFIG", "MTP_WEIGHTS", "attach_mtp", "draft_vocab_ids", "load_mtp", "save_mtp", "text_corpus",
           "train_mtp"]

MTP_WEIGHTS, MTP_CONFIG = "mtp.safetensors", "mtp_config.json"
FORMAT = "specjax-mtp-1"


def attach_mtp(model: Model, seed: int = 0, dtype=jnp.float32, draft_ids=None, layout: str = "specjax",
               taps: tuple[int, ...] = ()) -> Model:
    """``model`` with a fresh MTP module (``mtp_depth=1``; the drafter chains it); ``draft_ids``:
    the target tokens it drafts over (a draft vocabulary, ``with_draft_vocab``), or all.
    ``layout="eagle3"``: an EAGLE-3 head reading the outputs of target layers ``taps``."""
    # an EAGLE-3 head is a Llama layer whatever the target (what its public layout can express)
    llama = {"qk_norm": False, "qkv_bias": False, "sandwich_norm": False, "mlp_act": "silu", "norm_offset": 0.0,
             "query_pre_attn_scalar": None} if layout == "eagle3" else {}
    cfg = dataclasses.replace(model.config, mtp_depth=1, mtp_draft_vocab=0, mtp_layout=layout,
                              mtp_taps=tuple(taps), mtp_overrides=llama)
    mtp = init_mtp_params(jax.random.key(seed), cfg, dtype)
    out = Model({**model.params, "mtp": mtp}, cfg)
    return out if draft_ids is None else with_draft_vocab(out, draft_ids)


def draft_vocab_ids(stream: np.ndarray, n: int, vocab_size: int) -> np.ndarray:
    """The ``n`` most frequent token ids of ``stream`` (ties to the lower id), sorted: a draft
    vocabulary (EAGLE-3 picks its 32k the same way). Ids the stream never holds fill up from 0."""
    if not isinstance(n, int) or not 1 <= n < vocab_size:
        raise ValueError(f"--draft-vocab {n!r} is invalid: must lie in [1, vocab_size={vocab_size})")
    counts = np.bincount(np.asarray(stream, np.int64).reshape(-1), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count, descending; then by id
    return np.sort(order[:n]).astype(np.int32)


def _base(config: ModelConfig) -> dict:
    """The architecture an MTP module is trained for (not the sharded layout: ``shard_groups``)."""
    out = dataclasses.replace(config, mtp_depth=0, mtp_draft_vocab=0).to_dict()
    for k in _NOT_BASE:
        out.pop(k, None)
    return out


# what a config holds beside the architecture an MTP module is trained for (a module saved before
# a field existed still loads: the field is not compared)
_NOT_BASE = ("shard_groups", "mtp_draft_vocab", "mtp_layout", "mtp_taps", "mtp_overrides", "block_size",
             "block_layers", "block_taps", "block_mask_id", "block_overrides")


def _is_ids(path) -> bool:
    """Is this the draft vocabulary's int32 ids (never cast to the weights' dtype)?"""
    return str(path[-1].key) == "draft_ids"


def _name(path) -> str:
    """A tensor name from a params key path: ``block.wqkv``."""
    return ".".join(str(k.key) for k in path)


def save_mtp(model: Model, out: str | pathlib.Path, info: dict | None = None) -> pathlib.Path:
    """Write ``model``'s MTP module to ``out/mtp.safetensors`` (float32) and
    ``out/mtp_config.json`` (the base model's config, so it is attached only to that model)."""
    from safetensors.numpy import save_file

    if "mtp" not in model.params:
        raise ValueError("the model has no MTP module to save (attach_mtp / train_mtp first)")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    flat = {_name(p): np.ascontiguousarray(np.asarray(x, np.int32 if _is_ids(p) else np.float32))
            for p, x in jax.tree_util.tree_flatten_with_path(model.params["mtp"])[0]}
    save_file(flat, str(out / MTP_WEIGHTS), metadata={"format": FORMAT})
    meta = {"format": FORMAT, "base_config": _base(model.config), "draft_vocab": model.config.mtp_draft_vocab,
            **(info or {})}
    (out / MTP_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_mtp(model: Model, directory: str | pathlib.Path) -> Model:
    """``model`` with the MTP module saved in ``directory`` (cast to the model's dtype)."""
    from safetensors import safe_open

    directory = pathlib.Path(directory)
    cfg_path, w_path = directory / MTP_CONFIG, directory / MTP_WEIGHTS
    for p in (cfg_path, w_path):
        if not p.exists():
            raise ValueError(f"{p}: file not found (train one with `specjax train-mtp`)")
    meta = json.loads(cfg_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{cfg_path}: format={meta.get('format')!r} is not {FORMAT!r}")
    want, have = {k: v for k, v in meta.get("base_config", {}).items() if k not in _NOT_BASE}, _base(model.config)
    differ = sorted(k for k in set(want) | set(have) if json.dumps(want.get(k)) != json.dumps(have.get(k)))
    if differ:
        k = differ[0]
        raise ValueError(f"{cfg_path}: this MTP module was trained for another model ({k}={want.get(k)!r}, this "
                         f"model has {have.get(k)!r})")
    n = meta.get("draft_vocab", 0)
    if not isinstance(n, int) or not 0 <= n < model.config.vocab_size:
        raise ValueError(f"{cfg_path}: draft_vocab={n!r} is invalid: an int in [0, {model.config.vocab_size})")
    cfg = dataclasses.replace(model.config, mtp_depth=1, mtp_draft_vocab=n, mtp_layout="specjax",
                              mtp_taps=(), mtp_overrides=())
    like = jax.eval_shape(lambda: init_mtp_params(jax.random.key(0), cfg))  # names and shapes only
    want = {_name(p): s.shape for p, s in jax.tree_util.tree_flatten_with_path(like)[0]}
    dtype = model.params["embed"].dtype
    with safe_open(str(w_path), framework="numpy") as f:
        names = set(f.keys())
        if names != set(want):
            extra = sorted(names ^ set(want))
            raise ValueError(f"{w_path}: tensor {extra[0]!r} does not match this model's MTP module")
        loaded = {}
        for name, shape in want.items():
            x = f.get_tensor(name)
            if x.shape != shape:
                raise ValueError(f"{w_path}: tensor {name!r} has shape {x.shape}, expected {shape}")
            want_dtype = np.int32 if name.endswith("draft_ids") else dtype
            loaded[name] = (x.astype(want_dtype) if isinstance(model.params["embed"], np.ndarray)
                            else jnp.asarray(x, want_dtype))
    mtp = jax.tree_util.tree_map_with_path(lambda p, _: loaded[_name(p)], like)
    return Model({**model.params, "mtp": mtp}, cfg)


def text_corpus(files: Sequence[str | pathlib.Path], encode: Callable[[str], list[int]], *, eos_id: int | None,
                min_tokens: int, held_out_fraction: float = 0.05) -> Corpus:
    """Token streams from text ``files`` (each encoded as a document, ``eos_id`` after it); the
    last ``held_out_fraction`` of the tokens (at least ``min_tokens``) is held out."""
    parts = []
    for f in files:
        p = pathlib.Path(f)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"--data {p}: file not found") from None
        except UnicodeDecodeError:
            raise ValueError(f"--data {p}: not UTF-8 text") from None
        parts.append(np.asarray(encode(text) + ([] if eos_id is None else [eos_id]), np.int32))
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    held = max(min_tokens, int(len(stream) * held_out_fraction))
    if len(stream) < held + min_tokens:
        raise ValueError(f"--data holds {len(stream)} tokens; train-mtp needs at least {held + min_tokens} "
                         f"(two windows of seq_len + 1 = {min_tokens})")
    names = tuple(str(f) for f in files)
    return Corpus(stream[:-held], stream[-held:], names, names, f"{len(names)} text file(s), last {held} tokens "
                  "held out")


def train_mtp(model: Model, corpus: Corpus, out: str | pathlib.Path, sc, *, chain: int = 3, resume: bool = False,
              progress: bool = True, stop_at: int | None = None, bytes_only: bool = False,
              info: dict | None = None, draft_vocab: int = 0, layout: str = "specjax",
              taps: tuple[int, ...] | None = None) -> tuple[Model, dict]:
    """Train a fresh MTP module for the frozen ``model`` (``sc``: a ``StageConfig``) on
    ``corpus``; checkpoints under ``out/train`` (``resume`` continues them), the module
    saved into ``out`` when the run completes. Returns the model with it and a summary.
    ``draft_vocab = N``: the module drafts over the corpus's ``N`` most frequent tokens
    (``draft_vocab_ids``; its head starts as the target head's columns there).
    ``layout="eagle3"``: an EAGLE-3 head reading the outputs of target layers ``taps`` (default
    ``eagle3_taps``), trained with the same chained (training-time test) loss and saved in the
    public EAGLE-3 layout (``specjax.load_drafter`` reads it back, as vLLM and SGLang do)."""
    from specjax.train import run_stage, write_json_line

    out = pathlib.Path(out)
    target = Model({k: v for k, v in model.params.items() if k != "mtp"}, dataclasses.replace(model.config,
                                                                                              mtp_depth=0))
    ids = draft_vocab_ids(corpus.train, draft_vocab, target.config.vocab_size) if draft_vocab else None
    if layout == "eagle3" and taps is None:
        taps = eagle3_taps(target.config.n_layers)
    fresh = attach_mtp(target, seed=sc.seed, draft_ids=ids, layout=layout, taps=taps or ())
    log = out / "train" / "log.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    trained, summary = run_stage("mtp", fresh, corpus, sc, out / "train", resume=resume, mtp_depth=chain,
                                 progress=progress, log=lambda r: write_json_line(log, r), stop_at=stop_at,
                                 bytes_only=bytes_only)
    summary["corpus"] = corpus.describe()
    summary["draft_vocab"] = draft_vocab
    if summary["step"] >= sc.steps:
        if layout == "eagle3":
            from specjax.drafter_checkpoints import save_drafter

            save_drafter(trained, out, format="eagle3")
            (out / "training.json").write_text(json.dumps({"chain": chain, "summary": summary, **(info or {})},
                                                          indent=1, default=str))
        else:
            save_mtp(trained, out, {"chain": chain, "summary": summary, **(info or {})})
        summary["out"] = str(out)
    return trained, summary


def eagle3_taps(n_layers: int) -> tuple[int, ...]:
    """An EAGLE-3 head's default taps for an ``n_layers`` target: the outputs of an early, a middle
    and a late layer (vLLM's default ids ``(2, L // 2, L - 3)`` read as layer outputs), spread
    apart where a shallow target would repeat them."""
    taps = (1, n_layers // 2 - 1, n_layers - 4)
    if len(set(taps)) == 3 and min(taps) >= 0:
        return taps
    return tuple(sorted({round(i * (n_layers - 1) / 2) for i in range(3)}))
