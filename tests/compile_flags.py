"""XLA:CPU flags that make the suite's compiles cheaper, shared by ``conftest.py`` and the
subprocess workers (``mesh_worker.py``, ``multihost_worker.py``).

The suite compiles thousands of small programs whose run time is negligible, so compile time
is most of a cold run:

- ``--xla_backend_optimization_level=0``: LLVM at -O0, about a third off the backend compile
  (one chunked-prefill test: 100 s -> 64 s).
- ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU's older elemental emitters for fusions
  instead of the MLIR fusion emitters, about half of what is left (the same test's compiles:
  26.9 s -> 14.3 s; its run time unchanged). HLO passes are the same either way, so every
  program a test inspects is unchanged; only the machine code differs.

XLA aborts the process on a flag it does not know, so a flag is only added where the
installed jaxlib's library names it (a later jaxlib may drop it). The answer is kept in a
small file per library (path, size, mtime), so the scan runs once, not in every pytest run
of the mutation check.
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile

CHEAP = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _library() -> str | None:
    """The jaxlib shared library that registers XLA's flags, without importing jax."""
    import importlib.util

    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    for name in ("libjax_common.so", "xla_extension.so"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def known(flags: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``flags`` whose name the installed jaxlib knows (none where it cannot be read)."""
    path = _library()
    if path is None:
        return ()
    st = os.stat(path)
    memo = os.path.join(tempfile.gettempdir(), f"specjax-xla-flags-{st.st_size}-{int(st.st_mtime)}.json")
    try:
        with open(memo) as f:
            seen = json.load(f)
    except (OSError, ValueError):
        seen = {}
    missing = [f for f in flags if f not in seen]
    if missing:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
            for flag in missing:
                seen[flag] = lib.find(flag[2:].split("=")[0].encode()) >= 0
        tmp = f"{memo}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(seen, f)
        os.replace(tmp, memo)
    return tuple(f for f in flags if seen[f])


def with_cheap_compiles(xla_flags: str) -> str:
    """``xla_flags`` plus each cheap-compile flag the caller did not set itself."""
    mine = [f for f in known(CHEAP) if f.split("=")[0] not in xla_flags]
    return " ".join([xla_flags, *mine]).strip()
