"""The target/draft model: a Llama-family decoder with optional MTP."""

from specjax.model.config import ModelConfig
from specjax.model.llama import (
    LAYER_LOOPS,
    Model,
    ModelCache,
    forward,
    forward_hidden,
    fuse_params,
    head,
    hidden_states,
    init_cache,
    init_model,
    layer_loop,
    layer_params,
    logits,
    mtp_forward,
    mtp_hidden,
    mtp_logits,
    unfuse_params,
    with_draft_vocab,
    with_layer_loop,
)
from specjax.model.rope import RopeScaling

__all__ = [
    "LAYER_LOOPS",
    "Model",
    "ModelCache",
    "ModelConfig",
    "RopeScaling",
    "forward",
    "forward_hidden",
    "fuse_params",
    "head",
    "hidden_states",
    "init_cache",
    "init_model",
    "layer_loop",
    "layer_params",
    "logits",
    "mtp_forward",
    "mtp_hidden",
    "mtp_logits",
    "unfuse_params",
    "with_draft_vocab",
    "with_layer_loop",
]
