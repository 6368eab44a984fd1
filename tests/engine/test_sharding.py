"""Many devices (``specjax.sharding``): the layout, the table, meshes and processes.

Meshes run in subprocesses with eight forced CPU devices (``mesh_worker.py``) and two
processes with two devices each (``multihost_worker.py``), so the rest of the suite keeps
one device."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import TESTS

import specjax
from specjax.engine import state as engine_state
from specjax.model import ModelConfig, init_model, logits, with_layer_loop
from specjax.sharding import (
    PARAM_RULES,
    make_mesh,
    param_specs,
    parse_mesh,
    sharded_layout,
    spec_mismatches,
    state_specs,
)

HERE = TESTS


def _env() -> dict:
    """A subprocess's environment: no forced device count of ours, and this tree's ``specjax``
    first (the mutation check runs the tests in a copy of the tree)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _worker(*args: str, timeout: int = 600) -> dict:
    env = _env()
    proc = subprocess.run([sys.executable, str(HERE / "mesh_worker.py"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check(result: dict) -> None:
    bad = [k for k, ok in result["tokens"].items() if not ok]
    assert not bad, f"tokens differ from the unsharded run: {bad}"
    for part in ("params", "state"):
        wrong = {k: v for k, v in result[part].items() if v}
        assert not wrong, f"{part} placed against the table: {wrong}"


FULL = os.environ.get("SPECJAX_MESH_MATRIX") == "full"


@pytest.mark.parametrize("drafter", ["mtp", "ngram", "draft_model"])
def test_every_mesh_gives_the_unsharded_tokens(drafter):
    """Meshes 8x1, 4x2, 2x4, 1x8 with both rules and dense/paged caches: the same tokens as one
    device (KV heads 2 < model 8: replicated; sliding-window layers), every weight and state
    leaf where the table puts it, under ``transfer_guard("disallow")``; mtp also runs the paged
    Pallas kernel per shard. By default each drafter runs a covering set (every mesh and every
    rule x cache once: 4 runs, 12 over the drafters); ``SPECJAX_MESH_MATRIX=full`` runs the whole
    product (16 per drafter, 48 in all: about 7 CPU-minutes, over CI's budget)."""
    extra = ["pallas"] if drafter == "mtp" else []
    result = _worker(drafter, "all", "all", *extra) if FULL else _worker(drafter, "cover", *extra)
    assert len(result["tokens"]) == (16 if FULL else 4) + (drafter == "mtp")
    assert len({k.split()[0] for k in result["tokens"] if "pallas" not in k}) == 4  # every mesh shape
    _check(result)


def test_state_layout_on_one_mesh():
    """The quick version of the above (one mesh, one setting): what mutations run."""
    result = _worker("ngram", "4x2", "per_sequence:paged")
    assert len(result["state"]) == 1
    _check(result)


def test_loaders_stream_batch_memory_and_errors_on_a_mesh():
    """``load_model(mesh=)`` and ``load_hf_checkpoint(mesh=)`` (Gemma 3 fixture: KV heads 2 on a
    model axis of 4, sliding-window layers), ``stream`` and ``batch_generate`` (dense, paged): the
    unsharded tokens, weights per the table; a draft model the model axis cannot split (4 heads
    on 8 devices) replicated, with the unsharded tokens. ``specjax.memory``'s resident bytes equal XLA's for
    the compiled step; its largest activation is within XLA's temporaries. Bad settings are
    one clear error."""
    result = _worker("extras")
    _check(result)
    assert set(result["tokens"]) == {"hf", "bundle", "stream", "batch_generate dense", "batch_generate paged",
                                     "batch_generate dense: latency of every step",
                                     "batch_generate paged: latency of every step",
                                     "batch_generate paged, a page per shard", "batch_generate paged, shared prefixes",
                                     "batch_generate paged, shared prefixes reused",
                                     "batch_generate paged, shared prefixes, mtp",
                                     "batch_generate dense, chunked prefill", "batch_generate paged, chunked prefill",
                                     "replicated draft model"}
    for plan_args, xla_args, act, xla_temp in result["memory"]:
        assert plan_args == xla_args and 0 < act <= xla_temp
    errors = result["errors"]
    assert "3 rows" in errors["rows"] and "data axis (4)" in errors["rows"], errors
    assert "slots=6" in errors["slots"] and "data axis (4)" in errors["slots"], errors
    assert "model=3 must divide n_heads=8" in errors["heads"] and "replicate=True" in errors["heads"], errors
    assert "pages=6" in errors["pages"] and "data axis (4)" in errors["pages"], errors


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_each_get_their_own_rows():
    """Two processes (two CPU devices each, gloo collectives), each with its own prompts: on a
    2x2 and a 4x1 mesh spanning both, each gets back exactly what it gets alone."""
    env = _env()
    env["COORDINATOR"] = f"localhost:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py")], env=env | {"PROCESS_ID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, err[-3000:]
        outs.append(json.loads(lines[-1][len("RESULT "):]))
    assert [o["process"] for o in outs] == [0, 1] and all(o["devices"] == 4 for o in outs)
    for o in outs:
        assert o["2x2"] == o["alone"] and o["4x1"] == o["alone"], o
    assert outs[0]["alone"] != outs[1]["alone"]  # the processes' rows differ: a swap would show


LAYOUT_CASES = [  # (n_heads, n_kv_heads, model): KV heads split, or replicated when fewer than the model axis
    (4, 2, 2), (4, 1, 4), (8, 2, 8), (8, 4, 2), (6, 3, 2),
]


@pytest.mark.parametrize("heads,kv,model", LAYOUT_CASES)
@pytest.mark.parametrize("loop", ["unrolled", "scan"])
def test_sharded_layout_keeps_the_model(heads, kv, model, loop):
    """The grouped fused columns and replicated KV heads compute the same logits (one device)."""
    cfg = ModelConfig(vocab_size=32, d_model=48, n_layers=2, n_heads=heads, n_kv_heads=kv, head_dim=8, d_ff=32 * model,
                      max_seq_len=32, qkv_bias=True, tie_embeddings=False)
    m = with_layer_loop(init_model(cfg, seed=heads + kv), loop)
    params, cfg2 = sharded_layout(m.params, cfg, model)
    assert cfg2.shard_groups == model and cfg2.n_kv_heads % model == 0 and cfg2.n_kv_heads >= kv
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)), jnp.int32)
    want = logits(m, toks)
    got = logits(m.replace(params=params, config=cfg2), toks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_every_parameter_has_a_rule():
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32,
                      qkv_bias=True, qk_norm=True, sandwich_norm=True, tie_embeddings=False, mtp_depth=1)
    mesh = make_mesh(1, 1)
    params = init_model(cfg).params
    specs = jax.tree.leaves(param_specs(params, mesh), is_leaf=lambda s: isinstance(s, type(PARAM_RULES[0][1])))
    assert len(specs) == len(jax.tree.leaves(params))
    sharded = specjax.shard_model(init_model(cfg), mesh)  # one device: the table's specs, trivially placed
    assert spec_mismatches(sharded.params, param_specs(sharded.params, mesh), mesh) == []
    assert specjax.shard_model(sharded, mesh) is sharded  # already placed: a no-op


