"""The suite's XLA environment, set before jax is imported (jax reads its platform and
compilation-cache settings at import): ``conftest.py`` for pytest and its workers, and the
mutation check for the forkserver its pytest runs fork from (``scripts/forked_pytest.py``).

- CPU only.
- XLA's persistent compilation cache, shared by the test workers, their subprocesses and the
  mutation check's runs (whose unchanged programs are then not compiled again): keyed by the
  program and the jax/XLA versions, so a changed program always compiles. ``SPECJAX_XLA_CACHE``
  picks the folder; "off" disables it. No size limit inside jax (its LRU eviction stats and
  reads every entry on every write: O(entries) per compile); ``conftest.py`` prunes it.
- Cheaper XLA:CPU compiles (``compile_flags.py`` says which and why); a caller's own setting
  of a flag wins.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping

from compile_flags import with_cheap_compiles


def cache_folder(environ: MutableMapping[str, str] = os.environ) -> str:
    """The persistent cache's folder, or "off"."""
    return environ.get("SPECJAX_XLA_CACHE") or os.path.join(tempfile.gettempdir(), "specjax-xla-cache")


def configure(environ: MutableMapping[str, str] = os.environ) -> None:
    environ.setdefault("JAX_PLATFORMS", "cpu")
    folder = cache_folder(environ)
    if folder != "off":
        environ.setdefault("JAX_COMPILATION_CACHE_DIR", folder)
        environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    environ["XLA_FLAGS"] = with_cheap_compiles(environ.get("XLA_FLAGS", ""))
