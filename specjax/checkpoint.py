"""Model bundles on disk: ``config.json`` + orbax parameter checkpoints.

Layout of a bundle directory (what ``specjax train`` exports, what ``checkpoints/``
ships)::

    config.json   {"format": "specjax-bundle", "version": 1, "target": ModelConfig,
                   "draft": ModelConfig | null, "tokenizer": "bytes", "dtype": ..., "training": {...}}
    target/       orbax StandardCheckpointer tree: the target params (with its MTP module)
    draft/        the draft model's params (optional)

Weights are stored in ``dtype`` (bfloat16 for the shipped bundle, to fit the size
budget) and loaded as float32. Every failure names the file: a missing directory,
bad JSON, a config field that is wrong, a truncated or mismatched tensor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters import AUTO, default_drafter
from specjax.model import Model, ModelConfig, fuse_params, init_model, unfuse_params
from specjax.sharding import MODEL, param_specs, placed_shapes, sharded_config, sharded_layout, shardings
from specjax.tokenizer import ByteTokenizer

__all__ = ["Bundle", "CheckpointError", "DEFAULT_BUNDLE", "load_model", "save_bundle"]

FORMAT = "specjax-bundle"
VERSION = 1
_HERE = pathlib.Path(__file__).resolve().parent
# an installed wheel carries the bundle in specjax/checkpoints; the source tree in checkpoints/
DEFAULT_BUNDLE = next((p for p in (_HERE / "checkpoints" / "default", _HERE.parent / "checkpoints" / "default")
                       if p.is_dir()), _HERE.parent / "checkpoints" / "default")


class CheckpointError(ValueError):
    """A bundle that cannot be loaded; the message names the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Bundle:
    """A loaded bundle: target ``model`` (with MTP), optional ``draft_model``, tokenizer."""

    model: Model
    draft_model: Model | None
    tokenizer: ByteTokenizer
    path: pathlib.Path
    meta: dict

    def __repr__(self) -> str:
        draft = "" if self.draft_model is None else f", draft_model={self.draft_model!r}"
        return f"Bundle({str(self.path)!r}, model={self.model!r}{draft}, tokenizer={type(self.tokenizer).__name__})"

    def encode_prompts(self, prompts: list[str], bos: bool = True) -> list[list[int]]:
        if isinstance(prompts, str) or not isinstance(prompts, list | tuple) or not all(
            isinstance(p, str) for p in prompts
        ):
            raise ValueError(f"prompts must be a list of strings, got {prompts!r}")
        return [self.tokenizer.encode(p, bos=bos) for p in prompts]

    def generate_kwargs(self, kwargs: dict) -> dict:
        """``kwargs`` with what the bundle knows filled in: its EOS (unless a stop is given, as
        a keyword or in ``config``) and its draft model when the drafter needs one."""
        kwargs = dict(kwargs)
        config = kwargs.get("config")
        if "eos_id" not in kwargs and (config is None or config.eos_id is None):
            kwargs["eos_id"] = self.tokenizer.eos_id
        drafter = kwargs.get("drafter", AUTO if config is None else config.drafter)
        if default_drafter(drafter, self.model, kwargs.get("draft_model")) == "draft_model":
            if self.draft_model is None and kwargs.get("draft_model") is None:
                raise ValueError(f"drafter='draft_model': the bundle {self.path} has no draft model")
            kwargs.setdefault("draft_model", self.draft_model)
        return kwargs

    def generate(self, prompts: list[str], *, bos: bool = True, **kwargs: Any):
        """Text in, text out over ``specjax.generate`` (``draft_model`` and EOS filled in).
        ``bos``: start each prompt with BOS, as every training document did (use False for
        a snippet from the middle of a file). Returns ``(texts, GenerationResult)``."""
        from specjax.generation import generate

        res = generate(self.model, self.encode_prompts(prompts, bos), **self.generate_kwargs(kwargs))
        return [self.tokenizer.decode(t) for t in res.tokens], res


    def batch_generate(self, requests, *, bos: bool = True, **kwargs: Any):
        """Text in, text out over ``specjax.batch_generate``: ``requests`` yields strings or
        dicts whose ``prompt`` is a string (other fields as in ``Request``). Yields
        ``(text, Completion)`` per request, in completion order."""
        from specjax.batch import batch_generate

        def encoded():
            for i, r in enumerate(requests):
                r = {"prompt": r} if isinstance(r, str) else dict(r)
                if not isinstance(r.get("prompt"), str):
                    raise ValueError(f"requests[{i}].prompt={r.get('prompt')!r} is invalid: must be a string")
                yield {**r, "id": r.get("id", i), "prompt": self.tokenizer.encode(r["prompt"], bos=bos)}

        stream = encoded() if not isinstance(requests, list | tuple) else list(encoded())
        for c in batch_generate(self.model, stream, **self.generate_kwargs(kwargs)):
            yield self.tokenizer.decode(c.tokens), c


