"""A persistent XLA compilation cache: the second run of the same command compiles nothing.

On by default: ``generate``, ``stream``, ``batch_generate`` and every CLI command turn it on
before their first compile (``default_on``), unless ``$SPECJAX_COMPILATION_CACHE`` is
``0``/``off`` or a cache folder is already set in jax (``jax_compilation_cache_dir``: left as
it is). A folder that cannot be written turns it off with a one-line warning on stderr.
Where: ``$SPECJAX_COMPILATION_CACHE`` (a folder), else ``$SPECJAX_CACHE_DIR/xla``, else
``~/.cache/specjax/xla``. JAX keys every entry by the program, its compile options, the
backend and the jax/jaxlib versions, so a stale entry is never used; deleting the folder is
always safe.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import jax

__all__ = ["ENV", "cache_dir", "default_on", "enable_compilation_cache"]

ENV = "SPECJAX_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no", "")
_WARNED: set[Path] = set()  # folders already reported unwritable (one line each per process)


def cache_dir() -> Path | None:
    """The folder the cache would use (``None``: turned off by ``$SPECJAX_COMPILATION_CACHE``)."""
    value = os.environ.get(ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF else Path(value).expanduser()
    root = os.environ.get("SPECJAX_CACHE_DIR") or Path.home() / ".cache" / "specjax"
    return Path(root) / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Keep compiled programs in ``path`` (default ``cache_dir()``) across processes. Returns
    the folder in use, or ``None`` when turned off or the folder cannot be written (said once
    per folder on stderr; everything still works, it only compiles again)."""
    current = jax.config.jax_compilation_cache_dir
    if current:  # the user chose one: theirs wins
        return Path(current)
    folder = Path(path).expanduser() if path is not None else cache_dir()
    if folder is None:
        return None
    why = _unwritable(folder)
    if why is not None:
        if folder not in _WARNED:
            _WARNED.add(folder)
            print(f"specjax: the compilation cache is off: cannot write {folder} ({why}); set {ENV}=DIR to move "
                  f"it or {ENV}=0 to silence this", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    # every engine program is worth keeping: a small decode loop still takes a second or more
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return folder


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot hold the cache (made if missing), or ``None`` when it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


_DEFAULT_DONE = False


def default_on() -> None:
    """The cache on by default, once per process: what the entry points call before they compile
    (a user's ``enable_compilation_cache`` or jax setting, and ``$SPECJAX_COMPILATION_CACHE``, win)."""
    global _DEFAULT_DONE
    if not _DEFAULT_DONE:
        _DEFAULT_DONE = True
        enable_compilation_cache()
