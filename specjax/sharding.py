"""Many devices: a ``("data", "model")`` mesh, the one table saying where every array lives,
and the model layout tensor parallelism needs.

* ``"data"`` splits the batch: every per-row array of the engine state (tokens, lengths,
  caches, drafter state, seeds, sampling settings, counters) is split on its row axis.
* ``"model"`` splits the model Megatron-style: the fused ``wqkv`` and ``w_gate_up`` by columns
  (column-parallel), ``wo`` and ``w_down`` by rows (row-parallel: XLA inserts one all-reduce
  after attention and one after the MLP), the vocabulary of ``embed``/``lm_head``, and the
  KV heads of every cache.

Everything runs as one SPMD program: the engine's jitted loop takes arrays placed by this
table and XLA's partitioner (GSPMD) keeps them there; attention runs per shard under
``shard_map`` (``per_shard``), so the Pallas kernels see only their own rows and heads.

KV heads are split over ``"model"``; when ``n_kv_heads`` does not divide by the model axis
(``n_kv_heads < model``: Llama-3-8B's 8 KV heads on 16 devices), ``shard_model`` replicates
each KV head to ``lcm(n_kv_heads, model)`` heads. The model's output is unchanged (each query
head still reads a copy of its own KV head); the cost is ``lcm / n_kv_heads`` times the KV
cache bytes and the K/V projection FLOPs.

The paged pool is one pool per data shard: the engine splits it into ``data`` groups
(``PagedKVCache.split_pool``), each serving the rows of one data shard from its own pages and
free stack, so the pool's pages, free stacks and free counts are split over ``"data"`` (and
the pages' KV heads over ``"model"``). Each device holds ``1/data`` of the pages; block
tables hold page ids within the group, so a shard's allocation, writes and attention touch
only its own pages. A paged cache made with one pool (``num_free`` a scalar) is replicated
over ``"data"`` instead (``ONE_POOL_RULES``): correct on any mesh, ``data`` times the bytes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from specjax.model.config import ModelConfig

__all__ = [
    "DATA", "MODEL", "ONE_POOL_RULES", "PARAM_RULES", "STATE_RULES", "agree_max", "constrain", "data_shards",
    "local_rows", "make_mesh", "parse_mesh", "param_specs", "per_shard", "place", "placed_shapes", "put_rows",
    "shard_model", "sharded_config", "sharded_layout", "shardings", "spec_mismatches", "state_specs",
]

DATA, MODEL = "data", "model"

# ----------------------------------------------------------------------------- the table

# A parameter's spec by its name (the last key of its path; a stacked layer's leading [L]
# axis is never split). Every parameter must match one rule.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"embed", P(MODEL, None)),  # [V, d]: vocabulary rows (the lookup and the tied head)
    (r"lm_head", P(None, MODEL)),  # [d, V]: vocabulary columns (logits split over the vocabulary)
    (r"wqkv", P(None, MODEL)),  # [d, G * (q_g + k_g + v_g)]: column-parallel, one group per device
    (r"bqkv", P(MODEL)),
    (r"w[qkv]|w_gate|w_up", P(None, MODEL)),  # the separate tensors checkpoints store (read straight into
    (r"b[qkv]", P(MODEL)),  # these shardings, then fused on device: ``load_model(mesh=)``)
    (r"wo", P(MODEL, None)),  # [Hq * hd, d]: row-parallel (all-reduce after attention)
    (r"w_gate_up", P(None, MODEL)),  # [d, G * (gate_g + up_g)]: column-parallel
    (r"w_down", P(MODEL, None)),  # [d_ff, d]: row-parallel (all-reduce after the MLP)
    (r"proj", P()),  # MTP [2d, d]: small, replicated
    (r"fc", P()),  # a block drafter's [n_taps * d, d]: small, replicated
    (r"draft_ids|draft_head", P()),  # an MTP draft vocabulary: ids [N], head [d, N] (a fraction of the head)
    (r".*norm.*", P()),  # every norm weight
)

KV_ROWS = P(DATA, MODEL, None, None)  # a per-row KV buffer, one layer: [B, Hkv, slots, D]
# An engine-state leaf's spec by (the class holding it, its field). Unlisted fields are
# per-row ``[B, ...]`` arrays: split on the row axis over "data" (the rule that covers tokens,
# lengths, seeds, sampling settings, counters, the MTP hidden and every cache's lengths).
STATE_RULES: dict[tuple[str, str], P] = {
    ("DenseKVCache", "k"): KV_ROWS, ("DenseKVCache", "v"): KV_ROWS,
    ("RollingKVCache", "k"): KV_ROWS, ("RollingKVCache", "v"): KV_ROWS,
    ("CompressedKVCache", "k"): KV_ROWS, ("CompressedKVCache", "v"): KV_ROWS,
    ("CompressedKVCache", "mem_k"): KV_ROWS, ("CompressedKVCache", "mem_v"): KV_ROWS,
    ("PagedKVCache", "k"): P(DATA, MODEL, None, None),  # the pool [G * pages, Hkv, page, D]: group g's on shard g
    ("PagedKVCache", "v"): P(DATA, MODEL, None, None),
    ("PagedKVCache", "free_pages"): P(DATA),  # [G * pages]: each group's free stack on its shard
    ("PagedKVCache", "num_free"): P(DATA),  # [G]
    ("PagedKVCache", "refs"): P(DATA),  # [G * pages]: each group's page counts on its shard
    ("PagedKVCache", "cached"): P(DATA),
    ("MtpState", "prefix"): P(DATA, MODEL, None, None),  # the MTP block's store of cached pages: as the pool
    ("EngineState", "i"): P(),  # the step counter
    ("EngineState", "auto"): P(),  # depth="auto"'s cost table and window counts
}
ROWS = P(DATA)
# A paged cache with one pool for all rows (``num_free`` a scalar: not ``split_pool``-ed):
# global page ids, so the pool is replicated over "data" (split over "model" by heads).
ONE_POOL_RULES: dict[str, P] = {"k": P(None, MODEL, None, None), "v": P(None, MODEL, None, None),
                                "free_pages": P(), "num_free": P(), "refs": P(), "cached": P()}


def make_mesh(data: int | None = None, model: int = 1, *, devices: list | None = None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (default: all of them). ``data`` defaults to
    the devices left after ``model``. The model axis takes neighbouring devices (on TPU/GPU the
    fastest links carry its all-reduces)."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(model, int) or model < 1:
        raise ValueError(f"model={model!r} must be an int >= 1")
    if data is None:
        data = len(devices) // model
    if not isinstance(data, int) or data < 1 or data * model != len(devices):
        raise ValueError(f"mesh data={data!r} x model={model} must cover the {len(devices)} devices exactly")
    return Mesh(np.asarray(devices, dtype=object).reshape(data, model), (DATA, MODEL))


def data_shards(mesh: Mesh | None) -> int:
    """The size of ``mesh``'s data axis (how many ways the rows split); 1 without a mesh."""
    return 1 if mesh is None else mesh.shape[DATA]


