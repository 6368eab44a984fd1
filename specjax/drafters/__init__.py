"""Drafters: what proposes each step's drafts. One drafter per module; ``base`` holds the
engine's interface (``EngineDrafter``) and ``tree`` the tree construction they share."""

from specjax.drafters.base import EngineDrafter, gather_tokens, pick
from specjax.drafters.block import BlockDrafter, BlockState
from specjax.drafters.draft_model import DraftModelDrafter
from specjax.drafters.mtp import MtpDrafter, MtpState
from specjax.drafters.ngram import NgramDrafter
from specjax.drafters.none import NoDrafter
from specjax.drafters.plugged import PluggedDrafter
from specjax.drafters.registry import AUTO, BUILTIN, DRAFTERS, default_drafter, drafter_kind, resolve_drafter

__all__ = ["AUTO", "BUILTIN", "DRAFTERS", "BlockDrafter", "BlockState", "DraftModelDrafter", "EngineDrafter",
           "MtpDrafter", "MtpState", "NgramDrafter", "NoDrafter", "PluggedDrafter", "default_drafter", "drafter_kind",
           "gather_tokens", "pick", "resolve_drafter"]
