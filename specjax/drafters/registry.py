"""Drafter names and arguments -> engine drafters: the ``"auto"`` default, the built-in names, a
user's drafter (wrapped), a wrapper of a drafter (``specjax.controlled``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.drafters.block import BlockDrafter
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.mtp import MtpDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.none import NoDrafter
from specjax.drafters.plugged import PluggedDrafter
from specjax.protocols import check_drafter

DRAFTERS = ("mtp", "draft_model", "ngram", "block")
AUTO = "auto"  # every entry point's default drafter: ``default_drafter``


def default_drafter(drafter: object, model: object, draft_model: object) -> object:
    """``drafter``, with ``"auto"`` (the default of ``generate``, ``stream``, ``batch_generate``,
    the bundles and the CLI) resolved by one rule: ``"mtp"`` when the model carries an MTP
    module, else ``"block"`` when it carries a block drafter (a loaded DFlash drafter), else
    ``"draft_model"`` when a draft model is given, else ``"ngram"``."""
    if not (isinstance(drafter, str) and drafter == AUTO):
        return drafter
    decoder = getattr(model, "decoder", None)
    if getattr(decoder, "mtp_depth", 0):
        return "mtp"
    if getattr(decoder, "block_size", 0):
        return "block"
    return "draft_model" if draft_model is not None else "ngram"


BUILTIN = {"mtp": MtpDrafter, "draft_model": DraftModelDrafter, "ngram": NgramDrafter, "block": BlockDrafter}


def resolve_drafter(drafter: object, ngram_n: int = 3) -> Any:
    """``drafter`` (``None``, a name in ``DRAFTERS``, a built-in drafter or a user's
    ``protocols.Drafter``) -> the engine's drafter object."""
    if drafter is None:
        return NoDrafter()
    if isinstance(drafter, str):
        return NgramDrafter(ngram_n) if drafter == "ngram" else BUILTIN[drafter]()
    if isinstance(drafter, NoDrafter | NgramDrafter | DraftModelDrafter | MtpDrafter | BlockDrafter | PluggedDrafter):
        return drafter
    if _wraps(drafter):  # a wrapper of a drafter (specjax.controlled.Controlled): resolve what it wraps
        return dataclasses.replace(drafter, inner=resolve_drafter(drafter.inner, ngram_n))
    check_drafter("drafter", drafter)
    return PluggedDrafter(drafter)


def _wraps(drafter: object) -> bool:
    """Is ``drafter`` a wrapper of another drafter (``inner``), as ``specjax.controlled.Controlled``
    is? Asked of its class: a wrapper forwards attribute lookups to what it wraps."""
    return bool(getattr(type(drafter), "wraps_drafter", False))


def drafter_kind(drafter: object) -> str | None:
    """What a ``drafter`` argument needs from the models: ``None`` (plain decoding), ``"mtp"``,
    ``"draft_model"``, ``"ngram"``, ``"block"`` or ``"custom"`` (a user's drafter: nothing)."""
    if drafter is None or isinstance(drafter, NoDrafter):
        return None
    if isinstance(drafter, str):
        return drafter
    if _wraps(drafter):  # what its inner drafter needs (an MTP module, a draft model)
        return drafter_kind(drafter.inner)
    for name, cls in BUILTIN.items():
        if isinstance(drafter, cls):
            return name
    return "custom"
