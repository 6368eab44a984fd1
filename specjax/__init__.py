"""specjax: batched speculative decoding in JAX with per-sequence KV advance.

Data flows plan -> cache -> mask -> attention (-> model -> drafter -> verify -> engine).

The public names load on first use (``specjax.generate`` imports ``specjax.generation`` and
JAX then), so ``import specjax`` and the CLI start at once and take Ctrl-C cleanly from
their first moment. ``generate``, ``stream`` and ``batch_generate`` turn on the persistent
compilation cache (``specjax.compile_cache``) before their first compile.
"""

from __future__ import annotations

import importlib
from typing import Any

# where each public name lives
_EXPORTS: dict[str, tuple[str, ...]] = {
    "specjax.advance": ("KvAdvance", "kv_advance"),
    "specjax.attention": ("reference_attention",),
    "specjax.auto": ("CostTable", "DepthPolicy"),
    "specjax.batch": ("Completion", "Request", "batch_generate"),
    "specjax.cache": (
        "DenseKVCache", "PagedKVCache", "RollingKVCache", "cache_supports_per_sequence_advance", "front_align_batch",
        "front_pad_kv_cache"
    ),
    "specjax.checkpoint": ("Bundle", "CheckpointError", "load_model"),
    "specjax.compile_cache": ("enable_compilation_cache",),
    "specjax.drafter_checkpoints": ("load_drafter", "save_drafter"),
    "specjax.generation": ("generate",),
    "specjax.generation_config": ("GenerationConfig",),
    "specjax.hf": ("generate_text", "load_hf_checkpoint", "load_tokenizer", "save_hf_checkpoint"),
    "specjax.latency": ("latency_summary",),
    "specjax.masks": ("make_left_padded_causal_mask",),
    "specjax.metrics": ("GenerationResult",),
    "specjax.model": ("Model", "ModelConfig", "RopeScaling", "init_model", "logits"),
    "specjax.nnx_adapter": ("KVLayout", "nnx_model"),
    "specjax.plan": ("CohortStepPlan", "PerSeqStepPlan", "plan_cohort_step", "plan_per_sequence_step", "plan_step"),
    "specjax.protocols": ("Decoder", "DraftContext", "Drafter"),
    "specjax.sharding": ("make_mesh", "shard_model"),
    "specjax.sim": ("Bernoulli", "BetaRows", "Matches", "PositionDecay", "Trace", "simulate", "simulate_alone"),
    "specjax.streaming": ("StreamChunk", "stream"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; a submodule (``specjax.engine``)."""
    module = _WHERE.get(name)
    if module is None:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