def parse_mesh(text: str) -> tuple[int, int]:
    """``"4x2"`` -> ``(data=4, model=2)``."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m or min(int(m[1]), int(m[2])) < 1:
        raise ValueError(f"mesh {text!r} must be DATAxMODEL with both >= 1, e.g. 4x2")
    return int(m[1]), int(m[2])


def _fit(spec: P, shape: tuple, mesh: Mesh) -> P:
    """``spec`` for an array of ``shape``: a stacked leading ``[L]`` axis (the one ``spec``
    lacks) kept whole, and any axis that does not divide by its mesh axis replicated."""
    parts = list(spec)
    parts = [None] * (len(shape) - len(parts)) + parts if len(shape) > len(parts) else parts[: len(shape)]
    return P(*[a if a is None or shape[i] % mesh.shape[a] == 0 else None for i, a in enumerate(parts)])


def _param_rule(name: str) -> P:
    for pattern, spec in PARAM_RULES:
        if re.fullmatch(pattern, name):
            return spec
    raise KeyError(f"parameter {name!r} matches no rule in specjax.sharding.PARAM_RULES")


def param_specs(params: dict, mesh: Mesh) -> Any:
    """The ``PartitionSpec`` of every parameter (a pytree like ``params``)."""
    def spec(path, x):
        return _fit(_param_rule(str(path[-1].key)), np.shape(x), mesh)
    return jax.tree_util.tree_map_with_path(spec, params)


def state_specs(tree: Any, mesh: Mesh) -> Any:
    """The ``PartitionSpec`` of every leaf of an engine state, a cache or a drafter state."""
    def walk(x, rule: P | None):
        if x is None:
            return None
        fields = getattr(type(x), "__dataclass_fields__", None)
        if fields is not None and rule is None and hasattr(x, "replace"):  # a registered state class
            kids = {f: walk(getattr(x, f), _state_rule(x, f, mesh))
                    for f, fd in fields.items() if not fd.metadata.get("static", False)}
            return x.replace(**kids)
        if isinstance(x, tuple | list):
            return type(x)(walk(v, rule) for v in x)
        if isinstance(x, dict):
            return {k: walk(v, rule) for k, v in x.items()}
        if fields is not None:  # a rule covering a whole sub-state (EngineState.auto)
            return jax.tree.map(lambda leaf: _fit(rule, np.shape(leaf), mesh), x)
        shape = np.shape(x)
        if rule is None and shape:  # a per-row array [B, ...]: its first axis over "data"
            rule = P(*ROWS, *[None] * (len(shape) - 1))
        return _fit(rule or P(), shape, mesh)
    return walk(tree, None)


def _state_rule(x: Any, field: str, mesh: Mesh) -> P | None:
    """The table's rule for ``field`` of the state class ``x`` (a paged cache's pool by its groups)."""
    name = type(x).__name__
    if name == "PagedKVCache" and field in ONE_POOL_RULES:
        if np.ndim(x.num_free) == 0:
            return ONE_POOL_RULES[field]
        if x.groups != mesh.shape[DATA]:
            raise ValueError(f"a paged cache split into {x.groups} pools cannot run on a mesh with "
                             f"data={mesh.shape[DATA]}: make it with split_pool({mesh.shape[DATA]}) (one per shard)")
    return STATE_RULES.get((name, field))


def shardings(specs: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def placed_shapes(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """``tree``'s shapes and dtypes carrying the shardings of ``specs`` (``jax.ShapeDtypeStruct``:
    what ``lower`` and orbax's ``restore`` take to place their results)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings(specs, mesh))


