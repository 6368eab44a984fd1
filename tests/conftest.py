import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# depth="auto" keeps measured step costs on disk: never in the user's ~/.cache from tests
os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-test-cache-")
# removed when the process ends (each xdist worker and each mutation-check run made one: thousands piled up in /tmp)
atexit.register(shutil.rmtree, os.environ["SPECJAX_CACHE_DIR"], ignore_errors=True)

# XLA's persistent compilation cache, shared by the test workers, their subprocesses and the
# mutation check's runs (whose unchanged programs are then not compiled again): keyed by the
# program and the jax/XLA versions, so a changed program always compiles. SPECJAX_XLA_CACHE
# picks the folder; "off" disables it.
_XLA_CACHE = os.environ.get("SPECJAX_XLA_CACHE") or os.path.join(tempfile.gettempdir(), "specjax-xla-cache")
if _XLA_CACHE != "off":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))  # bytes; least recently used go first

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Every XLA:CPU executable keeps a few thousand memory mappings alive (JIT code and buffers),
# and jax keeps every executable it compiled. A test worker that compiles hundreds of
# configurations passes Linux's vm.max_map_count (65530) and LLVM then segfaults inside a
# compile. Measured: one engine test adds about 2,000 mappings; jax.clear_caches() returns
# them. So: when a worker holds many mappings, drop the compiled caches between tests.
MAPS_LIMIT = 25_000


def _mappings() -> int:
    try:
        with open(f"/proc/{os.getpid()}/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: nothing to count
        return 0


@pytest.fixture(autouse=True)
def _bounded_compile_caches():
    yield
    if _mappings() > MAPS_LIMIT:
        import gc

        import jax

        import specjax.engine

        specjax.engine._COMPILED.clear()
        jax.clear_caches()
        gc.collect()
