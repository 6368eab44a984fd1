"""What the public layouts' writers share."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["cast"]

SAVE_DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def cast(tensors: dict, dtype: str) -> dict:
    """``tensors`` (NumPy) with their float ones in ``dtype`` (``SAVE_DTYPES``), contiguous."""
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: one of {list(SAVE_DTYPES)}")
    to = SAVE_DTYPES[dtype]
    return {k: np.ascontiguousarray(v.astype(to) if v.dtype.kind == "f" else v) for k, v in tensors.items()}