def constrain(tree: Any, mesh: Mesh | None) -> Any:
    """Inside a jitted function: pin ``tree`` (an engine state) to the table's shardings."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, shardings(state_specs(tree, mesh), mesh))


def spec_mismatches(tree: Any, specs: Any, mesh: Mesh) -> list[str]:
    """Leaves of ``tree`` whose actual sharding differs from ``specs`` (paths; empty: all agree)."""
    out = []
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, x), spec in zip(flat, flat_specs, strict=True):
        want = NamedSharding(mesh, spec)
        if not x.sharding.is_equivalent_to(want, x.ndim):
            out.append(f"{jax.tree_util.keystr(path)}: {getattr(x.sharding, 'spec', x.sharding)}"
                       f" != {spec}")
    return out


# ----------------------------------------------------------------------------- per-shard attention


def per_shard(fn, cache: Any, q: jax.Array, layer: int | jax.Array = 0, tree: Any = None) -> jax.Array:
    """``fn(cache, q, layer, tree)`` (attention of ``q [B, t, Hq, D]`` over ``cache``; ``tree``: a
    ``TreeMask`` or ``None``) on each device's own rows and heads under ``shard_map`` when a
    multi-device mesh is set (``jax.set_mesh``: the engine sets it), else directly. Attention
    never mixes rows or heads, so each shard's result is its block of the whole; the Pallas
    kernels run unchanged on their shard, and a tree's per-row mask is split with the rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or set(mesh.axis_names) != {DATA, MODEL}:
        return fn(cache, q, layer, tree)
    q_spec = _fit(P(DATA, None, MODEL, None), q.shape, mesh)
    rows = lambda x: _fit(P(DATA, *[None] * (x.ndim - 1)), x.shape, mesh)  # noqa: E731
    args, specs = [cache, q], [state_specs(cache, mesh), q_spec]
    if tree is not None:  # a per-row mask, split as the rows are
        args.append(tree)
        specs.append(jax.tree.map(rows, tree))
    if not isinstance(layer, int):  # a traced layer index: every shard gets it
        args.append(layer)
        specs.append(P())

    def body(c, x, *rest):
        t = rest[0] if tree is not None else None
        return fn(c, x, rest[-1] if not isinstance(layer, int) else layer, t)

    return jax.shard_map(body, in_specs=tuple(specs), out_specs=q_spec, check_vma=False)(*args)


