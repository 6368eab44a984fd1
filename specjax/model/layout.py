"""A model's parameter layout: its layers as a list (``"unrolled"``) or as ``[L, ...]`` stacks
(``"scan"``), and every decoder block fused (``wqkv``, ``w_gate_up``) or separate (what
bundles and Hugging Face checkpoints store)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.model.config import ModelConfig
from specjax.model.layers import fuse_block, unfuse_block

__all__ = ["LAYER_LOOPS", "fuse_params", "layer_loop", "layer_params", "num_layers", "unfuse_params", "with_layer_loop"]

LAYER_LOOPS = ("unrolled", "scan")


def layer_loop(params: dict) -> str:
    """``"scan"`` when ``params["layers"]`` is stacked, ``"unrolled"`` when it is a list."""
    return "unrolled" if isinstance(params["layers"], list | tuple) else "scan"


def layer_params(params: dict, layer: int | jax.Array) -> dict:
    """Layer ``layer``'s params in either layout (a traced index into the stacks inside the scan)."""
    if layer_loop(params) == "unrolled":
        return params["layers"][layer]
    return jax.tree.map(lambda a: a[layer], params["layers"])


def num_layers(params: dict) -> int:
    if layer_loop(params) == "unrolled":
        return len(params["layers"])
    return jax.tree.leaves(params["layers"])[0].shape[0]


def with_layer_loop(model, loop: str):
    """``model`` with its layers laid out for ``loop`` (``LAYER_LOOPS``): ``"scan"`` stacks
    them (one ``lax.scan``: compile time flat in depth), ``"unrolled"`` splits them into a list
    (every layer compiled: on XLA:CPU the faster decode, README "Compile time vs depth"). Run
    once, outside any generate call: the conversion copies every layer's weights."""
    if loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop={loop!r} is invalid: must be one of {list(LAYER_LOOPS)}")
    p = model.params
    if layer_loop(p) == loop:
        return model
    n = num_layers(p)
    layers = [layer_params(p, i) for i in range(n)]
    return model.replace(params=dict(p, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
                                     if loop == "scan" else layers))


def _map_blocks(params: dict, fn, drafter_fn=None, mtp_fn=None) -> dict:
    """``fn`` over every decoder block's params; the block drafter's layers get ``drafter_fn``
    and the MTP block ``mtp_fn`` (default ``fn``: they may be shaped apart,
    ``ModelConfig.block_config``, ``mtp_config``)."""
    out = dict(params)
    out["layers"] = [fn(layer_params(params, i)) for i in range(num_layers(params))]
    if "mtp" in params:
        out["mtp"] = dict(params["mtp"], block=(mtp_fn or fn)(params["mtp"]["block"]))
    if "block" in params:  # a block drafter's layers
        out["block"] = dict(params["block"], layers=[(drafter_fn or fn)(p) for p in params["block"]["layers"]])
    return out


def fuse_params(params: dict) -> dict:
    """Separate ``wq, wk, wv (bq, bk, bv), w_gate, w_up`` -> the fused ``wqkv (bqkv), w_gate_up``
    (a list of layers: the unrolled layout)."""
    return _map_blocks(params, fuse_block)


def unfuse_params(params: dict, config: ModelConfig) -> dict:
    """The inverse of ``fuse_params`` (what bundles and HF checkpoints store), from either layout."""
    return _map_blocks(params, lambda p: unfuse_block(p, config), lambda p: unfuse_block(p, config.block_config),
                       lambda p: unfuse_block(p, config.mtp_config))
