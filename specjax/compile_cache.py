"""A persistent XLA compilation cache: the second run of the same command compiles nothing.

The CLI turns it on for every command; from Python call ``enable_compilation_cache()`` once
(before the first generation). Where: ``$SPECJAX_COMPILATION_CACHE`` (a folder; ``0``/``off``:
no cache), else ``$SPECJAX_CACHE_DIR/xla``, else ``~/.cache/specjax/xla``. A cache folder a
user already set (``jax_compilation_cache_dir``) is left as it is. JAX keys every entry by the
program, its compile options, the backend and the jax/jaxlib versions, so a stale entry is
never used; deleting the folder is always safe.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

__all__ = ["ENV", "cache_dir", "enable_compilation_cache"]

ENV = "SPECJAX_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "")


def cache_dir() -> Path | None:
    """The folder the cache would use (``None``: turned off by ``$SPECJAX_COMPILATION_CACHE``)."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    root = os.environ.get("SPECJAX_CACHE_DIR") or Path.home() / ".cache" / "specjax"
    return Path(root) / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Keep compiled programs in ``path`` (default ``cache_dir()``) across processes. Returns
    the folder in use, or ``None`` when turned off or the folder cannot be created (then
    everything still works; it only compiles again)."""
    current = jax.config.jax_compilation_cache_dir
    if current:  # the user chose one: theirs wins
        return Path(current)
    folder = Path(path).expanduser() if path is not None else cache_dir()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # every engine program is worth keeping: a small decode loop still takes a second or more
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return folder
