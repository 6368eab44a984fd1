"""The speculative decoding engine, one job per module, every import pointing down:

* ``config``: ``EngineConfig`` (static: what a compile depends on), cache sizes, ``make_engine``;
* ``controller``: ``StepController``, the interface a loop calls to pick each step's window
  (``depth="auto"`` implements it in ``specjax.auto``; a fixed depth has none);
* ``state``: ``EngineState`` (per-row arrays) and its one constructor; what comes back to the host;
* ``prefill``: prompts into empty caches (whole, or in chunks from each row's own length),
  each row's first token;
* ``step``: one step at one window: draft -> verify -> commit;
* ``loop``: steps in ``lax.while_loop`` (window dispatch under a controller), ``step``, the
  whole-generation loop.

``generate`` (``specjax.generation``), ``stream`` and ``batch_generate`` wire requests to it.
"""

from specjax.engine.config import PAGE_SIZE, EngineConfig, make_engine, prompt_bucket, request_capacity
from specjax.engine.controller import StepController
from specjax.engine.loop import decode_step, generate_loop, run_steps, step, step_and_chunk
from specjax.engine.prefill import (
    Chunk,
    chunk_commit,
    chunk_window,
    fresh_prefill,
    pending_rows,
    prefill,
    prefill_chunk,
    prefill_rows,
)
from specjax.engine.state import EngineState, check_status, fetch, new_state, row_status
from specjax.engine.step import StepVerdicts, step_window, step_with_chunk

__all__ = [
    "PAGE_SIZE", "Chunk", "EngineConfig", "EngineState", "StepController", "StepVerdicts", "check_status",
    "chunk_commit", "chunk_window", "decode_step", "fetch", "fresh_prefill", "generate_loop", "make_engine",
    "new_state", "pending_rows", "prefill", "prefill_chunk", "prefill_rows", "prompt_bucket", "request_capacity",
    "row_status", "run_steps", "step", "step_and_chunk", "step_window", "step_with_chunk",
]
