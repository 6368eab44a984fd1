"""Frozen dataclasses registered as JAX pytrees.

Fields declared with ``static_field()`` are pytree metadata (hashable, part of the
jit cache key); every other field is a leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax

T = TypeVar("T")


def static_field(**kwargs: Any) -> Any:
    """A dataclass field kept out of the pytree leaves (compile-time constant)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True)`` + ``jax.tree_util.register_dataclass``."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
    cls.replace = dataclasses.replace  # type: ignore[attr-defined]
    return cls