def test_generate_brings_back_no_cache(monkeypatch):
    """The loop runs with no implicit transfer, and what comes back is tokens and counters:
    nothing the size of a KV buffer."""
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)
    model = init_model(cfg, seed=2)
    fetched = []
    real = engine_state.local_rows
    monkeypatch.setattr(engine_state, "local_rows", lambda x: fetched.append(x.shape) or real(x))
    with jax.transfer_guard("disallow"):
        out = specjax.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=6, depth=2, mesh=make_mesh(1, 1))
    assert len(out.tokens) == 2 and fetched
    kv_elems = 2 * 128 * cfg.n_kv_heads * cfg.head_dim  # one layer's K buffer: [B, Hkv, capacity, D]
    assert max(int(np.prod(s)) for s in fetched) < kv_elems, fetched


def test_a_paged_pool_is_split_over_the_data_shards():
    """One pool per data shard: a split cache's pages, free stacks and counts go over "data"
    (a one-pool cache stays whole on each data shard), and per device a paged cache on 8 data
    shards holds 1/8 of what one device holds (sizing from abstract shapes: no devices)."""
    from jax.sharding import PartitionSpec as P

    from specjax.cache import PagedKVCache
    from specjax.memory import _mesh_like, memory_plan

    mesh = _mesh_like(4, 2)
    split = state_specs(PagedKVCache.create(1, 8, 16, 4, 4, 2, 8, groups=4), mesh)
    assert (split.k[0], split.free_pages, split.num_free) == (P("data", "model", None, None), P("data"), P("data"))
    one = state_specs(PagedKVCache.create(1, 8, 16, 4, 4, 2, 8), mesh)
    assert (one.k[0], one.free_pages, one.num_free) == (P(None, "model", None, None), P(None), P())
    with pytest.raises(ValueError, match="split into 2 pools cannot run on a mesh with data=4"):
        state_specs(PagedKVCache.create(1, 8, 16, 4, 4, 2, 8, groups=2), mesh)
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256)
    alone = memory_plan(cfg, batch=16, context=256, cache="paged", drafter=None).kv_cache
    per_device = memory_plan(cfg, data=8, batch=16, context=256, cache="paged", drafter=None).kv_cache
    assert 0 <= per_device * 8 - alone <= 8 * 4, (alone, per_device)  # the free counts: one int32 per shard


@pytest.mark.parametrize("text,err", [("4x", "DATAxMODEL"), ("0x2", "DATAxMODEL"), ("a", "DATAxMODEL")])
def test_bad_mesh_text(text, err):
    with pytest.raises(ValueError, match=err):
        parse_mesh(text)


def test_bad_mesh_sizes():
    assert parse_mesh("4x2") == (4, 2)
    with pytest.raises(ValueError, match="cover the 1 devices"):
        make_mesh(2, 1)
    with pytest.raises(ValueError, match="mesh=.*must be a jax.sharding.Mesh"):
        specjax.generate(init_model(ModelConfig(vocab_size=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                                                d_ff=16, max_seq_len=16)), [[1]], max_new_tokens=2, mesh="4x2")


def test_token_trees_on_a_mesh():
    """Token trees on meshes 4x2, 2x4 and 8x1 (draft model, n-gram and MTP trees, a preset,
    both rules, dense and paged caches, the Pallas kernel per shard): the unsharded tokens and
    the state where the table puts it; a batch job with a tree and a tree under depth="auto" too.
    Each tree's per-row mask is split with the rows (``per_shard``); one tree forward's hidden
    equals the unsharded one's on meshes 2x4 and 8x1."""
    result = _worker("trees")
    _check(result)
    assert len(result["tokens"]) == 6 and len(result["state"]) == 4
    assert result["accepted"]["draft_model dynamic:4,2 4x2 per_sequence paged xla"] > 10  # paths were compacted
    assert result["accepted"]["ngram dynamic:4,2 2x4 cohort dense xla"] > 0
    assert set(result["forward"]) == {"2x4", "8x1"}
    assert max(result["forward"].values()) < 1e-4, result["forward"]  # one tree forward: the unsharded hidden
