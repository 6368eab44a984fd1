"""Pallas kernels for ragged attention (dense per-row layout, per-row ring, paged through a
block table), each with its jitted wrapper and its XLA reference. Depends on JAX only:
``reference`` holds the visibility rule, the mask value and the oracles."""

from pallas_kernels.paged import paged_attention, paged_attention_reference
from pallas_kernels.ragged import (
    BODIES,
    ragged_attention,
    ragged_attention_reference,
    ring_attention,
    ring_attention_reference,
)
from pallas_kernels.reference import MASK_VALUE, dense_reference, paged_reference, ring_reference, visible

__all__ = [
    "BODIES",
    "MASK_VALUE",
    "dense_reference",
    "paged_attention",
    "paged_attention_reference",
    "paged_reference",
    "ragged_attention",
    "ragged_attention_reference",
    "ring_attention",
    "ring_attention_reference",
    "ring_reference",
    "visible",
]
