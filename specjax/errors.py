"""The one shape of every argument error, and the small checks errors are made of. Imports
nothing of specjax, so any module (``auto/``, the caches, the API) can use it without a cycle."""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["dtype_of", "fail", "is_int", "is_real", "shown"]


def fail(arg: str, value: object, allowed: str) -> None:
    """Raise ``ValueError('<arg>=<value> is invalid: <allowed>')``: every argument check's error."""
    raise ValueError(f"{arg}={value!r} is invalid: {allowed}")


def is_int(x: object) -> bool:
    """An int (NumPy's too), not a bool."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A real number (Python's or NumPy's, ``np.float32`` too), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def dtype_of(x: object) -> np.dtype:
    """The dtype of an array (NumPy's, jax's, a tracer, a ``ShapeDtypeStruct``) or of what
    ``np.asarray`` makes of anything else (a list, a Python int)."""
    import jax  # (an array type check only: jax is imported by then wherever arrays exist)

    if isinstance(x, np.ndarray | np.generic | jax.Array | jax.ShapeDtypeStruct):
        return np.dtype(x.dtype)
    return np.asarray(x).dtype


def shown(value: object) -> object:
    """A tuple a config made from a list, shown as the list the caller gave (errors)."""
    return list(value) if isinstance(value, tuple) else value
