"""Drafters from their public checkpoints: ``load_drafter(path, target)`` and ``save_drafter``.

A drafter checkpoint is a local folder (``config.json`` + safetensors; never a hub download).
Its format is recognised from ``config.json``, not from a flag; a drafter that does not fit
the target fails here, before anything compiles, with the mismatch named. Formats:

* ``dflash``: z-lab's DFlash drafters (``DFlashDraftModel``) -> the block drafter
  (``drafter="block"``; ``specjax.drafter_checkpoints.dflash``);
* ``eagle3``: EAGLE-3 heads (``LlamaForCausalLMEagle3``, SpecForge's and the EAGLE authors'
  layout) -> the MTP module in its EAGLE-3 layout (``drafter="mtp"``; ``.eagle3``).

MTP layers that ship inside a model's own checkpoint (MiMo, DeepSeek-V3) load with the model
(``load_hf_checkpoint``; ``.native_mtp``).
"""

from __future__ import annotations

from pathlib import Path

from specjax.drafter_checkpoints import dflash, eagle3
from specjax.hf_io import read_json
from specjax.model import Model

__all__ = ["FORMATS", "load_drafter", "save_drafter"]

# format name -> (its module, what its config.json looks like, the drafter it becomes)
FORMATS = {"dflash": (dflash, "architectures ['DFlashDraftModel'] or a 'dflash_config' field", "block"),
           "eagle3": (eagle3, "architectures ['LlamaForCausalLMEagle3']", "mtp")}


def detect(raw: dict) -> str | None:
    """The format of a drafter's ``config.json`` (a name in ``FORMATS``), or ``None``."""
    return next((name for name, (mod, _, _) in FORMATS.items() if mod.matches(raw)), None)


def load_drafter(path: str | Path, target: Model, dtype=None) -> Model:
    """``target`` carrying the drafter stored in the folder ``path``: pass the result to
    ``generate``, ``stream`` or ``batch_generate`` with ``drafter="auto"`` (or the drafter's
    name: ``"block"`` for DFlash, ``"mtp"`` for EAGLE-3). ``dtype`` (``"float32"``, ``"bfloat16"``, a jnp dtype):
    the drafter's weights' dtype; default: the target's. ``ValueError`` (one line) for a
    folder that is no drafter checkpoint, an unknown format (the known ones are listed) or a
    drafter that does not fit the target (the mismatch is named)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"draft checkpoint {str(path)!r} is not a directory")
    if not isinstance(target, Model):
        raise ValueError(f"target={type(target).__name__} is invalid: a specjax Model (load_model, "
                         "load_hf_checkpoint)")
    raw = read_json(path / "config.json")
    name = detect(raw)
    if name is None:
        known = "; ".join(f"{n}: {how}" for n, (_, how, _) in FORMATS.items())
        raise ValueError(f"{path / 'config.json'}: not a drafter format specjax reads (architectures="
                         f"{raw.get('architectures')!r}); known formats: {known}")
    return FORMATS[name][0].load(path, raw, target, dtype)


def save_drafter(model: Model, path: str | Path, format: str = "dflash", dtype: str = "float32") -> None:  # noqa: A002
    """Write ``model``'s drafter in a public layout (``format`` in ``FORMATS``; its weights in
    ``dtype``: ``"float32"`` or ``"bfloat16"``) that ``load_drafter`` and the format's own code
    read back."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is invalid: one of {list(FORMATS)}")
    FORMATS[format][0].save(model, Path(path), dtype)
