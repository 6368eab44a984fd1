"""pytest runs forked from one process that imported jax, numpy, pytest and hypothesis once.

A fresh ``python -m pytest`` spends seconds importing its third-party modules before the
first test; the mutation check runs pytest hundreds of times. Each run here is a fork of a
multiprocessing forkserver that preloaded them (never specjax: a run imports its own tree's
modules, mutated or not), so only the tree's code is imported and compiled per run.

The forkserver starts with the first run and keeps the environment of that moment: jax reads
its platform and compilation-cache settings at import, so set them first
(``tests/xla_env.py``). No backend is initialized in the server, so forking it is safe.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from pathlib import Path

# imported once in the server; a missing one (and those after it) are simply imported per run
PRELOAD = ["numpy", "jax", "jax.numpy", "pytest", "hypothesis", "scipy.stats", "optax", "orbax.checkpoint",
           "chex", "flax"]

_context = None


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(root: str, args: list[str], out: str, err: str, drop: list[str]) -> None:
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    os.chdir(root)
    sys.path[:] = [root] + [p for p in sys.path if p not in drop]  # the tree's code, not the checkout's
    import pytest

    code = pytest.main(args)
    sys.stdout.flush()
    sys.stderr.flush()
    # tests/conftest.py made this run its own cache folder and left removing it to atexit,
    # which a forked child skips
    cache = os.environ.get("SPECJAX_CACHE_DIR", "")
    if os.path.basename(cache).startswith("specjax-test-cache-"):
        shutil.rmtree(cache, ignore_errors=True)
    os._exit(int(code))


def run(root: Path, args: list[str], drop: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """``pytest args`` in ``root`` (its cwd and first import path; ``drop``: paths taken off
    ``sys.path``) -> ``(exit code, stdout, stderr)``. A run killed by a signal has a negative
    exit code, as ``subprocess`` reports it."""
    with tempfile.TemporaryDirectory(prefix="specjax-forked-pytest-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for path in (out, err):
            open(path, "w").close()
        proc = _server().Process(target=_child, args=(str(root), list(args), out, err, list(drop)))
        proc.start()
        proc.join()
        read = lambda p: Path(p).read_text(errors="replace")  # noqa: E731
        return proc.exitcode, read(out), read(err)
