"""Sizing before running: per-device bytes of a generation on a ``(data, model)`` mesh.

Every figure comes from abstract shapes (``jax.eval_shape``: nothing is allocated, so a
Llama-3-8B-shaped config sizes on a laptop) placed by ``specjax.sharding``'s table:

* ``params``: the weights laid out for the model axis (KV heads replicated where they must be);
* ``kv_cache``: the target's caches; ``drafter``: the drafter's state (the MTP block's cache,
  a draft model's caches); ``rows``: every other per-row array (tokens, trace, counters);
* ``step_activation``: the largest single tensor one decode step makes (float32 logits over
  the window, the MLP's input matmul, one attention score block); ``prefill_activation``:
  the same over the prompt (the prefill's logits are one position per row).

``check_compiled`` compares the first four with what XLA's own ``memory_analysis()`` reports
for the compiled decode step (tested on eight CPU devices).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np

from specjax.cache.base import XLA_SINGLE_PASS, key_block
from specjax.generation_config import DEFAULT_DEPTH
from specjax.model import Model, ModelConfig, init_model
from specjax.model.shapes import SHAPES
from specjax.sharding import DATA, MODEL, param_specs, placed_shapes, sharded_config, sharded_layout, state_specs

__all__ = ["PRESETS", "MemoryPlan", "check_compiled", "default_sizing_depth", "memory_plan", "resolve_config",
           "with_block_drafter"]

PRESETS = SHAPES  # named shapes of public checkpoints (specjax.model.shapes: sizing and the at-scale bench)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes (the largest device's: a replicated array counts whole on each)."""

    params: int
    kv_cache: int
    drafter: int
    rows: int
    step_activation: int
    prefill_activation: int
    mesh: tuple[int, int]
    batch: int
    context: int
    capacity: int
    kv_heads: int  # after replication for the model axis

    @property
    def total(self) -> int:
        """Resident state plus the larger of the two activation peaks (a lower bound on the peak)."""
        return self.params + self.kv_cache + self.drafter + self.rows + max(self.step_activation,
                                                                            self.prefill_activation)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


def _mesh_like(data: int, model: int):
    """What the table reads of a mesh (its axis sizes): sizing needs no devices."""
    return types.SimpleNamespace(shape={DATA: data, MODEL: model})


def _per_device(tree, specs, mesh) -> int:
    """Bytes of ``tree``'s leaves on one device under ``specs``."""
    leaves = jax.tree.leaves(tree)
    flat = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
    total = 0
    for x, spec in zip(leaves, flat, strict=True):
        split = int(np.prod([mesh.shape[a] for a in spec if a is not None], dtype=np.int64)) if len(spec) else 1
        total += int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize // split
    return total


def resolve_config(name: str) -> ModelConfig:
    """A preset name (``PRESETS``), a specjax bundle directory, or a Hugging Face checkpoint
    directory (or its ``config.json``); ``ValueError`` naming what is allowed otherwise."""
    if name in PRESETS:
        return PRESETS[name]
    path = pathlib.Path(name)
    if path.name == "config.json":
        path = path.parent
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"--config {name!r} is invalid: a preset ({', '.join(PRESETS)}), a specjax bundle or a "
                         "Hugging Face checkpoint directory")
    raw = json.loads(cfg_file.read_text())
    if raw.get("format") == "specjax-bundle":
        return ModelConfig(**raw["target"])
    from specjax.hf import read_config

    return read_config(path)[0]


