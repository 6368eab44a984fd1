"""The target/draft model: a Llama-family decoder with optional MTP."""

from specjax.model.config import ModelConfig
from specjax.model.llama import (
    Model,
    ModelCache,
    forward,
    hidden_states,
    init_cache,
    init_model,
    logits,
    mtp_forward,
)

__all__ = [
    "Model",
    "ModelCache",
    "ModelConfig",
    "forward",
    "hidden_states",
    "init_cache",
    "init_model",
    "logits",
    "mtp_forward",
]