def _cast_floats(tree, dtype):
    """Floating leaves to ``dtype``; integer leaves (a draft vocabulary's ids) as they are."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _cast(tree, dtype):
    """``_cast_floats`` onto the host (what a bundle saves)."""
    return jax.tree.map(np.asarray, _cast_floats(tree, dtype))


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save_bundle(
    path: str | pathlib.Path,
    model: Model,
    draft_model: Model | None = None,
    *,
    dtype: str = "bfloat16",
    training: dict | None = None,
) -> pathlib.Path:
    """Write a bundle (overwrites ``path``). Returns the path."""
    import shutil

    for m in (model, draft_model):
        if m is not None and m.config.shard_groups != 1:
            raise ValueError("save the model as loaded, not its shard_model() layout (shard_groups="
                             f"{m.config.shard_groups}, KV heads replicated)")
    path = pathlib.Path(path).absolute()
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    ckpt = _checkpointer()
    # on disk: the separate q/k/v and gate/up tensors (the layout HF checkpoints use)
    ckpt.save(path / "target", _cast(unfuse_params(model.params, model.config), dtype))
    if draft_model is not None:
        ckpt.save(path / "draft", _cast(unfuse_params(draft_model.params, draft_model.config), dtype))
    ckpt.wait_until_finished()
    cfg = {
        "format": FORMAT,
        "version": VERSION,
        "target": model.config.to_dict(),
        "draft": None if draft_model is None else draft_model.config.to_dict(),
        "tokenizer": "bytes",
        "dtype": dtype,
        "training": training or {},
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def _config(raw: Any, where: str) -> ModelConfig:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a ModelConfig object, got {type(raw).__name__}")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise CheckpointError(f"{where}: unknown ModelConfig field(s) {unknown}; allowed: {sorted(names)}")
    try:
        return ModelConfig(**raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def _is_closed_loop_callback(exc: BaseException | None) -> bool:
    """``RuntimeError('Event loop is closed')`` raised by ``asyncio``'s ``call_soon_threadsafe``."""
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    return "call_soon_threadsafe" in frames or "_check_closed" in frames


def _quiet_closed_loop_callbacks() -> None:
    """When a restore fails, reads still in flight in tensorstore's threads try to report to
    the asyncio loop orbax already closed, and each prints an "Event loop is closed"
    traceback (through ``sys.unraisablehook``) after our clean error. Drop exactly those;
    every other unraisable exception still reaches the previous hook. Installed once."""
    previous = sys.unraisablehook
    if getattr(previous, "_specjax_filter", False):
        return

    def hook(unraisable):
        if not _is_closed_loop_callback(unraisable.exc_value):
            previous(unraisable)

    hook._specjax_filter = True
    sys.unraisablehook = hook
    # the same failed reads, if their tasks are collected unretrieved, are logged by asyncio
    logging.getLogger("asyncio").addFilter(_drop_unretrieved_task_errors)


def _drop_unretrieved_task_errors(record: logging.LogRecord) -> bool:
    """asyncio's "Task exception was never retrieved" (or "Future ...", when the read was a bare
    future) for reads a failed restore abandoned."""
    return not str(record.msg).startswith(("Task exception was never retrieved",
                                           "Future exception was never retrieved"))


