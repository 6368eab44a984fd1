"""Can a cache (or a pytree of caches) carry one length per row?

Every cache kind specjax builds does (tested over the whole engine state), so the engine
itself never needs to ask. This is for caches written elsewhere, before research code runs
the per-sequence rule on them: a Flax ``decode=True`` attention cache, for example, keeps one
``cache_index`` for the whole batch, and is refused with a message naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.errors import dtype_of

__all__ = ["cache_supports_per_sequence_advance"]

_LENGTH_NAMES = ("length", "len", "offset", "pos", "position", "index", "cur_index", "cache_index", "seq_len")


def _field(slot: Any, name: str) -> Any:
    return slot.get(name) if isinstance(slot, dict) else getattr(slot, name, None)


def _is_record(tree: Any) -> bool:
    """A dict that is one cache (e.g. Flax's ``{"cached_key", "cached_value", "cache_index"}``)."""
    return isinstance(tree, dict) and any(k in tree for k in ("lengths", *_LENGTH_NAMES))


def _is_container(tree: Any) -> bool:
    """A dataclass holding only caches (dataclasses) and ``None``: checked part by part."""
    if not dataclasses.is_dataclass(tree) or isinstance(tree, type):
        return False
    values = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    return any(v is not None for v in values) and all(v is None or dataclasses.is_dataclass(v) for v in values)


def _slots(tree: Any, path: str):
    if isinstance(tree, dict) and not _is_record(tree):
        for k in tree:
            yield from _slots(tree[k], f"{path}[{k!r}]")
    elif isinstance(tree, list | tuple) and not hasattr(tree, "lengths"):
        for i, x in enumerate(tree):
            yield from _slots(x, f"{path}[{i}]")
    elif _is_container(tree):  # e.g. ModelCache: its parts are the caches
        for f in dataclasses.fields(tree):
            if getattr(tree, f.name) is not None:
                yield from _slots(getattr(tree, f.name), f"{path}.{f.name}")
    else:
        yield path, tree


def _shared_counter(slot: Any) -> str | None:
    """The first integer field of a dataclass cache that holds one value for the whole
    batch (a shared time base: e.g. one count of compressed blocks), else ``None``. A cache
    names its batch-wide pool state (a paged pool's free count) in ``SHARED_POOL_FIELDS``."""
    if not dataclasses.is_dataclass(slot):
        return None
    pool = getattr(slot, "SHARED_POOL_FIELDS", ())
    for f in dataclasses.fields(slot):
        if f.name in pool:
            continue
        x = getattr(slot, f.name)
        if hasattr(x, "dtype") and np.ndim(x) == 0 and np.issubdtype(np.dtype(x.dtype), np.integer):
            return f.name
    return None


def cache_supports_per_sequence_advance(cache: Any) -> str | None:
    """``None`` if every cache slot carries its own int ``lengths [B]`` and no other integer
    counter shared by the batch; otherwise a message naming the first slot/field that
    cannot (the engine refuses the per-sequence rule with it rather than running wrong)."""
    batch = None
    for path, slot in _slots(cache, "cache"):
        name = f"{path} ({type(slot).__name__})"
        lengths = _field(slot, "lengths")
        if lengths is None:
            other = [f for f in _LENGTH_NAMES if _field(slot, f) is not None]
            if other:
                shape = np.shape(_field(slot, other[0]))
                return (
                    f"{name} field {other[0]!r} has shape {shape}: a length shared by the whole batch; "
                    "per-sequence advance needs an int32 'lengths' of shape [B]"
                )
            return f"{name} has no per-row 'lengths' field; per-sequence advance needs int32 [B]"
        shape = np.shape(lengths)
        dtype = dtype_of(lengths)
        if len(shape) != 1:
            return (
                f"{name} field 'lengths' has shape {shape}: a length shared by the whole batch; "
                "per-sequence advance needs shape [B]"
            )
        if not np.issubdtype(dtype, np.integer):
            return f"{name} field 'lengths' has dtype {dtype}; per-sequence advance needs int32 [B]"
        shared = _shared_counter(slot)
        if shared is not None:
            return (
                f"{name} field {shared!r} is one value for the whole batch: a shared time base cannot "
                "advance rows by different counts; per-sequence advance needs one per row [B]"
            )
        if batch is None:
            batch = shape[0]
        elif shape[0] != batch:
            return f"{name} field 'lengths' has {shape[0]} rows but an earlier slot has {batch}"
    return None
