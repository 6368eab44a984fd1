import atexit
import os
import shutil
import tempfile

import pytest

# depth="auto" keeps measured step costs on disk: never in the user's ~/.cache from tests
os.environ["SPECJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="specjax-test-cache-")
# removed when the process ends (each xdist worker and each mutation-check run made one: thousands piled up in /tmp)
atexit.register(shutil.rmtree, os.environ["SPECJAX_CACHE_DIR"], ignore_errors=True)

# The persistent compilation cache, CPU only and cheaper compiles (tests/xla_env.py says which
# and why), set before anything imports jax. The cache folder is pruned here, once per session,
# oldest first, to this size.
import xla_env  # noqa: E402

xla_env.configure()
_XLA_CACHE_BYTES = 3 << 30


def _prune(folder: str, limit: int) -> None:
    try:
        entries = [e for e in os.scandir(folder) if e.is_file()]
    except OSError:
        return
    stats = sorted(((e.stat().st_mtime, e.stat().st_size, e.path) for e in entries), reverse=True)
    total = 0
    for _, size, path in stats:  # newest first: keep while under the limit
        total += size
        if total > limit:
            try:
                os.remove(path)
            except OSError:
                pass


if xla_env.cache_folder() != "off" and "PYTEST_XDIST_WORKER" not in os.environ:
    _prune(os.environ["JAX_COMPILATION_CACHE_DIR"], _XLA_CACHE_BYTES)  # before any worker compiles

from hypothesis import Phase, settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
# the mutation check's: the same examples, and a failure is its verdict as it stands (shrinking
# it to a minimal example compiles one program per try: a minute for one caught entry)
settings.register_profile("mutation", max_examples=25, deadline=None, derandomize=True,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate), report_multiple_bugs=False)
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

        import specjax.generation

        specjax.generation.clear_compiled()
        jax.clear_caches()
        gc.collect()


# The quick lane (``pytest -m "not slow" -n 2``): the plan, caches, kernels, trees, sampling,
# validation and layout tests. These modules build whole engines, models, notebooks or CLI
# runs and hold most of a cold run's compile time; the README's command runs them all.
SLOW = {
    "test_batch", "test_batch_cli", "test_batch_trees", "test_block_drafter", "test_bundle", "test_chunked_prefill",
    "test_cli", "test_compressed", "test_controlled", "test_default_bundle", "test_depth_auto", "test_docs",
    "test_drafter_checkpoints",
    "test_engine", "test_hf", "test_hf_families", "test_lean_step", "test_notebook", "test_plugins",
    "test_prefix_cache", "test_sharding", "test_tpu_compile", "test_train", "test_train_mtp", "test_tree_engine",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in SLOW:
            item.add_marker(pytest.mark.slow)
