"""specjax: batched speculative decoding in JAX with per-sequence KV advance.

Data flows plan -> cache -> mask -> attention (-> model -> drafter -> verify -> engine).
"""

from specjax.advance import KvAdvance, kv_advance
from specjax.attention import reference_attention
from specjax.auto import CostTable, DepthPolicy
from specjax.batch import Completion, Request, batch_generate
from specjax.cache import (
    DenseKVCache,
    PagedKVCache,
    RollingKVCache,
    cache_supports_per_sequence_advance,
    front_align_batch,
    front_pad_kv_cache,
)
from specjax.checkpoint import Bundle, CheckpointError, load_model
from specjax.compile_cache import enable_compilation_cache
from specjax.generation import generate
from specjax.generation_config import GenerationConfig
from specjax.hf import generate_text, load_hf_checkpoint, load_tokenizer, save_hf_checkpoint
from specjax.latency import latency_summary
from specjax.masks import make_left_padded_causal_mask
from specjax.metrics import GenerationResult
from specjax.model import Model, ModelConfig, RopeScaling, init_model, logits
from specjax.nnx_adapter import KVLayout, nnx_model
from specjax.plan import (
    CohortStepPlan,
    PerSeqStepPlan,
    plan_cohort_step,
    plan_per_sequence_step,
    plan_step,
)
from specjax.protocols import Decoder, DraftContext, Drafter
from specjax.sharding import make_mesh, shard_model
from specjax.sim import Bernoulli, BetaRows, Matches, PositionDecay, Trace, simulate, simulate_alone
from specjax.streaming import StreamChunk, stream

__all__ = [
    "Bernoulli",
    "BetaRows",
    "Matches",
    "PositionDecay",
    "Trace",
    "enable_compilation_cache",
    "generate_text",
    "Bundle",
    "Completion",
    "Request",
    "batch_generate",
    "latency_summary",
    "CheckpointError",
    "StreamChunk",
    "load_hf_checkpoint",
    "load_model",
    "load_tokenizer",
    "save_hf_checkpoint",
    "RopeScaling",
    "stream",
    "CohortStepPlan",
    "Decoder",
    "DraftContext",
    "Drafter",
    "KVLayout",
    "DenseKVCache",
    "GenerationResult",
    "KvAdvance",
    "Model",
    "ModelConfig",
    "PagedKVCache",
    "PerSeqStepPlan",
    "RollingKVCache",
    "cache_supports_per_sequence_advance",
    "front_align_batch",
    "front_pad_kv_cache",
    "generate",
    "GenerationConfig",
    "CostTable",
    "DepthPolicy",
    "init_model",
    "kv_advance",
    "logits",
    "make_left_padded_causal_mask",
    "make_mesh",
    "nnx_model",
    "shard_model",
    "plan_cohort_step",
    "plan_per_sequence_step",
    "plan_step",
    "reference_attention",
    "simulate",
    "simulate_alone",
]
__version__ = "0.1.0"
