"""specjax: batched speculative decoding in JAX with per-sequence KV advance."""

from specjax.advance import KvAdvance, kv_advance
from specjax.plan import (
    CohortStepPlan,
    PerSeqStepPlan,
    plan_cohort_step,
    plan_per_sequence_step,
    plan_step,
)
from specjax.sim import simulate, simulate_alone

__all__ = [
    "CohortStepPlan",
    "KvAdvance",
    "PerSeqStepPlan",
    "kv_advance",
    "plan_cohort_step",
    "plan_per_sequence_step",
    "plan_step",
    "simulate",
    "simulate_alone",
]
__version__ = "0.1.0"
