"""Every cache kind is a ``KVCache`` (``specjax.cache.protocol``) and commits a step plan the
one shared way: each row by its own ``plan.advance`` (both rules), as ``advance`` would."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.cache import CompressedKVCache, KVCache, ModelCache, RollingKVCache, global_cache
from specjax.plan import plan_step

B, HKV, HD = 3, 1, 8


def _caches():
    return {
        "dense": global_cache("dense", 1, B, 32, HKV, HD),
        "paged": global_cache("paged", 1, B, 32, HKV, HD, page_size=8),
        "rolling": RollingKVCache.create(1, B, 8, 8, HKV, HD),
        "compressed": CompressedKVCache.create(1, B, 32, 8, 4, 8, HKV, HD),
    }


@pytest.mark.parametrize("kind", ["dense", "paged", "rolling", "compressed"])
def test_every_cache_kind_is_a_kvcache_and_commits_a_plan_row_by_row(kind):
    cache = _caches()[kind]
    assert isinstance(cache, KVCache)
    k = jnp.ones((B, 4, HKV, HD), jnp.float32)
    if kind == "paged":
        cache = cache.reserve(4)
    cache = cache.write(0, k, k)
    u = jnp.ones((B,), jnp.int32)
    for rule in ("per_sequence", "cohort"):
        plan = plan_step(u, jnp.asarray([0, 2, 1], jnp.int32), 4, rule)
        got, want = cache.apply_plan(plan), cache.advance(plan.advance)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(plan.advance))


def test_a_model_cache_is_not_one_cache_but_maps_the_commit_over_its_parts():
    caches = _caches()
    model = ModelCache(caches["dense"], caches["rolling"], None)
    assert not isinstance(model, KVCache)  # no ``write``: a layer's write goes to its kind's cache
    got = model.advance(jnp.asarray([1, 2, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got.global_kv.lengths), [1, 2, 3])
    np.testing.assert_array_equal(np.asarray(got.local_kv.lengths), [1, 2, 3])