# ----------------------------------------------------------------------------- the model's layout


def _kv_heads(cfg: ModelConfig, model: int) -> int:
    """KV heads after replication for a ``model``-way split: ``n_kv_heads`` when it divides,
    else ``lcm(n_kv_heads, model)`` (each head copied), which must divide ``n_heads``."""
    h = cfg.n_kv_heads
    if h % model == 0:
        return h
    rep = math.lcm(h, model)
    if cfg.n_heads % rep:
        raise ValueError(f"model={model} cannot split n_heads={cfg.n_heads} with n_kv_heads={h} "
                         f"(the KV heads replicate to {rep}, which must divide n_heads)")
    return rep


def sharded_layout(params: dict, cfg: ModelConfig, model: int) -> tuple[dict, ModelConfig]:
    """``params`` (host NumPy or device arrays, the plain ``[q | k | v]`` layout) laid out for a
    ``model``-way split: KV heads replicated where needed (``_kv_heads``), the fused matrices'
    columns grouped per device (``ModelConfig.shard_groups``). Either layer layout."""
    cfg2 = sharded_config(cfg, model)
    if model == 1:
        return params, cfg
    if cfg.block_overrides and "block" in params:
        raise ValueError("a block drafter whose layers are shaped apart from the target's (block_overrides: a loaded "
                         "DFlash drafter) cannot be split over a mesh yet; load it without a mesh")
    hd, hq, hkv, hkv2 = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg2.n_kv_heads
    rep = np.arange(hkv2) * hkv // hkv2  # new KV head j copies head rep[j]: query head h still reads its own
    xp = jnp if any(isinstance(x, jax.Array) for x in jax.tree.leaves(params)) else np

    def kv(x):
        x = x.reshape(*x.shape[:-1], hkv, hd)[..., rep, :]
        return x.reshape(*x.shape[:-2], hkv2 * hd)

    def groups(*parts):
        return xp.concatenate([x.reshape(*x.shape[:-1], model, -1) for x in parts], axis=-1).reshape(
            *parts[0].shape[:-1], -1)

    def block(p: dict) -> dict:
        p = dict(p)
        for name in ("wqkv", "bqkv"):
            if name in p:
                x = p[name]
                q, k, v = x[..., : hq * hd], x[..., hq * hd : (hq + hkv) * hd], x[..., (hq + hkv) * hd :]
                p[name] = groups(q, kv(k), kv(v))
        f = cfg.d_ff
        p["w_gate_up"] = groups(p["w_gate_up"][..., :f], p["w_gate_up"][..., f:])
        return p

    out = dict(params)
    out["layers"] = [block(b) for b in params["layers"]] if isinstance(params["layers"], list | tuple) else block(
        params["layers"])
    if "mtp" in params:
        out["mtp"] = dict(params["mtp"], block=block(params["mtp"]["block"]))
    if "block" in params:  # a block drafter's layers, split as the target's
        out["block"] = dict(params["block"], layers=[block(b) for b in params["block"]["layers"]])
    return out, cfg2