def with_block_drafter(config: ModelConfig, block: int = 16, layers: int = 1) -> ModelConfig:
    """``config`` carrying a block drafter of ``block`` positions and ``layers`` layers shaped like
    its own, tapping DFlash's default target layers: what sizing and ``specjax compile`` use for
    ``drafter="block"`` on a shape that has none (a checkpoint's own drafter is kept)."""
    from specjax.drafter_checkpoints.dflash import default_target_layers

    if config.block_size:
        return config
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"block={block!r} is invalid: an int >= 2 (the last token and at least one draft)")
    if not isinstance(layers, int) or not 1 <= layers <= config.n_layers:
        raise ValueError(f"block_layers={layers!r} is invalid: an int in [1, {config.n_layers}] (the target's "
                         "layers)")
    return dataclasses.replace(config, block_size=block, block_layers=layers, block_mask_id=config.vocab_size - 1,
                               block_taps=tuple(sorted(set(default_target_layers(config.n_layers, layers)))))


def default_sizing_depth(config: ModelConfig, drafter: str | None) -> int:
    """Drafts per step when none is given, as generation picks them (``validate.default_depth``,
    on a config): a block drafter's whole block, else ``DEFAULT_DEPTH``."""
    return config.block_size - 1 if drafter == "block" and config.block_size else DEFAULT_DEPTH


def abstract_state(cfg: ModelConfig, data: int, model: int, batch: int, prompt: int, new: int, depth: int,
                    drafter: str | None, cache: str, dtype, *, tree=None, attention_impl: str = "xla",
                    layer_loop: str | None = None):
    """``(engine, params, state)`` as shapes: the laid-out params and the state right after prefill
    (``layer_loop``: the layers unrolled or as one scan; ``None``: the model's own layout)."""
    from specjax.advance import KvAdvance
    from specjax.engine import fresh_prefill, make_engine, request_capacity
    from specjax.sampling import RowSampling

    if drafter != "mtp" and cfg.mtp_depth:  # an MTP module only weighs where it drafts
        cfg = dataclasses.replace(cfg, mtp_depth=0)
    if drafter != "block" and cfg.block_size:  # nor does a block drafter
        cfg = dataclasses.replace(cfg, block_size=0, block_layers=0, block_taps=(), block_overrides=())
    def laid_out():
        m = init_model(cfg, dtype=dtype)
        if layer_loop is not None:
            from specjax.model import with_layer_loop

            m = with_layer_loop(m, layer_loop)
        return sharded_layout(m.params, cfg, model)[0]

    laid = jax.eval_shape(laid_out)
    cfg2 = sharded_config(cfg, model)
    capacity = request_capacity(prompt, new, depth)
    eng = make_engine(Model(laid, cfg2), drafter=drafter, draft_model=None, depth=depth,
                      kv_advance_rule=KvAdvance.PER_SEQUENCE, cache=cache, capacity=capacity, pool_groups=data,
                      tree=tree, attention_impl=attention_impl)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    f32 = jax.ShapeDtypeStruct((batch,), jnp.float32)
    args = (i32(batch, prompt), i32(batch), i32(batch), i32(batch, 4), jax.ShapeDtypeStruct((batch,), jnp.uint32),
            RowSampling(f32, i32(batch), f32))
    params = {"target": laid}
    st = jax.eval_shape(lambda p, *a: fresh_prefill(eng, p, *a), params, *args)
    return eng, params, st