def _restore(directory: pathlib.Path, config: ModelConfig, dtype: str, out_dtype, mesh=None) -> Model:
    """The parameters in ``directory``; with ``mesh``, each tensor read straight into its
    sharding (orbax restores every device's slice; nothing is gathered on one device), then
    fused and laid out for the mesh on device (``specjax.sharding``)."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: parameter checkpoint directory is missing")
    abstract = jax.eval_shape(lambda: unfuse_params(init_model(config, dtype=jnp.dtype(dtype)).params, config))
    restore_as = abstract if mesh is None else placed_shapes(abstract, param_specs(abstract, mesh), mesh)
    _quiet_closed_loop_callbacks()  # before: a failing read reports while the restore still runs
    try:
        params = _checkpointer().restore(directory, restore_as)
    except Exception as e:  # orbax/tensorstore raise many types; name the file instead
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{directory}: cannot restore parameters for the config in config.json "
            f"(missing, truncated or mismatched checkpoint): {first}"
        ) from None
    want = jax.tree_util.tree_flatten_with_path(abstract)[0]
    got = jax.tree.leaves(params)
    if len(want) != len(got):
        raise CheckpointError(f"{directory}: {len(got)} tensors, config.json implies {len(want)}")
    for (kp, a), x in zip(want, got, strict=True):
        if tuple(x.shape) != tuple(a.shape):
            raise CheckpointError(
                f"{directory}: tensor {jax.tree_util.keystr(kp)} has shape {tuple(x.shape)}, "
                f"config.json implies {tuple(a.shape)}"
            )
    if mesh is None:
        return Model(fuse_params(jax.tree.map(lambda x: jnp.asarray(x, out_dtype), params)), config)
    groups = mesh.shape[MODEL]

    def layout(p):
        return sharded_layout(fuse_params(_cast_floats(p, out_dtype)), config, groups)[0]
    fn = jax.jit(layout, out_shardings=shardings(param_specs(jax.eval_shape(layout, params), mesh), mesh))
    return Model(fn(params), sharded_config(config, groups))


def load_model(path: str | pathlib.Path | None = None, dtype="float32", mesh=None) -> Bundle:
    """Load a bundle (default: the one shipped in ``checkpoints/default``) with weights (and so
    the KV caches the engine builds) in ``dtype``: ``"float32"`` (default), ``"bfloat16"``,
    ``"float16"`` or ``None`` for the stored dtype. ``mesh`` (``specjax.make_mesh``): load the
    models sharded for it (``specjax.sharding``), each tensor read straight into its devices.

    Raises ``CheckpointError`` naming the file for a missing, truncated or mismatched
    checkpoint."""
    try:
        ok = dtype is None or str(jnp.dtype(dtype)) in ("float32", "bfloat16", "float16")
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"dtype={dtype!r} is invalid: must be float32, bfloat16, float16 or None")
    path = pathlib.Path(path if path is not None else DEFAULT_BUNDLE).absolute()
    if not path.is_dir():
        hint = " (the bundled default ships in checkpoints/default of the source tree and inside the wheel)"
        hint = hint if path == DEFAULT_BUNDLE else ""
        raise CheckpointError(f"{path}: bundle directory does not exist{hint}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing (is {path} a specjax bundle?)")
    try:
        meta = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{cfg_file}: 'format' must be {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{cfg_file}: unsupported bundle version {meta.get('version')!r} (this is {VERSION})")
    if meta.get("tokenizer") != "bytes":
        raise CheckpointError(f"{cfg_file}: tokenizer {meta.get('tokenizer')!r} is not supported (only 'bytes')")
    meta_dtype = meta.get("dtype", "float32")
    if meta_dtype not in ("float32", "bfloat16", "float16"):
        raise CheckpointError(f"{cfg_file}: dtype {meta_dtype!r} is not one of float32, bfloat16, float16")
    target_cfg = _config(meta.get("target"), f"{cfg_file} ['target']")
    if target_cfg.vocab_size != ByteTokenizer.vocab_size:
        raise CheckpointError(
            f"{cfg_file}: target vocab_size {target_cfg.vocab_size} != byte tokenizer's {ByteTokenizer.vocab_size}"
        )
    out_dtype = jnp.dtype(dtype if dtype is not None else meta_dtype)
    model = _restore(path / "target", target_cfg, meta_dtype, out_dtype, mesh)
    draft = None
    if meta.get("draft") is not None:
        draft_cfg = _config(meta["draft"], f"{cfg_file} ['draft']")
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            raise CheckpointError(f"{cfg_file}: draft vocab_size {draft_cfg.vocab_size} != target's")
        draft = _restore(path / "draft", draft_cfg, meta_dtype, out_dtype, mesh)
    return Bundle(model, draft, ByteTokenizer(), path, meta)
