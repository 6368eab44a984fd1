"""The Pallas kernels and the whole generate loop lower for TPU (Mosaic) from this CPU machine.

Pallas's Mosaic lowering reads the TPU generation from the default device's kind; here the
device is a CPU, so the tests supply a TPU's (``tpu_info.get_device_kind``: "TPU v5 lite" is
v5e, "TPU v6 lite" v6e; one core). What this checks: every kernel's grid body (dense, sliding
window, ring, paged) and every engine configuration named below lower to a Mosaic custom call
at real sizes (bfloat16, head_dim 128, GQA 4:1, a 4-token verify window). What only the chip
can check: Mosaic's own compile of that module (tiling, VMEM limits), numerics, and speed
(``benchmarks/gpu_check.py`` is the device run; none has run on a TPU yet)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")

CHIPS = ["TPU v5 lite", "TPU v6 lite"]


@pytest.fixture(params=CHIPS)
def tpu(request, monkeypatch):
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: request.param)
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    return request.param


def _lower_for_tpu(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("kernel", ["dense", "window", "ring", "paged", "dense-tree", "paged-tree", "ring-tree"])
def test_every_kernels_grid_body_lowers_for_tpu(tpu, kernel):
    from pallas_kernels.paged import paged_attention
    from pallas_kernels.ragged import ragged_attention, ring_attention
    from pallas_kernels.reference import TreeMask

    b, t_q, hq, hkv, d, keys, layers = 2, 4, 8, 2, 128, 512, 3
    dt = jnp.bfloat16
    q = jnp.zeros((b, t_q, hq, d), dt)
    lead, qs = jnp.zeros((b,), jnp.int32), jnp.full((b,), 100, jnp.int32)
    kv = jnp.zeros((layers, b, hkv, keys, d), dt)
    pages = jnp.zeros((layers, 40, hkv, 16, d), dt)
    table = jnp.zeros((b, keys // 16), jnp.int32)
    tree = TreeMask(qs, jnp.ones((b, t_q, t_q), bool), jnp.zeros((b, t_q), jnp.int32), jnp.zeros((b, t_q), jnp.int32))
    fn = {
        "dense": lambda q: ragged_attention(q, kv, kv, lead, qs, block_k=128, body="grid", interpret=False, layer=1),
        "window": lambda q: ragged_attention(q, kv, kv, lead, qs, window=100, block_k=128, body="grid",
                                             interpret=False, layer=1),
        "ring": lambda q: ring_attention(q, kv, kv, lead, qs, window=100, body="grid", interpret=False, layer=2),
        "paged": lambda q: paged_attention(q, pages, pages, table, lead, qs, body="grid", interpret=False, layer=0),
        "dense-tree": lambda q: ragged_attention(q, kv, kv, lead, qs, block_k=128, body="grid", interpret=False,
                                                 layer=1, tree=tree),
        "paged-tree": lambda q: paged_attention(q, pages, pages, table, lead, qs, body="grid", interpret=False,
                                                layer=0, tree=tree),
        "ring-tree": lambda q: ring_attention(q, kv, kv, lead, qs, window=100, body="grid", interpret=False, layer=2,
                                              tree=tree),
    }[kernel]
    assert "tpu_custom_call" in _lower_for_tpu(fn, q)


@pytest.mark.parametrize("cache,drafter,sliding,tree", [("dense", "mtp", False, None), ("paged", "ngram", False, None),
                                                        ("dense", "mtp", True, None),
                                                        ("dense", "mtp", True, "dynamic:8,2"),
                                                        ("paged", "mtp", False, "dynamic:8,2")])
def test_the_generate_loop_with_pallas_attention_lowers_for_tpu(tpu, cache, drafter, sliding, tree, monkeypatch):
    """The whole loop (prefill, the MTP chain or n-gram lookup, a 4-token verify, commit) with
    ``attention_impl="pallas"``, bfloat16 weights at head_dim 128 and GQA 4:1: every layer's
    attention a Mosaic kernel (the grid body, as on a TPU)."""
    import pallas_kernels.paged as paged_module
    import pallas_kernels.ragged as ragged_module
    from specjax.engine import generate_loop
    from specjax.generation import setup
    from specjax.generation_config import GenerationConfig
    from specjax.model import ModelConfig, init_model

    for module in (ragged_module, paged_module):
        monkeypatch.setattr(module, "default_body", lambda: "grid")
        monkeypatch.setattr(module, "interpret_arg", lambda interpret: False)
    cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128, d_ff=256,
                      max_seq_len=512, mtp_depth=3, sliding_window=64 if sliding else None,
                      global_every=2 if sliding else 0)
    model = init_model(cfg, dtype=jnp.bfloat16)
    settings = GenerationConfig(max_new_tokens=8, drafter=drafter, depth=3, cache=cache, attention_impl="pallas",
                                tree=tree)
    eng, params, args = setup(model, [[1, 2, 3], [4, 5]], settings)
    lowered = jax.jit(generate_loop, static_argnums=0).trace(
        eng, params, *args, None, np.int32(eng.max_steps)).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert text.count("tpu_custom_call") >= cfg.n_layers
