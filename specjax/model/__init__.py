"""The target/draft model: a Llama-family decoder with optional MTP."""

from specjax.model.config import ModelConfig
from specjax.model.llama import (
    Model,
    ModelCache,
    forward,
    forward_hidden,
    fuse_params,
    head,
    hidden_states,
    init_cache,
    init_model,
    logits,
    mtp_forward,
    mtp_hidden,
    unfuse_params,
)
from specjax.model.rope import RopeScaling

__all__ = [
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
    "logits",
    "mtp_forward",
    "mtp_hidden",
    "unfuse_params",
]