def sharded_config(cfg: ModelConfig, model: int) -> ModelConfig:
    """``cfg`` laid out for a ``model``-way split (``sharded_layout``'s config)."""
    if cfg.shard_groups != 1:
        raise ValueError(f"the model is already laid out for shard_groups={cfg.shard_groups}: shard the original")
    if model == 1:
        return cfg
    if cfg.n_heads % model or cfg.d_ff % model:
        raise ValueError(f"model={model} must divide n_heads={cfg.n_heads} and d_ff={cfg.d_ff}")
    return dataclasses.replace(cfg, n_kv_heads=_kv_heads(cfg, model), shard_groups=model)


def place(params: dict, mesh: Mesh) -> dict:
    """Every parameter onto ``mesh`` by the table: a host (NumPy) array goes shard by shard
    (each device receives its slice; nothing is gathered on one device), a device array is
    resharded. With many processes every process passes the same host arrays."""
    specs = param_specs(params, mesh)

    def put(x, spec):
        sharding = NamedSharding(mesh, spec)
        if isinstance(x, jax.Array) or jax.process_count() == 1:
            return jax.device_put(x, sharding)
        x = np.asarray(x)  # many processes: each builds only its own devices' slices
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    return jax.tree.map(put, params, specs, is_leaf=lambda s: isinstance(s, P))


def is_sharded_for(model: Any, mesh: Mesh) -> bool:
    """Is ``model`` laid out and placed for ``mesh`` (``shard_model``'s output, split or replicated)?"""
    leaf = jax.tree.leaves(model.params)[0]
    if not (isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh):
        return False
    return model.config.shard_groups == mesh.shape[MODEL] or (
        model.config.shard_groups == 1 and all(x.sharding.is_fully_replicated for x in jax.tree.leaves(model.params)))


def shard_model(model: Any, mesh: Mesh, *, replicate: bool = False) -> Any:
    """``model`` laid out for ``mesh``'s model axis and placed by the table (a no-op when it
    already is). The result decodes exactly as ``model`` does (the same tokens); save the
    original, not this (its config records the sharded layout). ``replicate``: when the model
    axis cannot split the model (its heads or MLP width), put a whole copy on every device
    instead of raising (what the engine does for a small draft model)."""
    if not hasattr(getattr(model, "config", None), "shard_groups"):  # specjax's ModelConfig (the model imports us)
        raise ValueError(f"model={type(model).__name__} is invalid with mesh=: the sharding table lays out specjax's "
                         "Llama (specjax.model.Model); run other models on one device")
    if is_sharded_for(model, mesh):
        return model
    try:
        params, cfg = sharded_layout(model.params, model.config, mesh.shape[MODEL])
    except ValueError as e:
        if model.config.shard_groups != 1:
            raise
        if not replicate:
            raise ValueError(f"{e}: pass shard_model(..., replicate=True) to put a whole copy of the model on every "
                             "device instead (what the engine does for a small draft model)") from None
        whole = NamedSharding(mesh, P())
        return model.replace(params=jax.tree.map(lambda x: jax.device_put(x, whole), model.params))
    return model.replace(params=place(params, mesh), config=cfg)


# ----------------------------------------------------------------------------- rows in, rows out


def put_rows(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows ``x [b, ...]`` (host) as its part of one global array split over
    ``"data"`` (``[b * processes, ...]``: every process passes the same count)."""
    sharding = NamedSharding(mesh, state_specs(x, mesh))
    if jax.process_count() == 1:
        return jax.device_put(np.asarray(x), sharding)  # each device receives its slice of the host array
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def agree_max(values: list[int]) -> list[int]:
    """The elementwise max of ``values`` over every process (host-side; one collective)."""
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(np.asarray(values, np.int64))
    return [int(v) for v in np.max(np.reshape(got, (-1, len(values))), axis=0)]


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a row-split array, on the host (in row order); the whole array
    with one process. A replicated array comes back whole."""
    if jax.process_count() == 1 or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
    seen, parts = set(), []
    for s in shards:
        start = s.index[0].start or 0
        if start not in seen:  # one copy of each row block (model-axis replicas hold the same rows)
            seen.add(start)
            parts.append(np.asarray(s.data))
    return np.concatenate(parts, axis=0)