def memory_plan(config: ModelConfig, *, data: int = 1, model: int = 1, batch: int, context: int,
                prompt: int | None = None, depth: int | None = 3, drafter: str | None = "ngram", cache: str = "dense",
                dtype="bfloat16", block: int = 16, block_layers: int = 1) -> MemoryPlan:
    """Per-device bytes of generating ``batch`` rows of up to ``context`` tokens each (``prompt``
    of them the prompt: default half) on a ``data x model`` mesh. ``drafter="block"``: the
    model's block drafter, or ``with_block_drafter(config, block, block_layers)``'s; its
    ``depth`` defaults to the whole block."""
    if drafter == "block":
        config = with_block_drafter(config, block, block_layers)
    depth = default_sizing_depth(config, drafter) if depth is None else depth
    for name, v in (("data", data), ("model", model), ("batch", batch), ("context", context), ("depth", depth)):
        if not isinstance(v, int) or v < (0 if name == "depth" else 1):
            raise ValueError(f"{name}={v!r} is invalid: must be an int >= {0 if name == 'depth' else 1}")
    if drafter not in ("mtp", "ngram", "block", None):
        raise ValueError(f"drafter={drafter!r} is invalid: sizing covers 'mtp', 'ngram', 'block' or None (size a "
                         "draft model as its own config)")
    if drafter == "mtp" and config.mtp_depth < 1:
        raise ValueError("drafter='mtp' is invalid: the config has no MTP module (mtp_depth=0)")
    if batch % data:
        raise ValueError(f"batch={batch} is invalid: must divide by the mesh's data axis ({data})")
    prompt = context // 2 if prompt is None else prompt
    if not 1 <= prompt < context:
        raise ValueError(f"prompt={prompt} is invalid: must lie in [1, context={context})")
    dtype = jnp.dtype(dtype)
    mesh = _mesh_like(data, model)
    eng, params, st = abstract_state(config, data, model, batch, prompt, context - prompt, depth, drafter, cache,
                                      dtype)
    specs = state_specs(st, mesh)
    cfg2 = eng.target.config
    kv = _per_device(st.cache, specs.cache, mesh)
    drafter_b = _per_device(st.dstate, specs.dstate, mesh) if st.dstate is not None else 0
    rows = _per_device(st.replace(cache=None, dstate=None), specs.replace(cache=None, dstate=None), mesh)
    b, m = batch // data, model
    v = cfg2.vocab_size // m if cfg2.vocab_size % m == 0 else cfg2.vocab_size
    hq = cfg2.n_heads // m
    item = dtype.itemsize

    def peak(t: int, logit_rows: int) -> int:
        kb = key_block(eng.capacity) if eng.capacity > XLA_SINGLE_PASS else eng.capacity
        return max(b * logit_rows * v * 4,  # float32 logits
                   b * t * 2 * cfg2.d_ff // m * item,  # the MLP's gate|up
                   b * hq * t * kb * 4)  # one block of float32 attention scores
    return MemoryPlan(
        params=_per_device(params, param_specs(params, mesh), mesh), kv_cache=kv, drafter=drafter_b, rows=rows,
        step_activation=peak(eng.window, eng.window), prefill_activation=peak(prompt, 1), mesh=(data, model),
        batch=batch, context=context, capacity=eng.capacity, kv_heads=cfg2.n_kv_heads)


def check_compiled(config: ModelConfig, mesh, *, batch: int, context: int, depth: int = 3,
                   drafter: str | None = "ngram", cache: str = "dense", dtype="float32") -> dict:
    """The plan against XLA: compile one decode step (``specjax.engine.step``) on ``mesh`` for
    abstract inputs and read its ``memory_analysis()`` (per device). Returns both figures."""
    from specjax.engine import decode_step

    data, model = mesh.shape[DATA], mesh.shape[MODEL]
    plan = memory_plan(config, data=data, model=model, batch=batch, context=context, depth=depth, drafter=drafter,
                       cache=cache, dtype=dtype)
    eng, params, st = abstract_state(config, data, model, batch, context // 2, context - context // 2, depth,
                                      drafter, cache, jnp.dtype(dtype))
    eng = dataclasses.replace(eng, mesh=mesh)
    p_abs = placed_shapes(params, param_specs(params, mesh), mesh)
    s_abs = placed_shapes(st, state_specs(st, mesh), mesh)
    with jax.set_mesh(mesh):
        # keep_unused: all of the state counts
        step = jax.jit(lambda p, s: decode_step(eng, p, s), donate_argnums=1, keep_unused=True)
        compiled = step.lower(p_abs, s_abs).compile()
    ma = compiled.memory_analysis()
    return {"plan": plan.to_dict(), "xla_argument_bytes": int(ma.argument_size_in_bytes),
            "xla_temp_bytes": int(ma.temp_size_in_bytes),
            "plan_argument_bytes": plan.params + plan.kv_cache + plan.drafter + plan.rows}
